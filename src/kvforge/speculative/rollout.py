"""Rollouts: G samples per prompt, decoded together, plain or with a drafter.

The G samples of one prompt form one batch (an RL group). With the n-gram drafter they share one
per-prompt `NgramCache`, seeded with the prompt: every token a sample commits is indexed at once,
so its siblings draft from it. With a `RolloutHistory` the cache is the prompt's history, kept
across calls: the group drafts from earlier groups' rollouts of the same prompt too (sample i
from the last group's sample i first, then its siblings: `previous.py`), and adds its own. `none`
is plain decoding (`Engine.generate`), the reference; its rollouts are recorded in the history
too, so a plain epoch leaves drafts for the next.
"""

from __future__ import annotations

from kvforge.generation import Generation, GenerationConfig
from kvforge.speculative.decode import speculative_generate
from kvforge.speculative.history import RolloutHistory
from kvforge.speculative.prefetch import Prefetcher
from kvforge.speculative.step import DRAFTS, DraftConfig, SpecStats, new_drafters

__all__ = ["DRAFTS", "DraftConfig", "generate_group"]


def generate_group(
    engine, prompt: list[int], samples: int, config: GenerationConfig, draft: DraftConfig, on_text=None, plan=None,
    history: RolloutHistory | None = None, rollout_key: str | None = None,
) -> tuple[list[Generation], SpecStats | None]:
    """`samples` completions of one prompt in one batch (`plan`: a prefill plan, one sample).
    `history`: with the n-gram drafter, the prompt's cache and previous rollouts come from it
    (under `rollout_key`, else the prompt's tokens); every arm records its samples there and
    settles it (written to disk, the bound enforced) when the group finishes."""
    prompts = [list(prompt) for _ in range(samples)]
    if draft.draft == "none":
        outputs, stats = engine.generate(prompts, config, on_text, plan), None
    else:
        use_history = history is not None and draft.draft == "ngram"
        kept, previous = (history.get(prompt, rollout_key), history.previous(prompt, rollout_key)) if use_history else (None, None)
        drafters, shared = new_drafters(draft, prompt, samples, kept, previous)
        prefetcher = Prefetcher(draft.k, draft.budget) if draft.prefetch else None
        try:
            gate = draft.new_gate(engine, group=True)  # the call returns when its last sample is done
            caches = [shared] * samples if shared is not None else None
            outputs, stats = speculative_generate(engine, prompts, drafters, config, draft.k, prefetcher, caches, on_text, plan, gate, draft.k_for)
        finally:
            if prefetcher is not None:
                prefetcher.close()
    if history is not None:
        cache = history.get(prompt, rollout_key)
        for index, g in enumerate(outputs):
            if draft.draft != "ngram":  # a drafting group indexed its tokens as it went
                cache.add(g.token_ids, prompt)
            history.record(prompt, index, list(g.token_ids), rollout_key)
        history.settle(prompt, rollout_key)
    return outputs, stats

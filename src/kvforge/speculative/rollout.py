"""Rollouts: G samples per prompt, decoded together, plain or with a drafter.

The G samples of one prompt form one batch (an RL group). With the n-gram drafter they share one
per-prompt `NgramCache`, seeded with the prompt: every token a sample commits is indexed at once,
so its siblings draft from it. With a `RolloutHistory` the cache is the prompt's history, kept
across calls: the group drafts from earlier groups' rollouts of the same prompt too, and adds its
own. `none` is plain decoding (`Engine.generate`), the reference.
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
    history: RolloutHistory | None = None,
) -> tuple[list[Generation], SpecStats | None]:
    """`samples` completions of one prompt in one batch (`plan`: a prefill plan, one sample).
    `history`: with the n-gram drafter, the prompt's cache comes from it and is settled back
    (written to disk, the bound enforced) when the group finishes."""
    prompts = [list(prompt) for _ in range(samples)]
    if draft.draft == "none":
        return engine.generate(prompts, config, on_text, plan), None
    use_history = history is not None and draft.draft == "ngram"
    drafters, shared = new_drafters(draft, prompt, samples, history.get(prompt) if use_history else None)
    prefetcher = Prefetcher(draft.k, draft.budget) if draft.prefetch else None
    try:
        gate = draft.new_gate(engine)
        caches = [shared] * samples if shared is not None else None
        outputs, stats = speculative_generate(engine, prompts, drafters, config, draft.k, prefetcher, caches, on_text, plan, gate, draft.k_for)
    finally:
        if use_history:
            history.settle(prompt)
        if prefetcher is not None:
            prefetcher.close()
    return outputs, stats

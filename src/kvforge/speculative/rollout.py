"""Rollouts: G samples per prompt, decoded together, plain or with a drafter.

The G samples of one prompt form one batch (an RL group). With the n-gram drafter they share one
per-prompt `NgramCache`, seeded with the prompt: every token a sample commits is indexed at once,
so its siblings draft from it. `none` is plain decoding (`Engine.generate`), the reference.
"""

from __future__ import annotations

from kvforge.generation import Generation, GenerationConfig
from kvforge.speculative.decode import speculative_generate
from kvforge.speculative.prefetch import Prefetcher
from kvforge.speculative.step import DRAFTS, DraftConfig, DraftGate, SpecStats, new_drafters

__all__ = ["DRAFTS", "DraftConfig", "generate_group"]


def generate_group(
    engine, prompt: list[int], samples: int, config: GenerationConfig, draft: DraftConfig, on_text=None, plan=None
) -> tuple[list[Generation], SpecStats | None]:
    """`samples` completions of one prompt in one batch (`plan`: a prefill plan, one sample)."""
    prompts = [list(prompt) for _ in range(samples)]
    if draft.draft == "none":
        return engine.generate(prompts, config, on_text, plan), None
    drafters, shared = new_drafters(draft, prompt, samples)
    prefetcher = Prefetcher(draft.k, draft.budget) if draft.prefetch else None
    try:
        gate = DraftGate() if draft.gate else None
        caches = [shared] * samples if shared is not None else None
        outputs, stats = speculative_generate(engine, prompts, drafters, config, draft.k, prefetcher, caches, on_text, plan, gate)
    finally:
        if prefetcher is not None:
            prefetcher.close()
    return outputs, stats

"""Rollouts: G samples per prompt, decoded together, plain or with a drafter.

The G samples of one prompt form one batch (an RL group). With the n-gram drafter they share one
per-prompt `NgramCache`, seeded with the prompt: every token a sample commits is indexed at once,
so its siblings draft from it. `none` is plain decoding (`Engine.generate`), the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.generation import Generation, GenerationConfig
from kvforge.speculative.decode import DraftGate, SpecStats, speculative_generate
from kvforge.speculative.ngram import NgramCache, NgramDrafter, PromptLookupDrafter
from kvforge.speculative.prefetch import Prefetcher

DRAFTS = ("none", "prompt-lookup", "ngram")


@dataclass(frozen=True)
class DraftConfig:
    draft: str = "ngram"
    # 8 draft tokens: on a CPU, verifying 2..9 tokens costs about the same (1.6-1.9x one token)
    k: int = 8
    prefetch: bool = False
    budget: int = 16
    # a match of at least 2 tokens: a unigram match drafts too often and wastes a verification
    n_min: int = 2
    n_max: int = 4
    # stop drafting for a request while it accepts < 1 token per drafted step (retry every 8)
    gate: bool = True

    def __post_init__(self):
        if self.draft not in DRAFTS:
            raise ValueError(f"unknown draft {self.draft!r}: use {', '.join(DRAFTS)}")
        if self.k < 1 or self.budget < 1:
            raise ValueError("k and the prefetch budget must be >= 1")
        if self.prefetch and self.draft != "ngram":
            raise ValueError("--prefetch needs --draft ngram: it reads the n-gram cache")


def generate_group(
    engine, prompt: list[int], samples: int, config: GenerationConfig, draft: DraftConfig, on_text=None, plan=None
) -> tuple[list[Generation], SpecStats | None]:
    """`samples` completions of one prompt in one batch (`plan`: a prefill plan, one sample)."""
    prompts = [list(prompt) for _ in range(samples)]
    if draft.draft == "none":
        return engine.generate(prompts, config, on_text, plan), None
    caches = None
    if draft.draft == "ngram":
        shared = NgramCache(prompt, draft.n_min, draft.n_max)
        drafters, caches = [NgramDrafter(shared, prompt) for _ in prompts], [shared] * samples
    else:
        drafters = [PromptLookupDrafter(draft.n_min, draft.n_max) for _ in prompts]
    prefetcher = Prefetcher(draft.k, draft.budget) if draft.prefetch else None
    try:
        gate = DraftGate() if draft.gate else None
        outputs, stats = speculative_generate(engine, prompts, drafters, config, draft.k, prefetcher, caches, on_text, plan, gate)
    finally:
        if prefetcher is not None:
            prefetcher.close()
    return outputs, stats

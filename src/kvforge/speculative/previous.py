"""Drafts from a prompt's previous rollouts: the tokens an earlier epoch's sample wrote next.

An RL run rolls the same prompts out every epoch with a policy that moves a little per update, so
a sample's text often runs along one of the prompt's previous rollouts (SPEC-RL drafts exactly
that). `PreviousRolloutDrafter` keeps one alignment: a previous rollout and the offset in it that
the sample's next token would continue. It starts at the sample's own previous rollout (the one
with its sample index), offset 0, and moves along it as long as the committed tokens equal the
rollout's. When they differ it looks for a new alignment:

1. a previous rollout (its own first) that begins with the sample's whole output so far;
2. else the latest `n_max`..`n_min` tokens of the context found inside a previous rollout (its
   own first), at the occurrence nearest the sample's own length: the texts came back together.

A draft is the next k tokens of the aligned rollout. Drafts are proposals only: which tokens are
committed never depends on them (`step.py`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class PreviousRolloutDrafter:
    """One sample's drafter over its prompt's previous rollouts (`rollouts[0]`: its own)."""

    def __init__(self, rollouts: Sequence[Sequence[int]], prompt_length: int, n_min: int = 2, n_max: int = 4):
        self.rollouts = [np.asarray(r, dtype=np.int64) for r in rollouts if len(r)]  # an empty one has nothing to draft
        self.prompt_length, self.n_min, self.n_max = prompt_length, n_min, n_max
        # (rollout, offset) the next committed token continues; None: lost, search again
        self.aligned: tuple[int, int] | None = (0, 0) if self.rollouts else None

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        if not self.rollouts:
            return []
        if self.aligned is None:
            self.aligned = self._align(context)
        if self.aligned is None:
            return []
        rollout, offset = self.aligned
        return self.rollouts[rollout][offset : offset + k].tolist()

    def observe(self, tokens: Sequence[int]) -> None:
        if self.aligned is None or not len(tokens):
            return
        rollout, offset = self.aligned
        ahead = self.rollouts[rollout][offset : offset + len(tokens)]
        same = len(ahead) == len(tokens) and bool((ahead == np.asarray(tokens, dtype=np.int64)).all())
        self.aligned = (rollout, offset + len(tokens)) if same else None

    def _align(self, context: Sequence[int]) -> tuple[int, int] | None:
        output = np.asarray(context[self.prompt_length :], dtype=np.int64)
        produced = len(output)
        for i, r in enumerate(self.rollouts):  # 1. a rollout that begins with the whole output
            if len(r) > produced and (r[:produced] == output).all():
                return i, produced
        tail = np.asarray(context[-self.n_max :], dtype=np.int64)
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):  # 2. the longest recent match
            suffix = tail[-n:]
            for i, r in enumerate(self.rollouts):
                if len(r) <= n:
                    continue
                windows = np.lib.stride_tricks.sliding_window_view(r[:-1], n)  # a match with a token after it
                hits = np.flatnonzero((windows == suffix).all(axis=1))
                if hits.size:
                    nearest = int(hits[np.abs(hits + n - produced).argmin()])
                    return i, nearest + n
        return None

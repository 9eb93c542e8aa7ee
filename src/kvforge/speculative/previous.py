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

Realigning runs on the step's critical path, for every unaligned sample at every step, so it is
kept cheap: the rollouts that still begin with the output are narrowed as the output grows (one
that stopped matching never matches again), and each rollout's n-grams are indexed once, at the
first search by n-gram, into their occurrences (`IndexedRollout`), so a search is a dictionary
lookup per rollout and n. The G drafters of a group share one `IndexedRollout` per previous
rollout (`step.new_drafters`), so a rollout is indexed once per group, not once per sample.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class IndexedRollout:
    """A previous rollout's tokens and, built at first use, its n-grams (n_min..n_max) that have a
    token after them, each mapped to the offsets after its occurrences (ascending)."""

    def __init__(self, tokens: Sequence[int], n_min: int = 2, n_max: int = 4):
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.n_min, self.n_max = n_min, n_max
        self._grams: dict[tuple[int, ...], list[int]] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def grams(self) -> dict[tuple[int, ...], list[int]]:
        if self._grams is None:
            grams: dict[tuple[int, ...], list[int]] = {}
            tokens = self.tokens.tolist()
            for n in range(self.n_min, self.n_max + 1):
                for end in range(n, len(tokens)):
                    grams.setdefault(tuple(tokens[end - n : end]), []).append(end)
            self._grams = grams  # whole or not at all: a reader never sees it half built
        return self._grams


class PreviousRolloutDrafter:
    """One sample's drafter over its prompt's previous rollouts (`rollouts[0]`: its own), given as
    token lists or as `IndexedRollout`s shared with the group's other drafters."""

    def __init__(self, rollouts: Sequence[Sequence[int] | IndexedRollout], prompt_length: int, n_min: int = 2, n_max: int = 4):
        indexed = [r if isinstance(r, IndexedRollout) else IndexedRollout(r, n_min, n_max) for r in rollouts]
        if any((r.n_min, r.n_max) != (n_min, n_max) for r in indexed):
            raise ValueError(f"the rollouts are indexed by other n-grams than {n_min}..{n_max}")
        self.indexed = [r for r in indexed if len(r)]  # an empty one has nothing to draft
        self.rollouts = [r.tokens for r in self.indexed]
        self.prompt_length, self.n_min, self.n_max = prompt_length, n_min, n_max
        # (rollout, offset) the next committed token continues; None: lost, search again
        self.aligned: tuple[int, int] | None = (0, 0) if self.rollouts else None
        self.prefixed = list(range(len(self.rollouts)))  # the rollouts that began with the output at the last search

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
        # 1. a rollout that begins with the whole output
        self.prefixed = [i for i in self.prefixed if len(self.rollouts[i]) >= produced and (self.rollouts[i][:produced] == output).all()]
        for i in self.prefixed:
            if len(self.rollouts[i]) > produced:
                return i, produced
        tail = tuple(int(t) for t in context[-self.n_max :])
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):  # 2. the longest recent match
            for i, rollout in enumerate(self.indexed):  # the earliest rollout holding it (its own first)
                ends = rollout.grams.get(tail[-n:])
                if ends:  # at the offset nearest the output's length
                    return i, min(ends, key=lambda end: abs(end - produced))
        return None

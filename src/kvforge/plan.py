"""PrefillPlan: per prompt row, how deep it is computed.

Exact prefill, RidgeFill and SPEED are one mechanism. Row i runs layers [0, depth[i]) exactly.
Above its depth a row is either
  - filled: the plan's `fill(layer, h)` predicts that layer's input from h, the residual stream
    entering the row's depth, and the layer writes the row's K/V from the prediction (input norm,
    k/v projections, k-norm and RoPE run; attention and MLP do not) -- RidgeFill; or
  - absent: no compute, no cache rows, invisible to every later query -- SPEED (no `fill`).
Rows with depth == num_layers are exact everywhere. The last prompt row must be exact: it
produces the first output token.

Invariant: a plan whose rows are all full depth computes exactly what exact prefill computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# fill(layer, h) -> predicted input of `layer`, for rows whose depth <= layer; h (1, N, E) is
# each such row's residual stream entering its own depth.
Filler = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PrefillPlan:
    depth: torch.Tensor  # (T,) int64, 0 <= depth <= num_layers
    fill: Filler | None = None
    method: str = "exact"

    @classmethod
    def exact(cls, tokens: int, num_layers: int) -> "PrefillPlan":
        return cls(torch.full((tokens,), num_layers, dtype=torch.long))

    def is_exact(self, num_layers: int) -> bool:
        return bool((self.depth == num_layers).all())

    def validate(self, tokens: int, num_layers: int) -> None:
        if self.depth.shape != (tokens,):
            raise ValueError(f"plan covers {tuple(self.depth.shape)} rows but the prompt has {tokens} tokens")
        if bool(((self.depth < 0) | (self.depth > num_layers)).any()):
            raise ValueError(f"plan depths must lie in [0, {num_layers}]")
        if int(self.depth[-1]) != num_layers:
            raise ValueError("the last prompt row must be exact at every layer: it produces the first token")

    def exact_rows(self, num_layers: int) -> int:
        return int((self.depth == num_layers).sum())

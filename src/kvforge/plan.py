"""PrefillPlan: per prompt row, how deep it is computed.

Exact prefill, RidgeFill and SPEED are one mechanism. Row i runs layers [0, depth[i]) exactly.
Above its depth a row is either
  - filled: the plan's `fill(layer, h)` predicts that layer's input from h, the residual stream
    entering the row's depth, and the layer writes the row's K/V from the prediction (input norm,
    k/v projections, k-norm and RoPE run; attention and MLP do not) -- RidgeFill; or
  - absent: no compute, no cache rows, invisible to every later query -- SPEED (no `fill`).
Rows with depth == num_layers are exact everywhere. The last prompt row must be exact: it
produces the first output token. Every layer stores its rows in position order, filled and exact
interleaved, so a layer that holds every row stays on attention's mask-free decode path.

On a sliding-window layer a filled row that no exact row of the prompt can see (and so no later
decode step either) is not written at all: it would never be read.

`choose`, when given, is called once, before the first layer any row leaves, with the layer
index, the residual stream entering the layer before it, the positions, the cache (whose layer
`layer - 1` holds every row's keys) and the depths; it returns the final depths. RidgeFill uses
it to keep exact the rows the prompt's tail attends to most.

Invariant: a plan whose rows are all full depth computes exactly what exact prefill computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# fill(layer, h, rows) -> the predicted input of `layer` (1, N, E) for the N prompt rows picked by
# the bool mask `rows` (T,); h (1, N, E) is each such row's residual stream entering its own depth.
Filler = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# choose(layer, h_before, positions, cache, depth) -> depth (T,)
Chooser = Callable[[int, torch.Tensor, torch.Tensor, object, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PrefillPlan:
    depth: torch.Tensor  # (T,) int64, 0 <= depth <= num_layers
    fill: Filler | None = None
    method: str = "exact"
    choose: Chooser | None = None

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

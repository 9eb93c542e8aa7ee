"""PrefillPlan: per prompt row, how deep it is computed.

Exact prefill, RidgeFill and SPEED are one mechanism. Row i runs layers [0, depth[i]) exactly.
Above its depth a row is either
  - filled: the plan's `fill(layer, h, rows)` predicts that layer's input from h, the residual
    stream entering the row's depth (and, for a map that reads it, the previous row's), and the layer writes the row's K/V from the prediction (input norm,
    k/v projections, k-norm and RoPE run; attention and MLP do not) -- RidgeFill; or
  - absent: no compute, no cache rows, invisible to every later query -- SPEED (no `fill`).
Rows with depth == num_layers are exact everywhere. The last prompt row must be exact: it
produces the first output token. Every layer stores its rows in position order, filled and exact
interleaved, so a layer that holds every row stays on attention's mask-free decode path.

On a sliding-window layer a filled row that no exact row of the prompt can see (and so no later
decode step either) is not written at all: it would never be read.

`choose`, when given, is called once, before the first layer any row leaves (or, with `choose_at`,
before that earlier layer), with the layer index, the residual stream entering the layer before it, the positions, the cache (whose layer
`layer - 1` holds every row's keys) and the depths; it returns the final depths. RidgeFill uses
it to keep exact the rows the prompt's tail attends to most. What a prefill finally ran is read
off its cache afterwards (`final_depth`, `PrefillReport.of`): every row carries its kind, so the
plan keeps no record of its own.

Invariant: a plan whose rows are all full depth computes exactly what exact prefill computes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

import torch

from kvforge.cache import KVCache, LayerCache, RowKind

if TYPE_CHECKING:  # fill.rescue reads plans: a runtime import would be a circle
    from kvforge.fill.rescue import RescueConfig

# fill(layer, h, rows) -> the predicted input of `layer` (1, N, E) for the N prompt rows picked by
# the bool mask `rows` (T,); h (1, T, E) holds every prompt row's residual stream entering its own
# depth, or, for a row still running, entering the first layer any row left. A fill may also
# write an attention layer's cache rows itself: key_value(layer, h, rows, rope) -> k, v
# (RidgeFill's maps folded into the layer's K/V projection); see `filled_key_value`.
Filler = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# choose(layer, h_before, positions, cache, depth) -> depth (T,)
Chooser = Callable[[int, torch.Tensor, torch.Tensor, object, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PrefillPlan:
    depth: torch.Tensor  # (T,) int64, 0 <= depth <= num_layers
    fill: Filler | None = None
    method: str = "exact"
    choose: Chooser | None = None
    reason: str | None = None  # why a method's plan for this prompt computes every row exactly
    choose_at: int | None = None  # the layer before which `choose` runs (None: the first layer any row leaves)
    # RidgeFill: while decoding, recompute filled rows a copy reads next (`fill.rescue.RescueConfig`;
    # the decode loop starts a `DecodeRescue` per sequence from what the prefill returns); None: off
    rescue: "RescueConfig | None" = None
    # what a filled row costs a prefill chunk's budget in the layers past its depth, in exact rows
    # (RidgeFill: `flops.filled_row_share` of its maps); None: as much as an exact row
    fill_cost: float | None = None

    @classmethod
    def exact(cls, tokens: int, num_layers: int, reason: str | None = None) -> "PrefillPlan":
        return cls(torch.full((tokens,), num_layers, dtype=torch.long), reason=reason)

    def is_exact(self, num_layers: int) -> bool:
        return bool((self.depth == num_layers).all())

    def validate(self, tokens: int, num_layers: int) -> None:
        if self.depth.shape != (tokens,):
            raise ValueError(f"plan covers {tuple(self.depth.shape)} rows but the prompt has {tokens} tokens")
        if bool(((self.depth < 0) | (self.depth > num_layers)).any()):
            raise ValueError(f"plan depths must lie in [0, {num_layers}]")
        if int(self.depth[-1]) != num_layers:
            raise ValueError("the last prompt row must be exact at every layer: it produces the first token")


def final_depth(cache: KVCache, tokens: int, start: int = 0) -> torch.Tensor:
    """(T,) how deep each of the `tokens` prompt rows at positions start, start+1, ... ran exactly,
    read off the cache of its prefill (sequence 0): the first layer that holds the row as anything
    but EXACT -- filled, or absent -- or L. This is the depth after any `choose`; later rows
    (decoding) do not change it."""
    depth = torch.full((tokens,), len(cache), dtype=torch.long)
    for layer in reversed(range(len(cache))):
        depth[~_rows_of_kind(cache[layer], RowKind.EXACT, tokens, start)] = layer
    return depth


def _rows_of_kind(layer: LayerCache, kind: RowKind, tokens: int, start: int) -> torch.Tensor:
    """(T,) bool: the prompt rows (positions start..start+T-1) this layer holds as `kind`."""
    rows = layer.row_positions()[0].cpu() - start
    held = (rows >= 0) & (rows < tokens) & (layer.row_kinds()[0].cpu() == int(kind))
    out = torch.zeros(tokens, dtype=torch.bool)
    out[rows[held]] = True
    return out


@dataclass(frozen=True)
class PrefillReport:
    """What a prefill ran, as the CLI, the server and the benches report it."""

    prefill: str  # the plan's method, or "exact" when every prompt row ran full depth
    prompt_tokens: int
    filled_rows: int | None = 0  # rows some layer wrote from a predicted input (RidgeFill)
    shallow_rows: int | None = 0  # rows below full depth and never filled: absent above their depth (SPEED)
    reason: str | None = None  # why a method other than exact ran exact

    @classmethod
    def of(cls, plan: PrefillPlan | None, cache: KVCache, tokens: int, start: int = 0) -> "PrefillReport":
        """Read off the cache right after prefilling `tokens` rows from position `start` by `plan`."""
        if plan is None:
            return cls("exact", tokens)
        below = final_depth(cache, tokens, start) < len(cache)
        filled = torch.zeros(tokens, dtype=torch.bool)
        for layer in cache.layers:
            filled |= _rows_of_kind(layer, RowKind.FILLED, tokens, start)
        if not bool(below.any()):
            return cls("exact", tokens, reason=_exact_reason(plan, tokens))
        return cls(plan.method, tokens, int(filled.sum()), int((below & ~filled).sum()))

    @classmethod
    def planned(cls, plan: PrefillPlan | None, tokens: int, num_layers: int) -> "PrefillReport":
        """The report known before the prefill runs, for callers that never see its cache. Row
        counts are None when the plan's `choose` decides them during the prefill."""
        if plan is None or plan.is_exact(num_layers):
            return cls("exact", tokens, reason=_exact_reason(plan, tokens) if plan is not None else None)
        if plan.choose is not None:
            return cls(plan.method, tokens, None, None)
        below = int((plan.depth < num_layers).sum())
        return cls(plan.method, tokens, below if plan.fill is not None else 0, 0 if plan.fill is not None else below)

    def as_dict(self) -> dict:
        """The fields as a JSON-ready dict (what CLI and server responses carry)."""
        return asdict(self)


def _exact_reason(plan: PrefillPlan, tokens: int) -> str | None:
    if plan.reason is not None or plan.method == "exact":
        return plan.reason
    return f"{plan.method} kept every row of the {tokens}-token prompt at full depth"


def filled_key_value(fill: Filler, adapter, layer: int, h: torch.Tensor, rows: torch.Tensor, rope: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache rows (k, v) an attention layer holds for the filled `rows`: the fill's own when it
    writes them, else the layer's norm and K/V projection over the fill's predicted input."""
    own = getattr(fill, "key_value", None)
    if own is not None:
        return own(layer, h, rows, rope)
    return adapter.key_value(layer, fill(layer, h, rows), rope)

"""RidgeFill: run the layers below a split exactly, fill the late layers' caches from ridge maps.

Shapes: T prompt tokens, E hidden size, L layers, Hq query heads, D head dim.

A RidgeFill prefill is a `PrefillPlan`: exact rows (the first `sinks` tokens, the chat template's
special tokens, an explicit list, the last `tail` tokens and, optionally, the rows the tail
attends to most at the last exact layer with the rows after each) run every layer; every other row runs layers [0, split)
exactly and, at each late layer l >= split, the layer writes its K/V from the predicted input
h_split @ W_l + b_l (at l = split the input is h_split itself). The `identity` fill (the seed's POP
baseline) uses h_split as every late layer's input, through the same plan. Every decode step runs
the full model; within it the plan's rescue (`fill.rescue`, on by default) recomputes the
filled rows a copy from the prompt reads next.

`resolve` turns a user's choice (preset, overrides, a maps file or the cached one) into a checked
config and maps; the CLI, the server and the demo all call it. A prompt no longer than the exact
rows gets an exact plan that says why (`PrefillPlan.reason`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvforge.artifacts import find_artifact
from kvforge.attention import visibility_mask
from kvforge.engine import Engine
from kvforge.errors import ArtifactError, KvforgeError
from kvforge.fill.calibrate import validate_splits
from kvforge.fill.maps import RidgeMaps, fold_kv
from kvforge.fill.rescue import RescueConfig
from kvforge.flops import filled_row_share
from kvforge.plan import PrefillPlan

FILLS = ("ridge", "identity")
# Split as a fraction of the depth, tail in tokens, rows chosen by the tail's attention.
PRESETS = {
    "fast": {"split_fraction": 0.5, "tail": 256, "attended_rows": 16},
    "quality": {"split_fraction": 2 / 3, "tail": 512, "attended_rows": 32},
}


@dataclass(frozen=True)
class RidgeFillConfig:
    split: int
    tail: int = 256
    sinks: int = 4
    special_rows: bool = True  # the chat template's special-token rows stay exact
    attended_rows: int = 0  # rows the tail attends to most at the last exact layer stay exact,
    attended_span: int = 16  # each with the rows that follow it
    rows: tuple[int, ...] = ()  # explicit prompt positions kept exact
    fill: str = "ridge"  # or "identity"
    # filled rows recomputed while decoding when the text repeats a prompt n-gram (`fill.rescue`);
    # None: decoding never touches them
    rescue: RescueConfig | None = RescueConfig()

    def __post_init__(self):
        if self.tail < 1 or self.sinks < 0 or self.attended_rows < 0 or self.attended_span < 0:
            raise ValueError("tail must be >= 1 and sinks, attended rows and their span >= 0")
        if self.fill not in FILLS:
            raise ValueError(f"fill must be one of {', '.join(FILLS)}, got {self.fill!r}")

    def check(self, num_layers: int) -> None:
        """Splits 1..L-1 fill layers [split, L); split = L fills nothing (exact, the degenerate case)."""
        if not 1 <= self.split <= num_layers:
            raise ValueError(f"split {self.split} is outside 1..{num_layers - 1} for a {num_layers}-layer model")


def preset(name: str, num_layers: int, **overrides) -> RidgeFillConfig:
    """The `fast` or `quality` setting for a model of `num_layers`, with fields overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown RidgeFill preset {name!r}: use {' or '.join(PRESETS)}")
    p = PRESETS[name]
    settings = {"split": preset_split(name, num_layers), "tail": p["tail"], "attended_rows": p["attended_rows"]}
    settings.update({k: v for k, v in overrides.items() if v is not None})
    return RidgeFillConfig(**settings)


def preset_split(name: str, num_layers: int) -> int:
    return max(1, min(num_layers - 1, round(PRESETS[name]["split_fraction"] * num_layers)))


def parse_splits(text: str, num_layers: int) -> list[int]:
    """'fast,quality,12' -> layer indices (presets resolved for this depth)."""
    splits = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item in PRESETS:
            splits.append(preset_split(item, num_layers))
        else:
            try:
                splits.append(int(item))
            except ValueError as exc:
                raise ValueError(f"--split takes layer indices or {', '.join(PRESETS)}, got {item!r}") from exc
    if not splits:
        raise ValueError("--split is empty")
    validate_splits(tuple(splits), num_layers)
    return sorted(set(splits))


def resolve(
    engine: Engine,
    maps: str | Path | RidgeMaps | None = None,
    preset_name: str = "fast",
    split: int | None = None,
    tail: int | None = None,
    attended_rows: int | None = None,
    rows: tuple[int, ...] = (),
    fill: str = "ridge",
    streamed: bool = False,
    rescue: bool = True,
) -> tuple[RidgeFillConfig, RidgeMaps | None]:
    """(config, maps) for RidgeFill on `engine`: the preset with any overrides, and the maps --
    loaded from `maps`, or the model's cached ones (`find_artifact("maps", model)`: a fit's, else the shipped ones) -- checked
    against the model and holding the split. The identity fill needs no maps (None). Each
    problem is a one-line error."""
    num_layers = engine.num_layers
    config = preset(preset_name, num_layers, split=split, tail=tail, attended_rows=attended_rows, rows=tuple(rows), fill=fill)
    if not rescue:
        config = replace(config, rescue=None)
    config.check(num_layers)
    if fill != "ridge":
        return config, None
    if not isinstance(maps, RidgeMaps):
        path = Path(maps) if maps is not None else find_artifact("maps", engine.model.name)
        if maps is None and not path.is_file():
            raise KvforgeError(
                f"no RidgeFill maps for {engine.model.name} at {path}: run `kvforge fit ridgefill --model {engine.model.name}` or pass --maps"
            )
        maps = RidgeMaps.load(path, streamed=streamed)
    if config.split < num_layers:
        _check_maps(engine, maps, config.split)
    else:
        maps.check_model(engine.model.name, engine.model.fingerprint, num_layers)
    return config, maps


def _check_maps(engine: Engine, maps: RidgeMaps, split: int) -> None:
    """A one-line error unless `maps` were fitted for the engine's model and hold `split`."""
    maps.check_model(engine.model.name, engine.model.fingerprint, engine.num_layers)
    if not maps.has_split(split):
        raise ArtifactError(f"maps {maps.path or ''} hold splits {maps.splits}, not split {split}: fit that split or pick one of those")


def exact_row_mask(prompt: list[int], config: RidgeFillConfig, special_ids: set[int]) -> torch.Tensor:
    """(T,) bool: rows kept exact before any attention-based choice."""
    t = len(prompt)
    exact = torch.zeros(t, dtype=torch.bool)
    exact[: config.sinks] = True
    exact[max(0, t - config.tail) :] = True
    if config.special_rows and special_ids:
        exact |= torch.tensor([tok in special_ids for tok in prompt], dtype=torch.bool)
    for row in config.rows:
        if not 0 <= row < t:
            raise ValueError(f"exact row {row} is outside the {t}-token prompt")
        exact[row] = True
    return exact


def planned_exact_rows(prompt: list[int], config: RidgeFillConfig, special_ids: set[int]) -> tuple[torch.Tensor, str | None]:
    """(T,) bool rows kept exact before the attention-based choice, and why the whole prompt stays
    exact (None when some row will be filled): a prompt no longer than the exact rows, or one whose
    fillable rows the attended-row choice would keep anyway. kvforge's engine and its vLLM model
    class both plan by this."""
    exact = exact_row_mask(prompt, config, special_ids)
    tokens, fillable = len(prompt), int((~exact).sum())
    if fillable == 0:
        return exact, f"the {tokens}-token prompt is no longer than RidgeFill's exact rows (first {config.sinks}, last {config.tail})"
    if config.attended_rows >= fillable:
        return exact, f"RidgeFill keeps exact the {config.attended_rows} rows the tail attends to most, which covers all {fillable} fillable rows"
    return exact, None


def ridgefill_plan(engine: Engine, prompt: list[int], config: RidgeFillConfig, maps: RidgeMaps | None = None) -> PrefillPlan:
    """The plan for one prompt. When nothing would be filled -- split = L, a prompt no longer
    than the exact rows, or one whose fillable rows the attended-row choice keeps exact anyway --
    it is the exact plan, with the reason."""
    num_layers, tokens = engine.num_layers, len(prompt)
    config.check(num_layers)
    if config.split == num_layers:
        return PrefillPlan.exact(tokens, num_layers, f"RidgeFill split {config.split} is the model's depth: no layer to fill")
    if config.fill == "ridge":
        if maps is None:
            raise ValueError("RidgeFill needs maps: pass --maps (fit them with `kvforge fit ridgefill`)")
        _check_maps(engine, maps, config.split)
    special = set(getattr(engine.model.tokenizer, "all_special_ids", []) or [])
    exact, reason = planned_exact_rows(prompt, config, special)
    if reason is not None:
        return PrefillPlan.exact(tokens, num_layers, reason)
    depth = torch.where(exact, num_layers, config.split)
    fill = MapFill(maps, config.split, engine.adapter, engine.dtype, engine.device) if config.fill == "ridge" else identity_fill
    rescue = config.rescue if isinstance(fill, MapFill) else None  # the identity fill has no maps to fall short of
    a = engine.adapter
    inputs, folded = (len(maps.inputs), maps.predicts_normed) if isinstance(fill, MapFill) else (0, False)  # the identity fill maps nothing
    fill_cost = filled_row_share(a, config.split, inputs, folded)
    read = attention_read_layer(a.windows, config.split, [a.is_recurrent(layer) for layer in range(a.num_layers)])
    if not config.attended_rows or read is None:  # read None: a hybrid with no attention layer below the split
        return PrefillPlan(depth, fill, "ridgefill", rescue=rescue, fill_cost=fill_cost)
    return PrefillPlan(depth, fill, "ridgefill", AttendedRows(engine, config.attended_rows, config.tail, config.attended_span),
                       choose_at=read + 1, rescue=rescue, fill_cost=fill_cost)


def attention_read_layer(windows: list[int | None], split: int, recurrent: list[bool] | None = None) -> int | None:
    """The exact layer whose attention picks the rows to keep exact: the last global-attention layer
    below the split, else the last attention layer below it; None when every layer below it is
    recurrent (a hybrid's linear attention has no attention weights to read). On Gemma 3 the layer
    below the split is usually a sliding-window layer, whose tail queries cannot see a row more
    than a window back: the rows a question retrieves from far back are visible only to the global
    layers (every sixth)."""
    recurrent = recurrent or [False] * len(windows)
    attention = [layer for layer in range(split) if not recurrent[layer]]
    globals_below = [layer for layer in attention if windows[layer] is None]
    return globals_below[-1] if globals_below else (attention[-1] if attention else None)


def identity_fill(layer: int, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The split layer's state as every late layer's input (POP's fill)."""
    return h[:, rows]


class MapFill:
    """Predicted late-layer inputs x @ W_l + b_l, x = h_split of the filled rows (beside the
    previous rows' h_split when the maps read it); maps read once per prefill per layer.

    Maps that predict the normed input write a filled row's cache straight from x (`key_value`):
    each map folded with its layer's norm gain and K/V projection (`maps.fold_kv`), once per maps
    object, model weights and dtype (streamed maps fold at every use: they are never all in memory)."""

    def __init__(self, maps: RidgeMaps, split: int, adapter, dtype: torch.dtype, device: torch.device):
        self.maps, self.split, self.adapter, self.dtype, self.device = maps, split, adapter, dtype, device
        self._key, self._x = None, None  # the last map input, reused while a prefill writes the same rows

    def __call__(self, layer: int, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if layer == self.split:  # the split layer's input is h_split itself
            return h[:, rows]
        w, b = self.maps.weights(self.split, layer, self.dtype)
        return torch.addmm(b.to(self.device), self._input(h, rows), w.to(self.device)).unsqueeze(0)

    def key_value(self, layer: int, h: torch.Tensor, rows: torch.Tensor, rope: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache rows (k, v) `layer` holds for the filled `rows`."""
        folded = None if layer == self.split or not self.maps.predicts_normed else self._folded(layer)
        if folded is None:
            return self.adapter.key_value(layer, self(layer, h, rows), rope)
        w, b = folded
        return self.adapter.cache_rows(layer, torch.addmm(b, self._input(h, rows), w).unsqueeze(0), rope)

    def _folded(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        norm = self.adapter.input_norm(layer)
        if norm is None:  # a norm kvforge cannot fold: the layer's own norm renormalises the prediction
            return None
        # the q/k/v weight object, not its address: one kept only packed has none (`ops.released`)
        key = (self.split, layer, self.dtype, self.device, id(self.adapter.qkv[layer][0]))
        cache = self.maps.folded if self.maps.tensors is not None else {}
        if key not in cache:
            kv_weight, kv_bias = self.adapter.kv_weights(layer)
            w, b = self.maps.weights(self.split, layer, torch.float32)
            a, c = fold_kv(w, b, norm[0], kv_weight, kv_bias)
            cache[key] = (a.to(self.device, self.dtype), c.to(self.device, self.dtype))
        return cache[key]

    def _input(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(N, I): the rows' h_split (beside their previous rows'); every global layer writes the
        same rows from the same h_split, so it is gathered once per prefill, not per layer."""
        if self._key is None or self._key[0] is not h or not torch.equal(rows, self._key[1]):
            x = h[0, rows]
            if self.maps.reads_previous:
                x = torch.cat([x, h[0, map_previous_rows(rows)]], dim=-1)
            self._key, self._x = (h, rows), x
        return self._x


def map_previous_rows(rows: torch.Tensor) -> torch.Tensor:
    """(N,) the row before each of the `rows` (bool (T,)); row 0, which has none, reads itself."""
    return (rows.nonzero().squeeze(1) - 1).clamp(min=0)


class AttendedRows:
    """Keeps exact the rows the tail's queries attend to most at an exact layer (the one before the
    layer it is called at: `attention_read_layer`), where every row's key is exact and already
    cached, and the `span` rows after each.

    A row's score is its largest attention weight from any tail query in any head: a question
    attends sharply to the few rows that match it, while summed weight favours rows every query
    glances at. The rows after a match are what a retrieval copies (the value after its key),
    so they stay exact with it. Only the tail's queries are recomputed (tail × one q projection).
    """

    def __init__(self, engine: Engine, count: int, tail: int, span: int = 16):
        self.adapter, self.count, self.tail, self.span = engine.adapter, count, tail, span

    def __call__(self, layer: int, h_before: torch.Tensor, positions: torch.Tensor, cache, depth: torch.Tensor) -> torch.Tensor:
        a, last_exact = self.adapter, layer - 1
        tail = slice(max(0, depth.numel() - self.tail), depth.numel())
        q_pos = positions[:, tail]
        q = a.attention_inputs(last_exact, h_before[:, tail], a.rope(h_before[:, tail], q_pos))[0]  # (1, Hq, Tt, D)
        keys, k_pos = a.attention_view(last_exact, cache[last_exact]).keys(), cache[last_exact].row_positions()  # (1, H, T, D)
        weight = peak_attention(q, keys, q_pos, k_pos, a.scaling[last_exact], a.windows[last_exact])  # (T,) by cache row
        rel = k_pos[0] - positions[0, 0]  # cache row -> prompt row
        ours = (rel >= 0) & (rel < depth.numel())
        by_row = torch.full((depth.numel(),), -1.0, dtype=weight.dtype, device=weight.device)
        by_row[rel[ours]] = weight[ours]
        depth = depth.clone()
        depth[most_attended(by_row, depth < a.num_layers, self.count, self.span)] = a.num_layers
        return depth


def peak_attention(q: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, scaling: float, window: int | None) -> torch.Tensor:
    """q (1, Hq, Tq, D) over keys (1, H, Tk, D) at positions (1, Tq) / (1, Tk) -> (Tk,): each key's
    largest attention weight from any query in any head. In fp32 whatever the model's dtype: in
    bf16 the weights tie often, and the rows chosen would hang on how ties fall."""
    keys = keys.float().repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
    scores = (q.float() @ keys.transpose(-1, -2)) * scaling  # (1, Hq, Tq, Tk)
    mask = visibility_mask(q_pos, k_pos, window)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1).amax(dim=(0, 1, 2))


def most_attended(weight: torch.Tensor, candidates: torch.Tensor, count: int, span: int) -> torch.Tensor:
    """(T,) bool: the `count` candidate rows with the largest `weight` (T,) and the `span` rows after each."""
    weight = weight.masked_fill(~candidates, -1.0)
    anchors = weight.topk(min(count, int(candidates.sum()))).indices
    rows = (anchors.unsqueeze(1) + torch.arange(span + 1, device=anchors.device)).flatten()
    keep = torch.zeros_like(candidates)
    keep[rows[rows < keep.numel()]] = True
    return keep

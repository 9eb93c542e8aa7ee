"""New weights for a loaded model, in place: what an RL trainer sends its rollout engine after
each update, without a restart.

Two kinds of update, both by the model's own parameter names (transformers' `named_parameters`;
a leading `base_model.model.`, PEFT's wrapper, is dropped):

- **full**: tensors named like the model's parameters, each of the parameter's shape and dtype,
  copied into it. Any subset of the parameters may be sent.
- **LoRA**: pairs `<module>.lora_A.weight` (r, in) and `<module>.lora_B.weight` (out, r); the
  module's weight becomes its base value + scale * B @ A (computed in float32, rounded once to
  the weight's dtype). A LoRA update replaces the previous one: the base values are kept from the
  first LoRA update on (until a full update makes new ones), and modules the new adapter leaves
  out return to them.

Everything is checked before anything is written: an unknown name, another shape or another dtype
is a `WeightUpdateError` naming the tensor, and the model keeps its weights. The engine's fused
projections are views of the same storage (`ops.linear.fuse_linears`), so they change with the
modules. What was derived from the old values is dropped: the packed weight copies
(`ops.linear.invalidate_packed`) and the cached fingerprint, so artifacts fitted for the old weights
no longer match (`LoadedModel.fingerprint` is recomputed on next use); `weights_version` counts
the updates. Weights a serving engine keeps only packed (`Engine.release_unpacked_weights`) get
their storage back for the update and are packed from the new values and released again before
it returns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

from kvforge.errors import KvforgeError
from kvforge.ops.linear import invalidate_packed, release_unpacked
from kvforge.ops.released import restore

PEFT_PREFIX = "base_model.model."
LORA_PARTS = (".lora_A.weight", ".lora_B.weight")


class WeightUpdateError(KvforgeError):
    """An update that does not fit the model; the message names the tensor."""


def update_weights(model, tensors: Mapping[str, torch.Tensor], lora_scale: float = 1.0) -> str:
    """Apply `tensors` (full weights or a LoRA, see the module docstring) to `model` (a
    `LoadedModel`) in place. Returns the kind applied, "full" or "lora"."""
    if not tensors:
        raise WeightUpdateError("the update holds no tensors")
    named = {name.removeprefix(PEFT_PREFIX): t for name, t in tensors.items()}
    params = dict(model.hf.named_parameters(remove_duplicate=False))
    lora = any(name.endswith(LORA_PARTS) for name in named)
    read = {name.removesuffix(part) + ".weight" for name in named for part in LORA_PARTS if name.endswith(part)} | set(model.lora_base) if lora else set(named)
    restored = restore(params[name] for name in read if name in params)  # weights kept only packed: storage back for the writes
    try:
        writes = _lora_writes(model, params, named, lora_scale) if lora else _full_writes(params, named)
        with torch.inference_mode():
            for name, value in writes.items():
                params[name].copy_(value)
        if not lora:
            for name in writes:
                model.lora_base.pop(name, None)  # a full update is the new base of what it wrote
        invalidate_packed()
    finally:
        release_unpacked(restored)  # packed from the values now and released again, here, while no step runs on them
    vars(model).pop("fingerprint", None)  # a cached_property: recomputed from the new values
    model.weights_version += 1
    return "lora" if lora else "full"


def _full_writes(params: dict, named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for name, value in named.items():
        target = params.get(name)
        if target is None:
            raise WeightUpdateError(f"tensor {name!r} is not a parameter of this model")
        if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
            raise WeightUpdateError(
                f"tensor {name!r} is {tuple(value.shape)} {_dtype(value.dtype)}, the model's is {tuple(target.shape)} {_dtype(target.dtype)}"
            )
    return dict(named)


def _lora_writes(model, params: dict, named: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, value in named.items():
        part = next((p for p in LORA_PARTS if name.endswith(p)), None)
        if part is None:
            raise WeightUpdateError(f"tensor {name!r} is not a LoRA factor (a LoRA update holds only *.lora_A.weight and *.lora_B.weight)")
        pairs.setdefault(name.removesuffix(part) + ".weight", {})[part[6]] = value  # "A" or "B"
    base = model.lora_base
    writes = {name: original for name, original in base.items() if name not in pairs}  # left out: back to the base
    for name, factors in pairs.items():
        target = params.get(name)
        if target is None:
            raise WeightUpdateError(f"LoRA factors for {name!r}, which is not a parameter of this model")
        if set(factors) != {"A", "B"}:
            raise WeightUpdateError(f"LoRA factors for {name!r} lack lora_{({'A', 'B'} - set(factors)).pop()}")
        a, b = factors["A"], factors["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(target.shape):
            raise WeightUpdateError(
                f"LoRA factors for {name!r} are A {tuple(a.shape)} and B {tuple(b.shape)}; the weight is {tuple(target.shape)}, so A must be (r, {target.shape[1]}) and B ({target.shape[0]}, r)"
            )
        original = base.get(name, target)
        delta = scale * (b.float().to(target.device) @ a.float().to(target.device))
        writes[name] = (original.float() + delta).to(target.dtype)
    for name in pairs:
        if name not in base:
            base[name] = params[name].detach().clone()
    return writes


def read_update(path: str | Path) -> tuple[dict[str, torch.Tensor], float]:
    """The tensors of a safetensors file (or of `adapter_model.safetensors` in a PEFT directory)
    and the LoRA scale: lora_alpha / r from an `adapter_config.json` beside it (lora_alpha /
    sqrt(r) with `use_rslora`), else 1.0."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / "adapter_model.safetensors"
    if not path.is_file():
        raise WeightUpdateError(f"no weights file at {path}")
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # a damaged or foreign file: say which, in one line
        raise WeightUpdateError(f"cannot read {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    config = path.parent / "adapter_config.json"
    scale = 1.0
    if config.is_file():
        try:
            settings = json.loads(config.read_text())
            scale = float(settings["lora_alpha"]) / (float(settings["r"]) ** 0.5 if settings.get("use_rslora") else float(settings["r"]))
        except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
            raise WeightUpdateError(f"{config} does not give lora_alpha and r: {exc}") from exc
    return tensors, scale


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

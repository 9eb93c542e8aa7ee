"""RidgeFill maps: the artifact that predicts each late layer's input from the split layer's state.

Shapes: N rows, E hidden size.

For a split s of L layers the artifact holds, for every late layer l in (s, L), W_l (I, E) and
b_l (E,) with input_l ≈ x @ W_l + b_l. The map's input x is h_s, the residual stream entering
layer s, or (`inputs` = ("split", "previous"), I = 2E) h_s beside the previous row's h_s: a late
layer's key at a row carries what the token *before* it was (what an induction head matches when a
continuation copies from the prompt), and the previous row's own state says that far better than
the row's state does. Layer s itself needs no map: its input *is* h_s. One file may hold maps for several splits (a fast and
a quality setting fitted in one calibration pass). Weights are float32, or int8 per output
channel with a float32 scale (`--int8`, the seed's `-i8` maps).

What a map predicts (`target`): "normed_input", the layer's input divided by its RMS (the input
norm without its gain: what the layer's projections read, so a map folds with the layer's norm
gain and K/V projection into one matrix from x straight to the cache rows, `fold_kv`: fewer MACs,
more loss, `kvforge fit ridgefill --normed-target`), or "input", the residual stream itself (the
default, and every file written before the field existed: the layer's own norm and projections
then run on the prediction).

Maps are used resident (every layer's tensors in memory) or streamed (each layer read from the
memory-mapped file when it runs, and dropped after).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open

from kvforge.cache import atomic_save_safetensors, read_artifact
from kvforge.errors import ArtifactError

FORMAT = "kvforge.ridgefill"
FORMAT_VERSION = "1"
INPUTS = ("split", "previous")  # the map inputs a file may name, in the order they are concatenated
TARGETS = ("normed_input", "input")  # what a map predicts; files without the field predict the input


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: w (I, O) -> (q int8 (I, O), scale (O,))."""
    scale = (w.abs().amax(dim=0) / 127.0).clamp(min=torch.finfo(torch.float32).tiny).float()
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def map_key(split: int, layer: int, part: str) -> str:
    return f"split.{split}.layer.{layer}.{part}"


@dataclass
class RidgeMaps:
    """Maps for one or more splits of one model, with the facts needed to trust them."""

    num_layers: int
    hidden_size: int
    fingerprint: str
    model: str
    splits: list[int]
    int8: bool
    info: dict = field(default_factory=dict)  # λ, R², calibration description, per split
    inputs: tuple[str, ...] = ("split",)  # what the map reads, in order: files without the field read h_s alone
    target: str = "input"  # what it predicts (TARGETS)
    tensors: dict[str, torch.Tensor] | None = None  # resident; None when streamed
    path: Path | None = None
    # fold_kv's results for resident maps, per (split, layer, dtype, K/V weights): in memory only
    folded: dict = field(default_factory=dict, repr=False)

    def has_split(self, split: int) -> bool:
        return split in self.splits

    def weights(self, split: int, layer: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(W (I, E), b (E,)) for `layer` at `split`, dequantized to `dtype`; I = E per input."""
        if not split < layer < self.num_layers or split not in self.splits:
            raise KeyError(f"no map for layer {layer} at split {split}")
        if self.tensors is not None:
            get = self.tensors.__getitem__
            return self._dequantize(get, split, layer, dtype)
        with safe_open(str(self.path), framework="pt", device="cpu") as f:  # memory-mapped read
            return self._dequantize(f.get_tensor, split, layer, dtype)

    def _dequantize(self, get, split: int, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        w = get(map_key(split, layer, "weight"))
        if self.int8:
            w = w.to(dtype) * get(map_key(split, layer, "scale")).to(dtype)
        return w.to(dtype), get(map_key(split, layer, "bias")).to(dtype)

    def resident_bytes(self, split: int) -> int:
        """Bytes of the maps one split keeps in memory when resident, with what they were folded into."""
        if self.tensors is None:
            return 0
        prefix = f"split.{split}."
        folded = sum(t.numel() * t.element_size() for key, pair in self.folded.items() if key[0] == split for t in pair)
        return folded + sum(t.numel() * t.element_size() for k, t in self.tensors.items() if k.startswith(prefix))

    @property
    def reads_previous(self) -> bool:
        return "previous" in self.inputs

    @property
    def predicts_normed(self) -> bool:
        return self.target == "normed_input"

    def layer_bytes(self) -> int:
        """Bytes of one layer's map as stored: what streaming holds at a time."""
        e = self.hidden_size
        return len(self.inputs) * e * e * (1 if self.int8 else 4) + e * 4 * (2 if self.int8 else 1)

    # --- file ----------------------------------------------------------------------------------
    def only(self, splits: list[int]) -> "RidgeMaps":
        """These maps restricted to `splits` (the same tensors, fewer of them): a smaller file for
        a deployment that uses one preset."""
        if self.tensors is None or not set(splits) <= set(self.splits):
            raise ValueError(f"only resident maps, and only splits they hold ({self.splits}), not {splits}")
        keep = {map_key(s, l, p) for s in splits for l in range(s + 1, self.num_layers) for p in self._parts()}
        info = {**self.info, "splits": {k: v for k, v in self.info.get("splits", {}).items() if int(k) in splits}}
        return replace(self, splits=sorted(splits), info=info, tensors={k: v for k, v in self.tensors.items() if k in keep},
                       path=None, folded={})

    def save(self, path: str | Path) -> None:
        if self.tensors is None:
            raise ValueError("only resident maps can be saved")
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kind": "ridgefill-maps",
            "model": self.model,
            "model_fingerprint": self.fingerprint,
            "num_layers": str(self.num_layers),
            "hidden_size": str(self.hidden_size),
            "splits": json.dumps(self.splits),
            "int8": json.dumps(self.int8),
            "inputs": json.dumps(list(self.inputs)),
            "target": self.target,
            "info": json.dumps(self.info),
        }
        atomic_save_safetensors({k: v.contiguous() for k, v in self.tensors.items()}, Path(path), meta)
        self.path = Path(path)

    @classmethod
    def load(cls, path: str | Path, streamed: bool = False) -> "RidgeMaps":
        path = Path(path)
        if not path.is_file():
            raise ArtifactError(f"maps file {str(path)!r} does not exist")
        with read_artifact(path, FORMAT, FORMAT_VERSION, "RidgeFill maps") as (f, meta):
            maps = cls(
                num_layers=int(meta["num_layers"]),
                hidden_size=int(meta["hidden_size"]),
                fingerprint=meta["model_fingerprint"],
                model=meta["model"],
                splits=[int(s) for s in json.loads(meta["splits"])],
                int8=bool(json.loads(meta["int8"])),
                info=json.loads(meta["info"]),
                inputs=tuple(json.loads(meta.get("inputs", '["split"]'))),
                target=meta.get("target", "input"),
                path=path,
            )
            if maps.target not in TARGETS:
                raise ArtifactError(f"{path} holds maps predicting {maps.target!r}: this kvforge reads {list(TARGETS)}")
            if maps.inputs not in (INPUTS[:1], INPUTS):
                raise ArtifactError(f"{path} names map inputs {list(maps.inputs)}: this kvforge reads {INPUTS[:1]} or {INPUTS}")
            names = set(f.keys())
            expected = {map_key(s, l, p) for s in maps.splits for l in range(s + 1, maps.num_layers) for p in maps._parts()}
            if names != expected:
                raise ArtifactError(f"{path} is incomplete: {len(expected - names)} of {len(expected)} map tensors missing")
            rows = len(maps.inputs) * maps.hidden_size
            shapes = {tuple(f.get_slice(n).get_shape()) for n in names if n.endswith(".weight")}
            if shapes != {(rows, maps.hidden_size)}:
                raise ArtifactError(f"{path} holds map weights of shape {sorted(shapes)}, not ({rows}, {maps.hidden_size}) for inputs {list(maps.inputs)}")
            if not streamed:
                maps.tensors = {name: f.get_tensor(name) for name in names}
        return maps

    def _parts(self) -> tuple[str, ...]:
        return ("weight", "bias", "scale") if self.int8 else ("weight", "bias")

    def check_model(self, model_name: str, fingerprint: str, num_layers: int) -> None:
        """A clear error when these maps were fitted for another model."""
        if fingerprint != self.fingerprint or num_layers != self.num_layers:
            raise ArtifactError(
                f"maps {self.path or ''} were fitted for {self.model} ({self.num_layers} layers, fingerprint "
                f"{self.fingerprint[:12]}), not for {model_name} ({num_layers} layers, fingerprint {fingerprint[:12]}); "
                f"other weights (or maps fitted before whole-tensor fingerprints): refit with `kvforge fit ridgefill`"
            )


def fold_kv(weight: torch.Tensor, bias: torch.Tensor, gain: torch.Tensor, kv_weight: torch.Tensor,
            kv_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A normed-input map (x @ weight + bias) followed by the layer's norm gain (E,) and K/V
    projection (kv_weight (C, E), kv_bias (C,)), as one map x @ A + a -> the projected rows (C wide):
    A = weight · diag(gain) · kv_weightᵀ (I, C). In fp32; a filled row then costs I·C MACs a layer
    instead of I·E + E·C, and the prediction is not renormalised (the ridge prediction of the rows)."""
    kv = kv_weight.float()
    a = (weight.float() * gain.float()) @ kv.T
    b = (bias.float() * gain.float()) @ kv.T
    return a, b if kv_bias is None else b + kv_bias.float()

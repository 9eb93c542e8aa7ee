"""Weight adapters on the engine's projections, saved as a `.safetensors` artifact: LoRA, or full
fine-tuning of chosen layers.

Shapes: E a projection's input width, O its output rows, r rank.

A LoRA pair (A (r, E), B (O, r)) per layer and target adds (alpha / r) * B @ A to the target's
weight. Targets are the fused q/k/v projection (`qkv`) and the fused MLP gate/up projection
(`gate_up`): the two matmuls every row runs in every layer, held by the family adapter. Rank 0 is
full fine-tuning instead: every projection of the chosen layers (`qkv`, the attention output `o`,
`gate_up`, `down`) carries a whole trained delta D (O, E), zero at the start; the layers left out
keep the base weights. One mechanism serves both: a delta per (layer, target). Training
swaps in W + delta for the duration of a forward (`applied`), so gradients reach the deltas only;
inference runs a second weight set with the delta added once (`adapted_engine`), so an adapted
model runs at the base model's speed and the base engine keeps the base weights. The norms stay
the base model's. A, B and D are fp32 whatever the model's dtype; the merged weights take the
model's (bf16 included). The artifact names the base model and its fingerprint, and what the adapter was trained for (SPEED: the cut,
anchors and tail), so loading it onto another model is refused.
"""

from __future__ import annotations

import copy
import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvforge.cache import atomic_save_safetensors, read_artifact
from kvforge.errors import ArtifactError
from kvforge.ops.released import readable

FORMAT = "kvforge.lora"
VERSION = "1"
TARGETS = ("qkv", "gate_up")  # LoRA's
FULL_TARGETS = ("qkv", "o", "gate_up", "down")  # full fine-tuning's: every projection of a layer


@dataclass
class LoraAdapter:
    rank: int  # 0: full fine-tuning (whole deltas, no factors)
    alpha: float
    num_layers: int
    model: str
    fingerprint: str
    tensors: dict[str, torch.Tensor]  # "layers.{i}.{target}.{A|B}", or "layers.{i}.{target}.D" at rank 0
    info: dict = field(default_factory=dict)  # what it was trained for and how
    path: Path | None = None
    layers: tuple[int, ...] | None = None  # the layers carrying deltas; None: every layer

    @classmethod
    def new(
        cls, adapter, rank: int, alpha: float, model: str, fingerprint: str, seed: int = 0, layers: list[int] | None = None
    ) -> "LoraAdapter":
        """A fresh adapter that starts as the base model: LoRA with A random (scaled by 1/sqrt(E))
        and B zero, or (rank 0) zero whole deltas on every projection of `layers`."""
        if rank < 0:
            raise ValueError(f"LoRA rank must be >= 1 (or 0: full fine-tuning), got {rank}")
        chosen = list(range(adapter.num_layers)) if layers is None else sorted(set(layers))
        if not chosen or not all(0 <= layer < adapter.num_layers for layer in chosen):
            raise ValueError(f"adapter layers must be within 0..{adapter.num_layers - 1}, got {layers}")
        recurrent = [layer for layer in chosen if adapter.is_recurrent(layer)]
        if recurrent:
            raise ValueError(
                f"weight adapters target softmax attention's projections and the gated MLP; layers {recurrent} are "
                "linear-attention (Gated DeltaNet) layers, which they do not cover yet"
            )
        targets = TARGETS if rank else FULL_TARGETS
        experts = [layer for layer in chosen if any(getattr(adapter, t)[layer] is None for t in targets)]
        if experts:
            raise ValueError(f"weight adapters need a gated MLP on every layer they train; layers {experts} are mixtures of experts")
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for layer in chosen:
            for target in targets:
                out_rows, in_cols = getattr(adapter, target)[layer][0].shape
                if rank:
                    tensors[_key(layer, target, "A")] = torch.randn(rank, in_cols, generator=g) / in_cols**0.5
                    tensors[_key(layer, target, "B")] = torch.zeros(out_rows, rank)
                else:
                    tensors[_key(layer, target, "D")] = torch.zeros(out_rows, in_cols)
        return cls(rank, alpha, adapter.num_layers, model, fingerprint, tensors, layers=None if layers is None else tuple(chosen))

    @property
    def targets(self) -> tuple[str, ...]:
        return TARGETS if self.rank else FULL_TARGETS

    @property
    def trained_layers(self) -> range | tuple[int, ...]:
        return range(self.num_layers) if self.layers is None else self.layers

    @property
    def kind(self) -> str:
        return f"LoRA rank {self.rank}" if self.rank else f"full fine-tuning of layers {_span(self.trained_layers)}"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 1.0

    def parameters(self) -> list[torch.Tensor]:
        return list(self.tensors.values())

    def delta(self, layer: int, target: str) -> torch.Tensor:
        if not self.rank:
            return self.tensors[_key(layer, target, "D")]
        return self.scale * self.tensors[_key(layer, target, "B")] @ self.tensors[_key(layer, target, "A")]

    def adapted_weights(self, adapter) -> dict[str, list]:
        """Each target's per-layer (weight, bias) list with W + delta on the trained layers (new
        tensors there, the base's own elsewhere)."""
        out = {}
        for target in self.targets:
            weights = list(getattr(adapter, target))
            for layer in self.trained_layers:
                weight, bias = weights[layer]
                weights[layer] = (merged(weight, self.delta(layer, target)), bias)
            out[target] = weights
        return out

    @contextmanager
    def applied(self, adapter):
        """Within the block the adapter's weights are W + delta (differentiable in the deltas)."""
        saved = {target: list(getattr(adapter, target)) for target in self.targets}
        try:
            for target, weights in self.adapted_weights(adapter).items():
                getattr(adapter, target)[:] = weights
            yield
        finally:
            for target in self.targets:
                getattr(adapter, target)[:] = saved[target]

    def check_model(self, model: str, fingerprint: str, num_layers: int) -> None:
        if fingerprint != self.fingerprint or num_layers != self.num_layers:
            raise ArtifactError(
                f"adapter {self.path or ''} was trained on {self.model} (fingerprint {self.fingerprint}, "
                f"{self.num_layers} layers), not {model} (fingerprint {fingerprint}, {num_layers} layers)"
            )

    def save(self, path: str | Path, storage: torch.dtype | None = None) -> None:
        """Write the artifact; `storage` torch.bfloat16 halves the file (the shipped adapter: its
        held-out score, measured on the bf16 file, is in artifacts/MANIFEST.json). Loading reads
        float32 either way."""
        meta = {
            "format": FORMAT,
            "format_version": VERSION,
            "rank": str(self.rank),
            "alpha": str(self.alpha),
            "num_layers": str(self.num_layers),
            "layers": "" if self.layers is None else ",".join(map(str, self.layers)),
            "model": self.model,
            "fingerprint": self.fingerprint,
            "targets": ",".join(self.targets),
            "info": json.dumps(self.info),
        }
        tensors = {k: v.detach().to(storage or v.dtype).contiguous().cpu() for k, v in self.tensors.items()}
        atomic_save_safetensors(tensors, Path(path), meta)
        self.path = Path(path)

    @classmethod
    def load(cls, path: str | Path) -> "LoraAdapter":
        path = Path(path)
        if not path.is_file():
            raise ArtifactError(f"adapter file {path} does not exist")
        with read_artifact(path, FORMAT, VERSION, "adapter") as (f, meta):
            tensors = {k: f.get_tensor(k).float() for k in f.keys()}  # a bf16 file trains and merges in float32
            try:
                layers = meta.get("layers") or None  # absent or empty: every layer
                adapter = cls(
                    int(meta["rank"]), float(meta["alpha"]), int(meta["num_layers"]), meta["model"], meta["fingerprint"],
                    tensors, json.loads(meta.get("info", "{}")), path,
                    None if layers is None else tuple(int(x) for x in layers.split(",")),
                )
            except (KeyError, ValueError) as e:
                raise ArtifactError(f"adapter {path} has unreadable metadata ({e}): re-create it") from None
        parts = "AB" if adapter.rank else "D"
        expected = {_key(l, t, p) for l in adapter.trained_layers for t in adapter.targets for p in parts}
        if set(tensors) != expected:
            raise ArtifactError(
                f"adapter {path} does not hold the tensors its metadata names ({len(expected - set(tensors))} missing, "
                f"{len(set(tensors) - expected)} unexpected): re-create it"
            )
        return adapter


@torch.no_grad()
def adapted_engine(engine, lora: LoraAdapter):
    """A second engine over the same model whose fused q/k/v and gate/up weights are W + delta,
    new tensors; every other weight (embeddings, norms, o/down projections, head) is shared, and
    `engine` keeps the base weights. Its fingerprint is the base model's combined with the
    adapter's, so artifacts fitted on the base model are refused for it."""
    from kvforge.engine import Engine

    adapter = copy.copy(engine.adapter)
    for target, weights in lora.adapted_weights(engine.adapter).items():
        setattr(adapter, target, weights)
    model = copy.copy(engine.model)  # keeps the base fingerprint already computed
    model.adapter = adapter
    h = hashlib.sha256(f"{engine.model.fingerprint}+lora{lora.rank}:{lora.alpha};".encode())
    for key in sorted(lora.tensors):
        h.update(lora.tensors[key].detach().float().cpu().numpy().tobytes())
    vars(model)["fingerprint"] = h.hexdigest()[:16]  # over the cached base id (a cached_property)
    return Engine(model, engine.chunk_size)


def merged(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """W + delta in W's dtype and device: the fp32 LoRA delta is added in fp32 and rounded once,
    so a bf16 model runs bf16 weights (its activations' dtype) that are as close as bf16 allows."""
    return (readable(weight).float() + delta.to(weight.device)).to(weight.dtype)  # a weight kept only packed: its values


def _key(layer: int, target: str, part: str) -> str:
    return f"layers.{layer}.{target}.{part}"


def _span(layers) -> str:
    layers = list(layers)
    return f"{layers[0]}..{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else ",".join(map(str, layers))

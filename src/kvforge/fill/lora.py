"""LoRA adapters on the engine's fused projections, saved as a `.safetensors` artifact.

Shapes: E hidden size, O a fused projection's output rows, r rank.

A LoRA pair (A (r, E), B (O, r)) per layer and target adds (alpha / r) * B @ A to the target's
weight. Targets are the fused q/k/v projection (`qkv`) and the fused MLP gate/up projection
(`gate_up`): the two matmuls every row runs in every layer, held by the family adapter. Training
swaps in W + delta for the duration of a forward (`applied`), so gradients reach A and B only;
inference runs a second weight set with the delta added once (`adapted_engine`), so an adapted
model runs at the base model's speed and the base engine keeps the base weights. A and B are
fp32 whatever the model's dtype; the merged weights take the model's (bf16 included). The artifact
names the base model and its fingerprint, and what the adapter was trained for (SPEED: the cut,
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

FORMAT = "kvforge.lora"
VERSION = "1"
TARGETS = ("qkv", "gate_up")


@dataclass
class LoraAdapter:
    rank: int
    alpha: float
    num_layers: int
    model: str
    fingerprint: str
    tensors: dict[str, torch.Tensor]  # "layers.{i}.{target}.{A|B}"
    info: dict = field(default_factory=dict)  # what it was trained for and how
    path: Path | None = None

    @classmethod
    def new(cls, adapter, rank: int, alpha: float, model: str, fingerprint: str, seed: int = 0) -> "LoraAdapter":
        """A fresh adapter: A random (scaled by 1/sqrt(E)), B zero, so it starts as the base model."""
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        recurrent = [layer for layer in range(adapter.num_layers) if adapter.is_recurrent(layer)]
        if recurrent:
            raise ValueError(
                f"LoRA adapters target softmax attention's q/k/v and the gated MLP; layers {recurrent} are linear-attention "
                "(Gated DeltaNet) layers, which they do not cover yet"
            )
        experts = [layer for layer in range(adapter.num_layers) if any(getattr(adapter, t)[layer] is None for t in TARGETS)]
        if experts:
            raise ValueError(f"LoRA adapters need a fused gate/up MLP on every layer; layers {experts} are mixtures of experts")
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for layer in range(adapter.num_layers):
            for target in TARGETS:
                weight = getattr(adapter, target)[layer][0]
                out_rows, in_cols = weight.shape
                tensors[_key(layer, target, "A")] = torch.randn(rank, in_cols, generator=g) / in_cols**0.5
                tensors[_key(layer, target, "B")] = torch.zeros(out_rows, rank)
        return cls(rank, alpha, adapter.num_layers, model, fingerprint, tensors)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def parameters(self) -> list[torch.Tensor]:
        return list(self.tensors.values())

    def delta(self, layer: int, target: str) -> torch.Tensor:
        return self.scale * self.tensors[_key(layer, target, "B")] @ self.tensors[_key(layer, target, "A")]

    @contextmanager
    def applied(self, adapter):
        """Within the block the adapter's fused weights are W + delta (differentiable in A, B)."""
        saved = {target: list(getattr(adapter, target)) for target in TARGETS}
        try:
            for target in TARGETS:
                fused = getattr(adapter, target)
                for layer, (weight, bias) in enumerate(saved[target]):
                    fused[layer] = (merged(weight, self.delta(layer, target)), bias)
            yield
        finally:
            for target in TARGETS:
                getattr(adapter, target)[:] = saved[target]

    def check_model(self, model: str, fingerprint: str, num_layers: int) -> None:
        if fingerprint != self.fingerprint or num_layers != self.num_layers:
            raise ArtifactError(
                f"adapter {self.path or ''} was trained on {self.model} (fingerprint {self.fingerprint}, "
                f"{self.num_layers} layers), not {model} (fingerprint {fingerprint}, {num_layers} layers)"
            )

    def save(self, path: str | Path) -> None:
        meta = {
            "format": FORMAT,
            "format_version": VERSION,
            "rank": str(self.rank),
            "alpha": str(self.alpha),
            "num_layers": str(self.num_layers),
            "model": self.model,
            "fingerprint": self.fingerprint,
            "targets": ",".join(TARGETS),
            "info": json.dumps(self.info),
        }
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.tensors.items()}
        atomic_save_safetensors(tensors, Path(path), meta)
        self.path = Path(path)

    @classmethod
    def load(cls, path: str | Path) -> "LoraAdapter":
        path = Path(path)
        if not path.is_file():
            raise ArtifactError(f"adapter file {path} does not exist")
        with read_artifact(path, FORMAT, VERSION, "adapter") as (f, meta):
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            adapter = cls(
                int(meta["rank"]), float(meta["alpha"]), int(meta["num_layers"]), meta["model"], meta["fingerprint"],
                tensors, json.loads(meta.get("info", "{}")), path,
            )
        expected = {_key(l, t, p) for l in range(adapter.num_layers) for t in TARGETS for p in "AB"}
        if set(tensors) != expected:
            raise ArtifactError(f"adapter {path} is incomplete: {len(expected - set(tensors))} LoRA tensors missing")
        return adapter


@torch.no_grad()
def adapted_engine(engine, lora: LoraAdapter):
    """A second engine over the same model whose fused q/k/v and gate/up weights are W + delta,
    new tensors; every other weight (embeddings, norms, o/down projections, head) is shared, and
    `engine` keeps the base weights. Its fingerprint is the base model's combined with the
    adapter's, so artifacts fitted on the base model are refused for it."""
    from kvforge.engine import Engine

    adapter = copy.copy(engine.adapter)
    for target in TARGETS:
        base = getattr(engine.adapter, target)
        setattr(adapter, target, [(merged(weight, lora.delta(layer, target)), bias) for layer, (weight, bias) in enumerate(base)])
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
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)


def _key(layer: int, target: str, part: str) -> str:
    return f"layers.{layer}.{target}.{part}"

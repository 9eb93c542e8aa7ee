"""The translator: per target layer ℓ and side (keys k, values v), a linear map from the
features of the source layers E_ℓ to the target layer's features.

Shapes: N rows; a source layer's features are (N, H_s·D_s), a target layer's (N, H_t·D_t).

  head-mixing  one dense (ν·H_s·D_s) × (H_t·D_t) matrix over the ν source layers side by side;
  head-wise    target head h reads only source head h of each source layer: H blocks of
               (ν·D_s) × D_t (needs H_s = H_t; H times fewer weights and FLOPs).
Both are stored as (G, in, out) with G = 1 or H, plus a bias (G·out,) (the closed-form fit is
centred, so the map is affine; stage 2 may train it). A head-mixing map may also read the
target's own token embeddings at the row and the `own_tokens`-1 rows before it
(`capture.OwnTokens`), side by side after the source layers. The artifact is one
.safetensors file whose metadata names both models (fingerprints), the capture point, the
alignment rule, the layer assignment and ν, the own-token count, and what it was fitted on.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from kvforge.cache import atomic_save_safetensors, read_artifact
from kvforge.errors import ArtifactError, UnknownModelError
from kvforge.translate.capture import OwnTokens

FORMAT = "kvforge.lingo"
FORMAT_VERSION = "1"
SIDES = ("k", "v")


@dataclass(frozen=True)
class ModelSide:
    """What a translator needs to know of one model."""

    name: str
    fingerprint: str
    num_layers: int
    kv_heads: int
    head_dim: int
    value_dim: int = 0  # a value's width where it differs from a key's (an MLA latent); 0: head_dim

    @property
    def width(self) -> int:
        """A key row's width (kv heads x head dim)."""
        return self.kv_heads * self.head_dim

    def dim(self, side: str) -> int:
        """Per-head width of one side: keys "k" or values "v"."""
        return self.value_dim if side == "v" and self.value_dim else self.head_dim

    def side_width(self, side: str) -> int:
        return self.kv_heads * self.dim(side)

    @classmethod
    def of(cls, engine) -> "ModelSide":
        a = engine.adapter
        if any(a.is_recurrent(layer) for layer in range(a.num_layers)):
            raise UnknownModelError(
                f"KV-Lingo translates K/V caches, and {engine.model.name} is a hybrid whose linear-attention layers "
                "hold a recurrent state, not K/V rows: not supported as a source or target"
            )
        heads, key_dim, value_dim = a.cache_dims(0)
        return cls(engine.model.name, engine.model.fingerprint, a.num_layers, heads, key_dim, 0 if value_dim == key_dim else value_dim)

    def label(self) -> str:
        return f"{self.name} (fingerprint {self.fingerprint})"


@dataclass
class Translator:
    source: ModelSide
    target: ModelSide
    capture: str
    align: str
    assign: str
    nu: int
    head_wise: bool
    sources: dict[str, list[list[int]]]  # side -> E_ℓ per target layer
    weights: dict[str, list[torch.Tensor]]  # side -> (G, in, out) per target layer
    biases: dict[str, list[torch.Tensor]]  # side -> (G·out,) per target layer
    info: dict = field(default_factory=dict)
    own_tokens: int = 0  # the target's own token embeddings each map reads (row t, t-1, ...)
    _casts: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # dtype -> (tensors, versions, Translator)

    @property
    def dtype(self) -> torch.dtype:
        return self.weights["k"][0].dtype

    def in_dtype(self, dtype: torch.dtype) -> "Translator":
        """These maps with weights and biases in `dtype`, for inference into a `dtype` cache: in
        bfloat16 the maps run on the CPU's bf16 matrix units (AMX: one 4K-row map 11x float32's
        speed; each matmul accumulates in float32, its output and the bias sum are bf16). Cast once
        and kept until a weight is replaced or changed in place (an optimizer step bumps a tensor's
        version)."""
        if self.dtype == dtype:
            return self
        tensors = tuple(t for side in SIDES for t in (*self.weights[side], *self.biases[side]))
        # Inference tensors (made under inference mode: a zeroed translator) keep no version and
        # no optimizer can step them.
        versions = tuple(-1 if t.is_inference() else t._version for t in tensors)
        kept = self._casts.get(dtype)
        if kept is None or kept[1] != versions or any(a is not b for a, b in zip(kept[0], tensors)):
            cast = lambda ts: [t.detach().to(dtype) for t in ts]  # noqa: E731
            kept = tensors, versions, dataclasses.replace(self, weights={s: cast(self.weights[s]) for s in SIDES},
                                                          biases={s: cast(self.biases[s]) for s in SIDES})
            self._casts[dtype] = kept
        return kept[2]

    @property
    def groups(self) -> int:
        return self.target.kv_heads if self.head_wise else 1

    def inputs(self, side: str, layer: int, source_features: list[torch.Tensor]) -> torch.Tensor:
        """(N, G, in): the features of E_ℓ, per head group when head-wise."""
        x = torch.stack([source_features[s] for s in self.sources[side][layer]], dim=1)  # (N, ν, H·D)
        n = x.shape[0]
        if not self.head_wise:
            return x.reshape(n, 1, -1)
        x = x.view(n, x.shape[1], self.source.kv_heads, self.source.dim(side)).transpose(1, 2)  # (N, H, ν, D)
        return x.reshape(n, self.source.kv_heads, -1)

    def apply(self, side: str, layer: int, source_features: list[torch.Tensor], own: OwnTokens | None = None) -> torch.Tensor:
        """Source features per layer (N, H_s·D_s) (and the target's own tokens) -> target layer
        features (N, H_t·D_t)."""
        if self.own_tokens and (own is None or own.count != self.own_tokens):
            raise ValueError(f"this translator reads the target's own {self.own_tokens} token embedding(s): pass them")
        x = self.inputs(side, layer, source_features)
        w = self.weights[side][layer]
        y = torch.einsum("ngi,gio->ngo", x.to(w.dtype), w[:, : x.shape[2]]).reshape(x.shape[0], -1)
        if self.own_tokens:
            # Weight rows past the source's: one (E, out) block per look-back j; its term depends on
            # the token alone, so it is computed per distinct token and gathered.
            blocks = w[0, x.shape[2] :].view(self.own_tokens, own.embeddings.shape[1], -1)  # (count, E, out)
            per_token = torch.einsum("ue,jeo->ujo", own.embeddings.to(w.dtype), blocks).reshape(-1, blocks.shape[2])
            # Row (u, j) of the table is token u's term at look-back j: one bag of `count` rows per row.
            rows = own.index * self.own_tokens + torch.arange(self.own_tokens, device=own.index.device)
            y = y + F.embedding_bag(rows, per_token, mode="sum")
        return y + self.biases[side][layer]

    def macs_per_token(self) -> int:
        """Multiply-accumulates of translating one token (both sides, every target layer)."""
        return sum(int(w.numel()) for side in SIDES for w in self.weights[side])

    def macs(self, rows: int, distinct_tokens: int = 0) -> int:
        """Multiply-accumulates of translating `rows` rows whose own tokens fill a table of
        `distinct_tokens` rows (`OwnTokens.embeddings`): own-token terms are computed per table row."""
        own = sum((int(w.shape[1]) - len(self.sources[side][layer]) * self.source.side_width(side)) * int(w.shape[2])
                  for side in SIDES for layer, w in enumerate(self.weights[side])) if self.own_tokens else 0
        return (self.macs_per_token() - own) * rows + own * distinct_tokens

    def zeroed(self) -> "Translator":
        """The untrained baseline: every map and bias zero (same shapes and assignment)."""
        zero = lambda ts: [torch.zeros_like(t) for t in ts]  # noqa: E731
        return Translator(
            self.source, self.target, self.capture, self.align, self.assign, self.nu, self.head_wise, self.sources,
            {s: zero(self.weights[s]) for s in SIDES}, {s: zero(self.biases[s]) for s in SIDES}, {"baseline": "zero"},
            self.own_tokens,
        )

    # --- checks ------------------------------------------------------------------------------
    def check_pair(self, source: ModelSide, target: ModelSide, capture: str | None = None) -> None:
        """One-line error unless this translator maps `source` into `target` (at `capture`)."""
        if (source.fingerprint, target.fingerprint) == (self.target.fingerprint, self.source.fingerprint) and source != target:
            raise ArtifactError(
                f"translator maps {self.source.name} → {self.target.name}, the other direction from {source.name} → {target.name}"
            )
        if source.fingerprint != self.source.fingerprint or target.fingerprint != self.target.fingerprint:
            raise ArtifactError(
                f"translator was fitted for {self.source.label()} → {self.target.label()}, "
                f"not {source.label()} → {target.label()}"
            )
        if capture is not None and capture != self.capture:
            raise ArtifactError(f"translator reads keys at {self.capture}, not {capture}")

    # --- artifact ----------------------------------------------------------------------------
    def save(self, path: str | Path, storage: torch.dtype = torch.float32) -> Path:
        """Write the artifact; `storage` torch.bfloat16 halves the file (the shipped translators:
        their held-out scores in bf16 are in artifacts/MANIFEST.json). Loading reads float32 either way."""
        if storage not in (torch.float32, torch.bfloat16):
            raise ValueError(f"a translator is stored in float32 or bfloat16, not {storage}")
        tensors: dict[str, torch.Tensor] = {}
        for side in SIDES:
            for layer, (w, b) in enumerate(zip(self.weights[side], self.biases[side])):
                tensors[f"{side}.{layer}.weight"] = w.detach().to(storage).contiguous()
                tensors[f"{side}.{layer}.bias"] = b.detach().to(storage).contiguous()
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kind": "translator",
            "source": json.dumps(asdict(self.source)),
            "target": json.dumps(asdict(self.target)),
            "capture": self.capture,
            "align": self.align,
            "assign": self.assign,
            "nu": str(self.nu),
            "head_wise": json.dumps(self.head_wise),
            "sources": json.dumps(self.sources),
            "info": json.dumps(self.info),
            "own_tokens": str(self.own_tokens),
        }
        path = Path(path)
        atomic_save_safetensors(tensors, path, meta)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Translator":
        path = Path(path)
        if not path.is_file():
            raise ArtifactError(f"no translator at {path}: fit one with `kvforge fit lingo`")
        with read_artifact(path, FORMAT, FORMAT_VERSION, "translator") as (f, meta):
            source, target = ModelSide(**json.loads(meta["source"])), ModelSide(**json.loads(meta["target"]))
            # Files written before own-token inputs existed read none.
            own_tokens = meta.get("own_tokens", "0")
            if not own_tokens.isdigit() or (int(own_tokens) and json.loads(meta["head_wise"])):
                raise ArtifactError(f"{path}: own_tokens {own_tokens!r} is not a count of own-token inputs a translator of this kind reads")
            own_tokens = int(own_tokens)
            # float32 whatever the file stores: stage 2 trains in float32, and a bf16 hand-off casts once (`in_dtype`)
            weights = {s: [f.get_tensor(f"{s}.{l}.weight").float() for l in range(target.num_layers)] for s in SIDES}
            biases = {s: [f.get_tensor(f"{s}.{l}.bias").float() for l in range(target.num_layers)] for s in SIDES}
            return cls(
                source, target, meta["capture"], meta["align"], meta["assign"], int(meta["nu"]), json.loads(meta["head_wise"]),
                json.loads(meta["sources"]), weights, biases, json.loads(meta["info"]), own_tokens,
            )

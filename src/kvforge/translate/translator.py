"""The translator: per target layer ℓ and side (keys k, values v), a linear map (with an optional
nonlinear residual branch, below) from the features of the source layers E_ℓ to the target layer's
features.

Shapes: N rows; a source layer's features are (N, H_s·D_s), a target layer's (N, H_t·D_t).

  head-mixing  one dense (ν·H_s·D_s) × (H_t·D_t) matrix over the ν source layers side by side;
  head-wise    target head h reads only source head h of each source layer: H blocks of
               (ν·D_s) × D_t (needs H_s = H_t; H times fewer weights and FLOPs).
Both are stored as (G, in, out) with G = 1 or H, plus a bias (G·out,) (the closed-form fit is
centred, so the map is affine; stage 2 may train it). A head-mixing map may also read the
target's own token embeddings at the row and the `own_tokens`-1 rows before it
(`capture.OwnTokens`), side by side after the source layers.

A head-mixing translator may add a nonlinear residual to each map (`with_residual`, trained by
stage 2): y = linear(x) + gelu(rms(x_src) · down) · up, over the source features x_src of E_ℓ
(RMS-normalised per row, so the branch works at any feature scale), with `down` (ν·H_s·D_s, r)
and `up` (r, H_t·D_t). `up` starts at zero, so stage 2 starts where the closed form ends.

The artifact is one .safetensors file whose metadata names both models (fingerprints), the
capture point, the alignment rule, the layer assignment and ν, the own-token count, the residual
width, and what it was fitted on. A file with a residual is format version 2 (a reader of
version 1 alone would drop the residual silently).
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
RESIDUAL_VERSION = "2"  # a translator with a residual branch
SIDES = ("k", "v")
STORE_NAMES = ("weight", "bias", "down", "up")  # tensor names in the file, in `Translator.stores` order


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
    down: dict[str, list[torch.Tensor]] | None = None  # side -> (in_src, r) per target layer: the residual branch, if any
    up: dict[str, list[torch.Tensor]] | None = None  # side -> (r, out) per target layer
    _casts: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # dtype -> (tensors, versions, Translator)

    @property
    def dtype(self) -> torch.dtype:
        return self.weights["k"][0].dtype

    @property
    def residual(self) -> int:
        """The residual branch's width r (0: none, a linear translator)."""
        return int(self.up["k"][0].shape[0]) if self.up is not None else 0

    def stores(self) -> list[dict[str, list[torch.Tensor]]]:
        """Every tensor store, side -> one tensor per target layer: the maps, the biases, and the
        residual branch's two matrices when there is one."""
        return [self.weights, self.biases] + ([self.down, self.up] if self.up is not None else [])

    def with_residual(self, width: int, seed: int = 0) -> "Translator":
        """This translator with a residual branch of `width` per map: `down` random (a seeded
        Gaussian over 1/sqrt(in)), `up` zero, so it translates exactly as before until trained."""
        if self.head_wise:
            raise ValueError("a residual branch needs a head-mixing translator (it reads every source head)")
        if width < 1:
            raise ValueError(f"the residual width must be >= 1, got {width}")
        if self.up is not None:
            raise ValueError(f"this translator has a residual branch of width {self.residual} already")
        g = torch.Generator().manual_seed(seed)
        down, up = {}, {}
        for side in SIDES:
            ins = [len(chosen) * self.source.side_width(side) for chosen in self.sources[side]]
            down[side] = [torch.randn(n, width, generator=g) / n**0.5 for n in ins]
            up[side] = [torch.zeros(width, self.target.side_width(side)) for _ in ins]
        # lists of its own: training replaces a store's tensors in place, and must not reach this one's
        return dataclasses.replace(self, weights={s: list(self.weights[s]) for s in SIDES}, biases={s: list(self.biases[s]) for s in SIDES},
                                   down=down, up=up)

    def in_dtype(self, dtype: torch.dtype) -> "Translator":
        """These maps (weights, biases and any residual branch) in `dtype`, for inference into a `dtype` cache: in
        bfloat16 the maps run on the CPU's bf16 matrix units (AMX: one 4K-row map 11x float32's
        speed; each matmul accumulates in float32, its output and the bias sum are bf16). Cast once
        and kept until a weight is replaced or changed in place (an optimizer step bumps a tensor's
        version)."""
        if self.dtype == dtype:
            return self
        tensors = tuple(t for store in self.stores() for side in SIDES for t in store[side])
        # Inference tensors (made under inference mode: a zeroed translator) keep no version and
        # no optimizer can step them.
        versions = tuple(-1 if t.is_inference() else t._version for t in tensors)
        kept = self._casts.get(dtype)
        if kept is None or kept[1] != versions or any(a is not b for a, b in zip(kept[0], tensors)):
            cast = lambda store: {s: [t.detach().to(dtype) for t in store[s]] for s in SIDES} if store is not None else None  # noqa: E731
            kept = tensors, versions, dataclasses.replace(self, weights=cast(self.weights), biases=cast(self.biases),
                                                          down=cast(self.down), up=cast(self.up))
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
        y = y + self.biases[side][layer]
        if self.up is not None:
            z = x.reshape(x.shape[0], -1).to(w.dtype)
            z = z * torch.rsqrt(z.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(z.dtype)
            y = y + F.gelu(z @ self.down[side][layer]) @ self.up[side][layer]
        return y

    def macs_per_token(self) -> int:
        """Multiply-accumulates of translating one token (both sides, every target layer)."""
        residual = sum(int(t.numel()) for store in ([self.down, self.up] if self.up is not None else []) for side in SIDES for t in store[side])
        return sum(int(w.numel()) for side in SIDES for w in self.weights[side]) + residual

    def macs(self, rows: int, distinct_tokens: int = 0) -> int:
        """Multiply-accumulates of translating `rows` rows whose own tokens fill a table of
        `distinct_tokens` rows (`OwnTokens.embeddings`): own-token terms are computed per table row."""
        own = sum((int(w.shape[1]) - len(self.sources[side][layer]) * self.source.side_width(side)) * int(w.shape[2])
                  for side in SIDES for layer, w in enumerate(self.weights[side])) if self.own_tokens else 0
        return (self.macs_per_token() - own) * rows + own * distinct_tokens

    def zeroed(self) -> "Translator":
        """The untrained baseline: every map and bias zero (same shapes and assignment; no residual
        branch, whose output would be zero too)."""
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
        for store, name in zip(self.stores(), STORE_NAMES):
            for side in SIDES:
                for layer, t in enumerate(store[side]):
                    tensors[f"{side}.{layer}.{name}"] = t.detach().to(storage).contiguous()
        meta = {
            "format": FORMAT,
            "format_version": RESIDUAL_VERSION if self.up is not None else FORMAT_VERSION,
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
            "residual": str(self.residual),
        }
        path = Path(path)
        atomic_save_safetensors(tensors, path, meta)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Translator":
        path = Path(path)
        if not path.is_file():
            raise ArtifactError(f"no translator at {path}: fit one with `kvforge fit lingo`")
        with read_artifact(path, FORMAT, (FORMAT_VERSION, RESIDUAL_VERSION), "translator") as (f, meta):
            source, target = ModelSide(**json.loads(meta["source"])), ModelSide(**json.loads(meta["target"]))
            # Files written before own-token inputs existed read none.
            own_tokens = meta.get("own_tokens", "0")
            if not own_tokens.isdigit() or (int(own_tokens) and json.loads(meta["head_wise"])):
                raise ArtifactError(f"{path}: own_tokens {own_tokens!r} is not a count of own-token inputs a translator of this kind reads")
            own_tokens = int(own_tokens)
            # float32 whatever the file stores: stage 2 trains in float32, and a bf16 hand-off casts once (`in_dtype`)
            read = lambda name: {s: [f.get_tensor(f"{s}.{l}.{name}").float() for l in range(target.num_layers)] for s in SIDES}  # noqa: E731
            residual = meta["format_version"] == RESIDUAL_VERSION
            width = meta.get("residual", "0")
            if not width.isdigit() or (int(width) > 0) != residual or (residual and json.loads(meta["head_wise"])):
                raise ArtifactError(f"{path}: residual width {width!r} does not fit a format {meta['format_version']} translator of this kind")
            down, up = (read("down"), read("up")) if residual else (None, None)
            if residual and any(d.shape[1] != int(width) or u.shape[0] != int(width) for side in SIDES for d, u in zip(down[side], up[side])):
                raise ArtifactError(f"{path}: its residual branches are not all {width} wide")
            return cls(
                source, target, meta["capture"], meta["align"], meta["assign"], int(meta["nu"]), json.loads(meta["head_wise"]),
                json.loads(meta["sources"]), read("weight"), read("bias"), json.loads(meta["info"]), own_tokens,
                down, up,
            )

"""Stage 1: closed-form translators from float64 second moments.

Both models prefill the same plain texts (the fit split of the packaged chat data) exactly; each
target row past the head is paired with its aligned source row(s) (`align`). For keys and for
values the moments of x = every source layer's features side by side against y = every target
layer's are accumulated once (`ridge.Moments`), so any layer assignment, head-wise or
head-mixing, is a sub-block: r2 and greedy selection cost ridge solves only. With `own_tokens`
the target's own token embeddings (`capture.own_tokens`) follow the source layers in x
and every head-mixing map reads them. Each map is then
solved by symmetric eigendecomposition with eigenvalues below `rel_tol` × the largest treated
as zero (λ = 0 by default, as the source; `lam` adds a ridge). Continuations are not used.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from kvforge import ridge
from kvforge.cache import atomic_save_safetensors, read_artifact
from kvforge.errors import ArtifactError
from kvforge.models.loading import dtype_name
from kvforge.data.prompts import plain_texts
from kvforge.translate.align import ALIGN_RULES, align, tokenize
from kvforge.translate.assign import ASSIGNMENTS, assign_layers, feature_block
from kvforge.translate.capture import cache_features, check_point, own_tokens
from kvforge.translate.translator import SIDES, ModelSide, Translator

MAX_OWN_TOKENS = 4


@dataclass(frozen=True)
class LingoFitConfig:
    capture: str = "pre-norm"
    align: str = "cover"
    # r2 with ν = 5 on 320 conversations (268K aligned rows) was the best closed form into SmolLM2:
    # +22.7 % bits per byte over native against +30.8 % for depth ν = 3 on 32 (docs/lingo.md).
    assign: str = "r2"
    nu: int = 5
    head_wise: bool = False
    conversations: int = 320
    max_chars: int = 4000  # per conversation: ~1K tokens on both models here
    lam: float = 0.0
    rel_tol: float = 1e-8
    # The target's own token embeddings (row t, t-1, ...) each map reads beside the source's: 2 took
    # the held-out gap from +45-48 % to +26-31 % (docs/lingo.md); 0 maps the source's rows alone.
    own_tokens: int = 2

    def __post_init__(self):
        check_point(self.capture)
        if not 0 <= self.own_tokens <= MAX_OWN_TOKENS:
            raise ValueError(f"own_tokens must be in 0..{MAX_OWN_TOKENS}, got {self.own_tokens}")
        if self.own_tokens and self.head_wise:
            raise ValueError("head-wise maps read one source head each; own-token inputs need head-mixing maps (drop --head-wise, or pass --own-tokens 0)")
        if self.align not in ALIGN_RULES:
            raise ValueError(f"unknown alignment rule {self.align!r}: use {', '.join(ALIGN_RULES)}")
        if self.assign not in ASSIGNMENTS:
            raise ValueError(f"unknown layer assignment {self.assign!r}: use {', '.join(ASSIGNMENTS)}")
        if self.conversations < 1 or self.max_chars < 16:
            raise ValueError("need at least one conversation of at least 16 characters")


def paired_features(source, target, text: str, capture: str, rule: str, own_count: int = 0):
    """(x per side: source layers side by side (N, L_s·W_s), then the own-token features
    (N, own·E); y: target layers (N, L_t·W_t)) for the target rows of `text` past the head."""
    src, tgt = tokenize(source.model.tokenizer, text), tokenize(target.model.tokenizer, text)
    alignment = align(src, tgt, rule)
    _, src_cache = source.prefill([src.ids], logits="none")
    _, tgt_cache = target.prefill([tgt.ids], logits="none")
    src_k, src_v = cache_features(source.adapter, src_cache, capture)
    tgt_k, tgt_v = cache_features(target.adapter, tgt_cache, capture)
    own = own_tokens(target, tgt.ids, alignment.head, len(tgt.ids) - alignment.head, own_count)
    own = [] if own is None else [own.features()]
    x = {"k": torch.cat([alignment.gather(f) for f in src_k] + own, 1), "v": torch.cat([alignment.gather(f) for f in src_v] + own, 1)}
    y = {"k": torch.cat([f[alignment.head :] for f in tgt_k], 1), "v": torch.cat([f[alignment.head :] for f in tgt_v], 1)}
    return x, y


def accumulate(source, target, texts: list[str], capture: str, rule: str, progress=None, own_count: int = 0,
               moments: dict[str, ridge.Moments] | None = None) -> dict[str, ridge.Moments]:
    """Moments of `texts`' aligned rows, added to `moments` in place when given (a fit in segments)."""
    s, t = ModelSide.of(source), ModelSide.of(target)
    own_width = own_count * target.adapter.hidden_size
    if moments is None:
        moments = {side: ridge.Moments.zeros(s.num_layers * s.side_width(side) + own_width, t.num_layers * t.side_width(side)) for side in SIDES}
    for text in texts:
        x, y = paired_features(source, target, text, capture, rule, own_count)
        for side in SIDES:
            moments[side].update(x[side], y[side])
        if progress:
            progress(x["k"].shape[0])
    return moments


def solve_translator(moments: dict[str, ridge.Moments], s: ModelSide, t: ModelSide, config: LingoFitConfig, progress=None) -> Translator:
    """Assign layers and solve every map from accumulated moments."""
    check_head_wise(config, s, t)
    sources, weights, biases, r2_fit = {}, {}, {}, {}
    for side in SIDES:
        m = moments[side]
        own_width = m.sx.shape[0] - s.num_layers * s.side_width(side)
        if bool(config.own_tokens) != bool(own_width):
            raise ValueError(f"the moments hold {own_width} own-token columns but the fit asks for {config.own_tokens} own tokens: accumulate with the same own_tokens")
        sources[side] = assign_layers(config.assign, s.num_layers, t.num_layers, config.nu, m, s.side_width(side), t.side_width(side), config.lam)
        weights[side], biases[side], r2_fit[side] = [], [], []
        for layer, chosen in enumerate(sources[side]):
            groups = t.kv_heads if config.head_wise else 1
            ws, bs, sse, sst = [], [], 0.0, 0.0
            for g in range(groups):
                inputs, outputs = _group_features(chosen, layer, g, s, t, config.head_wise, side)
                if config.own_tokens:  # the own-token block follows every source layer's features
                    inputs = torch.cat([inputs, torch.arange(s.num_layers * s.side_width(side), m.sx.shape[0])])
                sub = m.select(inputs, outputs)
                w, b = ridge.solve(sub, config.lam, config.rel_tol)
                e, total = ridge.residuals(sub, w, b)
                sse, sst = sse + float(e.sum()), sst + float(total.sum())
                ws.append(w.float())
                bs.append(b.float())
            weights[side].append(torch.stack(ws))
            biases[side].append(torch.cat(bs))
            r2_fit[side].append(1.0 - sse / max(sst, 1e-300))
            if progress:
                progress(side, layer)
    info = {
        "stage": 1,
        "fit": {**asdict(config), "tokens": moments["k"].n, "data": f"sharegpt fit split, {config.conversations} conversations as plain text, ≤ {config.max_chars} characters"},
        "r2_fit": r2_fit,
    }
    return Translator(s, t, config.capture, config.align, config.assign, config.nu, config.head_wise, sources, weights, biases, info,
                      config.own_tokens)


def check_head_wise(config: LingoFitConfig, s: ModelSide, t: ModelSide) -> None:
    if config.head_wise and s.kv_heads != t.kv_heads:
        raise ValueError(f"head-wise maps need equal KV head counts ({s.name}: {s.kv_heads}, {t.name}: {t.kv_heads}); drop --head-wise")


def _group_features(chosen: list[int], layer: int, group: int, s: ModelSide, t: ModelSide, head_wise: bool, side: str):
    """Input and output feature indices of one map: all heads (head-mixing) or one head."""
    sw, tw, sd, td = s.side_width(side), t.side_width(side), s.dim(side), t.dim(side)
    if not head_wise:
        return torch.cat([feature_block(c, sw) for c in chosen]), feature_block(layer, tw)
    inputs = torch.cat([c * sw + group * sd + torch.arange(sd) for c in chosen])
    return inputs, layer * tw + group * td + torch.arange(td)


def fit_lingo(source, target, config: LingoFitConfig, progress=None, snapshots: tuple[int, ...] = (), on_snapshot=None,
              keep_moments: bool = False):
    """Stage 1 end to end: capture, accumulate, assign, solve. `progress(tokens)` per text.

    `snapshots`: conversation counts below `config.conversations` at which a translator is also
    solved from the moments so far and handed to `on_snapshot(count, translator)`: the curve of
    quality against data from one pass (the texts are the same first-n at every count, so the
    snapshot at n is the fit of n conversations). With `keep_moments` the final moments are
    returned beside the translator (`LingoMoments`, to solve other assignments without prefilling)."""
    s, t = ModelSide.of(source), ModelSide.of(target)
    check_head_wise(config, s, t)
    bad = [n for n in snapshots if not 0 < n < config.conversations]
    if bad:
        raise ValueError(f"snapshots must lie between 0 and the {config.conversations} conversations fitted, got {bad}")
    start = time.perf_counter()
    texts = plain_texts("fit", config.conversations, min_chars=200, max_chars=config.max_chars)
    moments, done = None, 0
    for stop in sorted(set(snapshots)) + [config.conversations]:
        moments = accumulate(source, target, texts[done:stop], config.capture, config.align, progress, config.own_tokens, moments)
        done = stop
        if stop < config.conversations and on_snapshot:
            on_snapshot(stop, _solve_timed(moments, s, t, replace(config, conversations=stop), start))
    translator = _solve_timed(moments, s, t, config, start)
    return (translator, LingoMoments(s, t, config, moments, dtype_name(target.dtype))) if keep_moments else translator


def _solve_timed(moments, s: ModelSide, t: ModelSide, config: LingoFitConfig, start: float) -> Translator:
    translator = solve_translator(moments, s, t, config)
    translator.info["seconds"] = time.perf_counter() - start
    return translator


MOMENTS_FORMAT, MOMENTS_VERSION = "kvforge.lingo-moments", "1"
MOMENTS_FIELDS = ("sx", "sy", "xx", "xy", "yy")
# What the accumulated rows depend on; a solve from saved moments takes these from the file.
DATA_SETTINGS = ("capture", "align", "own_tokens", "conversations", "max_chars")


@dataclass
class LingoMoments:
    """A stage-1 fit's float64 moments with the models and data settings they came from: any layer
    assignment, ν, λ or head-wise choice is then solved from them without prefilling again."""

    source: ModelSide
    target: ModelSide
    config: LingoFitConfig
    moments: dict[str, ridge.Moments]
    dtype: str = "float32"  # the engines' dtype the rows were captured in

    def solve(self, source: ModelSide, target: ModelSide, config: LingoFitConfig) -> Translator:
        """The translator of `config`'s assignment, ν, λ and head-wise choice; its data settings
        must be (or are taken as) the file's."""
        if (source.fingerprint, target.fingerprint) != (self.source.fingerprint, self.target.fingerprint):
            raise ArtifactError(f"moments were accumulated for {self.source.label()} → {self.target.label()}, not {source.label()} → {target.label()}")
        config = replace(config, **{k: getattr(self.config, k) for k in DATA_SETTINGS})
        translator = _solve_timed(self.moments, source, target, config, time.perf_counter())
        translator.info["fit"]["from_moments"] = True
        return translator

    def save(self, path: str | Path) -> Path:
        tensors = {f"{side}.{f}": getattr(m, f).contiguous() for side, m in self.moments.items() for f in MOMENTS_FIELDS}
        meta = {"format": MOMENTS_FORMAT, "format_version": MOMENTS_VERSION, "kind": "lingo-moments",
                "source": json.dumps(asdict(self.source)), "target": json.dumps(asdict(self.target)),
                "config": json.dumps(asdict(self.config)), "dtype": self.dtype, "rows": json.dumps({side: m.n for side, m in self.moments.items()})}
        path = Path(path)
        atomic_save_safetensors(tensors, path, meta)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "LingoMoments":
        path = Path(path)
        if not path.is_file():
            raise ArtifactError(f"no moments at {path}: write them with `kvforge fit lingo --save-moments PATH`")
        with read_artifact(path, MOMENTS_FORMAT, MOMENTS_VERSION, "lingo moments file") as (f, meta):
            rows = json.loads(meta["rows"])
            moments = {side: ridge.Moments(int(rows[side]), *(f.get_tensor(f"{side}.{name}") for name in MOMENTS_FIELDS)) for side in SIDES}
            return cls(ModelSide(**json.loads(meta["source"])), ModelSide(**json.loads(meta["target"])),
                       LingoFitConfig(**json.loads(meta["config"])), moments, meta["dtype"])

"""KV-Lingo evaluation on held-out text: the target decoding from a translated cache against its
own native cache and against the source's own loss, plus the geometry of the two caches.

Each sample is a held-out conversation as plain text, cut at a character c where both tokenizers
start a token (the last such point within `prefix_chars`), so both models score exactly the same
continuation text[c:]. Loss is in bits per byte of that text (the tokenizers differ). Arms:
  target native      the target's exact cache of its prefix;
  target translated  the hand-off: the source's exact prefix cache translated (head rows native, and
                     the last `native_tail` rows when set);
  target zero        the same with every map zero (the untrained baseline);
  source native      the source's own exact cache.
In every arm the cache holds the prefix but its last token, and one teacher-forced forward over
that token and the continuation scores the continuation (`scoring.continuation_logits`). KL(target native ‖ translated) is per
continuation token, in nats. Diagnostics, on the prefix rows past the head: held-out R² per
target layer and side (variance-weighted, at the translator's capture point), the linear-CKA grid
between every source and target layer, and each layer's effective rank (exp of the entropy of
its covariance spectrum). Other translators of the pair (`compare`, say stage 1 against stage 2)
are scored on the same samples, with 95 % bootstrap intervals for bits per byte and KL.
Paired: the differences that decide whether a hand-off pays (the target from the translated cache
minus the source on its own cache, and minus the target on its own), each with a 95 % interval
from resampling conversations with both arms of a conversation kept together. Per alignment kind
(`translate.align.row_kinds`): the share of translated rows and of their squared K/V error, so a
kind of cross-tokenizer row that holds more than its share of the error shows.
`HeldOutBpb` scores the translated arm alone on the same conversations: the learning curve a
stage-2 run records.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvforge.data.prompts import plain_texts
from kvforge.scoring import continuation_logits, token_nll
from kvforge.translate.align import ROW_KINDS, row_kinds
from kvforge.translate.capture import cache_features, own_tokens
from kvforge.translate.handoff import translate_cache
from kvforge.translate.split import split_text
from kvforge.translate.translator import SIDES, Translator

LN2 = math.log(2.0)


@dataclass(frozen=True)
class LingoEvalSettings:
    samples: int = 24
    prefix_chars: int = 2000
    continuation_chars: int = 400
    skip: int = 0  # held-out conversations to skip
    native_tail: int = 0  # prefix tokens before the last that the target prefills itself (`translate_cache`)


class CacheGeometry:
    """Streamed per-layer and cross-layer second moments of aligned source/target features."""

    def __init__(self, source_layers: int, source_width: int, target_layers: int, target_width: int):
        self.ls, self.ws, self.lt, self.wt = source_layers, source_width, target_layers, target_width
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        self.n = 0
        self.sx, self.sy = z(source_layers * source_width), z(target_layers * target_width)
        self.xx = z(source_layers, source_width, source_width)
        self.yy = z(target_layers, target_width, target_width)
        self.xy = z(source_layers * source_width, target_layers * target_width)

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.double(), y.double()
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        xs = x.view(-1, self.ls, self.ws).transpose(0, 1)
        ys = y.view(-1, self.lt, self.wt).transpose(0, 1)
        self.xx += xs.transpose(1, 2) @ xs
        self.yy += ys.transpose(1, 2) @ ys
        self.xy += x.T @ y

    def _cov(self):
        mx, my = self.sx / self.n, self.sy / self.n
        mxs, mys = mx.view(self.ls, self.ws), my.view(self.lt, self.wt)
        cxx = self.xx / self.n - mxs.unsqueeze(2) * mxs.unsqueeze(1)
        cyy = self.yy / self.n - mys.unsqueeze(2) * mys.unsqueeze(1)
        cxy = self.xy / self.n - torch.outer(mx, my)
        return cxx, cyy, cxy

    def cka(self) -> list[list[float]]:
        """[source layer][target layer] linear CKA on token-centred features."""
        cxx, cyy, cxy = self._cov()
        blocks = cxy.view(self.ls, self.ws, self.lt, self.wt).permute(0, 2, 1, 3)
        num = (blocks**2).sum((2, 3))
        den = torch.linalg.matrix_norm(cxx).unsqueeze(1) * torch.linalg.matrix_norm(cyy).unsqueeze(0)
        return (num / den.clamp(min=1e-300)).tolist()

    def effective_ranks(self) -> tuple[list[float], list[float]]:
        cxx, cyy, _ = self._cov()
        return _effective_rank(cxx), _effective_rank(cyy)


def _effective_rank(cov: torch.Tensor) -> list[float]:
    values = torch.linalg.eigvalsh(cov).clamp(min=0)
    p = values / values.sum(-1, keepdim=True).clamp(min=1e-300)
    entropy = -(p * torch.log(p.clamp(min=1e-300))).sum(-1)
    return torch.exp(entropy).tolist()


@torch.inference_mode()
def eval_lingo(translator: Translator, source, target, settings: LingoEvalSettings, progress=None,
               compare: dict[str, Translator] | None = None) -> dict:
    """`compare`: other translators of the pair (say stage 1 against stage 2), scored on the same
    samples: bits per byte and KL each, with 95 % intervals."""
    s, t = translator.source, translator.target
    compare = compare or {}
    zero = translator.zeroed()
    texts = heldout_texts(settings)
    arms = {"target_native": [], "target_translated": [], "target_zero": [], "source_native": []}
    kl, kl_zero, byte_counts, tokens = [], [], [], 0
    other_nats = {label: [] for label in compare}
    other_kl = {label: [] for label in compare}
    token_counts = []
    r2_acc = {side: torch.zeros(t.num_layers, 2, dtype=torch.float64) for side in SIDES}  # SSE, Σ y²
    r2_sums = {side: torch.zeros(t.num_layers * t.side_width(side), dtype=torch.float64) for side in SIDES}
    geometry = {side: CacheGeometry(s.num_layers, s.side_width(side), t.num_layers, t.side_width(side)) for side in SIDES}
    kind_rows = dict.fromkeys(ROW_KINDS, 0)
    kind_sse = {side: dict.fromkeys(ROW_KINDS, 0.0) for side in SIDES}
    rows = 0
    for i, text in enumerate(texts):
        cut = split_text(source, target, text, settings.prefix_chars, translator.align)
        src, tgt, c, ps, pt = cut.src, cut.tgt, cut.cut, cut.source_prefix, cut.target_prefix
        alignment, src_cache, native = cut.alignment, cut.source_cache, cut.native_cache
        translated = translate_cache(translator, source, target, src_cache, alignment, tgt.ids, settings.native_tail)
        zeroed = translate_cache(zero, source, target, src_cache, alignment, tgt.ids, settings.native_tail)
        # Geometry and R² on the rows the translator wrote, at its capture point.
        if alignment.index.shape[0]:
            sk, sv = cache_features(source.adapter, src_cache, translator.capture)
            nk, nv = cache_features(target.adapter, native, translator.capture)
            own = own_tokens(target, tgt.ids, alignment.head, alignment.index.shape[0], translator.own_tokens)
            kinds = row_kinds(src.prefix(ps), tgt.prefix(pt), alignment)
            for kind in kinds:
                kind_rows[kind] += 1
            for side, sf, nf in (("k", sk, nk), ("v", sv, nv)):
                aligned = [alignment.gather(f) for f in sf]
                y = torch.cat([f[alignment.head :] for f in nf], 1)
                geometry[side].update(torch.cat(aligned, 1), y)
                row_sse = torch.zeros(len(kinds), dtype=torch.float64)
                for layer in range(t.num_layers):
                    truth = nf[layer][alignment.head :].double()
                    pred = translator.apply(side, layer, aligned, own).double()
                    row_sse += ((truth - pred) ** 2).sum(1)
                    r2_acc[side][layer, 0] += ((truth - pred) ** 2).sum()
                    r2_acc[side][layer, 1] += (truth**2).sum()
                for kind, e in zip(kinds, row_sse.tolist()):
                    kind_sse[side][kind] += e
                r2_sums[side] += y.double().sum(0)
            rows += alignment.index.shape[0]
        logits_native = continuation_logits(target, tgt.ids, pt, native)
        logits_translated = continuation_logits(target, tgt.ids, pt, translated)
        logits_zero = continuation_logits(target, tgt.ids, pt, zeroed)
        logits_compare = {label: continuation_logits(target, tgt.ids, pt, translate_cache(other, source, target, src_cache, alignment, tgt.ids,
                                                                                    settings.native_tail))
                          for label, other in compare.items()}
        src_cache.trim(1)
        logits_source = continuation_logits(source, src.ids, ps, src_cache)
        arms["target_native"].append(_nats(logits_native, tgt.ids[pt:]))
        arms["target_translated"].append(_nats(logits_translated, tgt.ids[pt:]))
        arms["target_zero"].append(_nats(logits_zero, tgt.ids[pt:]))
        arms["source_native"].append(_nats(logits_source, src.ids[ps:]))
        log_native = F.log_softmax(logits_native.double(), -1)
        kl.append(_kl(log_native, logits_translated))
        kl_zero.append(_kl(log_native, logits_zero))
        for label, logits_other in logits_compare.items():
            other_nats[label].append(_nats(logits_other, tgt.ids[pt:]))
            other_kl[label].append(sum(_kl(log_native, logits_other)))
        token_counts.append(len(tgt.ids) - pt)
        byte_counts.append(len(text[c:].encode("utf-8")))
        tokens += len(tgt.ids) - pt
        if progress:
            progress(i + 1, len(texts))
    total_bytes = sum(byte_counts)
    bpb = {arm: sum(v) / (LN2 * total_bytes) for arm, v in arms.items()}
    r2 = {}
    for side in SIDES:
        means = (r2_sums[side] / max(rows, 1)).view(t.num_layers, t.side_width(side))
        sst = r2_acc[side][:, 1] - rows * (means**2).sum(1)
        r2[side] = (1.0 - r2_acc[side][:, 0] / sst.clamp(min=1e-300)).tolist()
    ranks = {side: geometry[side].effective_ranks() for side in SIDES}
    return {
        "samples": len(texts),
        "tokens": tokens,
        "bytes": total_bytes,
        "translated_rows": rows,
        "bpb_target_native": bpb["target_native"],
        "bpb_target_translated": bpb["target_translated"],
        "bpb_target_zero": bpb["target_zero"],
        "bpb_source_native": bpb["source_native"],
        "bpb_ci": {arm: bootstrap_bpb(v, byte_counts) for arm, v in arms.items()},
        "kl": sum(sum(k) for k in kl) / tokens,
        "kl_ci": bootstrap_ratio([sum(k) for k in kl], token_counts),
        "kl_zero": sum(sum(k) for k in kl_zero) / tokens,
        "paired": {
            f"target_translated_minus_{arm}": paired_bpb(arms["target_translated"], arms[arm], byte_counts)
            for arm in ("source_native", "target_native")
        },
        "error_by_alignment": _error_by_kind(kind_rows, kind_sse),
        "compare": {
            label: {"bpb": sum(other_nats[label]) / (LN2 * total_bytes), "bpb_ci": bootstrap_bpb(other_nats[label], byte_counts),
                    "kl": sum(other_kl[label]) / tokens, "kl_ci": bootstrap_ratio(other_kl[label], token_counts)}
            for label in compare
        },
        "r2_keys": r2["k"],
        "r2_values": r2["v"],
        "r2_keys_mean": float(np.mean(r2["k"])),
        "r2_values_mean": float(np.mean(r2["v"])),
        "cka_keys": geometry["k"].cka(),
        "cka_values": geometry["v"].cka(),
        "effective_rank": {
            "source_keys": ranks["k"][0], "target_keys": ranks["k"][1], "source_values": ranks["v"][0], "target_values": ranks["v"][1],
        },
    }


def heldout_texts(settings: LingoEvalSettings) -> list[str]:
    """The held-out conversations an evaluation scores, long enough for a prefix and a continuation."""
    chars = settings.prefix_chars + settings.continuation_chars
    return plain_texts("held_out", settings.samples, min_chars=chars, max_chars=chars, skip=settings.skip)


class HeldOutBpb:
    """Bits per byte of the target's continuations from translated caches on the held-out
    conversations `eval_lingo` scores (its `bpb_target_translated` on the same settings), for a
    learning curve: called with the translator as it trains. Each call prefills the source and
    hands off again, so nothing large is kept between calls. `reference()` scores the two arms
    the curve is read against, which do not depend on the translator: the target and the source,
    each on its own cache."""

    def __init__(self, source, target, rule: str, settings: LingoEvalSettings):
        self.source, self.target, self.rule, self.settings = source, target, rule, settings
        self.texts = heldout_texts(settings)
        self.seconds = 0.0  # spent scoring, over every call
        # what a curve's scores depend on besides the translator: a run resumed under another is refused
        self.setting = (f"{len(self.texts)} held-out conversations from {settings.skip}, prefixes {settings.prefix_chars} and "
                        f"continuations {settings.continuation_chars} characters, native tail {settings.native_tail}")

    @torch.inference_mode()
    def __call__(self, translator: Translator) -> float:
        start = time.perf_counter()
        nats, byte_count = 0.0, 0
        for text in self.texts:
            cut = split_text(self.source, self.target, text, self.settings.prefix_chars, self.rule, native=False)
            cache = translate_cache(translator, self.source, self.target, cut.source_cache, cut.alignment, cut.tgt.ids, self.settings.native_tail)
            nats += _nats(continuation_logits(self.target, cut.tgt.ids, cut.target_prefix, cache), cut.tgt.ids[cut.target_prefix :])
            byte_count += len(text[cut.cut :].encode("utf-8"))
        self.seconds += time.perf_counter() - start
        return nats / (LN2 * byte_count)

    @torch.inference_mode()
    def reference(self) -> dict[str, float]:
        nats, byte_count = {"target_native": 0.0, "source_native": 0.0}, 0
        for text in self.texts:
            cut = split_text(self.source, self.target, text, self.settings.prefix_chars, self.rule)
            nats["target_native"] += _nats(continuation_logits(self.target, cut.tgt.ids, cut.target_prefix, cut.native_cache),
                                           cut.tgt.ids[cut.target_prefix :])
            cut.source_cache.trim(1)
            nats["source_native"] += _nats(continuation_logits(self.source, cut.src.ids, cut.source_prefix, cut.source_cache),
                                           cut.src.ids[cut.source_prefix :])
            byte_count += len(text[cut.cut :].encode("utf-8"))
        return {arm: n / (LN2 * byte_count) for arm, n in nats.items()}


def paired_bpb(nats_a: list[float], nats_b: list[float], byte_counts: list[int]) -> dict:
    """Bits per byte of arm a minus arm b on the same conversations, with a 95 % interval from
    resampling conversations (both arms of one kept together)."""
    diff = [(a - b) / LN2 for a, b in zip(nats_a, nats_b)]
    return {"bpb": sum(diff) / sum(byte_counts), "ci": bootstrap_ratio(diff, byte_counts)}


def _error_by_kind(rows: dict[str, int], sse: dict[str, dict[str, float]]) -> dict:
    """Per alignment kind with rows: its share of the translated rows and of their squared error
    (summed over layers, keys and values apart)."""
    total_rows = sum(rows.values())
    totals = {side: sum(sse[side].values()) for side in SIDES}
    return {
        kind: {"rows": n, "row_share": n / total_rows,
               **{f"{name}_error_share": sse[side][kind] / totals[side] if totals[side] else 0.0 for side, name in (("k", "key"), ("v", "value"))}}
        for kind, n in rows.items() if n
    }


def _nats(logits: torch.Tensor, targets: list[int]) -> float:
    return float(token_nll(logits, targets).double().sum())


def _kl(log_p: torch.Tensor, logits_q: torch.Tensor) -> list[float]:
    log_q = F.log_softmax(logits_q.double(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).tolist()


def bootstrap_ratio(values: list[float], weights: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """95 % interval of sum(values) / sum(weights), resampling whole samples."""
    if len(values) < 2:
        return [float("nan"), float("nan")]
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, len(values), (resamples, len(values)), generator=g)
    v = torch.tensor(values, dtype=torch.float64)[draws].sum(1) / torch.tensor(weights, dtype=torch.float64)[draws].sum(1)
    return torch.quantile(v, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()


def bootstrap_bpb(nats: list[float], byte_counts: list[int]) -> list[float]:
    """95 % interval of bits per byte, resampling whole samples."""
    return bootstrap_ratio([n / LN2 for n in nats], byte_counts)


def plot_cka(report: dict, translator: Translator, path) -> str:
    """Two panels (keys, values): CKA of every source layer against every target layer, with the
    translator's assignment marked."""
    from kvforge.bench.plotting import new_figure, save_figure

    fig, axes = new_figure(2, (11, 4.5))
    for ax, side, name in zip(axes, SIDES, ("keys", "values")):
        grid = np.array(report[f"cka_{name}"]).T  # target rows, source columns
        im = ax.imshow(grid, origin="lower", aspect="auto", vmin=0, vmax=1, cmap="viridis")
        for layer, chosen in enumerate(translator.sources[side]):
            ax.scatter(chosen, [layer] * len(chosen), s=8, c="red", marker="s")
        ax.set_xlabel(f"{translator.source.name} layer")
        ax.set_ylabel(f"{translator.target.name} layer")
        ax.set_title(f"linear CKA, {name} ({translator.capture}); red: {translator.assign} ν={translator.nu}")
        fig.colorbar(im, ax=ax)
    return str(save_figure(fig, Path(path)))

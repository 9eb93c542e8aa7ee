"""`kvforge eval ridgefill`: RidgeFill and the identity fill against exact on held-out data.

Continuation loss: a held-out sequence of `prompt_tokens + continuation` tokens; the prompt
(minus its last token) is prefilled by each arm, then the last prompt token and the continuation
run exactly (teacher forced), as decoding would, over the arm's cache. Loss is reported on novel
and key tokens (`metrics.token_classes`) as a perplexity gap to exact with a paired bootstrap 95 %
interval over samples.

Splice: the exact and RidgeFill caches mixed at the filled layers (RidgeFill keys with exact
values, and exact keys with RidgeFill values) say which component carries the error.

Needles: RULER niah_single haystacks with the needle inside the filled region, greedy answers,
string match, per arm.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kvforge.cache import KVCache, LayerCache
from kvforge.data.prompts import token_sequences
from kvforge.data.tasks import answered, needle_sample
from kvforge.engine import Engine
from kvforge.evaluate.metrics import mean_nll, paired_bootstrap_ci, ppl_gap_pct, token_classes
from kvforge.fill.maps import RidgeMaps
from kvforge.fill.ridgefill import RidgeFillConfig, final_depth, ridgefill_plan
from kvforge.generation import GenerationConfig


@dataclass(frozen=True)
class EvalSettings:
    samples: int = 12
    prompt_tokens: int = 2048
    continuation: int = 128
    needles: int = 20
    needle_tokens: int = 1600
    needle_depths: tuple[float, ...] = (0.1, 0.25, 0.4, 0.55, 0.7)


def eval_ridgefill(
    engine: Engine, maps: RidgeMaps, config: RidgeFillConfig, settings: EvalSettings, progress=None, memo: dict | None = None
) -> dict:
    """`memo` (a dict the caller keeps) lets a sweep over settings reuse the exact arm's caches and
    answers, which do not depend on the RidgeFill setting."""
    memo = {} if memo is None else memo
    arms = {"ridgefill": config, "identity": replace(config, fill="identity")}
    nll: dict[str, list[torch.Tensor]] = {name: [] for name in ["exact", *arms, "splice_filled_keys", "splice_filled_values"]}
    novel, key = [], []
    sequences = token_sequences(engine.model.tokenizer, settings.prompt_tokens + settings.continuation, "held_out")
    for i in range(settings.samples):
        seq = next(sequences)
        if progress:
            progress(f"continuation sample {i + 1}/{settings.samples}")
        prompt = seq[: settings.prompt_tokens - 1]
        if ("cache", i) not in memo:
            memo[("cache", i)] = _prefill(engine, prompt, None)
        exact_cache = memo[("cache", i)]
        plans = {name: ridgefill_plan(engine, prompt, c, maps) for name, c in arms.items()}
        caches = {name: _prefill(engine, prompt, plan) for name, plan in plans.items()}
        ridge_cache = caches["ridgefill"]
        caches["splice_filled_keys"] = _splice(exact_cache, ridge_cache, config.split, keys_from_fill=True)
        caches["splice_filled_values"] = _splice(exact_cache, ridge_cache, config.split, keys_from_fill=False)
        caches["exact"] = exact_cache
        for name, cache in caches.items():
            nll[name].append(_continuation_nll(engine, seq, settings.prompt_tokens, cache))
        filled = _filled_rows(plans["ridgefill"], len(prompt), engine.num_layers)
        n, k = token_classes(seq, settings.prompt_tokens, filled)
        novel.append(n)
        key.append(k)

    report: dict = {"arms": {}}
    for name in nll:
        report["arms"][name] = {
            "novel_nll": mean_nll(nll[name], novel),
            "key_nll": mean_nll(nll[name], key),
            "all_nll": mean_nll(nll[name], [torch.ones_like(m) for m in novel]),
        }
        if name != "exact":
            report["arms"][name].update(
                ppl_gap_novel_pct=ppl_gap_pct(nll[name], nll["exact"], novel),
                ppl_gap_novel_ci=paired_bootstrap_ci(nll[name], nll["exact"], novel),
                ppl_gap_key_pct=ppl_gap_pct(nll[name], nll["exact"], key),
                ppl_gap_key_ci=paired_bootstrap_ci(nll[name], nll["exact"], key),
            )
    report["novel_tokens"] = int(sum(int(m.sum()) for m in novel))
    report["key_tokens"] = int(sum(int(m.sum()) for m in key))
    report["needle"] = _needles(engine, maps, arms, settings, progress, memo)
    return report


def _filled_rows(plan, tokens: int, num_layers: int) -> torch.Tensor:
    """(T,) rows the plan filled, after any attention-based choice made during its prefill."""
    if plan is None:
        return torch.zeros(tokens, dtype=torch.bool)
    return final_depth(plan) < num_layers


def _prefill(engine: Engine, prompt: list[int], plan) -> KVCache:
    return engine.prefill([prompt], plan=plan)[1]


@torch.inference_mode()
def _continuation_nll(engine: Engine, seq: list[int], prompt_tokens: int, cache: KVCache) -> torch.Tensor:
    """(C,) nats of seq[prompt_tokens:] given the cache of seq[:prompt_tokens - 1], teacher forced.
    The cache is not modified (its rows past the prompt are trimmed back)."""
    ids = torch.tensor([seq[prompt_tokens - 1 : -1]], device=engine.device)
    positions = torch.arange(prompt_tokens - 1, len(seq) - 1, device=engine.device).unsqueeze(0)
    lengths = cache.lengths()
    logits = engine.forward(ids, positions, cache, "all")[0]  # (C, V)
    for layer, length in zip(cache.layers, lengths):
        layer.trim(layer.length - length)
    target = torch.tensor(seq[prompt_tokens:], device=logits.device)
    return F.cross_entropy(logits, target, reduction="none").cpu()


def _splice(exact: KVCache, filled: KVCache, split: int, keys_from_fill: bool) -> KVCache:
    """At layers >= split, keys from one cache and values from the other, at the rows the filled
    cache holds; lower layers are exact."""
    layers = []
    for i, (e, f) in enumerate(zip(exact.layers, filled.layers)):
        if i < split:
            layers.append(e.select_rows(torch.arange(e.length)))
            continue
        rows = f.row_positions()[0]  # the exact cache holds row p at index p
        ek, ev = e.keys()[:, :, rows], e.values()[:, :, rows]
        k, v = (f.keys(), ev) if keys_from_fill else (ek, f.values())
        layer = LayerCache(k.contiguous(), v.contiguous(), f.row_positions().clone(), f.row_kinds().clone(), length=f.length)
        layer.contiguous = f.contiguous
        layers.append(layer)
    return KVCache(layers)


def _needles(engine: Engine, maps: RidgeMaps, arms: dict, settings: EvalSettings, progress, memo: dict) -> dict:
    correct = {"exact": 0, **{name: 0 for name in arms}}
    in_filled = 0
    config = GenerationConfig(max_new_tokens=16)
    for i in range(settings.needles):
        depth = settings.needle_depths[i % len(settings.needle_depths)]
        sample = needle_sample(engine.model.tokenizer, settings.needle_tokens, depth, seed=i)
        if progress:
            progress(f"needle {i + 1}/{settings.needles} at depth {depth:.2f}")
        plans = {name: ridgefill_plan(engine, sample.prompt, c, maps) for name, c in arms.items()}
        start, end = sample.needle_rows
        if ("needle", i) not in memo:
            memo[("needle", i)] = answered(engine.generate(sample.prompt, config)[0].text, sample.value)
        correct["exact"] += memo[("needle", i)]
        for name, plan in plans.items():
            out = engine.generate(sample.prompt, config, plan=plan)[0]
            correct[name] += answered(out.text, sample.value)
        if bool(_filled_rows(plans["ridgefill"], len(sample.prompt), engine.num_layers)[start:end].all()):
            in_filled += 1  # the whole needle was filled (not rescued by the attention choice)
    n = settings.needles
    return {"samples": n, "needle_filled": in_filled, **{name: 100.0 * c / n if n else None for name, c in correct.items()}}


def summary(report: dict, model: str, config: RidgeFillConfig, prompt_tokens: int) -> dict:
    """The `eval ridgefill --json` object: the issue's figures at the top, one row per arm."""
    arms, needle = report["arms"], report["needle"]
    return {
        "command": "eval ridgefill",
        "model": model,
        "method": "ridgefill",
        "tokens": prompt_tokens,
        "split": config.split,
        "tail": config.tail,
        "attended_rows": config.attended_rows,
        "ppl_gap_novel_pct": arms["ridgefill"]["ppl_gap_novel_pct"],
        "ppl_gap_novel_ci": arms["ridgefill"]["ppl_gap_novel_ci"],
        "ppl_gap_key_pct": arms["ridgefill"]["ppl_gap_key_pct"],
        "identity_ppl_gap_novel_pct": arms["identity"]["ppl_gap_novel_pct"],
        "identity_ppl_gap_novel_ci": arms["identity"]["ppl_gap_novel_ci"],
        "identity_ppl_gap_key_pct": arms["identity"]["ppl_gap_key_pct"],
        "needle_exact": needle["exact"],
        "needle_ridgefill": needle["ridgefill"],
        "needle_identity": needle["identity"],
        "needle_samples": needle["samples"],
        "needle_filled": needle["needle_filled"],
        "splice": {
            "filled_keys_exact_values": arms["splice_filled_keys"],
            "exact_keys_filled_values": arms["splice_filled_values"],
        },
        "novel_tokens": report["novel_tokens"],
        "key_tokens": report["key_tokens"],
        "results": [{"tokens": prompt_tokens, "arm": name, **values} for name, values in arms.items()],
    }

"""`kvforge eval ridgefill`: RidgeFill and the identity fill against exact on held-out data.

Continuation loss: a held-out sequence of `prompt_tokens + continuation` tokens; the prompt
(minus its last token) is prefilled by each arm, then the last prompt token and the continuation
run exactly (teacher forced, `scoring.continuation_nll`), as decoding would, over the arm's cache.
Loss is reported on novel and key tokens (`metrics.token_classes`) and on all tokens as a
perplexity gap to exact with a paired bootstrap 95 % interval over samples.

Splice: the exact and RidgeFill caches mixed at the filled layers (RidgeFill keys with exact
values, and exact keys with RidgeFill values) say which component carries the error. On a hybrid
those two arms keep RidgeFill's recurrent states, and a third (`splice_exact_state`) keeps
RidgeFill's K/V with the exact recurrent states: how much of the error the state carries.

Needles: RULER niah_single haystacks, greedy answers, string match, per arm. The needle sits at
each depth of the haystack before the tail (the rows a fill can reach). Besides RidgeFill and the
identity fill at the given setting, the arm `ridgefill_no_attended` runs RidgeFill without the
tail-attended-row rescue, so the needle stays in filled rows and is found through the maps alone.
Per arm the report counts the needles whose rows were all filled and how many of those were
answered: only they say anything about the fill.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from kvforge.cache import CachedLayer, KVCache, LayerCache, RecurrentLayerCache
from kvforge.data.prompts import token_sequences
from kvforge.data.tasks import answered, needle_sample
from kvforge.engine import Engine
from kvforge.evaluate.metrics import mean_nll, paired_bootstrap_ci, ppl_gap_pct, token_classes
from kvforge.fill.maps import RidgeMaps
from kvforge.fill.ridgefill import RidgeFillConfig, ridgefill_plan
from kvforge.fill.rescue import DecodeRescue
from kvforge.generation import GenerationConfig
from kvforge.plan import final_depth
from kvforge.scoring import continuation_logits, continuation_nll, token_nll

NEEDLE_CONFIG = GenerationConfig(max_new_tokens=16)


@dataclass(frozen=True)
class EvalSettings:
    samples: int = 12
    prompt_tokens: int = 2048
    continuation: int = 128
    needles: int = 20
    needle_tokens: int = 1600
    needle_depths: tuple[float, ...] = (0.1, 0.25, 0.4, 0.55, 0.7)  # fractions of the haystack before the tail


def eval_ridgefill(
    engine: Engine, maps: RidgeMaps, config: RidgeFillConfig, settings: EvalSettings, progress=None, memo: dict | None = None
) -> dict:
    """`memo` (a dict the caller keeps) lets a sweep over settings reuse the exact arm's caches and
    needle answers. Entries are keyed by what determines them (the model's fingerprint, dtype,
    device and prefill chunk, the prompt's tokens and, for answers, the generation settings), so a
    changed setting never reads a stale one."""
    memo = {} if memo is None else memo
    model = _model_key(engine)
    arms = {"ridgefill": config, "identity": replace(config, fill="identity")}
    a = engine.adapter
    hybrid = any(a.is_recurrent(layer) for layer in range(a.num_layers))
    splices = ["splice_filled_keys", "splice_filled_values", *(["splice_exact_state"] if hybrid else [])]
    # a recurrent late layer turns the rescue off: no arm to score it beside
    rescuing = config.fill == "ridge" and config.rescue is not None and DecodeRescue.recurrent_late_layer(a, config.split) is None
    unrescued = ["ridgefill_no_rescue"] if rescuing else []
    nll: dict[str, list[torch.Tensor]] = {name: [] for name in ["exact", *arms, *unrescued, *splices]}
    novel, key = [], []
    rescued: list[tuple[int, int, int]] = []  # per sample: rows rescued, rescue events, filled rows
    sequences = token_sequences(engine.model.tokenizer, settings.prompt_tokens + settings.continuation, "held_out")
    for i in range(settings.samples):
        seq = next(sequences)
        if progress:
            progress(f"continuation sample {i + 1}/{settings.samples}")
        prompt = seq[: settings.prompt_tokens - 1]
        exact_key = ("exact_cache", model, tuple(prompt))
        if exact_key not in memo:
            memo[exact_key] = _prefill(engine, prompt, None)
        exact_cache = memo[exact_key]
        plans = {name: ridgefill_plan(engine, prompt, c, maps) for name, c in arms.items()}
        prefilled = {name: engine.prefill_with_states([prompt], plan=plan)[1:] for name, plan in plans.items()}
        caches = {name: cache for name, (cache, _) in prefilled.items()}
        ridge_cache = caches["ridgefill"]
        filled = _filled_rows(ridge_cache, len(prompt))
        if rescuing:  # the same prefill decoded with and without the rescue, which rewrites rows of its own copy
            caches["ridgefill"], caches["ridgefill_no_rescue"] = KVCache([_copy(layer) for layer in ridge_cache.layers]), ridge_cache
        caches["splice_filled_keys"] = _splice(exact_cache, ridge_cache, config.split, keys_from_fill=True)
        caches["splice_filled_values"] = _splice(exact_cache, ridge_cache, config.split, keys_from_fill=False)
        if hybrid:
            caches["splice_exact_state"] = _with_states_of(exact_cache, ridge_cache)
        caches["exact"] = exact_cache
        with torch.inference_mode():  # restore: the memoised exact cache is left as it was
            for name, cache in caches.items():
                between = DecodeRescue.start(engine, prompt, cache, prefilled[name][1], plans[name]) if name in plans else None
                nll[name].append(_continuation_nll(engine, seq, settings.prompt_tokens, cache, between).cpu())
                if between is not None:
                    rescued.append((between.rescued_rows, between.events, int(filled.sum())))
        n, k = token_classes(seq, settings.prompt_tokens, filled)
        novel.append(n)
        key.append(k)

    every = [torch.ones_like(m) for m in novel]
    report: dict = {"arms": {}}
    for name in nll:
        report["arms"][name] = {
            "novel_nll": mean_nll(nll[name], novel),
            "key_nll": mean_nll(nll[name], key),
            "all_nll": mean_nll(nll[name], every),
        }
        if name != "exact":
            report["arms"][name].update(
                ppl_gap_novel_pct=ppl_gap_pct(nll[name], nll["exact"], novel),
                ppl_gap_novel_ci=paired_bootstrap_ci(nll[name], nll["exact"], novel),
                ppl_gap_key_pct=ppl_gap_pct(nll[name], nll["exact"], key),
                ppl_gap_key_ci=paired_bootstrap_ci(nll[name], nll["exact"], key),
                ppl_gap_all_pct=ppl_gap_pct(nll[name], nll["exact"], every),
                ppl_gap_all_ci=paired_bootstrap_ci(nll[name], nll["exact"], every),
            )
    if rescued:
        rows, events, filled_total = (sum(r[i] for r in rescued) for i in range(3))
        report["rescue"] = {**asdict(config.rescue), "rows_per_sample": rows / len(rescued), "events_per_sample": events / len(rescued),
                            "share_of_filled": rows / filled_total if filled_total else 0.0, "continuation": settings.continuation}
    report["novel_tokens"] = int(sum(int(m.sum()) for m in novel))
    report["key_tokens"] = int(sum(int(m.sum()) for m in key))
    report["all_tokens"] = int(sum(m.numel() for m in every))
    needle_arms = {**arms, "ridgefill_no_attended": replace(config, attended_rows=0),
                   **({"ridgefill_no_rescue": replace(config, rescue=None)} if rescuing else {})}
    report["needle"] = _needles(engine, maps, needle_arms, settings, progress, memo, model)
    return report


def _continuation_nll(engine: Engine, seq: list[int], prompt_tokens: int, cache: KVCache, between=None) -> torch.Tensor:
    """(T,) nats of seq[prompt_tokens:] over `cache`, teacher forced (`_continuation_logits`)."""
    if between is None:
        return continuation_nll(engine, seq, prompt_tokens, cache, restore=True)
    return token_nll(_continuation_logits(engine, seq, prompt_tokens, cache, between), seq[prompt_tokens:])


def _continuation_logits(engine: Engine, seq: list[int], prompt_tokens: int, cache: KVCache, between) -> torch.Tensor:
    """(T, V) logits predicting seq[prompt_tokens:] given `cache` holding seq[:prompt_tokens - 1],
    scored as decoding runs RidgeFill's rescue (`fill.rescue`): the row of each token past the
    prompt rides with the rows that token calls for, which it and every later row read."""
    between.extend([seq[prompt_tokens - 1]])  # the prompt's last token: generation prefills it with the prompt
    parts, start = [], prompt_tokens - 1
    for t in range(prompt_tokens, len(seq) - 1):
        rows = between.observe(seq[t])
        if rows:  # rows before t in one chunk, then the rescue, then row t as decoding runs it: a step of its own
            if t > start:
                parts.append(continuation_logits(engine, seq[: t + 1], start + 1, cache))
            between.late_layers(engine, cache, rows)
            parts.append(engine.decode_step(torch.tensor([seq[t]]), cache, torch.tensor([t])))
            start = t + 1
    if start < len(seq) - 1:
        parts.append(continuation_logits(engine, seq, start + 1, cache))
    return torch.cat(parts)


def _model_key(engine: Engine) -> tuple:
    """What about the engine changes an exact result: weights and architecture, dtype, device,
    prefill chunking."""
    return (engine.model.fingerprint, str(engine.dtype), str(engine.device), engine.chunk_size)


def _filled_rows(cache: KVCache, tokens: int) -> torch.Tensor:
    """(T,) prompt rows its prefill did not run full depth, after any attention-based choice:
    read off the cache."""
    return final_depth(cache, tokens) < len(cache)


def _prefill(engine: Engine, prompt: list[int], plan) -> KVCache:
    return engine.prefill([prompt], plan=plan)[1]


def _splice(exact: KVCache, filled: KVCache, split: int, keys_from_fill: bool) -> KVCache:
    """At layers >= split, keys from one cache and values from the other, at the rows the filled
    cache holds; lower layers are exact."""
    layers = []
    for i, (e, f) in enumerate(zip(exact.layers, filled.layers)):
        if i < split:
            layers.append(_copy(e))
            continue
        if isinstance(f, RecurrentLayerCache):  # a recurrent state has no keys or values to swap: the fill's
            layers.append(_copy(f))
            continue
        rows = f.row_positions()[0]  # the exact cache holds row p at index p
        ek, ev = e.keys()[:, :, rows], e.values()[:, :, rows]
        k, v = (f.keys(), ev) if keys_from_fill else (ek, f.values())
        layer = LayerCache(k.contiguous(), v.contiguous(), f.row_positions().clone(), f.row_kinds().clone(), length=f.length)
        layer.contiguous = f.contiguous
        layers.append(layer)
    return KVCache(layers)


def _with_states_of(exact: KVCache, filled: KVCache) -> KVCache:
    """The filled cache with every recurrent layer's state taken from the exact cache."""
    return KVCache([_copy(e if isinstance(e, RecurrentLayerCache) else f) for e, f in zip(exact.layers, filled.layers)])


def _copy(layer: CachedLayer) -> CachedLayer:
    """A copy that scoring may append to and trim without touching the original."""
    return layer.select_batch(torch.arange(layer.batch))


def _needles(engine: Engine, maps: RidgeMaps, arms: dict, settings: EvalSettings, progress, memo: dict, model: tuple) -> dict:
    """Per arm: the share of needles answered, the needles whose rows were all filled and how many
    of those were answered. Arms with equal settings are run once."""
    correct = {"exact": 0, **{name: 0 for name in arms}}
    filled = {name: 0 for name in arms}
    filled_correct = {name: 0 for name in arms}
    for i in range(settings.needles):
        depth = settings.needle_depths[i % len(settings.needle_depths)]
        tail = arms["ridgefill"].tail
        reach = depth * max(0.0, 1.0 - tail / settings.needle_tokens)  # before the tail, which is always exact
        sample = needle_sample(engine.model.tokenizer, settings.needle_tokens, reach, seed=i)
        if progress:
            progress(f"needle {i + 1}/{settings.needles} at depth {depth:.2f} of the rows before the tail")
        start, end = sample.needle_rows
        exact_key = ("exact_answer", model, tuple(sample.prompt), NEEDLE_CONFIG)
        if exact_key not in memo:
            memo[exact_key] = engine.generate(sample.prompt, NEEDLE_CONFIG)[0].text
        correct["exact"] += answered(memo[exact_key], sample.value)
        results: dict[str, tuple[bool, bool]] = {}  # arm -> (answered, needle wholly filled)
        for name, c in arms.items():
            same = next((other for other in results if arms[other] == c), None)
            if same is None:
                cache = engine.new_cache(1, capacity=len(sample.prompt) + NEEDLE_CONFIG.max_new_tokens)
                plan = ridgefill_plan(engine, sample.prompt, c, maps)
                text = engine.generate(sample.prompt, NEEDLE_CONFIG, plan=plan, cache=cache)[0].text
                whole = bool(_filled_rows(cache, len(sample.prompt))[start:end].all())
                results[name] = (answered(text, sample.value), whole)
            else:
                results[name] = results[same]
            ok, whole = results[name]
            correct[name] += ok
            filled[name] += whole
            filled_correct[name] += ok and whole
    n = settings.needles
    pct = lambda count, total: 100.0 * count / total if total else None  # noqa: E731
    return {
        "samples": n,
        **{name: pct(c, n) for name, c in correct.items()},
        "needle_filled": filled["ridgefill"],  # needles wholly in RidgeFill's filled rows
        "filled": filled,
        "answered_in_filled": filled_correct,
        "in_filled_pct": {name: pct(filled_correct[name], filled[name]) for name in arms},
    }


def summary(report: dict, model: str, config: RidgeFillConfig, prompt_tokens: int) -> dict:
    """The `eval ridgefill --json` object: the issue's figures at the top, one row per arm."""
    arms, needle = report["arms"], report["needle"]
    needle_arms = list(needle["filled"])
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
        "ppl_gap_all_pct": arms["ridgefill"]["ppl_gap_all_pct"],
        "ppl_gap_all_ci": arms["ridgefill"]["ppl_gap_all_ci"],
        "ppl_gap_key_pct": arms["ridgefill"]["ppl_gap_key_pct"],
        "identity_ppl_gap_novel_pct": arms["identity"]["ppl_gap_novel_pct"],
        "identity_ppl_gap_novel_ci": arms["identity"]["ppl_gap_novel_ci"],
        "identity_ppl_gap_all_pct": arms["identity"]["ppl_gap_all_pct"],
        "identity_ppl_gap_all_ci": arms["identity"]["ppl_gap_all_ci"],
        "identity_ppl_gap_key_pct": arms["identity"]["ppl_gap_key_pct"],
        "rescue": report.get("rescue"),  # None: decoding left the filled rows alone
        **({f"no_rescue_ppl_gap_{c}_pct": arms["ridgefill_no_rescue"][f"ppl_gap_{c}_pct"] for c in ("novel", "all", "key")}
           if "ridgefill_no_rescue" in arms else {}),
        "needle_exact": needle["exact"],
        "needle_ridgefill": needle["ridgefill"],
        "needle_identity": needle["identity"],
        "needle_ridgefill_no_attended": needle["ridgefill_no_attended"],
        "needle_samples": needle["samples"],
        "needle_filled": needle["needle_filled"],
        "needle_by_arm": {
            name: {
                "answered_pct": needle[name],
                "filled": needle["filled"][name],
                "answered_in_filled": needle["answered_in_filled"][name],
                "answered_in_filled_pct": needle["in_filled_pct"][name],
            }
            for name in needle_arms
        },
        "splice": {
            "filled_keys_exact_values": arms["splice_filled_keys"],
            "exact_keys_filled_values": arms["splice_filled_values"],
            **({"filled_kv_exact_recurrent_state": arms["splice_exact_state"]} if "splice_exact_state" in arms else {}),
        },
        "novel_tokens": report["novel_tokens"],
        "key_tokens": report["key_tokens"],
        "all_tokens": report["all_tokens"],
        "results": [{"tokens": prompt_tokens, "arm": name, **values} for name, values in arms.items()],
    }

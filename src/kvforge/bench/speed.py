"""`kvforge bench speed`: time to first token, time per output token and active KV bytes of
exact prefill vs SPEED at several cuts, in one process on the same held-out prompt, arms
interleaved after a warm-up, medians.

Each timed call prefills (TTFT) and then decodes `decode_tokens` greedy tokens (TPOT = decode
time / tokens). Below the cut both arms run the same layer code on the same rows; above it SPEED
runs the full-depth rows only. Ceilings beside the measurements: TTFT from multiply-accumulates
(absent rows cost nothing above the cut, and the full-depth rows there attend only to each
other), TPOT from the multiply-accumulates of the same `decode_tokens` steps (projections, MLP
and head are the same; attention above the cut reads a few rows instead of the prompt), KV from
the cache. Per-round speedups (`*_speedup_runs`, exact and SPEED timed in the same round) show
the run-to-run spread the medians hide.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from kvforge.flops import decode_span_macs, exact_macs, prefill_macs
from kvforge.bench.harness import environment, interleaved_samples, synchronize
from kvforge.bench.plotting import new_figure, save_figure
from kvforge.data.prompts import held_out_text_tokens
from kvforge.engine import Engine
from kvforge.fill.speed import DEFAULT_TAIL, SpeedConfig, speed_plan
from kvforge.plan import PrefillPlan, PrefillReport


def bench_speed(
    engine: Engine, configs: list[SpeedConfig], lengths: list[int], runs: int = 3, decode_tokens: int = 64, progress=None
) -> dict:
    num_layers = engine.num_layers
    results = []
    for tokens in lengths:
        if tokens + decode_tokens >= engine.model.context_length:
            raise ValueError(f"{tokens} tokens + {decode_tokens} decoded exceed the context of {engine.model.context_length}")
        prompt = held_out_text_tokens(engine.model.tokenizer, tokens)
        plans = {"exact": None, **{f"cut {c.cut}": speed_plan(tokens, c, num_layers) for c in configs}}
        if progress:
            progress(f"{tokens} tokens: {len(plans)} arms x{runs}, {decode_tokens} decoded tokens each")
        samples = interleaved_samples({name: _prefill_then_decode(engine, prompt, plan, decode_tokens) for name, plan in plans.items()}, runs)
        timings = {name: {key: statistics.median(r[key] for r in rows) for key in ("ttft", "tpot")} for name, rows in samples.items()}
        exact = timings["exact"]
        exact_cache = engine.prefill([prompt])[1]
        kv_exact = exact_cache.nbytes
        for config in configs:
            name, plan = f"cut {config.cut}", plans[f"cut {config.cut}"]
            cache = engine.prefill([prompt], plan=plan)[1]
            ran = PrefillReport.of(plan, cache, tokens).as_dict()
            kv = cache.nbytes
            t = timings[name]
            results.append(
                {
                    "tokens": tokens,
                    "method": "speed",
                    **{key: ran[key] for key in ("prefill", "reason", "shallow_rows")},  # "exact" and why, when no row was shallow
                    "cut": config.cut,
                    "cut_fraction": config.fraction(num_layers),
                    "exact_ttft_s": exact["ttft"],
                    "speed_ttft_s": t["ttft"],
                    "ttft_speedup": exact["ttft"] / t["ttft"],
                    "ttft_speedup_runs": _per_round(samples["exact"], samples[name], "ttft"),
                    "ttft_ceiling": exact_macs(engine.adapter, tokens) / prefill_macs(engine.adapter, plan.depth, None, False),
                    "exact_tpot_s": exact["tpot"],
                    "speed_tpot_s": t["tpot"],
                    "tpot_speedup": exact["tpot"] / t["tpot"],
                    "tpot_speedup_runs": _per_round(samples["exact"], samples[name], "tpot"),
                    # over the same decode steps the TPOT averages: step i sees each layer's rows + i
                    "tpot_ceiling": decode_span_macs(engine.adapter, exact_cache.lengths(), decode_tokens)
                    / decode_span_macs(engine.adapter, cache.lengths(), decode_tokens),
                    "kv_bytes_exact": kv_exact,
                    "kv_bytes_speed": kv,
                    "kv_reduction_pct": 100.0 * (1 - kv / kv_exact),
                    # every shallow row is absent from the layers at and above the cut
                    "kv_reduction_ceiling_pct": 100.0 * (num_layers - config.cut) / num_layers,
                }
            )
    return {
        "command": "bench speed",
        "model": engine.model.name,
        "method": "speed",
        "tokens": lengths,
        "cuts": [c.cut for c in configs],
        "anchors_first": configs[0].first if configs else 1,
        "tail": configs[0].tail if configs else DEFAULT_TAIL,
        "decode_tokens": decode_tokens,
        "runs": runs,
        **environment(engine),
        "results": results,
    }


def _prefill_then_decode(engine: Engine, prompt: list[int], plan: PrefillPlan | None, decode_tokens: int):
    def run() -> dict[str, float]:
        synchronize()
        start = time.perf_counter()
        logits, cache = engine.prefill([prompt], plan=plan)
        token = logits.argmax(-1)
        synchronize()
        first = time.perf_counter()
        position = torch.tensor([len(prompt)], device=engine.device)
        for i in range(decode_tokens):
            token = engine.decode_step(token, cache, position + i).argmax(-1)
        synchronize()
        return {"ttft": first - start, "tpot": (time.perf_counter() - first) / max(1, decode_tokens)}

    return run


def _per_round(exact: list[dict[str, float]], speed: list[dict[str, float]], key: str) -> list[float]:
    """exact / SPEED for each round, both timed in the same stretch of time."""
    return [e[key] / s[key] for e, s in zip(exact, speed)]


def plot(report: dict, path: Path) -> Path:
    """PNG: TTFT and TPOT speedup vs prompt tokens, one line per cut, ceilings dashed."""
    fig, axes = new_figure(2, (10, 4))
    for ax, key, title in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        for cut in report["cuts"]:
            rows = [r for r in report["results"] if r["cut"] == cut]
            x = [r["tokens"] for r in rows]
            line = ax.plot(x, [r[f"{key}_speedup"] for r in rows], "o-", label=f"cut {cut}")[0]
            ax.plot(x, [r[f"{key}_ceiling"] for r in rows], "--", color=line.get_color())
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(f"{title} speedup over exact (dashed: ceiling)")
        ax.legend()
    fig.suptitle(f"{report['model']}: SPEED, {report['threads']} thread(s)")
    return save_figure(fig, path)

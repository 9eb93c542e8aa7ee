"""`kvforge bench ridgefill`: time to first token of exact, RidgeFill (maps resident and
streamed) and the identity fill, in one process on the same held-out prompt, interleaved, after
a warm-up; the MAC ceiling of the same plan beside the measured speedup."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path


from kvforge.bench.flops import exact_macs, prefill_macs
from kvforge.bench.harness import environment, interleaved_medians
from kvforge.bench.plotting import new_figure, save_figure
from kvforge.data.prompts import held_out_text_tokens
from kvforge.engine import Engine
from kvforge.fill.maps import RidgeMaps
from kvforge.fill.ridgefill import RidgeFillConfig, ridgefill_plan
from kvforge.plan import PrefillReport, final_depth


def bench_ridgefill(
    engine: Engine, maps: RidgeMaps, streamed: RidgeMaps, config: RidgeFillConfig, lengths: list[int], runs: int = 3, progress=None
) -> dict:
    arms = {"ridgefill": (config, maps), "ridgefill_streamed": (config, streamed), "identity": (replace(config, fill="identity"), None)}
    results = []
    for tokens in lengths:
        if tokens >= engine.model.context_length:
            raise ValueError(f"{tokens} tokens exceed the context of {engine.model.context_length}")
        prompt = held_out_text_tokens(engine.model.tokenizer, tokens)
        if progress:
            progress(f"{tokens} tokens: {len(arms) + 1} arms x{runs}")
        # The plan is built inside each timed call: choosing rows and reading maps are part of TTFT.
        timings = interleaved_medians(
            {"exact": lambda: engine.prefill([prompt]), **{name: _planned(engine, prompt, c, m) for name, (c, m) in arms.items()}},
            runs=runs,
        )
        plan = ridgefill_plan(engine, prompt, config, maps)
        _, cache = engine.prefill([prompt], plan=plan)
        exact_kv = engine.prefill([prompt])[1].nbytes
        depth = final_depth(cache, tokens)  # after the attention-chosen rows
        ran = PrefillReport.of(plan, cache, tokens).as_dict()
        ceiling = exact_macs(engine.adapter, tokens) / prefill_macs(engine.adapter, depth, config.split, True, len(maps.inputs), maps.predicts_normed)
        results.append(
            {
                "tokens": tokens,
                "method": "ridgefill",
                **{key: ran[key] for key in ("prefill", "reason", "filled_rows")},  # "exact" and why, when nothing was filled
                "split": config.split,
                "tail": config.tail,
                "exact_ttft_s": timings["exact"],
                "ridgefill_ttft_s": timings["ridgefill"],
                "ridgefill_streamed_ttft_s": timings["ridgefill_streamed"],
                "identity_ttft_s": timings["identity"],
                "speedup": timings["exact"] / timings["ridgefill"],
                "speedup_streamed": timings["exact"] / timings["ridgefill_streamed"],
                "speedup_identity": timings["exact"] / timings["identity"],
                "ceiling": ceiling,
                "fraction_of_ceiling": (timings["exact"] / timings["ridgefill"]) / ceiling,
                "filled_fraction": float((depth < engine.num_layers).float().mean()),
                # sliding-window layers skip filled rows no exact row can read
                "kv_bytes_exact": exact_kv,
                "kv_bytes_ridgefill": cache.nbytes,
            }
        )
    return {
        "command": "bench ridgefill",
        "model": engine.model.name,
        "method": "ridgefill",
        "tokens": lengths,
        "split": config.split,
        "tail": config.tail,
        "attended_rows": config.attended_rows,
        "map_inputs": list(maps.inputs),
        "map_target": maps.target,
        "maps_resident_bytes": maps.resident_bytes(config.split),
        "maps_streamed_bytes": maps.layer_bytes(),
        "runs": runs,
        **environment(engine),
        "results": results,
    }


def _planned(engine: Engine, prompt: list[int], config: RidgeFillConfig, maps: RidgeMaps | None):
    return lambda: engine.prefill([prompt], plan=ridgefill_plan(engine, prompt, config, maps))


def plot(report: dict, path: Path) -> Path:
    """PNG of measured speedup (resident, streamed, identity) and the MAC ceiling vs tokens."""
    rows = report["results"]
    x = [r["tokens"] for r in rows]
    fig, ax = new_figure()
    ax.plot(x, [r["ceiling"] for r in rows], "k--", label="MAC ceiling")
    ax.plot(x, [r["speedup"] for r in rows], "o-", label="RidgeFill, maps resident")
    ax.plot(x, [r["speedup_streamed"] for r in rows], "s-", label="RidgeFill, maps streamed")
    ax.plot(x, [r["speedup_identity"] for r in rows], "^-", label="identity fill")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT speedup over exact")
    ax.set_title(f"{report['model']}: split {report['split']}, tail {report['tail']}, {report['threads']} thread(s)")
    ax.legend()
    return save_figure(fig, path)

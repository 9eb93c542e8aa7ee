"""`kvforge bench ridgefill`: time to first token of exact, RidgeFill (maps resident and
streamed) and the identity fill, in one process on the same held-out prompt, interleaved, after
a warm-up; the MAC ceiling of the same plan beside the measured speedup. With `decode_tokens`,
also the decode speed of `decode_tokens` greedy tokens after exact prefill and after RidgeFill
with and without its decode-time rescue (`fill.rescue`), and the rows the rescue recomputed:
what the rescue costs while decoding (each arm decodes its own greedy continuation)."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path


from kvforge.flops import exact_macs, prefill_macs
from kvforge.bench.harness import environment, interleaved_medians, interleaved_samples
from kvforge.bench.plotting import new_figure, save_figure
from kvforge.data.prompts import held_out_text_tokens
from kvforge.engine import Engine
from kvforge.fill.maps import RidgeMaps
from kvforge.fill.rescue import RescueConfig
from kvforge.fill.ridgefill import RidgeFillConfig, ridgefill_plan
from kvforge.generation import GenerationConfig
from kvforge.plan import PrefillReport, final_depth


def bench_ridgefill(
    engine: Engine, maps: RidgeMaps, streamed: RidgeMaps, config: RidgeFillConfig, lengths: list[int], runs: int = 3, progress=None,
    decode_tokens: int = 0,
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
                **(_decode(engine, prompt, config, maps, decode_tokens, runs) if decode_tokens else {}),
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


def _decode(engine: Engine, prompt: list[int], config: RidgeFillConfig, maps: RidgeMaps, tokens: int, runs: int) -> dict:
    """Median decode tokens/s over `tokens` greedy tokens: exact, RidgeFill without and with its
    rescue (the configured one, or the default), interleaved; and the rows the rescue recomputed."""
    generation = GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    plans = {"exact": lambda: None, "ridgefill_no_rescue": lambda: ridgefill_plan(engine, prompt, replace(config, rescue=None), maps),
             "ridgefill_rescue": lambda: ridgefill_plan(engine, prompt, replace(config, rescue=config.rescue or RescueConfig()), maps)}

    def arm(make_plan):
        def run() -> dict:
            out = engine.generate(prompt, generation, plan=make_plan())[0]
            return {"tokens_per_s": out.decode_tokens_per_s, "rescued_rows": out.rescued_rows or 0}
        return run

    samples = interleaved_samples({name: arm(make) for name, make in plans.items()}, runs)
    speed = {name: statistics.median(x["tokens_per_s"] for x in xs) for name, xs in samples.items()}
    return {"decode_tokens": tokens, **{f"{name}_decode_tokens_per_s": v for name, v in speed.items()},
            "rescue_decode_cost": speed["ridgefill_no_rescue"] / speed["ridgefill_rescue"] - 1.0 if speed["ridgefill_rescue"] else None,
            "rescued_rows": statistics.median(x["rescued_rows"] for x in samples["ridgefill_rescue"])}


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

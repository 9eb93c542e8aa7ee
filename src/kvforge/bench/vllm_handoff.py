"""`kvforge bench vllm-handoff`: a conversation handed from a source model to a vLLM-served target.

The source (kvforge's engine) has prefilled the text: it holds the conversation, so its prefill is
not timed. Two arms per length, interleaved, median of `runs`, both ending in the target's first
token from vLLM:
- `reprefill`: vLLM prefills the target's tokens itself (its exact path);
- `handoff`: KV-Lingo translates the source's cache into the target's (alignment, translation,
  the target's few head rows computed natively by kvforge), the cache goes into the connector's
  in-memory store, and vLLM loads it and computes only the last token. With `native_tail` N the
  store holds the rows before the text's last N tokens and vLLM prefills those N itself over the
  loaded rows (the target's own prefill, in vLLM's fast path: "translate the context, prefill the
  prompt").
With `source_dir`, the source is vLLM-served too: its cache is read out of its vLLM engine through
the connector's save path (a request with `kvforge_save`, untimed like the source's prefill), so
both models run in vLLM and kvforge only translates. The store and vLLM run in this process (no file or network round trip: a disaggregated
deployment adds its transport). Reported beside the times: whether vLLM loaded every row but the
last (a failed load would be an exact prefill in disguise: the bench stops instead), and whether
the hand-off's first token equals the re-prefill's.
"""

from __future__ import annotations

import os
import time

import statistics

from kvforge.bench.harness import environment, interleaved_samples
from kvforge.bench.lingo import text_of_tokens
from kvforge.translate.align import align, tokenize
from kvforge.translate.handoff import native_rows, translate_cache


def bench_vllm_handoff(translator, source, target, target_dir, lengths: list[int], runs: int = 3, progress=None,
                       source_dir=None, native_tail: int = 0) -> dict:
    from vllm import SamplingParams

    from kvforge.errors import KvforgeError
    from kvforge.vllm.engine import close_llm, generate, start_llm
    from kvforge.vllm.store import MEMORY, CacheStore, config_id

    store, model_id = CacheStore("memory"), config_id(target_dir)
    llm = start_llm(target_dir, target.dtype, max(lengths) + 64, max_num_seqs=1)
    source_llm = start_llm(source_dir, source.dtype, min(2 * max(lengths) + 64, source.model.context_length), max_num_seqs=1) if source_dir is not None else None
    first = SamplingParams(temperature=0.0, max_tokens=1)
    results = []
    try:
        generate(llm, [[1, 2, 3]], first)  # warm-up
        for n in lengths:
            text = text_of_tokens(target.model.tokenizer, n)
            src, tgt = tokenize(source.model.tokenizer, text), tokenize(target.model.tokenizer, text)
            if source_llm is None:
                _, src_cache = source.prefill([src.ids], logits="none")
            else:  # the source serves the conversation in vLLM; read its cache out
                saved = f"source-{n}"
                generate(source_llm, [src.ids], SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"kvforge_save": saved}}))
                src_cache = store.get(saved).cache
                MEMORY.pop(saved, None)
            if progress:
                progress(f"{source.model.name} -> {target.model.name}: {len(tgt.ids)} target tokens ({len(src.ids)} source)")

            def reprefill():
                start = time.perf_counter()
                out = generate(llm, [tgt.ids], first)[0]
                return {"s": time.perf_counter() - start, "token": out.outputs[0].token_ids[0]}

            def handoff():
                start = time.perf_counter()
                alignment = align(src, tgt, translator.align).truncate(len(tgt.ids) - 1)
                _, loaded = native_rows(alignment, native_tail)  # rows vLLM loads; it prefills the rest
                cache = translate_cache(translator, source, target, src_cache, alignment.truncate(loaded), tgt.ids)
                translated = time.perf_counter()
                key = store.put(tgt.ids, cache, tgt.ids[:loaded], model_id)
                params = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": {"kvforge_cache": key}})
                out = generate(llm, [tgt.ids], params)[0]
                seconds = time.perf_counter() - start
                MEMORY.pop(key, None)
                if out.outputs[0].finish_reason == "error" or out.num_cached_tokens != loaded:
                    raise KvforgeError(f"vLLM did not load the handed-off cache ({out.num_cached_tokens} of {loaded} rows)")
                return {"s": seconds, "translate_s": translated - start, "token": out.outputs[0].token_ids[0]}

            samples = interleaved_samples({"reprefill": reprefill, "handoff": handoff}, runs)
            medians = {arm: {key: statistics.median(x[key] for x in xs) for key in ("s", "translate_s") if key in xs[0]}
                       for arm, xs in samples.items()}
            results.append({
                "source_engine": "vllm" if source_llm is not None else "kvforge", "source": source.model.name, "target": target.model.name, "tokens": len(tgt.ids), "source_tokens": len(src.ids),
                "native_tail": native_tail, "handoff_s": medians["handoff"]["s"], "translate_s": medians["handoff"]["translate_s"],
                "reprefill_s": medians["reprefill"]["s"], "speedup": medians["reprefill"]["s"] / medians["handoff"]["s"],
                "first_token_agrees": all(h["token"] == r["token"] for h, r in zip(samples["handoff"], samples["reprefill"])),
            })
    finally:
        close_llm(llm)
        if source_llm is not None:
            close_llm(source_llm)
    import vllm

    return {"command": "bench vllm-handoff", "runs": runs, "source_engine": "vllm" if source_dir is not None else "kvforge", "vllm": vllm.__version__,
            "vllm_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), **environment(target), "results": results}

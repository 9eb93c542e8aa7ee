"""`kvforge bench peers`: kvforge's exact engine against its peers on the same token ids, at the
same thread count: transformers (the very model object kvforge loaded, its own `DynamicCache`,
sdpa), vLLM's offline `LLM` (when `import vllm` works; otherwise a `skipped` entry) and llama.cpp
through llama-cpp-python (an optional install; `bench/llama_cpp.py`): `llama.cpp` holds the model's
GGUF re-typed to the pass's dtype (bf16 or f32), `llama.cpp-q8_0` the same at Q8_0, whatever the pass.

Per (engine, dtype, prompt length), arms interleaved over `runs` after a warm-up:
  - prefill tokens/s: the last-position logits of the whole prompt from an empty cache;
  - decode tokens/s: `decode_tokens` greedy steps, batch 1, from that prefilled cache.
Per (engine, dtype), the copy workload: `bench ngram`'s four copy prompts, batch 1, greedy,
`copy_new_tokens` new tokens each with end of sequence ignored, prefill included, through each
engine's own generate call (`Engine.generate`, transformers' `generate`, `LLM.generate`):
generated tokens / wall time, put on every row of that engine and dtype as `copy_tokens_per_s`.
kvforge rows also carry `step_cost`: what a wider step costs over a one-token decode step at
that context, `verify_9` (one sequence, 9 new rows: a k = 8 speculative verification) and
`batch_16` (16 sequences, one new row each), from the prefilled prompt's cache (copied 16 times:
16 samples of one prompt, whose shared rows attention reads once) and `batch_16_distinct` (the same
16 copies not known to be copies, each read on its own: what 16 different prompts cost).

vLLM is timed through its public API only: prefill = a generate call with max_tokens=1; decode =
(median time with max_tokens=1+decode_tokens minus the prefill median) / decode_tokens. Its
engine core runs where vLLM puts it (its own process by default), pinned to as many cores as
torch has threads through `VLLM_CPU_OMP_THREADS_BIND` unless that is already set. Each dtype's
models are loaded once and freed before the next dtype's: at most two are alive (kvforge's,
which the transformers arms share, and vLLM's).
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from kvforge.bench.exact import hf_decode, hf_prefill, ours_decode
from kvforge.bench.harness import environment, interleaved_medians, interleaved_metric_medians, timed
from kvforge.data.prompts import held_out_text_tokens
from kvforge.engine import Engine
from kvforge.models.loading import parse_dtype
from kvforge.vllm.engine import close_llm, vllm_missing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ENGINES = ("kvforge", "transformers", "vllm", "llama.cpp", "llama.cpp-q8_0")
PEERS = ENGINES[1:]
LLAMA_CPP = {"llama.cpp": None, "llama.cpp-q8_0": "q8_0"}  # engine -> the GGUF's weights (None: the pass's dtype)


def parse_choices(text: str, allowed: Sequence[str], option: str) -> list[str]:
    """A comma-separated `option` value as a list of names from `allowed`, in the given order
    without repeats; anything else is a one-line ValueError."""
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        what = f"unknown {', '.join(repr(b) for b in bad)}" if bad else "nothing given"
        raise ValueError(f"{option} takes a comma-separated list of {', '.join(allowed)}: {what} in {text!r}")
    return names


def bench_peers(
    model: str,
    lengths: list[int],
    dtypes: Sequence[str] = ("fp32", "bf16"),
    engines: Sequence[str] = ENGINES,
    decode_tokens: int = 64,
    runs: int = 3,
    copy_new_tokens: int = 128,
    device: str = "cpu",
    load_engine: Callable[[torch.dtype], Engine] | None = None,
    copy_prompt_ids: list[list[int]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Every (engine, dtype, length) row, plus the `skipped` engines with their reasons.

    `load_engine(torch_dtype)` builds kvforge's engine for one dtype (default: `load_model(model,
    device, dtype)`); `copy_prompt_ids` replaces the copy prompts (default: `copy_prompts` of the
    model's tokenizer). Both exist so tests can run the bench on tiny in-memory models."""
    for name in dtypes:
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}: use {' or '.join(DTYPES)}")
    for name in engines:
        if name not in ENGINES:
            raise ValueError(f"unknown engine {name!r}: use {', '.join(ENGINES)}")
    if not lengths or min(lengths) < 1:
        raise ValueError(f"prompt lengths must be positive, got {lengths}")
    for value, what in ((decode_tokens, "decode tokens"), (runs, "runs"), (copy_new_tokens, "copy new tokens")):
        if value < 1:
            raise ValueError(f"{what} must be >= 1, got {value}")
    if load_engine is None:
        from kvforge.models import load_model

        def load_engine(dtype: torch.dtype) -> Engine:
            return Engine(load_model(model, device=device, dtype=dtype))

    vllm_reason = vllm_missing() if "vllm" in engines else None
    llama_engines = [e for e in engines if e in LLAMA_CPP]
    llama_reason = _llama_cpp_reason(model) if llama_engines else None
    settings = dict(lengths=lengths, engines=[e for e in engines if e not in LLAMA_CPP or llama_reason is None],
                    decode_tokens=decode_tokens, runs=runs, copy_new_tokens=copy_new_tokens, model_spec=model,
                    progress=progress or (lambda message: None))
    results, skipped, load_s, copy_workload, name = [], [], {}, None, model
    for dtype in dtypes:
        if vllm_reason is not None:
            skipped.append({"engine": "vllm", "dtype": dtype, "reason": vllm_reason})
        if llama_reason is not None:
            skipped += [{"engine": e, "dtype": dtype, "reason": llama_reason} for e in llama_engines]
        out = _bench_dtype(dtype, load_engine, copy_prompt_ids, vllm_reason is None and "vllm" in engines, **settings)
        results += out["rows"]
        skipped += out["skipped"]
        load_s[dtype] = out["load_s"]
        copy_workload, name = out["copy_workload"], out["model"]
        gc.collect()  # this dtype's models go before the next dtype's load
    _add_ratios(results)
    return {
        "command": "bench peers",
        "model": name,
        "method": "exact",
        "tokens": lengths,
        "dtypes": list(dtypes),
        "engines": list(engines),
        "runs": runs,
        "decode_tokens": decode_tokens,
        "copy_workload": copy_workload,
        **environment(),
        **_versions(vllm_reason is None and "vllm" in engines, bool(llama_engines) and llama_reason is None),
        "load_s": load_s,
        "results": results,
        "skipped": skipped,
    }


def markdown_table(report: dict) -> str:
    """One Markdown row per (engine, dtype): prefill and decode tokens/s at each length, copy
    tokens/s, and kvforge's ratios (prefill / decode) to transformers and to vLLM at each length."""
    lengths = report["tokens"]
    peers = [p for p in PEERS if any(r["engine"] == p for r in report["results"])]
    header = (["engine", "dtype"] + [f"prefill tok/s @{t}" for t in lengths] + [f"decode tok/s @{t}" for t in lengths]
              + ["copy tok/s"] + [f"×{peer} prefill/decode @{t}" for peer in peers for t in lengths])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    pairs = list(dict.fromkeys((r["engine"], r["dtype"]) for r in report["results"]))
    for engine, dtype in pairs:
        rows = {r["tokens"]: r for r in report["results"] if (r["engine"], r["dtype"]) == (engine, dtype)}
        cells = [engine, dtype] + [_num(rows[t]["prefill_tokens_per_s"]) for t in lengths]
        cells += [_num(rows[t]["decode_tokens_per_s"]) for t in lengths] + [_num(rows[lengths[0]]["copy_tokens_per_s"])]
        for peer in peers:
            for t in lengths:
                ratio = rows[t].get(f"ratio_to_{peer}")
                cells.append(f"{_num(ratio['prefill'], 2)} / {_num(ratio['decode'], 2)}" if ratio else "–")
        lines.append("| " + " | ".join(cells) + " |")
    widths = [(r["dtype"], r["tokens"], r["step_cost"]) for r in report["results"] if "step_cost" in r]
    if widths:
        lines += ["", "| kvforge dtype | context | one-token step ms | 9-row verify / one | 16 samples of the prompt / one "
                  "| 16 distinct sequences / one |", "|---|---|---|---|---|---|"]
        lines += [f"| {d} | {t} | {c['one_s'] * 1e3:.1f} | {c['verify_9']:.2f} | {c['batch_16']:.2f} | {c['batch_16_distinct']:.2f} |"
                  for d, t, c in widths]
    return "\n".join(lines)


def _bench_dtype(dtype: str, load_engine, copy_prompt_ids, with_vllm: bool, *, lengths, engines, decode_tokens, runs,
                 copy_new_tokens, model_spec, progress) -> dict:
    """The rows of one dtype. Its models live only in this call's frame."""
    progress(f"{dtype}: loading kvforge's model")
    start = time.perf_counter()
    engine = load_engine(DTYPES[dtype])
    load_s = {"kvforge": time.perf_counter() - start}
    tokenizer, context = engine.model.tokenizer, engine.model.context_length
    if max(lengths) + decode_tokens >= context:
        raise ValueError(f"{max(lengths)} + {decode_tokens} tokens exceed the context of {context}")
    if copy_prompt_ids is None:
        from kvforge.bench.ngram import copy_prompts

        copy_prompt_ids = copy_prompts(tokenizer)
    if max(len(p) for p in copy_prompt_ids) + copy_new_tokens >= context:
        raise ValueError(f"a copy prompt of {max(len(p) for p in copy_prompt_ids)} + {copy_new_tokens} tokens exceeds the context of {context}")

    skipped, llm = [], None
    if with_vllm:
        max_len = max_len_for(lengths, decode_tokens, copy_prompt_ids, copy_new_tokens)
        progress(f"{dtype}: loading vLLM (max_model_len {max_len})")
        start = time.perf_counter()
        llm, reason = _load_vllm(engine.model.hf, dtype, max_len)
        if llm is None:
            skipped.append({"engine": "vllm", "dtype": dtype, "reason": reason})
        else:
            load_s["vllm"] = time.perf_counter() - start
    llamas = {}
    for e in (e for e in engines if e in LLAMA_CPP):
        progress(f"{dtype}: loading {e}")
        cpp, seconds, reason = _load_llama_cpp(model_spec, LLAMA_CPP[e] or dtype, max_len_for(lengths, decode_tokens, copy_prompt_ids, copy_new_tokens))
        if cpp is None:
            skipped.append({"engine": e, "dtype": dtype, "reason": reason})
        else:
            llamas[e], load_s[e] = cpp, seconds
    names = [e for e in engines if (e != "vllm" or llm is not None) and (e not in LLAMA_CPP or e in llamas)]
    hf = engine.model.hf

    measured: dict[tuple[str, int], dict] = {}
    for tokens in lengths:
        ids_list = held_out_text_tokens(tokenizer, tokens)
        ids = torch.tensor([ids_list], device=engine.device)
        prefill_arms = {
            "kvforge": lambda: engine.prefill(ids),
            "transformers": lambda: hf_prefill(hf, ids),
            "vllm": lambda: _vllm_generate(llm, [ids_list], 1),
            **{e: (lambda cpp=cpp: cpp.prefill(ids_list)) for e, cpp in llamas.items()},
        }
        decode_arms = {
            "kvforge": lambda: ours_decode(engine, ids, decode_tokens),
            "transformers": lambda: hf_decode(hf, ids, decode_tokens),
            "vllm": lambda: _vllm_generate(llm, [ids_list], 1 + decode_tokens),  # wall time; the prefill is taken off below
            **{e: (lambda cpp=cpp: cpp.decode(ids_list, decode_tokens)) for e, cpp in llamas.items()},
        }
        progress(f"{dtype}, {tokens} tokens: prefill x{runs}")
        prefill = interleaved_medians({e: prefill_arms[e] for e in names}, runs=runs)
        progress(f"{dtype}, {tokens} tokens: decode {decode_tokens} x{runs}")
        decode = interleaved_medians({e: decode_arms[e] for e in names}, runs=runs)
        if "vllm" in decode:
            decode["vllm"] -= prefill["vllm"]
        for e in names:
            measured[e, tokens] = {
                "prefill_s": prefill[e],
                "prefill_tokens_per_s": tokens / prefill[e],
                "decode_tokens_per_s": decode_tokens / decode[e] if decode[e] > 0 else None,
            }
        if "kvforge" in names:
            progress(f"{dtype}, {tokens} tokens: step widths x{runs}")
            measured["kvforge", tokens]["step_cost"] = step_cost(engine, ids_list, runs)

    copy_arms = {
        "kvforge": lambda prompts, n: _kvforge_copy(engine, prompts, n),
        "transformers": lambda prompts, n: _hf_copy(hf, prompts, n),
        "vllm": lambda prompts, n: sum(len(o.outputs[0].token_ids) for p in prompts for o in _vllm_generate(llm, [p], n)),
        **{e: cpp.generate for e, cpp in llamas.items()},
    }
    progress(f"{dtype}: copy workload ({len(copy_prompt_ids)} prompts x {copy_new_tokens} tokens) x{runs}")
    for e in names:  # warm-up: a couple of tokens each, so no arm pays first-call costs in a timed run
        copy_arms[e](copy_prompt_ids[:1], 2)
    copy = interleaved_metric_medians(
        {e: _rate(copy_arms[e], copy_prompt_ids, copy_new_tokens) for e in names}, runs=runs, warmup=0
    )
    rows = [
        {"engine": e, "dtype": dtype, "tokens": tokens, "arm": f"{e} {dtype}", **measured[e, tokens],
         "copy_tokens_per_s": copy[e]["tokens_per_s"],
         **({"extra_buffers": llamas[e].extra_buffers} if e in llamas else {})}  # llama.cpp's repacked weights (bench/llama_cpp.py)
        for e in names for tokens in lengths
    ]
    if llm is not None:
        close_llm(llm)
    for cpp in llamas.values():
        cpp.close()
    workload = {"prompts": len(copy_prompt_ids), "prompt_tokens": [len(p) for p in copy_prompt_ids],
                "new_tokens": copy_new_tokens, "generated_tokens": {e: int(copy[e]["tokens"]) for e in names}}
    return {"rows": rows, "skipped": skipped, "load_s": load_s, "copy_workload": workload, "model": engine.model.name}


def max_len_for(lengths: list[int], decode_tokens: int, copy_prompt_ids: list[list[int]], copy_new_tokens: int) -> int:
    """The context a peer engine is sized for: the longest prompt with its decode, a few rows spare."""
    return max(max(lengths) + decode_tokens, max(len(p) for p in copy_prompt_ids) + copy_new_tokens) + 16


@torch.inference_mode()
def step_cost(engine: Engine, prompt: list[int], runs: int = 3) -> dict[str, float]:
    """Median time of a 9-row step of one sequence and of a one-row step of 16 sequences (samples
    of `prompt`, and the same rows as 16 unrelated sequences), each over a one-row step of one
    sequence, all after `prompt`'s cache (rows rolled back after each step, so every step sees
    the same context)."""
    _, cache = engine.prefill([prompt])
    batch = cache.select_batch(torch.zeros(16, dtype=torch.long))
    distinct = cache.select_batch(torch.zeros(16, dtype=torch.long))
    for layer in distinct.layers:
        layer.shared = 0  # as if 16 different prompts: every sequence reads its own rows
    last = torch.tensor((prompt * 9)[-9:], device=engine.device)  # any 9 ids: only the widths are timed
    start = len(prompt)

    def step(c, ids: torch.Tensor) -> None:
        b, t = ids.shape
        positions = torch.arange(start, start + t, device=engine.device).expand(b, t)
        engine.forward(ids, positions, c, "all" if t > 1 else "last")  # verification reads every row's logits
        c.trim(t)

    times = interleaved_medians({
        "one": lambda: step(cache, last[:1].view(1, 1)),
        "verify_9": lambda: step(cache, last.view(1, 9)),
        "batch_16": lambda: step(batch, last[:1].expand(16, 1).contiguous()),
        "batch_16_distinct": lambda: step(distinct, last[:1].expand(16, 1).contiguous()),
    }, runs=max(runs, 5))
    return {"one_s": times["one"], **{arm: times[arm] / times["one"] for arm in ("verify_9", "batch_16", "batch_16_distinct")}}


def _rate(generate: Callable[[list[list[int]], int], int], prompts: list[list[int]], new_tokens: int):
    def run() -> dict[str, float]:
        seconds, tokens = timed(lambda: generate(prompts, new_tokens))
        return {"tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens}

    return run


def _kvforge_copy(engine: Engine, prompts: list[list[int]], new_tokens: int) -> int:
    from kvforge.generation import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)  # greedy
    return sum(len(g.token_ids) for p in prompts for g in engine.generate(p, config))


def _hf_copy(hf, prompts: list[list[int]], new_tokens: int) -> int:
    """transformers' own `generate`, greedy; min_new_tokens keeps it from stopping at EOS (its
    generation config fills an unset eos_token_id back in from the model's)."""
    generated = 0
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=hf.device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False)
            generated += out.shape[1] - ids.shape[1]
    return generated


# --- vLLM ----------------------------------------------------------------------------------------
def _load_vllm(hf, dtype: str, max_model_len: int):
    """(vLLM's LLM over the Hugging Face directory kvforge loaded from, None) or (None, why not)."""
    source = getattr(hf, "name_or_path", "")  # what from_pretrained was given: the converted directory or hub id
    if not source or (source.startswith((".", "/", "~")) and not Path(source).expanduser().is_dir()):
        return None, "no Hugging Face directory to give vLLM (the model was not loaded from one)"
    try:
        from kvforge.vllm.engine import start_llm

        llm = start_llm(source, parse_dtype(dtype), max_model_len)
    except Exception as exc:  # vLLM refuses this model or dtype: record why, measure the others
        return None, f"vllm failed to load {dtype}: {_first_line(exc)}"
    return llm, None


def _vllm_generate(llm, prompts: list[list[int]], max_tokens: int) -> list:
    from vllm import SamplingParams

    from kvforge.vllm.engine import generate

    return generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


# --- llama.cpp -----------------------------------------------------------------------------------
def _llama_cpp_reason(model: str) -> str | None:
    """Why llama.cpp cannot be timed on `model`, or None."""
    from kvforge.bench.llama_cpp import gguf_source, llama_cpp_missing

    missing = llama_cpp_missing()
    if missing is not None:
        return missing
    if gguf_source(model) is None:
        return f"llama.cpp reads GGUF and {model!r} is not a GGUF model: give its .gguf (llama.cpp's convert_hf_to_gguf.py writes one)"
    return None


def _load_llama_cpp(model: str, weights: str, n_ctx: int):
    """(llama.cpp's model, its load seconds, None) or (None, None, why not). The load time leaves
    out re-typing the GGUF and the probe of llama.cpp's repacked buffers (both once per file)."""
    from kvforge.bench.llama_cpp import LlamaCpp, extra_buffers_work, gguf_source, retyped_gguf

    threads = torch.get_num_threads()
    try:
        path = retyped_gguf(gguf_source(model), weights)
        extra = extra_buffers_work(path, threads)
        start = time.perf_counter()
        cpp = LlamaCpp(path, threads, n_ctx, extra_buffers=extra)
    except Exception as exc:  # llama.cpp refuses this file, or its probe failed: record why, measure the others
        return None, None, f"llama.cpp failed to load {weights}: {_first_line(exc)}"
    return cpp, time.perf_counter() - start, None


def _versions(with_vllm: bool, with_llama_cpp: bool = False) -> dict:
    import transformers

    versions = {"transformers": transformers.__version__, "vllm": None}
    if with_vllm:
        import vllm

        versions["vllm"] = getattr(vllm, "__version__", "unknown")
    versions["vllm_threads_bind"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") if with_vllm else None
    versions["llama_cpp"] = None
    if with_llama_cpp:
        from kvforge.bench.llama_cpp import versions as llama_versions

        versions["llama_cpp"] = llama_versions()
    return versions


# --- report --------------------------------------------------------------------------------------
def _add_ratios(rows: list[dict]) -> None:
    """kvforge rows get ratio_to_<peer> = {prefill, decode, copy}: kvforge's rate over the peer's
    at the same dtype and length (> 1: kvforge is faster), or None where the peer was not measured."""
    by_key = {(r["engine"], r["dtype"], r["tokens"]): r for r in rows}
    for row in rows:
        if row["engine"] != "kvforge":
            continue
        for peer in PEERS:
            other = by_key.get((peer, row["dtype"], row["tokens"]))
            row[f"ratio_to_{peer}"] = None if other is None else {
                figure: _ratio(row[f"{figure}_tokens_per_s"], other[f"{figure}_tokens_per_s"])
                for figure in ("prefill", "decode", "copy")
            }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

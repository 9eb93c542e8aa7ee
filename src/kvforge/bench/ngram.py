"""`kvforge bench ngram`: plain decoding vs prompt-lookup vs n-gram drafting (synchronous and with
the prefetcher), in one process on the same prompts, arms interleaved, after a short warm-up.

Workloads:
  - copy: batch 1, greedy. Rewrite prompts over real code (Python standard library functions,
    read with `inspect`) and a repeat-this prompt over real held-out chat text.
  - rl: G samples per prompt at temperature 1 from held-out chat prompts (first user turns).
Losslessness is checked, not assumed: every drafting arm's outputs in every timed run are compared
token for token with plain decoding's run with the same seed (greedy for copy; for rl, seeded
sampling at temperature 1: a sampled token is a function of its logits and its key, `sampling.py`).
Speed is end to end and over the decode phase alone (each group's first token to its last: prefill
is the same for every arm). The gate's decisions are reported beside the speed: the share of
request-steps that verified a draft (`rows_drafted`) and the mean draft length K of the steps that
verified one (`mean_k`).

Prefetch figures: coverage c (share of probes whose outcome was in the table), the device time
per step T_dev (the verification forward plus the host work the prefetcher cannot take off the
critical path) and the host time it can (T_host: the synchronous arm's draft lookups), the
prediction (T_dev + T_host) / (T_dev + (1 - c) T_host) beside the measured speedup over the
synchronous arm, and coverage at other budgets from the same run (the greedy allocation's pick
order tells at which budget each outcome would have been covered).
"""

from __future__ import annotations

import inspect
import statistics
import time
from pathlib import Path

from kvforge.bench.harness import environment
from kvforge.bench.plotting import new_figure, save_figure
from kvforge.data.prompts import held_out_conversations
from kvforge.generation import GenerationConfig
from kvforge.prompting import encode_prompt
from kvforge.speculative.rollout import DraftConfig, generate_group

WORKLOADS = ("copy", "rl")
COPY_FUNCTIONS = ("textwrap.dedent", "shutil.copyfileobj", "difflib.get_close_matches")
BUDGETS = (1, 2, 4, 8, 16, 32, 64)


def copy_prompts(tokenizer, count: int = 4, max_chars: int = 1500) -> list[list[int]]:
    """Edit-and-copy prompts over standard-library source, then one repeat prompt over held-out chat text."""
    import importlib

    texts = []
    for dotted in COPY_FUNCTIONS[: max(0, count - 1)]:
        module, name = dotted.rsplit(".", 1)
        source = inspect.getsource(getattr(importlib.import_module(module), name))[:max_chars]
        texts.append(f"Add a comment line at the top of this function and otherwise copy it unchanged:\n\n```python\n{source}\n```")
    if count > len(texts):
        turn = held_out_conversations(1, min_chars=600, max_chars=3000)[0].turns[0][1][:max_chars]
        texts.append(f"Repeat the following text exactly, word for word:\n\n{turn}")
    return [encode_prompt(tokenizer, t, chat=True) for t in texts]


def rl_prompts(tokenizer, count: int = 3, max_chars: int = 1500) -> list[list[int]]:
    """First user turns of held-out conversations."""
    convs = held_out_conversations(count, min_chars=200, max_chars=20000, skip=3)
    return [encode_prompt(tokenizer, c.turns[0][1][:max_chars], chat=True) for c in convs]


def workload_settings(tokenizer, workload: str, prompts: int | None, samples: int, max_new_tokens: int | None):
    """(prompt ids, samples per prompt, temperature, new tokens) of a workload: copy is batch 1,
    greedy, 128 tokens over 4 prompts; rl is `samples` per prompt at temperature 1, 96 tokens over 3."""
    if workload == "copy":
        return copy_prompts(tokenizer, prompts or 4), 1, 0.0, max_new_tokens or 128
    return rl_prompts(tokenizer, prompts or 3), samples, 1.0, max_new_tokens or 96


def bench_ngram(
    engine, workload: str, runs: int = 3, k: int = 8, budget: int = 16, max_new_tokens: int | None = None,
    samples: int = 8, prompts: int | None = None, progress=None, gate: bool = True,
) -> dict:
    """`gate`: the drafting arms verify the draft length that pays (`gate.DraftGate`); False verifies every draft found."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}: use {' or '.join(WORKLOADS)}")
    prompt_ids, group, temperature, max_new_tokens = workload_settings(engine.model.tokenizer, workload, prompts, samples, max_new_tokens)
    arms = {
        "plain": DraftConfig("none"),
        "prompt-lookup": DraftConfig("prompt-lookup", k, gate=gate),
        "ngram": DraftConfig("ngram", k, gate=gate),
        "ngram-prefetch": DraftConfig("ngram", k, prefetch=True, budget=budget, gate=gate),
    }
    # warm-up: a few tokens per arm, so no arm pays first-call costs
    for draft in arms.values():
        generate_group(engine, prompt_ids[0], group, GenerationConfig(max_new_tokens=4, temperature=temperature, seed=0), draft)
    per_run: dict[str, list[dict]] = {name: [] for name in arms}
    order = list(arms.items())
    for run in range(runs):
        for name, draft in order if run % 2 == 0 else order[::-1]:
            if progress:
                progress(f"{workload}: run {run + 1}/{runs}, {name}")
            per_run[name].append(_run_arm(engine, prompt_ids, group, temperature, max_new_tokens, draft, seed=run))
    lossless = {name: all(r["outputs"] == p["outputs"] for r, p in zip(runs, per_run["plain"])) for name, runs in per_run.items() if name != "plain"}
    results = _summarise(per_run, lossless, arms)
    return {
        "command": "bench ngram",
        "model": engine.model.name,
        "method": "ngram",
        "workload": workload,
        "tokens": sum(len(p) for p in prompt_ids),
        "prompts": len(prompt_ids),
        "samples_per_prompt": group,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "k": k,
        "budget": budget,
        "gate": gate,
        "runs": runs,
        **environment(engine),
        "results": results,
        "coverage_vs_budget": _coverage_curve(per_run["ngram-prefetch"]),
        "accept_hist": _accept_hist(per_run["ngram"]),
    }


def _run_arm(engine, prompt_ids, group, temperature, max_new_tokens, draft: DraftConfig, seed: int) -> dict:
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    tokens, outputs, stats_list = 0, [], []
    decode_tokens, decode_s = 0, 0.0
    start = time.perf_counter()
    for ids in prompt_ids:
        generations, stats = generate_group(engine, ids, group, config, draft)
        tokens += sum(len(g.token_ids) for g in generations)
        outputs.append([g.token_ids for g in generations])
        # the group's decode phase: its first first token to its last token
        decode_tokens += sum(len(g.token_ids) - 1 for g in generations)
        decode_s += max(g.ttft_s + g.decode_s for g in generations) - min(g.ttft_s for g in generations)
        if stats is not None:
            stats_list.append(stats)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "decode_tokens": decode_tokens, "decode_s": decode_s, "outputs": outputs, "stats": stats_list}


def _summarise(per_run: dict[str, list[dict]], lossless: dict[str, bool], arms: dict[str, DraftConfig]) -> list[dict]:
    rate = {name: statistics.median(r["tokens"] / r["seconds"] for r in runs) for name, runs in per_run.items()}
    decode = {name: statistics.median(r["decode_tokens"] / max(r["decode_s"], 1e-9) for r in runs) for name, runs in per_run.items()}
    rows = []
    for name, runs in per_run.items():
        row = {"arm": name, "gate": arms[name].gate if arms[name].draft != "none" else None, "tokens_per_s": rate[name],
               "speedup_vs_plain": rate[name] / rate["plain"], "decode_tokens_per_s": decode[name],
               "decode_speedup_vs_plain": decode[name] / decode["plain"]}
        stats = [s for r in runs for s in r["stats"]]
        if stats:
            steps = sum(s.steps for s in stats)
            request_steps = sum(s.request_steps for s in stats)
            drafting_steps = sum(s.drafting_steps for s in stats)
            row.update(
                mean_accept_len=sum(s.accepted for s in stats) / request_steps,
                rows_drafted=sum(s.drafted_rows for s in stats) / request_steps,
                mean_k=sum(s.k_sum for s in stats) / drafting_steps if drafting_steps else 0.0,
                lossless=lossless[name],
                device_ms_per_step=1000 * sum(s.device_s + s.host_s for s in stats) / steps,
                host_ms_per_step=1000 * sum(s.lookup_s for s in stats) / steps,
                forward_ms_per_step=1000 * sum(s.device_s for s in stats) / steps,
            )
        if name == "ngram-prefetch":
            probes = sum(s.probes for s in stats)
            c = sum(s.hits for s in stats) / probes if probes else 0.0
            sync = next((r for r in rows if r["arm"] == "ngram"), None)
            row["coverage"] = c
            row["prefetched_drafts"] = sum(s.prefetched for s in stats)  # request-steps that verified a prefetch hit
            if sync is not None:
                t_dev, t_host = sync["device_ms_per_step"], sync["host_ms_per_step"]
                row["predicted_speedup"] = (t_dev + t_host) / (t_dev + (1 - c) * t_host)
                row["speedup_vs_sync"] = rate[name] / rate["ngram"]
                row["sync_host_ms_per_step"] = t_host
        rows.append(row)
    return rows


def _coverage_curve(runs: list[dict]) -> dict[str, float]:
    needed = [n for r in runs for s in r["stats"] if s.prefetcher is not None for n in s.prefetcher.needed]
    return {str(b): (sum(1 for n in needed if n is not None and n <= b) / len(needed) if needed else 0.0) for b in BUDGETS}


def _accept_hist(runs: list[dict]) -> list[int]:
    hist: list[int] = []
    for r in runs:
        for s in r["stats"]:
            hist = [a + b for a, b in zip(hist, s.accept_hist)] if hist else list(s.accept_hist)
    return hist


def plot(report: dict, path: Path) -> Path:
    """PNG: prefetch coverage vs budget, and the n-gram arm's accept-length histogram."""
    fig, (left, right) = new_figure(2, (10, 4))
    curve = report["coverage_vs_budget"]
    left.plot([int(b) for b in curve], list(curve.values()), "o-")
    left.set_xscale("log", base=2)
    left.set_ylim(0, 1.02)
    left.set_xlabel("candidate budget per request")
    left.set_ylabel("coverage")
    left.axvline(report["budget"], color="grey", lw=0.5)
    hist = report["accept_hist"]
    right.bar(range(len(hist)), [h / max(1, sum(hist)) for h in hist])
    right.set_xlabel(f"accepted draft tokens (k = {report['k']})")
    right.set_ylabel("share of steps")
    fig.suptitle(f"{report['model']}: n-gram drafting, workload {report['workload']}")
    return save_figure(fig, path)

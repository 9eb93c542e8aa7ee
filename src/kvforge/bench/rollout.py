"""`kvforge bench rollout`: RL rollout epochs through the server, plain vs n-gram drafting from the
rollout history of earlier epochs.

An RL run rolls out the same prompts every epoch. An epoch here sends each `rl` prompt of
`bench ngram` once, as one /v1/completions request for n samples at temperature 1 with logprobs
on (`logprobs_of: sampling`, what a trainer's importance ratios need), one request at a time, to a
live server in this process (uvicorn on a loopback port, as `bench serve`). Arms: `plain` (no
drafter), `ngram` (the n-gram drafter and the server's rollout history) and, with `k_min`,
`ngram-ramp` (the same with the length-aware draft budget: a sample that has produced t tokens
drafts up to min(k, k_min + t // 16)). Every drafting run of epoch e starts from the same history:
what the first `ngram` runs of epochs 1..e-1 left (epoch 1: none), copied in before the run, so
runs of one epoch are alike and the arms are interleaved. Epochs sample with different seeds (a
next epoch does not replay the last one's random numbers); the model does not change between
epochs here, as it would in training, so epoch 2's acceptance is an optimistic figure.

Lossless: per epoch, one greedy request of n for the first prompt, each drafting arm (from the
epoch's starting history) against plain: every choice's text and token strings equal.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import httpx

from kvforge.bench.harness import environment
from kvforge.bench.ngram import rl_prompts
from kvforge.bench.plotting import new_figure, save_figure
from kvforge.bench.serve import start_server, stop_server
from kvforge.speculative.history import DEFAULT_MAX_ENTRIES, RolloutHistory
from kvforge.speculative.step import DraftConfig


def bench_rollout(
    model: str, n: int = 8, epochs: int = 2, runs: int = 3, prompts: int = 3, max_tokens: int = 96, k: int = 8,
    k_min: int | None = 2, device: str = "cpu", dtype: str = "auto", progress=None,
) -> dict:
    """Rows per (epoch, arm): tokens/s (completion tokens over the run's wall time, median of
    `runs`), speedup over plain in the same epoch, mean accept length, losslessness."""
    from kvforge.serve.app import ServeConfig, build_served, create_app

    if n < 1 or epochs < 1 or runs < 1 or prompts < 1 or max_tokens < 1:
        raise ValueError("--n, --epochs, --runs, --prompts and --max-tokens must be >= 1")
    every = build_served(ServeConfig(model, max_batch=n, queue_size=4, device=device, dtype=dtype))
    served = every[model]
    scheduler = served.schedulers[0]
    arms = {"plain": DraftConfig("none", k), "ngram": DraftConfig("ngram", k)}
    if k_min:
        arms["ngram-ramp"] = DraftConfig("ngram", k, k_min=k_min)
    prompt_ids = rl_prompts(served.engine.model.tokenizer, prompts)
    snapshot = RolloutHistory(arms["ngram"].n_min, arms["ngram"].n_max, DEFAULT_MAX_ENTRIES)
    server, url = start_server(create_app(every))
    results = []
    try:
        with httpx.Client(base_url=url, timeout=1800) as http:
            send = lambda ids, draft, **kw: _request(http, model, ids, n, draft, **kw)  # noqa: E731
            for name, draft in arms.items():  # warm-up: no arm pays first-call costs
                _use(scheduler, draft, copy.deepcopy(snapshot))
                send(prompt_ids[0], draft, max_tokens=4, temperature=1.0, seed=0)
            for epoch in range(1, epochs + 1):
                start_entries, following = snapshot.entries, None
                per_run: dict[str, list[dict]] = {name: [] for name in arms}
                order = list(arms.items())
                for run in range(runs):
                    shift = run % len(order)
                    for name, draft in order[shift:] + order[:shift]:
                        if progress:
                            progress(f"epoch {epoch}: run {run + 1}/{runs}, {name}")
                        _use(scheduler, draft, copy.deepcopy(snapshot))
                        per_run[name].append(_run(scheduler, send, prompt_ids, draft, max_tokens, seed=1000 * epoch + run))
                        if name == "ngram" and following is None:
                            following = scheduler.history  # the next epoch's history: this epoch's first ngram run
                lossless = _lossless(scheduler, send, prompt_ids[0], arms, snapshot, min(max_tokens, 32))
                results += _rows(epoch, per_run, lossless, sum(len(p) for p in prompt_ids), start_entries)
                snapshot = copy.deepcopy(following)
    finally:
        stop_server(server)
    return {
        "command": "bench rollout", "model": model, "method": "ngram", "workload": "rl", "tokens": sum(len(p) for p in prompt_ids),
        "prompts": len(prompt_ids), "n": n, "epochs": epochs, "temperature": 1.0, "max_tokens": max_tokens, "k": k, "k_min": k_min,
        "runs": runs, **environment(served.engine), "results": results,
    }


def _use(scheduler, draft: DraftConfig, history: RolloutHistory) -> None:
    """Point the idle scheduler at an arm's draft settings and a history (read only between requests)."""
    scheduler.draft, scheduler.history = draft, history


def _request(http: httpx.Client, model: str, ids: list[int], n: int, draft: DraftConfig, max_tokens: int, temperature: float, seed: int) -> dict:
    body = {"model": model, "prompt": ids, "n": n, "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "logprobs": 0,
            "kvforge": {"draft": draft.draft, "logprobs_of": "sampling"}}
    response = http.post("/v1/completions", json=body)
    if response.status_code != 200:
        raise RuntimeError(f"the server answered {response.status_code}: {response.text[:200]}")
    out = response.json()
    if out["usage"]["completion_tokens"] != sum(len(c["logprobs"]["tokens"]) for c in out["choices"]):
        raise RuntimeError("the response's log-probabilities do not cover every generated token")
    return out


def _run(scheduler, send, prompt_ids: list[list[int]], draft: DraftConfig, max_tokens: int, seed: int) -> dict:
    """One epoch's pass over the prompts: completion tokens, wall seconds, accepted tokens and steps."""
    accepted, steps = scheduler.stats.accepted, scheduler.stats.request_steps
    tokens, start = 0, time.perf_counter()
    for ids in prompt_ids:
        tokens += send(ids, draft, max_tokens=max_tokens, temperature=1.0, seed=seed)["usage"]["completion_tokens"]
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "accepted": scheduler.stats.accepted - accepted, "steps": scheduler.stats.request_steps - steps}


def _lossless(scheduler, send, ids: list[int], arms: dict[str, DraftConfig], snapshot: RolloutHistory, max_tokens: int) -> dict[str, bool]:
    """Per drafting arm: a greedy group's choices (text and token strings) equal plain decoding's."""

    def greedy(draft):
        _use(scheduler, draft, copy.deepcopy(snapshot))
        out = send(ids, draft, max_tokens=max_tokens, temperature=0.0, seed=0)
        return [(c["text"], c["logprobs"]["tokens"]) for c in out["choices"]]

    reference = greedy(arms["plain"])
    return {name: greedy(draft) == reference for name, draft in arms.items() if name != "plain"}


def _rows(epoch: int, per_run: dict[str, list[dict]], lossless: dict[str, bool], prompt_tokens: int, history_entries: int) -> list[dict]:
    rate = {name: statistics.median(r["tokens"] / r["seconds"] for r in runs) for name, runs in per_run.items()}
    rows = []
    for name, runs in per_run.items():
        steps = sum(r["steps"] for r in runs)
        rows.append({
            "epoch": epoch, "arm": name, "tokens": prompt_tokens, "completion_tokens": statistics.median(r["tokens"] for r in runs),
            "tokens_per_s": rate[name], "speedup_vs_plain": rate[name] / rate["plain"], "lossless": lossless.get(name),
            "mean_accept_len": sum(r["accepted"] for r in runs) / steps if name != "plain" and steps else None,
            "history_entries": history_entries if name != "plain" else None,
        })
    return rows


def plot(report: dict, path: Path) -> Path:
    """PNG: speedup over plain per epoch, one bar per drafting arm."""
    fig, ax = new_figure(1, (6, 4))
    arms = [a for a in dict.fromkeys(r["arm"] for r in report["results"]) if a != "plain"]
    width = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        rows = [r for r in report["results"] if r["arm"] == arm]
        ax.bar([r["epoch"] + (i - (len(arms) - 1) / 2) * width for r in rows], [r["speedup_vs_plain"] for r in rows], width, label=arm)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xticks(range(1, report["epochs"] + 1))
    ax.set_xlabel("epoch (2+: drafting from earlier epochs' rollouts)")
    ax.set_ylabel("tokens/s vs plain")
    ax.legend()
    fig.suptitle(f"{report['model']}: rollouts n = {report['n']} through the server")
    return save_figure(fig, path)

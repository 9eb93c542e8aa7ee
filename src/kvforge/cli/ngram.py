"""`kvforge bench ngram` and `bench rollout`: speculative decoding with lossless drafters against plain
decoding, offline and as RL rollout epochs through the server."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import typer
from rich.console import Console
from rich.table import Table

from kvforge.cli.common import (
    BudgetOpt, DeviceOpt, cell, DtypeOpt, JsonOpt, KOpt, ModelOpt, ThreadsOpt, bench_app, emit_json, err, load_engine, figure_name, setup_threads,
    user_errors,
)
from kvforge.errors import KvforgeError


@bench_app.command("ngram")
@user_errors
def bench_ngram_cmd(
    model: str = ModelOpt,
    workload: str = typer.Option("copy", "--workload", help="copy (batch 1, greedy) or rl (G samples per prompt, temperature 1)."),
    k: int = KOpt,
    budget: int = BudgetOpt,
    samples_per_prompt: int = typer.Option(8, "--samples-per-prompt", "-G", help="rl: samples per prompt."),
    prompts: Optional[int] = typer.Option(None, "--prompts", help="Prompts (default: 4 copy, 3 rl)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", help="Default: 128 copy, 96 rl."),
    runs: int = typer.Option(3, "--runs", help="Timed runs per arm (median reported)."),
    no_gate: bool = typer.Option(False, "--no-gate", help="Drafting arms verify every draft they find (no cost gate)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG path (default: benchmarks/results/ngram-<workload>-<model>[-<dtype>][-ungated].png)."),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Plain vs prompt-lookup vs n-gram drafting (synchronous, prefetch): tokens/s, acceptance, losslessness."""
    from kvforge.bench.ngram import WORKLOADS, bench_ngram, plot as plot_report

    setup_threads(threads)
    if workload not in WORKLOADS:
        raise KvforgeError(f"unknown workload {workload!r}: use {' or '.join(WORKLOADS)}")
    if runs < 1 or k < 1 or budget < 1 or samples_per_prompt < 1 or (prompts is not None and prompts < 1):
        raise KvforgeError("--runs, --k, --budget, --samples-per-prompt and --prompts must be >= 1")
    engine = load_engine(model, device, dtype)
    report = bench_ngram(engine, workload, runs, k, budget, max_new_tokens, samples_per_prompt, prompts, progress=lambda m: err.print(f"[dim]{m}[/dim]"),
                          gate=not no_gate)
    report["model"] = model
    suffix = {torch.bfloat16: "-bf16", torch.float16: "-fp16"}.get(engine.dtype, "")  # a bf16 run keeps the fp32 plot
    suffix += "-ungated" if no_gate else ""  # and an ungated run the gated one
    report["plot"] = str(plot_report(report, plot or Path("benchmarks/results") / f"ngram-{workload}-{figure_name(model)}{suffix}.png"))
    if json_out:
        emit_json(report)
        return
    table = Table("arm", "tokens/s", "× plain", "decode × plain", "mean accept", "rows drafted", "mean k", "lossless", "coverage", "predicted × sync", "measured × sync")
    for r in report["results"]:
        table.add_row(r["arm"], cell(r, "tokens_per_s", ".1f"), cell(r, "speedup_vs_plain", ".2f"), cell(r, "decode_speedup_vs_plain", ".2f"),
                      cell(r, "mean_accept_len", ".2f"), cell(r, "rows_drafted", ".2f"), cell(r, "mean_k", ".1f"),
                      str(r.get("lossless", "—")), cell(r, "coverage", ".3f"), cell(r, "predicted_speedup", ".3f"), cell(r, "speedup_vs_sync", ".3f"))
    Console().print(table)
    err.print(f"[dim]{report['workload']}: {report['prompts']} prompts x{report['samples_per_prompt']}, k {k}, budget {budget}, {report['threads']} thread(s), median of {runs}; plot {report['plot']}[/dim]")


@bench_app.command("rollout")
@user_errors
def bench_rollout_cmd(
    model: str = ModelOpt,
    workload: str = typer.Option("rl", "--workload", help="rl: the held-out chat prompts of `bench ngram --workload rl`."),
    n: int = typer.Option(8, "--n", help="Samples per prompt: one request with n choices."),
    epochs: int = typer.Option(2, "--epochs", help="Rollout epochs over the same prompts; epoch e drafts from epochs 1..e-1."),
    runs: int = typer.Option(3, "--runs", help="Timed runs per arm and epoch (median reported)."),
    prompts: int = typer.Option(3, "--prompts", help="Prompts per epoch."),
    max_tokens: int = typer.Option(96, "--max-tokens", help="New tokens per sample."),
    k: int = KOpt,
    k_min: int = typer.Option(2, "--k-min", help="The ngram-ramp arm's length-aware budget: min(k, k_min + t // 16) after t tokens (0: no such arm)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG path (default: benchmarks/results/rollout-<model>.png)."),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """RL rollout epochs through the server (n samples per request, temperature 1, logprobs on): plain vs n-gram
    drafting, the second epoch from the first's rollout history; tokens/s, acceptance, losslessness."""
    from kvforge.bench.rollout import bench_rollout, plot as plot_report

    setup_threads(threads)
    if workload != "rl":
        raise KvforgeError(f"unknown workload {workload!r}: bench rollout runs rl")
    if k_min < 0 or k < 1 or k_min > k:
        raise KvforgeError(f"need 0 <= --k-min <= --k and --k >= 1, got {k_min}, {k}")
    report = bench_rollout(model, n, epochs, runs, prompts, max_tokens, k, k_min or None, device, dtype, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    report["plot"] = str(plot_report(report, plot or Path("benchmarks/results") / f"rollout-{figure_name(model)}.png"))
    if json_out:
        emit_json(report)
        return
    table = Table("epoch", "arm", "tokens/s", "× plain", "mean accept", "lossless")
    for r in report["results"]:
        table.add_row(str(r["epoch"]), r["arm"], cell(r, "tokens_per_s", ".1f"), cell(r, "speedup_vs_plain", ".2f"), cell(r, "mean_accept_len", ".2f"),
                      str(r["lossless"]) if r["lossless"] is not None else "—")
    Console().print(table)
    err.print(f"[dim]{report['prompts']} prompts x{n}, {max_tokens} tokens, k {k}, {report['threads']} thread(s), median of {runs}; plot {report['plot']}[/dim]")

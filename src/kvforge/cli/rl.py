"""`kvforge bench rl`: an RL loop end to end (rollouts plain and drafted, GRPO updates loaded into
the rollout engine without a restart)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvforge.cli.common import DeviceOpt, JsonOpt, KOpt, ModelOpt, bench_app, cell, emit_json, err, load_engine, figure_name, setup_threads, user_errors
from kvforge.errors import KvforgeError


@bench_app.command("rl")
@user_errors
def bench_rl_cmd(
    model: str = ModelOpt,
    task: str = typer.Option("sql", "--task", help="sql (text-to-SQL on generated schemas) or arith (word problems)."),
    epochs: int = typer.Option(6, "--epochs", help="Epochs: rollouts, then one GRPO update (none after the last)."),
    group: int = typer.Option(8, "--samples-per-prompt", "-G", help="Samples per problem (a GRPO group)."),
    prompts: int = typer.Option(4, "--prompts", help="Training problems rolled out every epoch."),
    max_tokens: int = typer.Option(48, "--max-new-tokens", "-n"),
    noise: str = typer.Option("fresh", "--noise", help="fresh (the epoch in the noise key: exact draws) or coupled (replays; biased for training)."),
    lr: float = typer.Option(6e-6, "--lr", help="AdamW learning rate of the update (full weights; smollm2-135m: KL ~1e-3 per token)."),
    k: int = KOpt,
    heldout: int = typer.Option(8, "--heldout", help="Held-out problems answered greedily before the first update and after the last."),
    seed: int = typer.Option(0, "--seed"),
    threads: Optional[int] = typer.Option(None, "--threads", help="Threads of the rollouts (default: every physical core); the update runs on every physical core (with vLLM engines, on the rollouts' threads: vLLM fixes torch's threads in its process)."),
    dtype: str = typer.Option("bf16", "--dtype", help="The rollout engine's dtype; the trainer runs float32."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG path (default: benchmarks/results/rl-<task>-<model>-<noise>.png)."),
    also: Optional[Path] = typer.Option(None, "--plot-with", help="Another noise mode's JSON report, drawn beside this one."),
    prefetch: bool = typer.Option(False, "--prefetch", help="The drafted arm with the (accept length, bonus) prefetcher; its hit rate reported."),
    ungated: bool = typer.Option(False, "--ungated", help="Also an arm that verifies every proposal (no gate): what drafting reaches on the task."),
    repeats: int = typer.Option(1, "--repeats", help="Times each group's kvforge arms run, in alternating order (A B B A): each arm's seconds the mean of its timings of the same tokens."),
    engines: str = typer.Option("kvforge", "--engines", help="kvforge, vllm or kvforge,vllm: whose rollout arms run (vLLM's take every update in place)."),
    device: str = DeviceOpt,
    json_out: bool = JsonOpt,
):
    """RL rollouts across epochs: plain vs drafted (previous epoch's rollouts, n-grams) in one run, the policy updated
    by GRPO between epochs and loaded without a restart; tokens/s, token identity, KL per update, reward, acceptance per source."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvforge.bench.rl import bench_rl, check_settings, plot as plot_report
    from kvforge.models.loading import hf_directory

    threads = setup_threads(None) if threads is None else threads  # the update's threads: every core
    chosen = tuple(e.strip() for e in engines.split(",") if e.strip())
    check_settings(task, noise, epochs, group, prompts, max_tokens, k, threads, heldout, lr, chosen, repeats, ungated)
    if "vllm" in chosen:
        from kvforge.cli.vllm import need_vllm

        need_vllm()
    other = None
    if also is not None:
        try:
            other = json.loads(also.read_text())
            other["results"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise KvforgeError(f"--plot-with {also}: not a bench rl JSON report ({exc})") from exc
    engine = load_engine(model, device, dtype)
    trainer_model = AutoModelForCausalLM.from_pretrained(str(hf_directory(model)), dtype=torch.float32)
    report = bench_rl(engine, trainer_model, task, epochs, group, prompts, max_tokens, noise, lr, k, threads, heldout, seed,
                      progress=lambda m: err.print(f"[dim]{m}[/dim]"), engines=chosen, vllm_dir=hf_directory(model) if "vllm" in chosen else None,
                      prefetch=prefetch, repeats=repeats, ungated=ungated)
    report["model"] = model
    path = plot or Path("benchmarks/results") / f"rl-{task}-{figure_name(model)}-{noise}.png"
    report["plot"] = str(plot_report([report] + ([other] if other else []), path))
    if json_out:
        emit_json(report)
        return
    table = Table("epoch", "arm", "tokens/s", "× plain", "identical", "KL to previous", "reward", "mean accept", "rows drafted", "proposals landed by source")
    for r in report["results"]:
        by_source = ", ".join(f"{s} {v:.2f}" for s, v in (r["match_by_source"] or {}).items())
        table.add_row(str(r["epoch"]), r["arm"], cell(r, "tokens_per_s", ".1f"), cell(r, "speedup_vs_plain", ".2f"), str(r["token_identical"]),
                      cell(r, "kl_to_previous", ".2e"), cell(r, "reward_mean", ".3f"), cell(r, "mean_accept_len", ".2f"), cell(r, "rows_drafted", ".2f"),
                      by_source or "—")
    Console().print(table)
    held = report["heldout_reward"]
    err.print(f"[dim]{task}, {noise} noise: {prompts} problems x{group}, {max_tokens} tokens, {threads} rollout thread(s); "
              f"held-out reward {cell(held, 'before', '.3f')} -> {cell(held, 'after', '.3f')}; plot {report['plot']}[/dim]")

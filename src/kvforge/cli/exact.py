"""`kvforge bench exact` and `eval exact`: the exact engine against transformers, in speed and in logits."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvforge.cli.common import (
    DeviceOpt, DtypeOpt, ReferenceDtypeOpt, JsonOpt, ModelOpt, ThreadsOpt, bench_app, dtype_of, emit_json, err, eval_app, load_engine, parse_lengths,
    setup_threads,
    user_errors,
)
from kvforge.errors import KvforgeError


@bench_app.command("exact")
@user_errors
def bench_exact_cmd(
    model: str = ModelOpt,
    tokens: str = typer.Option("1024,4096", "--tokens", help="Comma-separated prompt lengths."),
    runs: int = typer.Option(3, "--runs", help="Timed runs per arm (median reported)."),
    decode_tokens: int = typer.Option(64, "--decode-tokens"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Exact engine vs transformers (sdpa) on the same weights: prefill, decode, KV bytes, logit parity over every prompt position."""
    import time

    from kvforge.bench.exact import bench_exact

    setup_threads(threads)
    lengths = parse_lengths(tokens)
    import transformers  # noqa: F401  (the interpreter-wide import is not part of loading a model)

    start = time.perf_counter()
    engine = load_engine(model, device, dtype)
    load_s = time.perf_counter() - start
    report = bench_exact(engine, lengths, runs=runs, decode_tokens=decode_tokens, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    report["load_s"] = load_s  # includes a GGUF conversion only when none was cached
    if json_out:
        emit_json(report)
        return
    table = Table("tokens", "prefill s", "HF prefill s", "prefill ×HF", "decode tok/s", "HF decode tok/s", "decode ×HF", "KV bytes", "max |Δlogit| (all positions)")
    for r in report["results"]:
        table.add_row(
            str(r["tokens"]), f"{r['prefill_s']:.3f}", f"{r['hf_prefill_s']:.3f}", f"{r['prefill_speedup_vs_hf']:.2f}",
            f"{r['decode_tokens_per_s']:.1f}", f"{r['hf_decode_tokens_per_s']:.1f}", f"{r['decode_speedup_vs_hf']:.2f}",
            f"{r['kv_bytes']:,}", f"{r['max_abs_logit_diff']:.2e}",
        )
    Console().print(table)
    err.print(f"[dim]{report['threads']} thread(s), median of {runs} runs after a warm-up; model load {load_s:.1f} s[/dim]")


@eval_app.command("exact")
@user_errors
def eval_exact_cmd(
    model: str = ModelOpt,
    prompts: int = typer.Option(5, "--prompts", help="Held-out prompts to compare."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n"),
    device: str = DeviceOpt,
    dtype: str = ReferenceDtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Exact engine vs transformers on real prompts: logit difference and greedy token identity."""
    from kvforge.evaluate.parity import eval_parity

    setup_threads(threads)
    if prompts < 1 or max_new_tokens < 1:
        raise KvforgeError("--prompts and --max-new-tokens must be >= 1")
    engine = load_engine(model, device, dtype)
    report = eval_parity(engine, prompts, max_new_tokens, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    report["dtype"] = dtype_of(engine)
    if json_out:
        emit_json(report)
        return
    low = "transformers_diff_vs_fp32" in report  # a low precision: both engines against transformers' fp32 too
    table = Table("prompt tokens", "max |Δlogit|", *(["ours vs fp32", "transformers vs fp32"] if low else []),
                  "greedy identical", "first divergence")
    for r in report["results"]:
        table.add_row(str(r["tokens"]), f"{r['max_abs_logit_diff']:.2e}",
                      *([f"{r['max_abs_logit_diff_vs_fp32']:.2e}", f"{r['transformers_diff_vs_fp32']:.2e}"] if low else []),
                      str(r["greedy_identical"]), str(r["first_divergence"]))
    Console().print(table)

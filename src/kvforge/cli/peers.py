"""`kvforge bench peers`: the exact engine against transformers, vLLM and llama.cpp on the same token ids."""

from __future__ import annotations

from typing import Optional

import typer

from kvforge.errors import KvforgeError
from kvforge.cli.common import DeviceOpt, JsonOpt, ModelOpt, ThreadsOpt, bench_app, emit_json, err, parse_lengths, setup_threads, user_errors


@bench_app.command("peers")
@user_errors
def bench_peers_cmd(
    model: str = ModelOpt,
    tokens: str = typer.Option("1024,4096", "--tokens", help="Comma-separated prompt lengths."),
    dtypes: str = typer.Option("fp32,bf16", "--dtypes", help="Comma-separated dtypes: fp32, bf16 (each loaded once)."),
    engines: str = typer.Option("kvforge,transformers,vllm,llama.cpp,llama.cpp-q8_0", "--engines",
                                help="Comma-separated engines: kvforge, transformers, vllm, llama.cpp (the GGUF at the pass's dtype), "
                                     "llama.cpp-q8_0 (at Q8_0); one that is not installed is skipped."),
    decode_tokens: int = typer.Option(64, "--decode-tokens"),
    runs: int = typer.Option(3, "--runs", help="Timed runs per arm (median reported)."),
    copy_new_tokens: int = typer.Option(128, "--copy-new-tokens", help="New tokens per copy-workload prompt."),
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """kvforge vs transformers, vLLM and llama.cpp, same token ids and threads: prefill and decode tok/s per length and dtype, copy-workload tok/s."""
    from kvforge.bench.peers import DTYPES, ENGINES, bench_peers, markdown_table, parse_choices

    lengths = parse_lengths(tokens)
    dtype_names = parse_choices(dtypes, list(DTYPES), "--dtypes")
    engine_names = parse_choices(engines, ENGINES, "--engines")
    setup_threads(threads)
    report = bench_peers(
        model, lengths, dtype_names, engine_names, decode_tokens=decode_tokens, runs=runs, copy_new_tokens=copy_new_tokens,
        device=device,
        progress=lambda m: err.print(f"[dim]{m}[/dim]"),
    )
    for skip in report["skipped"]:
        err.print(f"[yellow]skipped {skip['engine']} {skip['dtype']}:[/yellow] {skip['reason']}", highlight=False)
    if json_out:
        emit_json(report)
        return
    print(markdown_table(report))
    err.print(f"[dim]{report['threads']} thread(s), median of {runs} runs after a warm-up; ratios are kvforge's rate over the peer's (prefill / decode)[/dim]")


@bench_app.command("load")
@user_errors
def bench_load_cmd(
    model: str = ModelOpt,
    dtypes: str = typer.Option("bf16,fp32", "--dtypes", help="Comma-separated dtypes, each loaded in a fresh process."),
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Loading's cost: peak resident memory above `import torch, transformers` against the weights' bytes, load and fingerprint
    seconds; then the resident memory while decoding, with the unpacked weights kept and released (as `serve` does)."""
    from kvforge.bench.loading import bench_load
    from kvforge.models.loading import DTYPES

    names = [d.strip() for d in dtypes.split(",") if d.strip()]
    if not names or any(d not in DTYPES for d in names):
        raise KvforgeError(f"--dtypes: comma-separated fp32, bf16 or fp16, got {dtypes!r}")
    report = bench_load(model, names, setup_threads(threads), progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    if json_out:
        emit_json(report)
        return
    for r in report["results"]:
        print(f"{r['dtype']}: {r['parameters'] / 1e6:.0f}M parameters, weights {r['weight_bytes'] / 1e9:.2f} GB, peak "
              f"{r['peak_above_import_bytes'] / 1e9:.2f} GB above the import ({r['peak_over_weights']:.2f}x), load {r['load_s']:.1f} s, "
              f"fingerprint {r['fingerprint_s']:.1f} s; the tokenizer's share {r['tokenizer_peak_bytes'] / 1e9:.2f} GB; decoding "
              f"{r['rss_decoding_bytes'] / 1e9:.2f} GB ({r['rss_decoding_over_weights']:.2f}x), with the unpacked weights released "
              f"{r['rss_decoding_released_bytes'] / 1e9:.2f} GB ({r['rss_decoding_released_over_weights']:.2f}x)")

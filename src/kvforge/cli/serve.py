"""`kvforge serve` and `kvforge bench serve`: the OpenAI-compatible server, run and measured."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvforge.cli.common import (
    AnchorsOpt, AttendedOpt, CutOpt, DeviceOpt, DtypeOpt, JsonOpt, MapsOpt, ModelOpt, PresetOpt, SplitOpt, ThreadsOpt, app, bench_app,
    emit_json, err, setup_threads, user_errors,
)


RidgeTailOpt = typer.Option(None, "--tail", help="RidgeFill full-depth tail tokens (overrides the preset).")
SpeedTailOpt = typer.Option(None, "--speed-tail", help="SPEED full-depth tail tokens (default 64, or the adapter's).")
BatchedTokensOpt = typer.Option(
    512, "--max-num-batched-tokens", min=0,
    help="Exact, SPEED and RidgeFill prompts longer than this are prefilled in chunks of it, each beside a decode step of the running requests (0: whole prompts).")


@app.command()
@user_errors
def serve(
    model: str = ModelOpt,
    maps: Optional[Path] = MapsOpt,
    preset: str = PresetOpt,
    split: Optional[int] = SplitOpt,
    tail: Optional[int] = RidgeTailOpt,
    attended_rows: Optional[int] = AttendedOpt,
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="SPEED LoRA adapter from `kvforge fit speed`: SPEED requests run it, every other method the base model."),
    cut: Optional[str] = CutOpt,
    anchors: Optional[str] = AnchorsOpt,
    speed_tail: Optional[int] = SpeedTailOpt,
    translator: Optional[Path] = typer.Option(None, "--translator", help="KV-Lingo translator from --model into --target (enables prefill 'handoff')."),
    target: Optional[str] = typer.Option(None, "--target", help="Second served model, the translator's target."),
    handoff_native_tail: int = typer.Option(0, "--handoff-native-tail", help="Hand-off: the prompt's last N tokens the target prefills itself over the translated rows (the newest message, say)."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    max_batch: int = typer.Option(16, "--max-batch", help="Requests decoded together (continuous batching)."),
    queue_size: int = typer.Option(64, "--queue-size", help="Waiting requests before 429."),
    history_entries: int = typer.Option(
        500_000, "--history-entries",
        help="Rollout history for n-gram requests: (n-gram, successor) pairs kept over all prompts (~400 bytes each; LRU; 0: no history).",
    ),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="KVFORGE_API_KEY", show_envvar=True,
        help="Require `Authorization: Bearer KEY` on every route but /health (prefer the environment variable: a flag shows in ps).",
    ),
    metrics_public: bool = typer.Option(False, "--metrics-public", help="With --api-key: serve /metrics without the key."),
    max_body_bytes: Optional[int] = typer.Option(None, "--max-body-bytes", min=1, help="Larger request bodies answer 413 (default 16 MiB)."),
    max_num_batched_tokens: int = BatchedTokensOpt,
    kv_cache_memory: Optional[str] = typer.Option(
        None, "--kv-cache-memory", help="KV-cache memory per weight set (bytes, or with KiB/MiB/GiB): a pool of rows each request reserves its "
                                        "prompt and max tokens from; a request that does not fit waits for running ones to finish. Default: no bound."),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
):
    """OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.
    Prefill exact and SPEED always, RidgeFill with maps (--maps, default: the model's own fit or the
    shipped ones, when there are any), hand-off with --translator and --target."""
    import uvicorn

    from kvforge.artifacts import find_artifact
    from kvforge.serve.app import ServeConfig, build_served, create_app

    setup_threads(threads)
    if maps is None:
        found = find_artifact("maps", model)
        maps = found if found.is_file() else None
    if max_batch < 1 or queue_size < 1 or history_entries < 0 or handoff_native_tail < 0:
        raise ValueError("--max-batch and --queue-size must be >= 1, --history-entries and --handoff-native-tail >= 0")
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty: give a key, or leave it out to serve without one")
    with err.status(f"loading {model}"):
        served = build_served(ServeConfig(
            model, maps, adapter, translator, target, max_batch, queue_size, device, dtype, preset=preset, split=split, tail=tail,
            attended_rows=attended_rows, cut=cut, anchors=anchors, speed_tail=speed_tail, history_entries=history_entries,
            handoff_native_tail=handoff_native_tail, max_num_batched_tokens=max_num_batched_tokens or None,
            kv_cache_memory=parse_bytes(kv_cache_memory) if kv_cache_memory is not None else None,
        ))
    guard = " (API key required)" if api_key else ""
    err.print(f"serving {', '.join(served)} on http://{host}:{port}/v1{guard}", highlight=False)
    # log_level warning: no access log lines (they would hold request paths, never headers or keys)
    limits = {"max_body_bytes": max_body_bytes} if max_body_bytes is not None else {}
    uvicorn.run(create_app(served, api_key, metrics_public, **limits), host=host, port=port, log_level="warning")


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '64KiB' or a byte count -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    value = text.strip().lower()
    unit = next((u for u in units if value.endswith(u)), "")
    try:
        amount = float(value[: len(value) - len(unit)] if unit else value)
    except ValueError:
        raise ValueError(f"--kv-cache-memory {text!r}: give bytes, or a number with KiB, MiB or GiB") from None
    if amount <= 0:
        raise ValueError(f"--kv-cache-memory {text!r} must be positive")
    return int(amount * units.get(unit, 1))


@bench_app.command("serve")
@user_errors
def bench_serve_cmd(
    model: str = ModelOpt,
    maps: Optional[Path] = MapsOpt,
    preset: str = PresetOpt,
    tail: Optional[int] = RidgeTailOpt,
    attended_rows: Optional[int] = AttendedOpt,
    methods: str = typer.Option("exact,ridgefill,speed,ngram", "--methods", help="Comma-separated: exact, ridgefill (the cached maps), speed, ngram."),
    concurrency: str = typer.Option("1,4,16", "--concurrency", help="Comma-separated client counts."),
    requests: int = typer.Option(2, "--requests", help="Requests per client."),
    max_tokens: int = typer.Option(64, "--max-tokens"),
    prompt_tokens: int = typer.Option(256, "--prompt-tokens", help="Held-out text per prompt."),
    arrival_tokens: int = typer.Option(0, "--arrival-tokens", min=0, help="Also: a prompt of this many tokens arriving while --streams streams decode (their inter-token latency during its prefill against their median)."),
    streams: int = typer.Option(15, "--streams", min=1, help="Streams decoding when the --arrival-tokens prompt arrives."),
    arrival_method: str = typer.Option("exact", "--arrival-method", help="How the --arrival-tokens prompt is prefilled: exact, ridgefill (the cached maps), speed, or handoff (from --source)."),
    source: Optional[str] = typer.Option(None, "--source", help="With --arrival-method handoff: the model the arriving prompt is handed off from (a server of both models)."),
    translator: Optional[Path] = typer.Option(None, "--translator", help="With --source: the translator (default: the pair's stage-2 one if present, else its stage-1 one)."),
    batched_tokens: str = typer.Option("512", "--max-num-batched-tokens", help="The server's prefill chunk, comma-separated: one --arrival-tokens run each (0: whole prompts); the first serves the concurrency levels."),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help="The server's KV-cache budget (as `serve`'s); the levels report the most requests run at once and the rows reserved."),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Throughput and TTFT percentiles of a live server at several concurrencies, exact vs each
    method; with --arrival-tokens, streams' inter-token latency while a long prompt is prefilled."""
    from kvforge.bench.serve import bench_serve

    setup_threads(threads)
    levels = [int(c) for c in concurrency.split(",") if c.strip()]
    chunks = [int(c) or None for c in batched_tokens.split(",") if c.strip()]
    if not levels or min(levels) < 1 or requests < 1 or max_tokens < 1:
        raise ValueError("--concurrency, --requests and --max-tokens must be >= 1")
    if not chunks or any(c is not None and c < 0 for c in chunks):
        raise ValueError("--max-num-batched-tokens takes token counts >= 0 (0: whole prompts)")
    report = bench_serve(model, maps, [m.strip() for m in methods.split(",") if m.strip()], levels, requests, max_tokens, prompt_tokens,
                         device, progress=lambda m: err.print(f"[dim]{m}[/dim]"), preset=preset, tail=tail, attended_rows=attended_rows,
                         dtype=dtype, arrival_tokens=arrival_tokens, streams=streams, chunks=chunks,
                         arrival_method=arrival_method, source=source, translator=translator,
                         kv_cache_memory=parse_bytes(kv_cache_memory) if kv_cache_memory is not None else None)
    if json_out:
        emit_json(report)
        return
    table = Table("method", "concurrency", "requests", "tokens/s", "× conc. 1", "decode tokens/s", "× conc. 1", "TTFT p50 s", "TTFT p95 s",
                  "filled %", "shallow %", "ran exact", "most running", "failed")
    for r in report["results"]:
        decode = "—" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.1f}"
        table.add_row(r["method"], str(r["concurrency"]), str(r["requests"]), f"{r['tokens_per_s']:.1f}", f"{r['scaling']:.2f}", decode,
                      "—" if r["decode_scaling"] is None else f"{r['decode_scaling']:.2f}",
                      f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p95_s']:.2f}", f"{100 * r['filled_share']:.0f}", f"{100 * r['shallow_share']:.0f}",
                      str(r["ran_exact"]), str(r["peak_running"]), str(r["failed"]))
    Console().print(table)
    if report["arrival"]:
        arrival = Table("prefill chunk", "streams", "arrival tokens", "method", "its TTFT s", "median ITL ms", "p99 ITL during its prefill ms", "× median")
        for a in report["arrival"]:
            shown = lambda value, digits: "—" if value is None else f"{value:.{digits}f}"  # noqa: E731
            arrival.add_row(str(a["max_num_batched_tokens"] or "whole"), str(a["streams"]), str(a["arrival_tokens"]), a["arrival_method"], shown(a["arrival_ttft_s"], 2),
                            shown(a["median_itl_ms"], 1), shown(a["p99_itl_ms_during_prefill"], 1), shown(a["p99_over_median"], 2))
        Console().print(arrival)

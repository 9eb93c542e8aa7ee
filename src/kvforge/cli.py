"""The `kvforge` command: parses arguments and calls the library. No algorithm lives here.

Bad input (a `KvforgeError` or an invalid setting) prints one line on stderr and exits 2.
With `--json`, a command prints exactly one JSON object, on the last line of stdout; progress
goes to stderr.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from kvforge.errors import KvforgeError

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Forge KV caches instead of computing them in full.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: methods side by side in one process.")
app.add_typer(bench_app, name="bench")
eval_app = typer.Typer(no_args_is_help=True, help="Evaluations: each method measured against exact on held-out data.")
app.add_typer(eval_app, name="eval")
fit_app = typer.Typer(no_args_is_help=True, help="Fit maps once per model, in closed form.")
app.add_typer(fit_app, name="fit")
err = Console(stderr=True)

ModelOpt = typer.Option("smollm2-135m", "--model", "-m", help="Alias, HF directory, .gguf file or hub id.")
DeviceOpt = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N.")
ThreadsOpt = typer.Option(None, "--threads", help="torch CPU threads (default: torch's choice).")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object on the last line of stdout.")
MapsOpt = typer.Option(None, "--maps", help="RidgeFill maps (from `kvforge fit ridgefill`; default: the cached ones).")
PresetOpt = typer.Option("fast", "--preset", help="RidgeFill setting: fast or quality.")
SplitOpt = typer.Option(None, "--split", help="RidgeFill split layer (overrides the preset).")
TailOpt = typer.Option(None, "--tail", help="Full-depth tail tokens (RidgeFill: overrides the preset; SPEED: default 1).")
AttendedOpt = typer.Option(None, "--attended-rows", help="RidgeFill: rows the tail attends to most kept exact, each with the 16 after it (overrides the preset; 0: none).")
CutOpt = typer.Option(None, "--cut", help="SPEED cut: layers (e.g. 22) or a fraction of the depth (default 0.75, or the adapter's).")
AnchorsOpt = typer.Option(None, "--anchors", help="SPEED full-depth anchors: bos, first:K and/or positions, comma-separated (default bos, or the adapter's).")
AdapterOpt = typer.Option(None, "--adapter", help="SPEED LoRA adapter from `kvforge fit speed`: its cut, anchors and tail apply; SPEED runs its weights.")
DraftOpt = typer.Option("none", "--draft", help="Speculative drafter: none, prompt-lookup or ngram (lossless).")
PrefetchOpt = typer.Option(False, "--prefetch", help="n-gram: build the next drafts while the model verifies.")
KOpt = typer.Option(8, "--k", help="Draft tokens per step.")
BudgetOpt = typer.Option(16, "--budget", help="Prefetch candidates per request per step.")


def user_errors(fn):
    """Turn bad input into a one-line message and exit code 2 instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (KvforgeError, ValueError, FileNotFoundError, IsADirectoryError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)

    return wrapper


def _setup(threads: Optional[int]) -> None:
    import torch

    if threads:
        if threads < 1:
            raise KvforgeError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def _load(model: str, device: str):
    from kvforge.engine import Engine
    from kvforge.models import load_model

    with err.status(f"loading {model}"):
        return Engine(load_model(model, device=device))


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


@app.command()
@user_errors
def models(json_out: bool = JsonOpt):
    """List the packaged model aliases, where they come from and whether they are installed."""
    from kvforge.models import PACKAGED_MODELS

    rows = [
        {"alias": m.alias, "description": m.description, "packages": list(m.packages), "installed": m.installed(), "install": m.install}
        for m in PACKAGED_MODELS.values()
    ]
    if json_out:
        _emit({"command": "models", "models": rows})
        return
    table = Table("alias", "installed", "what", "from (pip)")
    for r in rows:
        table.add_row(r["alias"], "yes" if r["installed"] else "no", r["description"], r["install"])
    Console().print(table)


@app.command()
@user_errors
def generate(
    model: str = ModelOpt,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", "-f", help="Read the prompt from a file."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    chunk_size: Optional[int] = typer.Option(None, "--chunk-size", help="Prefill chunk (tokens)."),
    method: str = typer.Option("exact", "--method", help="Prefill method: exact, ridgefill or speed."),
    maps: Optional[Path] = MapsOpt,
    preset: str = PresetOpt,
    split: Optional[int] = SplitOpt,
    tail: Optional[int] = TailOpt,
    exact_rows: Optional[str] = typer.Option(None, "--exact-rows", help="RidgeFill: prompt positions kept exact, comma-separated."),
    attended_rows: Optional[int] = AttendedOpt,
    cut: Optional[str] = CutOpt,
    anchors: Optional[str] = AnchorsOpt,
    adapter: Optional[Path] = AdapterOpt,
    draft: str = DraftOpt,
    prefetch: bool = PrefetchOpt,
    k: int = KOpt,
    budget: int = BudgetOpt,
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Generate a completion: exact prefill, RidgeFill (late layers filled from ridge maps) or
    SPEED (prompt rows cached only below the cut; decode runs full depth); decoding plain or
    speculative with a lossless drafter."""
    from kvforge.fill import ridgefill, speed
    from kvforge.generation import GenerationConfig
    from kvforge.plan import PrefillReport
    from kvforge.prompting import encode_prompt
    from kvforge.speculative.rollout import DraftConfig, generate_group

    _setup(threads)
    if (prompt is None) == (prompt_file is None):
        raise KvforgeError("give exactly one of --prompt or --prompt-file")
    text = prompt if prompt is not None else _read_prompt(prompt_file)
    if not text.strip():
        raise KvforgeError("empty prompt: give some text")
    config = GenerationConfig(max_new_tokens, temperature, top_k, top_p, seed, tuple(stop), chunk_size=chunk_size)
    if method not in ("exact", "ridgefill", "speed"):
        raise KvforgeError(f"unknown --method {method!r}: use exact, ridgefill or speed")
    if adapter is not None and method != "speed":
        raise KvforgeError(f"--adapter is a SPEED adapter: use it with --method speed, not {method}")
    drafting = DraftConfig(draft, k, prefetch, budget)
    engine = _load(model, device)
    ids = encode_prompt(engine.model.tokenizer, text, chat=chat)
    plan, setting = None, None
    if method == "ridgefill":
        rf, resident = ridgefill.resolve(engine, maps, preset, split, tail, attended_rows, _parse_rows(exact_rows))
        plan, setting = ridgefill.ridgefill_plan(engine, ids, rf, resident), asdict(rf)
    elif method == "speed":
        spd = speed.resolve(engine, cut, anchors, tail, adapter)
        engine, plan, setting = spd.engine, spd.plan(len(ids)), asdict(spd.config)
    ran = PrefillReport.planned(plan, len(ids), engine.num_layers)
    if ran.reason and method != "exact":
        err.print(f"[yellow]note:[/yellow] {ran.reason}; running exact prefill", highlight=False, soft_wrap=True)
    stream = None if json_out else (lambda _i, delta: (sys.stdout.write(delta), sys.stdout.flush()))
    outputs, stats = generate_group(engine, ids, 1, config, drafting, on_text=stream, plan=plan)
    out = outputs[0]
    if json_out:
        _emit(
            {
                "command": "generate",
                "model": model,
                "method": method,
                **{key: value for key, value in ran.as_dict().items() if key != "prompt_tokens"},  # what the prefill ran
                "setting": setting,
                "tokens": out.prompt_tokens,
                "prompt_tokens": out.prompt_tokens,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "ttft_s": out.ttft_s,
                "decode_tokens_per_s": out.decode_tokens_per_s,
                "adapter": str(adapter) if adapter else None,
                "draft": draft,
                "speculative": stats.as_dict() if stats else None,
            }
        )
    else:
        sys.stdout.write("\n")
        err.print(
            f"[dim]{out.prompt_tokens} prompt tokens, {len(out.token_ids)} generated, TTFT {out.ttft_s:.3f} s, "
            f"{out.decode_tokens_per_s:.1f} tokens/s, finish: {out.finish_reason}"
            + (f", {draft} drafting: mean accept length {stats.mean_accept_len:.2f} of {k}" if stats else "")
            + (f", prefetch coverage {stats.coverage:.2f}" if stats and prefetch else "")
            + "[/dim]"
        )


def _parse_rows(text: Optional[str]) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in (text or "").split(",") if t.strip())
    except ValueError as exc:
        raise KvforgeError(f"--exact-rows takes comma-separated token positions, got {text!r}") from exc


def _read_prompt(path: Path) -> str:
    if not path.is_file():
        raise KvforgeError(f"prompt file {str(path)!r} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise KvforgeError(f"prompt file {str(path)!r} is not UTF-8 text") from exc


@app.command()
@user_errors
def rollout(
    model: str = ModelOpt,
    prompts: Path = typer.Option(..., "--prompts", help="Prompts: .jsonl with a \"prompt\" field per line, or text with one prompt per line."),
    samples_per_prompt: int = typer.Option(8, "--samples-per-prompt", "-G", help="Samples per prompt (one batch, one shared n-gram cache)."),
    temperature: float = typer.Option(1.0, "--temperature", "-t"),
    top_p: float = typer.Option(1.0, "--top-p"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="Wrap each prompt in the model's chat template."),
    draft: str = typer.Option("ngram", "--draft", help="none, prompt-lookup or ngram."),
    prefetch: bool = PrefetchOpt,
    k: int = KOpt,
    budget: int = BudgetOpt,
    no_gate: bool = typer.Option(False, "--no-gate", help="Draft every step (no DraftGate pausing rejected drafters)."),
    out: Path = typer.Option(Path("rollouts.jsonl"), "--out", "-o", help="JSONL of rollouts, one line per sample."),
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """RL-style rollouts: G samples per prompt, decoded together, plain or with a lossless drafter."""
    import time

    from kvforge.generation import GenerationConfig
    from kvforge.prompting import encode_prompt
    from kvforge.speculative.rollout import DraftConfig, generate_group

    _setup(threads)
    if samples_per_prompt < 1:
        raise KvforgeError("--samples-per-prompt must be >= 1")
    texts = _read_prompts(prompts)
    drafting = DraftConfig(draft, k, prefetch, budget, gate=not no_gate)
    config = GenerationConfig(max_new_tokens, temperature, 0, top_p, seed)
    engine = _load(model, device)
    encoded = [encode_prompt(engine.model.tokenizer, t, chat=chat) for t in texts]
    tokens, accepted, steps, start = 0, 0, 0, time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for index, ids in enumerate(encoded):
            err.print(f"[dim]prompt {index + 1}/{len(encoded)}: {len(ids)} tokens x{samples_per_prompt}[/dim]")
            outputs, stats = generate_group(engine, ids, samples_per_prompt, config, drafting)
            for sample, g in enumerate(outputs):
                record = {"prompt_index": index, "sample": sample, "text": g.text, "token_ids": g.token_ids, "finish_reason": g.finish_reason}
                f.write(json.dumps(record) + "\n")
                tokens += len(g.token_ids)
            if stats:
                accepted, steps = accepted + stats.accepted, steps + stats.request_steps
    elapsed = time.perf_counter() - start
    summary = {
        "command": "rollout",
        "model": model,
        "method": draft,
        "gate": drafting.gate,
        "tokens": tokens,
        "prompts": len(encoded),
        "samples_per_prompt": samples_per_prompt,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "mean_accept_len": accepted / steps if steps else None,
        "out": str(out),
    }
    if json_out:
        _emit(summary)
        return
    err.print(f"wrote {len(encoded) * samples_per_prompt} rollouts to {out}: {tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tokens/s)")


def _read_prompts(path: Path) -> list[str]:
    """Prompts from .jsonl ({"prompt": ...} per line) or plain text (one per non-empty line)."""
    text = _read_prompt(path)
    if path.suffix == ".jsonl":
        prompts = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompt = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise KvforgeError(f"{path}:{number}: expected a JSON object with a \"prompt\" string") from exc
            if not isinstance(prompt, str) or not prompt.strip():
                raise KvforgeError(f"{path}:{number}: empty prompt")
            prompts.append(prompt)
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise KvforgeError(f"{path} holds no prompts")
    return prompts


@bench_app.command("exact")
@user_errors
def bench_exact_cmd(
    model: str = ModelOpt,
    tokens: str = typer.Option("1024,4096", "--tokens", help="Comma-separated prompt lengths."),
    runs: int = typer.Option(3, "--runs", help="Timed runs per arm (median reported)."),
    decode_tokens: int = typer.Option(64, "--decode-tokens"),
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Exact engine vs transformers (sdpa) on the same weights: prefill, decode, KV bytes, logit parity over every prompt position."""
    from kvforge.bench.exact import bench_exact

    import time

    _setup(threads)
    lengths = _parse_lengths(tokens)
    import transformers  # noqa: F401  (the interpreter-wide import is not part of loading a model)

    start = time.perf_counter()
    engine = _load(model, device)
    load_s = time.perf_counter() - start
    report = bench_exact(engine, lengths, runs=runs, decode_tokens=decode_tokens, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    report["load_s"] = load_s  # includes a GGUF conversion only when none was cached
    if json_out:
        _emit(report)
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


@fit_app.command("ridgefill")
@user_errors
def fit_ridgefill_cmd(
    model: str = ModelOpt,
    split: str = typer.Option("fast,quality", "--split", help="Layer indices and/or presets (fast, quality), comma-separated; one file holds them all."),
    calib_tokens: int = typer.Option(200_000, "--calib-tokens", help="Calibration tokens (fit split of the packaged chat data)."),
    seq_len: int = typer.Option(2048, "--seq-len", help="Tokens per calibration sequence."),
    lam: Optional[float] = typer.Option(None, "--lam", help="Ridge λ relative to the mean diagonal; default: per layer by held-out R²."),
    int8: bool = typer.Option(False, "--int8", help="Store maps as int8 per output channel; reports the error."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output .safetensors (default: $KVFORGE_HOME/maps/<model>-ridgefill.safetensors)."),
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Fit RidgeFill maps: one exact pass over calibration text, then a ridge solve per late layer."""
    import time

    from tqdm import tqdm

    from kvforge.artifacts import artifact_path
    from kvforge.fill.calibrate import CalibrationConfig, fit_ridgefill
    from kvforge.fill.ridgefill import parse_splits

    _setup(threads)
    engine = _load(model, device)
    splits = parse_splits(split, engine.num_layers)
    config = CalibrationConfig(tuple(splits), calib_tokens, seq_len, lam=lam, int8=int8)
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
        "tokens": maps.info["calibration"]["fit_rows"] + maps.info["calibration"]["held_out_rows"],
        "out": str(path),
        "splits": maps.splits,
        "seconds": elapsed,
        "int8": int8,
        "info": maps.info,
    }
    if json_out:
        _emit(summary)
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


def _parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise KvforgeError(f"--tokens must be comma-separated integers, got {text!r}") from exc
    if not lengths or any(n < 1 for n in lengths):
        raise KvforgeError(f"--tokens must list positive lengths, got {text!r}")
    return lengths


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
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG path (default: benchmarks/results/ridgefill-<model>.png)."),
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """TTFT of exact vs RidgeFill (maps resident and streamed) vs identity fill, with the MAC ceiling."""
    from kvforge.bench.ridgefill import bench_ridgefill, plot as plot_report
    from kvforge.fill import ridgefill
    from kvforge.fill.maps import RidgeMaps

    _setup(threads)
    lengths = _parse_lengths(tokens)
    engine = _load(model, device)
    config, resident = ridgefill.resolve(engine, maps, preset, split, tail)
    streamed = RidgeMaps.load(resident.path, streamed=True)
    report = bench_ridgefill(engine, resident, streamed, config, lengths, runs, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    report["model"] = model
    report["plot"] = str(plot_report(report, plot or Path("benchmarks/results") / f"ridgefill-{_safe(model)}.png"))
    if json_out:
        _emit(report)
        return
    table = Table("tokens", "exact s", "RidgeFill s", "speedup", "streamed", "identity", "ceiling", "filled")
    for r in report["results"]:
        table.add_row(
            str(r["tokens"]), f"{r['exact_ttft_s']:.2f}", f"{r['ridgefill_ttft_s']:.2f}", f"{r['speedup']:.2f}×",
            f"{r['speedup_streamed']:.2f}×", f"{r['speedup_identity']:.2f}×", f"{r['ceiling']:.2f}×", f"{100 * r['filled_fraction']:.0f} %",
        )
    Console().print(table)
    err.print(
        f"[dim]split {config.split}, tail {config.tail}; maps resident {report['maps_resident_bytes'] / 2**20:.1f} MiB, "
        f"streamed {report['maps_streamed_bytes'] / 2**20:.2f} MiB at a time; {report['threads']} thread(s), median of {runs}; plot {report['plot']}[/dim]"
    )


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


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
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """RidgeFill and identity fill vs exact on held-out text: novel/key-token loss, splices, needles."""
    from kvforge.evaluate.ridgefill import EvalSettings, eval_ridgefill, summary
    from kvforge.fill import ridgefill

    _setup(threads)
    if samples < 2 or needles < 0:
        raise KvforgeError("--samples must be >= 2 (for the bootstrap) and --needles >= 0")
    engine = _load(model, device)
    config, resident = ridgefill.resolve(engine, maps, preset, split, tail)
    settings = EvalSettings(samples=samples, needles=needles, prompt_tokens=prompt_tokens)
    report = eval_ridgefill(engine, resident, config, settings, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    out = summary(report, model, config, prompt_tokens)
    arms = report["arms"]
    if json_out:
        _emit(out)
        return
    table = Table("arm", "novel nats", "novel ppl gap [95 % CI]", "key nats", "key ppl gap")
    for name, a in arms.items():
        gap = f"{a['ppl_gap_novel_pct']:+.2f} % [{a['ppl_gap_novel_ci'][0]:+.2f}, {a['ppl_gap_novel_ci'][1]:+.2f}]" if name != "exact" else "—"
        key_gap = f"{a['ppl_gap_key_pct']:+.2f} %" if name != "exact" else "—"
        table.add_row(name, f"{a['novel_nll']:.4f}", gap, f"{a['key_nll']:.4f}", key_gap)
    Console().print(table)
    n = report["needle"]
    if n["samples"]:
        Console().print(f"needles ({n['samples']}): exact {n['exact']:.0f} %; " + ", ".join(
            f"{arm} {n[arm]:.0f} % ({n['answered_in_filled'][arm]}/{n['filled'][arm]} wholly filled answered)" for arm in n["filled"]))


@fit_app.command("speed")
@user_errors
def fit_speed_cmd(
    model: str = ModelOpt,
    cut: str = typer.Option("0.75", "--cut", help="Layers (e.g. 22) or a fraction of the depth."),
    steps: int = typer.Option(200, "--steps", help="Optimizer steps."),
    lora_rank: int = typer.Option(8, "--lora-rank", help="LoRA rank on the fused q/k/v and gate/up projections."),
    lr: float = typer.Option(5e-4, "--lr", help="Peak learning rate (cosine schedule, 5 % warmup)."),
    accumulate: int = typer.Option(1, "--accumulate", help="Conversations per optimizer step."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Prompt + reply tokens per training conversation."),
    anchors: Optional[str] = AnchorsOpt,
    tail: int = typer.Option(1, "--tail", help="Full-depth tail tokens of the prompt."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output .safetensors (default: $KVFORGE_HOME/adapters/<model>-speed-cut<C>.safetensors)."),
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Adapt a model to SPEED: LoRA fine-tuning on the fit split of the chat data under the SPEED mask."""
    from tqdm import tqdm

    from kvforge.artifacts import artifact_path
    from kvforge.fill.speed import resolve_config
    from kvforge.fill.speed_fit import SpeedFitConfig, fit_speed

    _setup(threads)
    config = SpeedFitConfig(steps=steps, rank=lora_rank, lr=lr, accumulate=accumulate, max_tokens=max_tokens)
    engine = _load(model, device)
    speed = resolve_config(engine.num_layers, cut, anchors, tail)
    path = out or artifact_path("adapter", model, cut=speed.cut)
    with tqdm(total=steps, unit="step", desc=f"SPEED cut {speed.cut}", file=sys.stderr, disable=json_out and not sys.stderr.isatty()) as bar:

        def progress(step: int, loss: float) -> None:
            bar.set_postfix(loss=f"{loss:.3f}")
            bar.update(1)

        lora = fit_speed(engine, speed, config, model, progress)
    lora.save(path)
    summary = {"command": "fit speed", "model": model, "method": "speed", "tokens": lora.info["training"]["tokens"], "out": str(path), **lora.info}
    if json_out:
        _emit(summary)
        return
    err.print(
        f"wrote {path}: cut {speed.cut}/{engine.num_layers}, rank {lora_rank}, {steps} steps in {lora.info['seconds']:.0f} s; "
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
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """TTFT, TPOT and active KV bytes of exact vs SPEED at several cuts, with their ceilings."""
    from kvforge.bench.speed import bench_speed, plot as plot_report
    from kvforge.fill import speed

    _setup(threads)
    lengths = _parse_lengths(tokens)
    if decode_tokens < 1:
        raise KvforgeError("--decode-tokens must be >= 1")
    engine = _load(model, device)
    # The adapter changes weights, not cost: it is accepted (its policy applied) so a bench runs the served model.
    spd = speed.resolve(engine, None, anchors, tail, adapter)
    if cuts is None:
        cuts = str(spd.config.cut) if adapter is not None else ",".join(map(str, speed.BENCH_CUTS))
    configs = [speed.resolve_config(engine.num_layers, c, anchors, tail, spd.lora) for c in cuts.split(",") if c.strip()]
    if not configs:
        raise KvforgeError("--cuts is empty")
    report = bench_speed(spd.engine, configs, lengths, runs, decode_tokens, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    report["model"] = model
    report["plot"] = str(plot_report(report, plot or Path("benchmarks/results") / f"speed-{_safe(model)}.png"))
    if json_out:
        _emit(report)
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
    no_gate: bool = typer.Option(False, "--no-gate", help="Drafting arms draft every step (no DraftGate)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG path (default: benchmarks/results/ngram-<workload>-<model>.png)."),
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Plain vs prompt-lookup vs n-gram drafting (synchronous, prefetch): tokens/s, acceptance, losslessness."""
    from kvforge.bench.ngram import WORKLOADS, bench_ngram, plot as plot_report

    _setup(threads)
    if workload not in WORKLOADS:
        raise KvforgeError(f"unknown workload {workload!r}: use {' or '.join(WORKLOADS)}")
    if runs < 1 or k < 1 or budget < 1 or samples_per_prompt < 1 or (prompts is not None and prompts < 1):
        raise KvforgeError("--runs, --k, --budget, --samples-per-prompt and --prompts must be >= 1")
    engine = _load(model, device)
    report = bench_ngram(engine, workload, runs, k, budget, max_new_tokens, samples_per_prompt, prompts, progress=lambda m: err.print(f"[dim]{m}[/dim]"),
                          gate=not no_gate)
    report["model"] = model
    report["plot"] = str(plot_report(report, plot or Path("benchmarks/results") / f"ngram-{workload}-{_safe(model)}.png"))
    if json_out:
        _emit(report)
        return
    table = Table("arm", "tokens/s", "× plain", "mean accept", "lossless", "coverage", "predicted × sync", "measured × sync")
    for r in report["results"]:
        fmt = lambda key, spec: format(r[key], spec) if r.get(key) is not None else "—"  # noqa: E731
        table.add_row(r["arm"], fmt("tokens_per_s", ".1f"), fmt("speedup_vs_plain", ".2f"), fmt("mean_accept_len", ".2f"),
                      str(r.get("lossless", "—")), fmt("coverage", ".3f"), fmt("predicted_speedup", ".3f"), fmt("speedup_vs_sync", ".3f"))
    Console().print(table)
    err.print(f"[dim]{report['workload']}: {report['prompts']} prompts x{report['samples_per_prompt']}, k {k}, budget {budget}, {report['threads']} thread(s), median of {runs}; plot {report['plot']}[/dim]")


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
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Exact vs SPEED (training-free and, with --adapter, adapted) on held-out replies and needles."""
    from kvforge.evaluate.speed import SpeedEvalSettings, eval_speed, summary
    from kvforge.fill.speed import resolve

    _setup(threads)
    if samples < 2 or needles < 0 or max_tokens < 32:
        raise KvforgeError("--samples must be >= 2 (for the bootstrap), --needles >= 0 and --max-tokens >= 32")
    base = _load(model, device)
    spd = resolve(base, cut, anchors, tail, adapter)  # with an adapter, a second weight set: the base arms keep the base model
    speed, adapted = spd.config, (spd.engine if adapter is not None else None)
    settings = SpeedEvalSettings(samples=samples, max_tokens=max_tokens, needles=needles, needle_tokens=needle_tokens)
    report = eval_speed(base, adapted, speed, settings, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    out = summary(report, model, speed, base.num_layers, str(adapter) if adapter else None)
    if json_out:
        _emit(out)
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


@eval_app.command("exact")
@user_errors
def eval_exact_cmd(
    model: str = ModelOpt,
    prompts: int = typer.Option(5, "--prompts", help="Held-out prompts to compare."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n"),
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Exact engine vs transformers on real prompts: logit difference and greedy token identity."""
    from kvforge.evaluate.parity import eval_parity

    _setup(threads)
    if prompts < 1 or max_new_tokens < 1:
        raise KvforgeError("--prompts and --max-new-tokens must be >= 1")
    engine = _load(model, device)
    report = eval_parity(engine, prompts, max_new_tokens, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    if json_out:
        _emit(report)
        return
    table = Table("prompt tokens", "max |Δlogit|", "greedy identical", "first divergence")
    for r in report["results"]:
        table.add_row(str(r["tokens"]), f"{r['max_abs_logit_diff']:.2e}", str(r["greedy_identical"]), str(r["first_divergence"]))
    Console().print(table)


@app.command()
@user_errors
def demo(
    model: str = ModelOpt,
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n"),
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """A long real prompt answered by each method, with a one-screen summary."""
    from kvforge.demo import run_demo

    from kvforge.artifacts import artifact_path
    from kvforge.demo import PARTNERS

    _setup(threads)
    engine = _load(model, device)
    maps = artifact_path("maps", engine.model.name)
    if not maps.is_file():
        err.print(f"[dim]first run: fitting RidgeFill maps for {model} once (a few minutes), cached in {maps}[/dim]")
    partner = PARTNERS.get(engine.model.name)
    translator = artifact_path("translator", partner, target=engine.model.name) if partner else None
    if translator is not None and not translator.is_file():
        err.print(f"[dim]first run: fitting a KV-Lingo translator {partner} → {model} once (a few minutes), cached in {translator}[/dim]")
    with err.status("answering"):
        rows, prompt = run_demo(engine, max_new_tokens)
    if json_out:
        _emit(
            {
                "command": "demo",
                "model": model,
                "method": ",".join(r.method for r in rows),
                "tokens": rows[0].prompt_tokens,
                "results": [r.__dict__ for r in rows],
            }
        )
        return
    out = Console()
    out.print(f"[bold]kvforge demo[/bold] on {model}: a held-out ShareGPT conversation, then: {prompt.splitlines()[-1]!r}")
    table = Table("method", "prompt tokens", "TTFT s", "decode tok/s")
    for r in rows:
        table.add_row(r.method, str(r.prompt_tokens), f"{r.ttft_s:.2f}", f"{r.decode_tokens_per_s:.1f}")
    out.print(table)
    for r in rows:
        answer = " ".join(r.answer.split())
        out.print(f"[bold]{r.method}[/bold]: {answer[:400]}{'…' if len(answer) > 400 else ''}", highlight=False)


# KV-Lingo and server commands live in their own modules; importing them registers them above.
from kvforge import cli_lingo, cli_serve  # noqa: E402,F401


def main() -> None:
    app()


if __name__ == "__main__":
    main()

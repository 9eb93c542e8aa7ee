"""The `kvforge` command: parses arguments and calls the library. No algorithm lives here.

Bad input (a `KvforgeError` or an invalid setting) prints one line on stderr and exits 2.
With `--json`, a command prints exactly one JSON object, on the last line of stdout; progress
goes to stderr.
"""

from __future__ import annotations

import functools
import json
import sys
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
err = Console(stderr=True)

ModelOpt = typer.Option("smollm2-135m", "--model", "-m", help="Alias, HF directory, .gguf file or hub id.")
DeviceOpt = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N.")
ThreadsOpt = typer.Option(None, "--threads", help="torch CPU threads (default: torch's choice).")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object on the last line of stdout.")


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
    device: str = DeviceOpt,
    threads: Optional[int] = ThreadsOpt,
    json_out: bool = JsonOpt,
):
    """Generate a completion with the exact engine."""
    from kvforge.generation import GenerationConfig
    from kvforge.prompting import encode_prompt

    _setup(threads)
    if (prompt is None) == (prompt_file is None):
        raise KvforgeError("give exactly one of --prompt or --prompt-file")
    text = prompt if prompt is not None else _read_prompt(prompt_file)
    if not text.strip():
        raise KvforgeError("empty prompt: give some text")
    config = GenerationConfig(max_new_tokens, temperature, top_k, top_p, seed, tuple(stop), chunk_size=chunk_size)
    engine = _load(model, device)
    ids = encode_prompt(engine.model.tokenizer, text, chat=chat)
    stream = None if json_out else (lambda _i, delta: (sys.stdout.write(delta), sys.stdout.flush()))
    out = engine.generate(ids, config, on_text=stream)[0]
    if json_out:
        _emit(
            {
                "command": "generate",
                "model": model,
                "method": "exact",
                "tokens": out.prompt_tokens,
                "prompt_tokens": out.prompt_tokens,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "ttft_s": out.ttft_s,
                "decode_tokens_per_s": out.decode_tokens_per_s,
            }
        )
    else:
        sys.stdout.write("\n")
        err.print(
            f"[dim]{out.prompt_tokens} prompt tokens, {len(out.token_ids)} generated, TTFT {out.ttft_s:.3f} s, "
            f"{out.decode_tokens_per_s:.1f} tokens/s, finish: {out.finish_reason}[/dim]"
        )


def _read_prompt(path: Path) -> str:
    if not path.is_file():
        raise KvforgeError(f"prompt file {str(path)!r} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise KvforgeError(f"prompt file {str(path)!r} is not UTF-8 text") from exc


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
    """Exact engine vs transformers (sdpa) on the same weights: prefill, decode, KV bytes, logit parity."""
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
    table = Table("tokens", "prefill s", "HF prefill s", "prefill ×HF", "decode tok/s", "HF decode tok/s", "decode ×HF", "KV bytes", "max |Δlogit|")
    for r in report["results"]:
        table.add_row(
            str(r["tokens"]), f"{r['prefill_s']:.3f}", f"{r['hf_prefill_s']:.3f}", f"{r['prefill_speedup_vs_hf']:.2f}",
            f"{r['decode_tokens_per_s']:.1f}", f"{r['hf_decode_tokens_per_s']:.1f}", f"{r['decode_speedup_vs_hf']:.2f}",
            f"{r['kv_bytes']:,}", f"{r['max_abs_logit_diff']:.2e}",
        )
    Console().print(table)
    err.print(f"[dim]{report['threads']} thread(s), median of {runs} runs after a warm-up; model load {load_s:.1f} s[/dim]")


def _parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise KvforgeError(f"--tokens must be comma-separated integers, got {text!r}") from exc
    if not lengths or any(n < 1 for n in lengths):
        raise KvforgeError(f"--tokens must list positive lengths, got {text!r}")
    return lengths


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

    _setup(threads)
    engine = _load(model, device)
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()

"""What every `kvforge` command shares: the typer apps, the common options, error handling and
output. Commands register on these apps from their own modules.

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

from kvforge.errors import KvforgeError
from kvforge.provenance import report
from kvforge.paths import figure_name, safe_name  # noqa: F401  (re-exported to the command modules)

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
DtypeOpt = typer.Option(
    "auto", "--dtype",
    help="Weights and KV cache: auto (bf16 on GPUs and on CPUs that multiply it natively: AMX, AVX512-BF16; else fp32), "
         "fp32 (the exact reference), bf16 or fp16. Maps and adapters fitted in fp32 load in any.",
)
# Fits and evaluations measure against exact: fp32 unless told otherwise.
ReferenceDtypeOpt = typer.Option(
    "fp32", "--dtype", help="Weights and KV cache: fp32 (the exact reference), bf16, fp16 or auto (as `generate`'s).",
)
ThreadsOpt = typer.Option(None, "--threads", help="torch CPU threads (default: every physical core this process may use).")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object on the last line of stdout.")
MapsOpt = typer.Option(None, "--maps", help="RidgeFill maps (from `kvforge fit ridgefill`; default: your own fit in $KVFORGE_HOME, else the shipped ones).")
PresetOpt = typer.Option("fast", "--preset", help="RidgeFill setting: fast or quality.")
SplitOpt = typer.Option(None, "--split", help="RidgeFill split layer (overrides the preset).")
TailOpt = typer.Option(None, "--tail", help="Full-depth tail tokens (RidgeFill: overrides the preset; SPEED: default 64).")
AttendedOpt = typer.Option(None, "--attended-rows", help="RidgeFill: rows the tail attends to most kept exact, each with the 16 after it (overrides the preset; 0: none).")
RescueOpt = typer.Option(True, "--rescue/--no-rescue", help="RidgeFill: while decoding, recompute the filled rows after each prompt occurrence of the text's last two tokens (what a copy reads next); TTFT unchanged.")
CutOpt = typer.Option(None, "--cut", help="SPEED cut: layers (e.g. 22) or a fraction of the depth (default 0.75, or the adapter's).")
AnchorsOpt = typer.Option(None, "--anchors", help="SPEED full-depth anchors: bos, first:K and/or positions, comma-separated (default bos, or the adapter's).")
AdapterOpt = typer.Option(None, "--adapter", help="SPEED LoRA adapter from `kvforge fit speed`: its cut, anchors and tail apply; SPEED runs its weights.")
DraftOpt = typer.Option("none", "--draft", help="Speculative drafter: none, prompt-lookup or ngram (lossless).")
PrefetchOpt = typer.Option(False, "--prefetch", help="n-gram: build the next drafts while the model verifies.")
KOpt = typer.Option(8, "--k", help="Draft tokens per step.")
BudgetOpt = typer.Option(16, "--budget", help="Prefetch candidates per request per step.")
KMinOpt = typer.Option(
    None, "--k-min", help="Length-aware draft budget (DAS): a sample that has produced t tokens drafts up to min(k, k_min + t // 16) tokens (default: always k).",
)
HistoryEntriesOpt = typer.Option(
    500_000, "--history-entries", help="Rollout history bound: (n-gram, successor) pairs held in memory over all prompts (~400 bytes each), least recently used prompts evicted.",
)


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


def setup_threads(threads: Optional[int]) -> int:
    """Apply `--threads` to torch (None: every physical core the process may use) and return it."""
    import torch

    from kvforge.cpu import all_cores

    if threads is not None and threads < 1:
        raise KvforgeError(f"--threads must be >= 1, got {threads}")
    threads = all_cores() if threads is None else threads
    torch.set_num_threads(threads)
    return threads


def load_engine(model: str, device: str, dtype: str = "auto"):
    """Load `model` (alias, directory, .gguf or hub id) into an `Engine` in `dtype` (a `--dtype`
    name), with a status line on stderr."""
    from kvforge.engine import Engine
    from kvforge.models import load_model

    with err.status(f"loading {model}"):
        return Engine(load_model(model, device=device, dtype=dtype))


def dtype_of(engine) -> str:
    """The dtype an engine runs in, as JSON reports record it ("float32", "bfloat16")."""
    from kvforge.models.loading import dtype_name

    return dtype_name(engine.dtype)


def cell(row: dict, key: str, spec: str) -> str:
    """A report row's figure formatted for a table, or "—" where it is absent or null."""
    return format(row[key], spec) if row.get(key) is not None else "—"


def emit_json(obj: dict) -> None:
    """Print the one JSON object of a `--json` run on its own line of stdout, with where it ran
    (`provenance.report`: CPU, flags, threads, versions, commit; no absolute paths)."""
    sys.stdout.write(json.dumps(report(obj)) + "\n")
    sys.stdout.flush()


def read_prompt(path: Path) -> str:
    """The text of a prompt file, or a one-line error when it is missing or not UTF-8."""
    if not path.is_file():
        raise KvforgeError(f"prompt file {str(path)!r} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise KvforgeError(f"prompt file {str(path)!r} is not UTF-8 text") from exc


def parse_lengths(text: str) -> list[int]:
    """`--tokens 1024,4096` as a list of positive prompt lengths."""
    try:
        lengths = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise KvforgeError(f"--tokens must be comma-separated integers, got {text!r}") from exc
    if not lengths or any(n < 1 for n in lengths):
        raise KvforgeError(f"--tokens must list positive lengths, got {text!r}")
    return lengths


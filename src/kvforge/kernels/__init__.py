"""Small C kernels kvforge compiles itself, for what torch's CPU ops do slowly.

`few_query_attention.c`: attention of a few query rows (a decode or verification step) over a
contiguous bf16 cache buffer. torch's batched matmuls read such a buffer at 7-9 GB/s here (a
3 x 64 by 64 x T product per head and sequence) where one core streams 17-23 GB/s. Built with the
system's C compiler at first use into kvforge's cache directory (well under a second: no torch
headers; called through ctypes with raw pointers); where there is no compiler or no AVX-512, or
`KVFORGE_KERNELS=0`, `available()` is False and callers keep torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvforge.paths import kvforge_home

_SOURCE = Path(__file__).with_name("few_query_attention.c")
_FLAGS = ["-O3", "-mavx512f", "-mfma", "-shared", "-fPIC"]
_MAX_DIM = 256  # MAX_CHUNKS x 16 in the C source


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVFORGE_KERNELS", "1") == "0" or torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"):
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    source = _SOURCE.read_bytes()
    tag = hashlib.sha256(source + " ".join([compiler, *_FLAGS]).encode()).hexdigest()[:16]
    target = kvforge_home() / "kernels" / f"few_query_attention-{tag}.so"
    try:  # any failure to build or load (read-only home, noexec mount, a compiler error) keeps torch's ops
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: atomic
                built = Path(tmp) / target.name
                done = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built)], capture_output=True, timeout=120)
                if done.returncode != 0:
                    return None
                os.replace(built, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError):
        return None
    i64, f32, ptr = ctypes.c_long, ctypes.c_float, ctypes.c_void_p
    lib.kvforge_qk.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, f32]
    lib.kvforge_pv.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64]
    lib.kvforge_qk.restype = lib.kvforge_pv.restype = None
    return lib


def available(dim: int) -> bool:
    """Whether the compiled few-query kernels can run heads of width `dim` here (16..256, a multiple
    of 16: the kernel's per-block scratch and accumulators are sized for at most 256)."""
    return 16 <= dim <= _MAX_DIM and dim % 16 == 0 and _library() is not None


def few_query_scores(rows: torch.Tensor, k: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    """rows (B, H, R, D) fp32 against the first `length` rows of a bf16 buffer k (B, H, C, D)
    -> scaled scores (B, H, R, C) fp32, -inf past `length`."""
    b, h, r, d = rows.shape
    c = k.shape[2]
    if not k.is_contiguous() or k.dtype != torch.bfloat16 or k.shape[:2] != (b, h) or k.shape[3] != d or not 0 <= length <= c:
        raise ValueError(f"few_query_scores: rows {tuple(rows.shape)} against a contiguous bf16 buffer, got {k.dtype} "
                         f"{tuple(k.shape)} with length {length}")
    rows = rows.contiguous()
    scores = torch.empty(b, h, r, c, dtype=torch.float32)
    _library().kvforge_qk(rows.data_ptr(), k.data_ptr(), scores.data_ptr(), b * h, r, c, length, d, scale)
    return scores


def few_query_values(weights: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """weights (B, H, R, C) fp32 over the first `length` rows of a bf16 buffer v (B, H, C, D)
    -> (B, H, R, D) fp32."""
    b, h, r, c = weights.shape
    d = v.shape[-1]
    if not v.is_contiguous() or v.dtype != torch.bfloat16 or v.shape[:3] != (b, h, c) or not 0 <= length <= c:
        raise ValueError(f"few_query_values: weights {tuple(weights.shape)} over a contiguous bf16 buffer, got {v.dtype} "
                         f"{tuple(v.shape)} with length {length}")
    weights = weights.contiguous()
    out = torch.empty(b, h, r, d, dtype=torch.float32)
    _library().kvforge_pv(weights.data_ptr(), v.data_ptr(), out.data_ptr(), b * h, r, c, length, d)
    return out

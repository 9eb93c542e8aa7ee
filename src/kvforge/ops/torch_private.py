"""torch's private CPU ops kvforge calls, in one place: oneDNN's and MKL's linears over a weight
packed once (what torch.compile's CPU backend packs linears with). They are not public API: the
calls below are written against torch 2.5 to 2.13 (`WRITTEN_FOR`). On any torch each op is tried
once on a small weight against `F.linear` before it is used, so a torch that renamed, removed or
changed one leaves kvforge on `F.linear` (slower, never wrong)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

WRITTEN_FOR = ((2, 5), (2, 13))  # the torch releases these calls were written and tested against


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _agrees(pack, run, dtype: torch.dtype) -> bool:
    """Whether a packed linear runs and matches F.linear on a small random weight."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g).to(dtype)
    x = torch.randn(3, 64, generator=g).to(dtype)
    try:
        with torch.no_grad():
            return torch.allclose(run(x, pack(w), w).float(), F.linear(x, w).float(), atol=1e-2, rtol=1e-2)
    except (RuntimeError, AttributeError, TypeError):
        return False


@functools.cache
def onednn(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear runs `dtype` (bf16, fp16) here."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        supported = (torch.ops.mkldnn._is_mkldnn_bf16_supported() if dtype == torch.bfloat16
                     else torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (RuntimeError, AttributeError):
        return False
    return bool(supported) and _agrees(onednn_pack, lambda x, p, w: onednn_linear(x, p, None), dtype)


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """A (N, K) weight in oneDNN's blocked layout, for `onednn_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def onednn_linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows (M, K) times an `onednn_pack`ed weight, plus bias."""
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")


@functools.cache
def mkl() -> bool:
    """Whether MKL's packed fp32 linear runs here."""
    if not torch.backends.mkl.is_available() or not hasattr(torch.ops.mkl, "_mkl_linear"):
        return False
    return _agrees(mkl_pack, lambda x, p, w: mkl_linear(x, p, w, None), torch.float32)


def mkl_pack(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 (N, K) weight packed for MKL's SGEMM, for `mkl_linear`."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, 1)


def mkl_linear(rows: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows (M, K) times an `mkl_pack`ed weight (the unpacked one passed beside it), plus bias; the
    last argument is the batch size the weight was packed for (`mkl_pack`'s 1)."""
    return torch.ops.mkl._mkl_linear(rows.contiguous(), packed, weight, bias, 1)

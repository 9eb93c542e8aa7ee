"""RMSNorm as the families compute it, in fused torch ops or, for bf16 steps, the compiled kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.ops import kernels


_ONE_PLUS_W_NORMS = ("Gemma3RMSNorm", "Qwen3NextRMSNorm", "Qwen3_5RMSNorm")


def rms_norm_params(norm: torch.nn.Module) -> tuple[float, bool] | None:
    """(eps, one_plus) of an RMSNorm kvforge knows (Llama's `w * x`, or Gemma's `x * (1 + w)`), else None."""
    if hasattr(norm, "variance_epsilon"):  # Llama, Mistral, Qwen2, Qwen3
        return norm.variance_epsilon, False
    if type(norm).__name__ in _ONE_PLUS_W_NORMS:
        return norm.eps, True
    return None


def rms_norm(norm: torch.nn.Module, x: torch.Tensor, stream: bool = False) -> torch.Tensor:
    """A family's RMSNorm module applied with torch's fused `F.rms_norm`: the same arithmetic as
    the module's forward (normalise in fp32, then Llama's `w * x.to(dtype)` or Gemma's
    `(x * (1 + w)).to(dtype)`), bit for bit on the parity tests, in 2-4 ops instead of 8. A decode
    step is short enough that the per-op cost of ~200 small ops per layer is a fifth of it.

    `stream`: x is a (B, T, E) row block of the residual stream (or a branch's output added to it);
    in bf16 with the compiled kernels, a step of up to `kernels.small_rows` tokens per sequence
    (decode, verification: the steps `linear` sends to `small_linear`) normalises it in one call
    (`kernels.rms_norm`, the same formula, its sum of squares in another order: a decode step's 61
    norms ~1.2 ms -> ~0.1 ms), and so does a prefill (a 4K-token bf16 prefill's 61 norms: 166 ms
    in torch's ops, which go through fp32 copies; the kernel splits rows over torch's threads).
    The choice never depends on layout (a slice such as the last row the head reads is made
    contiguous: a few rows), so a decode step and a verification round alike. Heads' q/k norms and other
    families' norms keep torch's ops (not measured: a q/k view would need a copy first)."""
    params = rms_norm_params(norm)
    if params is None:
        return norm(x)  # any other norm: its own forward
    eps, one_plus = params
    if stream and x.dtype == torch.bfloat16 and x.dim() == 3:
        x = x.contiguous()
        if kernels.rms_norm_fits(x, norm.weight):
            return kernels.rms_norm(x, norm.weight, eps, one_plus)
    normed = F.rms_norm(x.float(), x.shape[-1:], None, eps)
    if one_plus:
        return (normed * (1.0 + norm.weight.float())).to(x.dtype)
    return norm.weight * normed.to(x.dtype)

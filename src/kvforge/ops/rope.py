"""Rotary position embeddings applied to query and key rows."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by cos, sin (B, T, R) in the half-split (GPT-NeoX) layout; with partial
    RoPE (R < D) only the first R dimensions turn."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

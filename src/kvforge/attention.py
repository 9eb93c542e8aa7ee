"""Attention of query rows over one layer's cached rows, with masks built from positions.

Shapes: B batch, Hq query heads, H KV heads, Tq query rows, Tk cached rows, D head dim.

A key is visible to a query when the key is a real row (position >= 0), its position is not
after the query's, and, on sliding-window layers, q_pos - k_pos < window. Masks come from
positions, not row order, so caches whose layers hold different rows (SPEED, RidgeFill,
translated caches, left-padded batches) all attend correctly through the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.cache import LayerCache


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(B, 1, Tq, Tk) bool: which keys each query may see.

    A query that would see nothing (a padding row) is given every key instead, so softmax stays
    finite; its output is never used.
    """
    q = q_pos.unsqueeze(-1)  # (B, Tq, 1)
    k = k_pos.unsqueeze(-2)  # (B, 1, Tk)
    visible = (k >= 0) & (k <= q)
    if window is not None:
        visible &= (q - k) < window
    visible |= ~visible.any(dim=-1, keepdim=True)
    return visible.unsqueeze(1)


def readable_rows(positions: torch.Tensor, active: torch.Tensor, window: int | None) -> torch.Tensor:
    """(T,) bool: rows of one sequence that some active row can see through a sliding window.

    Decode steps come after the last prompt row, which is always active, so a row no active row
    sees is never read and need not be written."""
    if window is None:
        return torch.ones_like(active)
    seen_from = positions[active]  # ascending
    nxt = torch.searchsorted(seen_from, positions).clamp(max=seen_from.numel() - 1)
    return (seen_from[nxt] >= positions) & (seen_from[nxt] - positions < window)


def attend(
    q: torch.Tensor,
    layer: LayerCache,
    q_pos: torch.Tensor,
    scaling: float,
    window: int | None = None,
    new_rows: int | None = None,
) -> torch.Tensor:
    """q (B, Hq, Tq, D) over the layer's rows (already holding this step's own keys) -> (B, Hq, Tq, D).

    `new_rows`: how many of the layer's last rows were appended for these queries; when they
    are the queries' own rows in a contiguous layer, the standard causal shapes need no mask.
    """
    k, v = layer.keys(), layer.values()
    tq, tk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    continues = layer.contiguous and new_rows == tq
    if continues and tq == 1:
        if window is not None and tk > window:  # a local layer's decode step sees its last `window` rows
            k, v = k[:, :, tk - window :], v[:, :, tk - window :]
        return F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=gqa)
    fast = continues and (window is None or tk <= window)
    if fast and tk == tq:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    mask = visibility_mask(q_pos, layer.row_positions(), window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)

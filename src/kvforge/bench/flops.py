"""Multiply-accumulate counts of a prefill plan, for the speedup ceiling beside measured times.

Per exact row and layer: q/k/v and output projections, the gated MLP and attention over the keys
the row sees (its position + 1, or its window). Per filled row and late layer: the ridge map
(E × E; none at the split layer, whose input is the split state itself) and the k/v projections,
only on rows the layer writes (sliding-window layers skip rows nothing reads). The head runs on
the last row. The ceiling is exact MACs / plan MACs: the speedup if time were proportional to MACs. A decode
step's MACs (`decode_macs`) give the same ceiling for time per output token.
"""

from __future__ import annotations

import torch

from kvforge.attention import readable_rows


def _dims(adapter) -> tuple[int, int, int, int, int]:
    c = adapter.config
    return adapter.hidden_size, adapter.num_heads * adapter.head_dim, adapter.kv_heads * adapter.head_dim, c.intermediate_size, c.vocab_size


def prefill_macs(adapter, depth: torch.Tensor, split: int | None, filled: bool) -> int:
    """MACs of a prefill where row i runs layers [0, depth[i]) exactly; above it a row is filled
    (`filled`: from a map at layers > split, the split state at the split layer) or absent."""
    e, q_dim, kv_dim, ffn, vocab = _dims(adapter)
    t = depth.numel()
    positions = torch.arange(t)
    per_row_linear = _per_row_linear(adapter)
    total = 0
    for layer in range(adapter.num_layers):
        active = depth > layer
        window = adapter.windows[layer]
        seen = positions[active] + 1
        if window is not None:
            seen = seen.clamp(max=window)
        # QKᵀ and AV: 2 · head dim per visible key per query head
        total += int(active.sum()) * per_row_linear + int(seen.sum()) * 2 * q_dim
        if filled:
            written = ~active & readable_rows(positions, active, window)
            map_macs = e * e if (split is not None and layer > split) else 0
            total += int(written.sum()) * (map_macs + e * 2 * kv_dim)
    return total + e * vocab


def decode_macs(adapter, cached_rows: list[int]) -> int:
    """MACs of one decode step over a cache holding `cached_rows[l]` rows at layer l: every layer's
    projections and MLP on one row, attention over the cached rows it sees plus itself, the head."""
    e, q_dim, _, _, vocab = _dims(adapter)
    total = 0
    for layer, rows in enumerate(cached_rows):
        window = adapter.windows[layer]
        seen = rows + 1 if window is None else min(rows + 1, window)
        total += _per_row_linear(adapter) + seen * 2 * q_dim
    return total + e * vocab


def _per_row_linear(adapter) -> int:
    e, q_dim, kv_dim, ffn, _ = _dims(adapter)
    return e * (q_dim + 2 * kv_dim) + q_dim * e + 3 * e * ffn


def exact_macs(adapter, tokens: int) -> int:
    return prefill_macs(adapter, torch.full((tokens,), adapter.num_layers), None, False)

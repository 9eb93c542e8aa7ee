"""The keys and values a SPEED request sees above the cut, kept contiguous beside vLLM's paged cache.

Shapes: H KV heads, D head dim, Hq query heads, n a request's rows this step, C a buffer's rows.

Above the cut a SPEED request sees a few hundred rows (anchors, tail, generated tokens) of a long
context. Reading them out of vLLM's paged cache at every layer of every step costs more than
attending over them (one request, a decode step, bf16, one thread, AMD EPYC with AVX512-BF16: 48 µs
to gather 97 rows' keys and values through the block table against 36 µs for the attention).
So each request's visible rows are also kept here, one contiguous (1, H, C, D) buffer per layer
above the cut, in the order of their positions: a step appends its rows to them (vLLM's cache
gets them too, through the backend) and attends over the buffer's first rows with kvforge's
few-query attention (in bf16 the compiled kernel).

The buffers are a copy, never the record: the paged cache is. A request whose buffers are gone
(evicted, or never made) gets them rebuilt from the paged cache through its block table.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from kvforge.attention import grouped_attention


# Up to this many query rows (a decode or verification step) a request attends with kvforge's
# few-query attention (in bf16 the compiled kernel); more (a prompt's anchors and tail, a prompt
# without a plan) with torch's SDPA.
FEW_QUERIES = 32


class VisibleRows:
    """One request's visible keys and values above the cut: `layers` buffers of each, (1, H, C, D),
    of which the first `filled` rows hold the rows at its visible positions, in order."""

    def __init__(self, layers: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device, capacity: int):
        # zeros, not empty: torch's attention multiplies the rows past `length` by weight 0, and
        # never-written memory may hold NaNs
        self.keys = [torch.zeros(1, heads, capacity, dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(1, heads, capacity, dim, dtype=dtype, device=device) for _ in range(layers)]
        self.filled = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows, the rows held kept (the buffers at least double when they grow)."""
        if rows <= self.capacity:
            return
        capacity = max(rows, 2 * self.capacity)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_zeros(1, old.shape[1], capacity, old.shape[3])
                new[:, :, : self.filled] = old[:, :, : self.filled]
                buffers[i] = new

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor, at: int) -> None:
        """A layer's rows k, v (n, H, D) at visible rows [at, at + n)."""
        n = k.shape[0]
        self.keys[layer][0, :, at : at + n] = k.transpose(0, 1)
        self.values[layer][0, :, at : at + n] = v.transpose(0, 1)

    def attend(self, layer: int, q: torch.Tensor, length: int, scaling: float, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Queries q (n, Hq, D), the last n of the first `length` visible rows, over those rows
        (causal among the queries' own) -> (n, Hq·D). `mask` (1, 1, n, length): which rows each
        query sees instead (a sliding window)."""
        n, hq, d = q.shape
        rows = q.transpose(0, 1).unsqueeze(0)
        k, v = self.keys[layer], self.values[layer]
        if n > FEW_QUERIES:  # a prompt's rows: SDPA, without a score matrix per query row in fp32
            if mask is None:
                mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril_(length - n)
            o = torch.nn.functional.scaled_dot_product_attention(rows, k[:, :, :length], v[:, :, :length], attn_mask=mask,
                                                                 scale=scaling, enable_gqa=hq != k.shape[1])
        elif mask is None:
            o = grouped_attention(rows, k, v, scaling, length=length)
        else:
            o = grouped_attention(rows, k[:, :, :length], v[:, :, :length], scaling, mask)
        return o[0].transpose(0, 1).reshape(n, hq * d)


class VisibleRowsStore:
    """Each running request's `VisibleRows`, by the first block of its block table (vLLM hands a
    model no request ids), the most recently used `capacity` kept: the engine runs at most that
    many requests at once, so an evicted request's are those of a finished one, or rebuilt. A
    block's rows are dropped when a new prompt starts on it."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held: OrderedDict[int, VisibleRows] = OrderedDict()

    def get(self, first_block: int) -> VisibleRows | None:
        rows = self.held.get(first_block)
        if rows is not None:
            self.held.move_to_end(first_block)
        return rows

    def put(self, first_block: int, rows: VisibleRows) -> None:
        self.held[first_block] = rows
        self.held.move_to_end(first_block)
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)

    def drop(self, first_block: int) -> None:
        self.held.pop(first_block, None)

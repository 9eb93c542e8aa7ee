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

from kvforge.ops import kernels
from kvforge.cache import LayerCache
from kvforge.steps import run_to_end


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
    are the queries' own rows in a contiguous layer (or, with the kernel, at the ends of an
    aligned one's sequences), the standard causal shapes need no mask.
    """
    k, v = layer.keys(), layer.values()
    tq, tk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    continues = layer.contiguous and new_rows == tq
    few = tq <= FEW_QUERIES and q.dtype != torch.float32
    unwindowed = window is None or layer.length <= window  # no query sees a key past the window
    # The whole buffer, its rows past `length` masked: the batched matmul reads a whole buffer in
    # place but copies a slice of one (K and V, every layer, every step). Every step of a width
    # sees the same number of columns, so decode and verification round alike. With the compiled
    # kernel a bf16 prefill takes this path too, a few tokens at a time (SDPA's bf16 flash kernel
    # costs 3x it at 512 tokens here, 1.7x at 4K).
    if _continues_over_buffer(q, layer, window, new_rows) and (few or _compiled(q, layer.k, layer.v)):
        return grouped_attention(q, layer.k, layer.v, scaling, length=layer.length, shared=layer.shared)
    if (layer.aligned and layer.ends is not None and new_rows == tq and few and unwindowed and layer.k.is_contiguous()
            and _compiled(q, layer.k, layer.v)):
        # sequences of different lengths, each contiguous (a group after a drafted step, a
        # server's batch): each read to its own end, no mask; the rows a group's samples share
        # are read once where that pays (`_reads_shared_once`), as on the path above
        b, hq, _, d = q.shape
        if _reads_shared_once(b, tq, layer.shared):
            return _shared_prefix(q, layer.k, layer.v, scaling, layer.length, layer.shared, layer.ends)
        rows = q.reshape(b, layer.k.shape[1], hq // layer.k.shape[1] * tq, d)
        out = kernels.few_query_attention(rows, layer.k, layer.v, layer.length, scaling, tq, lengths=layer.ends)
        return out.to(layer.v.dtype).view(b, hq, tq, layer.v.shape[-1])
    if few and unwindowed:
        # the compiled kernel reads the mask's columns, the rows in use; torch's matmuls the whole
        # buffers in place, so every step of a width rounds alike
        positions = layer.row_positions() if _compiled(q, layer.k, layer.v) else layer.positions
        return grouped_attention(q, layer.k, layer.v, scaling, visibility_mask(q_pos, positions, window))
    if continues and tq == 1:
        if window is not None and tk > window:  # a local layer's decode step sees its last `window` rows
            k, v = k[:, :, tk - window :], v[:, :, tk - window :]
        if few:
            return grouped_attention(q, k, v, scaling)
        return F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=gqa)
    fast = continues and (window is None or tk <= window)
    if fast and tk == tq:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    mask = visibility_mask(q_pos, layer.row_positions(), window)
    if few:
        return grouped_attention(q, k, v, scaling, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)


# What a long step's attention yields between two blocks of its query rows (`attend_steps`): a
# point where its caller may pause, as between two layers (`engine.LAYER_BOUNDARY`).
QUERY_BLOCK = "query block"


def attend_steps(
    q: torch.Tensor,
    layer: LayerCache,
    q_pos: torch.Tensor,
    scaling: float,
    window: int | None = None,
    new_rows: int | None = None,
):
    """`attend` as a generator that returns its result and, where the compiled kernel runs a long
    step's query rows in blocks (`_chunked_prefill`: a bf16 prefill chunk continuing its sequence),
    yields `QUERY_BLOCK` between two blocks: a server may run its running requests' decode step
    there, so a chunk at a long context need not hold them for a whole layer's attention. A row's
    bits depend only on its own query and the keys it sees (the kernel's invariant): the same bits
    as `attend`."""
    if (q.shape[2] > PREFILL_CHUNK and _continues_over_buffer(q, layer, window, new_rows)
            and _compiled(q, layer.k, layer.v)):
        return (yield from _chunked_prefill_steps(q, layer.k, layer.v, scaling, layer.length))
    return attend(q, layer, q_pos, scaling, window, new_rows)


def _continues_over_buffer(q: torch.Tensor, layer: LayerCache, window: int | None, new_rows: int | None) -> bool:
    """Whether the queries continue a contiguous layer whose last rows are their own, unwindowed,
    its buffers whole and contiguous: the path that reads the whole buffer up to `length`, unmasked."""
    return (layer.contiguous and new_rows == q.shape[2] and (window is None or layer.length <= window)
            and layer.k.is_contiguous())


# Below this many query rows, a low-precision step (decode, speculative verification) attends
# with two matmuls instead of SDPA: on CPU, SDPA's bf16 flash kernel costs 4x the matmuls for
# one query over 4K keys (3.99 vs 0.85 ms per layer here), and is no faster at 9 queries.
FEW_QUERIES = 32


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    mask: torch.Tensor | None = None,
    length: int | None = None,
    shared: int = 0,
) -> torch.Tensor:
    """Attention for a few query rows: the query heads that share a KV head are stacked as rows
    of one matmul (no repeated K/V), scores and softmax in fp32 (as SDPA accumulates them), the
    weights cast back for the value matmul. q (B, Hq, Tq, D), k, v (B, H, Tk, D), mask
    (B, 1, Tq, Tk) bool or None -> (B, Hq, Tq, D).

    `length` (instead of a mask): k and v are a contiguous layer's whole buffers whose first
    `length` rows hold positions 0..length-1, the last Tq of them the queries' own. The mask is
    then two slices of the scores filled in place (the empty rows, and the causal triangle among
    the queries' own rows): the same scores as the position mask gives, without building and
    broadcasting a (B, 1, Tq, Tk) mask per layer (a third of a 9-row step at 4K).

    `shared` (with `length`): the buffers' first `shared` rows are the same in every sequence (a
    prompt's samples); with the compiled kernel a batch then reads them once (`_shared_prefix`)
    where that measured faster (`_reads_shared_once`)."""
    b, hq, tq, d = q.shape
    heads = k.shape[1]
    group = hq // heads
    compiled = _compiled(q, k, v)
    if compiled and length is not None and tq > PREFILL_CHUNK:
        return _chunked_prefill(q, k, v, scaling, length)
    if compiled and length is not None and _reads_shared_once(b, tq, shared):
        return _shared_prefix(q, k, v, scaling, length, shared)
    rows = q.reshape(b, heads, group * tq, d)
    if compiled:
        # the compiled kernel: each K/V row read once per block of the group's rows, rows past
        # `length` never read; scores and softmax in fp32, weights rounded to bf16 (as torch's path
        # rounds them) and normalized by their rounded sum at the end. On the length path each
        # row's softmax covers only the keys it sees (the step's causal triangle included), so a
        # row's bits do not depend on the step's width; on the mask path a hidden key's score is
        # -inf and its weight exactly 0.
        if mask is None and length is not None:  # the three passes in one call
            return kernels.few_query_attention(rows, k, v, length, scaling, tq).to(v.dtype).view(b, hq, tq, v.shape[-1])
        read = length if length is not None else mask.shape[-1] if mask is not None else k.shape[2]  # a mask may cover the rows in use alone
        scores = kernels.few_query_scores(rows, k, read, scaling, columns=read if mask is not None else None)
        if mask is not None:
            scores = scores.view(b, heads, group, tq, -1).masked_fill_(~mask.unsqueeze(2), float("-inf")).view(b, heads, group * tq, -1)
        weights, inverse = kernels.few_query_softmax(scores, read, tq if length is not None else 1)
        return kernels.few_query_values(weights, inverse, v, read).to(v.dtype).view(b, hq, tq, v.shape[-1])
    if k.is_contiguous():  # a whole buffer: Q K^T reads K in place (16 x 1280 keys: 0.86 ms vs 1.5 for K Q^T)
        scores = torch.matmul(rows, k.transpose(-1, -2)).float().mul_(scaling)
    else:  # a slice of a larger buffer: the bf16 batched matmul copies a transposed slice (all of K,
        # every step) but not a plain one, so K Q^T
        scores = torch.matmul(k, rows.transpose(-1, -2)).transpose(-1, -2).float() * scaling
    if length is not None:
        per_query = scores.view(b, heads, group, tq, -1)
        per_query[..., length:] = float("-inf")
        if tq > 1:  # the step's own rows: each hidden from the step's earlier queries
            later = torch.ones(tq, tq, dtype=torch.bool, device=q.device).triu_(1)
            per_query[..., length - tq : length].masked_fill_(later, float("-inf"))
    elif mask is not None:  # (B, 1, Tq, Tk) -> the same mask for every head of a group
        scores = scores.view(b, heads, group, tq, -1).masked_fill(~mask.unsqueeze(2), float("-inf")).view(b, heads, group * tq, -1)
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(weights, v).view(b, hq, tq, v.shape[-1])


# Query tokens per pass of the compiled kernel in a long step (a prefill): each pass reads the
# keys up to its last token, so a small chunk skips most of the causal triangle's upper half
# (measured at 512-4K tokens, D 64, AVX-512: 16, 32 and 64 within noise of each other, 128-256
# 14-29 % slower than 32; on AMX tiles 64 is 1-5 % faster than 32, 128 no faster than 64).
PREFILL_CHUNK = 64


def _chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, length: int) -> torch.Tensor:
    """The compiled kernel's length path over a long step, PREFILL_CHUNK tokens at a time: chunk
    [c0, c1) of the step's tq tokens ends at row length - (tq - c1) and has c1 - c0 tokens, which
    is all the kernel needs to give each row its own causal keys. A row's bits depend only on
    its own query and the keys it sees (the kernel's invariant), so the chunking never shows."""
    return run_to_end(_chunked_prefill_steps(q, k, v, scaling, length))


def _chunked_prefill_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, length: int):
    """`_chunked_prefill` as a generator that yields `QUERY_BLOCK` between two chunks of tokens."""
    b, hq, tq, d = q.shape
    heads = k.shape[1]
    group = hq // heads
    out = torch.empty(b, hq, tq, v.shape[-1], dtype=v.dtype)
    for c0 in range(0, tq, PREFILL_CHUNK):
        if c0:
            yield QUERY_BLOCK
        c1 = min(tq, c0 + PREFILL_CHUNK)
        n, read = c1 - c0, length - (tq - c1)
        rows = q[:, :, c0:c1].reshape(b, heads, group * n, d)
        out[:, :, c0:c1] = kernels.few_query_attention(rows, k, v, read, scaling, n).view(b, hq, n, v.shape[-1])
    return out


# A batch whose sequences share their leading rows reads them once (`_shared_prefix`) where that
# measured faster than the fused kernel reading them per sequence, whose scores stay in cache:
# one or two query tokens per sequence, and (sequences x shared rows) at least SHARED_MIN_READS.
# Measured with 9 query heads over 3 KV heads of 64 dims, one thread (shared / per sequence):
# AMX tiles, 1 token: 8 x 500 rows 1.47, 8 x 1500 0.80, 8 x 4000 0.63, 16 x 500 0.98, 16 x 4000
# 0.32; AVX-512, 1 token: 8 x 1500 1.14, 8 x 4000 0.97, 16 x 1500 0.98, 16 x 4000 0.54; a
# 9-token verification 0.95-1.74 on both (its stacked scores go through memory three times).
SHARED_MAX_QUERIES = 2
SHARED_MIN_READS = 16384
SHARED_MIN_ROWS = 64  # below it the extra copies of a few small tensors cost more than the rows read


def _reads_shared_once(batch: int, queries: int, shared: int) -> bool:
    """Whether a batch of `batch` sequences of `queries` query tokens each reads the `shared` rows
    they have in common once (`_shared_prefix`) instead of per sequence."""
    return batch > 1 and queries <= SHARED_MAX_QUERIES and shared >= SHARED_MIN_ROWS and batch * shared >= SHARED_MIN_READS


def _shared_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, length: int, shared: int,
                   ends: list[int] | None = None) -> torch.Tensor:
    """The compiled kernel's length path for a batch whose first `shared` rows are one prompt's in
    every sequence: each head's query rows of the whole batch, stacked, score the shared keys of
    sequence 0 (read once instead of B times: 16 samples of a 4K prompt read 1.5 GB of K/V a step
    otherwise); each sequence scores its own later rows; the softmax runs over each row's whole
    row of scores; the value pass runs over the shared rows for the stacked rows, then resumes each
    row's sums over its own rows from the same key (even; a multiple of 32 on AMX tiles). A key's
    score does not depend on which rows share the call nor where its block starts, a softmax row on
    its scores alone, and a value sum is the same additions in the same order (`few_query_values`
    in parts): the result equals `grouped_attention`'s without `shared` to the bit (tested).

    `ends` (B,): sequence b's rows end at ends[b] (an aligned layer's sequences of different
    lengths, `length` the longest), its step's last token at row ends[b] - 1; each sequence's own
    rows, softmax and value sums stop at its end, and each row has the bits of a call over its
    sequence alone (tested)."""
    b, hq, tq, d = q.shape
    heads = k.shape[1]
    r = hq // heads * tq
    split = shared - shared % kernels.value_part_step(d)  # where the value pass may resume (pairs; AMX: chunks of 32)
    by_head = ends * heads if ends is not None else None  # the stacked layout's heads: (head, sequence) in order
    own_rows = q.reshape(b, heads, r, d)
    stacked = own_rows.transpose(0, 1).reshape(1, heads, b * r, d)
    scores = kernels.few_query_scores(stacked, k[:1], split, scaling, columns=length)  # -inf from `split` on
    own = kernels.few_query_scores(own_rows, k, length, scaling, columns=length - split, start=split, lengths=ends)
    scores = scores.view(heads, b, r, length)
    scores[..., split:] = own.transpose(0, 1)
    weights, inverse = kernels.few_query_softmax(scores, length, tq, lengths=by_head)
    sums = kernels.few_query_values(weights.view(1, heads, b * r, -1), inverse.view(1, heads, b * r), v[:1], split, finish=False)
    sums = sums.view(heads, b, r, d).transpose(0, 1).contiguous()
    own_weights = weights[..., split:].transpose(0, 1)
    own_inverse = inverse.transpose(0, 1)
    out = kernels.few_query_values(own_weights, own_inverse, v, length, start=split, sums=sums, lengths=ends)
    return out.to(v.dtype).view(b, hq, tq, v.shape[-1])


def reads_rows_in_use(dtype: torch.dtype, device: torch.device | str, widths: list[tuple[int, int]]) -> bool:
    """Whether attention over layers of these (key, value) widths reads only the rows a layer
    holds, whatever its buffers' capacity: in float32 it attends over slices of them, in bf16 on
    CPU through the compiled kernel (keys and values as wide, a width it takes). Elsewhere a
    low-precision step of a few rows reads whole buffers (`grouped_attention`), which is cheap only
    while they grow with their rows."""
    if dtype == torch.float32:
        return True
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu"
            and all(key == value and kernels.available(key) for key, value in widths))


def _compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the compiled few-query kernel runs this step: whole contiguous bf16 buffers on CPU,
    and nothing to backpropagate through (the kernel has no backward; training keeps torch's ops)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return (q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.device.type == k.device.type == v.device.type == "cpu"
            and k.is_contiguous()
            and v.is_contiguous() and k.shape[-1] == v.shape[-1] and kernels.available(k.shape[-1]))

"""The few-query attention path against torch's SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.attention import grouped_attention


@pytest.mark.parametrize("tq", [1, 3, 9])
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_attention_matches_sdpa(tq, masked):
    g = torch.Generator().manual_seed(tq)
    q = torch.randn(2, 6, tq, 16, generator=g)
    buffer_k = torch.randn(2, 2, 40, 16, generator=g)  # a cache layer: rows are a slice of a larger buffer
    buffer_v = torch.randn(2, 2, 40, 16, generator=g)
    k, v = buffer_k[:, :, :31], buffer_v[:, :, :31]
    mask = (torch.rand(2, 1, tq, 31, generator=g) > 0.4) if masked else None
    if mask is not None:
        mask[..., 0] = True  # every query sees something
    ours = grouped_attention(q, k, v, 0.25, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5)


def test_grouped_attention_bf16_close_to_fp32():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 1, 64, generator=g), torch.randn(1, 3, 500, 64, generator=g), torch.randn(1, 3, 500, 64, generator=g))
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)
    ours = grouped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.125).float()
    # bf16 keeps 8 bits of mantissa: inputs, scores' operands and weights each round once.
    assert (ours - ref).abs().max() < 0.05
    assert not torch.equal(ours, ref)


def test_low_precision_linear_rows_do_not_depend_on_the_row_count():
    # The shape where oneDNN's one-row bf16 kernel rounded apart from the batched one here.
    from kvforge.ops.linear import linear

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(576, 1536, generator=g) * 0.05).bfloat16()
    x = torch.randn(1, 9, 1536, generator=g).bfloat16()
    together = linear(x, w)
    one_by_one = torch.cat([linear(x[:, i : i + 1], w) for i in range(9)], dim=1)
    assert torch.equal(together, one_by_one)


@pytest.mark.parametrize("inputs", [576, 1024, 1088, 1536, 3072])
def test_low_precision_linear_is_row_stable_from_1_to_32_rows_packed_or_not(inputs):
    """Decode (1 row), verification (k + 1 rows) and batched steps (up to 32 rows) give every row
    the same bits, through the prepacked oneDNN path and through F.linear (a weight view)."""
    from kvforge.ops.linear import linear

    g = torch.Generator().manual_seed(inputs)
    w = (torch.randn(640, inputs, generator=g) * 0.05).bfloat16()
    x = torch.randn(32, inputs, generator=g).bfloat16()
    for weight in (w, w[0:]):  # whole (packed at first use) and a view (never packed)
        with torch.inference_mode():
            reference = linear(x, weight)
            for width in (1, 2, 5, 9, 16):
                parts = torch.cat([linear(x[s : s + width], weight) for s in range(0, 32, width)])
                assert torch.equal(parts, reference), (inputs, width)


@pytest.mark.parametrize("tq", [1, 9])
def test_low_precision_attention_over_a_whole_buffer_ignores_rows_past_the_length(tq):
    """bf16 few-query attention reads the layer's whole buffer (no slice copy): rows past its
    length -- never written, or trimmed after a rejected draft, their K/V still there -- must not
    count. Reference: SDPA in fp32 over the rows in use."""
    from kvforge.attention import attend
    from kvforge.cache import KVCache

    g = torch.Generator().manual_seed(tq)
    layer = KVCache.empty(1, 1, 2, 16, torch.bfloat16, capacity=64)[0]
    layer.append(torch.randn(1, 2, 40, 16, generator=g).bfloat16(), torch.randn(1, 2, 40, 16, generator=g).bfloat16(),
                 torch.arange(40).view(1, -1))
    layer.trim(12)  # rows 28..39 rejected: their K/V stay in the buffer, their positions are -1
    q = torch.randn(1, 6, tq, 16, generator=g).bfloat16()
    q_pos = torch.arange(28 - tq + 1, 29).view(1, -1) if tq > 1 else torch.tensor([[28]])
    if tq > 1:  # the queries' own rows are the last tq in use
        layer.trim(tq - 1)
        k_new = torch.randn(1, 2, tq - 1, 16, generator=g).bfloat16()
        layer.append(k_new, k_new, q_pos[:, :-1])
    layer.append(torch.randn(1, 2, 1, 16, generator=g).bfloat16(), torch.randn(1, 2, 1, 16, generator=g).bfloat16(), q_pos[:, -1:])
    assert layer.capacity > layer.length
    ours = attend(q, layer, q_pos, 0.25, new_rows=tq).float()
    k, v = layer.keys().float(), layer.values().float()
    mask = layer.row_positions().view(1, 1, 1, -1) <= q_pos.view(1, 1, -1, 1)
    ref = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    assert (ours - ref).abs().max() < 0.03


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tq", [1, 9])
def test_a_contiguous_layer_masked_by_its_length_gives_the_position_masks_result_bit_for_bit(batch, tq):
    """The in-place length mask (empty rows and the causal triangle filled into the scores) is the
    position mask's arithmetic exactly, so decoding and drafting round as they did with it."""
    from kvforge.attention import visibility_mask
    from kvforge.cache import KVCache

    g = torch.Generator().manual_seed(batch * 10 + tq)
    layer = KVCache.empty(1, batch, 2, 16, torch.bfloat16, capacity=80)[0]
    layer.append(torch.randn(batch, 2, 50, 16, generator=g).bfloat16(), torch.randn(batch, 2, 50, 16, generator=g).bfloat16(),
                 torch.arange(50).expand(batch, -1))
    layer.trim(7)  # rejected rows keep their K/V in the buffer
    q = torch.randn(batch, 6, tq, 16, generator=g).bfloat16()
    q_pos = torch.arange(43 - tq, 43).expand(batch, -1)
    by_length = grouped_attention(q, layer.k, layer.v, 0.25, length=layer.length)
    by_mask = grouped_attention(q, layer.k, layer.v, 0.25, visibility_mask(q_pos, layer.positions, None))
    assert torch.equal(by_length, by_mask)


def test_low_precision_attention_over_a_layer_with_missing_positions_uses_the_position_mask():
    """A layer whose rows are not positions 0..length-1 (SPEED leaves prompt rows out of upper
    layers) cannot be masked by its length: attend must fall back to the position mask."""
    from kvforge.attention import attend
    from kvforge.cache import KVCache

    g = torch.Generator().manual_seed(7)
    layer = KVCache.empty(1, 1, 2, 16, torch.bfloat16, capacity=64)[0]
    kept = torch.tensor([[0, 1, 2, 10, 11, 12, 13, 14]])  # rows 3..9 absent
    layer.append(torch.randn(1, 2, 8, 16, generator=g).bfloat16(), torch.randn(1, 2, 8, 16, generator=g).bfloat16(), kept)
    q_pos = torch.tensor([[15]])
    layer.append(torch.randn(1, 2, 1, 16, generator=g).bfloat16(), torch.randn(1, 2, 1, 16, generator=g).bfloat16(), q_pos)
    assert not layer.contiguous
    q = torch.randn(1, 6, 1, 16, generator=g).bfloat16()
    ours = attend(q, layer, q_pos, 0.25, new_rows=1).float()
    ref = F.scaled_dot_product_attention(q.float(), layer.keys().float(), layer.values().float(), scale=0.25, enable_gqa=True)
    assert (ours - ref).abs().max() < 0.03


def test_a_weight_changed_in_place_is_packed_again():
    from kvforge.ops.linear import linear

    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=g).bfloat16()
    x = torch.randn(3, 32, generator=g).bfloat16()
    with torch.inference_mode():
        before = linear(x, w)
        w.mul_(2)  # in place: the packed copy made by the first call is stale now
        after = linear(x, w)
    assert torch.equal(after, linear(x, w.clone()))  # as a weight never packed before
    assert not torch.equal(after, before)


def test_fp32_one_row_through_a_streamed_weight_is_packed_and_within_rounding_of_f_linear():
    """fp32 keeps F.linear, except one row through a weight larger than the caches (an LM head):
    MKL's packed GEMM, within fp32 rounding of F.linear's GEMV; under autograd, plain F.linear."""
    from kvforge.ops import linear as ops_linear, torch_private

    if not torch_private.mkl():
        pytest.skip("torch built without MKL")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(8192, 576, generator=g) * 0.05  # 18.9 MB: above the streamed-weight size
    assert w.numel() * 4 >= ops_linear._STREAMED_BYTES
    x = torch.randn(1, 1, 576, generator=g)
    with torch.inference_mode():
        head = ops_linear.linear(x, w)
        assert getattr(w, "_kvforge_packed", None) is not None
        assert torch.allclose(head, F.linear(x, w), atol=1e-5, rtol=1e-5)
        two = ops_linear.linear(x.expand(1, 2, 576), w)  # more than one row: F.linear itself
        assert torch.equal(two, F.linear(x.expand(1, 2, 576), w))
    trained = w.clone().requires_grad_()
    assert torch.equal(ops_linear.linear(x, trained), F.linear(x, trained))


def test_freed_memory_is_kept_once_per_process(monkeypatch):
    from kvforge import allocator

    allocator.keep_freed_memory.cache_clear()
    monkeypatch.setenv("KVFORGE_KEEP_FREED_MEMORY", "0")
    assert allocator.keep_freed_memory() is False
    allocator.keep_freed_memory.cache_clear()
    monkeypatch.delenv("KVFORGE_KEEP_FREED_MEMORY")
    import sys

    assert allocator.keep_freed_memory() is sys.platform.startswith("linux")


@pytest.mark.parametrize("batch, heads, kv_heads, tq, length, shared, dim", [
    (16, 9, 3, 1, 1030, 1024, 64),  # samples of a prompt, each one token on
    (4, 9, 3, 9, 290, 281, 64),  # their verification, an odd shared length
    (3, 8, 2, 4, 200, 130, 128),
    (2, 4, 4, 1, 65, 65, 64),  # everything shared: the step's own row too
    (5, 6, 3, 2, 150, 77, 32),
])
def test_a_batch_reads_its_shared_rows_once_with_the_same_bits(batch, heads, kv_heads, tq, length, shared, dim, monkeypatch):
    """A batch whose first rows are one prompt's (select_batch of one sequence) reads them once for
    every sequence (at every size here: the path's own thresholds lifted): the same result, to the
    bit, as each sequence reading its own copy."""
    from unittest import mock

    from kvforge import attention
    from kvforge.ops import kernels

    if not kernels.available(dim):
        pytest.skip("no AVX512-BF16 or no C compiler here")
    monkeypatch.setattr(attention, "SHARED_MIN_READS", 64)
    monkeypatch.setattr(attention, "SHARED_MAX_QUERIES", 16)
    g = torch.Generator().manual_seed(length)
    k = torch.randn(batch, kv_heads, length + 7, dim, generator=g).bfloat16()
    v = torch.randn(batch, kv_heads, length + 7, dim, generator=g).bfloat16()
    k[:, :, :shared], v[:, :, :shared] = k[:1, :, :shared], v[:1, :, :shared]
    q = torch.randn(batch, heads, tq, dim, generator=g).bfloat16()
    with mock.patch.object(attention, "_shared_prefix", wraps=attention._shared_prefix) as once:
        ours = grouped_attention(q, k, v, dim**-0.5, length=length, shared=shared)
    assert once.call_count == 1
    assert torch.equal(ours, grouped_attention(q, k, v, dim**-0.5, length=length))


@pytest.mark.parametrize("batch, queries, shared, once", [
    (16, 1, 1024, True), (8, 2, 4000, True),  # decode steps of many samples of a long prompt
    (8, 1, 200, False), (512, 1, 63, False),  # too few shared rows: the fused kernel per sequence is faster
    (8, 9, 4000, False), (1, 1, 8000, False),  # a verification's stacked scores; one sequence
])
def test_a_batch_reads_its_shared_rows_once_where_that_measured_faster(batch, queries, shared, once):
    from kvforge import attention

    assert attention._reads_shared_once(batch, queries, shared) is once


@pytest.mark.parametrize("heads, kv_heads, tq, ends, shared, dim", [
    (9, 3, 1, [300, 211, 257, 300], 200, 64),  # samples of a prompt after drafted steps, AMX tiles where the CPU has them
    (9, 3, 9, [290, 282, 301], 281, 64),  # their verification, an odd shared length
    (6, 3, 2, [150, 97, 131, 78, 150], 77, 48),  # AVX-512 (48 is no multiple of 32)
])
def test_sequences_that_end_apart_read_their_shared_rows_once_with_the_bits_of_each_alone(heads, kv_heads, tq, ends, shared, dim):
    """An aligned batch whose sequences end at different rows (`ends`) and share their first rows
    reads those once: each sequence's result equals the kernel's over that sequence alone with its
    own length, to the bit, at 1 and 2 threads; per-head lengths out of range are refused."""
    from kvforge import attention
    from kvforge.ops import kernels

    if not kernels.available(dim):
        pytest.skip("no AVX512-BF16 or no C compiler here")
    batch, length = len(ends), max(ends)
    g = torch.Generator().manual_seed(length + tq)
    k = torch.randn(batch, kv_heads, length + 7, dim, generator=g).bfloat16()
    v = torch.randn(batch, kv_heads, length + 7, dim, generator=g).bfloat16()
    k[:, :, :shared], v[:, :, :shared] = k[:1, :, :shared], v[:1, :, :shared]
    q = torch.randn(batch, heads, tq, dim, generator=g).bfloat16()
    r = heads // kv_heads * tq
    alone = torch.cat([
        kernels.few_query_attention(q[b : b + 1].reshape(1, kv_heads, r, dim), k[b : b + 1].contiguous(), v[b : b + 1].contiguous(),
                                    n, dim**-0.5, tq).to(v.dtype).view(1, heads, tq, dim)
        for b, n in enumerate(ends)])
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            together = attention._shared_prefix(q, k, v, dim**-0.5, length, shared, ends)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(together, alone)
    with pytest.raises(ValueError, match="per-head lengths"):
        kernels.few_query_scores(q.reshape(batch, kv_heads, r, dim), k, length, 0.1, start=shared,
                                 lengths=[shared - 1] + ends[1:])  # one before `start`


def test_which_attention_reads_only_the_rows_in_use():
    """float32 attends over slices of a layer's buffers and bf16 on CPU through the compiled
    kernel (keys and values as wide): buffers may hold a whole context. fp16 does not."""
    from kvforge.attention import reads_rows_in_use
    from kvforge.ops import kernels

    assert reads_rows_in_use(torch.float32, "cpu", [(64, 64), (64, 512)])
    assert not reads_rows_in_use(torch.float16, "cpu", [(64, 64)])
    assert reads_rows_in_use(torch.bfloat16, "cpu", [(64, 64)]) == kernels.available(64)
    assert not reads_rows_in_use(torch.bfloat16, "cpu", [(64, 64), (64, 128)])  # a latent wider than its key


def test_a_masked_bf16_step_over_buffers_of_a_whole_context_equals_one_over_its_rows():
    """bf16 with the compiled kernel: a layer whose rows are not contiguous (a gap of positions),
    in buffers allocated for 4,096 rows, attends to the bit as the same rows in buffers of their
    own length: the kernel reads only the mask's columns, the rows in use."""
    from kvforge.attention import attend
    from kvforge.cache import KVCache, LayerCache
    from kvforge.ops import kernels

    heads, dim = 2, 64
    if not kernels.available(dim):
        pytest.skip("no compiled bf16 kernel for this width")
    torch.manual_seed(0)
    k, v = torch.randn(1, heads, 6, dim, dtype=torch.bfloat16), torch.randn(1, heads, 6, dim, dtype=torch.bfloat16)
    positions = torch.tensor([[0, 1, 2, 5, 6, 7]])  # rows 3 and 4 not held: the layer is not contiguous
    whole = KVCache.empty(1, 1, heads, dim, torch.bfloat16, capacity=1)
    whole.leave(0)
    whole.allocate(2, 4096)
    own = LayerCache.empty(1, heads, dim, torch.bfloat16, "cpu", 6)
    big = whole[0]
    big.join(own)
    for layer in (own, big):
        layer.append(k, v, positions)
    assert big.capacity == 4096 and own.capacity == 6 and not big.contiguous
    q = torch.randn(1, 2 * heads, 1, dim, dtype=torch.bfloat16)
    out = [attend(q, layer, torch.tensor([[7]]), 0.125, new_rows=1) for layer in (own, big)]
    assert torch.equal(out[0], out[1])

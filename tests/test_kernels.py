"""The compiled few-query attention kernel: against SDPA, and a row's bits independent of the
step's width, of the batch, and of the length/mask path (what lossless drafting in bf16 needs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.ops import kernels
from kvforge.attention import PREFILL_CHUNK, grouped_attention, visibility_mask

pytestmark = pytest.mark.skipif(not kernels.available(64), reason=f"no kernels here: {kernels.status()['why_not']}")


def _buffer(batch, heads, capacity, dim, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, heads, capacity, dim, generator=g).bfloat16()
    v = torch.randn(batch, heads, capacity, dim, generator=g).bfloat16()
    return k, v, g


@pytest.mark.parametrize("dim", [16, 64, 128, 256])
@pytest.mark.parametrize("length", [1, 15, 16, 37, 100])
def test_kernel_matches_sdpa_over_the_real_rows(dim, length):
    k, v, g = _buffer(2, 2, 112, dim, seed=dim + length)
    q = torch.randn(2, 6, 1, dim, generator=g).bfloat16()
    ours = grouped_attention(q, k, v, dim**-0.5, length=length).float()
    ref = F.scaled_dot_product_attention(q.float(), k[:, :, :length].float(), v[:, :, :length].float(), scale=dim**-0.5, enable_gqa=True)
    # inputs in bf16, scores and the softmax in fp32, weights rounded to bf16, the output rounded once to bf16
    assert (ours - ref).abs().max() < 2e-2


def test_rows_past_the_length_are_never_read():
    k, v, g = _buffer(1, 2, 64, 64, seed=1)
    q = torch.randn(1, 6, 1, 64, generator=g).bfloat16()
    before = grouped_attention(q, k, v, 0.125, length=40)
    k[:, :, 40:] = float("nan")  # a trimmed draft's stale rows, or garbage
    v[:, :, 40:] = float("nan")
    assert torch.equal(grouped_attention(q, k, v, 0.125, length=40), before)


@pytest.mark.parametrize("dim, query_heads", [(16, 6), (64, 6), (48, 6), (64, 16)])
def test_a_row_has_the_same_bits_in_a_decode_step_and_in_a_verification_step(dim, query_heads):
    """Decode of the token at position p (length p + 1) against the same token as row i of a
    9-row verification step (length p + 9 - i... with the later rows its own, masked). Width 48
    transposes a whole group of 16 dimension pairs and a half one; 16 query heads over 2 KV heads
    make 72 rows per head, past the 64 a short last key block takes at a time."""
    k, v, g = _buffer(1, 2, 96, dim, seed=dim)
    q = torch.randn(1, query_heads, 9, dim, generator=g).bfloat16()
    start = 50
    verify = grouped_attention(q, k, v, 0.3, length=start + 9)
    for i in range(9):
        decode = grouped_attention(q[:, :, i : i + 1], k, v, 0.3, length=start + i + 1)
        assert torch.equal(decode[:, :, 0], verify[:, :, i]), i


def test_a_row_has_the_same_bits_alone_and_in_a_batch_and_on_the_mask_path():
    k, v, g = _buffer(4, 2, 80, 64, seed=3)
    q = torch.randn(4, 6, 1, 64, generator=g).bfloat16()
    length = 61
    batched = grouped_attention(q, k, v, 0.125, length=length)
    positions = torch.where(torch.arange(80) < length, torch.arange(80), torch.tensor(-1)).expand(4, -1)
    masked = grouped_attention(q, k, v, 0.125, visibility_mask(torch.full((4, 1), length - 1), positions, None))
    assert torch.equal(batched, masked)
    for b in range(4):
        alone = grouped_attention(q[b : b + 1], k[b : b + 1].contiguous(), v[b : b + 1].contiguous(), 0.125, length=length)
        assert torch.equal(alone, batched[b : b + 1])


def test_switched_off_by_the_environment(monkeypatch):
    kernels.reload()
    monkeypatch.setenv("KVFORGE_KERNELS", "0")
    try:
        assert not kernels.available(64) and kernels.status() == {"kernels": "none", "why_not": "disabled by KVFORGE_KERNELS=0", "kernel_threads": None}
    finally:
        kernels.reload()
        monkeypatch.delenv("KVFORGE_KERNELS")
    assert kernels.available(64)
    assert not kernels.available(24)  # widths that are not a multiple of 16 keep torch's ops
    assert not kernels.available(512)  # nor wider than the kernel's scratch


def test_a_step_that_trains_keeps_torchs_ops_and_its_gradient():
    k, v, g = _buffer(1, 2, 48, 64, seed=4)
    q = torch.randn(1, 6, 1, 64, generator=g).bfloat16().requires_grad_()
    out = grouped_attention(q, k, v, 0.125, length=30)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_shapes_the_kernel_cannot_read_are_refused_before_it_runs():
    k, v, g = _buffer(1, 2, 32, 64, seed=5)
    rows = torch.randn(1, 2, 3, 64, generator=g).bfloat16()
    with pytest.raises(ValueError, match="length 40"):
        kernels.few_query_scores(rows, k, 40, 0.125)  # more rows than the buffer holds
    with pytest.raises(ValueError, match="8 columns"):
        kernels.few_query_scores(rows, k, 10, 0.125, columns=8)  # fewer columns than scores
    with pytest.raises(ValueError):
        kernels.few_query_scores(rows[..., :32], k, 10, 0.125)  # another head width
    with pytest.raises(ValueError):
        kernels.few_query_scores(rows.float(), k, 10, 0.125)  # fp32 queries: the kernel multiplies bf16 pairs
    weights, inverse = kernels.few_query_softmax(kernels.few_query_scores(rows, k, 10, 0.125), 10)
    assert weights.shape == (1, 2, 3, 32) and weights.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        kernels.few_query_values(torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16), inverse, v, 10)  # weights over fewer rows
    with pytest.raises(ValueError):
        kernels.few_query_values(weights, inverse[..., :2], v, 10)  # a normalizer missing
    with pytest.raises(ValueError, match="tokens"):
        kernels.few_query_softmax(torch.zeros(1, 2, 3, 32), 10, tokens=4)  # more step tokens than rows
    with pytest.raises(ValueError, match="tokens"):
        kernels.few_query_softmax(torch.zeros(1, 2, 3, 32), 10, tokens=2)  # rows not whole steps
    wide = torch.zeros(1, 2, 32, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        kernels.few_query_scores(torch.zeros(1, 2, 3, 512, dtype=torch.bfloat16), wide, 10, 0.1)  # wider than the scratch


def test_weights_are_a_softmax_rounded_once_and_normalized_by_their_rounded_sum():
    """Each row's weights are exp(score - max) rounded to bf16 (zero past the keys the row sees,
    the causal triangle of a 3-token step included), and the normalizer is one over their sum."""
    k, v, g = _buffer(1, 2, 40, 64, seed=6)
    rows = torch.randn(1, 2, 6, 64, generator=g).bfloat16()  # 2 query heads x 3 tokens per KV head
    scores = kernels.few_query_scores(rows, k, 21, 0.125)
    expected_scores = (rows.float() @ k[:, :, :21].float().transpose(-1, -2)) * 0.125
    torch.testing.assert_close(scores[..., :21], expected_scores, rtol=1e-5, atol=1e-5)
    assert torch.isinf(scores[..., 21:]).all()
    weights, inverse = kernels.few_query_softmax(scores.clone(), 21, tokens=3)
    for r in range(6):
        seen = 21 - (2 - r % 3)
        s = scores[..., r, :seen]
        e = torch.exp(s - s.max(-1, keepdim=True).values)
        torch.testing.assert_close(weights[..., r, :seen].float(), e.bfloat16().float(), rtol=0, atol=2**-8)
        assert (weights[..., r, seen:22] == 0).all()
        torch.testing.assert_close(inverse[..., r], 1 / weights[..., r, :seen].float().sum(-1), rtol=1e-5, atol=0)


@pytest.mark.parametrize("tokens", [65, 140])
def test_a_prefill_in_chunks_gives_each_row_the_bits_of_its_own_decode_step(tokens):
    """A long step (a prefill) runs the kernel a few tokens at a time; each row must come out as
    a one-token step at its own position gives it (the kernel's invariant), so prefilling and
    decoding agree to the bit and the chunk boundaries never show."""
    from kvforge import attention

    k, v, g = _buffer(2, 3, 160, 64, seed=tokens)
    prefix = 7  # rows already in the cache before this step
    q = torch.randn(2, 9, tokens, 64, generator=g).bfloat16()
    length = prefix + tokens
    whole = grouped_attention(q, k, v, 0.125, length=length)
    assert tokens > attention.PREFILL_CHUNK  # the chunked path ran
    for t in (0, 63, 64, tokens - 1):  # either side of a chunk boundary
        alone = grouped_attention(q[:, :, t : t + 1], k, v, 0.125, length=prefix + t + 1)
        assert torch.equal(whole[:, :, t : t + 1], alone)
    causal = torch.ones(tokens, length, dtype=torch.bool).tril(prefix)
    ref = F.scaled_dot_product_attention(q.float(), k[:, :, :length].float(), v[:, :, :length].float(), attn_mask=causal,
                                         scale=0.125, enable_gqa=True)
    assert (whole.float() - ref).abs().max() < 2e-2


def test_a_long_steps_attention_pauses_between_its_blocks_of_query_rows_with_attends_bits():
    """`attend_steps` yields between the blocks of query rows the kernel runs a long step in (where
    a server runs its decode steps) and returns `attend`'s result to the bit; a short step, a
    windowed layer longer than its window and an fp32 layer do not pause."""
    from kvforge.attention import QUERY_BLOCK, attend, attend_steps
    from kvforge.cache import KVCache

    g = torch.Generator().manual_seed(5)
    layer = KVCache.empty(1, 1, 3, 64, torch.bfloat16, capacity=224)[0]
    k, v = torch.randn(1, 3, 200, 64, generator=g).bfloat16(), torch.randn(1, 3, 200, 64, generator=g).bfloat16()
    positions = torch.arange(200)[None]
    layer.append(k, v, positions)
    q = torch.randn(1, 9, 150, 64, generator=g).bfloat16()  # the last 150 rows: a chunk after 50 earlier rows

    def run(steps):
        points = []
        while True:
            try:
                points.append(next(steps))
            except StopIteration as done:
                return points, done.value

    points, out = run(attend_steps(q, layer, positions[:, 50:], 0.125, new_rows=150))
    assert points == [QUERY_BLOCK] * (-(-150 // PREFILL_CHUNK) - 1)
    assert torch.equal(out, attend(q, layer, positions[:, 50:], 0.125, new_rows=150))
    for args, kw in (((q[:, :, -PREFILL_CHUNK:], layer, positions[:, -PREFILL_CHUNK:], 0.125), {"new_rows": PREFILL_CHUNK}),
                     ((q, layer, positions[:, 50:], 0.125), {"window": 16, "new_rows": 150})):
        points, out = run(attend_steps(*args, **kw))
        assert points == [] and torch.equal(out, attend(*args, **kw))
    wide = KVCache.empty(1, 1, 3, 64, torch.float32, capacity=224)[0]
    wide.append(k.float(), v.float(), positions)
    points, out = run(attend_steps(q.float(), wide, positions[:, 50:], 0.125, new_rows=150))
    assert points == [] and torch.equal(out, attend(q.float(), wide, positions[:, 50:], 0.125, new_rows=150))


def test_a_bf16_prefill_attends_through_the_kernel_and_stays_close_to_sdpa():
    """attend() sends a contiguous layer's long bf16 step to the kernel (SDPA's bf16 flash kernel
    is 2-3x slower on CPU); a sliding-window layer longer than its window keeps SDPA's mask."""
    from unittest import mock

    from kvforge.attention import attend
    from kvforge.cache import KVCache

    g = torch.Generator().manual_seed(3)
    layer = KVCache.empty(1, 1, 3, 64, torch.bfloat16, capacity=128)[0]
    k, v = torch.randn(1, 3, 70, 64, generator=g).bfloat16(), torch.randn(1, 3, 70, 64, generator=g).bfloat16()
    positions = torch.arange(70)[None]
    layer.append(k, v, positions)
    q = torch.randn(1, 9, 70, 64, generator=g).bfloat16()
    with mock.patch.object(kernels, "few_query_attention", wraps=kernels.few_query_attention) as fused:
        ours = attend(q, layer, positions, 0.125, new_rows=70)
    assert fused.call_count == -(-70 // PREFILL_CHUNK)  # 70 tokens in chunks
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert (ours.float() - ref.float()).abs().max() < 2e-2
    with mock.patch.object(kernels, "few_query_attention", wraps=kernels.few_query_attention) as fused:
        windowed = attend(q, layer, positions, 0.125, window=16, new_rows=70)
    assert fused.call_count == 0
    mask = visibility_mask(positions, positions, 16)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    assert torch.equal(windowed, ref)


@pytest.mark.parametrize("dim", [48, 64, 256])
@pytest.mark.parametrize("rows, tokens, length", [(3, 1, 37), (27, 9, 100), (96, 32, 130), (40, 5, 70)])
def test_attention_in_one_call_gives_the_three_passes_bits(dim, rows, tokens, length):
    """few_query_attention (32 rows at a time, each group's scores kept in cache) = scores, softmax
    and values as three calls, to the bit, for row counts above and below a group, on AMX tiles
    (dims that are multiples of 32, where the CPU has them) and AVX-512 (48)."""
    k, v, g = _buffer(2, 2, 136, dim, seed=dim + rows)
    q = torch.randn(2, 2, rows, dim, generator=g).bfloat16()
    scores = kernels.few_query_scores(q, k, length, 0.1)
    weights, inverse = kernels.few_query_softmax(scores, length, tokens)
    assert torch.equal(kernels.few_query_attention(q, k, v, length, 0.1, tokens), kernels.few_query_values(weights, inverse, v, length))
    with pytest.raises(ValueError, match="few_query_attention"):
        kernels.few_query_attention(q, k, v, length, 0.1, tokens=rows + 1)


@pytest.mark.parametrize("dim", [48, 64])
@pytest.mark.parametrize("rows, tokens", [(3, 1), (27, 9), (40, 5)])
def test_attention_over_sequences_of_their_own_lengths_gives_each_sequence_its_own_bits(dim, rows, tokens):
    """`lengths`: each sequence read to its own end, in one call, equals a call over that sequence
    alone with its own length, to the bit (AMX tiles for 64 where the CPU has them, AVX-512 for 48),
    at 1 and 2 threads."""
    k, v, g = _buffer(3, 2, 136, dim, seed=dim + rows)
    q = torch.randn(3, 2, rows, dim, generator=g).bfloat16()
    lengths = [37, 130, tokens + 4]
    alone = torch.cat([kernels.few_query_attention(q[b : b + 1], k[b : b + 1].contiguous(), v[b : b + 1].contiguous(), n, 0.1, tokens)
                       for b, n in enumerate(lengths)])
    for threads in (1, 2):
        together = _at_threads(threads, lambda: kernels.few_query_attention(q, k, v, 130, 0.1, tokens, lengths=lengths))
        assert torch.equal(together, alone)
    for bad in ([37, 120, 20], [37, 130], [tokens - 1 or 0, 130, 40]):  # longest not `length`, one per sequence, each holds the step
        with pytest.raises(ValueError, match="lengths"):
            kernels.few_query_attention(q, k, v, 130, 0.1, tokens, lengths=bad)


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (48, 40), (208, 64)])
def test_small_linear_rows_have_the_same_bits_at_every_width_and_match_f_linear(shape):
    """1..32 rows through every row tile (1..9 rows, and passes of 9 with the rest; 208 outputs = 13
    blocks leave one block after whole tiles of any width): a row's bits never
    depend on how many rows share the call (decode = verification = batch), and the result is
    F.linear's within one bf16 rounding of the output."""
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(32, k, generator=g).bfloat16()
    packed = kernels.pack_pairs(w)
    alone = torch.cat([kernels.small_linear(x[r : r + 1], packed, bias) for r in range(32)])
    for m in range(2, 33):
        assert torch.equal(kernels.small_linear(x[:m], packed, bias), alone[:m]), m
    batch = x.repeat(5, 1)[:150]  # a batch's verification: row chunks of 16 (AMX) or 9 (AVX-512) and a rest
    assert torch.equal(kernels.small_linear(batch, packed, bias), alone.repeat(5, 1)[:150])
    for m in (33, 64, 97):  # AMX: groups of 32 rows on 2 x 2 tiles, the rest 16 at a time
        assert torch.equal(kernels.small_linear(batch[:m], packed, bias), alone.repeat(5, 1)[:m]), m
    assert torch.equal(_at_threads(2, lambda: kernels.small_linear(batch, packed, bias)), alone.repeat(5, 1)[:150])
    ref = F.linear(x.float(), w.float(), bias.float())
    assert ((alone.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-3).all()


@pytest.mark.parametrize("shape", [(48, 40), (208, 576), (64, 96)])  # 20 pairs: a last part of 4 below a whole 16
def test_unpack_pairs_gives_the_weight_back_bit_for_bit_at_one_and_two_threads(shape):
    if kernels.kind() == "none":
        pytest.skip("no compiled kernels here")
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    packed = kernels.pack_pairs(weight)
    for threads in (1, 2):
        assert torch.equal(_at_threads(threads, lambda: kernels.unpack_pairs(packed)), weight)
    with pytest.raises(ValueError, match="unpack_pairs"):
        kernels.unpack_pairs(packed, out=torch.empty(shape[0], shape[1] + 2, dtype=torch.bfloat16))


def test_small_linear_takes_amx_tiles_where_the_cpu_has_them():
    """On an AMX-BF16 CPU small_linear multiplies on the tiles (weights with a multiple of 32
    inputs); the AVX-512 path gives the same products within one bf16 rounding."""
    import os
    from pathlib import Path

    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    linux = tuple(int(n) for n in os.uname().release.split("-")[0].split(".")[:2])
    if "amx_bf16" not in cpu or os.environ.get("KVFORGE_AMX") == "0" or linux < (5, 16):
        pytest.skip("no AMX-BF16 here (or a Linux before 5.16, which does not grant the tiles)")
    assert kernels.amx() and kernels.kind() == "amx"
    lib = kernels._library()
    assert lib.kvforge_amx_usable(576) and not lib.kvforge_amx_usable(40)  # 40 inputs: not whole A tiles
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(208, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(20, 576, generator=g).bfloat16()
    packed = kernels.pack_pairs(w)
    tiles = kernels.small_linear(x, packed)
    lib.kvforge_amx_disable()
    try:
        vectors = kernels.small_linear(x, packed)
    finally:
        lib.kvforge_amx_enable()
    assert ((tiles.float() - vectors.float()).abs() <= vectors.float().abs() * 2**-7 + 1e-3).all()
    # attention's value pass sums 32 keys per tile: parts may start only where a chunk does
    assert kernels.value_part_step(64) == 32 and kernels.value_part_step(48) == 2
    k, v, _ = _buffer(1, 1, 96, 64, seed=3)
    weights, inverse = kernels.few_query_softmax(kernels.few_query_scores(torch.randn(1, 1, 3, 64).bfloat16(), k, 90, 0.1), 90)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.few_query_values(weights[..., 2:], inverse, v, 90, start=2)
    whole = kernels.few_query_values(weights, inverse, v, 90)
    sums = kernels.few_query_values(weights, inverse, v, 64, finish=False)
    assert torch.equal(kernels.few_query_values(weights[..., 64:], inverse, v, 90, start=64, sums=sums), whole)


def test_linear_runs_few_bf16_rows_through_small_linear_and_keeps_onednn_for_the_rest():
    from unittest import mock

    from kvforge.ops.linear import linear

    g = torch.Generator().manual_seed(4)
    w = (torch.randn(64, 32, generator=g) * 0.1).bfloat16()
    odd = (torch.randn(40, 32, generator=g) * 0.1).bfloat16()  # 40 outputs: not whole blocks of 16
    x = torch.randn(kernels.small_rows(32) + 1, 32, generator=g).bfloat16()
    batch = torch.randn(16, 9, 32, generator=g).bfloat16()  # a batch's verification: 144 rows of 9-token steps
    with torch.inference_mode(), mock.patch.object(kernels, "small_linear", wraps=kernels.small_linear) as small:
        linear(x[:9], w)
        together = linear(batch, w)
        assert small.call_count == 2
        assert torch.equal(together[3, :1], linear(batch[3, :1], w))  # = that sequence's decode step
        calls = small.call_count
        linear(x, w)  # a prefill-sized step
        linear(x[None], w)
        linear(x[:9], odd)
        assert small.call_count == calls
    with pytest.raises(ValueError, match="small_linear"):
        kernels.small_linear(x[:, :30], kernels.pack_pairs(w))


class Gemma3RMSNorm(torch.nn.Module):  # the name is what `rms_norm` recognises Gemma's (1 + w) norms by
    def __init__(self, dim, g):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim, generator=g).bfloat16())
        self.eps = 1e-6


class LlamaRMSNorm(torch.nn.Module):
    def __init__(self, dim, g):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim, generator=g).bfloat16())
        self.variance_epsilon = 1e-5


@pytest.mark.parametrize("family", [LlamaRMSNorm, Gemma3RMSNorm])
@pytest.mark.parametrize("dim", [64, 576, 1152])
def test_rms_norm_kernel_matches_torch_and_a_row_alone(family, dim):
    """The residual stream's norm in one call: within one bf16 step of torch's four ops (its sum of
    squares runs in another order), each row's bits the same alone as in a batch of 9-token steps."""
    from unittest import mock

    from kvforge.ops.norms import rms_norm

    g = torch.Generator().manual_seed(dim)
    norm = family(dim, g)
    x = (torch.randn(4, 9, dim, generator=g) * 20).bfloat16()
    with torch.inference_mode(), mock.patch.object(kernels, "rms_norm", wraps=kernels.rms_norm) as compiled:
        ours = rms_norm(norm, x, stream=True)
        assert compiled.call_count == 1
        ref = rms_norm(norm, x)  # not the stream: torch's ops
        last = rms_norm(norm, x[:, -1:], stream=True)  # a slice (as the head reads it), made contiguous
        assert compiled.call_count == 2
        alone = torch.stack([torch.cat([rms_norm(norm, x[b : b + 1, t : t + 1], stream=True) for t in range(9)], dim=1)[0] for b in range(4)])
    steps = (ours.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert steps.max() <= 1 and ours.dtype == torch.bfloat16
    assert torch.equal(alone, ours) and torch.equal(last, ours[:, -1:])
    with pytest.raises(ValueError, match="rms_norm"):
        kernels.rms_norm(x[..., :60].contiguous(), norm.weight[:60], 1e-6, one_plus=False)
    with torch.enable_grad():  # training keeps torch's ops, which backpropagate, frozen norm weights or not
        assert rms_norm(norm, x.float().requires_grad_().bfloat16(), stream=True).requires_grad
        norm.weight.requires_grad_(False)
        assert rms_norm(norm, x.float().requires_grad_().bfloat16(), stream=True).requires_grad
    long = (torch.randn(1, kernels.SMALL_ROWS + 1, dim, generator=g) * 20).bfloat16()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):  # a prefill, on one thread or two: the kernel, each row's bits its own
            torch.set_num_threads(n)
            with torch.inference_mode(), mock.patch.object(kernels, "rms_norm", wraps=kernels.rms_norm) as compiled:
                prefill = rms_norm(norm, long, stream=True)
                assert compiled.call_count == 1
            assert torch.equal(prefill[:, 5:6], rms_norm(norm, long[:, 5:6], stream=True))
    finally:
        torch.set_num_threads(threads)


def _at_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("tiles", [True, False], ids=["amx-where-present", "avx512"])
def test_kernels_give_the_same_bits_at_one_and_two_threads(tiles):
    """The kernels split a call's outputs over torch's thread count (a linear's blocks of 16
    outputs, an attention's heads, a norm's rows), each output computed by one thread as at one
    thread: the bits of a linear, the one-call attention, the three passes and a norm do not depend on the threads,
    for shapes with fewer heads or blocks than threads and with a part's last tile left over."""
    lib = kernels._library()
    if not tiles:
        lib.kvforge_amx_disable()
    try:
        g = torch.Generator().manual_seed(11)
        for n, k in [(960, 576), (208, 64), (16, 64), (3072, 576)]:
            w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
            bias = torch.randn(n, generator=g).bfloat16()
            packed = kernels.pack_pairs(w)
            for m in (1, 9, 20):
                x = torch.randn(m, k, generator=g).bfloat16()
                one = _at_threads(1, lambda: kernels.small_linear(x, packed, bias))
                assert torch.equal(_at_threads(2, lambda: kernels.small_linear(x, packed, bias)), one), (n, k, m)
        for heads, rows, tokens, length, dim in [(1, 3, 1, 37, 64), (3, 3, 1, 300, 64), (3, 27, 9, 290, 64), (5, 40, 5, 130, 48)]:
            kb, vb, _ = _buffer(1, heads, 300, dim, seed=heads + rows)
            q = torch.randn(1, heads, rows, dim, generator=g).bfloat16()

            def passes():
                weights, inverse = kernels.few_query_softmax(kernels.few_query_scores(q, kb, length, 0.1), length, tokens)
                return kernels.few_query_attention(q, kb, vb, length, 0.1, tokens), kernels.few_query_values(weights, inverse, vb, length)

            one = _at_threads(1, passes)
            two = _at_threads(2, passes)
            assert torch.equal(two[0], one[0]) and torch.equal(two[1], one[1]) and torch.equal(one[0], one[1])
        x = torch.randn(1, 300, 576, generator=g).bfloat16()  # a prefill's rows
        weight = torch.randn(576, generator=g).bfloat16()
        for one_plus in (False, True):
            one = _at_threads(1, lambda: kernels.rms_norm(x, weight, 1e-5, one_plus))
            assert torch.equal(_at_threads(2, lambda: kernels.rms_norm(x, weight, 1e-5, one_plus)), one)
    finally:
        if not tiles:
            lib.kvforge_amx_enable()


def test_kernels_called_from_two_threads_at_once_each_get_their_own_bits():
    """Two Python threads (a server's schedulers) calling the kernels at once, each on a team of
    torch's OpenMP runtime: both get the one-thread bits."""
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(5)
    w = (torch.randn(3072, 576, generator=g) * 0.05).bfloat16()
    packed = kernels.pack_pairs(w)
    xs = [torch.randn(3, 576, generator=g).bfloat16() for _ in range(2)]
    expected = [_at_threads(1, lambda x=x: kernels.small_linear(x, packed)) for x in xs]

    def many(x):
        torch.set_num_threads(2)
        return [kernels.small_linear(x, packed) for _ in range(200)]

    threads = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(many, xs))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, want) for outs, want in zip(results, expected) for out in outs)


def test_silu_mul_rounds_as_torchs_two_bf16_ops_and_the_mlp_takes_it():
    """silu(gate) * up in one pass: the bits of torch's bf16 silu then product (exp within 2 ulp,
    which lands on the same bf16 on these values; results below bf16's normal range read 0), a
    row's bits the same alone, at 1 and 2 threads; a bf16 Llama MLP runs it, fp32 keeps torch's."""
    from unittest import mock

    from conftest import tiny_loaded

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(200, 3072, generator=g) * 4).bfloat16()
    x[0, :6] = torch.tensor([100.0, -100.0, 89.0, -89.0, 0.0, -0.0]).bfloat16()  # exp's overflow and underflow
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    ours = _at_threads(2, lambda: kernels.silu_mul(x))
    assert torch.equal(ours, ref)
    assert torch.equal(_at_threads(1, lambda: kernels.silu_mul(x[7:8])), ours[7:8])
    with pytest.raises(ValueError, match="silu_mul"):
        kernels.silu_mul(x[:, :48].contiguous())
    from kvforge.engine import Engine

    for dtype, calls in ((torch.bfloat16, 4), (torch.float32, 0)):  # the tiny Llama's 4 layers, once each
        engine = Engine(tiny_loaded("llama", dtype=dtype))
        with torch.inference_mode(), mock.patch.object(kernels, "silu_mul", wraps=kernels.silu_mul) as fused:
            engine.prefill([[5, 6, 7, 8]])
        assert fused.call_count == calls, dtype

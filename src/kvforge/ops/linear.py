"""The linear every projection of the engine runs: row-stable in low precision (a row's bits do
not depend on how many rows a step computes, which lossless drafting needs), over weights packed
once. Packed copies are kept on the weight tensor and dropped when weights change in place."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvforge.allocator import return_freed_memory
from kvforge.ops import kernels, released, torch_private


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, in low precision on CPU with rows that do not depend on how many rows are
    computed at once, and the weight packed once.

    With the compiled kernels (AVX512-BF16), bf16 steps of up to `kernels.small_rows` tokens per
    sequence (32; 256 on AMX tiles: decode, verification at any batch size, prefill chunks) run
    `kernels.small_linear` over the weight
    packed into pairs (a row's bits independent of the row count by construction; a decode
    step's 121 matmuls at one row 24 -> 12.5 ms, at 9 rows 28 -> 25 ms, at 16 rows 35 -> 31 ms,
    interleaved, on AMD EPYC with AVX512-BF16) and longer ones (prefill) F.linear; elsewhere, what follows.
    A weight kept only packed (`release_unpacked`) runs from its pairs, or unpacked for the call.

    Prepacked: oneDNN's linear over a weight reordered into its blocked layout at first use
    (`mkldnn._reorder_linear_weight`, what torch.compile's CPU backend packs bf16 linears with) and
    kept beside the weight. Measured on AMD EPYC (AVX512-BF16), one thread, smollm2's bf16 shapes with the
    weights streaming from memory as in decoding: a decode step's 121 matmuls 57 -> 32 ms (1 row),
    65 -> 35 ms (9 rows); equal or faster at every width up to 1024-row prefill chunks, with
    results bit-identical to F.linear's.
    Row stability matters for speculative decoding: a one-token decode step and a (k+1)-token
    verification must round alike, else near-ties flip and drafting stops being token-identical to
    plain decoding. oneDNN's one-row kernels, packed or not, round apart from its multi-row ones
    when a row has more than 1024 inputs (measured: 27-45 of 192 rows differ for 1088..3072 inputs,
    none up to 1024; the 1536 -> 576 down projection is one), while 2..32 rows agree with each
    other. Whether a shape does is measured once per shape (`_one_row_rounds_apart`); such a
    single row is computed as two (a broadcast view, no copy of the weights), the others as one. Without a packable weight (a
    view, autograd) it goes through F.linear. fp32 keeps transformers' kernel but for one case
    (`_linear_fp32`): its parity is against transformers."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if released.is_released(weight if weight._base is None else weight._base):
        return _linear_released(x, weight, bias)
    training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if x.dtype == torch.float32:
        return _linear_fp32(x, weight, bias, training)
    rows = x.reshape(-1, x.shape[-1])
    if (not training and x.dtype == torch.bfloat16 and kernels.small_linear_fits(weight)
            and (bias is None or bias.dtype == torch.bfloat16)):
        # By the step's tokens per sequence, not its rows: a batch's verification (16 x 9 rows)
        # must round each row as that sequence's decode step does.
        if (x.shape[-2] if x.dim() >= 3 else rows.shape[0]) > kernels.small_rows(weight.shape[1]):
            return F.linear(x, weight, bias)  # a prefill: oneDNN at this CPU's peak, packed or not
            # (prepacked 3 % faster at 1K-4K tokens, not worth a third copy of the weight)
        pairs = _packed(weight, kernels.pack_pairs)
        if pairs is not None:
            return kernels.small_linear(rows, pairs, bias).view(*x.shape[:-1], -1)
    packed = None if training else _packed(weight)
    single = rows.shape[0] == 1 and _one_row_rounds_apart(weight.shape[0], weight.shape[1], weight.dtype, packed is not None)
    if single:  # computed as two rows: see above
        rows = rows.expand(2, -1)
    if packed is not None:
        out = torch_private.onednn_linear(rows, packed, bias)
    else:
        out = F.linear(rows, weight, bias)
    return (out[:1] if single else out).view(*x.shape[:-1], -1)


# fp32 weights above this size (bytes) do not stay in this CPU's caches between decode steps
_STREAMED_BYTES = 16 << 20


def _linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, training: bool) -> torch.Tensor:
    """fp32 keeps transformers' kernel (F.linear: MKL's SGEMM, its SGEMV for one row) at every width
    but one: a single row through a weight too large for the caches (the LM head). There SGEMV
    streams the weight at ~9 GB/s and MKL's packed SGEMM, over a copy packed once, at ~19 GB/s
    (smollm2-135m's 49152 x 576 head, one thread: 13.2 -> 5.9 ms, a tenth of a decode step). That
    row then rounds as an SGEMM row does, ~5e-6 off SGEMV's: as far as transformers' own one-row
    and two-row forwards are apart."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] != 1 or training or weight.numel() * weight.element_size() < _STREAMED_BYTES:
        return F.linear(x, weight, bias)
    packed = _packed(weight, _mkl_pack)
    if packed is None:
        return F.linear(x, weight, bias)
    out = torch_private.mkl_linear(rows, packed, weight, bias)
    return out.view(*x.shape[:-1], -1)


def release_unpacked(weights) -> int:
    """Free the row-major storage of each weight that `small_linear` runs from its packed pairs,
    keeping the pairs (`ops.released`): a bf16 model's projections then take their memory once
    instead of twice. Such a weight's steps of up to `kernels.small_rows` tokens per sequence read
    the pairs as before; a longer step (a prefill, a server's prefill chunk of more than 256
    tokens) and a view of it (the K/V rows RidgeFill reads) run on the weight unpacked from the
    pairs for that call, bit for bit the same products. Measured over smollm2-135m's 121
    projection weights, Intel Xeon with AMX: unpacking them all takes 24 ms at one thread, 15 at
    two, paid by every such step; `benchmarks/released_weights.py` times whole prefills.
    Nothing else may read a released weight's storage: a module's own forward over it reads freed
    memory. `released.readable` gives the values, `released.restore` the storage back for a write
    (`weights.update_weights`, which releases them again after). Kept: weights that are views,
    share their storage, need gradients, sit on a storage that cannot be resized, or have no pairs
    here (fp32, no kernels). An embedding table tied to a released LM head is looked up in the
    pairs (`released.packed_rows`). The freed memory goes back to the kernel (the allocator keeps
    freed memory for activations otherwise). Returns the bytes freed."""
    freed = 0
    for weight in weights:
        storage = weight.untyped_storage()
        if (weight._base is not None or weight.requires_grad or not weight.is_contiguous() or weight.storage_offset() != 0
                or storage.nbytes() != weight.numel() * weight.element_size() or not storage.resizable()):
            continue
        if released.is_released(weight) or _packed(weight, kernels.pack_pairs) is None:
            continue
        freed += released.release(weight)
    if freed:
        return_freed_memory()
    return freed


def _linear_released(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear` over a released weight or a view of one: the pairs where the weight itself runs
    `small_linear`, else its values unpacked for this call, run as `linear` runs the original."""
    training = torch.is_grad_enabled() and x.requires_grad
    tokens = x.shape[-2] if x.dim() >= 3 else x.reshape(-1, x.shape[-1]).shape[0]
    if (weight._base is None and not training and x.dtype == torch.bfloat16 and tokens <= kernels.small_rows(weight.shape[1])
            and (bias is None or bias.dtype == torch.bfloat16)):
        return kernels.small_linear(x.reshape(-1, x.shape[-1]), released.pairs_of(weight), bias).view(*x.shape[:-1], -1)
    return linear(x, released.readable(weight), bias)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    return torch_private.onednn_pack(weight) if torch_private.onednn(weight.dtype) else None


def _mkl_pack(weight: torch.Tensor) -> torch.Tensor | None:
    return torch_private.mkl_pack(weight) if torch_private.mkl() else None


_weights_generation = 0  # bumped by `invalidate_packed`: every packed copy made before is stale


def invalidate_packed() -> None:
    """Mark every packed weight copy stale, after weights were written in place (`weights.py`):
    inference tensors keep no version counter, so a packed copy cannot see the write itself."""
    global _weights_generation
    _weights_generation += 1


def _packed(weight: torch.Tensor, pack=_onednn_pack) -> torch.Tensor | None:
    """The weight in a library's packed layout (oneDNN's blocked one by default), made at first use
    and kept on the tensor (remade if the weight changed since: its version counter, storage,
    dtype or an `invalidate_packed`); None for a view (a slice would be packed on every call), a
    non-contiguous weight, or what this CPU's library cannot run."""
    # a slice of an inference tensor has no _base: its storage offset tells it (the K/V rows of q/k/v)
    if weight._base is not None or weight.storage_offset() or not weight.is_contiguous() or weight.dim() != 2:
        return None
    # inference tensors (made under inference mode, e.g. LoRA-merged weights) keep no version counter
    stamp = (None if weight.is_inference() else weight._version, weight.data_ptr(), weight.dtype, _weights_generation)
    packs = getattr(weight, "_kvforge_packed", None)
    if packs is None:
        packs = weight._kvforge_packed = {}  # one entry per layout: prefill and decode use different ones
    cached = packs.get(pack)
    if cached is None or cached[0] != stamp:
        packed = pack(weight.detach())
        if packed is None:
            return None
        cached = packs[pack] = (stamp, packed)
    return cached[1]


@functools.cache
def _one_row_rounds_apart(out_features: int, in_features: int, dtype: torch.dtype, packed: bool) -> bool:
    """Whether oneDNN computes one row of this shape differently from the same row among others,
    measured once per shape on 64 random rows (on AMD EPYC with AVX512-BF16: only above 1024 inputs, for 14-23 %
    of rows, packed or not; other CPUs and oneDNN releases may differ, hence measured, not assumed)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).to(dtype)
    x = torch.randn(64, in_features, generator=g).to(dtype)
    if packed:
        p = torch_private.onednn_pack(w)
        run = lambda rows: torch_private.onednn_linear(rows, p, None)  # noqa: E731
    else:
        run = lambda rows: F.linear(rows, w)  # noqa: E731
    with torch.no_grad():
        return any(not torch.equal(run(x[r : r + 1]), run(x[r : r + 1].expand(2, -1))[:1]) for r in range(64))


def fuse_linears(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One (weight, bias) for several linears that read the same input, so a layer does one
    larger matmul instead of several. The modules' own weights are re-pointed at parameters
    aliasing the fused tensor's storage (not views of it: `_base` is None): memory is not doubled
    and transformers' forward still works unchanged, until the fused weight is released
    (`release_unpacked`)."""
    weight = torch.cat([l.weight.detach() for l in linears], dim=0)
    biases = [l.bias for l in linears]
    bias = torch.cat([b.detach() for b in biases], dim=0) if all(b is not None for b in biases) else None
    if any(b is not None for b in biases) and bias is None:
        raise ValueError("cannot fuse linears where only some have a bias")
    offset = 0
    for l in linears:
        n = l.weight.shape[0]
        l.weight = torch.nn.Parameter(weight[offset : offset + n], requires_grad=False)
        if bias is not None:
            l.bias = torch.nn.Parameter(bias[offset : offset + n], requires_grad=False)
        offset += n
    return weight, bias

"""Small C kernels kvforge compiles itself, for what torch's CPU ops do slowly.

`few_query_attention.c`: attention of a few query rows (a decode or verification step, or a
prefill a few tokens at a time) over a contiguous bf16 cache buffer. torch's batched matmuls read
such a buffer at 7-9 GB/s here (a 3 x 64 by 64 x T product per head and sequence) where one core
streams 17-23 GB/s, and a 9-token verification at 4K (27 query rows per KV head) is bound by
multiplies, which AVX512-BF16's pair dot products halve. `small_linear.c`: a bf16 linear for a
few rows (up to `small_rows`: 32 tokens per sequence, 256 on AMX tiles) over a weight packed once
into pairs (oneDNN streams a decode step's weights at ~10 GB/s here); `kvforge_unpack_pairs`
gives a packed weight back. On CPUs with AMX-BF16 both do their multiplies on the tiles
(`small_linear_amx.c`; the attention's tile passes sit in few_query_attention.c), so a linear of
up to 16 rows costs about one row's (`KVFORGE_AMX=0` keeps AVX-512). `rms_norm.c`: a bf16 RMSNorm in one call instead of four
ops. `silu_mul.c`: a gated MLP's silu(gate) * up in one pass. `threads.c`: each call split over
torch's own OpenMP threads by independent outputs (a linear's blocks, an attention's heads, a norm's
rows), so the bits do not depend on the thread count. They are built into one library when kvforge
is installed (setup.py: no torch headers, called through ctypes with raw pointers), for AVX-512
whatever CPU builds them; the library's own `kvforge_supported` (cpu_check.c) says at run time
whether this CPU runs them. Where the library was not built (no C compiler at install), does not
load, this CPU lacks AVX512-BF16, or `KVFORGE_KERNELS=0`, `available()` is False and callers keep
torch's ops; `status()` says which, every `--json` report records it, and a library that should be
there and is not is announced once on stderr.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Sequence

import torch

from kvforge.cpu import multiplies_natively

_MAX_DIM = 256  # MAX_DIM in the C source
_NAME = "_kvforge_kernels"  # setup.py's extension: the library's file name up to its suffix


def _sources_hash(directory: Path) -> str:
    """setup.py's `sources_hash` of the `.c` and `.h` files beside this module (the same bytes hashed)."""
    h = hashlib.sha256()
    for path in sorted(directory.glob("*.[ch]")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None) or (None, why not)."""
    if os.environ.get("KVFORGE_KERNELS", "1") == "0":
        return None, "disabled by KVFORGE_KERNELS=0"
    if platform.machine() not in ("x86_64", "AMD64") or multiplies_natively("bfloat16") is False:
        return None, "this CPU lacks AVX512-BF16 (or AVX-512 BW, VL)"  # no build could run here: nothing to announce
    here = Path(__file__).parent
    files = [here / f"{_NAME}{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    found = next((f for f in files if f.is_file()), None)
    if found is None:
        return None, ("not built when kvforge was installed (no C compiler, or one without AVX-512 support?): "
                      "reinstall kvforge where `cc` runs")
    try:
        lib = ctypes.CDLL(str(found))
    except OSError as exc:
        return None, f"{found.name} does not load: {exc}"
    lib.kvforge_sources.restype = ctypes.c_char_p
    if lib.kvforge_sources().decode() != _sources_hash(here):
        return None, f"{found.name} was built from other sources than these: reinstall kvforge (`make install`)"
    if not lib.kvforge_supported():
        return None, "this CPU lacks AVX512-BF16 (or AVX-512 BW, VL)"
    i64, f32, ptr = ctypes.c_long, ctypes.c_float, ctypes.c_void_p
    lib.kvforge_qk.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, ptr]
    lib.kvforge_softmax.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr]
    lib.kvforge_pv.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int, ptr]
    lib.kvforge_pack_pairs.argtypes = [ptr, ptr, i64, i64]
    lib.kvforge_unpack_pairs.argtypes = [ptr, ptr, i64, i64]
    lib.kvforge_small_linear.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64]
    lib.kvforge_rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, f32, ctypes.c_int]
    lib.kvforge_attend.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, i64, ptr, i64]
    lib.kvforge_attend.restype = ctypes.c_int
    lib.kvforge_silu_mul.argtypes = [ptr, ptr, i64, i64]
    lib.kvforge_silu_mul.restype = None
    lib.kvforge_use_openmp.argtypes = [ptr, ptr, ptr, ptr]
    lib.kvforge_use_openmp.restype = None
    entries = _openmp_entries()  # the kernels split their calls over torch's own threads (threads.c), or run alone
    lib.kvforge_use_openmp(*(entries or (None,) * len(_OPENMP_ENTRIES)))
    lib.kvforge_threads = "openmp" if entries else "one"
    for fn in (lib.kvforge_qk, lib.kvforge_softmax, lib.kvforge_pv, lib.kvforge_pack_pairs, lib.kvforge_unpack_pairs, lib.kvforge_small_linear,
               lib.kvforge_rms_norm):
        fn.restype = None
    if hasattr(lib, "kvforge_amx_enable"):
        lib.kvforge_amx_usable.argtypes = [i64]
        if os.environ.get("KVFORGE_AMX", "1") != "0":
            lib.kvforge_amx_enable()  # the kernels take the tiles from now on where this CPU and Linux allow them
    return lib, None


_OPENMP_ENTRIES = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads", "omp_get_max_threads")


def _openmp_entries() -> list[int] | None:
    """The addresses of the OpenMP entry points torch's own ops run on (looked up through
    libtorch_cpu's handle, which resolves them in the runtime torch is linked to: GNU libgomp, or
    LLVM's or Intel's, which export the same GNU entry points); None where torch's parallel backend
    is not OpenMP or no such library is found (then the kernels run on the calling thread alone)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    libraries = sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*"))
    if not libraries:
        return None
    try:
        torch_cpu = ctypes.CDLL(str(libraries[0]))  # already loaded by `import torch`: the same handle
        return [ctypes.cast(getattr(torch_cpu, name), ctypes.c_void_p).value for name in _OPENMP_ENTRIES]
    except (OSError, AttributeError):
        return None


_LOCK = threading.Lock()
_announced: list[ctypes.CDLL | None] = []  # the library once `_library` has run (a step's threads may race to it)


def _library() -> ctypes.CDLL | None:
    """The kernels' library, or None; the first call says on stderr why a library that should be
    there is not (a CPU without AVX512-BF16, or `KVFORGE_KERNELS=0`, is not announced)."""
    if not _announced:
        with _LOCK:
            if not _announced:
                lib, why = _loaded()
                if lib is None and why.startswith(("not built", _NAME)):  # the CPU runs them, the library is not there
                    print(f"warning: kvforge's C kernels are missing: {why}; bf16 runs torch's ops, slower", file=sys.stderr)
                _announced.append(lib)
    return _announced[0]


def _on_torch_threads() -> ctypes.CDLL:
    """The library, for a call that splits over torch's threads: `torch.get_num_threads()` runs
    torch's once-per-thread setup, after which the runtime's `omp_get_max_threads` (threads.c)
    answers torch's thread count in this thread too (a server's scheduler thread, say)."""
    torch.get_num_threads()
    return _library()


def reload() -> None:
    """Forget the library and why it is missing, so the next call looks again (tests: the
    environment or the file changed)."""
    with _LOCK:
        _loaded.cache_clear()
        _announced.clear()


def status() -> dict:
    """What `--json` reports record: {"kernels": `kind()`, "why_not": the reason, or None,
    "kernel_threads": "openmp" (torch's thread count, on torch's own OpenMP threads), "one" (torch
    runs no OpenMP runtime to share: the calling thread alone) or None (no kernels)}."""
    lib = _library()
    return {"kernels": kind(), "why_not": _loaded()[1], "kernel_threads": None if lib is None else lib.kvforge_threads}


def kind() -> str:
    """Which compiled kernels run here: "amx" (on tiles where shapes allow), "avx512-bf16", or "none"
    (torch's ops)."""
    return "amx" if amx() else "avx512-bf16" if _library() is not None else "none"


def amx() -> bool:
    """Whether the kernels multiply on AMX tiles here (`small_linear` for weights with a multiple of
    32 inputs, attention for heads as wide: an AMX-BF16 CPU, Linux's permission, and `KVFORGE_AMX`
    not 0); False where the kernels are not available at all."""
    return _tiles(32)


def _tiles(width: int) -> bool:
    """Whether the C kernels take the AMX path for this input or head width (their own test)."""
    lib = _library()
    return bool(lib is not None and hasattr(lib, "kvforge_amx_usable") and lib.kvforge_amx_usable(width))


def _on_cpu(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor a kernel reads or writes through a raw pointer is in CPU memory."""
    return all(t is None or t.device.type == "cpu" for t in tensors)


def _widths_ok(dim: int) -> bool:
    return 16 <= dim <= _MAX_DIM and dim % 16 == 0


def available(dim: int) -> bool:
    """Whether the compiled few-query kernels can run heads of width `dim` here (16..256, a multiple
    of 16: the kernel's per-block scratch and accumulators are sized for at most 256)."""
    return _widths_ok(dim) and _library() is not None


def _head_lengths(lengths: Sequence[int] | None, b: int, h: int, low: int, high: int, name: str) -> torch.Tensor | None:
    """`lengths` (one per head of (B, H) in order, or one per sequence for all its H heads) as the
    int64 (B * H,) the kernels index by head, each checked to lie in [low, high]; None stays None."""
    if lengths is None:
        return None
    lengths = tuple(lengths)
    if len(lengths) == b and h > 1:
        lengths = tuple(n for n in lengths for _ in range(h))
    if len(lengths) != b * h or lengths and not low <= min(lengths) <= max(lengths) <= high:
        raise ValueError(f"{name}: per-head lengths, one per sequence ({b}) or per head ({b * h}), each in [{low}, {high}], "
                         f"got {list(lengths)}")
    return _long_tensor(lengths)


@functools.lru_cache(maxsize=64)
def _long_tensor(values: tuple[int, ...]) -> torch.Tensor:
    """An int64 tensor of `values`, made once: every layer of a step passes the same lengths (never
    written: the kernels only read it)."""
    return torch.tensor(values, dtype=torch.long)


def few_query_scores(rows: torch.Tensor, k: torch.Tensor, length: int, scale: float, columns: int | None = None,
                     start: int = 0, lengths: Sequence[int] | None = None) -> torch.Tensor:
    """bf16 query rows (B, H, R, D) against rows [start, length) of a bf16 buffer k (B, H, C, D)
    -> scaled scores (B, H, R, S) fp32, column j for key start + j, -inf past `length`; S =
    `columns` (length - start .. C - start, default C - start: a prefill chunk asks for `length`
    alone instead of the whole buffer's width). A key's score does not depend on `start`.
    `lengths` (one per sequence, or per head in (B, H) order, each in [start, length]): a head reads
    rows [start, its length) and its scores are -inf from there (sequences that end apart)."""
    b, h, r, d = rows.shape
    c = k.shape[2]
    columns = c - start if columns is None else columns
    if (not k.is_contiguous() or k.dtype != torch.bfloat16 or rows.dtype != torch.bfloat16 or k.shape[:2] != (b, h)
            or k.shape[3] != d or not 0 <= start <= length <= start + columns <= c or not _widths_ok(d) or not _on_cpu(rows, k)):
        raise ValueError(f"few_query_scores: CPU bf16 rows {rows.dtype} {tuple(rows.shape)} against a contiguous bf16 buffer, "
                         f"got {k.dtype} {tuple(k.shape)} with length {length} from row {start} and {columns} columns")
    # the kernel counts from the buffer's row `start`
    heads = _head_lengths(None if lengths is None else [n - start for n in lengths], b, h, 0, length - start, "few_query_scores")
    rows = rows.contiguous()
    scores = torch.empty(b, h, r, columns, dtype=torch.float32)
    # the buffer from row `start` on: each head's rows still `c` apart
    _on_torch_threads().kvforge_qk(rows.data_ptr(), k.data_ptr() + start * d * k.element_size(), scores.data_ptr(), b * h,
                                   r, c, length - start, columns, d, scale, None if heads is None else heads.data_ptr())
    return scores


def few_query_softmax(scores: torch.Tensor, length: int, tokens: int = 1, lengths: Sequence[int] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (B, H, R, C) fp32 -> the softmax's weights, unnormalized (B, H, R, W) bf16 with W = C
    rounded up to even, and each row's normalizer (B, H, R) fp32 (the inverse of its weights' sum),
    for `few_query_values`. Row r is token r % `tokens` of a step whose last token is row length - 1:
    it sees the first length - (tokens - 1 - r % tokens) keys (the causal triangle among the step's
    own rows); its weights are zero from there on (up to `length`; past it they are not written).
    `lengths` (one per sequence, or per head in (B, H) order, each at most `length`): each head's own
    `length`."""
    b, h, r, c = scores.shape
    if (scores.dtype != torch.float32 or not scores.is_contiguous() or not 0 <= length <= c or not 1 <= tokens <= max(r, 1)
            or r % tokens or not _on_cpu(scores)):
        raise ValueError(f"few_query_softmax: contiguous CPU fp32 scores, got {scores.dtype} {tuple(scores.shape)} "
                         f"with length {length} and {tokens} tokens")
    heads = _head_lengths(lengths, b, h, 0, length, "few_query_softmax")
    weights = torch.empty(b, h, r, (c + 1) // 2 * 2, dtype=torch.bfloat16)
    inverse = torch.empty(b, h, r, dtype=torch.float32)
    _on_torch_threads().kvforge_softmax(scores.data_ptr(), weights.data_ptr(), inverse.data_ptr(), b * h, r, c,
                                        weights.shape[-1], length, tokens, None if heads is None else heads.data_ptr())
    return weights, inverse


def few_query_values(weights: torch.Tensor, inverse: torch.Tensor, v: torch.Tensor, length: int, start: int = 0,
                     sums: torch.Tensor | None = None, finish: bool = True, lengths: Sequence[int] | None = None) -> torch.Tensor:
    """`few_query_softmax`'s weights (B, H, R, W) and normalizers (B, H, R) over rows [start, length)
    of a bf16 buffer v (B, H, C, D) -> (B, H, R, D) fp32; weights column j is key start + j.

    In parts: `finish=False` returns the raw sums of the part (not normalized); a later part passes
    them as `sums` (written in place and returned) and starts where the last one ended, at a key
    that is a multiple of `value_part_step(D)`. A row's sums are then the same additions, in the
    same order, as one pass from key 0. `lengths` (one per sequence, or per head in (B, H) order,
    each in [start, length]): each head's own `length`."""
    b, h, r, w = weights.shape
    c, d = v.shape[2], v.shape[-1]
    if (not v.is_contiguous() or v.dtype != torch.bfloat16 or weights.dtype != torch.bfloat16 or v.shape[:2] != (b, h)
            or w % 2 or w < length - start or not 0 <= start <= length <= c or start % value_part_step(d)
            or inverse.shape != (b, h, r)
            or inverse.dtype != torch.float32 or not _widths_ok(d)
            or (sums is not None and (sums.shape != (b, h, r, d) or sums.dtype != torch.float32 or not sums.is_contiguous()))
            or not _on_cpu(weights, inverse, v, sums)):
        raise ValueError(f"few_query_values: CPU bf16 weights {weights.dtype} {tuple(weights.shape)} over a contiguous bf16 "
                         f"buffer, got {v.dtype} {tuple(v.shape)} with length {length} from row {start} "
                         f"(a multiple of {value_part_step(d)})")
    heads = _head_lengths(lengths, b, h, start, length, "few_query_values")
    weights, inverse = weights.contiguous(), inverse.contiguous()
    out = torch.empty(b, h, r, d, dtype=torch.float32) if sums is None else sums
    _on_torch_threads().kvforge_pv(weights.data_ptr(), inverse.data_ptr(), v.data_ptr(), out.data_ptr(), b * h, r, w, c,
                                   start, length, d, int(sums is not None), int(finish),
                                   None if heads is None else heads.data_ptr())
    return out


def value_part_step(dim: int) -> int:
    """Where a value pass of heads of width `dim` may be split into parts: every 2 keys (AVX-512
    sums key pairs in order), every 32 on AMX (a tile sums 32 keys at once, in an order of its own)."""
    return 32 if _tiles(dim) else 2


def few_query_attention(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, scale: float,
                        tokens: int = 1, lengths: Sequence[int] | None = None) -> torch.Tensor:
    """bf16 query rows (B, H, R, D) over rows [0, length) of bf16 buffers k, v (B, H, C, D) ->
    (B, H, R, D) fp32: `few_query_scores`, `few_query_softmax(..., tokens)` and
    `few_query_values` in one call, a few rows at a time so their scores stay in cache between
    the passes (a long prefill's scores otherwise go through memory three times); the same bits.
    `lengths` (B,): sequence b's rows are [0, lengths[b]), its step's last token at row
    lengths[b] - 1 (`length` their largest); each row has the bits of a call over its sequence
    alone with its own length."""
    b, h, r, d = rows.shape
    c = k.shape[2]
    ragged = None if lengths is None else torch.tensor(list(lengths), dtype=torch.long)
    if (not k.is_contiguous() or not v.is_contiguous() or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16
            or rows.dtype != torch.bfloat16 or k.shape != v.shape or k.shape[:2] != (b, h) or k.shape[3] != d
            or not 0 < length <= c or not 1 <= tokens <= max(r, 1) or r % tokens or not _widths_ok(d) or not _on_cpu(rows, k, v)
            or ragged is not None and (ragged.numel() != b or int(ragged.max()) != length or int(ragged.min()) < tokens)):
        raise ValueError(f"few_query_attention: CPU bf16 rows {rows.dtype} {tuple(rows.shape)} in steps of {tokens} tokens over "
                         f"contiguous bf16 buffers, got {k.dtype} {tuple(k.shape)} / {v.dtype} {tuple(v.shape)} "
                         f"with length {length}" + ("" if ragged is None else f" and lengths {ragged.tolist()}"))
    rows = rows.contiguous()
    out = torch.empty(b, h, r, d, dtype=torch.float32)
    if _on_torch_threads().kvforge_attend(rows.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), b * h, r, c, length,
                                          d, scale, tokens, None if ragged is None else ragged.data_ptr(), h) != 0:
        raise MemoryError(f"few_query_attention: no memory for the scores of {length} keys")
    return out


# Up to this many tokens per sequence a bf16 step's linears run `small_linear` (decode and
# verification, at any batch size); longer steps (prefill) stay with oneDNN, which reaches this
# CPU's multiply peak there.
SMALL_ROWS = 32
# On AMX tiles `small_linear` keeps pace with oneDNN well past a verification's rows, so a step of
# up to this many tokens per sequence (a short prompt, a server's prefill chunk) runs it too.
# `benchmarks/small_linear.py` over smollm2-135m's 121 bf16 weights, Intel Xeon with AMX, ms per
# row, F.linear (what a prefill runs) / small_linear (small-linear-amx-1t.json, -2t.json): 1 thread,
# 64 rows 0.67 / 0.42, 144 0.38 / 0.31, 256 0.26 / 0.24, 512 0.21 / 0.23, 1024 0.17 / 0.21;
# 2 threads, 144 0.22 / 0.20, 256 0.18 / 0.16, 512 0.12 / 0.14.
AMX_SMALL_ROWS = 256


def small_rows(in_features: int) -> int:
    """How many tokens per sequence a bf16 step may have for its linears over a weight of
    `in_features` inputs to run `small_linear`: AMX_SMALL_ROWS where that weight multiplies on
    AMX tiles, SMALL_ROWS elsewhere (with AVX-512 alone its cost grows with the rows: 32 rows
    cost 4.7x one). The same for every step of a width, so a decode step and a verification
    round alike."""
    return AMX_SMALL_ROWS if _tiles(in_features) else SMALL_ROWS


def small_linear_fits(weight: torch.Tensor) -> bool:
    """Whether `small_linear` can run this weight here: bf16 (N, K) with N % 16 == 0 and K even."""
    return (weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0
            and weight.device.type == "cpu" and _library() is not None)


def pack_pairs(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 weight (N, K) packed for `small_linear`: (N / 16, K / 2, 16, 2), each input pair's
    weights for 16 outputs in one 64-byte row; None where `small_linear_fits` is False."""
    if not small_linear_fits(weight):
        return None
    weight = weight.contiguous()
    n, k = weight.shape
    packed = torch.empty(n // 16, k // 2, 16, 2, dtype=torch.bfloat16)
    _library().kvforge_pack_pairs(weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def unpack_pairs(packed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A `pack_pairs` weight back to (N, K) bf16, bit for bit, into `out` where given (contiguous)."""
    blocks, pairs = packed.shape[:2]
    n, k = blocks * 16, pairs * 2
    if out is None:
        out = torch.empty(n, k, dtype=torch.bfloat16)
    if (packed.dtype != torch.bfloat16 or packed.shape[2:] != (16, 2) or not packed.is_contiguous() or out.shape != (n, k)
            or out.dtype != torch.bfloat16 or not out.is_contiguous() or not _on_cpu(packed, out)):
        raise ValueError(f"unpack_pairs: a contiguous bf16 (N / 16, K / 2, 16, 2) weight into ({n}, {k}) bf16")
    _on_torch_threads().kvforge_unpack_pairs(packed.data_ptr(), out.data_ptr(), n, k)
    return out


def small_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) bf16 times a `pack_pairs` weight, plus bias (N) -> (M, N) bf16, each output summed
    in fp32 over the input pairs in order and rounded once: a row's bits do not depend on M."""
    blocks, pairs = packed.shape[:2]
    n, k = blocks * 16, pairs * 2
    if (x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or packed.dtype != torch.bfloat16
            or packed.shape[2:] != (16, 2) or not packed.is_contiguous() or x.device.type != "cpu" or packed.device.type != "cpu"
            or (bias is not None and (bias.shape != (n,) or bias.dtype != torch.bfloat16 or bias.device.type != "cpu"))):
        raise ValueError(f"small_linear: bf16 rows (M, {k}) and a bias ({n},), got {x.dtype} {tuple(x.shape)}"
                         f"{'' if bias is None else f' and {bias.dtype} {tuple(bias.shape)}'}")
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    _on_torch_threads().kvforge_small_linear(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                                             out.data_ptr(), x.shape[0], n, k)
    return out


def rms_norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` can run here: contiguous bf16 rows on CPU whose width (a multiple of 16)
    is the weight's, nothing to backpropagate through."""
    return (x.dtype == weight.dtype == torch.bfloat16 and x.is_contiguous() and x.device.type == weight.device.type == "cpu"
            and weight.shape == x.shape[-1:] and x.shape[-1] > 0 and x.shape[-1] % 16 == 0 and _library() is not None
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus: bool) -> torch.Tensor:
    """RMSNorm of bf16 rows (..., D) in one call: Llama's `w * bf16(normed)` or, with `one_plus`,
    Gemma's `bf16(normed * (1 + w))`, normalising in fp32; a row's bits depend only on the row."""
    if not rms_norm_fits(x, weight):
        raise ValueError(f"kernels.rms_norm: contiguous bf16 rows of a width that is a multiple of 16 and the weight's, "
                         f"got {x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
    weight = weight.contiguous()
    out = torch.empty_like(x)
    _on_torch_threads().kvforge_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1],
                                         x.shape[-1], eps, int(one_plus))
    return out


def silu_mul_fits(gate_up: torch.Tensor) -> bool:
    """Whether `silu_mul` can run on these rows in this process: contiguous CPU bf16 rows whose
    halves are multiples of 16 wide, nothing to backpropagate through."""
    return (gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous() and gate_up.device.type == "cpu"
            and gate_up.dim() >= 1 and gate_up.shape[-1] % 32 == 0 and gate_up.shape[-1] > 0 and _library() is not None
            and not (torch.is_grad_enabled() and gate_up.requires_grad))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """A gated MLP's `silu(gate) * up` from the fused projection's output (..., 2F) bf16, the gate
    first -> (..., F) bf16, in one pass, rounded as torch's two bf16 ops round (silu_mul.c)."""
    if not silu_mul_fits(gate_up):
        raise ValueError(f"kernels.silu_mul: contiguous CPU bf16 rows of a width that is a multiple of 32, "
                         f"got {gate_up.dtype} {tuple(gate_up.shape)}")
    width = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], width, dtype=torch.bfloat16)
    _on_torch_threads().kvforge_silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // gate_up.shape[-1], width)
    return out

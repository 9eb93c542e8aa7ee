"""Rows in and out of vLLM's paged KV cache, for kvforge's model classes and connector.

Shapes: N rows, H KV heads, D head dim, bs block size.

Writing goes through the attention backend's own cache update (`impl.do_kv_cache_update`), so
it follows whatever layout the backend keeps (the CPU backend's prepacked tiles included).
Reading has no backend API, so it is by layout. vLLM's CPU backend keeps, per block and KV
head, bs·D keys followed by bs·D values (its `cpu_attn_reshape_and_cache` for each kernel ISA):
  - "vec" and "vec16": keys as [D, bs] (transposed), values as [bs, D];
  - "amx" (bf16 on an AMX CPU): keys as [bs/16, D/2, 16, 2], each 16 rows' keys in pairs of head
    dims (the B tiles of Q·Kᵀ); values as [D/16, bs/2, 16, 2], each 16 head dims' values in pairs
    of rows (the B tiles of P·V).
Any other layout (GPU backends) is refused with `UnreadableLayout`.
"""

from __future__ import annotations

import torch

from kvforge.errors import KvforgeError

READABLE = ("vec", "vec16", "amx")
AMX_ROWS, PAIR = 16, 2  # an AMX B tile's 16 rows of 32 bf16: 16 keys × 16 head-dim pairs, or 16 head dims × 16 row pairs


class UnreadableLayout(KvforgeError):
    """The cache's layout is not one kvforge can read rows from."""


def attention_context(layer_name: str):
    """(metadata, attention layer, its cache, this step's slots) of one attention layer, for the
    forward being run (the slots are None during vLLM's dummy runs)."""
    from vllm.model_executor.layers.attention.attention import get_attention_context

    return get_attention_context(layer_name)


def write_rows(layer_name: str, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None = None) -> None:
    """K and V rows (N, H·D) into `slots` (default: this step's slots for every row) through the
    backend's own cache update."""
    _, layer, kv_cache, step_slots = attention_context(layer_name)
    write_into(layer, kv_cache, k, v, step_slots if slots is None else slots)


def write_into(layer, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None) -> None:
    """K and V rows (N, H·D or N, H, D) into `slots` of vLLM attention layer `layer`'s cache."""
    if slots is None or k.shape[0] == 0:
        return
    n, heads, d = k.shape[0], layer.num_kv_heads, layer.head_size
    layer.impl.do_kv_cache_update(layer, k.reshape(n, heads, d).contiguous(), v.reshape(n, heads, d).contiguous(), kv_cache, slots)


def block_size(layer_name: str) -> int:
    """Rows per block as attention layer `layer_name`'s cache is laid out (the block table's unit)."""
    _, _, kv_cache, _ = attention_context(layer_name)
    return kv_cache.shape[2]


def slots_of(block_row: torch.Tensor, positions: torch.Tensor, bs: int) -> torch.Tensor:
    """The cache slots (block · bs + offset) of a request's rows at `positions`, from its row of
    the block table."""
    return block_row[positions // bs].long() * bs + positions % bs


def layout_of(layer) -> str:
    """The CPU kernel layout an attention layer's cache is kept in ("vec", "amx", ...), or the
    backend's name where it is not vLLM's CPU backend."""
    return getattr(layer, "isa", None) or type(layer.impl).__name__


def unreadable(kv_cache: torch.Tensor, layout: str) -> str | None:
    """Why rows cannot be read out of a cache of this layout and dtype, or None."""
    if layout not in READABLE:
        return f"vLLM's {layout!r} cache layout is not readable by kvforge (it reads the CPU backend's {', '.join(READABLE)} layouts)"
    if kv_cache.dtype not in (torch.float32, torch.bfloat16, torch.float16) or (layout == "amx" and kv_cache.element_size() != 2):
        return f"vLLM's {layout!r} cache in {kv_cache.dtype} is not readable by kvforge (a quantized cache keeps other groups and scales)"
    bs, d = kv_cache.shape[2], kv_cache.shape[3] // 2
    if layout == "amx" and (bs % AMX_ROWS or d % AMX_ROWS):
        return (f"vLLM's amx cache layout with block size {bs} and head size {d} is not readable by kvforge "
                f"(it reads blocks and heads of multiples of {AMX_ROWS})")
    return None


def read_rows(kv_cache: torch.Tensor, slots: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V rows (N, H, D) held in `slots` (block · bs + offset) of one layer's cache
    (blocks, H, bs, 2·D)."""
    reason = unreadable(kv_cache, layout)
    if reason is not None:
        raise UnreadableLayout(reason)
    blocks, heads, bs, width = kv_cache.shape
    block, offset = slots // bs, slots % bs
    d = width // 2
    if layout == "amx":
        region = kv_cache.view(blocks, heads, 2 * bs * d)  # one block's and head's keys, then its values
        dims, o = torch.arange(d, device=slots.device), offset.view(-1, 1)
        key_at = (o // AMX_ROWS) * AMX_ROWS * d + (dims // PAIR) * AMX_ROWS * PAIR + (o % AMX_ROWS) * PAIR + dims % PAIR
        value_at = bs * d + (dims // AMX_ROWS) * bs * AMX_ROWS + (o // PAIR) * AMX_ROWS * PAIR + (dims % AMX_ROWS) * PAIR + o % PAIR
        rows, per_head = block.view(-1, 1, 1), torch.arange(heads, device=slots.device).view(1, -1, 1)
        return region[rows, per_head, key_at.unsqueeze(1)], region[rows, per_head, value_at.unsqueeze(1)]
    halves = kv_cache.view(blocks, heads, 2, bs * d)
    keys = halves[:, :, 0].view(blocks, heads, d, bs)[block, :, :, offset]
    values = halves[:, :, 1].view(blocks, heads, bs, d)[block, :, offset, :]
    return keys, values


def attend(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One request's queries over the rows it sees. `attn`: vLLM's attention module (heads,
    scaling); q (n, Hq·D), k and v (m, H·D) or (m, H, D); `mask` from `visible_mask` -> (n, Hq·D)."""
    d, hq, h = attn.head_dim, attn.num_heads, attn.num_kv_heads
    n, m = q.shape[0], k.shape[0]
    qr = q.reshape(1, n, hq, d).transpose(1, 2)
    kr = k.reshape(1, m, h, d).transpose(1, 2)
    vr = v.reshape(1, m, h, d).transpose(1, 2)
    o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=attn.scaling, enable_gqa=hq != h)
    return o.transpose(1, 2).reshape(n, hq * d)


def visible_mask(attn, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
    """Which of the rows at `k_pos` each query at `q_pos` sees on `attn`'s layer: causal by position,
    windowed on a sliding layer; None where every query sees every row (a decode step's one row)."""
    from kvforge.attention import visibility_mask

    mask = visibility_mask(q_pos.view(1, -1), k_pos.view(1, -1), window(attn))
    return None if bool(mask.all()) else mask


def window(attn) -> int | None:
    """The sliding window of vLLM's attention module `attn`, or None (global attention)."""
    size = getattr(attn.attn.impl, "sliding_window", -1)
    return None if size is None or size < 0 else size

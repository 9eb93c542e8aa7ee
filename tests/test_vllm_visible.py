"""A SPEED request's visible rows above the cut, kept beside vLLM's cache (`kvforge.vllm.visible`):
growing keeps the rows held, a step's queries attend over the rows before them and causally among
their own (few rows through kvforge's few-query attention, many through SDPA), and the store keeps
the most recently used requests' rows."""

from __future__ import annotations

import pytest
import torch

from kvforge.vllm.visible import FEW_QUERIES, VisibleRows, VisibleRowsStore

HEADS, QUERY_HEADS, DIM = 2, 6, 32


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """q (n, Hq, D) the last n of k, v's (m, H, D) rows, causal, in float64 -> (n, Hq·D)."""
    n, m, group = q.shape[0], k.shape[0], QUERY_HEADS // HEADS
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,mhd->hnm", q.double(), kk) * scaling
    hidden = torch.ones(n, m, dtype=torch.bool).tril_(m - n).logical_not_()
    weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hnm,mhd->nhd", weights, vv).reshape(n, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new", [1, 5, FEW_QUERIES + 8])
def test_a_steps_rows_attend_over_the_rows_before_them_and_causally_among_their_own(dtype, new):
    g = torch.Generator().manual_seed(new)
    before = 70
    k, v = (torch.randn(before + new, HEADS, DIM, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(new, QUERY_HEADS, DIM, generator=g).to(dtype)
    rows = VisibleRows(layers=2, heads=HEADS, dim=DIM, dtype=dtype, device=torch.device("cpu"), capacity=16)
    rows.reserve(before)
    rows.put(1, k[:before], v[:before], 0)
    rows.filled = before
    rows.reserve(before + new)  # grows past the rows held, keeping them
    rows.put(1, k[before:], v[before:], before)
    out = rows.attend(1, q, before + new, 0.2)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out.double() - reference(q, k, v, 0.2)).abs().max() < tol


def test_growing_keeps_the_rows_held_in_every_layer():
    rows = VisibleRows(layers=3, heads=HEADS, dim=DIM, dtype=torch.float32, device=torch.device("cpu"), capacity=4)
    held = torch.randn(3, HEADS, DIM)
    for layer in range(3):
        rows.put(layer, held + layer, -held, 0)
    rows.filled = 3
    rows.reserve(5)
    assert rows.capacity == 8  # at least doubles
    for layer in range(3):
        assert torch.equal(rows.keys[layer][0, :, :3], (held + layer).transpose(0, 1))
        assert torch.equal(rows.values[layer][0, :, :3], (-held).transpose(0, 1))


def test_the_store_keeps_the_most_recently_used_and_drops_a_block_on_request():
    store = VisibleRowsStore(capacity=2)
    made = [VisibleRows(1, HEADS, DIM, torch.float32, torch.device("cpu"), 1) for _ in range(3)]
    store.put(10, made[0])
    store.put(20, made[1])
    assert store.get(10) is made[0]  # a use makes 10 the most recent
    store.put(30, made[2])
    assert store.get(20) is None and store.get(10) is made[0] and store.get(30) is made[2]
    store.drop(30)
    assert store.get(30) is None

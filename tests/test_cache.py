"""KVCache: append, trim, row and batch selection, memory accounting, save and load."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.cache import KVCache, LayerCache, RowKind
from kvforge.errors import ArtifactError

H, D = 2, 4


def _rows(batch, start, n):
    k = torch.randn(batch, H, n, D)
    v = torch.randn(batch, H, n, D)
    pos = torch.arange(start, start + n).expand(batch, n)
    return k, v, pos


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    trim=st.integers(0, 20),
    capacity=st.integers(1, 8),
)
def test_append_then_trim_keeps_a_prefix(chunks, trim, capacity):
    cache = KVCache.empty(3, 2, H, D, capacity=capacity)
    ks, vs, start = [], [], 0
    for n in chunks:
        k, v, pos = _rows(2, start, n)
        for layer in cache.layers:
            layer.append(k, v, pos)
        ks.append(k)
        vs.append(v)
        start += n
    total = sum(chunks)
    trim = min(trim, total)
    cache.trim(trim)
    keep = total - trim
    expect_k = torch.cat(ks, dim=2)[:, :, :keep]
    for layer in cache.layers:
        assert layer.length == keep
        assert torch.equal(layer.keys(), expect_k)
        assert torch.equal(layer.values(), torch.cat(vs, dim=2)[:, :, :keep])
        assert torch.equal(layer.row_positions()[0], torch.arange(keep))
        assert layer.contiguous
    assert cache.nbytes == 3 * 2 * 2 * H * D * keep * 4
    assert cache.next_positions().tolist() == [keep, keep]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 20), data=st.data())
def test_select_rows_picks_those_rows(n, data):
    index = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    cache = KVCache.empty(2, 1, H, D)
    k, v, pos = _rows(1, 0, n)
    for layer in cache.layers:
        layer.append(k, v, pos)
    picked = cache.select_rows(torch.tensor(index))
    for layer in picked.layers:
        assert torch.equal(layer.keys(), k[:, :, index])
        assert layer.row_positions()[0].tolist() == index
        assert layer.contiguous == (index == list(range(len(index))))


def test_trim_too_much_is_an_error():
    cache = KVCache.empty(1, 1, H, D)
    cache[0].append(*_rows(1, 0, 3))
    with pytest.raises(ValueError):
        cache.trim(4)


def test_non_contiguous_positions_clear_the_fast_path_flag():
    cache = KVCache.empty(1, 1, H, D)
    k, v, _ = _rows(1, 0, 3)
    cache[0].append(k, v, torch.tensor([[0, 2, 5]]))
    assert not cache[0].contiguous
    assert cache.next_positions().tolist() == [6]


def test_a_rollback_to_different_ends_keeps_each_sequence_aligned_and_equal_ends_restore_contiguity():
    """Sequences rolled back by different amounts stay contiguous each (`aligned`, read to their own
    ends); a verification whose padding slots sit inside a sequence is not aligned until its rollback
    drops them; once the ends meet again the layer is contiguous."""
    layer = KVCache.empty(1, 2, H, D)[0]
    layer.append(*_rows(2, 0, 5))
    layer.rollback([0, 2])
    assert (layer.ends, layer.aligned, layer.contiguous) == ([5, 3], True, False)
    k, v, _ = _rows(2, 0, 3)
    layer.append(k, v, torch.tensor([[5, 6, 7], [3, -1, -1]]))  # one real row and two padding slots for sequence 1
    assert not layer.aligned
    layer.rollback([0, 2])
    assert (layer.ends, layer.aligned) == ([8, 4], True)
    layer.append(*_rows(2, 0, 1)[:2], torch.tensor([[8], [4]]))
    assert layer.aligned
    layer.rollback([4, 0])
    assert (layer.ends, layer.aligned, layer.contiguous) == (None, True, True)


def test_a_padded_append_after_a_trim_is_not_taken_for_aligned_rows():
    """A layer trimmed while contiguous, then continued with left-padded rows (padding slots
    inside a sequence), is not aligned, and a rollback to different ends does not make it so."""
    layer = KVCache.empty(1, 2, H, D)[0]
    layer.append(*_rows(2, 0, 4))
    layer.trim(1)
    k, v, _ = _rows(2, 0, 3)
    layer.append(k, v, torch.tensor([[3, 4, 5], [-1, 3, 4]]))
    assert not layer.contiguous and not layer.aligned
    layer.rollback([1, 0])
    assert layer.ends == [5, 6] and not layer.aligned and not layer.contiguous


def test_provenance_is_kept_per_row():
    cache = KVCache.empty(1, 1, H, D)
    cache[0].append(*_rows(1, 0, 2), kind=RowKind.EXACT)
    cache[0].append(*_rows(1, 2, 2), kind=RowKind.FILLED)
    assert cache[0].row_kinds()[0].tolist() == [0, 0, 1, 1]


def test_save_load_round_trip(tmp_path):
    cache = KVCache.empty(2, 1, H, D)
    for layer in cache.layers:
        layer.append(*_rows(1, 0, 5))
    path = tmp_path / "c.safetensors"
    cache.save(path, {"model": "tiny"})
    loaded, meta = KVCache.load(path)
    assert meta["model"] == "tiny"
    for a, b in zip(cache.layers, loaded.layers):
        assert torch.equal(a.keys(), b.keys())
        assert torch.equal(a.row_positions(), b.row_positions())
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temp file left


def test_corrupt_cache_file_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ArtifactError, match="cannot read"):
        KVCache.load(path)


def test_latent_caches_join_a_batch():
    """An MLA layer's values (the latent, 12 wide) are wider than its keys (the rope key, 8)."""
    from conftest import tiny_loaded
    from kvforge.engine import Engine

    engine = Engine(tiny_loaded("deepseek_v3"))
    (la, ca), (lb, cb) = engine.prefill([[5, 6, 7]]), engine.prefill([[8, 9]])
    batch = KVCache.concat_batch([ca, cb])
    assert batch[0].values().shape == (2, 1, 3, 12)
    step = engine.decode_step(torch.tensor([4, 4]), batch)
    assert (step[1] - engine.decode_step(torch.tensor([4]), cb)[0]).abs().max() < 1e-4


def test_copies_of_one_sequence_share_their_rows_until_a_write_differs():
    """`shared` (rows the same in every sequence, which attention may read once) follows what a
    batch of one prompt's samples does: appends keep it, trims and per-sequence rollbacks cut it."""
    layer = LayerCache.empty(1, 2, 8, torch.float32, "cpu", capacity=32)
    layer.append(torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8), torch.arange(20).view(1, -1))
    assert layer.shared == 0
    samples = layer.select_batch(torch.zeros(4, dtype=torch.long))
    assert samples.shared == 20
    samples.append(torch.randn(4, 2, 3, 8), torch.randn(4, 2, 3, 8), torch.arange(20, 23).expand(4, 3))
    assert samples.shared == 20
    assert samples.select_batch(torch.tensor([2, 0])).shared == 20  # any of them: still the same rows
    samples.trim(5)
    assert samples.shared == 18
    samples.rollback([0, 2, 0, 1])  # sequence 1 pads rows 16-17: they are no longer the same everywhere
    assert samples.shared == 16
    mixed = KVCache([layer]).concat_batch([KVCache([layer]), KVCache([layer])])[0]
    assert mixed.shared == 0 and mixed.select_batch(torch.tensor([0, 1])).shared == 0  # not known to be copies


def test_sequences_that_roll_back_apart_keep_their_rows_packed():
    """Rollback by different amounts, then appends: each sequence's next rows go at its own end,
    so its real rows sit at the buffer rows a lockstep batch would give them (no padding slot
    between them), and the rows past a shorter sequence's end are padding."""
    cache = KVCache.empty(1, batch=3, kv_heads=1, head_dim=2)
    for step in range(4):
        cache[0].append(torch.full((3, 1, 1, 2), float(step)), torch.zeros(3, 1, 1, 2), torch.full((3, 1), step))
    cache.rollback([0, 2, 1])  # lengths 4, 2, 3
    assert cache[0].ends == [4, 2, 3] and cache[0].length == 4
    cache[0].append(torch.ones(3, 1, 3, 2), torch.ones(3, 1, 3, 2), torch.tensor([[4, 5, 6], [2, 3, 4], [3, 4, 5]]))
    positions = cache[0].row_positions()
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert positions[1].tolist() == [0, 1, 2, 3, 4, -1, -1]
    assert positions[2].tolist() == [0, 1, 2, 3, 4, 5, -1]
    assert cache.next_positions().tolist() == [7, 5, 6]
    chosen = cache.select_batch(torch.tensor([1, 2]))  # choosing sequences keeps their ends
    assert chosen[0].ends == [5, 6] and chosen[0].length == 7
    alone = cache.select_batch(torch.tensor([1]))
    assert alone[0].ends is None and alone[0].length == 5  # one sequence: its padding is trimmed
    cache.rollback([2, 0, 1])  # every sequence back to 5 rows: one length again
    assert cache[0].ends is None and cache[0].length == 5 and (cache[0].row_positions() == torch.arange(5)).all()
    joined = KVCache.concat_batch([chosen, cache])  # a batch joining another keeps every end
    assert joined[0].ends == [5, 6, 5, 5, 5]


class _CopiedBytes:
    """Counts the bytes the tensor copies inside a `with` block write (copies, gathers,
    concatenations, clones): what joining or leaving a batch costs in memory traffic."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        aten = torch.ops.aten
        copies = {aten.copy_, aten.index_put_, aten.cat, aten.index_select, aten.clone, aten._to_copy, aten.index_copy_, aten.stack,
                  aten.slice_scatter}
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.overloadpacket in copies and isinstance(out, torch.Tensor):
                    counter.bytes += out.numel() * out.element_size()
                return out

        self.bytes, self.mode = 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _resident_bytes(tensors: list[torch.Tensor]) -> int:
    """The memory the OS backs of the mappings that hold `tensors` (their `Rss` in
    /proc/self/smaps; the kernel merges neighbouring mappings of one kind, so all of a cache's
    buffers are counted together)."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = any(start < stop and first < end for first, stop in spans)
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the mappings' memory from Linux's /proc")
def test_an_allocated_batch_takes_memory_for_its_rows_and_gives_a_leaving_sequences_back():
    """A batch allocated once for 4 sequences of 8192 rows takes no memory for its keys and values
    until rows are written, then about their pages; a leaving sequence's pages go back (they read
    zeros again), the sequence moved into its slot keeps its rows and nothing past them, and an
    empty batch holds nothing."""
    page = 4096
    buffers = 4  # keys and values of 2 layers, alike
    pages = lambda rows: buffers * H * -(-rows * D * 4 // page) * page  # noqa: E731 (one sequence's pages of float32 rows)
    batch = KVCache.empty(2, 1, H, D, capacity=1)
    batch.leave(0)
    batch.allocate(4, 8192)
    held = [t for layer in batch.layers for t in layer.rows.held]
    assert len(held) == buffers and held[0].shape == (4, H, 8192, D)
    # what the mappings hold besides these rows: none of theirs yet (a neighbouring mapping of
    # the same kind, which the kernel may have merged with them, may hold some)
    before = _resident_bytes(held)
    short, long = _sequence(1000, 0, layers=2), _sequence(3000, 1, layers=2)
    batch.join(long)
    batch.join(short)
    slack = buffers * 2 * page  # a page a slot shares with its neighbour, per buffer
    assert pages(1000) + pages(3000) <= _resident_bytes(held) - before <= pages(1000) + pages(3000) + slack
    batch.leave(0)  # the short sequence moves into slot 0: slot 1's pages go back, and slot 0's past its rows
    assert pages(1000) <= _resident_bytes(held) - before <= pages(1000) + slack
    keys = held[0]
    assert torch.equal(keys[0, :, :1000], short[0].keys()[0]) and not keys[0, :, 1000:].any() and not keys[1:].any()
    batch.leave(0)
    assert _resident_bytes(held) - before <= slack and not any(t.any() for t in held)
    with pytest.raises(ValueError, match="allocated anew"):
        long.allocate(2, 10)


def test_a_layer_whose_keys_fail_to_grow_keeps_the_capacity_it_had(monkeypatch):
    """Growing a layer's buffers grows the keys and values before the row log: should they fail
    (out of memory), the layer's buffers still agree (`KVCache.intact`) and it holds what it held."""
    import kvforge.rows as rows

    cache = _sequence(8, 0, layers=1)
    grow = rows._grow

    def keys_fail(t, capacity, dim, fill):
        if dim == 2:  # keys and values: (B, H, rows, D)
            raise MemoryError("no room")
        return grow(t, capacity, dim, fill)

    monkeypatch.setattr(rows, "_grow", keys_fail)
    with pytest.raises(MemoryError):
        cache[0].append(*_rows(1, 8, 4))
    assert cache.intact() and cache[0].capacity == 8 and cache[0].length == 8
    monkeypatch.setattr(rows, "_grow", grow)
    cache[0].append(*_rows(1, 8, 4))
    assert cache.intact() and cache[0].length == 12


def _sequence(length, seed, layers=3, capacity=None):
    torch.manual_seed(seed)
    cache = KVCache.empty(layers, 1, H, D, capacity=capacity or length)
    for layer in cache.layers:
        layer.append(*_rows(1, 0, length))
    return cache


def _row_bytes(cache):
    """Bytes of one sequence's rows: keys, values, positions, kinds."""
    layer = cache[0]
    return len(cache) * layer.length * (2 * H * D * layer.k.element_size() + 8 + 1)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=2, max_size=7), leaving=st.data(), allocated=st.booleans())
def test_joining_and_leaving_a_batch_copies_only_that_sequences_rows(lengths, leaving, allocated):
    """`join` writes the joining sequence's rows into a free slot and `leave` moves the last
    sequence into the leaving one's slot: each copies one sequence's rows, never the batch's
    (in buffers with room for its rows: they grow geometrically, as a decode step's rows do, or
    were allocated once for the batch, as a server's are), and every sequence keeps exactly its
    rows (as `concat_batch` and `select_batch` give them)."""
    sequences = [_sequence(n, seed) for seed, n in enumerate(lengths)]
    if allocated:
        batch = KVCache.empty(3, 1, H, D, capacity=1)
        batch.leave(0)
        batch.allocate(len(lengths), max(lengths))
        batch.join(sequences[0])
    else:
        batch = _sequence(lengths[0], 0, capacity=max(lengths))
        batch.reserve_slots(len(lengths))
    for seq in sequences[1:]:
        with _CopiedBytes() as copied:
            batch.join(seq)
        assert copied.bytes <= _row_bytes(seq) * 1.01
    order = list(range(len(lengths)))
    while len(order) > 1:
        b = leaving.draw(st.integers(0, len(order) - 1))
        moved = sequences[order[-1]]
        with _CopiedBytes() as copied:
            batch.leave(b)
        assert copied.bytes <= (_row_bytes(moved) * 1.01 if b != len(order) - 1 else 0)
        order[b] = order[-1]
        order.pop()
        reference = KVCache.concat_batch([sequences[i] for i in order])
        for mine, ref in zip(batch.layers, reference.layers):
            for row, i in enumerate(order):
                n = lengths[i]
                assert torch.equal(mine.row_positions()[row, :n], ref.row_positions()[row, :n])
                assert bool((mine.row_positions()[row, n:] == -1).all())
                assert torch.equal(mine.keys()[row, :, :n], ref.keys()[row, :, :n]) and torch.equal(mine.values()[row, :, :n], ref.values()[row, :, :n])
            assert mine.length == max(lengths[i] for i in order) and (mine.ends is None) == (len({lengths[i] for i in order}) == 1)
        assert batch.nbytes == 3 * 2 * H * D * 4 * sum(lengths[i] for i in order)  # each sequence's rows to its own end, no padding

"""What a cached layer logs of its rows: each row's position and provenance, sequence by
sequence (`RowLog`), in buffers with room for more rows and sequences (`SlotBuffers`).

Shapes: B sequences, C capacity in rows, T rows appended.
"""

from __future__ import annotations

import functools
import math
import mmap
from enum import IntEnum

import torch


class RowKind(IntEnum):
    """Provenance of one cached row."""

    EXACT = 0  # computed by the model's own layer on its exact input
    FILLED = 1  # written by the layer from a predicted input (RidgeFill)
    TRANSLATED = 2  # mapped from another model's cache (KV-Lingo)
    PADDING = 3  # an empty slot that aligns sequences of different lengths in a batch


class SlotBuffers:
    """Tensors laid out (sequence, ..., row, ...), the row at `row_dim`, that share a capacity of
    rows and a number of sequence slots. `views` are their first `batch` sequences, the ones in
    use; the slots past them are room for sequences that join later, so joining writes only the
    joining rows. `fills`: the value a row holds before it is written. `clears`: a slot a
    sequence is written or moved into takes the fills first, as it may hold a sequence that left
    (the log's positions, which masks read; K/V rows past a sequence's end are never read)."""

    def __init__(self, tensors: list[torch.Tensor], row_dim: int, fills: list[int], clears: bool = False):
        self.row_dim, self.fills, self.clears = row_dim, fills, clears
        self.batch = tensors[0].shape[0]
        self._hold(list(tensors))

    def _hold(self, held: list[torch.Tensor], maps: list[mmap.mmap | None] | None = None) -> None:
        """Hold these buffers (`maps`: the memory of those backed on demand) for the batch in use."""
        self.held, self.maps = held, maps or [None] * len(held)
        self.use(self.batch)

    def allocate(self, slots: int, capacity: int, on_demand: bool = True) -> None:
        """Empty buffers for `slots` sequences of `capacity` rows, for a batch that joins and
        leaves without copying. `on_demand` (on CPU): a buffer whose rows start as zeros (keys and
        values) is backed on demand (`backed_on_demand`): it takes memory for the rows written,
        not for its capacity, and a slot's pages go back when its sequence leaves (`leave`);
        otherwise buffers are allocated whole."""
        if self.batch:
            raise ValueError(f"buffers holding {self.batch} sequences cannot be allocated anew")
        held, maps = [], []
        for t, fill in zip(self.held, self.fills):
            shape = [slots, *t.shape[1:]]
            shape[self.row_dim] = capacity
            if fill == 0 and on_demand and backs_on_demand(t.device) and math.prod(shape):
                buffer, memory = backed_on_demand(shape, t.dtype)
            else:
                buffer, memory = torch.full(shape, fill, dtype=t.dtype, device=t.device), None
            held.append(buffer)
            maps.append(memory)
        self._hold(held, maps)

    def _release(self, slot: int) -> None:
        """Slot `slot` holds no sequence: its pages in buffers backed on demand go back to the OS
        (they read as zeros again, as never-written rows do); other buffers keep their memory."""
        for t, memory in zip(self.held, self.maps):
            if memory is None:
                continue
            size = t[slot].numel() * t.element_size()
            start = slot * size  # the buffer starts its mapping
            first, end = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, (start + size) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > first:  # the pages wholly inside the slot (a page it shares with a neighbour stays)
                memory.madvise(mmap.MADV_DONTNEED, first, end - first)

    @property
    def capacity(self) -> int:
        return self.held[0].shape[self.row_dim]

    @property
    def slots(self) -> int:
        return self.held[0].shape[0]

    def use(self, batch: int) -> None:
        """The first `batch` sequences are in use."""
        self.batch = batch
        self.views = [t[:batch] for t in self.held]

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        self._hold([_grow(t, capacity, self.row_dim, fill) for t, fill in zip(self.held, self.fills)])

    def reserve_slots(self, sequences: int) -> None:
        """Room for `sequences` sequences: the ones in use are copied once into larger buffers."""
        if self.slots >= sequences:
            return
        grown = []
        for view, fill in zip(self.views, self.fills):
            out = view.new_full((sequences, *view.shape[1:]), fill)
            out[: self.batch] = view
            grown.append(out)
        self._hold(grown)

    def write_sequences(self, start: int, parts: list[torch.Tensor], rows: int) -> None:
        """Slots start, start+1, ... take the first `rows` rows of `parts`' sequences."""
        n = parts[0].shape[0]
        for t, part, fill in zip(self.held, parts, self.fills):
            slots = t[start : start + n]
            if self.clears:
                slots.fill_(fill)
            slots.narrow(self.row_dim, 0, rows).copy_(part.narrow(self.row_dim, 0, rows))

    def leave(self, b: int, rows: int) -> None:
        """Sequence `b` leaves: the last sequence's first `rows` rows move into its slot (cleared
        first, or its pages released, so nothing of the leaving rows stays), and the last slot is
        released."""
        last = self.batch - 1
        if b != last:
            self._release(b)
            for t, fill in zip(self.held, self.fills):
                if self.clears:
                    t[b].fill_(fill)
                t[b].narrow(self.row_dim - 1, 0, rows).copy_(t[last].narrow(self.row_dim - 1, 0, rows))
        self._release(last)
        self.use(last)

    def write(self, at: int | tuple[int, ...], parts: list[torch.Tensor | int]) -> None:
        """Each sequence's rows of `parts` (tensors, or one value for every row; the first a
        tensor) go from row `at` on, or from its own row at[b]."""
        t = parts[0].shape[self.row_dim]
        for view, part in zip(self.views, parts):
            if isinstance(at, int):
                rows = view.narrow(self.row_dim, at, t)
                rows.fill_(part) if isinstance(part, int) else rows.copy_(part)
                continue
            # one indexed copy into the flat view (the views in use are contiguous: a slot
            # buffer's leading sequences are)
            middle = math.prod(view.shape[1 : self.row_dim])
            tail = view.shape[self.row_dim + 1 :]
            flat = _flat_rows_at_ends(at, t, middle, self.capacity, view.device)
            if isinstance(part, int):
                view.view(-1, *tail).index_fill_(0, flat, part)
            else:
                view.view(-1, *tail).index_copy_(0, flat, part.expand(*view.shape[: self.row_dim], t, *tail).reshape(-1, *tail).to(view.dtype))

    def select(self, dim: int, index: torch.Tensor, rows: int) -> list[torch.Tensor]:
        """New tensors of the first `rows` rows, holding `index` along `dim` (0: sequences)."""
        return [view.narrow(self.row_dim, 0, rows).index_select(dim, index).contiguous() for view in self.views]


class RowLog:
    """Which rows a layer holds, sequence by sequence: each row's token position (-1: a padding
    slot of a shorter sequence) and provenance (`RowKind`), the layer's length, and where each
    sequence's rows end. Attention masks and provenance reports read it; the layer keeps what the
    rows hold beside it (`LayerCache`'s keys and values, `RecurrentLayerCache`'s state)."""

    def __init__(self, positions: torch.Tensor, kinds: torch.Tensor, length: int = 0, contiguous: bool | None = None):
        self.buffers = SlotBuffers([positions, kinds], row_dim=1, fills=[-1, int(RowKind.PADDING)], clears=True)
        self.length = length
        # True while row i holds position i for every sequence: attention then needs no mask
        # for a query that continues the sequence, which keeps decode on the fast path.
        self.contiguous = _is_contiguous(self.positions[:, :length]) if contiguous is None else contiguous
        # Rows [0, shared) are the same in every sequence of the batch (one prompt's rows copied to
        # each of its samples by `select_batch`): attention may read them once for the whole batch.
        self.shared = 0
        # Where each sequence's rows end when they differ (rows [ends[b], length) of sequence b
        # are padding slots, and its next rows go at ends[b]); None: every sequence ends at `length`.
        self.ends: list[int] | None = None
        # With `ends`: True while sequence b's rows [0, ends[b]) hold its positions 0..ends[b]-1 (a
        # batch whose sequences are contiguous but of different lengths: its attention needs no
        # mask either, each sequence read to its own end). Without `ends`: `contiguous`.
        self.aligned = False

    @classmethod
    def empty(cls, batch: int, capacity: int, device) -> "RowLog":
        return cls(torch.full((batch, capacity), -1, dtype=torch.long, device=device),
                   torch.full((batch, capacity), int(RowKind.PADDING), dtype=torch.uint8, device=device))

    @property
    def positions(self) -> torch.Tensor:  # (B, C) int64, -1 = padding
        return self.buffers.views[0]

    @property
    def kinds(self) -> torch.Tensor:  # (B, C) uint8 RowKind
        return self.buffers.views[1]

    def row_positions(self) -> torch.Tensor:
        return self.positions[:, : self.length]

    def row_kinds(self) -> torch.Tensor:
        return self.kinds[:, : self.length]

    def sequence_ends(self) -> list[int]:
        return list(self.ends or [self.length] * self.buffers.batch)

    def capacity_for(self, rows: int) -> int | None:
        """The capacity to grow to for `rows` more rows past `length` (None: there is room).
        Grow by an eighth (at least 256 rows): amortised O(1) per appended row without doubling
        a long prompt's cache on its first decode step."""
        needed, capacity = self.length + rows, self.buffers.capacity
        if needed <= capacity:
            return None
        return max(needed, capacity + max(256, capacity // 8))

    def append(self, positions: torch.Tensor, kind: RowKind | torch.Tensor) -> int | tuple[int, ...]:
        """Log rows at `positions` (B, T) of `kind` (one value or (B, T)) at each sequence's end;
        returns where they went (`SlotBuffers.write`'s `at`). The buffers have room for them."""
        t = positions.shape[1]
        kinds = kind if isinstance(kind, torch.Tensor) else int(kind)
        if self.ends is None:
            start = self.length
            self.buffers.write(start, [positions, kinds])
            if self.contiguous:
                self.contiguous = bool((positions == torch.arange(start, start + t, device=positions.device)).all())
            self.aligned = self.contiguous  # every sequence ends at `length`: aligned is contiguous
            self.length = start + t
            return start
        at = tuple(self.ends)
        self.aligned = self.aligned and bool((positions == _rows_at_ends(at, t, positions.device)).all())
        self.buffers.write(at, [positions, kinds])
        ends = [e + t for e in at]
        self.length = max(ends)
        self.ends = None if min(ends) == max(ends) else ends
        if self.ends is None:
            self.contiguous = self.aligned
        return at

    def join(self, other: "RowLog") -> None:
        """Log `other`'s sequences after this one's, in the next slots (the buffers have room)."""
        b, n = self.buffers.batch, other.buffers.batch
        ends = self.sequence_ends() + other.sequence_ends()
        self.buffers.write_sequences(b, [other.row_positions(), other.row_kinds()], other.length)
        self.buffers.use(b + n)
        self.length = max(ends)
        self.ends = None if min(ends) == max(ends) else ends
        self.shared = 0 if b else other.shared  # another prompt's rows: nothing is the same in every sequence
        self._recheck()

    def leave(self, b: int) -> None:
        """Drop sequence `b`: the last one moves into its slot (`LayerCache.leave`)."""
        last = self.buffers.batch - 1
        ends = self.sequence_ends()
        self.buffers.leave(b, ends[last])
        ends[b] = ends[last]
        ends.pop()
        length = max(ends, default=0)
        if length < self.length:
            self._trim_rows(self.length - length)
        self.ends = None if not ends or min(ends) == max(ends) else ends
        self._recheck()

    def _recheck(self) -> None:
        self.contiguous = _is_contiguous(self.row_positions())
        self.aligned = _is_aligned(self.row_positions(), self.ends)

    def _trim_rows(self, n: int) -> None:
        if n < 0 or n > self.length:
            raise ValueError(f"cannot trim {n} rows from a layer holding {self.length}")
        self.length -= n
        self.shared = min(self.shared, self.length)
        # the dropped rows become padding (rows past them already are: buffers may hold a whole context)
        self.positions[:, self.length : self.length + n] = -1
        self.kinds[:, self.length : self.length + n] = int(RowKind.PADDING)

    def rollback(self, drop: list[int]) -> None:
        """Drop the last drop[b] rows of sequence b (from its own end); the length becomes the
        longest sequence's, and a shorter one's rows past its end are padding slots."""
        ends = [e - n for e, n in zip(self.sequence_ends(), drop)]
        if min(ends) < 0:
            raise ValueError(f"cannot drop {max(drop)} rows from a layer holding {self.length}")
        aligned = self.aligned if self.ends is not None else self.contiguous  # dropping rows from aligned sequences' ends keeps them aligned
        self._trim_rows(self.length - max(ends))
        if min(ends) < self.length:  # the shorter sequences' rows past their ends become padding slots
            past = _rows_past_ends(tuple(ends), self.length, self.buffers.capacity, self.positions.device)
            self.positions.view(-1).index_fill_(0, past, -1)
            self.kinds.view(-1).index_fill_(0, past, int(RowKind.PADDING))
        self.shared = min(self.shared, min(ends))
        self.ends = None if min(ends) == max(ends) else ends
        # else a verification's padding slots sat inside a sequence: they may be gone
        self.aligned = aligned or _is_aligned(self.row_positions(), self.ends)
        self.contiguous = self.aligned and self.ends is None

    def select_rows(self, index: torch.Tensor) -> "RowLog":
        """A log of rows `index` (1-D) of every sequence."""
        return RowLog(*self.buffers.select(1, index, self.length), length=len(index))

    def select_batch(self, index: torch.Tensor) -> "RowLog":
        """A log of the chosen sequences (1-D index into the batch)."""
        log = RowLog(*self.buffers.select(0, index, self.length), length=self.length)
        # copies of one sequence share all their rows; any choice keeps the rows every one shared
        log.shared = self.length if index.numel() > 1 and bool((index == index[0]).all()) else self.shared
        if self.ends is not None:
            ends = [self.ends[i] for i in index.tolist()]
            log.ends = None if min(ends) == max(ends) else ends
            if log.ends is None and ends[0] < log.length:  # the chosen sequences all end early
                log._trim_rows(log.length - ends[0])
            log._recheck()
        return log


def trailing_ends(positions: torch.Tensor) -> list[int] | None:
    """Each sequence's end before its trailing padding slots (B, T) -> `LayerCache.ends`."""
    if positions.shape[1] == 0:
        return None
    real = (positions >= 0).int()
    ends = (positions.shape[1] - real.flip(1).argmax(1)).where(real.any(1), torch.zeros_like(real[:, 0])).tolist()
    return None if min(ends) == max(ends) else ends


# anonymous private mappings and madvise: POSIX systems (elsewhere, buffers are allocated whole)
_ON_DEMAND = hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS") and hasattr(mmap.mmap, "madvise")


def backs_on_demand(device: torch.device | str) -> bool:
    """Whether buffers on `device` can be backed on demand (`backed_on_demand`)."""
    return _ON_DEMAND and torch.device(device).type == "cpu"


def backed_on_demand(shape: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A zero CPU tensor in an anonymous private mapping: the OS backs it a page at a time as it
    is first written, and reading a page never written maps the shared zero page, so a buffer
    sized for every slot's whole context takes the memory of the rows written. The mapping is
    returned for `SlotBuffers._release` (madvise): torch's allocators hand out whole blocks they
    cannot give back a page at a time. Transparent huge pages are declined, which would back
    2 MiB at a touch."""
    size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    memory = mmap.mmap(-1, max(-(-size // mmap.PAGESIZE), 1) * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    tensor = torch.frombuffer(memory, dtype=dtype, count=math.prod(shape)).view(shape)  # keeps the mapping alive
    return tensor, memory


def _grow(t: torch.Tensor, capacity: int, dim: int, fill: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = capacity - t.shape[dim]
    pad = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=dim)


def _is_contiguous(positions: torch.Tensor) -> bool:
    expected = torch.arange(positions.shape[1], device=positions.device)
    return bool((positions == expected).all())


@functools.lru_cache(maxsize=16)
def _rows_at_ends(ends: tuple[int, ...], t: int, device: torch.device) -> torch.Tensor:
    """(B, t) the rows t rows appended at each sequence's end go to. Every layer of a step asks
    the same: computed once (a handful of small ops per layer, a few percent of a ragged decode
    step otherwise)."""
    return torch.tensor(ends, device=device).unsqueeze(1) + torch.arange(t, device=device)


@functools.lru_cache(maxsize=32)
def _flat_rows_at_ends(ends: tuple[int, ...], t: int, middle: int, capacity: int, device: torch.device) -> torch.Tensor:
    """Those rows as indices into a buffer (B, middle, capacity, ...) flattened over its first
    three dims, in the order of an appended (B, middle, t, ...) tensor's rows (`middle`: the
    heads of a key buffer, 1 for the log's (B, capacity))."""
    rows = _rows_at_ends(ends, t, device)
    first = torch.arange(len(ends), device=device).view(-1, 1, 1) * middle + torch.arange(middle, device=device).view(1, -1, 1)
    return (first * capacity + rows.unsqueeze(1)).reshape(-1)


@functools.lru_cache(maxsize=16)
def _rows_past_ends(ends: tuple[int, ...], length: int, capacity: int, device: torch.device) -> torch.Tensor:
    """The rows [ends[b], length) of every sequence b, as indices into a flat (B * capacity)
    positions buffer (computed once per step: every layer rolls back alike)."""
    return torch.cat([torch.arange(b * capacity + end, b * capacity + length, device=device) for b, end in enumerate(ends)])


def _is_aligned(positions: torch.Tensor, ends: list[int] | None) -> bool:
    """Whether sequence b's rows [0, ends[b]) (every row, for `ends` None) hold positions 0..ends[b]-1."""
    if ends is None:
        return _is_contiguous(positions)
    expected = torch.arange(positions.shape[1], device=positions.device)
    inside = expected < torch.tensor(ends, device=positions.device).unsqueeze(1)
    return bool(((positions == expected) | ~inside).all())

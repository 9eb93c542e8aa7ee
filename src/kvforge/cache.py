"""KVCache: per-layer keys and values with the positions and provenance of every row.

Shapes: B batch, H KV heads, T rows, D head dim. Keys are stored *after* RoPE (and after the
family's k-norm), ready for attention; values as projected.

Each layer holds its own rows, so layers may differ in what they hold (SPEED keeps prompt rows
only in lower layers; RidgeFill writes filled rows into late layers). Every row carries its
token position (-1 for a padding slot of a shorter sequence in a batch) and its provenance
(`RowKind`). Attention masks are built from positions, never from row order, so a layer's rows
need not be contiguous.

Storage is preallocated and grows geometrically: appending a decode row is a slice copy, and
`trim(n)` (speculative rollback) only moves the length back. When the sequences of a batch roll
back by different amounts (speculative requests accepting different draft lengths), each keeps
its own end (`LayerCache.ends`) and its next rows are written there, so a sequence's rows stay
packed from its first row with no padding slot between them: the layout plain decoding gives it,
which attention's sums over rows depend on for their rounding.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvforge.errors import ArtifactError

CACHE_FORMAT_VERSION = "1"


class RowKind(IntEnum):
    """Provenance of one cached row."""

    EXACT = 0  # computed by the model's own layer on its exact input
    FILLED = 1  # written by the layer from a predicted input (RidgeFill)
    TRANSLATED = 2  # mapped from another model's cache (KV-Lingo)
    PADDING = 3  # an empty slot that aligns sequences of different lengths in a batch


@dataclass
class LayerCache:
    """One layer's rows. Only the first `length` rows of the buffers are in use."""

    k: torch.Tensor  # (B, H, C, D), C = capacity
    v: torch.Tensor  # (B, H, C, D)
    positions: torch.Tensor  # (B, C) int64, -1 = padding
    kinds: torch.Tensor  # (B, C) uint8 RowKind
    length: int = 0
    # True while row i holds position i for every sequence: attention then needs no mask
    # for a query that continues the sequence, which keeps decode on the fast path.
    contiguous: bool = True
    # Rows [0, shared) are the same in every sequence of the batch (one prompt's rows copied to
    # each of its samples by `select_batch`): attention may read them once for the whole batch.
    shared: int = 0
    # Where each sequence's rows end when they differ (rows [ends[b], length) of sequence b are
    # padding slots, and its next rows go at ends[b]); None: every sequence ends at `length`.
    ends: list[int] | None = None
    # Buffers with room for more sequences (k, v, positions, kinds), of which k, v, positions and
    # kinds are views of the first B: a sequence joins by writing its rows into the next slot
    # (`join`) and leaves by the last one moving into its slot (`leave`). None: no spare slots.
    slots: tuple[torch.Tensor, ...] | None = None
    # With `ends`: True while sequence b's rows [0, ends[b]) hold its positions 0..ends[b]-1 (a
    # batch whose sequences are contiguous but of different lengths: its attention needs no mask
    # either, each sequence read to its own end). False where unknown; without `ends`, `contiguous`.
    aligned: bool = False

    @classmethod
    def empty(cls, batch: int, heads: int, dim: int, dtype: torch.dtype, device, capacity: int, value_dim: int | None = None) -> "LayerCache":
        """`value_dim`: the values' width where it differs from the keys' (an MLA latent)."""
        return cls(
            k=torch.zeros(batch, heads, capacity, dim, dtype=dtype, device=device),
            v=torch.zeros(batch, heads, capacity, dim if value_dim is None else value_dim, dtype=dtype, device=device),
            positions=torch.full((batch, capacity), -1, dtype=torch.long, device=device),
            kinds=torch.full((batch, capacity), int(RowKind.PADDING), dtype=torch.uint8, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def keys(self) -> torch.Tensor:
        return self.k[:, :, : self.length]

    def values(self) -> torch.Tensor:
        return self.v[:, :, : self.length]

    def row_positions(self) -> torch.Tensor:
        return self.positions[:, : self.length]

    def row_kinds(self) -> torch.Tensor:
        return self.kinds[:, : self.length]

    def _reserve(self, rows: int, exact: bool = False) -> None:
        needed = self.length + rows
        if needed <= self.capacity:
            return
        # Grow by an eighth (at least 256 rows): amortised O(1) per appended row without
        # doubling a long prompt's cache on its first decode step. `exact`: to `needed` rows.
        capacity = needed if exact else max(needed, self.capacity + max(256, self.capacity // 8))
        if self.slots is not None:
            k, v, positions, kinds = self.slots
            self.slots = (_grow(k, capacity, dim=2, fill=0), _grow(v, capacity, dim=2, fill=0),
                          _grow(positions, capacity, dim=1, fill=-1), _grow(kinds, capacity, dim=1, fill=int(RowKind.PADDING)))
            self._view(self.k.shape[0])
            return
        self.k = _grow(self.k, capacity, dim=2, fill=0)
        self.v = _grow(self.v, capacity, dim=2, fill=0)
        self.positions = _grow(self.positions, capacity, dim=1, fill=-1)
        self.kinds = _grow(self.kinds, capacity, dim=1, fill=int(RowKind.PADDING))

    def _view(self, batch: int) -> None:
        """k, v, positions and kinds: the first `batch` sequences of the slot buffers."""
        k, v, positions, kinds = self.slots
        self.k, self.v, self.positions, self.kinds = k[:batch], v[:batch], positions[:batch], kinds[:batch]

    def reserve_slots(self, sequences: int) -> None:
        """Buffers with room for `sequences` sequences (the batch is copied once into them, when
        they grow); later joins write only the joining sequences' rows."""
        held = self.slots[0].shape[0] if self.slots is not None else self.k.shape[0]
        if self.slots is not None and held >= sequences:
            return
        b = self.k.shape[0]
        grown = []
        for t, fill in ((self.k, 0), (self.v, 0), (self.positions, -1), (self.kinds, int(RowKind.PADDING))):
            out = t.new_full((max(sequences, b), *t.shape[1:]), fill)
            out[:b] = t
            grown.append(out)
        self.slots = tuple(grown)
        self._view(b)

    def join(self, other: "LayerCache", slots: int = 0) -> None:
        """Add `other`'s sequences after this layer's, in place: their rows are written into free
        slots (grown to at least `slots` sequences, or twice the batch, when there are too few),
        and no other sequence's rows move. Rows past a sequence's end are padding slots."""
        b, n = self.k.shape[0], other.k.shape[0]
        if other.length > self.capacity:
            self._reserve(other.length - self.length)
        if self.slots is None or self.slots[0].shape[0] < b + n:
            self.reserve_slots(max(slots, b + n, 2 * b))
        k, v, positions, kinds = self.slots
        rows = other.length
        k[b : b + n, :, :rows] = other.keys()
        v[b : b + n, :, :rows] = other.values()
        positions[b : b + n] = -1  # the slot may hold a sequence that left
        positions[b : b + n, :rows] = other.row_positions()
        kinds[b : b + n] = int(RowKind.PADDING)
        kinds[b : b + n, :rows] = other.row_kinds()
        ends = (self.ends or [self.length] * b) + (other.ends or [rows] * n)
        self._view(b + n)
        self.length = max(ends)
        self.ends = None if min(ends) == max(ends) else ends
        self.shared = 0 if b else other.shared  # another prompt's rows: nothing is the same in every sequence
        self.contiguous = _is_contiguous(self.row_positions())
        self.aligned = _is_aligned(self.row_positions(), self.ends)

    def leave(self, b: int) -> None:
        """Remove sequence `b` in place: the batch's last sequence moves into its slot (its rows
        alone are copied), so sequence order changes the same way (`KVCache.leave`)."""
        last = self.k.shape[0] - 1
        ends = list(self.ends or [self.length] * (last + 1))
        if self.slots is None:  # the buffers as they are become the slots: nothing is copied
            self.slots = (self.k, self.v, self.positions, self.kinds)
        if b != last:
            end = ends[last]
            self.k[b, :, :end] = self.k[last, :, :end]
            self.v[b, :, :end] = self.v[last, :, :end]
            self.positions[b] = -1
            self.positions[b, :end] = self.positions[last, :end]
            self.kinds[b] = int(RowKind.PADDING)
            self.kinds[b, :end] = self.kinds[last, :end]
            ends[b] = end
        ends.pop()
        self._view(last)
        length = max(ends, default=0)
        if length < self.length:
            self._trim_rows(self.length - length)
        self.ends = None if not ends or min(ends) == max(ends) else ends
        self.contiguous = _is_contiguous(self.row_positions())
        self.aligned = _is_aligned(self.row_positions(), self.ends)

    def append(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        kind: RowKind | torch.Tensor = RowKind.EXACT,
    ) -> None:
        """Append rows: k, v (B, H, T, D); positions (B, T); kind one value or (B, T). Each
        sequence's rows go at its own end."""
        t = k.shape[2]
        if t == 0:
            return
        if self.ends is not None:
            self._append_at_ends(k, v, positions, kind)
            return
        self._reserve(t)
        start, end = self.length, self.length + t
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.positions[:, start:end] = positions
        self.kinds[:, start:end] = kind if isinstance(kind, torch.Tensor) else int(kind)
        if self.contiguous:
            expected = torch.arange(start, end, device=positions.device)
            self.contiguous = bool((positions == expected).all())
        self.aligned = self.contiguous  # every sequence ends at `length`: aligned is contiguous
        self.length = end

    def _append_at_ends(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, kind) -> None:
        t = k.shape[2]
        ends = [e + t for e in self.ends]
        self._reserve(max(ends) - self.length)
        # sequence b's t rows go to rows [ends[b], ends[b] + t), which continue its positions when aligned
        rows, flat_rows, flat_kv = _rows_at_ends(tuple(self.ends), t, self.k.shape[1], self.capacity, positions.device)
        self.aligned = self.aligned and bool((positions == rows).all())
        # one indexed copy per tensor into its flat view (a slot buffer's leading sequences are
        # contiguous already: `contiguous()` returns the same view)
        self.k, self.v, self.positions, self.kinds = (x.contiguous() for x in (self.k, self.v, self.positions, self.kinds))
        if self.k.numel():  # a recurrent layer's log holds no K/V (zero heads)
            self.k.view(-1, self.k.shape[-1]).index_copy_(0, flat_kv, k.reshape(-1, k.shape[-1]).to(self.k.dtype))
            self.v.view(-1, self.v.shape[-1]).index_copy_(0, flat_kv, v.reshape(-1, v.shape[-1]).to(self.v.dtype))
        self.positions.view(-1).index_copy_(0, flat_rows, positions.reshape(-1).to(self.positions.dtype))
        if isinstance(kind, torch.Tensor):
            self.kinds.view(-1).index_copy_(0, flat_rows, kind.expand(positions.shape).reshape(-1).to(self.kinds.dtype))
        else:
            self.kinds.view(-1).index_fill_(0, flat_rows, int(kind))
        self.length = max(ends)
        self.ends = None if min(ends) == max(ends) else ends
        if self.ends is None:
            self.contiguous = self.aligned

    def rewrite(self, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace held rows in place: row index[b, r] of sequence b takes k[b, :, r] and
        v[b, :, r] (index -1: a padding slot, nothing written). Positions and kinds stay: a kind
        records what the prefill ran. A rewritten row is no longer the same in every sequence."""
        b, r = (index >= 0).nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        rows = index[b, r]
        self.k[b, :, rows] = k[b, :, r].to(self.k.dtype)
        self.v[b, :, rows] = v[b, :, r].to(self.v.dtype)
        self.shared = min(self.shared, int(rows.min()))

    def trim(self, n: int) -> None:
        """Drop the last n rows (speculative rollback)."""
        self.rollback([n] * self.k.shape[0])

    def _trim_rows(self, n: int) -> None:
        if n < 0 or n > self.length:
            raise ValueError(f"cannot trim {n} rows from a layer holding {self.length}")
        self.length -= n
        self.shared = min(self.shared, self.length)
        self.positions[:, self.length :] = -1
        self.kinds[:, self.length :] = int(RowKind.PADDING)

    def rollback(self, drop: list[int]) -> None:
        """Drop the last drop[b] rows of sequence b (from its own end); the layer's length becomes
        the longest sequence's, and a shorter one's rows past its end are padding slots."""
        ends = [e - n for e, n in zip(self.ends or [self.length] * len(drop), drop)]
        if min(ends) < 0:
            raise ValueError(f"cannot drop {max(drop)} rows from a layer holding {self.length}")
        aligned = self.aligned if self.ends is not None else self.contiguous  # dropping rows from aligned sequences' ends keeps them aligned
        self._trim_rows(self.length - max(ends))
        if min(ends) < self.length:  # the shorter sequences' rows past their ends become padding slots
            self.positions, self.kinds = self.positions.contiguous(), self.kinds.contiguous()
            past = _rows_past_ends(tuple(ends), self.length, self.capacity, self.positions.device)
            self.positions.view(-1).index_fill_(0, past, -1)
            self.kinds.view(-1).index_fill_(0, past, int(RowKind.PADDING))
        self.shared = min(self.shared, min(ends))
        self.ends = None if min(ends) == max(ends) else ends
        # else a verification's padding slots sat inside a sequence: they may be gone
        self.aligned = aligned or _is_aligned(self.row_positions(), self.ends)
        self.contiguous = self.aligned and self.ends is None

    def select_rows(self, index: torch.Tensor) -> "LayerCache":
        """A new layer holding rows `index` (1-D, into this layer's rows) of every sequence."""
        index = index.to(self.k.device)
        k = self.keys().index_select(2, index).contiguous()
        v = self.values().index_select(2, index).contiguous()
        positions = self.row_positions().index_select(1, index).contiguous()
        kinds = self.row_kinds().index_select(1, index).contiguous()
        layer = LayerCache(k, v, positions, kinds, length=len(index))
        layer.contiguous = _is_contiguous(positions)
        return layer

    def select_batch(self, index: torch.Tensor) -> "LayerCache":
        """A new layer holding the chosen sequences (1-D index into the batch)."""
        index = index.to(self.k.device)
        layer = LayerCache(
            self.keys().index_select(0, index).contiguous(),
            self.values().index_select(0, index).contiguous(),
            self.row_positions().index_select(0, index).contiguous(),
            self.row_kinds().index_select(0, index).contiguous(),
            length=self.length,
        )
        layer.contiguous = _is_contiguous(layer.row_positions())
        # copies of one sequence share all their rows; any choice keeps the rows every one shared
        layer.shared = self.length if index.numel() > 1 and bool((index == index[0]).all()) else self.shared
        if self.ends is not None:
            ends = [self.ends[i] for i in index.tolist()]
            layer.ends = None if min(ends) == max(ends) else ends
            if layer.ends is None and ends[0] < layer.length:  # the chosen sequences all end early
                layer._trim_rows(layer.length - ends[0])
            layer.contiguous = _is_contiguous(layer.row_positions())
            layer.aligned = _is_aligned(layer.row_positions(), layer.ends)
        return layer

    def nbytes(self) -> int:
        """Bytes of the K and V rows in use (positions and provenance not counted)."""
        per_row = self.k.shape[0] * self.k.shape[1] * (self.k.shape[3] + self.v.shape[3]) * self.k.element_size()
        return per_row * self.length


@dataclass
class RecurrentLayerCache(LayerCache):
    """A linear-attention (Gated DeltaNet) layer's state: the last K-1 inputs of its causal conv
    and its recurrent matrix, in place of K/V rows (its k and v hold no heads). It still logs the
    position and kind of every row it consumed, so provenance reports and `next_positions` read
    it like any layer.

    The recurrence cannot be undone, so rollback restores what the last step kept: the state
    before it, and after a short step the state after each of its tokens (`deltanet`). Trimming
    further back than the last step is refused."""

    conv: torch.Tensor | None = None  # (B, C, K-1) model dtype
    state: torch.Tensor | None = None  # (B, Hv, Dk, Dv) float32
    # The last step, for rollback: its token count; the conv inputs [before, step] (B, C, K-1+T)
    # and the recurrent states before it and after each token when it ran token by token, else
    # only the conv inputs and state before it (a long prefill step keeps no copy of its inputs).
    step_tokens: int = 0
    step_window: torch.Tensor | None = None
    step_states: list | None = None

    @classmethod
    def empty_state(
        cls, batch: int, channels: int, width: int, state_shape: tuple[int, int, int], dtype: torch.dtype, device, capacity: int
    ) -> "RecurrentLayerCache":
        rows = LayerCache.empty(batch, 0, 0, dtype, device, capacity)
        return cls(
            rows.k, rows.v, rows.positions, rows.kinds,
            conv=torch.zeros(batch, channels, width, dtype=dtype, device=device),
            state=torch.zeros(batch, *state_shape, dtype=torch.float32, device=device),
        )

    @property
    def per_token(self) -> bool:
        return self.step_states is not None and len(self.step_states) == self.step_tokens + 1

    def advance(self, window: torch.Tensor, states: list[torch.Tensor], positions: torch.Tensor, kind) -> None:
        """Take one step's conv window (B, C, K-1+T) and recurrent states (the state before, then
        after each token or after the last) and log its rows."""
        width = self.conv.shape[-1]
        t = window.shape[-1] - width
        self.step_tokens = t
        per_token = len(states) == t + 1
        self.step_window = window if per_token else window[..., :width].clone()
        self.step_states = states if per_token else states[:1]
        self.conv = window[..., t:].clone()  # not a view: it would keep the whole window alive
        self.state = states[-1]
        empty = self.k.new_empty(self.k.shape[0], 0, t, 0)
        LayerCache.append(self, empty, empty, positions, kind)

    def trim(self, n: int) -> None:
        self.rollback([n] * self.k.shape[0])

    def rollback(self, drop: list[int]) -> None:
        if max(drop) == 0:
            return
        step, width, per_token = self.step_tokens, self.conv.shape[-1], self.per_token
        for n in drop:  # all checked first: a refused rollback leaves the layer as it was
            if n > step or (0 < n < step and not per_token):
                lost = " (its rollback record was not kept: a batch was re-formed or the cache loaded since)" if step == 0 else ""
                raise ValueError(
                    f"a recurrent (Gated DeltaNet) layer rolls back only within its last step ({step} tokens"
                    f"{'' if per_token else ', whole'}){lost}; {n} asked"
                )
        self.conv, self.state = self.conv.clone(), self.state.clone()
        for b, n in enumerate(drop):
            if n == 0:
                continue
            kept = step - n
            self.conv[b] = self.step_window[b, :, kept : kept + width]
            self.state[b] = self.step_states[kept][b]
        if min(drop) == max(drop) and per_token:  # every sequence back to one point: the step is shorter
            kept = step - drop[0]
            self.step_tokens, self.step_window, self.step_states = kept, self.step_window[..., : width + kept], self.step_states[: kept + 1]
        else:
            self.step_tokens, self.step_window, self.step_states = 0, None, None
        LayerCache.rollback(self, drop)

    def select_rows(self, index: torch.Tensor) -> "LayerCache":
        raise ValueError("a recurrent (Gated DeltaNet) layer holds a state, not rows: its rows cannot be selected")

    def select_batch(self, index: torch.Tensor) -> "RecurrentLayerCache":
        rows = LayerCache.select_batch(self, index)
        index = index.to(self.conv.device)
        return RecurrentLayerCache(
            rows.k, rows.v, rows.positions, rows.kinds, rows.length, rows.contiguous, rows.shared, rows.ends,
            conv=self.conv.index_select(0, index), state=self.state.index_select(0, index),
        )

    @classmethod
    def joined(cls, rows: LayerCache, parts: list["RecurrentLayerCache"]) -> "RecurrentLayerCache":
        """`rows` (the joined row log) with the parts' states stacked along the batch."""
        return cls(
            rows.k, rows.v, rows.positions, rows.kinds, rows.length, rows.contiguous, ends=rows.ends,
            conv=torch.cat([p.conv for p in parts]), state=torch.cat([p.state for p in parts]),
        )

    def join(self, other: "RecurrentLayerCache", slots: int = 0) -> None:
        """`LayerCache.join` for the row log; the states (a fixed size per sequence) are stacked.
        The last step's rollback record is dropped: the batch changed."""
        LayerCache.join(self, other, slots)
        self.conv, self.state = torch.cat([self.conv, other.conv]), torch.cat([self.state, other.state])
        self.step_tokens, self.step_window, self.step_states = 0, None, None

    def leave(self, b: int) -> None:
        last = self.conv.shape[0] - 1
        LayerCache.leave(self, b)
        order = [last if i == b else i for i in range(last)]
        index = torch.tensor(order, dtype=torch.long, device=self.conv.device)
        self.conv, self.state = self.conv.index_select(0, index), self.state.index_select(0, index)
        self.step_tokens, self.step_window, self.step_states = 0, None, None

    def nbytes(self) -> int:
        """Bytes of the conv and recurrent states (fixed, whatever the length) and of the last
        step's rollback record (after a k-token verification: k + 1 more states until the next step)."""
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        held = size(self.conv) + size(self.state)
        if self.step_window is not None:
            held += size(self.step_window)
        if self.step_states:  # the first is the state before the step, a tensor of its own
            held += sum(size(s) for s in self.step_states if s is not self.state)
        return held


class KVCache:
    """The whole model's cache: one `LayerCache` per layer."""

    def __init__(self, layers: list[LayerCache]):
        self.layers = layers

    @classmethod
    def empty(
        cls,
        num_layers: int,
        batch: int,
        kv_heads: int | list[int],
        head_dim: int | list[int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        capacity: int = 256,
    ) -> "KVCache":
        """An empty cache; heads and head dim may be given per layer."""
        heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * num_layers
        dims = head_dim if isinstance(head_dim, list) else [head_dim] * num_layers
        return cls([LayerCache.empty(batch, h, d, dtype, device, capacity) for h, d in zip(heads, dims)])

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> LayerCache:
        return self.layers[layer]

    @property
    def batch_size(self) -> int:
        return self.layers[0].k.shape[0]

    def lengths(self) -> list[int]:
        return [layer.length for layer in self.layers]

    def next_positions(self) -> torch.Tensor:
        """(B,) the position the next token of each sequence takes: one past its largest."""
        best = None
        for layer in self.layers:
            if layer.length:
                top = layer.row_positions().max(dim=1).values
                best = top if best is None else torch.maximum(best, top)
        if best is None:
            return torch.zeros(self.batch_size, dtype=torch.long, device=self.layers[0].k.device)
        return best + 1

    def trim(self, n: int) -> None:
        """Drop the last n rows of every layer (speculative rollback of n rejected tokens)."""
        for layer in self.layers:
            layer.trim(n)

    def rollback(self, drop: list[int]) -> None:
        """Drop the last drop[b] rows of sequence b in every layer (speculative rollback when
        requests accepted different numbers of draft tokens). Each sequence keeps its own end;
        the batch's rows past it are padding slots (position -1, invisible to attention) until
        its next rows are written there."""
        for layer in self.layers:
            layer.rollback(drop)

    def select_rows(self, index: torch.Tensor) -> "KVCache":
        """A new cache holding rows `index` of every layer."""
        return KVCache([layer.select_rows(index) for layer in self.layers])

    def select_batch(self, index: torch.Tensor) -> "KVCache":
        """A new cache holding the chosen sequences."""
        return KVCache([layer.select_batch(index) for layer in self.layers])

    @classmethod
    def concat_batch(cls, caches: list["KVCache"]) -> "KVCache":
        """One cache holding every sequence of `caches`, in order (continuous batching: a newly
        prefilled request joins the running batch). Each layer takes the longest length; a
        shorter sequence's extra slots are padding (position -1), so no row moves position."""
        layers = []
        for parts in zip(*(c.layers for c in caches)):
            length = max(p.length for p in parts)
            first = parts[0]
            batch = sum(p.k.shape[0] for p in parts)
            heads, dim = first.k.shape[1], first.k.shape[3]
            out = LayerCache(
                k=first.k.new_zeros(batch, heads, length, dim),
                v=first.v.new_zeros(batch, heads, length, first.v.shape[3]),  # an MLA latent is wider than its key
                positions=torch.full((batch, length), -1, dtype=torch.long, device=first.k.device),
                kinds=torch.full((batch, length), int(RowKind.PADDING), dtype=torch.uint8, device=first.k.device),
                length=length,
            )
            row, ends = 0, []
            for p in parts:
                n = p.k.shape[0]
                out.k[row : row + n, :, : p.length] = p.keys()
                out.v[row : row + n, :, : p.length] = p.values()
                out.positions[row : row + n, : p.length] = p.row_positions()
                out.kinds[row : row + n, : p.length] = p.row_kinds()
                ends += p.ends or [p.length] * n
                row += n
            out.contiguous = _is_contiguous(out.positions)
            out.ends = None if min(ends) == max(ends) else ends  # each sequence continues after its own rows
            out.aligned = _is_aligned(out.positions, out.ends)
            layers.append(RecurrentLayerCache.joined(out, parts) if isinstance(first, RecurrentLayerCache) else out)
        return cls(layers)

    def join(self, other: "KVCache", slots: int = 0) -> None:
        """Add `other`'s sequences after this cache's, in place (`LayerCache.join`: only their rows
        are written); `slots`: room for that many sequences when the buffers grow."""
        for mine, theirs in zip(self.layers, other.layers):
            mine.join(theirs, slots)

    def row_bytes(self) -> int:
        """Bytes of one row of one sequence across the attention layers (keys and values)."""
        return sum(layer.k.shape[1] * (layer.k.shape[3] + layer.v.shape[3]) * layer.k.element_size()
                   for layer in self.layers if not isinstance(layer, RecurrentLayerCache))

    def reserve_rows(self, rows: int) -> None:
        """Room for `rows` rows per sequence in every layer's buffers, allocated at once."""
        for layer in self.layers:
            if rows > layer.capacity:
                layer._reserve(rows - layer.length, exact=True)

    def sequence(self, b: int) -> "KVCache":
        """Sequence `b` as a cache of one sequence whose tensors are views into this one's: rows
        rewritten through it are rewritten here (nothing may be appended through it)."""
        layers = []
        for layer in self.layers:
            end = layer.ends[b] if layer.ends is not None else layer.length
            view = LayerCache(layer.k[b : b + 1], layer.v[b : b + 1], layer.positions[b : b + 1], layer.kinds[b : b + 1], length=end)
            view.contiguous = _is_contiguous(view.row_positions())
            layers.append(view)
        return KVCache(layers)

    def unshare(self, row: int) -> None:
        """Rows from `row` on were rewritten in one sequence: no longer the same in every sequence."""
        for layer in self.layers:
            layer.shared = min(layer.shared, row)

    def reserve_slots(self, sequences: int) -> None:
        """Room for `sequences` sequences in every layer's buffers (`LayerCache.reserve_slots`)."""
        for layer in self.layers:
            if not isinstance(layer, RecurrentLayerCache):  # its states are stacked per join
                layer.reserve_slots(sequences)

    def leave(self, b: int) -> None:
        """Remove sequence `b` in place: the last sequence moves into its slot (`LayerCache.leave`)."""
        for layer in self.layers:
            layer.leave(b)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V rows in use across all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def save(self, path: str | Path, metadata: dict[str, str] | None = None) -> None:
        """Write the used rows to a .safetensors file (temp file, then rename)."""
        tensors: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            tensors[f"layers.{i}.k"] = layer.keys().contiguous().cpu()
            tensors[f"layers.{i}.v"] = layer.values().contiguous().cpu()
            tensors[f"layers.{i}.positions"] = layer.row_positions().contiguous().cpu()
            tensors[f"layers.{i}.kinds"] = layer.row_kinds().contiguous().cpu()
            if isinstance(layer, RecurrentLayerCache):
                tensors[f"layers.{i}.conv"] = layer.conv.contiguous().cpu()
                tensors[f"layers.{i}.state"] = layer.state.contiguous().cpu()
        meta = {"format": "kvforge.kvcache", "format_version": CACHE_FORMAT_VERSION, "num_layers": str(len(self))}
        meta.update(metadata or {})
        atomic_save_safetensors(tensors, Path(path), meta)

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu") -> tuple["KVCache", dict[str, str]]:
        """Read a cache written by `save`; returns it with the file's metadata."""
        path = Path(path)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                if meta.get("format") != "kvforge.kvcache":
                    raise ArtifactError(f"{path} is not a kvforge KV cache (format={meta.get('format')!r})")
                layers = []
                for i in range(int(meta["num_layers"])):
                    k = f.get_tensor(f"layers.{i}.k").to(device)
                    layer = LayerCache(
                        k=k,
                        v=f.get_tensor(f"layers.{i}.v").to(device),
                        positions=f.get_tensor(f"layers.{i}.positions").to(device),
                        kinds=f.get_tensor(f"layers.{i}.kinds").to(device),
                        length=k.shape[2],
                    )
                    layer.contiguous = _is_contiguous(layer.positions)
                    layer.ends = _trailing_ends(layer.positions)
                    if f"layers.{i}.state" in f.keys():
                        layer = RecurrentLayerCache(
                            layer.k, layer.v, layer.positions, layer.kinds, layer.length, layer.contiguous, ends=layer.ends,
                            conv=f.get_tensor(f"layers.{i}.conv").to(device), state=f.get_tensor(f"layers.{i}.state").to(device))
                    layers.append(layer)
        except ArtifactError:
            raise
        except Exception as exc:  # safetensors raises several types for a damaged file
            raise ArtifactError(f"cannot read KV cache {path}: {exc}") from exc
        return cls(layers), meta


def _trailing_ends(positions: torch.Tensor) -> list[int] | None:
    """Each sequence's end before its trailing padding slots (B, T) -> `LayerCache.ends`."""
    if positions.shape[1] == 0:
        return None
    real = (positions >= 0).int()
    ends = (positions.shape[1] - real.flip(1).argmax(1)).where(real.any(1), torch.zeros_like(real[:, 0])).tolist()
    return None if min(ends) == max(ends) else ends


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Save to a temp file beside `path`, then rename, so no reader sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def read_artifact(path: Path, fmt: str, version: str | tuple[str, ...], what: str):
    """Open a kvforge .safetensors artifact of format `fmt` and yield (file, metadata). A wrong
    format or version (`version`: the one this kvforge reads, or a tuple of them), and anything a
    damaged file raises inside the block (safetensors and json raise several types), become one
    `ArtifactError` naming `what`."""
    versions = (version,) if isinstance(version, str) else version
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("format") != fmt:
                raise ArtifactError(f"{path} is not a kvforge {what} (format={meta.get('format')!r})")
            if meta.get("format_version") not in versions:
                raise ArtifactError(f"{path} has {what} format {meta.get('format_version')}, this kvforge reads {' or '.join(versions)}")
            yield f, meta
    except ArtifactError:
        raise
    except Exception as exc:
        raise ArtifactError(f"cannot read {what} {path}: {type(exc).__name__}: {exc}") from exc


def _grow(t: torch.Tensor, capacity: int, dim: int, fill: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = capacity - t.shape[dim]
    pad = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=dim)


def _is_contiguous(positions: torch.Tensor) -> bool:
    expected = torch.arange(positions.shape[1], device=positions.device)
    return bool((positions == expected).all())


@functools.lru_cache(maxsize=16)
def _rows_at_ends(ends: tuple[int, ...], t: int, heads: int, capacity: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where t rows appended at each sequence's end go in a layer's buffers (B, H, capacity, .):
    the rows (B, t), their index into a flat (B * capacity) positions buffer, and into a flat
    (B * H * capacity) key or value buffer, in the order of the appended tensors' rows. Every
    layer of a step asks the same: computed once (a handful of small ops per layer, a few
    percent of a ragged decode step otherwise)."""
    rows = torch.tensor(ends, device=device).unsqueeze(1) + torch.arange(t, device=device)  # (B, t)
    sequences = torch.arange(len(ends), device=device)
    flat_rows = (sequences.unsqueeze(1) * capacity + rows).reshape(-1)
    flat_kv = ((sequences.view(-1, 1, 1) * heads + torch.arange(heads, device=device).view(1, -1, 1)) * capacity
               + rows.unsqueeze(1)).reshape(-1)
    return rows, flat_rows, flat_kv


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

"""KVCache: per-layer keys and values with the positions and provenance of every row.

Shapes: B batch, H KV heads, T rows, D head dim. Keys are stored *after* RoPE (and after the
family's k-norm), ready for attention; values as projected.

Each layer holds its own rows, so layers may differ in what they hold (SPEED keeps prompt rows
only in lower layers; RidgeFill writes filled rows into late layers). Every row carries its
token position (-1 for a padding slot of a shorter sequence in a batch) and its provenance
(`RowKind`). Attention masks are built from positions, never from row order, so a layer's rows
need not be contiguous.

A layer is its row log (`rows.RowLog`: positions, kinds, and where each sequence ends) beside what it
keeps of the rows: keys and values (`LayerCache`) or a linear-attention layer's recurrent state
(`RecurrentLayerCache`). Both answer the same row operations (append, rollback, join, leave,
select), the log's part written once.

Storage is preallocated and grows geometrically: appending a decode row is a slice copy, and
`trim(n)` (speculative rollback) only moves the length back. When the sequences of a batch roll
back by different amounts (speculative requests accepting different draft lengths), each keeps
its own end (`LayerCache.ends`) and its next rows are written there, so a sequence's rows stay
packed from its first row with no padding slot between them: the layout plain decoding gives it,
which attention's sums over rows depend on for their rounding.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvforge.errors import ArtifactError
from kvforge.rows import RowKind, RowLog, SlotBuffers, trailing_ends

CACHE_FORMAT_VERSION = "2"  # 2: a recurrent layer is saved without K/V; `load` reads 1 and 2


class _LoggedLayer:
    """What every layer's cache answers from its row log (`RowLog`), whatever it keeps of the rows."""

    log: RowLog

    positions = property(lambda self: self.log.positions)
    kinds = property(lambda self: self.log.kinds)
    length = property(lambda self: self.log.length)
    ends = property(lambda self: self.log.ends)
    contiguous = property(lambda self: self.log.contiguous, lambda self, value: setattr(self.log, "contiguous", value))
    aligned = property(lambda self: self.log.aligned, lambda self, value: setattr(self.log, "aligned", value))
    shared = property(lambda self: self.log.shared, lambda self, value: setattr(self.log, "shared", value))

    @property
    def capacity(self) -> int:
        return self.log.buffers.capacity

    @property
    def batch(self) -> int:
        return self.log.buffers.batch

    @property
    def sequence_slots(self) -> int:
        """Sequences the buffers have room for (the batch and the free slots)."""
        return self.log.buffers.slots

    def row_positions(self) -> torch.Tensor:
        return self.log.row_positions()

    def row_kinds(self) -> torch.Tensor:
        return self.log.row_kinds()

    def _buffers(self) -> list[SlotBuffers]:
        """The log's buffers and those of what the layer keeps per row."""
        return [self.log.buffers]

    def _reserve(self, rows: int) -> None:
        capacity = self.log.capacity_for(rows)
        if capacity is not None:  # the log last: should a larger buffer fail to grow, the layer keeps the capacity it had
            for buffers in reversed(self._buffers()):
                buffers.grow(capacity)

    def _log(self, positions: torch.Tensor, kind) -> int | tuple[int, ...]:
        """Log rows at `positions` (B, T) at each sequence's end, the buffers grown for them first;
        returns where they went (`RowLog.append`)."""
        self._reserve(max(self.log.sequence_ends()) + positions.shape[1] - self.length)
        return self.log.append(positions, kind)

    def _reserve_for(self, other: "_LoggedLayer", slots: int) -> None:
        """Room for `other`'s rows and sequences after this layer's (at least `slots` sequences,
        or twice the batch, when the slots grow)."""
        b, n = self.batch, other.batch
        if other.length > self.capacity:
            self._reserve(other.length - self.length)
        if self.sequence_slots < b + n:
            self.reserve_slots(max(slots, b + n, 2 * b))

    def reserve_slots(self, sequences: int) -> None:
        """Buffers with room for `sequences` sequences (the batch is copied once into them, when
        they grow); later joins write only the joining sequences' rows."""
        for buffers in self._buffers():
            buffers.reserve_slots(sequences)

    def allocate(self, slots: int, rows: int, on_demand: bool = True) -> None:
        """Empty buffers for `slots` sequences of `rows` rows (`SlotBuffers.allocate`: keys and
        values backed on demand)."""
        for buffers in self._buffers():
            buffers.allocate(slots, rows, on_demand)

    def trim(self, n: int) -> None:
        """Drop the last n rows (speculative rollback)."""
        self.rollback([n] * self.batch)

    def rollback(self, drop: list[int]) -> None:
        self.log.rollback(drop)


class LayerCache(_LoggedLayer):
    """An attention layer's rows: keys and values beside the row log. Only the first `length`
    rows are in use."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, kinds: torch.Tensor,
                 length: int = 0, log: RowLog | None = None, contiguous: bool | None = None):
        """k, v (B, H, C, D), C = capacity; positions (B, C) int64; kinds (B, C) uint8; or `log`.
        `contiguous`: known of the positions (else read off them)."""
        self.log = log if log is not None else RowLog(positions, kinds, length, contiguous)
        self.rows = SlotBuffers([k, v], row_dim=2, fills=[0, 0])

    @classmethod
    def empty(cls, batch: int, heads: int, dim: int, dtype: torch.dtype, device, capacity: int, value_dim: int | None = None) -> "LayerCache":
        """`value_dim`: the values' width where it differs from the keys' (an MLA latent)."""
        log = RowLog.empty(batch, capacity, device)
        return cls(torch.zeros(batch, heads, capacity, dim, dtype=dtype, device=device),
                   torch.zeros(batch, heads, capacity, dim if value_dim is None else value_dim, dtype=dtype, device=device),
                   None, None, log=log)

    @property
    def k(self) -> torch.Tensor:  # (B, H, C, D)
        return self.rows.views[0]

    @property
    def v(self) -> torch.Tensor:  # (B, H, C, D)
        return self.rows.views[1]

    def keys(self) -> torch.Tensor:
        return self.k[:, :, : self.length]

    def values(self) -> torch.Tensor:
        return self.v[:, :, : self.length]

    def _buffers(self) -> list[SlotBuffers]:
        return [self.log.buffers, self.rows]

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, kind: RowKind | torch.Tensor = RowKind.EXACT) -> None:
        """Append rows: k, v (B, H, T, D); positions (B, T); kind one value or (B, T). Each
        sequence's rows go at its own end, so a sequence's rows stay packed from its first row."""
        t = k.shape[2]
        if t == 0:
            return
        self.rows.write(self._log(positions, kind), [k, v])

    def join(self, other: "LayerCache", slots: int = 0) -> None:
        """Add `other`'s sequences after this layer's, in place: their rows are written into free
        slots (grown to at least `slots` sequences, or twice the batch, when there are too few),
        and no other sequence's rows move. Rows past a sequence's end are padding slots."""
        self._reserve_for(other, slots)
        self.rows.write_sequences(self.batch, [other.keys(), other.values()], other.length)
        self.rows.use(self.batch + other.batch)
        self.log.join(other.log)

    def leave(self, b: int) -> None:
        """Remove sequence `b` in place: the batch's last sequence moves into its slot (its rows
        alone are copied), so sequence order changes the same way (`KVCache.leave`)."""
        self.rows.leave(b, self.log.sequence_ends()[-1])
        self.log.leave(b)

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

    def select_rows(self, index: torch.Tensor) -> "LayerCache":
        """A new layer holding rows `index` (1-D, into this layer's rows) of every sequence."""
        index = index.to(self.k.device)
        return LayerCache(*self.rows.select(2, index, self.length), None, None, log=self.log.select_rows(index))

    def select_batch(self, index: torch.Tensor) -> "LayerCache":
        """A new layer holding the chosen sequences (1-D index into the batch)."""
        index = index.to(self.k.device)
        # the log's and the rows' buffers alike hold this layer's `length` rows
        return LayerCache(*self.rows.select(0, index, self.length), None, None, log=self.log.select_batch(index))

    def sequence(self, b: int) -> "LayerCache":
        """Sequence `b` as a layer whose tensors are views into this one's (`KVCache.sequence`)."""
        end = self.log.sequence_ends()[b]
        return LayerCache(self.k[b : b + 1], self.v[b : b + 1], self.positions[b : b + 1], self.kinds[b : b + 1], length=end)

    @classmethod
    def concat(cls, parts: list["LayerCache"]) -> "LayerCache":
        """One layer holding every sequence of `parts`, in order, in new buffers."""
        first, length = parts[0], max(p.length for p in parts)
        out = cls.empty(sum(p.batch for p in parts), first.k.shape[1], first.k.shape[3], first.k.dtype, first.k.device,
                        length, value_dim=first.v.shape[3])  # an MLA latent is wider than its key
        out.rows.use(0)
        out.log.buffers.use(0)
        for p in parts:
            out.join(p)
        return out

    def nbytes(self) -> int:
        """Bytes of the K and V rows in use, each sequence's to its own end (positions and
        provenance not counted; nor the padding slots past a shorter sequence's end, which take
        no memory in buffers backed on demand)."""
        per_row = self.k.shape[1] * (self.k.shape[3] + self.v.shape[3]) * self.k.element_size()
        return per_row * sum(self.log.sequence_ends())

    def save_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.k": self.keys().contiguous().cpu(), f"{prefix}.v": self.values().contiguous().cpu()}


class RecurrentLayerCache(_LoggedLayer):
    """A linear-attention (Gated DeltaNet) layer's state: the last K-1 inputs of its causal conv
    and its recurrent matrix, in place of K/V rows. Its row log records the position and kind of
    every row it consumed, so provenance reports and `next_positions` read it like any layer.

    The recurrence cannot be undone, so rollback restores what the last step kept: the state
    before it, and after a short step the state after each of its tokens (`deltanet`). Trimming
    further back than the last step is refused."""

    def __init__(self, log: RowLog, conv: torch.Tensor, state: torch.Tensor):
        self.log = log
        self.conv = conv  # (B, C, K-1) model dtype
        self.state = state  # (B, Hv, Dk, Dv) float32
        # The last step, for rollback: its token count; the conv inputs [before, step] (B, C,
        # K-1+T) and the recurrent states before it and after each token when it ran token by
        # token, else only the conv inputs and state before it (a long prefill step keeps no copy
        # of its inputs).
        self.step_tokens = 0
        self.step_window: torch.Tensor | None = None
        self.step_states: list | None = None

    @classmethod
    def empty_state(
        cls, batch: int, channels: int, width: int, state_shape: tuple[int, int, int], dtype: torch.dtype, device, capacity: int
    ) -> "RecurrentLayerCache":
        return cls(RowLog.empty(batch, capacity, device),
                   conv=torch.zeros(batch, channels, width, dtype=dtype, device=device),
                   state=torch.zeros(batch, *state_shape, dtype=torch.float32, device=device))

    @property
    def per_token(self) -> bool:
        return self.step_states is not None and len(self.step_states) == self.step_tokens + 1

    def _forget_step(self) -> None:
        self.step_tokens, self.step_window, self.step_states = 0, None, None

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
        if t:
            self._log(positions, kind)

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
            self._forget_step()
        self.log.rollback(drop)

    def select_rows(self, index: torch.Tensor) -> "RecurrentLayerCache":
        raise ValueError("a recurrent (Gated DeltaNet) layer holds a state, not rows: its rows cannot be selected")

    def select_batch(self, index: torch.Tensor) -> "RecurrentLayerCache":
        index = index.to(self.conv.device)
        return RecurrentLayerCache(self.log.select_batch(index), conv=self.conv.index_select(0, index), state=self.state.index_select(0, index))

    def sequence(self, b: int) -> "RecurrentLayerCache":
        """Sequence `b`, its state a view into this one's (`KVCache.sequence`)."""
        end = self.log.sequence_ends()[b]
        log = RowLog(self.positions[b : b + 1], self.kinds[b : b + 1], length=end)
        return RecurrentLayerCache(log, self.conv[b : b + 1], self.state[b : b + 1])

    def join(self, other: "RecurrentLayerCache", slots: int = 0) -> None:
        """The row logs joined (`LayerCache.join`) and the states (a fixed size per sequence)
        stacked. The last step's rollback record is dropped: the batch changed."""
        self._reserve_for(other, slots)
        self.log.join(other.log)
        self.conv, self.state = torch.cat([self.conv, other.conv]), torch.cat([self.state, other.state])
        self._forget_step()

    def leave(self, b: int) -> None:
        last = self.batch - 1
        self.log.leave(b)
        order = [last if i == b else i for i in range(last)]
        index = torch.tensor(order, dtype=torch.long, device=self.conv.device)
        self.conv, self.state = self.conv.index_select(0, index), self.state.index_select(0, index)
        self._forget_step()

    @classmethod
    def concat(cls, parts: list["RecurrentLayerCache"]) -> "RecurrentLayerCache":
        out = parts[0].select_batch(torch.arange(parts[0].batch))
        for p in parts[1:]:
            out.join(p)
        return out

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

    def save_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.conv": self.conv.contiguous().cpu(), f"{prefix}.state": self.state.contiguous().cpu()}


CachedLayer = LayerCache | RecurrentLayerCache


class KVCache:
    """The whole model's cache: per layer, its row log and K/V rows (`LayerCache`) or recurrent
    state (`RecurrentLayerCache`)."""

    def __init__(self, layers: list[CachedLayer]):
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

    def __getitem__(self, layer: int) -> CachedLayer:
        return self.layers[layer]

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch

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
            return torch.zeros(self.batch_size, dtype=torch.long, device=self.layers[0].positions.device)
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
        """One cache holding every sequence of `caches`, in order, in new buffers. Each layer takes
        the longest length; a shorter sequence's extra slots are padding (position -1), so no row
        moves position."""
        return cls([type(parts[0]).concat(list(parts)) for parts in zip(*(c.layers for c in caches))])

    def join(self, other: "KVCache", slots: int = 0) -> None:
        """Add `other`'s sequences after this cache's, in place (`LayerCache.join`: only their rows
        are written); `slots`: room for that many sequences when the buffers grow."""
        for mine, theirs in zip(self.layers, other.layers):
            mine.join(theirs, slots)

    def row_bytes(self) -> int:
        """Bytes of one row of one sequence across the attention layers (keys and values)."""
        return sum(layer.k.shape[1] * (layer.k.shape[3] + layer.v.shape[3]) * layer.k.element_size()
                   for layer in self.layers if isinstance(layer, LayerCache))

    def allocate(self, slots: int, rows: int, on_demand: bool = True) -> None:
        """Buffers for `slots` sequences of `rows` rows in every layer, for an empty batch that
        sequences join and leave (`KVCache.join`, `leave`) without a buffer growing while they
        fit. `on_demand` (on CPU): keys and values take memory as rows are written, and a leaving
        sequence's pages go back (`SlotBuffers.allocate`); otherwise they are allocated whole."""
        if self.batch_size:
            raise ValueError(f"a cache holding {self.batch_size} sequences cannot be allocated anew")
        for layer in self.layers:
            layer.allocate(slots, rows, on_demand)

    def sequence(self, b: int) -> "KVCache":
        """Sequence `b` as a cache of one sequence whose tensors are views into this one's: rows
        rewritten through it are rewritten here (nothing may be appended through it)."""
        return KVCache([layer.sequence(b) for layer in self.layers])

    def unshare(self, row: int) -> None:
        """Rows from `row` on were rewritten in one sequence: no longer the same in every sequence."""
        for layer in self.layers:
            layer.shared = min(layer.shared, row)

    def reserve_slots(self, sequences: int) -> None:
        """Room for `sequences` sequences in every layer's buffers (`LayerCache.reserve_slots`)."""
        for layer in self.layers:
            layer.reserve_slots(sequences)

    def leave(self, b: int) -> None:
        """Remove sequence `b` in place: the last sequence moves into its slot (`LayerCache.leave`)."""
        for layer in self.layers:
            layer.leave(b)

    def intact(self) -> bool:
        """Whether every layer's buffers agree on its batch, capacity and slots (a step that failed
        while growing them may leave them apart)."""
        batch = self.batch_size
        return all(layer.batch == batch and len({(b.batch, b.capacity, b.slots) for b in layer._buffers()}) == 1 for layer in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V rows in use, and of recurrent states, across all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def save(self, path: str | Path, metadata: dict[str, str] | None = None) -> None:
        """Write the used rows to a .safetensors file (temp file, then rename)."""
        tensors: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            tensors[f"layers.{i}.positions"] = layer.row_positions().contiguous().cpu()
            tensors[f"layers.{i}.kinds"] = layer.row_kinds().contiguous().cpu()
            tensors.update(layer.save_tensors(f"layers.{i}"))  # keys and values, or a recurrent state
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
                if meta.get("format_version") not in ("1", CACHE_FORMAT_VERSION):
                    raise ArtifactError(f"{path} has KV cache format {meta.get('format_version')}, this kvforge reads 1 or {CACHE_FORMAT_VERSION}")
                layers = []
                for i in range(int(meta["num_layers"])):
                    get = lambda name: f.get_tensor(f"layers.{i}.{name}").to(device)  # noqa: B023, E731
                    positions = get("positions")
                    log = RowLog(positions, get("kinds"), length=positions.shape[1])
                    log.ends = trailing_ends(positions)
                    log._recheck()
                    if f"layers.{i}.state" in f.keys():  # a recurrent layer (a format 1 file also holds zero-head K/V for it)
                        layers.append(RecurrentLayerCache(log, conv=get("conv"), state=get("state")))
                    else:
                        layers.append(LayerCache(get("k"), get("v"), None, None, log=log))
        except ArtifactError:
            raise
        except Exception as exc:  # safetensors raises several types for a damaged file
            raise ArtifactError(f"cannot read KV cache {path}: {exc}") from exc
        return cls(layers), meta


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

"""The engine: runs a model layer by layer over an explicit `KVCache`.

Shapes: B batch, T tokens, E hidden size, V vocabulary, L layers.

The layer loop is public (`run_layer`, `run_layers`) so methods that compute some rows only in
some layers (RidgeFill, SPEED, KV-Lingo capture) build on it instead of on forward hooks. The
engine knows nothing of those methods. Sequences of different lengths share a batch by left
padding: a padding slot has position -1 and is invisible to attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.allocator import keep_freed_memory
from kvforge.attention import QUERY_BLOCK, attend_steps, readable_rows
from kvforge.cache import KVCache, LayerCache, RecurrentLayerCache, RowKind
from kvforge.errors import PromptError
from kvforge.models.deltanet import PER_TOKEN_STEPS
from kvforge.models.loading import LoadedModel
from kvforge.plan import PrefillPlan, filled_key_value
from kvforge.steps import in_inference_mode, run_to_end


@dataclass(frozen=True)
class RewrittenRows:
    """Rows the cache holds already, recomputed from `layer` on (`run_layers`; RidgeFill's rescue):
    their residual stream entering `layer` h (B, R, E), their positions (B, R) and their row
    indices in the cache (B, R), -1 in both for a padding slot. From `layer` on they run with the
    pass's own rows (before them), their keys and values replace the held ones in place, and every
    row attends to the cache as it stands: a held row up to its own position, rewritten ones
    included."""

    layer: int
    h: torch.Tensor
    positions: torch.Tensor
    index: torch.Tensor


# What a prefill's steps yield between two layers of an exact, SPEED or RidgeFill chunk
# (`Engine.run_layers_steps`, `Engine._fill_in_chunks`, `Engine.run_plan_steps`), and within a long
# chunk's attention (`QUERY_BLOCK`): points where the caller may pause; between two chunks they
# yield None, where it pauses.
LAYER_BOUNDARY = "layer"
PAUSE_POINTS = (LAYER_BOUNDARY, QUERY_BLOCK)


class Engine:
    """Exact prefill and decode for one loaded model."""

    def __init__(self, model: LoadedModel, chunk_size: int | None = None):
        self.model = model
        self.adapter = model.adapter
        self.device = model.device
        self.dtype = model.dtype
        self.chunk_size = chunk_size  # None: the whole prompt in one pass
        keep_freed_memory()  # each step's activations reuse freed memory instead of faulting it in anew

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    def update_weights(self, tensors, lora_scale: float = 1.0) -> str:
        """New weights in place, full or a LoRA (`models.weights.update_weights`): call it between
        steps, not during one. Returns the kind applied."""
        from kvforge.models.weights import update_weights

        return update_weights(self.model, tensors, lora_scale)

    def release_unpacked_weights(self) -> int:
        """Keep each projection weight only in the packed form the bf16 kernels read
        (`ops.linear.release_unpacked`): about half the weights' memory in bf16 with the compiled
        kernels, nothing elsewhere. For serving from this engine: the model's attention and dense MLP
        modules no longer run their own forward (transformers' forward over the model reads freed
        memory; experts and other modules keep their weights). Returns the bytes freed."""
        from kvforge.ops.linear import release_unpacked

        return release_unpacked(self.adapter.projection_weights())

    @property
    def rollback_rows(self) -> int | None:
        """The most rows one step may have and still roll back part of them (None: no limit). A
        hybrid's recurrent layers keep the state after each token only for short steps."""
        return PER_TOKEN_STEPS if any(self.adapter.is_recurrent(layer) for layer in range(self.num_layers)) else None

    def new_cache(self, batch: int = 1, capacity: int = 256) -> KVCache:
        """An empty cache: K/V rows for attention layers, a fresh state for recurrent ones."""
        a = self.adapter
        layers = []
        for layer in range(a.num_layers):
            if a.is_recurrent(layer):
                channels, width, shape = a.state_spec(layer)
                layers.append(RecurrentLayerCache.empty_state(batch, channels, width, shape, self.dtype, self.device, capacity))
            else:
                heads, key_dim, value_dim = a.cache_dims(layer)
                layers.append(LayerCache.empty(batch, heads, key_dim, self.dtype, self.device, capacity, value_dim))
        return KVCache(layers)

    # --- the layer loop ----------------------------------------------------------------------
    def run_layer(
        self,
        layer: int,
        h: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        rope: dict,
        kind: RowKind | torch.Tensor = RowKind.EXACT,
        rewrite: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one decoder layer on rows h (B, T, E) at `positions` (B, T); their K/V are
        appended to the layer's cache first, so they attend to themselves and all earlier rows.
        `rewrite` (B, R): the first R rows of h are rows the cache holds already, at these row
        indices (-1: none), and replace them in place instead of being appended (`RewrittenRows`)."""
        return run_to_end(self.run_layer_steps(layer, h, positions, cache, rope, kind, rewrite))

    def run_layer_steps(self, layer: int, h: torch.Tensor, positions: torch.Tensor, cache: KVCache, rope: dict,
                        kind: RowKind | torch.Tensor = RowKind.EXACT, rewrite: torch.Tensor | None = None):
        """`run_layer` as a generator that returns its result and yields `QUERY_BLOCK` where its
        attention may pause (`attention_layer_steps`)."""
        a = self.adapter
        if a.is_recurrent(layer):
            if rewrite is not None:
                raise ValueError(f"layer {layer} is recurrent: its state cannot take a row back")
            padding = positions < 0
            mixed = self._recur(layer, h, positions, cache[layer], kind, padding if bool(padding.any()) else None)
            return a.mlp_block(layer, a.mix_output(layer, h, mixed))
        if rewrite is None:
            store = lambda held, k, v: held.append(k, v, positions, kind)  # noqa: E731
            return (yield from self.attention_layer_steps(layer, h, positions, cache, rope, store, new_rows=h.shape[1]))
        n = rewrite.shape[1]

        def store(held: LayerCache, k: torch.Tensor, v: torch.Tensor) -> None:
            held.rewrite(rewrite, k[:, :, :n], v[:, :, :n])
            held.append(k[:, :, n:], v[:, :, n:], positions[:, n:], kind)

        return (yield from self.attention_layer_steps(layer, h, positions, cache, rope, store))

    def attention_layer(self, layer: int, h: torch.Tensor, positions: torch.Tensor, cache: KVCache, rope: dict, store,
                        new_rows: int | None = None) -> torch.Tensor:
        """The one attention-layer body: rows h (B, T, E) at `positions` (B, T) project their
        queries, keys and values; `store(layer_cache, k, v)` puts the keys and values into the
        cache (appended, interleaved with filled rows, or rewriting held rows); then every row
        attends to the cache as it stands, masked by positions, and attention output and MLP give
        the next layer's input. `new_rows`: the layer's last rows are these rows' own (attention's
        mask-free path)."""
        return run_to_end(self.attention_layer_steps(layer, h, positions, cache, rope, store, new_rows))

    def attention_layer_steps(self, layer: int, h: torch.Tensor, positions: torch.Tensor, cache: KVCache, rope: dict, store,
                              new_rows: int | None = None):
        """`attention_layer` as a generator that returns its result and yields `QUERY_BLOCK` between
        two blocks of a long step's query rows (`attention.attend_steps`)."""
        a = self.adapter
        q, k, v, gate = a.attention_inputs(layer, h, rope)
        store(cache[layer], k, v)
        o = yield from attend_steps(q, a.attention_view(layer, cache[layer]), positions, a.scaling[layer], a.windows[layer], new_rows=new_rows)
        return a.mlp_block(layer, a.attention_output(layer, h, o, gate))

    def _recur(self, layer: int, h, positions, state: RecurrentLayerCache, kind, padding=None, per_token: bool | None = None):
        """Rows h (B, T, E) in position order through a recurrent layer's state update, which
        `state` takes (and logs as rows of `kind`); returns what `mix_output` reads. A short step
        continuing a state runs token by token and keeps every intermediate state (rollback)."""
        if per_token is None:
            per_token = state.length > 0 and h.shape[1] <= PER_TOKEN_STEPS
        mixed, window, states = self.adapter.mix(layer, h, state.conv, state.state, padding, per_token)
        state.advance(window, [state.state, *states], positions, kind)
        return mixed

    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        start: int = 0,
        end: int | None = None,
        rope: dict | None = None,
        rewritten: RewrittenRows | None = None,
    ) -> torch.Tensor:
        """Run layers [start, end) on rows h; returns the residual stream entering layer `end`.
        `rewritten`: held rows that join from their layer on and are rewritten in place
        (`RewrittenRows`); the returned stream holds h's rows only."""
        return run_to_end(self.run_layers_steps(h, positions, cache, start, end, rope, rewritten))

    def run_layers_steps(self, h: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int = 0, end: int | None = None,
                         rope: dict | None = None, rewritten: RewrittenRows | None = None):
        """`run_layers` as a generator that yields `LAYER_BOUNDARY` between two layers (and
        `QUERY_BLOCK` within a long step's attention) and returns its result."""
        end = self.num_layers if end is None else end
        rope = rope if rope is not None else self.adapter.rope(h, positions)
        kind = _row_kinds(positions)
        index = None
        for layer in range(start, end):
            if layer > start:
                yield LAYER_BOUNDARY
            if rewritten is not None and layer == rewritten.layer:
                h = torch.cat([rewritten.h.to(h.dtype), h], dim=1)
                positions = torch.cat([rewritten.positions, positions], dim=1)
                rope, index = self.adapter.rope(h, positions), rewritten.index
            h = yield from self.run_layer_steps(layer, h, positions, cache, rope, kind, index)
        return h if index is None else h[:, index.shape[1] :]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, logits: str = "last") -> torch.Tensor | None:
        """ids, positions (B, T) through every layer. logits: 'last' (B, V), 'all' (B, T, V) or 'none'."""
        return run_to_end(self._forward_steps(ids, positions, cache, logits))

    def forward_steps(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, logits: str = "last"):
        """`forward` as a generator that yields `LAYER_BOUNDARY` between two layers (and
        `QUERY_BLOCK` within a long chunk's attention) and returns forward's result: a server may run
        its running requests' decode step there, so a long chunk of prefill need not hold them for
        all its layers (`serve.scheduler`). The same layers on the same rows: the same bits as
        `forward`."""
        return (yield from in_inference_mode(self._forward_steps(ids, positions, cache, logits)))

    def _forward_steps(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, logits: str):
        h = yield from self.run_layers_steps(self.adapter.embed(ids), positions, cache)
        return self._logits(h, logits)

    def _logits(self, h: torch.Tensor, logits: str) -> torch.Tensor | None:
        if logits == "none":
            return None
        if logits == "last":
            return self.adapter.head(h[:, -1:]).squeeze(1).float()
        return self.adapter.head(h).float()

    # --- prefill and decode ------------------------------------------------------------------
    def prefill(
        self,
        prompts: list[list[int]] | torch.Tensor,
        cache: KVCache | None = None,
        chunk_size: int | None = None,
        logits: str = "last",
        plan: PrefillPlan | None = None,
        exact_shortcut: bool = True,
    ) -> tuple[torch.Tensor, KVCache]:
        """Prefill one or more prompts (left-padded into a batch), exactly or by a `PrefillPlan`.

        Returns the logits of each prompt's last token (B, V) (or every token's, (B, T, V), with
        logits='all', exact only) and the cache. With `cache`, the prompts continue the cached
        sequences. A plan whose rows are all full depth takes the plain exact path (batched,
        chunked); exact_shortcut=False runs it through `run_plan` all the same, so tests can hold
        the plan path to its invariant.
        """
        logits, cache, _ = run_to_end(self.prefill_steps(prompts, cache, chunk_size, logits, plan, exact_shortcut))
        return logits, cache

    def prefill_with_states(self, *args, **kwargs) -> tuple[torch.Tensor, KVCache, torch.Tensor | None]:
        """`prefill` (the same arguments), and what decoding may need of it beside the cache: a
        planned prefill's per-row residual streams entering their depths (`run_plan`; None for an
        exact prefill). `prefill_steps` run to its end."""
        return run_to_end(self.prefill_steps(*args, **kwargs))

    def prefill_steps(
        self,
        prompts: list[list[int]] | torch.Tensor,
        cache: KVCache | None = None,
        chunk_size: int | None = None,
        logits: str = "last",
        plan: PrefillPlan | None = None,
        exact_shortcut: bool = True,
    ):
        """`prefill_with_states` as a generator that yields between two chunks of an exact prefill
        (None: where a server runs its running requests' decode step: chunked prefill that shares
        the time with decoding), and `LAYER_BOUNDARY` between two layers of an exact, SPEED or
        RidgeFill chunk and `QUERY_BLOCK` within a long chunk's attention (where it may:
        `PAUSE_POINTS`), and returns its result. Plans run in chunks too: one whose rows are
        exact or absent (SPEED) as an exact prefill does, one that fills its rows from one split
        (RidgeFill, hybrids' too) in two phases (`_fill_in_chunks`); other plans run whole."""
        if cache is None and plan is None and _copies_of_one(prompts):
            # one prompt's samples (an RL group, `n` completions): prefill it once and copy its rows,
            # which the batch's attention then reads once (`LayerCache.shared`); each sample's cache
            # is that prompt's own, bit for bit
            last, one, _ = yield from self.prefill_steps([list(prompts[0])], chunk_size=chunk_size, logits=logits)
            copies = torch.zeros(len(prompts), dtype=torch.long, device=self.device)
            return (None if last is None else last.index_select(0, copies)), one.select_batch(copies), None
        ids, positions = self.pad_batch(prompts, cache)
        # A fresh cache is sized to the prompt exactly: attention then reads K/V that are one
        # contiguous block per layer, which the CPU attention kernel runs measurably faster on.
        cache = cache if cache is not None else self.new_cache(ids.shape[0], capacity=ids.shape[1])
        if plan is not None and not (exact_shortcut and plan.is_exact(self.num_layers)):
            if ids.shape[0] != 1 or logits != "last":
                raise ValueError("a non-exact prefill plan runs one prompt and returns last-token logits")
            plan.validate(ids.shape[1], self.num_layers)
            if chunk_size and ids.shape[1] > chunk_size and plan.fill is None and plan.choose is None:
                return (yield from in_inference_mode(self._plan_in_chunks(ids, positions, cache, plan, chunk_size)))
            if chunk_size and ids.shape[1] > chunk_size and self._leaves_at_one_split(plan):
                return (yield from in_inference_mode(self._fill_in_chunks(ids, positions, cache, plan, chunk_size)))
            with torch.inference_mode():
                h, states = self.run_plan(ids, positions, cache, plan)
                return self.adapter.head(h[:, -1:]).squeeze(1).float(), cache, states
        chunk = chunk_size or self.chunk_size or ids.shape[1]
        outputs = []
        for start in range(0, ids.shape[1], chunk):
            if start:
                yield
            end = min(start + chunk, ids.shape[1])
            want = logits if (end == ids.shape[1] or logits == "all") else "none"
            outputs.append((yield from self.forward_steps(ids[:, start:end], positions[:, start:end], cache, want)))
        if logits == "all":
            return torch.cat(outputs, dim=1), cache, None
        return outputs[-1], cache, None

    def _plan_in_chunks(self, ids, positions, cache: KVCache, plan: PrefillPlan, chunk: int):
        """A plan whose rows are exact or absent (SPEED: each row's depth known from the prompt's
        length, no fill, no choice) run `chunk` rows at a time, yielding None between chunks and
        the `PAUSE_POINTS` of a chunk's layers (`run_plan_steps`): each chunk's rows attend
        over the rows earlier chunks left in the cache at each layer, as they would in one pass.
        The rows' bits are `generate`'s with the same chunk size. Run under `in_inference_mode`
        (`prefill_steps`)."""
        for start in range(0, ids.shape[1], chunk):
            if start:
                yield
            end = min(start + chunk, ids.shape[1])
            rows = PrefillPlan(plan.depth[start:end], method=plan.method)
            h, _ = yield from self.run_plan_steps(ids[:, start:end], positions[:, start:end], cache, rows)
        return self.adapter.head(h[:, -1:]).squeeze(1).float(), cache, None

    def _leaves_at_one_split(self, plan: PrefillPlan) -> bool:
        """Whether `plan` fills every row it does not keep exact from one split on (RidgeFill), its
        choice of exact rows made at or below the split: what `_fill_in_chunks` runs."""
        left = plan.depth[plan.depth < self.num_layers]
        if plan.fill is None or left.numel() == 0 or not bool((left == left[0]).all()):
            return False
        split = int(left[0])
        return (plan.choose_at or split) <= split

    def _fill_in_chunks(self, ids, positions, cache: KVCache, plan: PrefillPlan, chunk: int):
        """A plan whose rows leave at one split and are filled past it (`_leaves_at_one_split`) in
        two phases of chunks, yielding None between chunks and `LAYER_BOUNDARY` between two layers
        of a chunk (and `QUERY_BLOCK` within an exact layer's attention, as `forward_steps` does): layers [0, split) over `chunk` rows at a time
        (every row is exact there); then the plan's choice of exact rows, which reads the cache of
        its layer and the tail's stream entering it, both whole by then; then layers [split, L) over
        chunks of about `chunk` rows' worth of work each (`_late_chunks`: exact rows, and the
        filled rows between them, written from their h_split in position order among them). Each
        exact row attends over the rows earlier chunks left, as in one pass; the rows' bits are
        `generate`'s with the same chunk size. Run under `in_inference_mode` (`prefill_steps`)."""
        a, tokens = self.adapter, ids.shape[1]
        depth = plan.depth.to(self.device)
        split = int(depth.min())
        read = (plan.choose_at or split) - 1 if plan.choose is not None else None  # the layer whose input the choice reads
        streams, read_streams = [], []
        for start in range(0, tokens, chunk):
            if start:
                yield
            rows = slice(start, min(start + chunk, tokens))
            h = a.embed(ids[:, rows])
            rope = a.rope(h, positions[:, rows])
            for layer in range(split):
                if layer:
                    yield LAYER_BOUNDARY
                if layer == read:
                    read_streams.append(h)
                h = yield from self.run_layer_steps(layer, h, positions[:, rows], cache, rope)
            streams.append(h)
        at_depth = torch.cat(streams, dim=1)  # every row's h_split
        if plan.choose is not None:
            depth = plan.choose(read + 1, torch.cat(read_streams, dim=1), positions, cache, depth).to(self.device)
            if not bool(((depth == split) | (depth == self.num_layers)).all()):
                raise ValueError("a plan's choice that runs in chunks keeps rows exact or leaves them at the split")
        starts = _late_chunks((depth == self.num_layers).tolist(), chunk, 1.0 if plan.fill_cost is None else plan.fill_cost)
        for start, end in zip(starts, starts[1:] + [tokens]):
            yield
            rows = slice(start, end)
            h = at_depth[:, rows]
            rope = a.rope(h, positions[:, rows])
            for layer in range(split, self.num_layers):
                if layer > split:
                    yield LAYER_BOUNDARY
                h = self._plan_layer(layer, h, positions, cache, rope, depth, plan, at_depth, rows=rows)
        states = at_depth if bool((depth < self.num_layers).any()) else None  # as one pass: None when no row left
        return a.head(h[:, -1:]).squeeze(1).float(), cache, states

    def run_plan(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, plan: PrefillPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run_plan_steps` run to its end."""
        return run_to_end(self.run_plan_steps(ids, positions, cache, plan))

    def run_plan_steps(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, plan: PrefillPlan):
        """A generator that yields `LAYER_BOUNDARY` between two layers (as `forward_steps` does) and
        returns (h, at_depth). Layer by layer: rows still within their depth run the layer exactly; rows past it are
        filled (their K/V written from the plan's predicted input, in position order among the
        exact rows, before those attend) or absent. Returns the residual stream leaving the last
        layer (1, T, E), final for full-depth rows only, and every row's stream entering its own
        depth (a row of full depth: entering the first layer any row left; None when none left),
        what a decode-time rescue recomputes a filled row from.

        Not under inference mode, so training under a plan (SPEED adaptation) backpropagates
        through it; `prefill` is the inference entry point (`in_inference_mode` for the steps)."""
        a = self.adapter
        depth = plan.depth.to(self.device)
        h = a.embed(ids)  # (1, T, E)
        rope = a.rope(h, positions)
        # each row's residual stream entering its own depth; a row still running holds the stream
        # entering the first layer any row left (for RidgeFill, whose rows all leave at the split,
        # every row's h_split: a map may read a filled row's neighbours)
        at_depth = None
        h_before, chosen = h, plan.choose is None
        for layer in range(self.num_layers):
            if layer:
                yield LAYER_BOUNDARY
            if not chosen and layer > 0 and (layer == plan.choose_at or bool((depth <= layer).any())):
                depth, chosen = plan.choose(layer, h_before, positions, cache, depth).to(self.device), True
            leaving = depth == layer
            if bool(leaving.any()):
                if at_depth is None:
                    at_depth = h.clone()
                else:
                    at_depth[:, leaving] = h[:, leaving]
            if not bool((depth <= layer).any()):  # below every row's depth: the plain exact layer, no gathers
                h_before, h = h, (yield from self.run_layer_steps(layer, h, positions, cache, rope))
                continue
            h = self._plan_layer(layer, h, positions, cache, rope, depth, plan, at_depth)
        return h, at_depth

    def _plan_layer(self, layer: int, h: torch.Tensor, positions: torch.Tensor, cache: KVCache, rope: dict, depth: torch.Tensor,
                    plan: PrefillPlan, at_depth: torch.Tensor | None, rows: slice | None = None) -> torch.Tensor:
        """One layer of a plan that some rows have left: the rows still within their depth run it
        exactly, rows past it are filled (written before the exact rows attend, in position order
        among them) or absent. `positions`, `depth` and `at_depth` are the whole prompt's; `h` and
        `rope` hold the rows `rows` (a chunk of the prompt; None: all of it), the only rows this
        call runs and writes. A filled row is written where an exact row of the whole prompt
        can see it (a sliding window), whichever chunk that row is in."""
        a = self.adapter
        chunk = rows if rows is not None else slice(None)
        exact_anywhere = depth > layer
        active, past = exact_anywhere[chunk], ~exact_anywhere[chunk]
        if plan.fill is None and not bool(active.any()):  # every row absent from here on (a chunk of shallow rows)
            return h
        h_active = h[:, active]
        chunk_positions = positions[:, chunk]

        def store(held: LayerCache, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
            present, kinds = active, RowKind.EXACT
            written = past & readable_rows(positions[0], exact_anywhere, a.windows[layer])[chunk] if plan.fill is not None else None
            if written is not None and bool(written.any()):  # a chunk may hold no row to fill
                whole = torch.zeros_like(exact_anywhere)
                whole[chunk] = written
                k_fill, v_fill = filled_key_value(plan.fill, a, layer, at_depth, whole, _rope_rows(rope, written))
                present = active | written
                is_exact = active[present]
                k, v = (k_fill, v_fill) if k is None else (_interleave(k, k_fill, is_exact), _interleave(v, v_fill, is_exact))
                kinds = torch.where(is_exact, int(RowKind.EXACT), int(RowKind.FILLED)).to(torch.uint8).unsqueeze(0)
            if k is not None:
                held.append(k, v, chunk_positions[:, present], kinds)

        if a.is_recurrent(layer):  # the state sees exact and filled rows in position order, absent rows never
            h_new = self._run_recurrent_plan(layer, h_active, active, past, at_depth, chunk_positions, cache, plan, chunk)
            return h if h_new is None else h.masked_scatter(active.view(1, -1, 1).expand_as(h), h_new)
        if not bool(active.any()):  # a chunk of filled rows only: written, nothing runs
            store(cache[layer], None, None)
            return h
        h_new = self.attention_layer(layer, h_active, chunk_positions[:, active], cache, _rope_rows(rope, active), store)
        # Out of place: autograd may still need the old h when a plan is trained through.
        return h.masked_scatter(active.view(1, -1, 1).expand_as(h), h_new)

    def _run_recurrent_plan(self, layer, h_active, active, past, at_depth, positions, cache, plan, chunk: slice) -> torch.Tensor | None:
        """One recurrent layer of `run_plan` over the rows `chunk` of the prompt (`active`, `past`
        and `positions` are that chunk's; chunks come in position order, so the state sees every
        row in order, as in one pass): a filled row runs the layer's projections and state update
        from its predicted input, in position order among the exact rows; its output projection and
        MLP are skipped (nothing reads them). Returns the active rows' new h (None: the chunk holds
        filled rows only)."""
        a = self.adapter
        present, kinds, rows = active, RowKind.EXACT, h_active
        if plan.fill is not None:
            whole = torch.zeros(at_depth.shape[1], dtype=torch.bool, device=past.device)
            whole[chunk] = past  # the fill reads every row's h_split and writes this chunk's filled rows
            x = plan.fill(layer, at_depth, whole)
            present = active | past
            is_exact = active[present]
            rows = _interleave_rows(h_active, x, is_exact)
            kinds = torch.where(is_exact, int(RowKind.EXACT), int(RowKind.FILLED)).to(torch.uint8).unsqueeze(0)
        core, z = self._recur(layer, rows, positions[:, present], cache[layer], kinds, per_token=False)
        if not bool(active.any()):
            return None
        if plan.fill is not None:
            core, z = core[:, is_exact], z[:, is_exact]
        return a.mlp_block(layer, a.mix_output(layer, h_active, (core, z)))

    def decode_step(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor | None = None) -> torch.Tensor:
        """One token per sequence (B,) at `positions` (B,; default: the next free ones) -> logits (B, V)."""
        positions = cache.next_positions() if positions is None else positions
        return self.forward(tokens.view(-1, 1).to(self.device), positions.view(-1, 1).to(self.device), cache, "last")

    def pad_batch(
        self, prompts: list[list[int]] | torch.Tensor, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-pad token lists into ids (B, T) and positions (B, T) (-1 on padding)."""
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.view(1, -1).tolist() if prompts.dim() == 1 else prompts.tolist()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise PromptError("empty prompt: give at least one token")
        longest = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), longest, dtype=torch.long)
        positions = torch.full((len(prompts), longest), -1, dtype=torch.long)
        start = cache.next_positions().cpu() if cache is not None else torch.zeros(len(prompts), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            n = len(prompt)
            ids[row, longest - n :] = torch.tensor(prompt, dtype=torch.long)
            positions[row, longest - n :] = torch.arange(n) + start[row]
        return ids.to(self.device), positions.to(self.device)

    def generate(self, prompts, config=None, on_text=None, plan: PrefillPlan | None = None, cache: KVCache | None = None):
        """See `kvforge.speculative.decode.generate`."""
        from kvforge.speculative.decode import generate  # the decode loop builds on the engine

        return generate(self, prompts, config, on_text, plan, cache)


def _copies_of_one(prompts) -> bool:
    """Whether `prompts` is a list of two or more copies of one prompt."""
    if isinstance(prompts, torch.Tensor) or len(prompts) < 2:
        return False
    first = list(prompts[0])
    return all(list(p) == first for p in prompts[1:])


def _row_kinds(positions: torch.Tensor) -> RowKind | torch.Tensor:
    """EXACT for real rows, PADDING where position is -1 (one value when there is no padding)."""
    padding = positions < 0
    if not bool(padding.any()):
        return RowKind.EXACT
    kinds = torch.full(positions.shape, int(RowKind.EXACT), dtype=torch.uint8, device=positions.device)
    kinds[padding] = int(RowKind.PADDING)
    return kinds


def _late_chunks(exact: list[bool], chunk: int, fill_cost: float) -> list[int]:
    """Where the late-layer chunks of a filled prompt start: each holds at most `chunk` exact rows'
    worth of work, its filled rows counted at `fill_cost` each (the plan's, from MACs: a filled row
    runs no attention or MLP, and on a hybrid's recurrent layer still its projections and state
    update)."""
    starts, work = [0], 0.0
    for row, is_exact in enumerate(exact):
        cost = 1.0 if is_exact else fill_cost
        if work + cost > chunk and row > starts[-1]:
            starts.append(row)
            work = 0.0
        work += cost
    return starts


def _rope_rows(rope: dict, rows: torch.Tensor) -> dict:
    """The rotary tables restricted to some rows (a bool mask over T)."""
    return {key: (cos[:, rows], sin[:, rows]) for key, (cos, sin) in rope.items()}


def _interleave_rows(exact: torch.Tensor, filled: torch.Tensor, is_exact: torch.Tensor) -> torch.Tensor:
    """Exact and filled rows (B, *, E) merged along dim 1 in position order."""
    out = exact.new_empty(exact.shape[0], is_exact.numel(), exact.shape[-1])
    out[:, is_exact] = exact
    out[:, ~is_exact] = filled
    return out


def _interleave(exact: torch.Tensor, filled: torch.Tensor, is_exact: torch.Tensor) -> torch.Tensor:
    """Exact and filled rows (B, H, *, D) merged along dim 2 in position order."""
    b, heads, _, d = exact.shape
    out = exact.new_empty(b, heads, is_exact.numel(), d)
    out[:, :, is_exact] = exact
    out[:, :, ~is_exact] = filled
    return out

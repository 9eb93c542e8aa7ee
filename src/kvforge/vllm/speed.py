"""SPEED inside vLLM: an out-of-tree Llama model class whose prompt rows other than the anchors
and the tail stop at the cut, and whose layers above the cut read only the rows they see.

Shapes: N rows scheduled this step (every request's, concatenated), E hidden size, n a
request's rows this step, m the rows it sees above the cut, T its planned prompt length.

The plugin registers `KvforgeSpeedForCausalLM`; `engine_args(...)` points a served Llama
checkpoint at it (`hf_overrides`: the architecture and the SPEED settings, which travel with the
model config into every vLLM process). Every step runs the same way:

- Layers [0, cut) run stock over every row: vLLM's own attention over its paged cache.
- Each request's rows are planned from its prompt length T. A request whose step starts at
  position 0 is a whole prompt (chunked prefill is off): its T is recorded, keyed by the first
  block of its block table (vLLM's metadata carries no request ids; the first block stays the
  request's until it finishes, and a later request on that block starts with its own prefill,
  which records it anew). A row at position p is *visible* above the cut when p >= T (every
  decode-phase row) or p is an anchor or in the tail (`fill.speed.full_depth_rows`, as
  kvforge's engine plans it).
- Layers [cut, L) run only this step's visible rows: norm, fused QKV, RoPE; their K/V written
  through the backend's cache update; then each request's rows attend over the visible rows of
  its own sequence (anchors, tail and generated tokens: a few hundred rows whatever the prompt's
  length), then the output projection and MLP. Those rows are also kept contiguous per request and
  layer (`kvforge.vllm.visible`), so a step appends to them rather than gathering them out of the
  paged cache at every layer; a request whose copy is gone gets it read back through its block
  table (`paged.read_rows`). Shallow rows leave the final hidden states as zeros: they are never
  sampled (the last prompt row is always in the tail), so prompt logprobs are meaningful only
  from the last prompt row on.

Two paths run this. A step holding a whole prompt with shallow rows changes the rows between the
layers, so it runs eager (`_speed`). A step whose every row is visible (every decode and
verification step, the n-gram proposer's included) is vLLM's own model, compiled where the engine
compiles (`engine_args(compiled=True)`): the layers above the cut have their attention backend
extended (`_with_visible_rows`), and vLLM's opaque attention op hands it the step, which it
attends over each request's visible rows. So a prefill skips the upper layers for the shallow
rows, and every decode step attends above the cut over m rows instead of the whole context: the
time saving of SPEED. The memory saving is not had: vLLM allocates blocks per request for every
layer, so the shallow rows' upper-layer slots stay allocated and unread (that needs a second KV
cache group in vLLM's allocator).

A SPEED adapter (`kvforge fit speed`) is merged into the served weights as vLLM loads them (W +
delta added to the checkpoint's q/k/v, gate/up, and for full fine-tuning o/down tensors, in fp32
and rounded once, as `lora.adapted_engine` merges them), so the served model is kvforge's adapted
model, after vLLM's in-place reload too; its recorded policy (cut, anchors, tail) is applied as
kvforge applies it.

Limits: reading rows back (a request whose visible rows were evicted) is by the CPU backend's
layout (`paged.read_rows`: the vec, vec16 and AMX-tile layouts), so on a GPU backend such a step
fails with `UnreadableLayout`; nothing here runs on a GPU in kvforge's tests. A preempted request is recomputed by
vLLM as one prompt of its prompt and output so far, which this class plans as a prompt (its output
rows then become shallow); a request whose first step starts past position 0 (a cache loaded by a
connector) is served at full visibility only if its first block carries no plan of an earlier
request. Both are avoided by an engine sized so nothing is preempted and by not loading caches
into a SPEED engine. An anchor past a short prompt makes every row of it full depth (kvforge's
engine refuses such a prompt; a server cannot). The connector's save path stores nothing from a
SPEED prefill (its upper layers bypass vLLM's attention op, where the save hook sits).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM

from kvforge.errors import KvforgeError
from kvforge.fill.lora import LoraAdapter, merged
from kvforge.fill.speed import SpeedConfig, resolve_config, speed_plan
from kvforge.vllm.paged import attention_context, layout_of, read_rows, slots_of, visible_mask, window, write_into
from kvforge.vllm.steps import check_whole_prompt_engine, step_metadata, whole_prompt_engine_args
from kvforge.vllm.visible import VisibleRows, VisibleRowsStore

ARCHITECTURE = "KvforgeSpeedForCausalLM"
SETTINGS = "kvforge_speed"  # the hf_config attribute the settings travel in
# kvforge's adapter targets -> the checkpoint's tensors they cover, in the fused rows' order
REBUILT_SPARE_ROWS = 64  # room past a request's rows when its visible rows are made, before they must grow
_CHECKPOINT_PARTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "o": ("self_attn.o_proj",),
    "down": ("mlp.down_proj",),
}


def engine_args(cut: str | float | int | None = None, anchors: str | None = None, tail: int | None = None, adapter: str | None = None,
                max_model_len: int = 4096, compiled: bool = False) -> dict:
    """Arguments for `vllm.LLM(...)` that serve a Llama checkpoint with SPEED: the model class and
    the settings (None: the adapter's recorded policy, else kvforge's defaults), whole-prompt
    prefill steps, no prefix caching; eager unless `compiled` (vLLM's compilation: its decode
    steps compiled, minutes of warm-up on a few cores)."""
    from pathlib import Path

    settings = {"cut": None if cut is None else str(cut), "anchors": anchors, "tail": tail}
    if adapter is not None:
        path = Path(adapter).expanduser().resolve()
        if not path.is_file():
            raise KvforgeError(f"adapter file {str(path)!r} does not exist: fit one with `kvforge fit speed`")
        settings["adapter"] = str(path)
    overrides = {"architectures": [ARCHITECTURE], SETTINGS: {k: v for k, v in settings.items() if v is not None}}
    return {"hf_overrides": overrides, **whole_prompt_engine_args(max_model_len, compiled)}


@dataclass
class SpeedRecord:
    """One request's whole-prompt step as planned: its rows, its prompt, the full-depth rows (with
    SPEED switched off, what SPEED would have run)."""

    tokens: int
    prompt: int  # T: the rows planned as prompt (the step's rows less the scored ones)
    full: torch.Tensor  # (T,) bool: anchors and tail; all True when the prompt has no shallow row
    reason: str | None = None  # why no row is shallow

    @property
    def shallow_rows(self) -> int:
        return int((~self.full).sum())


@dataclass
class Stats:
    speed_steps: int = 0  # steps that ran the SPEED path
    stock_steps: int = 0  # forwards that ran the stock model (no request with a shallow row, or vLLM's dummy runs)
    mixed_steps: int = 0  # SPEED steps holding a whole prompt beside other requests' continuing rows
    rebuilt: int = 0  # times a request's visible rows above the cut were read back from the paged cache
    last: list[SpeedRecord] = field(default_factory=list)  # the last whole-prompt step's requests


@dataclass
class _RequestRows:
    """One request's rows of a step above the cut."""

    span: tuple[int, int]  # its live rows' range among the step's live rows
    before: int  # the visible rows it had before this step; its live rows follow them
    visible: VisibleRows  # its visible rows' keys and values above the cut
    positions: torch.Tensor | None  # the positions of its visible rows through this step (for a sliding window's mask)


@dataclass
class _StepRows:
    """This step's rows above the cut: which run, and per request what they attend over."""

    live: torch.Tensor  # (N,) bool: the rows that run the upper layers
    scheduled: int  # the step's rows of requests (those past it pad the step, never live)
    requests: list[_RequestRows]
    masks: dict = field(default_factory=dict)  # (request, window) -> its sliding window's mask, once a step

    @property
    def all_live(self) -> bool:
        return bool(self.live[: self.scheduled].all())

    def attend(self, layer: int, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The live rows' q (rows, Hq·D), k and v (rows, H·D) of LlamaAttention `attn`, the
        `layer`-th above the cut: each request's rows put after its visible rows, then its queries
        attend over them -> (rows, Hq·D)."""
        hq, h, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q, k, v = q.reshape(-1, hq, d), k.reshape(-1, h, d), v.reshape(-1, h, d)
        size, out = window(attn), []
        for i, r in enumerate(self.requests):
            qa, qb = r.span
            if qb == qa:
                continue
            r.visible.put(layer, k[qa:qb], v[qa:qb], r.before)
            mask = None
            if size is not None:
                if (i, size) not in self.masks:
                    self.masks[i, size] = visible_mask(attn, r.positions[r.before :], r.positions)
                mask = self.masks[i, size]
            out.append(r.visible.attend(layer, q[qa:qb], r.before + qb - qa, attn.scaling, mask))
        return out[0] if len(out) == 1 else torch.cat(out) if out else q.new_zeros(0, hq * d)


@dataclass
class _Step:
    """What the layers above the cut see of the step being run: its rows while it runs the SPEED
    path with every row live, else None (vLLM's own attention)."""

    rows: _StepRows | None = None


@functools.cache
def _with_visible_rows(backend: type) -> type:
    """A subclass of attention backend `backend` for a layer above the cut. vLLM's attention op
    calls the backend from vLLM's compiled graph as from the eager model (the op is opaque to the
    compiler): while a step's every row is live (decode and verification steps of SPEED requests),
    each request's queries attend over its visible rows; otherwise the backend's own attention
    runs. Everything else, writing the step's keys and values into the paged cache included, is
    the backend's."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, **kwargs):
        rows = self.speed_step.rows
        if rows is None or output is None:
            return backend.forward(self, layer, query, key, value, kv_cache, attn_metadata, output=output, **kwargs)
        n = rows.scheduled  # every scheduled row is live, in the order of the spans
        output.view(query.shape[0], -1)[:n].copy_(rows.attend(self.speed_layer, self.speed_attn, query[:n], key[:n], value[:n]))
        return output

    return type(f"VisibleRows{backend.__name__}", (backend,), {"forward": forward, "__doc__": _with_visible_rows.__doc__})


def _see_visible_rows(impl, attn, layer: int, step: _Step) -> None:
    """Make attention backend `impl`, of the `layer`-th layer above the cut (vLLM's LlamaAttention
    `attn`), attend over the visible rows during SPEED steps (`_with_visible_rows`). The instance's
    class is swapped for a subclass of its own, so it stays the backend vLLM made (its state, the
    attributes vLLM sets on it later, vLLM's isinstance checks)."""
    impl.__class__ = _with_visible_rows(type(impl))
    impl.speed_attn, impl.speed_layer, impl.speed_step = attn, layer, step


class SpeedForCausalLM(LlamaForCausalLM):
    """vLLM's Llama with SPEED's layer-asymmetric visibility (see the module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        settings = dict(getattr(vllm_config.model_config.hf_config, SETTINGS, None) or {})
        check_whole_prompt_engine(vllm_config, "SPEED", "kvforge.vllm.speed.engine_args", compiles=True)
        layers = vllm_config.model_config.hf_config.num_hidden_layers
        self.lora = LoraAdapter.load(settings["adapter"]) if settings.get("adapter") else None
        if self.lora is not None and (self.lora.info or {}).get("method", "speed") != "speed":
            raise KvforgeError(f"adapter {settings['adapter']} was trained for {self.lora.info['method']}, not SPEED")
        self.served_dtype = vllm_config.model_config.dtype
        self.loaded = False  # whether the whole checkpoint has been loaded once
        self.config_speed: SpeedConfig = resolve_config(layers, settings.get("cut"), settings.get("anchors"), settings.get("tail"), self.lora)
        self.model_dir = vllm_config.model_config.model
        self.speed_enabled = True  # in-process switch: the benches time exact and SPEED on one engine
        # Scoring (`eval speed --engine vllm`): the last `score_tokens` rows of every prompt are a
        # reply scored with prompt logprobs: decode-phase rows, full depth, outside the plan.
        self.score_tokens = 0
        self.prompts: dict[int, torch.Tensor] = {}  # a request's first block -> its prompt's full-depth rows
        self.stats = Stats()
        self.step = _Step()
        self.visible = VisibleRowsStore(vllm_config.scheduler_config.max_num_seqs)
        self.upper = self.model.layers[self.config_speed.cut :]
        for i, layer in enumerate(self.upper):
            attention = layer.self_attn.attn
            _see_visible_rows(attention.impl, layer.self_attn, i, self.step)
        self.windowed = any(window(layer.self_attn) is not None for layer in self.upper)

    # --- loading -------------------------------------------------------------------------------
    def load_weights(self, weights):
        """vLLM's load, with the adapter's deltas added to the checkpoint's projection tensors on
        the way in: each tensor rounded to the served dtype, W + delta added in fp32 and rounded
        once, as `lora.adapted_engine` merges them. On the way in, so vLLM's reload (new weights
        in place) merges them again and vLLM shards the merged tensors as it shards any."""
        if self.lora is None:
            return super().load_weights(weights)
        from kvforge.models.streamed import directory_fingerprint

        self.lora.check_model(str(self.model_dir), directory_fingerprint(self.model_dir), len(self.model.layers))
        return super().load_weights(self._adapted(weights))

    def _adapted(self, weights):
        wanted = {}
        for layer in self.lora.trained_layers:
            for target in self.lora.targets:
                for part in _CHECKPOINT_PARTS[target]:
                    wanted[f"model.layers.{layer}.{part}.weight"] = (layer, target, part)
        found, deltas = set(), {}
        for name, tensor in weights:
            if name in wanted:
                layer, target, part = wanted[name]
                if (layer, target) not in deltas:
                    deltas[layer, target] = self.lora.delta(layer, target)
                delta = self._delta_rows(deltas[layer, target], target, part)
                if delta.shape != tensor.shape:
                    raise KvforgeError(f"adapter {self.lora.path}: {name} is {tuple(tensor.shape)} in the checkpoint, "
                                       f"its delta {tuple(delta.shape)}")
                tensor = merged(tensor.to(self.served_dtype), delta)
                found.add(name)
            yield name, tensor
        missing = sorted(set(wanted) - found)
        if missing and not self.loaded:  # the first load is the whole checkpoint; a reload may send part of it
            raise KvforgeError(f"adapter {self.lora.path} trains {missing[0]}, which the checkpoint does not hold")
        self.loaded = True

    def _delta_rows(self, delta: torch.Tensor, target: str, part: str) -> torch.Tensor:
        """The rows of a fused target's delta that belong to checkpoint tensor `part`."""
        parts = _CHECKPOINT_PARTS[target]
        if len(parts) == 1:
            return delta
        config = self.config
        if target == "qkv":
            head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            sizes = [config.num_attention_heads * head, config.num_key_value_heads * head, config.num_key_value_heads * head]
        else:  # gate, up: the MLP's intermediate rows each
            sizes = [config.intermediate_size, config.intermediate_size]
        start = sum(sizes[: parts.index(part)])
        return delta[start : start + sizes[parts.index(part)]]

    # --- forward -------------------------------------------------------------------------------
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        metadata = step_metadata()
        rows = None
        if metadata is not None and intermediate_tensors is None and inputs_embeds is None:
            rows = self._step_rows(metadata, input_ids.shape[0])
        if rows is None:
            self.stats.stock_steps += 1
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        self.stats.speed_steps += 1
        if not rows.all_live:  # a whole prompt with shallow rows: the rows above the cut change
            with torch.inference_mode():
                return self._speed(input_ids, positions, rows)
        # every row runs every layer: vLLM's model (compiled where the engine compiles), whose
        # attention above the cut reads each request's visible rows (`_with_visible_rows`)
        self.step.rows = rows
        try:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        finally:
            self.step.rows = None

    def _step_rows(self, m, total: int) -> _StepRows | None:
        """Plan this step's rows from the attention metadata; None when no request has a shallow
        row (the stock model computes the same thing)."""
        starts, seq_lens = m.query_start_loc.tolist(), m.seq_lens.tolist()
        table = m.block_table
        plans: list[torch.Tensor | None] = []
        records = []
        for i, s in enumerate(seq_lens):
            a, b = starts[i], starts[i + 1]
            if b == a:  # a padding entry: no rows
                plans.append(None)
                continue
            first = int(table[i, 0])
            if s == b - a:  # a whole prompt: plan it, and remember the plan for its later steps
                self.visible.drop(first)  # rows an earlier request on this block left
                record = self._plan(b - a)
                records.append(record)
                if self.speed_enabled and record.reason is None:
                    self.prompts[first] = record.full
                else:
                    self.prompts.pop(first, None)
            # a request keeps the plan it was prefilled with, whatever the switch says since
            plans.append(self.prompts.get(first))
        if records:
            self.stats.last = records
        if all(p is None for p in plans):
            return None
        self.stats.mixed_steps += 0 < len(records) < len(seq_lens)
        live = torch.zeros(total, dtype=torch.bool)
        requests, done = [], 0
        for i, (s, full) in enumerate(zip(seq_lens, plans)):
            a, b = starts[i], starts[i + 1]
            start = s - (b - a)  # the step's first position
            step_visible = _visible_rows(start, s, full)
            # the visible rows before the step: the prompt's anchors and tail, every row past the prompt
            before = start if full is None else int(full[:start].sum()) + max(0, start - full.numel())
            live[a:b] = step_visible
            n = int(step_visible.sum())
            positions = _visible_positions(s, full) if self.windowed else None
            visible = self._visible(int(table[i, 0]) if b > a else -1, start, table[i], full, before, n)
            requests.append(_RequestRows((done, done + n), before, visible, positions))
            done += n
        return _StepRows(live, starts[-1], requests)

    def _visible(self, first: int, start: int, block_row: torch.Tensor, full: torch.Tensor | None, before: int, n: int) -> VisibleRows:
        """The visible rows above the cut of a request whose step starts at position `start`, with
        room for the step's `n`: its own if they hold its `before` earlier rows, else new ones (a
        whole prompt has none) with those rows read out of the paged cache through its block table."""
        kept = full is not None and first >= 0  # a request without a plan sees every row: its copy is made for the step alone
        visible = self.visible.get(first) if kept and start > 0 else None
        if visible is None or visible.filled < before:
            attn = self.upper[0].self_attn
            _, _, kv_cache, _ = attention_context(attn.attn.layer_name)
            visible = VisibleRows(len(self.upper), attn.num_kv_heads, attn.head_dim, self.served_dtype, kv_cache.device,
                                  before + n + (REBUILT_SPARE_ROWS if kept else 0))
            if before:
                self.stats.rebuilt += 1
                slots = slots_of(block_row, _visible_positions(start, full), kv_cache.shape[2])
                for j, layer in enumerate(self.upper):
                    _, vllm_attention, kv_cache, _ = attention_context(layer.self_attn.attn.layer_name)
                    visible.put(j, *read_rows(kv_cache, slots, layout_of(vllm_attention)), 0)
            if kept:
                self.visible.put(first, visible)
        visible.reserve(before + n)
        visible.filled = before + n
        return visible

    def _plan(self, tokens: int) -> SpeedRecord:
        """kvforge's SPEED plan of a whole-prompt step's rows less the scored ones."""
        prompt, layers = tokens - self.score_tokens, len(self.model.layers)
        try:
            plan = speed_plan(prompt, self.config_speed, layers)
        except KvforgeError as exc:  # no prompt before the scored rows, or anchors past a short prompt: every row full depth
            return SpeedRecord(tokens, prompt, torch.ones(max(prompt, 0), dtype=torch.bool), str(exc))
        return SpeedRecord(tokens, prompt, plan.depth == layers, plan.reason)

    def _speed(self, input_ids, positions, rows: _StepRows) -> torch.Tensor:
        layers, cut = self.model.layers, self.config_speed.cut
        h, residual = self.model.embed_input_ids(input_ids), None
        for layer in layers[:cut]:
            h, residual = layer(positions, h, residual)
        live = rows.live
        x, res, pos = h[live], residual[live], positions[live]
        for j, layer in enumerate(layers[cut:]):
            attn = layer.self_attn
            xn, res = layer.input_layernorm(x, res)
            qkv, _ = attn.qkv_proj(xn)
            q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q, k = attn.rotary_emb(pos, q, k)
            _, vllm_attention, kv_cache, slots = attention_context(attn.attn.layer_name)
            if slots is not None:
                n = min(slots.numel(), live.numel())  # beyond the scheduled rows: padding, never live
                write_into(vllm_attention, kv_cache, k, v, slots[:n][live[:n]])
            o, _ = attn.o_proj(rows.attend(j, attn, q, k, v))
            hidden, res = layer.post_attention_layernorm(o, res)
            x = layer.mlp(hidden)
        final = h.new_zeros(h.shape)
        final[live] = self.model.norm(x, res)[0]
        return final


def _visible_rows(start: int, stop: int, full: torch.Tensor | None) -> torch.Tensor:
    """(stop - start,) bool: which of positions [start, stop) a request sees above the cut: its
    prompt's full-depth rows (`full`; None: every row) and every row past its prompt."""
    visible = torch.ones(stop - start, dtype=torch.bool)
    if full is not None:
        part = full[start:stop]
        visible[: part.numel()] = part
    return visible


def _visible_positions(length: int, full: torch.Tensor | None) -> torch.Tensor:
    """The positions under `length` a request sees above the cut."""
    return _visible_rows(0, length, full).nonzero().flatten()


def speed_stats(llm) -> list[Stats]:
    """The SPEED model's counters and last whole-prompt step, per worker, of an in-process engine."""
    return llm.apply_model(lambda model: model.stats if isinstance(model, SpeedForCausalLM) else None)


def set_speed(llm, enabled: bool, score_tokens: int | None = None) -> None:
    """Switch SPEED on or off for the prompts an in-process engine prefills after the call (off: every
    row visible at every layer, the stock model's computation; a running request keeps the plan
    it was prefilled with), and set how many rows at each prompt's end are a scored reply."""

    def apply(model):
        model.speed_enabled = enabled
        if score_tokens is not None:
            model.score_tokens = score_tokens

    llm.apply_model(apply)

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
  through the backend's cache update; then each request's rows attend over the visible rows
  of its own sequence, read back from the paged cache through its block table (`paged.read_rows`:
  anchors, tail and generated tokens, a few hundred rows whatever the prompt's length), then the
  output projection and MLP. Shallow rows leave the final hidden states as zeros: they are
  never sampled (the last prompt row is always in the tail), so prompt logprobs are meaningful
  only from the last prompt row on.

So a prefill skips the upper layers for the shallow rows, and every decode or verification step
(the n-gram proposer's included) attends above the cut over m rows instead of the whole
context: the time saving of SPEED. The memory saving is not had: vLLM allocates blocks per
request for every layer, so the shallow rows' upper-layer slots stay allocated and unread
(that needs a second KV cache group in vLLM's allocator).

A SPEED adapter (`kvforge fit speed`) is merged into the served weights as vLLM loads them (W +
delta added to the checkpoint's q/k/v, gate/up, and for full fine-tuning o/down tensors, in fp32
and rounded once, as `lora.adapted_engine` merges them), so the served model is kvforge's adapted
model, after vLLM's in-place reload too; its recorded policy (cut, anchors, tail) is applied as
kvforge applies it.

Limits: reading rows back is by the CPU backend's layout (`paged.read_rows`: the vec, vec16 and
AMX-tile layouts), so a GPU backend fails its first step with `UnreadableLayout`. A preempted request is recomputed by
vLLM as one prompt of its prompt and output so far, which this class plans as a prompt (its output
rows then become shallow); a request whose first step starts past position 0 (a cache loaded by a
connector) is served at full visibility only if its first block carries no plan of an earlier
request. Both are avoided by an engine sized so nothing is preempted and by not loading caches
into a SPEED engine. An anchor past a short prompt makes every row of it full depth (kvforge's
engine refuses such a prompt; a server cannot). The connector's save path stores nothing from a
SPEED prefill (its upper layers bypass vLLM's attention op, where the save hook sits).
`enforce_eager=True`: the SPEED path is eager Python with data-dependent row sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM

from kvforge.errors import KvforgeError
from kvforge.fill.lora import LoraAdapter, merged
from kvforge.fill.speed import SpeedConfig, resolve_config, speed_plan
from kvforge.vllm.paged import attend, attention_context, block_size, layout_of, read_rows, slots_of, visible_mask, window, write_into
from kvforge.vllm.steps import check_whole_prompt_engine, step_metadata, whole_prompt_engine_args

ARCHITECTURE = "KvforgeSpeedForCausalLM"
SETTINGS = "kvforge_speed"  # the hf_config attribute the settings travel in
# kvforge's adapter targets -> the checkpoint's tensors they cover, in the fused rows' order
_CHECKPOINT_PARTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "o": ("self_attn.o_proj",),
    "down": ("mlp.down_proj",),
}


def engine_args(cut: str | float | int | None = None, anchors: str | None = None, tail: int | None = None, adapter: str | None = None,
                max_model_len: int = 4096) -> dict:
    """Arguments for `vllm.LLM(...)` that serve a Llama checkpoint with SPEED: the model class and
    the settings (None: the adapter's recorded policy, else kvforge's defaults), whole-prompt
    prefill steps, no prefix caching, eager."""
    from pathlib import Path

    settings = {"cut": None if cut is None else str(cut), "anchors": anchors, "tail": tail}
    if adapter is not None:
        path = Path(adapter).expanduser().resolve()
        if not path.is_file():
            raise KvforgeError(f"adapter file {str(path)!r} does not exist: fit one with `kvforge fit speed`")
        settings["adapter"] = str(path)
    overrides = {"architectures": [ARCHITECTURE], SETTINGS: {k: v for k, v in settings.items() if v is not None}}
    return {"hf_overrides": overrides, **whole_prompt_engine_args(max_model_len)}


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
    last: list[SpeedRecord] = field(default_factory=list)  # the last whole-prompt step's requests


@dataclass
class _StepRows:
    """This step's rows above the cut: which run, and per request what they attend over."""

    live: torch.Tensor  # (N,) bool: the rows that run the upper layers
    live_spans: list[tuple[int, int]]  # per request: its live rows' range among all live rows
    seen_positions: list[torch.Tensor]  # per request: the positions it sees above the cut
    seen_slots: list[torch.Tensor]  # per request: their cache slots


class SpeedForCausalLM(LlamaForCausalLM):
    """vLLM's Llama with SPEED's layer-asymmetric visibility (see the module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        settings = dict(getattr(vllm_config.model_config.hf_config, SETTINGS, None) or {})
        check_whole_prompt_engine(vllm_config, "SPEED", "kvforge.vllm.speed.engine_args")
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
        with torch.inference_mode():
            return self._speed(input_ids, positions, rows)

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
        bs = block_size(self.model.layers[-1].self_attn.attn.layer_name)
        live = torch.zeros(total, dtype=torch.bool)
        live_spans, seen_positions, seen_slots, done = [], [], [], 0
        for i, (s, full) in enumerate(zip(seq_lens, plans)):
            a, b = starts[i], starts[i + 1]
            visible = torch.ones(s, dtype=torch.bool)
            if full is not None:
                visible[: min(s, full.numel())] = full[:s]
            live[a:b] = visible[s - (b - a) :]
            n = int(live[a:b].sum())
            live_spans.append((done, done + n))
            done += n
            seen = visible.nonzero().flatten()
            seen_positions.append(seen)
            seen_slots.append(slots_of(table[i], seen, bs))
        return _StepRows(live, live_spans, seen_positions, seen_slots)

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
        masks: dict[tuple[int, int | None], torch.Tensor | None] = {}
        for layer in layers[cut:]:
            attn = layer.self_attn
            xn, res = layer.input_layernorm(x, res)
            qkv, _ = attn.qkv_proj(xn)
            q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q, k = attn.rotary_emb(pos, q, k)
            _, vllm_attention, kv_cache, slots = attention_context(attn.attn.layer_name)
            if slots is not None:
                n = min(slots.numel(), live.numel())  # beyond the scheduled rows: padding, never live
                write_into(vllm_attention, kv_cache, k, v, slots[:n][live[:n]])
            layout = layout_of(vllm_attention)  # `read_rows` refuses one it cannot read
            out = []
            for i, ((qa, qb), seen, seen_slots) in enumerate(zip(rows.live_spans, rows.seen_positions, rows.seen_slots)):
                if qb > qa:
                    keys, values = read_rows(kv_cache, seen_slots, layout)
                    key = (i, window(attn))  # masks computed once a step, not once a layer
                    if key not in masks:
                        masks[key] = visible_mask(attn, pos[qa:qb], seen)
                    out.append(attend(attn, q[qa:qb], keys, values, masks[key]))
            o, _ = attn.o_proj(out[0] if len(out) == 1 else torch.cat(out))
            hidden, res = layer.post_attention_layernorm(o, res)
            x = layer.mlp(hidden)
        final = h.new_zeros(h.shape)
        final[live] = self.model.norm(x, res)[0]
        return final


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

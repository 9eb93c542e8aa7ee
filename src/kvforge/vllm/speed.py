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

A SPEED adapter (`kvforge fit speed`) is merged into the served weights on load (W + delta on
the fused QKV and gate/up projections, in fp32 and rounded once, as `lora.adapted_engine`), so
the served model is kvforge's adapted model; its recorded policy (cut, anchors, tail) is
applied as kvforge applies it.

Limits: a preempted request is recomputed by vLLM as one prompt of its prompt and output so far,
which this class plans as a prompt (its output rows then become shallow); a request whose first
step starts past position 0 (a cache loaded by a connector) is served at full visibility only if
its first block carries no record of an earlier request. Both are avoided by an engine sized so
nothing is preempted and by not loading caches into a SPEED engine. `enforce_eager=True`: the
SPEED path is eager Python with data-dependent row sets (see `vllm.ridgefill`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.llama import LlamaForCausalLM

from kvforge.errors import KvforgeError
from kvforge.fill.lora import LoraAdapter, merged
from kvforge.fill.speed import SpeedConfig, full_depth_rows, resolve_config
from kvforge.vllm.paged import READABLE, UnreadableLayout, attend, attention_context, layout_of, read_rows, write_into

logger = logging.getLogger("kvforge.vllm")
ARCHITECTURE = "KvforgeSpeedForCausalLM"
SETTINGS = "kvforge_speed"  # the hf_config attribute the settings travel in
_VLLM_TARGETS = {"qkv": "self_attn.qkv_proj", "gate_up": "mlp.gate_up_proj"}  # kvforge's fused targets in vLLM's Llama


def engine_args(cut: str | float | int | None = None, anchors: str | None = None, tail: int | None = None, adapter: str | None = None,
                max_model_len: int = 4096, dtype=None) -> dict:
    """Arguments for `vllm.LLM(...)` that serve a Llama checkpoint with SPEED: the model class and
    the settings (None: the adapter's recorded policy, else kvforge's defaults), whole-prompt
    prefill steps, no prefix caching, eager, and a block size whose cache layout kvforge reads
    (16 where AMX would pack bf16 blocks of 32 or more into tiles)."""
    from pathlib import Path

    settings = {"cut": None if cut is None else str(cut), "anchors": anchors, "tail": tail}
    if adapter is not None:
        path = Path(adapter).expanduser().resolve()
        if not path.is_file():
            raise KvforgeError(f"adapter file {str(path)!r} does not exist: fit one with `kvforge fit speed`")
        settings["adapter"] = str(path)
    args = {
        "hf_overrides": {"architectures": [ARCHITECTURE], SETTINGS: {k: v for k, v in settings.items() if v is not None}},
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max_model_len,
        "max_model_len": max_model_len,
        "enable_prefix_caching": False,
        "enforce_eager": True,
    }
    if dtype in (torch.bfloat16, "bfloat16", "bf16") and torch.cpu._is_amx_tile_supported():
        args["block_size"] = 16
    return args


@dataclass
class SpeedRecord:
    """What one request's whole-prompt step ran: its rows, its planned prompt, the full-depth rows."""

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
    stock_steps: int = 0  # steps where no request has a shallow row
    mixed_steps: int = 0  # SPEED steps holding a whole prompt beside other requests' continuing rows
    last: list[SpeedRecord] = field(default_factory=list)  # the last whole-prompt step's requests


@dataclass
class _StepRows:
    """This step's rows above the cut: which run, and per request what they attend over."""

    live: torch.Tensor  # (N,) bool: the rows that run the upper layers
    queries: list[tuple[int, int]]  # per request: its live rows' range among all live rows
    seen_positions: list[torch.Tensor]  # per request: the positions it sees above the cut
    seen_slots: list[torch.Tensor]  # per request: their cache slots


class SpeedForCausalLM(LlamaForCausalLM):
    """vLLM's Llama with SPEED's layer-asymmetric visibility (see the module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        settings = dict(getattr(vllm_config.model_config.hf_config, SETTINGS, None) or {})
        scheduler = vllm_config.scheduler_config
        if scheduler.enable_chunked_prefill or scheduler.max_num_batched_tokens < vllm_config.model_config.max_model_len:
            raise KvforgeError("SPEED in vLLM plans each prompt from its first step: set enable_chunked_prefill=False and "
                               "max_num_batched_tokens >= max_model_len (kvforge.vllm.speed.engine_args does)")
        if not vllm_config.model_config.enforce_eager:
            raise KvforgeError("SPEED in vLLM runs eager: set enforce_eager=True (kvforge.vllm.speed.engine_args does)")
        if vllm_config.cache_config.enable_prefix_caching:
            raise KvforgeError("SPEED in vLLM needs enable_prefix_caching=False: a block's upper-layer rows depend on its prompt's plan")
        layers = vllm_config.model_config.hf_config.num_hidden_layers
        self.lora = LoraAdapter.load(settings["adapter"]) if settings.get("adapter") else None
        if self.lora is not None and (self.lora.info or {}).get("method", "speed") != "speed":
            raise KvforgeError(f"adapter {settings['adapter']} was trained for {self.lora.info['method']}, not SPEED")
        self.config_speed: SpeedConfig = resolve_config(layers, settings.get("cut"), settings.get("anchors"), settings.get("tail"), self.lora)
        self.model_dir = vllm_config.model_config.model
        self.block_size = vllm_config.cache_config.block_size
        self.speed_enabled = True  # in-process switch: the benches time exact and SPEED on one engine
        # Scoring (`eval speed --engine vllm`): the last `score_tokens` rows of every prompt are a
        # reply scored with prompt logprobs: decode-phase rows, full depth, outside the plan.
        self.score_tokens = 0
        self.prompts: dict[int, torch.Tensor] = {}  # a request's first block -> its prompt's full-depth rows
        self.stats = Stats()

    # --- loading -------------------------------------------------------------------------------
    def load_weights(self, weights):
        """vLLM's load, then the adapter's deltas merged into the fused projections (before vLLM's
        post-load processing packs them)."""
        loaded = super().load_weights(weights)
        if self.lora is not None:
            from kvforge.models.streamed import directory_fingerprint

            fingerprint = directory_fingerprint(self.model_dir)
            self.lora.check_model(str(self.model_dir), fingerprint, len(self.model.layers))
            with torch.no_grad():
                for layer in self.lora.trained_layers:
                    for target in self.lora.targets:
                        if target not in _VLLM_TARGETS:
                            raise KvforgeError(f"adapter {self.lora.path} trains {target}, which SPEED in vLLM does not merge "
                                               "(LoRA on qkv and gate_up is supported)")
                        weight = self.model.layers[layer].get_submodule(_VLLM_TARGETS[target]).weight
                        weight.copy_(merged(weight, self.lora.delta(layer, target)))
        return loaded

    # --- forward -------------------------------------------------------------------------------
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        metadata = _metadata()
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
        table, bs = m.block_table, self.block_size
        plans: list[torch.Tensor | None] = []
        records = []
        for i, s in enumerate(seq_lens):
            a, b = starts[i], starts[i + 1]
            first = int(table[i, 0])
            if s == b - a:  # a whole prompt: plan it, and remember the plan for its later steps
                record = self._plan(b - a)
                records.append(record)
                if self.speed_enabled and record.reason is None:
                    self.prompts[first] = record.full
                else:
                    self.prompts.pop(first, None)
            plans.append(self.prompts.get(first) if self.speed_enabled else None)
        if records:
            self.stats.last = records
        if all(p is None for p in plans):
            return None
        self.stats.mixed_steps += 0 < len(records) < len(seq_lens)
        live = torch.zeros(total, dtype=torch.bool)
        queries, seen_positions, seen_slots, done = [], [], [], 0
        for i, (s, full) in enumerate(zip(seq_lens, plans)):
            a, b = starts[i], starts[i + 1]
            visible = torch.ones(s, dtype=torch.bool)
            if full is not None:
                visible[: min(s, full.numel())] = full[:s]
            live[a:b] = visible[s - (b - a) :]
            n = int(live[a:b].sum())
            queries.append((done, done + n))
            done += n
            seen = visible.nonzero().flatten()
            seen_positions.append(seen)
            seen_slots.append(table[i, seen // bs].long() * bs + seen % bs)
        return _StepRows(live, queries, seen_positions, seen_slots)

    def _plan(self, tokens: int) -> SpeedRecord:
        prompt = tokens - self.score_tokens
        if prompt < 1:
            return SpeedRecord(tokens, prompt, torch.ones(max(prompt, 0), dtype=torch.bool), "the prompt is no longer than its scored rows")
        if self.config_speed.cut == len(self.model.layers):
            return SpeedRecord(tokens, prompt, torch.ones(prompt, dtype=torch.bool), "the cut is the model's depth")
        try:
            full = full_depth_rows(prompt, self.config_speed)
        except KvforgeError as exc:  # anchors past a short prompt: every row full depth
            return SpeedRecord(tokens, prompt, torch.ones(prompt, dtype=torch.bool), str(exc))
        if bool(full.all()):
            return SpeedRecord(tokens, prompt, full, "every prompt row is an anchor or in the tail")
        return SpeedRecord(tokens, prompt, full)

    def _speed(self, input_ids, positions, rows: _StepRows) -> torch.Tensor:
        layers, cut = self.model.layers, self.config_speed.cut
        h, residual = self.model.embed_input_ids(input_ids), None
        for layer in layers[:cut]:
            h, residual = layer(positions, h, residual)
        live = rows.live
        x, res, pos = h[live], residual[live], positions[live]
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
            layout = layout_of(vllm_attention)
            if layout not in READABLE:
                raise UnreadableLayout(f"SPEED in vLLM reads the rows above the cut from the paged cache, and vLLM keeps it in the "
                                       f"{layout!r} layout: serve with block_size=16 (kvforge.vllm.speed.engine_args does on AMX)")
            out = []
            for (qa, qb), seen, seen_slots in zip(rows.queries, rows.seen_positions, rows.seen_slots):
                if qb > qa:
                    keys, values = read_rows(kv_cache, seen_slots, layout)
                    out.append(attend(attn, q[qa:qb], pos[qa:qb], keys, values, seen))
            o, _ = attn.o_proj(torch.cat(out))
            hidden, res = layer.post_attention_layernorm(o, res)
            x = layer.mlp(hidden)
        final = h.new_zeros(h.shape)
        final[live] = self.model.norm(x, res)[0]
        return final


def _metadata():
    """The attention metadata of this forward (the target model's under speculative decoding),
    or None (vLLM's warm-up and dummy runs)."""
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0] if metadata else None
    if not isinstance(metadata, dict) or not metadata:
        return None
    return next(iter(metadata.values()))


def speed_stats(llm) -> list[Stats]:
    """The SPEED model's counters and last whole-prompt step, per worker, of an in-process engine."""
    return llm.apply_model(lambda model: model.stats if isinstance(model, SpeedForCausalLM) else None)


def set_speed(llm, enabled: bool, score_tokens: int | None = None) -> None:
    """Switch SPEED on or off on an in-process engine (off: every row visible at every layer, the
    stock model's computation), and set how many rows at each prompt's end are a scored reply."""

    def apply(model):
        model.speed_enabled = enabled
        if score_tokens is not None:
            model.score_tokens = score_tokens

    llm.apply_model(apply)

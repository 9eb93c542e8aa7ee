"""RidgeFill inside vLLM: an out-of-tree Llama model class whose prefill fills the late layers'
cache from kvforge's ridge maps, measured against vLLM's own exact prefill.

Shapes: N rows scheduled this step (every request's, concatenated), E hidden size, H KV heads,
Hq query heads, D head dim; per request T prompt rows.

The plugin registers `KvforgeRidgeFillForCausalLM`; `engine_args(maps, ...)` points a served
checkpoint at it (`hf_overrides`: the architecture and the settings, which travel with the model
config into every vLLM process) and turns chunked prefill off, so a prompt is prefilled in one
step, whole. The class is vLLM's `LlamaForCausalLM` with one forward added:

- A step where every scheduled request is a whole prompt from position 0 (query length = sequence
  length, read off the layers' attention metadata) is a RidgeFill prefill. Each prompt is planned
  as kvforge's engine plans it (`planned_exact_rows`: sinks, special tokens, tail; then the rows the
  tail attends to most at layer split - 1, `most_attended`). Layers [0, split) run stock, over every
  row. At each late layer, every row's K/V is computed -- the exact rows' from their own residual
  stream, the filled rows' from the map's prediction x @ W_l + b_l (x = h_split, beside the
  previous row's h_split in the same prompt when the maps read it; h_split itself at the split
  layer; maps of the normed input folded with the layer's norm gain and K/V projection into one
  multiply, `fold_kv`, as kvforge's `MapFill` does) -- and written through vLLM's own cache update (`do_kv_cache_update`: the CPU cache
  layout is the kernel's business); then only the exact rows attend, over this step's K/V of their
  own prompt (the whole prompt is in this step, so no paged read is needed), and run the output
  projection and MLP. Filled rows leave the final hidden states as zeros: only the last row (exact)
  is sampled, so prompt logprobs of filled rows are not meaningful.
- Any other step (decode, speculative verification, a continuation over loaded or cached rows, a
  step mixing a prefill with decodes) runs the stock model: decoding over a forged cache is vLLM's,
  after RidgeFill's decode-time rescue has recomputed the filled rows the step's pending token
  calls for (`vllm.rescue`: kvforge's schedule, so the tokens are `generate --method ridgefill`'s;
  the setting `rescue: False` turns it off, as `--no-rescue` does). Drafts of kvforge's n-gram
  proposer end before a token that would trigger a rescue, as in kvforge's engine.

Prefix caching must be off (a filled block must never be reused as exact); `engine_args` does it.
`enforce_eager=True`: vLLM's torch.compile traces `LlamaModel.forward`, which this class leaves to
the stock path; the RidgeFill path is eager Python with data-dependent row sets, so compiling it
would need a fixed-shape formulation (masks instead of gathers) or a compiled region per layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from vllm.model_executor.models.llama import LlamaForCausalLM

from kvforge.errors import KvforgeError
from kvforge.fill.maps import RidgeMaps, fold_kv
from kvforge.fill.rescue import DecodeRescue, RescueConfig
from kvforge.fill.ridgefill import RidgeFillConfig, map_previous_rows, most_attended, peak_attention, planned_exact_rows, preset
from kvforge.vllm.paged import attend, attention_context, layout_of, unreadable, visible_mask, window, write_rows
from kvforge.vllm.rescue import RescueBook, late_layers, publish
from kvforge.vllm.steps import check_whole_prompt_engine, step_metadata, whole_prompt_engine_args

logger = logging.getLogger("kvforge.vllm")
ARCHITECTURE = "KvforgeRidgeFillForCausalLM"
SETTINGS = "kvforge_ridgefill"  # the hf_config attribute the settings travel in


def engine_args(maps: str | Path, preset_name: str = "fast", max_model_len: int = 4096, **overrides) -> dict:
    """Arguments for `vllm.LLM(...)` (or `vllm serve` flags) that serve a Llama checkpoint with
    RidgeFill prefill: the model class, the settings (`overrides`: split, tail, attended_rows,
    sinks; rescue False for none, or a dict of `RescueConfig` fields), whole-prompt prefill steps,
    no prefix caching, eager."""
    maps = Path(maps).expanduser().resolve()
    if not maps.is_file():
        raise KvforgeError(f"maps file {str(maps)!r} does not exist: fit them with `kvforge fit ridgefill`")
    settings = {"maps": str(maps), "preset": preset_name, **{k: v for k, v in overrides.items() if v is not None}}
    return {"hf_overrides": {"architectures": [ARCHITECTURE], SETTINGS: settings}, **whole_prompt_engine_args(max_model_len)}


@dataclass
class PrefillRecord:
    """What one request's prefill ran: its length and which rows stayed exact."""

    tokens: int
    exact: torch.Tensor  # (T,) bool
    reason: str | None = None  # why every row stayed exact
    context: int = 0  # rows planned: the prompt's, less the scored rows at its end

    @property
    def filled_rows(self) -> int:
        return int((~self.exact).sum())


@dataclass
class Stats:
    filled_prefills: int = 0
    exact_prefills: int = 0  # whole-prompt prefills that filled nothing (too short)
    stock_steps: int = 0  # steps that ran the stock model (decode, mixed, continuation)
    rescue_events: int = 0  # (request, step) pairs whose pending token recomputed filled rows first
    rescued_rows: int = 0
    last: list[PrefillRecord] = field(default_factory=list)  # the last RidgeFill step's requests


class RidgeFillForCausalLM(LlamaForCausalLM):
    """vLLM's Llama with RidgeFill prefill (see the module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        settings = dict(getattr(vllm_config.model_config.hf_config, SETTINGS, None) or {})
        if "maps" not in settings:
            raise KvforgeError(f"{ARCHITECTURE} needs hf_overrides {{'{SETTINGS}': {{'maps': PATH, ...}}}}: "
                               "use kvforge.vllm.ridgefill.engine_args")
        check_whole_prompt_engine(vllm_config, "RidgeFill", "kvforge.vllm.ridgefill.engine_args")
        layers = vllm_config.model_config.hf_config.num_hidden_layers
        choice = {k: settings[k] for k in ("split", "tail", "attended_rows", "sinks") if k in settings}
        self.config_ridgefill: RidgeFillConfig = preset(settings.get("preset", "fast"), layers, **choice)
        rescue = settings.get("rescue", True)  # True: kvforge's default schedule; False: off; or RescueConfig's fields
        if rescue is False:
            self.config_ridgefill = replace(self.config_ridgefill, rescue=None)
        elif isinstance(rescue, dict):
            self.config_ridgefill = replace(self.config_ridgefill, rescue=RescueConfig(**rescue))
        elif rescue is not True:
            raise KvforgeError(f"RidgeFill's rescue setting takes True, False or a dict of RescueConfig fields, not {rescue!r}")
        self.config_ridgefill.check(layers)
        if self.config_ridgefill.split >= layers:
            raise KvforgeError(f"RidgeFill split {self.config_ridgefill.split} fills no layer of this {layers}-layer model")
        self.maps_path = settings["maps"]
        self.model_dir = vllm_config.model_config.model
        self.dtype = vllm_config.model_config.dtype
        self.ridgefill_enabled = True  # in-process switch: the benches time exact and RidgeFill on one engine
        self.rescue_enabled = True  # in-process switch for the prompts filled from then on (the evaluation's arms)
        self.maps_stale = False  # the served weights were updated (`kvforge.vllm.weights`): the maps fit others
        self.prepared = False  # the first load_weights ran `_prepare`
        # Scoring: the last `score_tokens` rows of every prompt are a continuation scored with
        # prompt logprobs (`eval ridgefill --engine vllm`): exact, and outside the plan, which
        # covers the rows before them as if they were the whole prompt -- what kvforge's eval
        # computes with a RidgeFill cache of the context and the continuation run over it.
        self.score_tokens = int(settings.get("score_tokens", 0))
        self.stats = Stats()
        self.rescues = RescueBook(limit=2 * vllm_config.scheduler_config.max_num_seqs + 8)
        self.special_ids: set[int] = set()
        self.fill_maps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # maps of the input, by late layer
        self.fill_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # maps of the normed input, folded
        self.maps_read_previous = False
        self.kv_weights: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    # --- loading -------------------------------------------------------------------------------
    def load_weights(self, weights):
        loaded = super().load_weights(weights)
        if self.prepared:  # a second load is an in-place update (`Worker.reload_weights`), whoever sends it
            self._weights_updated()
        else:
            self._prepare()
            self.prepared = True
        return loaded

    def _prepare(self) -> None:
        """Check the maps against the served weights; keep what the fill path needs in the model's
        dtype: each late layer's map, and its K/V projection rows (vLLM's CPU linear layers drop
        their weight tensors once packed for oneDNN, so the fused QKV weight is sliced now)."""
        from transformers import AutoTokenizer

        from kvforge.models.streamed import directory_fingerprint

        maps = RidgeMaps.load(self.maps_path)
        layers, split = len(self.model.layers), self.config_ridgefill.split
        maps.check_model(str(self.model_dir), directory_fingerprint(self.model_dir), layers)
        if not maps.has_split(split):
            raise KvforgeError(f"maps {self.maps_path} hold splits {maps.splits}, not split {split}")
        self.maps_read_previous = maps.reads_previous
        first = split - 1 if self.config_ridgefill.attended_rows else split
        for l in range(first, layers):
            attn = self.model.layers[l].self_attn
            w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
            self.kv_weights[l] = (w[attn.q_size :].detach().clone(), None if b is None else b[attn.q_size :].detach().clone())
        for l in range(split + 1, layers):
            if maps.predicts_normed:  # Llama's RMSNorm: gain = weight
                a, c = fold_kv(*maps.weights(split, l), self.model.layers[l].input_layernorm.weight.detach(), *self.kv_weights[l])
                self.fill_kv[l] = (a.to(self.dtype), c.to(self.dtype))
            else:
                self.fill_maps[l] = maps.weights(split, l, self.dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])

    def _weights_updated(self) -> None:
        """After an in-place weight update the maps fit the weights before it, so every prompt
        from then on is prefilled exactly (fit maps for the new weights and start an engine with
        them to fill again). The weights are not read here: vLLM's reload calls `load_weights`
        before its post-load processing, while layers are between their old and new states."""
        if not self.maps_stale:
            logger.warning("RidgeFill off: the served weights were updated, and the maps %s were fitted for the weights before; "
                           "prompts are prefilled exactly", self.maps_path)
        self.maps_stale = True
        self.fill_maps, self.fill_kv, self.kv_weights = {}, {}, {}  # what the fill read of the old weights

    # --- forward -------------------------------------------------------------------------------
    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        filling = self.ridgefill_enabled and not self.maps_stale and inputs_embeds is None
        spans = self._whole_prompts(input_ids) if filling else None
        plans = [self._plan(input_ids[a:b]) for a, b in spans] if spans else []
        if not any(r.reason is None for r in plans):
            self.stats.stock_steps += not plans
            self.stats.exact_prefills += len(plans)
            if plans:  # whole prompts too short to fill: what ran is still this step's record
                self.stats.last = plans
            if inputs_embeds is None and intermediate_tensors is None:
                with torch.inference_mode():
                    self._rescue_due(input_ids)
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        with torch.inference_mode():
            return self._ridgefill(input_ids, positions, spans, plans)

    def _whole_prompts(self, input_ids: torch.Tensor) -> list[tuple[int, int]] | None:
        """Each request's rows (start, end) when every request of this step is a whole prompt from
        position 0, else None (no metadata: vLLM's warm-up runs)."""
        m = step_metadata()
        if m is None:
            return None
        starts = m.query_start_loc.tolist()
        if starts[-1] != input_ids.numel():
            return None
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        if lengths != m.seq_lens.tolist() or min(lengths, default=0) < 2:
            return None
        return list(zip(starts, starts[1:]))

    def _rescue_due(self, input_ids: torch.Tensor) -> None:
        """Before a stock step: the filled rows each request's pending token calls for, recomputed
        (`vllm.rescue`); a whole prompt from position 0 starts a request with no rescue."""
        m = step_metadata()
        if m is None or not self.rescues.by_block:
            return
        starts, seq_lens = m.query_start_loc.tolist(), m.seq_lens.tolist()
        for i, s in enumerate(seq_lens):
            a, b = starts[i], starts[i + 1]
            if b == a:  # a padding entry: no rows
                continue
            first = int(m.block_table[i, 0])
            if s == b - a:  # a prompt prefilled exactly on a block a finished request may have held
                self.rescues.start(first, None)
                continue
            found = self.rescues.due(first, s - (b - a), input_ids[a:b].tolist())
            if found is not None:
                rescue, rows = found
                late_layers(self, rescue, rows, m.block_table[i])
                self.stats.rescue_events += 1
                self.stats.rescued_rows += len(rows)

    def _start_rescues(self, input_ids: torch.Tensor, stream: torch.Tensor, spans, plans: list[PrefillRecord]) -> None:
        """After a RidgeFill prefill: each filled request's rescue (its prompt, filled rows and
        split-layer states), under its first block, and its schedule for the proposer."""
        if self.config_ridgefill.rescue is not None and not self._rescue_readable():
            self.config_ridgefill = replace(self.config_ridgefill, rescue=None)
        config = self.config_ridgefill
        table = step_metadata().block_table
        for i, (record, (a, b)) in enumerate(zip(plans, spans)):
            rescue = None
            if record.reason is None and config.rescue is not None and self.rescue_enabled and not self.score_tokens:
                prompt, filled = input_ids[a:b].tolist(), ~record.exact.cpu()
                rescue = DecodeRescue(prompt, stream[a:b].unsqueeze(0).clone(), filled, config.split, config.rescue)
                publish(prompt, filled, config.split, config.rescue)
            self.rescues.start(int(table[i, 0]), rescue)

    def _rescue_readable(self) -> bool:
        """Whether the rescue can read rows back from this engine's cache (`paged.unreadable`);
        if not, it is turned off with a warning before any request relies on it."""
        _, vllm_attention, kv_cache, _ = attention_context(self.model.layers[-1].self_attn.attn.layer_name)
        reason = unreadable(kv_cache, layout_of(vllm_attention))
        if reason is not None:
            logger.warning("RidgeFill's decode-time rescue off: %s", reason)
        return reason is None

    def _plan(self, ids: torch.Tensor) -> PrefillRecord:
        context = ids.numel() - self.score_tokens
        if context < 1:
            return PrefillRecord(ids.numel(), torch.ones_like(ids, dtype=torch.bool), "the prompt is no longer than its scored rows", 0)
        exact, reason = planned_exact_rows(ids[:context].tolist(), self.config_ridgefill, self.special_ids)
        scored = torch.ones(self.score_tokens, dtype=torch.bool)
        return PrefillRecord(ids.numel(), torch.cat([exact, scored]).to(ids.device), reason, context)

    def _ridgefill(self, input_ids, positions, spans, plans: list[PrefillRecord]) -> torch.Tensor:
        config, layers = self.config_ridgefill, self.model.layers
        split = config.split
        h, residual = self.model.embed_input_ids(input_ids), None
        for layer in layers[: split - 1]:
            h, residual = layer(positions, h, residual)
        # the stream entering split - 1 (a copy: vLLM's fused add-norm updates its residual in place)
        before = h.clone() if residual is None else h + residual
        h, residual = layers[split - 1](positions, h, residual)
        stream = h + residual  # h_split, every row
        exact = torch.cat([r.exact if r.reason is None else torch.ones_like(r.exact) for r in plans])
        if config.attended_rows:
            exact = self._keep_attended(before, positions, spans, plans, exact)
        for record, (a, b) in zip(plans, spans):
            record.exact = exact[a:b].clone()
        self._start_rescues(input_ids, stream, spans, plans)
        filled = ~exact
        # exact rows keep vLLM's (hidden, residual) pair, so each norm adds and normalises them as the
        # stock layers do (in fp32 inside the fused add-norm); filled rows need only the summed stream
        x, res, source = h[exact], residual[exact], stream[filled]
        map_input = source
        if self.maps_read_previous:  # beside each filled row's h_split, its prompt's previous row's (as kvforge's MapFill)
            before = torch.cat([a + map_previous_rows(filled[a:b]) for a, b in spans])
            map_input = torch.cat([source, stream[before]], dim=-1)
        pos_exact, pos_filled = positions[exact], positions[filled]
        # per request: its exact rows among all exact rows, and its rows among all rows
        counts = torch.stack([exact[a:b].sum() for a, b in spans]).tolist()
        for l in range(split, len(layers)):
            layer = layers[l]
            attn = layer.self_attn
            xn, res = layer.input_layernorm(x, res)
            qkv, _ = attn.qkv_proj(xn)
            q, k_exact, v_exact = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q, k_exact = attn.rotary_emb(pos_exact, q, k_exact)
            if l in self.fill_kv:
                k_filled, v_filled = self._rotated(l, torch.addmm(self.fill_kv[l][1], map_input, self.fill_kv[l][0]), pos_filled)
            else:
                predicted = source if l == split else torch.addmm(self.fill_maps[l][1], map_input, self.fill_maps[l][0])
                k_filled, v_filled = self._key_value(l, layer.input_layernorm(predicted), pos_filled)
            k = x.new_empty(exact.numel(), attn.kv_size)
            v = x.new_empty(exact.numel(), attn.kv_size)
            k[exact], k[filled], v[exact], v[filled] = k_exact, k_filled, v_exact, v_filled
            write_rows(attn.attn.layer_name, k, v)
            o = _attend(attn, q, k, v, positions, pos_exact, spans, counts)
            out, _ = attn.o_proj(o)
            hidden, res = layer.post_attention_layernorm(out, res)
            x = layer.mlp(hidden)
        final = stream.new_zeros(stream.shape)
        final[exact] = self.model.norm(x, res)[0]
        self.stats.filled_prefills += sum(r.reason is None for r in plans)
        self.stats.exact_prefills += sum(r.reason is not None for r in plans)
        self.stats.last = plans
        return final

    def _key_value(self, l: int, xn: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (RoPE applied) and V of layer `l` for normed inputs `xn`, without the query projection."""
        return self._rotated(l, F.linear(xn, *self.kv_weights[l]), pos)

    def _rotated(self, l: int, kv: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected rows (N, 2 · kv size) -> K with RoPE applied, and V."""
        attn = self.model.layers[l].self_attn
        k, v = kv.split([attn.kv_size, attn.kv_size], dim=-1)
        k, _ = attn.rotary_emb(pos, k.contiguous())  # the key passed as the rotary op's query
        return k, v

    def _keep_attended(self, before, positions, spans, plans, exact: torch.Tensor) -> torch.Tensor:
        """Per filled request, the rows its tail attends to most at layer split - 1 (and the rows
        after each) made exact, as kvforge's `AttendedRows` chooses them on a model whose layers all
        attend globally (Llama: `attention_read_layer` is split - 1)."""
        config = self.config_ridgefill
        layer = self.model.layers[config.split - 1]
        attn = layer.self_attn
        exact = exact.clone()
        for record, (a, b) in zip(plans, spans):
            if record.reason is not None:
                continue
            xn = layer.input_layernorm(before[a:b])
            keys, _ = self._key_value(config.split - 1, xn, positions[a:b])
            end = record.context  # the planned prompt's tail queries (scored rows are not the prompt)
            t = max(0, end - config.tail)
            qkv, _ = attn.qkv_proj(xn[t:end])
            q, _ = attn.rotary_emb(positions[a + t : a + end], qkv[:, : attn.q_size].contiguous())
            d = attn.head_dim
            weight = peak_attention(
                q.view(1, -1, attn.num_heads, d).transpose(1, 2),
                keys.view(1, -1, attn.num_kv_heads, d).transpose(1, 2),
                positions[a + t : a + end].view(1, -1), positions[a:b].view(1, -1), attn.scaling, window(attn))
            exact[a:b] |= most_attended(weight, ~exact[a:b], config.attended_rows, config.attended_span)
        return exact


def _attend(attn, q, k, v, positions, pos_exact, spans, counts) -> torch.Tensor:
    """Each request's exact rows over its own rows' K/V (this step's: the whole prompt), causal by
    position (and windowed on sliding layers). q (Ne, Hq·D), k, v (N, H·D) -> (Ne, Hq·D)."""
    out, start = [], 0
    for (a, b), n in zip(spans, counts):
        mask = visible_mask(attn, pos_exact[start : start + n], positions[a:b])
        out.append(attend(attn, q[start : start + n], k[a:b], v[a:b], mask))
        start += n
    return torch.cat(out)


def ridgefill_stats(llm) -> list[Stats]:
    """The RidgeFill model's counters and last prefill, per worker, of an in-process engine."""
    return llm.apply_model(lambda model: model.stats if isinstance(model, RidgeFillForCausalLM) else None)


def set_ridgefill(llm, enabled: bool, score_tokens: int | None = None, rescue: bool | None = None) -> None:
    """Switch RidgeFill on or off on an in-process engine (off: the stock model, every step), set
    how many rows at each prompt's end are a scored continuation, and switch the decode-time rescue
    of the prompts filled from then on (a running request keeps what it was prefilled with)."""

    def apply(model):
        model.ridgefill_enabled = enabled
        if score_tokens is not None:
            model.score_tokens = score_tokens
        if rescue is not None:
            model.rescue_enabled = rescue

    llm.apply_model(apply)

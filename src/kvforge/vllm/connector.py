"""A vLLM KV connector that loads a cache kvforge made into vLLM's paged cache.

A request opts in with `SamplingParams(extra_args={"kv_transfer_params": {"kvforge_cache": key}})`
(the OpenAI server: a `kv_transfer_params` field in the body), `key` from `CacheStore.put`. The
scheduler side tells vLLM that the first N prompt tokens are external (N = the entry's rows, at
most the prompt's length - 1: vLLM computes the last token, which gives the first logits); the
worker side writes the entry's K/V rows into the request's blocks before the forward, through
the attention backend's own cache update (`do_kv_cache_update`): the layout is the backend's
business (the CPU backend's keys transposed within a block, prepacked tiles on AMX machines, a
GPU backend's own), so rows are never written by indexing. vLLM then computes the remaining prompt tokens over the injected rows and decodes at
its own speed. Requests without the parameter prefill as usual.

The save path reads a request's cache out: a request with `kv_transfer_params={"kvforge_save": key}`
has its prompt's K/V rows (every layer, positions 0..N-1) copied into the store under `key` once
its prefill is complete, as a kvforge `KVCache` of exact rows: a vLLM-served source model's cache,
ready for KV-Lingo to translate. Reading has no backend API: rows are read by the layouts of vLLM's
CPU kernels ("vec", "vec16" and AMX tiles: `paged.read_rows`); any other layout (a GPU backend)
fails the save with a message instead.

Failure: a missing entry, an entry for another model, another prompt, or a layout that does not
match the served model fails that request (vLLM finishes it with an error, `kv_load_failure_policy`
"fail") and logs why; the engine stays up, and nothing falls back to an exact prefill silently.

Prefix caching must be off: injected blocks (a translated cache is not the model's own) would be
hashed into vLLM's prefix cache and reused by later requests as if exact. Sliding-window models
(Gemma 3) load every row in every layer: the connector does not opt into vLLM's hybrid allocator,
so each layer keeps a block for every token and vLLM's kernels apply the window.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

from kvforge.cache import KVCache, RowKind
from kvforge.errors import KvforgeError
from kvforge.vllm.paged import READABLE, layout_of, read_rows, slots_of, write_into
from kvforge.vllm.store import CacheStore, Entry, config_id

logger = logging.getLogger("kvforge.vllm")
PARAM = "kvforge_cache"
SAVE_PARAM = "kvforge_save"
LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass
class Load:
    """One request's load: the entry's first `rows` rows into `block_ids` (positions 0..rows-1)."""

    request_id: str
    key: str
    rows: int
    block_ids: list[int] = field(default_factory=list)
    error: str | None = None  # found on the scheduler side: fail the request instead of loading


@dataclass
class Save:
    """One request's read-out: its prompt's rows, from `block_ids`, into the store as `key`. The
    served model's id and layer count travel with it from its engine's scheduler: vLLM keeps one
    worker-side connector per process, so with several engines in a process the worker side may
    be another engine's instance."""

    request_id: str
    key: str
    tokens: list[int]
    block_ids: list[int]
    model: str
    num_layers: int


@dataclass
class KvforgeConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)  # requests whose prefill completes this step


class KvforgeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if "store" not in extra:
            raise ValueError('KvforgeConnector needs kv_connector_extra_config={"store": "<directory>" or "memory"}')
        if vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("KvforgeConnector needs enable_prefix_caching=False: injected blocks must never be reused as exact")
        self.store = CacheStore(extra["store"])
        self.num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self.model = config_id(vllm_config.model_config.model)
        self.block_size = vllm_config.cache_config.block_size
        self.pending: dict[str, Load] = {}  # scheduler side: loads allocated this step
        self.checked: dict[str, list[int]] = {}  # scheduler side: key -> the entry's tokens, once checked
        self.failed_blocks: set[int] = set()
        self.saving: dict[str, Save] = {}  # scheduler side: save requests still prefilling
        self.rows: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # worker side: key -> layer -> (K, V)

    # --- scheduler side --------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        key = (request.kv_transfer_params or {}).get(PARAM)
        if not key:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        rows, _ = self._check(key, prompt)
        # on an error, claim the prompt's rows all the same: the worker then fails the load, and
        # with it the request, rather than vLLM quietly prefilling it exactly
        return max((rows or len(prompt) - 1) - num_computed_tokens, 0), False

    def _check(self, key: str, prompt: list[int]) -> tuple[int | None, str | None]:
        """(rows to load, None) or (None, why the entry cannot serve this request)."""
        tokens = self.checked.get(key)
        if tokens is None:
            try:
                tokens, model = self.store.describe(key)
            except KvforgeError as exc:
                return None, str(exc)
            if model != self.model:
                return None, f"cache {key} was made for another model (config {model}, served {self.model})"
        if len(tokens) >= len(prompt) or prompt[: len(tokens)] != tokens:
            return None, f"cache {key} holds {len(tokens)} tokens that are not a proper prefix of this request's {len(prompt)}-token prompt"
        self.checked[key] = tokens
        return len(tokens), None

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        key = request.kv_transfer_params[PARAM]
        rows, error = self._check(key, list(request.prompt_token_ids or []))
        self.pending[request.request_id] = Load(request.request_id, key, rows or num_external_tokens,
                                               list(blocks.get_block_ids()[0]), error)

    def build_connector_meta(self, scheduler_output) -> KvforgeConnectorMetadata:
        meta = KvforgeConnectorMetadata(list(self.pending.values()))
        self.pending.clear()
        for new in scheduler_output.scheduled_new_reqs:
            params = (new.sampling_params.extra_args or {}).get("kv_transfer_params") or {} if new.sampling_params else {}
            if params.get(SAVE_PARAM):
                self.saving[new.req_id] = Save(new.req_id, params[SAVE_PARAM], list(new.prompt_token_ids or []), list(new.block_ids[0]),
                                               self.model, self.num_layers)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
            if req_id in self.saving and new_blocks is not None:
                save = self.saving[req_id]
                save.block_ids = list(new_blocks[0]) if req_id in cached.resumed_req_ids else save.block_ids + list(new_blocks[0])
        computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, save in list(self.saving.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if scheduled and computed.get(req_id, 0) + scheduled >= len(save.tokens):  # the prefill completes now
                meta.saves.append(self.saving.pop(req_id))
        return meta

    def request_finished(self, request, block_ids):
        key = (request.kv_transfer_params or {}).get(PARAM)
        if key:
            self.checked.pop(key, None)
        self.saving.pop(request.request_id, None)  # finished (or aborted) before its prefill completed
        return False, None

    # --- worker side -----------------------------------------------------------------------------
    # The worker-side connector is process-global in vLLM (one agent however many engines run
    # in-process), so the caches are taken from the forward context of the engine stepping now,
    # not from `register_kv_caches`.
    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        for load in getattr(meta, "loads", ()):
            error = load.error
            if error is None:
                try:
                    self._write(load, self.store.get(load.key), _attention_layers(forward_context))
                except KvforgeError as exc:
                    error = str(exc)
            if error is not None:
                logger.error("kvforge: request %s fails: %s", load.request_id, error)
                self.failed_blocks.update(load.block_ids)

    def _write(self, load: Load, entry: Entry, layers: dict[str, torch.nn.Module]) -> None:
        cache = entry.cache
        if len(cache) != len(layers):
            raise KvforgeError(f"cache {load.key} has {len(cache)} layers, the served model {len(layers)}")
        bs = self.block_size
        for name, attention in layers.items():
            layer = cache[int(LAYER_INDEX.search(name).group(1))]
            k, v, positions = layer.keys()[0], layer.values()[0], layer.row_positions()[0]
            if (k.shape[0], k.shape[2]) != (attention.num_kv_heads, attention.head_size):
                raise KvforgeError(f"cache {load.key} has {k.shape[0]} KV heads × {k.shape[2]} in {name}, "
                                   f"the served model {attention.num_kv_heads} × {attention.head_size}")
            keep = (positions >= 0) & (positions < load.rows)
            if int(keep.sum()) != load.rows:
                raise KvforgeError(f"cache {load.key} lacks rows in {name}: {int(keep.sum())} of {load.rows}")
            positions = positions[keep]
            table = torch.tensor(load.block_ids, dtype=torch.int64)
            slots = slots_of(table, positions, bs)
            dtype = attention.kv_cache.dtype
            write_into(attention, attention.kv_cache, k[:, keep].transpose(0, 1).to(dtype), v[:, keep].transpose(0, 1).to(dtype), slots)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are synchronous: every layer is written in `start_load_kv`."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Copy this layer's rows of every request whose prefill completes this step (they are in
        the paged cache by now: vLLM writes a step's K/V before its attention)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        match = LAYER_INDEX.search(layer_name)
        if not getattr(meta, "saves", None) or match is None or not isinstance(kv_layer, torch.Tensor):
            return
        from vllm.forward_context import get_forward_context

        bs, layout = kv_layer.shape[2], layout_of(get_forward_context().no_compile_layers[layer_name])
        for save in meta.saves:
            if layout not in READABLE:
                logger.error("kvforge: cannot save request %s: the %r cache layout is not readable", save.request_id, layout)
                continue
            positions = torch.arange(len(save.tokens))
            table = torch.tensor(save.block_ids, dtype=torch.int64)
            keys, values = read_rows(kv_layer, table[positions // bs] * bs + positions % bs, layout)
            self.rows.setdefault(save.key, {})[int(match.group(1))] = (keys.clone(), values.clone())

    def wait_for_save(self) -> None:
        """Put each completed read-out into the store as a kvforge cache of exact rows."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        for save in getattr(meta, "saves", ()):
            layers = self.rows.pop(save.key, {})
            if not layers:
                continue
            if sorted(layers) != list(range(save.num_layers)):
                # a model whose late layers bypass vLLM's attention op (kvforge's RidgeFill and SPEED classes) leaves
                # them unsaved: store nothing rather than a partial cache
                logger.error("kvforge: request %s not saved: %d of %d layers passed through vLLM's attention",
                             save.request_id, len(layers), save.num_layers)
                continue
            cache = KVCache.empty(len(layers), 1, layers[0][0].shape[1], layers[0][0].shape[2], layers[0][0].dtype,
                                  capacity=len(save.tokens))
            positions = torch.arange(len(save.tokens)).view(1, -1)
            for i in range(len(layers)):
                k, v = layers[i]
                cache[i].append(k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), positions, RowKind.EXACT)
            self.store.save(save.key, cache, save.tokens, save.model)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed


def _attention_layers(forward_context) -> dict[str, torch.nn.Module]:
    """Attention layer name -> vLLM's attention layer (which holds its paged cache), for the
    engine running this forward."""
    layers = getattr(forward_context, "no_compile_layers", None) or {}
    return {name: layer for name, layer in layers.items()
            if isinstance(getattr(layer, "kv_cache", None), torch.Tensor) and LAYER_INDEX.search(name)}

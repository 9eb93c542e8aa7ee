"""Model loading, packaged aliases and family adapters."""

from kvforge.models.adapters import Gemma3Adapter, LlamaAdapter, ModelAdapter, Qwen3Adapter, adapter_for
from kvforge.models.loading import LoadedModel, dtype_name, kvforge_home, load_model, parse_dtype, resolve_device
from kvforge.models.registry import DEFAULT_MODEL, PACKAGED_MODELS, PackagedModel

__all__ = [
    "DEFAULT_MODEL",
    "Gemma3Adapter",
    "LlamaAdapter",
    "LoadedModel",
    "ModelAdapter",
    "PACKAGED_MODELS",
    "PackagedModel",
    "Qwen3Adapter",
    "adapter_for",
    "dtype_name",
    "kvforge_home",
    "load_model",
    "parse_dtype",
    "resolve_device",
]

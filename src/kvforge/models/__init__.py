"""Model loading, packaged aliases and family adapters."""

from kvforge.models.adapters import ModelAdapter, adapter_for
from kvforge.models.loading import LoadedModel, dtype_name, kvforge_home, load_model, parse_dtype, resolve_device
from kvforge.models.registry import DEFAULT_MODEL, PACKAGED_MODELS, PackagedModel

__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "ModelAdapter",
    "PACKAGED_MODELS",
    "PackagedModel",
    "adapter_for",
    "dtype_name",
    "kvforge_home",
    "load_model",
    "parse_dtype",
    "resolve_device",
]

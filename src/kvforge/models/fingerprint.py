"""A short id of a model's architecture and weights, stored in every artifact to refuse the wrong model.

`model_fingerprint` hashes a loaded model's parameters as fp32 values. `streamed` computes the
same id from a Hugging Face directory's files, one tensor at a time, so a model loaded straight
into bf16, and a vLLM worker that never loads transformers' model, get the fp32 id that artifacts
fitted in fp32 carry. A directory's id is cached under `$KVFORGE_HOME/fingerprints`, keyed by the
directory and its files' sizes and modification times; a read-only home only loses the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from kvforge.paths import kvforge_home

FINGERPRINT_VERSION = 1  # of the cache's entries; the id itself is `model_fingerprint`'s
_CONFIG_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "sliding_window", "layer_types", "rms_norm_eps")


def hasher(config) -> "hashlib._Hash":
    """A fingerprint's hash, started with what the config contributes."""
    h = hashlib.sha256(config.model_type.encode())
    for key in _CONFIG_KEYS:
        h.update(f"{key}={getattr(config, key, None)!r};".encode())
    return h


def hash_tensor(h, name: str, shape: tuple[int, ...]) -> None:
    """Add one parameter's name and shape to a fingerprint's hash; its values follow
    (`hash_values`, whole or in consecutive rows: the same bytes either way)."""
    h.update(f"{name}:{tuple(shape)};".encode())


def hash_values(h, values: torch.Tensor) -> None:
    """Add values (as fp32) to a fingerprint's hash."""
    h.update(values.detach().float().cpu().contiguous().numpy())  # hashed in place: no bytes copy


def model_fingerprint(model: torch.nn.Module, read=None) -> str:
    """The id of a loaded model: its type, the config fields that change the computation, and
    every parameter's name, shape and values (as fp32). Re-saving or converting the same weights
    keeps the id; a fine-tune that moves any weight changes it. `read`: a parameter -> its values
    (`released.readable`, for weights kept only packed)."""
    h = hasher(model.config)
    for name, p in model.named_parameters():
        hash_tensor(h, name, tuple(p.shape))
        hash_values(h, p if read is None else read(p))
    return h.hexdigest()[:16]


def cached_fingerprint(directory: Path) -> str | None:
    """The id cached for `directory` with its files as they are (same sizes and mtimes), or None."""
    try:
        return str(json.loads(_cache_entry(directory.resolve()).read_text())["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def cache_fingerprint(directory: Path, fingerprint: str) -> None:
    """Keep `directory`'s id for its files as they are (a read-only home: not kept)."""
    entry = _cache_entry(directory.resolve())
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=entry.parent, delete=False, suffix=".tmp") as f:
            json.dump({"version": FINGERPRINT_VERSION, "fingerprint": fingerprint}, f)
        os.replace(f.name, entry)
    except OSError:
        pass


def _cache_entry(directory: Path) -> Path:
    """Where a directory's id is cached: named by its path and its weight and JSON files' sizes and
    mtimes, so a rewritten file is hashed again."""
    import transformers

    # transformers' version too: it names the parameters, orders them and renders the config
    stamp = [str(directory), str(FINGERPRINT_VERSION), transformers.__version__]
    weights = [p for p in sorted(directory.iterdir()) if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".json")]
    for path in weights:
        try:
            stat = path.stat()
        except OSError:
            continue
        stamp.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    key = hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:24]
    return kvforge_home() / "fingerprints" / f"{key}.json"

"""Where kvforge puts caches for vLLM to load: one entry per prompt, keyed by its token ids.

An entry is a kvforge `KVCache` of one sequence (its rows for positions 0..N-1 in every layer)
with the token ids it was computed for and the served model it was made for (the Hugging Face
config of the target, hashed): the connector refuses an entry made for another model. Two stores:

- a directory (`KvforgeConnector`'s `store` setting is a path): one `<key>.safetensors` file per
  entry, written atomically, read by vLLM's engine process wherever it runs;
- memory (`store="memory"`): a dict in this process, for an engine run in-process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, what kvforge's benches and tests do): no file round trip.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from safetensors import safe_open

from kvforge.cache import KVCache
from kvforge.errors import ArtifactError, KvforgeError
from kvforge.speculative.history import prompt_key

MEMORY: dict[str, "Entry"] = {}


def config_id(model_dir: str | Path) -> str:
    """A served model's identity as the connector sees it: a hash of its config.json."""
    path = Path(model_dir).expanduser() / "config.json"
    if not path.is_file():
        raise KvforgeError(f"{model_dir} has no config.json: serve a Hugging Face directory")
    config = json.loads(path.read_text())
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Entry:
    cache: KVCache  # one sequence, every layer holding positions 0..len(tokens)-1
    tokens: list[int]
    model: str  # config_id of the model the cache is for


class CacheStore:
    """Entries by prompt key, in memory or in a directory."""

    def __init__(self, where: str | Path):
        self.memory = str(where) == "memory"
        self.directory = None if self.memory else Path(where).expanduser()
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def name(self) -> str:
        return "memory" if self.memory else str(self.directory)

    def put(self, prompt: Sequence[int], cache: KVCache, tokens: Sequence[int], model: str) -> str:
        """Store the cache of `tokens` (a prefix of `prompt`) for requests whose prompt is `prompt`;
        returns the key a request names in `kv_transfer_params={"kvforge_cache": key}`."""
        if cache.batch_size != 1:
            raise KvforgeError(f"a stored cache holds one sequence, this one holds {cache.batch_size}")
        if not 0 < len(tokens) < len(prompt) or list(prompt[: len(tokens)]) != list(tokens):
            raise KvforgeError("the cache must cover a proper prefix of the prompt: vLLM computes at least the last token")
        return self.save(prompt_key(prompt), cache, tokens, model)

    def save(self, key: str, cache: KVCache, tokens: Sequence[int], model: str) -> str:
        """Store the cache of `tokens` under `key` (what the connector's save path does)."""
        if self.memory:
            MEMORY[key] = Entry(cache, list(tokens), model)
        else:
            cache.save(self.directory / f"{key}.safetensors", {"tokens": json.dumps(list(tokens)), "model": model})
        return key

    def get(self, key: str) -> Entry:
        """The entry, or a one-line error naming what is wrong."""
        if self.memory:
            if key not in MEMORY:
                raise KvforgeError(f"no cache {key} in the in-process store (was it put in another process?)")
            return MEMORY[key]
        path = self.directory / f"{key}.safetensors"
        if not path.is_file():
            raise KvforgeError(f"no cache {key} in {self.directory}")
        try:
            cache, meta = KVCache.load(path)
            return Entry(cache, json.loads(meta["tokens"]), meta["model"])
        except (ArtifactError, KeyError, ValueError, OSError) as exc:
            raise KvforgeError(f"cache {path} cannot be read: {exc}") from exc

    def describe(self, key: str) -> tuple[list[int], str]:
        """(token ids, model) of an entry without reading its rows: what the scheduler checks."""
        if self.memory:
            entry = self.get(key)
            return entry.tokens, entry.model
        path = self.directory / f"{key}.safetensors"
        if not path.is_file():
            raise KvforgeError(f"no cache {key} in {self.directory}")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
            return json.loads(meta["tokens"]), meta["model"]
        except Exception as exc:  # safetensors raises several types for a damaged file
            raise KvforgeError(f"cache {path} cannot be read: {exc}") from exc

    def drop(self, key: str) -> None:
        if self.memory:
            MEMORY.pop(key, None)
        else:
            (self.directory / f"{key}.safetensors").unlink(missing_ok=True)

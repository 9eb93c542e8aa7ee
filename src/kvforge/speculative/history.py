"""Rollout history: each prompt's n-gram cache and latest rollouts, kept across rollout calls and
server requests.

An RL run visits the same prompt every epoch, and its earlier rollouts are the best drafts there
are (DAS, SPEC-RL). A `RolloutHistory` maps a rollout, named by its `rollout_key` or else by a
hash of the prompt's token ids (`prompt_key`), to that prompt's `NgramCache` (the prompt and every
rollout of it so far) and to the latest token ids of each sample index (sample i of this epoch
drafts from sample i of the last one first: `previous.py`). Both are only ever handed to
drafters: which tokens are committed never depends on them (greedy: plain decoding's tokens;
sampling: the model's distribution). Keyed by the prompt's tokens, a history read from a file is
checked against them, so a renamed or colliding file never lends one prompt's history to another
(in memory, a 128-bit key collision is negligible); a rollout key names its rollout whatever the
prompt, as its caller chose. An unknown key starts from the prompt alone.

Bound: at most `max_entries` entries over all prompts held: (n-gram, successor) pairs (about 400
bytes each in CPython, measured: the default 500,000 is ~200 MB) plus the latest rollouts' tokens.
`settle(prompt)` after a group finishes evicts least recently used prompts until the total fits;
a prompt whose history alone exceeds the bound restarts from its prompt. Caches in use by running
groups stay alive through their drafters until those finish, so memory is the bound plus the
running groups' caches.

On disk (`directory`): one file per rollout, `<key>.safetensors` (the table and the latest
rollouts as integer tensors, the prompt's tokens and the n-gram sizes in the metadata), written
atomically (temp file, then rename) when `settle` is called. A file that cannot be read, or holds
another format, other n-gram sizes or another prompt, is ignored with one warning naming it
(history is only a speed hint: a trainer's run should not stop for it) and replaced at the next
write.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from kvforge.cache import atomic_save_safetensors, read_artifact
from kvforge.errors import ArtifactError, KvforgeError
from kvforge.speculative.ngram import NgramCache

FORMAT, VERSION = "kvforge-rollout-history", "2"
DEFAULT_MAX_ENTRIES = 500_000
MAX_ROLLOUTS = 32  # latest rollouts kept per prompt: a sample aligns against each of them


def prompt_key(prompt: Sequence[int]) -> str:
    """A prompt's key: 32 hex digits of BLAKE2b over its token ids as little-endian int64."""
    return hashlib.blake2b(np.asarray(prompt, dtype="<i8").tobytes(), digest_size=16).hexdigest()


def history_key(prompt: Sequence[int], rollout_key: str | None = None) -> str:
    """The history's name for a rollout: its `rollout_key` when given (hashed: any string makes a
    file name), else its prompt's tokens."""
    if rollout_key is None:
        return prompt_key(prompt)
    return "r" + hashlib.blake2b(rollout_key.encode(), digest_size=16).hexdigest()


class RolloutHistory:
    """Per-rollout n-gram caches and latest rollouts, least recently used evicted beyond
    `max_entries`; with a `directory`, each rollout's history is also read from and written to
    its own file."""

    def __init__(self, n_min: int = 2, n_max: int = 4, max_entries: int = DEFAULT_MAX_ENTRIES, directory: Path | None = None,
                 warn: Callable[[str], None] | None = None):
        if max_entries < 1:
            raise ValueError(f"the history bound must be >= 1 entries, got {max_entries}")
        if directory is not None and Path(directory).exists() and not Path(directory).is_dir():
            raise KvforgeError(f"history directory {directory} is a file: give a directory")
        self.n_min, self.n_max, self.max_entries = n_min, n_max, max_entries
        self.directory = Path(directory) if directory is not None else None
        self.warn = warn or (lambda message: warnings.warn(message, stacklevel=3))
        self.caches: OrderedDict[str, NgramCache] = OrderedDict()  # least recently used first
        self.rollouts: dict[str, dict[int, list[int]]] = {}  # key -> sample index -> its latest token ids

    def __len__(self) -> int:
        return len(self.caches)

    @property
    def entries(self) -> int:
        return sum(self._entries(key) for key in self.caches)

    def _entries(self, key: str) -> int:
        return self.caches[key].entries + sum(len(r) for r in self.rollouts.get(key, {}).values())

    def get(self, prompt: Sequence[int], rollout_key: str | None = None) -> NgramCache:
        """The rollout's n-gram cache, most recently used now: held, else read from its file,
        else new (the prompt alone)."""
        return self.caches[self._held(prompt, rollout_key)]

    def previous(self, prompt: Sequence[int], rollout_key: str | None = None) -> dict[int, list[int]]:
        """The rollout's latest token ids per sample index (a copy: a group drafts from the
        rollouts it started with while its finished samples are recorded)."""
        return dict(self.rollouts[self._held(prompt, rollout_key)])

    def record(self, prompt: Sequence[int], index: int, tokens: list[int], rollout_key: str | None = None) -> None:
        """Sample `index` of the rollout wrote `tokens` (kept as given: a caller may go on
        appending to the list): its latest rollout from now on. Beyond `MAX_ROLLOUTS` samples
        of one prompt the oldest recorded goes."""
        rollouts = self.rollouts[self._held(prompt, rollout_key)]
        rollouts.pop(index, None)
        rollouts[index] = tokens
        while len(rollouts) > MAX_ROLLOUTS:
            rollouts.pop(next(iter(rollouts)))

    def _held(self, prompt: Sequence[int], rollout_key: str | None) -> str:
        """The rollout's key, its history held (read from its file, else new) and most recently used."""
        key = history_key(prompt, rollout_key)
        if key not in self.caches:
            cache, rollouts = self._read(key, prompt, rollout_key) or (NgramCache(prompt, self.n_min, self.n_max), {})
            self.caches[key], self.rollouts[key] = cache, rollouts
        self.caches.move_to_end(key)
        return key

    def settle(self, prompt: Sequence[int], rollout_key: str | None = None) -> None:
        """After a group of the prompt finished: write its file (with a directory), then evict
        least recently used rollouts until the bound holds."""
        key = history_key(prompt, rollout_key)
        if key in self.caches and self._entries(key) > self.max_entries:  # alone over the bound: start over
            self.caches[key], self.rollouts[key] = NgramCache(prompt, self.n_min, self.n_max), {}
        if key in self.caches and self.directory is not None:
            save_cache(self.caches[key], prompt, self.path(key), self.rollouts[key])
        total = self.entries
        while total > self.max_entries and self.caches:
            evicted = next(iter(self.caches))
            total -= self._entries(evicted)
            del self.caches[evicted]
            self.rollouts.pop(evicted, None)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def _read(self, key: str, prompt: Sequence[int], rollout_key: str | None) -> tuple[NgramCache, dict[int, list[int]]] | None:
        if self.directory is None or not self.path(key).is_file():
            return None
        try:
            return load_cache(self.path(key), prompt if rollout_key is None else None, self.n_min, self.n_max)
        except ArtifactError as exc:
            self.warn(f"ignoring rollout history {self.path(key)}: {exc}")
            return None


def save_cache(cache: NgramCache, prompt: Sequence[int], path: Path, rollouts: dict[int, list[int]] | None = None) -> None:
    """Write `cache` (the history of `prompt`) atomically: per (n-gram, successor) pair its n-gram
    (padded with -1 to n_max), successor, count and last-seen clock, so a reload drafts exactly
    as the cache did (ties included); and each sample index's latest rollout (`rollout.<i>`)."""
    rows = [(ngram, successor, count, last) for ngram, followers in cache.table.items() for successor, (count, last) in followers.items()]
    ngrams = np.full((len(rows), cache.n_max), -1, dtype=np.int64)
    for i, (ngram, *_rest) in enumerate(rows):
        ngrams[i, : len(ngram)] = ngram
    column = lambda j: torch.tensor([r[j] for r in rows], dtype=torch.int64)  # noqa: E731
    tensors = {"prompt": torch.tensor(list(prompt), dtype=torch.int64), "ngrams": torch.from_numpy(ngrams),
               "successors": column(1), "counts": column(2), "last": column(3)}
    for index, tokens in (rollouts or {}).items():
        tensors[f"rollout.{index}"] = torch.tensor(list(tokens), dtype=torch.int64)
    meta = {"format": FORMAT, "format_version": VERSION, "n_min": str(cache.n_min), "n_max": str(cache.n_max), "clock": str(cache.clock)}
    atomic_save_safetensors(tensors, path, meta)


def load_cache(path: Path, prompt: Sequence[int] | None, n_min: int, n_max: int) -> tuple[NgramCache, dict[int, list[int]]]:
    """The cache and latest rollouts saved in `path`; an `ArtifactError` when the file is
    damaged, of another format, or holds other n-gram sizes or (given `prompt`) another prompt."""
    cache, rollouts = NgramCache((), n_min, n_max), {}
    with read_artifact(path, FORMAT, VERSION, "rollout history") as (f, meta):  # any damage inside: ArtifactError
        if (int(meta["n_min"]), int(meta["n_max"])) != (n_min, n_max):
            raise ArtifactError(f"n-grams of {meta['n_min']}..{meta['n_max']} tokens, this run uses {n_min}..{n_max}")
        if prompt is not None and f.get_tensor("prompt").tolist() != list(prompt):
            raise ArtifactError("it holds the history of another prompt")
        columns = [f.get_tensor(name).tolist() for name in ("ngrams", "successors", "counts", "last")]
        if len({len(c) for c in columns}) != 1:
            raise ArtifactError("its tables have different lengths")
        for ngram, successor, count, seen in zip(*columns):
            key = tuple(t for t in ngram if t >= 0)
            if not n_min <= len(key) <= n_max or count < 1:
                raise ArtifactError(f"an entry of {len(key)} tokens with count {count}")
            cache.table.setdefault(key, {})[successor] = [count, seen]
            cache.entries += 1
        cache.clock = int(meta["clock"])
        for name in f.keys():
            if name.startswith("rollout."):
                index = name.removeprefix("rollout.")
                if not index.isdigit():
                    raise ArtifactError(f"a rollout named {name!r}")
                rollouts[int(index)] = f.get_tensor(name).tolist()
    return cache, rollouts

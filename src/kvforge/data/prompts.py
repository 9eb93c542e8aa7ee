"""Prompts of real held-out text at a chosen token length, for benchmarks and the demo."""

from __future__ import annotations

from typing import Iterator

from kvforge.data.sharegpt import conversations, render


def held_out_text_tokens(tokenizer, tokens: int, skip: int = 0) -> list[int]:
    """Exactly `tokens` ids of held-out ShareGPT conversations, rendered with the chat template
    and concatenated in file order (after skipping `skip` conversations)."""
    ids: list[int] = []
    for i, conv in enumerate(conversations("held_out")):
        if i < skip:
            continue
        ids.extend(tokenizer(render(tokenizer, conv), add_special_tokens=not ids).input_ids)
        if len(ids) >= tokens:
            return ids[:tokens]
    raise ValueError(f"held-out data holds fewer than {tokens} tokens")


def held_out_conversations(count: int, min_chars: int = 0, max_chars: int | None = None, skip: int = 0) -> list:
    """The first `count` held-out conversations whose text length is in range."""
    out = []
    for conv in conversations("held_out"):
        size = sum(len(t) for _, t in conv.turns)
        if size < min_chars or (max_chars is not None and size > max_chars):
            continue
        if skip:
            skip -= 1
            continue
        out.append(conv)
        if len(out) == count:
            break
    return out


def token_sequences(tokenizer, length: int, split: str = "fit") -> Iterator[list[int]]:
    """Conversations of `split`, chat-rendered, concatenated and cut into `length`-token
    sequences; each starts with the tokenizer's own special prefix (BOS where it has one)."""
    prefix = tokenizer("", add_special_tokens=True).input_ids
    buffer: list[int] = list(prefix)
    for conv in conversations(split):
        buffer.extend(tokenizer(render(tokenizer, conv), add_special_tokens=False).input_ids)
        while len(buffer) >= length:
            yield buffer[:length]
            buffer = list(prefix) + buffer[length:]


def plain_text(turns) -> str:
    """Conversation turns ((role, text), ...) as plain text ("User: ...\\n\\nAssistant: ..."), the same
    string for every model: two models with different chat templates and tokenizers read identical text."""
    return "\n\n".join(f"{role.capitalize()}: {content.strip()}" for role, content in turns)


def plain_texts(split: str, count: int, min_chars: int, max_chars: int, skip: int = 0) -> list[str]:
    """`count` conversations of `split` with at least `min_chars` characters, as plain text cut
    to `max_chars`."""
    out = []
    for conv in conversations(split):
        text = plain_text(conv.turns)
        if len(text) < min_chars:
            continue
        if skip:
            skip -= 1
            continue
        out.append(text[:max_chars])
        if len(out) == count:
            return out
    raise ValueError(f"the {split} split holds fewer than {count} conversations of {min_chars}+ characters")

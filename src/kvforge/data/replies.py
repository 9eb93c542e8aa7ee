"""Reply samples: a conversation split at the start of an assistant turn.

The prompt is the conversation rendered up to that turn's header (the chat template's
generation prompt); the reply is the assistant's text, as the template renders it. From each
conversation the latest assistant turn whose prompt fits is taken, so prompts are as long as
the length cap allows (SPEED and hand-off are about long prompts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from kvforge.data.sharegpt import conversations, render_messages


@dataclass(frozen=True)
class ReplySample:
    ids: list[int]  # prompt + reply
    prompt_tokens: int

    @property
    def reply_tokens(self) -> int:
        return len(self.ids) - self.prompt_tokens


def reply_samples(
    tokenizer, split: str, max_tokens: int, min_prompt: int = 64, max_reply: int = 128, min_reply: int = 8
) -> Iterator[ReplySample]:
    """One sample per conversation of `split` (in file order) with prompt + reply <= max_tokens."""
    special = tokenizer("", add_special_tokens=True).input_ids  # BOS where the tokenizer adds one
    for conv in conversations(split):
        messages = [m for m in conv.messages() if m["role"] != "system"]
        best = None
        for i in range(1, len(messages)):
            if messages[i]["role"] != "assistant":
                continue
            prompt = special + tokenizer(render_messages(tokenizer, messages[:i], True), add_special_tokens=False).input_ids
            if len(prompt) + min_reply > max_tokens:
                break
            full = special + tokenizer(render_messages(tokenizer, messages[: i + 1]), add_special_tokens=False).input_ids
            if full[: len(prompt)] != prompt or len(prompt) < min_prompt:
                continue  # a template that re-renders earlier turns differently: skip the turn
            reply = full[len(prompt) :][: min(max_reply, max_tokens - len(prompt))]
            if len(reply) >= min_reply:
                best = ReplySample(prompt + reply, len(prompt))
        if best is not None:
            yield best

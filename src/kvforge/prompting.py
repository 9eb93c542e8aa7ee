"""Text to prompt token ids: plain, or through the model's chat template."""

from __future__ import annotations

from kvforge.errors import PromptError


def encode_prompt(tokenizer, text: str, chat: bool = False, system: str | None = None) -> list[int]:
    """Token ids for `text`; with `chat`, as one user turn followed by the assistant header."""
    if not text or not text.strip():
        raise PromptError("empty prompt: give some text")
    if not chat:
        return list(tokenizer(text).input_ids)
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("this model's tokenizer has no chat template: drop --chat")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template already holds any BOS token it wants.
    return list(tokenizer(rendered, add_special_tokens=False).input_ids)

"""Evaluation tasks built from held-out text: RULER-style single-needle haystacks.

A needle ("One of the special magic numbers for {key} is: {value}.") is inserted at a chosen
depth of a haystack of held-out ShareGPT text; the question at the end asks for the number.
The answer is right when the generated text contains the value (RULER's string match).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvforge.data.sharegpt import conversations

KEYS = (
    "apple", "harbor", "violet", "granite", "falcon", "meadow", "copper", "lantern", "orchid", "glacier",
    "thistle", "saffron", "compass", "ember", "juniper", "marble", "quartz", "sparrow", "tundra", "walnut",
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"


@dataclass(frozen=True)
class NeedleSample:
    prompt: list[int]
    value: str
    key: str
    depth: float  # where the needle sits, as a fraction of the haystack
    needle_rows: tuple[int, int]  # [start, end) prompt rows holding the needle


def haystack_text(min_chars: int, skip: int = 0) -> str:
    """Held-out conversation text, turns joined, at least `min_chars` long."""
    parts, size = [], 0
    for i, conv in enumerate(conversations("held_out")):
        if i < skip:
            continue
        for _, text in conv.turns:
            parts.append(text.strip())
            size += len(parts[-1])
        if size >= min_chars:
            return "\n\n".join(parts)
    raise ValueError("held-out data is too short for this haystack")


def needle_sample(tokenizer, haystack_tokens: int, depth: float, seed: int) -> NeedleSample:
    """A haystack of about `haystack_tokens` tokens with a needle at `depth` (0..1), as a chat
    prompt (plain text when the tokenizer has no chat template), ending with the answer prefix."""
    rng = random.Random(seed)
    key, value = rng.choice(KEYS), str(rng.randint(1_000_000, 9_999_999))
    hay_ids = tokenizer(haystack_text(haystack_tokens * 6, skip=seed * 7), add_special_tokens=False).input_ids[:haystack_tokens]
    cut = int(depth * len(hay_ids))
    before, after = tokenizer.decode(hay_ids[:cut]), tokenizer.decode(hay_ids[cut:])
    needle = NEEDLE.format(key=key, value=value)
    user_before = before.rstrip() + "\n"
    user = f"{user_before}{needle}\n{after.lstrip()}\n\n{QUESTION.format(key=key)}"
    answer = ANSWER_PREFIX.format(key=key)
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
        prompt_text, prefix_text = rendered + answer, tokenizer.apply_chat_template(
            [{"role": "user", "content": user_before}], tokenize=False, add_generation_prompt=False
        )
        specials = False
    else:
        prompt_text, prefix_text = f"{user}\n{answer}", user_before
        specials = True
    prompt = tokenizer(prompt_text, add_special_tokens=specials).input_ids
    # Rows of the needle: the shared token prefix up to the needle, then its length.
    start = _common_prefix(prompt, tokenizer(prefix_text, add_special_tokens=specials).input_ids)
    start = min(start, len(prompt) - 1)
    length = len(tokenizer(needle, add_special_tokens=False).input_ids)
    return NeedleSample(prompt, value, key, depth, (start, min(start + length, len(prompt))))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def answered(text: str, value: str) -> bool:
    return value in text

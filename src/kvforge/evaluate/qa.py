"""A small context-grounded QA set: a fact stated at the start of a held-out conversation, asked
at its end, scored by string match.

Each item opens a held-out conversation with one planted fact ("My cat is called Biscuit."),
keeps the conversation's own turns after it (up to `prefix_chars`, ending at a whole exchange)
and closes with the question as the last user turn. The answer can only come from the prefix:
the fact is arbitrary (a name, a number, a city drawn at random), so a model's memory cannot
supply it. Arms: the target from its own native cache, from each translated cache (the source
prefilled the text), and the source itself; greedy decoding, correct when the reply contains the
answer (case-insensitive).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvforge.data.facts import EVAL_FACTS, plant
from kvforge.data.sharegpt import conversations
from kvforge.generation import GenerationConfig
from kvforge.translate.align import tokenize
from kvforge.translate.handoff import hand_off
from kvforge.translate.translator import Translator


@dataclass(frozen=True)
class QAItem:
    text: str  # the prefix, ending with the assistant header
    answer: str


def qa_items(count: int, prefix_chars: int = 1500, seed: int = 0, split: str = "held_out") -> list[QAItem]:
    rng = random.Random(seed)
    out = []
    for conv in conversations(split):
        if len(conv.turns) < 2 or conv.turns[0][0] != "user":
            continue  # drawn before any value, so the set stays what it was
        fact = EVAL_FACTS[len(out) % len(EVAL_FACTS)]
        answer = rng.choice(fact.values)
        text = plant(conv.turns, fact, answer, prefix_chars)
        if text is None:
            continue  # the first exchange alone is too long
        out.append(QAItem(text, answer))
        if len(out) == count:
            return out
    raise ValueError(f"the {split} split holds fewer than {count} usable conversations")


def correct(reply: str, answer: str) -> bool:
    return answer.lower() in reply.lower()


@torch.inference_mode()
def eval_qa(translators: dict[str, Translator], source, target, items: list[QAItem], max_new_tokens: int = 16, progress=None,
            native_tail: int = 0) -> dict:
    """Accuracy per arm: target_native, one per translator (the hand-off's last `native_tail` tokens
    prefilled by the target), source_native."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    hits = {"target_native": [], **{label: [] for label in translators}, "source_native": []}
    replies, prompt_tokens = [], 0
    for i, item in enumerate(items):
        row = {"answer": item.answer}
        for arm, engine in (("target_native", target), ("source_native", source)):
            ids = tokenize(engine.model.tokenizer, item.text).ids
            row[arm] = engine.generate(ids, config)[0].text
            prompt_tokens += len(ids) if engine is target else 0
        _, source_cache = source.prefill([tokenize(source.model.tokenizer, item.text).ids], logits="none")
        for label, tr in translators.items():
            h = hand_off(tr, source, target, item.text, source_cache, native_tail=native_tail)
            row[label] = target.generate([h.pending], config, cache=h.cache)[0].text
        for arm in hits:
            hits[arm].append(correct(row[arm], item.answer))
        replies.append(row)
        if progress:
            progress(i + 1, len(items))
    return {
        "questions": len(items),
        "prompt_tokens": prompt_tokens,  # the target's
        "accuracy": {arm: 100 * sum(v) / len(v) for arm, v in hits.items()},  # percent
        "correct": {arm: sum(v) for arm, v in hits.items()},
        "replies": replies,
    }

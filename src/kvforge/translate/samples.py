"""Stage-2 training samples: (text, cut) pairs from the packaged chat data, cut at the start of an
assistant reply, as the source builds them.

natural  a conversation up to and including the "Assistant:" header of its last assistant turn
         that fits the prefix cap, that reply (capped) as the continuation;
packed   several conversations' leading exchanges concatenated, one (question, answer) exchange
         removed at random: the question closes the prefix, the answer is the continuation, so the
         reply has to come from anywhere in a long prefix, never from the exchange itself;
recall   a training fact planted in a conversation's first user turn and asked at its end, the
         answer sentence as the continuation (`data.facts`: no template or value of the held-out
         QA set), so a fact's token has to travel the whole prefix.
Plain text ("User: ...\n\nAssistant: ..."), the same string for both models.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from kvforge.data.facts import recall_sample
from kvforge.data.prompts import plain_text
from kvforge.data.sharegpt import conversations


def natural_sample(turns, max_prefix_chars: int, max_continuation_chars: int) -> tuple[str, int] | None:
    """The conversation up to its last assistant header within `max_prefix_chars`, plus that reply."""
    best = None
    for i, (role, content) in enumerate(turns):
        if role != "assistant" or i == 0:
            continue
        before = plain_text(turns[:i]) + "\n\nAssistant:"
        if len(before) > max_prefix_chars:
            break
        if len(content.strip()) >= 20:
            best = (before + " " + content.strip()[:max_continuation_chars], len(before))
    return best


def _exchanges(turns) -> list[tuple[str, str]]:
    """(question, answer) pairs of a conversation: each user turn followed by an assistant turn."""
    return [(q, a) for (rq, q), (ra, a) in zip(turns, turns[1:]) if rq == "user" and ra == "assistant" and q.strip() and a.strip()]


def packed_sample(group: list[list[tuple[str, str]]], rng: random.Random, max_continuation_chars: int) -> tuple[str, int]:
    """Concatenated conversations with one (question, answer) exchange removed at random: the
    question closes the prefix, the answer is the continuation (the source's packed samples: the
    reply needs context from anywhere in a long prefix, never from the exchange itself)."""
    candidates = [(c, j) for c, ex in enumerate(group) for j, (_, a) in enumerate(ex) if len(a.strip()) >= 20]
    c, j = rng.choice(candidates)
    question, answer = group[c][j]
    turns = [t for k, ex in enumerate(group) for i, (q, a) in enumerate(ex) if (k, i) != (c, j) for t in (("user", q), ("assistant", a))]
    before = plain_text(turns + [("user", question)]) + "\n\nAssistant:"
    return before + " " + answer.strip()[:max_continuation_chars], len(before)


def training_texts(split: str, count: int, max_prefix_chars: int, max_packed_chars: int, max_continuation_chars: int,
                   packed_fraction: float = 0.5, seed: int = 0, skip: int = 0, recall_fraction: float = 0.0,
                   avoid: range = range(0)) -> tuple[list[tuple[str, int]], int]:
    """The first `count` samples of `iter_training_texts` (the same arguments), and how many
    conversations they took, so a later call can stay disjoint (`skip`)."""
    out, read = [], 0
    if count <= 0:
        return out, read
    for sample, read in iter_training_texts(split, max_prefix_chars, max_packed_chars, max_continuation_chars, packed_fraction, seed, skip,
                                            recall_fraction, avoid):
        out.append(sample)
        if len(out) == count:
            return out, read
    raise ValueError(f"the {split} split holds too few usable conversations for {count} samples ({len(out)})")


def iter_training_texts(split: str, max_prefix_chars: int, max_packed_chars: int, max_continuation_chars: int,
                        packed_fraction: float = 0.5, seed: int = 0, skip: int = 0, recall_fraction: float = 0.0,
                        avoid: range = range(0)) -> Iterator[tuple[tuple[str, int], int]]:
    """(text, cut) samples of `split`, each with how many conversations have been read by then: a
    `recall_fraction` of them recall samples, of the others a `packed_fraction` packed (prefix of
    at most `max_packed_chars`, from several conversations) and the rest natural, interleaved;
    skips the first `skip` conversations, and those whose index (from 0, in file order) is in
    `avoid` (another call's: the validation ones)."""
    if not (0 <= recall_fraction < 1 and 0 <= packed_fraction <= 1):
        raise ValueError(f"sample fractions must be in [0, 1) (recall) and [0, 1] (packed), got {recall_fraction} and {packed_fraction}")
    rng = random.Random(seed)
    made, group, read, packed, recall = 0, [], 0, 0, 0
    room = max_packed_chars - 200  # the lifted question and the assistant header
    for conv in conversations(split):
        read += 1
        if read <= skip or read - 1 in avoid:
            continue
        sample = None
        if recall < recall_fraction * (made + 1):
            sample = recall_sample(conv.turns, rng, max_prefix_chars)
            recall += sample is not None
        elif packed >= packed_fraction * (made - recall + 1):
            sample = natural_sample(conv.turns, max_prefix_chars, max_continuation_chars)
        else:
            exchanges, size = [], 0
            for q, a in _exchanges(conv.turns):  # the leading exchanges that fit in a third of the room
                size += len(q) + len(a) + 24
                if size > room // 3:
                    break
                exchanges.append((q, a))
            if exchanges:
                group.append(exchanges)
            if sum(len(q) + len(a) + 24 for ex in group for q, a in ex) > room * 3 // 4 or len(group) == 5:
                sample = packed_sample(group, rng, max_continuation_chars)
                group, packed = [], packed + 1
        if sample is not None:
            made += 1
            yield sample, read

"""Drafters: a per-prompt n-gram cache (NgramRL) and vLLM-style prompt lookup.

A `Drafter` belongs to one request: `propose(context, k)` returns up to k draft tokens that
continue `context` (the request's committed tokens), and `observe(tokens)` tells it the tokens
the request just committed. Verification (`verify.py`) never looks inside a drafter.

The n-gram cache (`NgramCache`) holds, for one prompt, every n-gram (n_min..n_max tokens) of the
prompt and of every rollout of that prompt so far, each mapped to its successors with counts:
the sibling samples of an RL group share one cache, so a rollout drafts from what its siblings
already wrote. A draft follows the longest n-gram suffix of the context that the cache knows,
takes its most frequent successor (ties: the most recent), appends it and repeats, for up to k
tokens. That chain of most frequent successors suits rollouts that repeat each other; copying a
document wants the tokens after the latest match instead (prompt lookup); a sample of a prompt
rolled out before may follow one of its previous rollouts (`previous.py`). `NgramDrafter`
proposes from each source and returns, per request, the one whose recent proposals matched more
of what the request went on to commit; `source` names it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from kvforge.speculative.gate import Acceptance
from kvforge.speculative.previous import PreviousRolloutDrafter

# the sources `NgramDrafter` proposes from, in the order that wins a tie
SOURCES = ("rollout", "chain", "lookup")
_TIE_RANK = {source: -i for i, source in enumerate(SOURCES)}


class Drafter(Protocol):
    def propose(self, context: Sequence[int], k: int) -> list[int]: ...

    def observe(self, tokens: Sequence[int]) -> None: ...


class NgramCache:
    """n-gram -> {successor: [count, last seen]}, for one prompt and its rollouts."""

    def __init__(self, prompt: Sequence[int] = (), n_min: int = 1, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.table: dict[tuple[int, ...], dict[int, list[int]]] = {}
        self.clock = 0  # increases with every indexed token: "most recent" for ties
        self.entries = 0  # (n-gram, successor) pairs: the size a history store bounds
        self.add(prompt)

    def add(self, tokens: Sequence[int], before: Sequence[int] = ()) -> None:
        """Index every n-gram followed by one of `tokens`; `before` is the context they continue
        (its last n_max tokens form the n-grams that straddle the boundary)."""
        seq = list(before[-self.n_max :]) + list(tokens)
        for i in range(len(seq) - len(tokens), len(seq)):
            if i == 0:
                continue
            self.clock += 1
            successor = seq[i]
            for n in range(self.n_min, min(self.n_max, i) + 1):
                followers = self.table.setdefault(tuple(seq[i - n : i]), {})
                entry = followers.get(successor)
                if entry is None:
                    entry = followers[successor] = [0, 0]
                    self.entries += 1
                entry[0] += 1
                entry[1] = self.clock

    def successors(self, context: Sequence[int]) -> list[int]:
        """Successors of the longest suffix of `context` in the cache, most frequent first
        (ties: most recent first); [] when no suffix is known."""
        for n in range(min(self.n_max, len(context)), self.n_min - 1, -1):
            entry = self.table.get(tuple(context[len(context) - n :]))
            if entry:
                return [t for t, _ in sorted(entry.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))]
        return []

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens: the top successor of the longest known suffix, repeatedly."""
        tail = list(context[-self.n_max :])
        out: list[int] = []
        while len(out) < k:
            nxt = self.successors(tail)
            if not nxt:
                break
            out.append(nxt[0])
            tail = (tail + [nxt[0]])[-self.n_max :]
        return out


class NgramDrafter:
    """One request's view of a (shared) per-prompt `NgramCache`, prompt lookup over its own
    tokens and, given `previous` rollouts of the prompt (its own first), their continuation: each
    `propose` looks up every source and returns the one expected to land the most tokens, judged
    by how much of each source's recent proposals the request then committed (`Acceptance`)."""

    def __init__(self, cache: NgramCache, prompt: Sequence[int], previous: Sequence[Sequence[int]] = ()):
        self.cache = cache
        self.tail = list(prompt[-cache.n_max :])  # what the next committed tokens continue
        self.drafters = {"lookup": PromptLookupDrafter(cache.n_min, cache.n_max, latest=True)}
        if previous:
            self.drafters["rollout"] = PreviousRolloutDrafter(previous, len(prompt), cache.n_min, cache.n_max)
        self.scores = {source: Acceptance() for source in SOURCES}
        self.proposed: dict[str, list[int]] = {}  # the last proposals, until the next commit scores them
        self.chosen = dict.fromkeys(SOURCES, 0)  # proposals returned per source
        # per source, over every proposal whether verified or not: [tokens proposed, tokens that the
        # request then committed, up to the first that differs] (what each source would land)
        self.matched = {source: [0, 0] for source in SOURCES}
        self.source: str | None = None  # the source of the last proposal returned (None: nothing proposed)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        self.proposed = {"chain": self.cache.draft(context, k)}
        for name, drafter in self.drafters.items():
            self.proposed[name] = drafter.propose(context, k)
        source = max(self.proposed, key=lambda s: (self.scores[s].expected(len(self.proposed[s])), _TIE_RANK[s]))
        self.source = source if self.proposed[source] else None
        if self.source is not None:
            self.chosen[source] += 1
        return self.proposed[source]

    def observe(self, tokens: Sequence[int]) -> None:
        for source, proposal in self.proposed.items():
            self.scores[source].observe(proposal, tokens)
            landed = next((i for i, (d, t) in enumerate(zip(proposal, tokens)) if d != t), min(len(proposal), len(tokens)))
            tally = self.matched[source]
            tally[0], tally[1] = tally[0] + min(len(proposal), len(tokens)), tally[1] + landed
        self.proposed = {}
        for drafter in self.drafters.values():
            drafter.observe(tokens)
        self.cache.add(tokens, self.tail)
        self.tail = (self.tail + list(tokens))[-self.cache.n_max :]


class PromptLookupDrafter:
    """vLLM's `ngram` proposer: the longest suffix of the context (n_max down to n_min tokens)
    that occurs earlier in the request's own tokens (prompt and output so far), at its earliest
    occurrence (`latest`: at its latest, where a copy in progress continues); the draft is the k
    tokens that followed it.

    Every n-gram that has a token after it is indexed once, by where it ends, as the context grows
    (a drafter's contexts extend each other; one that does not is indexed afresh): a proposal
    compares the context with what was indexed (one C-level comparison) and looks up one n-gram
    per n, where a scan of the context per step cost 1 % of a rollout step of smollm2-135m. The
    index holds about (n_max - n_min + 1) entries per token of the request."""

    source = "lookup"

    def __init__(self, n_min: int = 1, n_max: int = 4, latest: bool = False):
        self.n_min, self.n_max, self.latest = n_min, n_max, latest
        self.tokens: list[int] = []  # the context indexed so far
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> where its earliest (latest) occurrence ends

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        self._extend(context)
        tokens = self.tokens
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            end = self.ends.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return tokens[end : end + k]
        return []

    def _extend(self, context: Sequence[int]) -> None:
        """Index the n-grams that end before the context's last token (each has a token after it)."""
        seen = len(self.tokens)
        if len(context) < seen or _as_list(context[:seen]) != self.tokens:
            self.tokens, self.ends, seen = [], {}, 0
        self.tokens.extend(_as_list(context[seen:]))
        tokens = self.tokens
        for end in range(max(seen, 1), len(tokens)):  # the ends indexed before stop at seen - 1
            for n in range(self.n_min, min(self.n_max, end) + 1):
                gram = tuple(tokens[end - n : end])
                if self.latest or gram not in self.ends:
                    self.ends[gram] = end

    def observe(self, tokens: Sequence[int]) -> None:
        pass


def _as_list(tokens: Sequence[int]) -> list[int]:
    """Token ids as a list of ints (vLLM's proposer passes numpy rows)."""
    return tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)


class NoDrafter:
    def propose(self, context: Sequence[int], k: int) -> list[int]:
        return []

    def observe(self, tokens: Sequence[int]) -> None:
        pass

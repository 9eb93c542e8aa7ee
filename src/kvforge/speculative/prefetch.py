"""The (accept length, bonus token) prefetcher: next step's drafts, built while the model verifies.

Shapes: k draft tokens, j accept length in 0..len(draft), b the bonus token.

Verification of step t ends in an outcome (j, b) per request: j draft tokens accepted, then the
bonus b. The next draft depends on both, so a synchronous drafter waits for them. While the model
verifies, a worker thread builds a table per request keyed by (j, b): for each j the top
candidates for b among the cache's frequency-ranked successors of context + draft[:j] (on a
rejection at j the bonus is not draft[j], so that one is skipped), and the draft the lookup would
give after each. A candidate budget N per request is split across the j greedily by marginal gain
in expected coverage: P(j) from the request's recent accept lengths times the gain of one more
candidate in branch j's coverage profile (the share of past outcomes whose bonus ranked within
the first n candidates; profiles are kept apart for a full accept, where the bonus is usually the
top successor, and a rejection). After verification one probe per request: a hit is the next
draft; a miss falls back to the drafter's own lookup for that request only. Committed tokens
never depend on the prefetcher: it only decides which draft is verified next.
"""

from __future__ import annotations

import heapq
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

MAX_RANK = 64  # candidates looked at per branch when learning the coverage profiles
# the draft sources whose next drafts the tables hold (the n-gram chain; None: nothing proposed): a
# request drafting from another source (a previous rollout, prompt lookup) gets no tables
PREFETCHED_SOURCES = (None, "chain", "prefetch")


@dataclass
class Branch:
    """A request's step: context and the draft being verified, and the table built for it."""

    context: list[int]
    draft: list[int]
    table: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    ranked: dict[int, list[int]] = field(default_factory=dict)  # j -> candidate bonus tokens, ranked
    order: list[int] = field(default_factory=list)  # branch of each candidate in pick order, up to MAX_RANK


class CoverageProfile:
    """P(the bonus is among the first n candidates), learned from outcomes, with a prior."""

    def __init__(self, prior_top: float):
        # prior: one pseudo-outcome at rank 0 with weight prior_top, the rest spread over ranks 1..
        self.counts = [prior_top] + [(1 - prior_top) / MAX_RANK] * MAX_RANK  # rank MAX_RANK = not found
        self.total = 1.0

    def record(self, rank: int | None) -> None:
        self.counts[MAX_RANK if rank is None or rank >= MAX_RANK else rank] += 1
        self.total += 1

    def gain(self, n: int) -> float:
        """Coverage added by the (n+1)-th candidate."""
        return self.counts[n] / self.total if n < MAX_RANK else 0.0


def allocation_order(
    budget: int, p_accept: list[float], profiles: list[CoverageProfile], caps: list[int] | None = None
) -> list[int]:
    """The branch j each of `budget` candidates goes to, in the order the greedy choice picks
    them: always the branch whose next candidate adds the most expected coverage. `caps[j]`:
    how many candidates branch j has at all."""
    caps = caps or [MAX_RANK] * len(p_accept)
    counts, order = [0] * len(p_accept), []
    heap = [(-p * prof.gain(0), j) for j, (p, prof) in enumerate(zip(p_accept, profiles)) if caps[j] > 0]
    heapq.heapify(heap)
    while heap and len(order) < budget:
        gain, j = heapq.heappop(heap)
        if gain >= 0:
            break
        order.append(j)
        counts[j] += 1
        if counts[j] < caps[j]:
            heapq.heappush(heap, (-p_accept[j] * profiles[j].gain(counts[j]), j))
    return order


def allocate(budget: int, p_accept: list[float], profiles: list[CoverageProfile], caps: list[int] | None = None) -> list[int]:
    """Candidates per branch j (len(p_accept) branches), greedily by marginal expected coverage."""
    counts = [0] * len(p_accept)
    for j in allocation_order(budget, p_accept, profiles, caps):
        counts[j] += 1
    return counts


class Prefetcher:
    """Per-request (j, b) tables built on a worker thread; `probe` after each verification."""

    def __init__(self, k: int, budget: int = 16, history: int = 32):
        self.k, self.budget = k, budget
        self.full = CoverageProfile(prior_top=0.9)  # the source: ~90 % of full-accept bonuses are the top successor
        self.partial = CoverageProfile(prior_top=0.5)
        self.accepts: dict[int, deque] = {}
        self.history = history
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvforge-prefetch")
        self.probes = self.hits = 0
        self.needed: list[int | None] = []  # per probe: the smallest budget that would have covered it

    def start(self, requests: dict[int, tuple[object, list[int], list[int]]]) -> Future:
        """Build tables for {request: (ngram cache, context, draft)} on the worker; returns a
        future of {request: Branch}. The caller must not modify the caches until it resolves."""
        return self.pool.submit(lambda: {key: self._build(key, *request) for key, request in requests.items()})

    def _build(self, key: int, cache, context: list[int], draft: list[int]) -> Branch:
        branch = Branch(context, draft)
        n = len(draft)
        for j in range(n + 1):
            ranked = cache.successors(context + draft[:j])
            if j < n:
                ranked = [t for t in ranked if t != draft[j]]
            branch.ranked[j] = ranked[:MAX_RANK]
        profiles = [self.full if j == n else self.partial for j in range(n + 1)]
        caps = [len(branch.ranked[j]) for j in range(n + 1)]
        branch.order = allocation_order(max(self.budget, MAX_RANK), self._p_accept(key, n), profiles, caps)
        counts = [0] * (n + 1)
        for j in branch.order[: self.budget]:
            counts[j] += 1
        for j, count in enumerate(counts):
            for b in branch.ranked[j][:count]:
                branch.table[(j, b)] = cache.draft(context + draft[:j] + [b], self.k)
        return branch

    def _p_accept(self, key: int, n: int) -> list[float]:
        """P(accept length j) for j in 0..n from the request's recent accept lengths (add-one)."""
        counts = [1.0] * (n + 1)
        for j in self.accepts.get(key, ()):
            counts[min(j, n)] += 1
        total = sum(counts)
        return [c / total for c in counts]

    def forget(self, key: int) -> None:
        """Drop a finished request's accept-length history (a server sees unboundedly many)."""
        self.accepts.pop(key, None)

    def probe(self, key: int, branch: Branch, accepted: int, bonus: int) -> list[int] | None:
        """The prefetched next draft for outcome (accepted, bonus), or None (a miss); learns from it."""
        self.probes += 1
        self.accepts.setdefault(key, deque(maxlen=self.history)).append(accepted)
        ranked = branch.ranked.get(accepted, [])
        profile = self.full if accepted == len(branch.draft) else self.partial
        rank = ranked.index(bonus) if bonus in ranked else None
        profile.record(rank)
        self.needed.append(_budget_needed(branch.order, accepted, rank))
        draft = branch.table.get((accepted, bonus))
        if draft is not None:
            self.hits += 1
        return draft

    @property
    def coverage(self) -> float:
        return self.hits / self.probes if self.probes else 0.0

    def coverage_at(self, budget: int) -> float:
        """Coverage this run would have had at another budget (same pick order, same outcomes)."""
        covered = sum(1 for n in self.needed if n is not None and n <= budget)
        return covered / len(self.needed) if self.needed else 0.0

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _budget_needed(order: list[int], accepted: int, rank: int | None) -> int | None:
    """The budget at which the (rank+1)-th candidate of branch `accepted` is picked, if ever."""
    if rank is None:
        return None
    seen = 0
    for position, j in enumerate(order):
        if j == accepted:
            if seen == rank:
                return position + 1
            seen += 1
    return None

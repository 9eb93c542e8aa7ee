"""The draft gate: how many draft tokens a step verifies, from what a wider forward costs and what
each row's drafts are worth.

Shapes: B rows in the step, W = K + 1 the verification width, C the longest row's context.

A step's forward pads every row to the longest draft, so its cost is set by B, W and C, not by
how many rows draft: one drafting row makes every row of the batch W wide. The gate therefore picks
one draft length K per step (0: a plain step) to maximise expected committed tokens per second,

    rate(K) = sum_r (1 + sum_{i=1..min(K, len d_r)} a_r^i) / (forward(B, K + 1, C) + host),

with a_r the row's chance that a drafted token is accepted given the ones before it (geometric
accept lengths). Rows whose drafts are worth little ride in the same forward at no extra cost.

That is the objective of rows that finish apart (the server's requests: each returns when its own
tokens are done). Rows that finish together (`group=True`: an offline `generate` of a batch, the
G samples of an RL group) return when the last of them does, and a token one row gains shortens
the call only if that row is the last to finish. So a group's gate maximises the seconds a step
saves, net of what its width costs:

    saved(K) = E_crit(K) x (forward(B, 1, C) + host) + (sum_r E_r(K) - |crit| E_crit(K)) x row,
    net(K)   = saved(K) - (forward(B, K + 1, C) - forward(B, 1, C)),

with E_r(K) the row's expected accepted tokens, crit the rows with the most of their token budget
left (the likeliest to finish last), E_crit(K) the least of theirs (the group saves a step only if
each of them gains one), and `row` one row's share of a step, (forward(B, 2, C) - forward(B, 1, C)) / B
(what a row that finishes earlier saves each later step). A step whose rows all keep the same
budget drafts only when every row's draft is worth it; a single row is judged as before.

`Acceptance` learns a_r from every proposal, verified or not: a draft that was not verified is
compared with the tokens the step then committed, which are the tokens a verification of it
would have committed (`verify.py`: both are plain decoding's), so a row that stops drafting keeps
learning and drafts again as soon as its drafts would land, however many steps it ran plain.

`StepCost` is the forward's cost: measured once per engine and batch size (forwards of widths 1
and 2 over a short scratch cache, a line through them for the wider ones: a CPU's cost per extra
row is flat over a step's few rows, from nearly 0 on AMX tiles to a whole row's cost where bf16 is
emulated) and refined from the step timings, per context band. Only timing depends on the gate;
the committed tokens are plain decoding's whatever it decides.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch

CONTEXT_BAND = 256  # rows of context per band of the observed costs: attention grows with context
SCRATCH_ROWS = 16  # the calibration cache's context: the prior holds the context-free part


class Acceptance:
    """A row's per-token acceptance rate, from its proposals compared with what it committed (an
    exponential average over steps). Its prior, one pseudo-trial, is the rate of `population` (the
    rows a gate has seen, so a new request starts where its kind of request stands), else even."""

    def __init__(self, decay: float = 0.8, population: "Acceptance | None" = None):
        self.decay, self.population = decay, population
        self.hits, self.misses = 0.0, 0.0

    @property
    def rate(self) -> float:
        prior = self.population.rate if self.population is not None else 0.5
        return (self.hits + prior) / (self.hits + self.misses + 1.0)

    def observe(self, proposal: Sequence[int], committed: Sequence[int]) -> None:
        """The step proposed `proposal` (verified or not) and committed `committed`: each drafted
        token is a trial until the first that differs from what was committed."""
        hits = misses = 0
        for drafted, token in zip(proposal, committed):
            if drafted != token:
                misses = 1
                break
            hits += 1
        if hits or misses:
            self.hits = self.decay * self.hits + hits
            self.misses = self.decay * self.misses + misses
            if self.population is not None:
                self.population.observe(proposal, committed)

    def expected(self, length: int) -> float:
        """Expected accepted tokens of a draft of `length` tokens."""
        a = self.rate
        return sum(a**i for i in range(1, length + 1))


def _bucket(batch: int) -> int:
    """The calibrated batch size standing for `batch`: the largest power of two not above it."""
    return 1 << (batch.bit_length() - 1)


@dataclass
class StepCost:
    """Seconds of a verification forward by (batch, width, context), and the host time of a step
    around it. `prior[bucket][width]`: measured on a scratch cache; `observed`: the steps' own
    forwards (an exponential average per batch, width and context band)."""

    engine: object  # None: no prior (vLLM's step is measured only as it runs)
    prior: dict[int, dict[int, float]] = field(default_factory=dict)
    observed: dict[tuple[int, int, int], float] = field(default_factory=dict)
    host: float = 0.0
    decay: float = 0.5
    # every row's trials over this engine (slowly forgotten): the prior of a new row's acceptance
    population: Acceptance = field(default_factory=lambda: Acceptance(decay=0.99))

    def seconds(self, batch: int, width: int, context: int) -> float:
        """Predicted forward seconds: observed at this batch, width and band; else a width observed
        at this batch and band scaled by the shape of the cost over widths (the prior's, or with no
        prior the widths observed at another band); else that shape itself. With nothing to go on, a
        plain step is measured first (an unmeasured width 1 costs nothing), then a wider one is taken
        to cost what the nearest measured width does, so it is tried."""
        band = context // CONTEXT_BAND
        here = {w: t for (b, w, c), t in self.observed.items() if b == batch and c == band}
        if width in here:
            return here[width]
        shape = self._shape(batch, band)
        if here and shape is not None:
            w = min(here, key=lambda w: abs(w - width))
            return here[w] * _line(shape, width) / _line(shape, w)
        if shape is not None:
            return _line(shape, width) * (batch / _bucket(batch) if _bucket(batch) in self.prior else 1.0)
        if len(here) >= 2:
            return _line(here, width)
        if width == 1:
            return 1e-9
        return here[min(here, key=lambda w: abs(w - width))] if here else 1.0

    def _shape(self, batch: int, band: int) -> dict[int, float] | None:
        """Seconds by width whose ratios stand for this batch's: the prior, else the widths observed
        at this batch in the band with the most of them (two at least, another band than `band`)."""
        if _bucket(batch) in self.prior:
            return self.prior[_bucket(batch)]
        bands: dict[int, dict[int, float]] = {}
        for (b, w, c), t in self.observed.items():
            if b == batch and c != band:
                bands.setdefault(c, {})[w] = t
        best = max(bands.values(), key=len, default={})
        return best if len(best) >= 2 else None

    def record(self, batch: int, width: int, context: int, forward_s: float, host_s: float) -> None:
        key = (batch, width, context // CONTEXT_BAND)
        old = self.observed.get(key)
        self.observed[key] = forward_s if old is None else self.decay * old + (1 - self.decay) * forward_s
        self.host = host_s if not self.host else self.decay * self.host + (1 - self.decay) * host_s

    def calibrate(self, batch: int) -> None:
        """Measure widths 1 and 2 at `batch`'s bucket, once (the smaller of two timings of width 1,
        around one of width 2)."""
        bucket = _bucket(batch)
        if self.engine is None or bucket in self.prior:
            return
        engine, table = self.engine, {}
        with torch.inference_mode():
            _, cache = engine.prefill([[1] * SCRATCH_ROWS] * bucket)
            for width in (1, 2, 1):
                ids = torch.ones(bucket, width, dtype=torch.long, device=engine.device)
                positions = torch.arange(SCRATCH_ROWS, SCRATCH_ROWS + width, device=engine.device).expand(bucket, width)
                start = time.perf_counter()
                engine.forward(ids, positions, cache, "all")
                table[width] = min(table.get(width, float("inf")), time.perf_counter() - start)
                cache.rollback([width] * bucket)
        self.prior[bucket] = table


def _line(table: dict[int, float], width: int) -> float:
    """Seconds at `width`: measured, or on the line through the two nearest widths measured (one
    width measured: its seconds)."""
    if width in table:
        return table[width]
    if len(table) == 1:
        return next(iter(table.values()))
    a, b = sorted(sorted(table, key=lambda w: abs(w - width))[:2])
    return max(table[a] + (table[b] - table[a]) * (width - a) / (b - a), min(table.values()))


_COSTS: "weakref.WeakKeyDictionary[object, StepCost]" = weakref.WeakKeyDictionary()


def step_cost(engine) -> StepCost:
    """The engine's cost model, shared by every gate that drives it (measured once per engine)."""
    cost = _COSTS.get(engine)
    if cost is None:
        cost = _COSTS[engine] = StepCost(engine)
    return cost


class DraftGate:
    """Picks each step's draft length from the engine's `StepCost` and the rows' `Acceptance`."""

    def __init__(self, cost: StepCost, group: bool = False):
        self.cost = cost
        self.group = group  # the rows finish together (module docstring)

    def new_acceptance(self) -> Acceptance:
        """A new row's acceptance, its prior the rate of the rows this engine has drafted for."""
        return Acceptance(population=self.cost.population)

    def prepare(self, batch: int) -> None:
        """Measure the engine's forward at this batch size if not yet measured (outside a step's timing)."""
        self.cost.calibrate(batch)

    def choose(self, drafts: Sequence[Sequence[int]], acceptance: Sequence[Acceptance], context: int,
               remaining: Sequence[int] | None = None) -> int:
        """The draft length K (0: verify nothing) with the most expected committed tokens per
        second for a step of these rows, each with its proposed draft; for a group (`remaining`:
        each row's token budget left), the most seconds saved (module docstring)."""
        batch = len(drafts)
        longest = max((len(d) for d in drafts), default=0)
        if longest == 0:
            return 0
        if self.group and remaining is not None and batch > 1:
            return self._group_choice(drafts, acceptance, context, remaining, longest)
        best_k, best_rate = 0, batch / (self.cost.seconds(batch, 1, context) + self.cost.host)
        for k in range(1, longest + 1):
            gain = sum(1 + a.expected(min(k, len(d))) for d, a in zip(drafts, acceptance))
            rate = gain / (self.cost.seconds(batch, k + 1, context) + self.cost.host)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _group_choice(self, drafts, acceptance, context: int, remaining: Sequence[int], longest: int) -> int:
        batch = len(drafts)
        plain = self.cost.seconds(batch, 1, context)
        row = max(0.0, self.cost.seconds(batch, 2, context) - plain) / batch
        last = max(remaining)
        critical = [i for i, left in enumerate(remaining) if left == last]
        best_k, best_net = 0, 0.0
        for k in range(1, longest + 1):
            expected = [a.expected(min(k, len(d))) for d, a in zip(drafts, acceptance)]
            whole = min(expected[i] for i in critical)
            saved = whole * (plain + self.cost.host) + (sum(expected) - whole * len(critical)) * row
            net = saved - (self.cost.seconds(batch, k + 1, context) - plain)
            if net > best_net:
                best_k, best_net = k, net
        return best_k

    def record(self, batch: int, width: int, context: int, forward_s: float, host_s: float) -> None:
        self.cost.record(batch, width, context, forward_s, host_s)

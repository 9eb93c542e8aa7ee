"""The draft gate: how many draft tokens a step verifies, from what a wider forward costs and what
each row's drafts are worth.

Shapes: B rows in the step, W = K + 1 the verification width, C the longest row's context.

A step's forward makes every row as wide as the longest draft, so its cost is set by B, W and C,
not by how many rows draft: one drafting row makes every row of the batch W wide. The gate therefore picks
one draft length K per step (0: a plain step) to maximise expected committed tokens per second,

    rate(K) = sum_r (1 + sum_{i=1..min(K, len d_r)} a_r^i) / step(B, K + 1, C),

with a_r the row's chance that a drafted token is accepted given the ones before it (geometric
accept lengths) and step(B, W, C) a step's seconds: the forward and the host work around it
(verifying a wider step draws more tokens). Rows whose drafts are worth little ride in the same
forward at no extra cost.

That is the objective of rows that finish apart (the server's requests: each returns when its own
tokens are done). Rows that finish together (`group=True`: an offline `generate` of a batch, the
G samples of an RL group) return when the last of them does, and a token one row gains shortens
the call only if that row is the last to finish. So a group's gate maximises the seconds a step
saves, net of what its width costs:

    saved(K) = q E_crit(K) x step(B, 1, C) + (sum_r E_r(K) - q |crit| E_crit(K)) x row,
    net(K)   = saved(K) - (step(B, K + 1, C) - step(B, 1, C)) - apart,

with E_r(K) the row's expected accepted tokens, crit the rows with the most of their token budget
left (the likeliest to finish last), E_crit(K) the expected least accept length among them (the
group saves a step only if each of them gains one): sum_{j=1..J} prod_{r in crit} a_r^j, J the
shortest of their drafts (cut to K), far below the least of their expectations when many rows tie
(eight rows at a = 0.66: 0.04 against 1.7); and `row` what a row that finishes earlier saves
each later step: the slope of a plain step's measured seconds over its rows (`StepCost.row_seconds`;
on AMX tiles a fraction of a row's share of a second token, since rows share the weights' reads).
The rows with the most budget left are the last to finish only if they run to their budget: a row
that stops at its end-of-sequence token first leaves the last step to another row. q is the share
of the group rows this engine decoded that ran to their budget (one pseudo-trial at 1/2, slowly
forgotten); with probability 1 - q their gain saves only their share of later steps. A group's
step drafts only when net(K) is at least its extra cost (the wider step's and `apart`) again (`GROUP_MARGIN`), and, with
a measured prior, never at a width whose extra cost does not show (noise, not a free step). A
step whose rows all keep the same budget drafts only when every row's draft is likely to land; a
single row is judged as before. `apart` is what a first drafted step costs every later one: the
group's sequences end at the same row until a drafted step's rows accept different lengths, and
from then on each row's appends and attention run to its own end, every plain step some percent
dearer (`StepCost.ragged_seconds`, calibrated: 8 rows of smollm2-135m in bf16 on AMX tiles, one
thread, 3-7 %). So while they end together a drafted step is charged that excess once more: the
steps after it, drafting as it does, each save what it saves and bear the excess; a step whose
saving does not cover it leaves the rows together (on `bench rl`'s fresh-noise groups a gate
without the charge drafted a few steps whose groups then ran apart, and lost to one that never
drafts). apart is 0 once they end apart. (Rows that finish apart, the server's, end apart anyway.)

`Acceptance` learns a_r from every proposal, verified or not: a draft that was not verified is
compared with the tokens the step then committed, which are the tokens a verification of it
would have committed (`verify.py`: both are plain decoding's), so a row that stops drafting keeps
learning and drafts again once its drafts would land, however many steps it ran plain. While no
draft could pay (`would_draft`: even drafts as long as the rows may verify), rows look one up only
every `PROBE_EVERY`-th step: enough to learn from, without a lookup per row and step spent for
nothing.

`StepCost` is the forward's cost: measured once per engine and batch size at every width the gate
may pick (forwards over a scratch cache one context band long) and refined from the step timings,
per context band. Every width is measured, not a line through two: the cost of a wider step is
neither flat nor linear, and grows with the context (smollm2-135m in bf16 on AMX tiles, one
thread, 8 rows at 200 tokens of context: widths 1, 2, 3, 5, 9 take 35, 40, 47, 55, 72 ms, each 16
more rows one more row of tiles; a line through widths 1 and 2 over a 16-row cache put width 3 at 36 ms, and the gate
drafted steps that cost more than they saved). Only timing depends on the gate; the committed
tokens are plain decoding's whatever it decides.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch

CONTEXT_BAND = 256  # rows of context per band of the observed costs: attention grows with context
# A group's step drafts only when it expects to save its width's extra cost twice over. Rows'
# rates come from few trials and the gate drafts exactly where they look highest, so what lands
# falls short of what it expected, and a group that finishes together gains little from any one
# step: without the margin, `bench rl`'s fresh-noise groups (smollm2-135m, bf16, AMX) drafted
# more steps and ran slower than plain decoding.
GROUP_MARGIN = 1.0
SCRATCH_ROWS = CONTEXT_BAND  # the calibration cache's context: a first band's attention beside the projections
# While even drafts as long as the rows may verify would not pay (`DraftGate.would_draft`), a
# request looks up a draft only every PROBE_EVERY-th step, to keep its acceptance learning: the
# lookups of the steps between would be spent for nothing (8 rows' lookups took about 1.5 % of a
# step of 8 RL samples of smollm2-135m in bf16 on AMX tiles, one thread), and a rate learned from a
# quarter of the steps moves within a few dozen of them
PROBE_EVERY = 4


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
    host: dict[tuple[int, int], float] = field(default_factory=dict)  # a step's host seconds by (batch, width)
    decay: float = 0.5
    # every row's trials over this engine (slowly forgotten): the prior of a new row's acceptance
    population: Acceptance = field(default_factory=lambda: Acceptance(decay=0.99))
    # per calibrated bucket: a plain step's seconds on a batch whose sequences end at different
    # rows over one whose sequences end together (`ragged_seconds`)
    ragged: dict[int, float] = field(default_factory=dict)
    finished: float = 0.0  # group rows finished (slowly forgotten), and those of them that ran to their budget
    ran_out: float = 0.0

    @property
    def budget_share(self) -> float:
        """q of the module docstring: the chance a group row runs to its token budget."""
        return (self.ran_out + 0.5) / (self.finished + 1.0)

    def record_finish(self, ran_out: bool) -> None:
        self.finished = 0.99 * self.finished + 1.0
        self.ran_out = 0.99 * self.ran_out + float(ran_out)

    def forget_rows(self) -> None:
        """Forget what the rows taught (acceptance, budget share), keep the measured costs: after a
        warm-up, whose few tokens say nothing of the requests to come."""
        self.population = Acceptance(decay=0.99)
        self.finished = self.ran_out = 0.0

    def seconds(self, batch: int, width: int, context: int) -> float:
        """Predicted forward seconds at one width (`forward_seconds`)."""
        return self.forward_seconds(batch, width, context)[-1]

    def forward_seconds(self, batch: int, widest: int, context: int) -> list[float]:
        """Predicted forward seconds at widths 1..`widest` (index w - 1). Each: observed at this
        batch, width and band; else a width observed at this batch and band scaled by the shape of
        the cost over widths (the prior's, or with no prior the widths observed at another band);
        else that shape itself. With nothing to go on, a plain step is measured first (an
        unmeasured width 1 costs nothing), then a wider one is taken to cost what the nearest
        measured width does, so it is tried. With a prior, a width costs at least the plain step
        times the prior's ratio: a wide step's observed average rests on a few noisy timings, and
        the gate drafts exactly where they came out low (a group gate that trusted them drafted 3x
        the steps and ran 3 % slower than the one with the floor, on `bench rl`'s fresh-noise
        groups, smollm2-135m, bf16, AMX)."""
        band = context // CONTEXT_BAND
        here = {w: t for (b, w, c), t in self.observed.items() if b == batch and c == band}
        shape = self._shape(batch, band)
        predicted = [self._predicted(batch, width, here, shape) for width in range(1, widest + 1)]
        if _bucket(batch) in self.prior:
            ratios = self.prior[_bucket(batch)]
            predicted = [max(seconds, predicted[0] * _line(ratios, w) / _line(ratios, 1)) for w, seconds in enumerate(predicted, 1)]
        return predicted

    def _predicted(self, batch: int, width: int, here: dict[int, float], shape: dict[int, float] | None) -> float:
        if width in here:
            return here[width]
        if here and shape is not None:
            w = min(here, key=lambda w: abs(w - width))
            return here[w] * _line(shape, width) / _line(shape, w)
        if _bucket(batch) in self.prior:
            return self._prior_seconds(batch, width)
        if shape is not None:
            return _line(shape, width)
        if len(here) >= 2:
            return _line(here, width)
        if width == 1:
            return 1e-9
        return here[min(here, key=lambda w: abs(w - width))] if here else 1.0

    def _prior_seconds(self, batch: int, width: int) -> float:
        """The prior's seconds at `batch` (its bucket measured): on the line between its bucket and
        the next one up where that was measured (a step's cost is far from proportional to its
        rows: on AMX tiles 8 rows cost about what 4 do), else its bucket's plus the fitted cost
        of each row past it (`_row_slope`)."""
        low = _bucket(batch)
        below = _line(self.prior[low], width)
        if batch == low:
            return below
        if 2 * low in self.prior:
            return below + (_line(self.prior[2 * low], width) - below) * (batch - low) / low
        slope = self._row_slope(low)
        return below + slope * (batch - low) if slope is not None else below * batch / low

    def _row_slope(self, largest: int) -> float | None:
        """The least-squares slope (>= 0) of the prior's plain-step seconds over the batch buckets
        measured up to `largest` (a difference of two single timings is mostly noise); None with
        fewer than two."""
        sizes = sorted(b for b in self.prior if b <= largest and 1 in self.prior[b])
        if len(sizes) < 2:
            return None
        mean_b = sum(sizes) / len(sizes)
        mean_t = sum(self.prior[b][1] for b in sizes) / len(sizes)
        slope = sum((b - mean_b) * (self.prior[b][1] - mean_t) for b in sizes) / sum((b - mean_b) ** 2 for b in sizes)
        return max(0.0, slope)

    def row_seconds(self, batch: int, context: int) -> float:
        """What a plain step saves when one of its rows has left: the fitted slope of the prior's
        plain steps over the buckets up to twice this batch's (`_row_slope`; measured at the
        calibration's context, `SCRATCH_ROWS`, whatever `context` is); without a prior, a row's
        share of a second token per row ((width 2 - width 1) / batch)."""
        slope = self._row_slope(2 * _bucket(batch))
        if slope is not None:
            return slope
        return max(0.0, self.seconds(batch, 2, context) - self.seconds(batch, 1, context)) / batch

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

    def ragged_seconds(self, batch: int, context: int) -> float:
        """What every later plain step costs more once a batch's sequences end at different rows
        (a drafted step whose rows accepted different lengths leaves them so: each row's appends
        and attention then run to its own end) than while they end together: the calibrated ratio
        at the batch's bucket over a plain step; 0 where not measured."""
        ratio = self.ragged.get(_bucket(batch), 1.0)
        return max(0.0, ratio - 1.0) * self.seconds(batch, 1, context)

    def host_seconds(self, batch: int, width: int) -> float:
        """A step's host seconds at this batch and width: observed, else observed at the nearest
        batch (then the nearest width there, at least its width 1's: a wider step verifies more);
        0 with nothing observed."""
        if not self.host:
            return 0.0
        if (batch, width) in self.host:
            return self.host[batch, width]
        nearest = min({b for b, _ in self.host}, key=lambda b: (abs(b - batch), b))
        widths = [w for b, w in self.host if b == nearest]
        seconds = self.host[nearest, min(widths, key=lambda w: (abs(w - width), w))]
        return max(seconds, self.host.get((nearest, 1), 0.0))

    def step_seconds(self, batch: int, widest: int, context: int) -> list[float]:
        """Predicted seconds of a whole step at widths 1..`widest` (index w - 1): its forward and
        the host work around it, none below a narrower step's (timings that disagree by noise must
        not make a wider step look free: observed widths of a batch between two calibrated ones
        came out 1 ms cheaper at width 3 than at 2, and the gate took width 3 for it)."""
        forward = self.forward_seconds(batch, widest, context)
        steps = [seconds + self.host_seconds(batch, w) for w, seconds in enumerate(forward, 1)]
        for w in range(1, len(steps)):
            steps[w] = max(steps[w], steps[w - 1])
        return steps

    def record(self, batch: int, width: int, context: int, forward_s: float, host_s: float) -> None:
        for table, key, value in ((self.observed, (batch, width, context // CONTEXT_BAND), forward_s), (self.host, (batch, width), host_s)):
            old = table.get(key)
            table[key] = value if old is None else self.decay * old + (1 - self.decay) * value

    def calibrate(self, batch: int, widths: int = 2, ragged: bool = False) -> None:
        """Measure widths 1..`widths` at `batch`'s bucket and every smaller one (a batch shrinks as
        its requests finish), each width once (the smaller of two timings, in two passes over the
        widths not yet measured); `ragged`: also what rows ending apart cost (`ragged_seconds`),
        at each bucket of two rows or more."""
        if self.engine is None:
            return
        bucket = _bucket(batch)
        while bucket >= 1:
            missing = [w for w in range(1, widths + 1) if w not in self.prior.get(bucket, {})]
            if missing:
                self.prior.setdefault(bucket, {}).update(self._measure(bucket, missing))
            if ragged and bucket > 1 and bucket not in self.ragged:
                self.ragged[bucket] = self._measure_ragged(bucket)
            bucket //= 2

    def _measure(self, bucket: int, widths: list[int]) -> dict[int, float]:
        engine, table = self.engine, {}
        with torch.inference_mode():
            _, cache = engine.prefill([[1] * SCRATCH_ROWS] * bucket)
            for width in widths * 2:
                ids = torch.ones(bucket, width, dtype=torch.long, device=engine.device)
                positions = torch.arange(SCRATCH_ROWS, SCRATCH_ROWS + width, device=engine.device).expand(bucket, width)
                table[width] = min(table.get(width, float("inf")), _timed_forward(engine, ids, positions, cache))
                cache.rollback([width] * bucket)
        return table

    def _measure_ragged(self, bucket: int, repeats: int = 5) -> float:
        """A plain step's seconds over a scratch batch whose sequences end one row apart, over the
        same batch ending together (each the least of `repeats` timings, taken in turns: a
        difference of a few percent)."""
        engine, best = self.engine, {}
        with torch.inference_mode():
            caches = {name: engine.prefill([[1] * SCRATCH_ROWS] * bucket)[1] for name in ("together", "apart")}
            apart = caches["apart"]
            engine.forward(torch.ones(bucket, 2, dtype=torch.long, device=engine.device),
                           apart.next_positions().view(-1, 1) + torch.arange(2, device=engine.device), apart, "all")
            apart.rollback([b % 2 for b in range(bucket)])
            for _ in range(repeats):
                for name, cache in caches.items():
                    ids = torch.ones(bucket, 1, dtype=torch.long, device=engine.device)
                    seconds = _timed_forward(engine, ids, cache.next_positions().view(-1, 1), cache)
                    best[name] = min(best.get(name, float("inf")), seconds)
                    cache.rollback([1] * bucket)
        return best["apart"] / best["together"]


def _timed_forward(engine, ids: torch.Tensor, positions: torch.Tensor, cache) -> float:
    """Seconds of one forward over `cache`, the device's queued work waited for (a timing of the
    forward, not of its launch)."""
    start = time.perf_counter()
    engine.forward(ids, positions, cache, "all")
    if torch.device(engine.device).type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - start


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

    def prepare(self, batch: int, widths: int = 2) -> None:
        """Measure the engine's forward at this batch size, widths 1..`widths`, if not yet measured
        (outside a step's timing); for a group, also a plain step over rows that end apart."""
        self.cost.calibrate(batch, widths, ragged=self.group)

    def choose(self, drafts: Sequence[Sequence[int]], acceptance: Sequence[Acceptance], context: int,
               remaining: Sequence[int] | None = None, together: bool = False) -> int:
        """The draft length K (0: verify nothing) with the most expected committed tokens per
        second for a step of these rows, each with its proposed draft; for a group (`remaining`:
        each row's token budget left; `together`: its sequences end at the same row), the most
        seconds saved (module docstring)."""
        batch = len(drafts)
        longest = max((len(d) for d in drafts), default=0)
        if longest == 0:
            return 0
        if self.group and remaining is not None and batch > 1:
            return self._group_choice(drafts, acceptance, context, remaining, longest, together)
        step = self.cost.step_seconds(batch, longest + 1, context)
        best_k, best_rate = 0, batch / step[0]
        for k in range(1, longest + 1):
            gain = sum(1 + a.expected(min(k, len(d))) for d, a in zip(drafts, acceptance))
            rate = gain / step[k]
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def would_draft(self, rooms: Sequence[int], acceptance: Sequence[Acceptance], context: int,
                    remaining: Sequence[int] | None = None, together: bool = False) -> bool:
        """Whether `choose` could pick a draft for rows that may verify `rooms` tokens, whatever
        they propose: `choose` over drafts of every row's whole room is an upper bound, since a
        longer draft never lowers a step's expected gain (nor, for a group, the least accept
        length among its critical rows) and a width's cost does not depend on the drafts."""
        return self.choose([range(max(0, room)) for room in rooms], acceptance, context, remaining, together) > 0

    def _group_choice(self, drafts, acceptance, context: int, remaining: Sequence[int], longest: int, together: bool) -> int:
        batch = len(drafts)
        step = self.cost.step_seconds(batch, longest + 1, context)
        plain = step[0]
        # a first drafted step leaves the rows ending apart, and every later step bears the excess
        apart = self.cost.ragged_seconds(batch, context) if together else 0.0
        # a row saves at most its share of a plain step (a fitted slope may say more), which also
        # keeps a longer draft from ever lowering net(K): `would_draft`'s bound
        row = min(self.cost.row_seconds(batch, context), plain / batch)
        last = max(remaining)
        critical = [i for i, left in enumerate(remaining) if left == last]
        rates, lengths = [a.rate for a in acceptance], [len(d) for d in drafts]
        # grown one draft token at a time: each row's a^k, the rows' summed expected accepts
        # (E_r(K) = sum_{i <= min(K, len d_r)} a_r^i), and E_crit(K) = sum_{j <= min(K, J)} (prod_crit a)^j
        power, expected = [1.0] * batch, 0.0
        crit_rate, crit_length = math.prod(rates[i] for i in critical), min(lengths[i] for i in critical)
        reach, least = 1.0, 0.0
        best_k, best_net = 0, 0.0
        for k in range(1, longest + 1):
            for r in range(batch):
                if k <= lengths[r]:
                    power[r] *= rates[r]
                    expected += power[r]
            if k <= crit_length:
                reach *= crit_rate
                least += reach
            whole = self.cost.budget_share * least
            saved = whole * plain + (expected - whole * len(critical)) * row
            wider = step[k] - plain
            extra = wider + apart
            net = saved - extra
            # with a measured prior, a width that looks free is noise; without one (vLLM's step,
            # measured as it runs) it is a width not yet tried
            if net > best_net and net > GROUP_MARGIN * extra and (wider > 0 or not self.cost.prior):
                best_k, best_net = k, net
        return best_k

    def record(self, batch: int, width: int, context: int, forward_s: float, host_s: float) -> None:
        self.cost.record(batch, width, context, forward_s, host_s)

    def finished(self, ran_out: bool) -> None:
        """A row of a group finished: at its token budget (`ran_out`) or before it."""
        if self.group:
            self.cost.record_finish(ran_out)

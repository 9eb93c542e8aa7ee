"""One speculative step over a batch of requests: draft, verify in one forward, commit, roll back.

Shapes: B requests in the batch, K the longest draft this step, V vocabulary.

Each request's cache rows hold its committed tokens except the last one (pending). A step feeds
every request's pending token and its draft (filled to K: `verification_batch`) through the model
at once, verifies each row (`verify.py`: the token plain decoding would pick at each position,
greedy or drawn from the request's `SampleKey`), commits the accepted draft tokens and the bonus
token, and rolls the cache back to the committed rows (per request: requests accept different
lengths). The bonus becomes the next pending token. A request without a drafter verifies an empty
draft: plain decoding is the same step. Drafters, the gate and the prefetcher only decide what is
verified, so the committed tokens are plain decoding's, token for token, greedy or sampled,
wherever the verification forward's rows are the same bits as a one-token step's.
A committed token's log-probabilities (when its request records them) are read off the row of
the verification logits it was chosen at, the row plain decoding would have computed.

With a `Prefetcher`, the next step's drafts are built on a worker thread while the model
verifies; after verification one probe per request finds the draft for its outcome (accept
length, bonus), which the next step verifies; a miss falls back to the drafter's own lookup.

RidgeFill's decode-time rescue runs in the step (`fill.rescue`): a request's pending token
triggers the rows its n-gram calls for, which are recomputed through the late layers just before
the step's forward, and its draft ends before a token that would trigger one, so each position
sees the rows plain decoding shows it.

Every decode path is a loop over `speculative_step`: offline decoding, plain or drafted
(`decode.generate`, `decode.speculative_generate`), rollouts and the server (`serve.scheduler`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvforge.fill.rescue import DecodeRescue
from kvforge.generation import GenerationConfig, SequenceState, commit_token
from kvforge.sampling import SampleKey
from kvforge.speculative.gate import PROBE_EVERY, Acceptance, DraftGate, step_cost
from kvforge.speculative.ngram import Drafter, NgramCache, NgramDrafter, NoDrafter, PromptLookupDrafter
from kvforge.speculative.prefetch import PREFETCHED_SOURCES, Prefetcher
from kvforge.speculative.previous import IndexedRollout
from kvforge.speculative.verify import verify

DRAFTS = ("none", "prompt-lookup", "ngram")
log = logging.getLogger("kvforge.decode")


@dataclass(frozen=True)
class DraftConfig:
    draft: str = "ngram"
    # 8 draft tokens: on a CPU, verifying 2..9 tokens costs about the same (1.6-1.9x one token)
    k: int = 8
    prefetch: bool = False
    budget: int = 16
    # a match of at least 2 tokens: a unigram match drafts too often and wastes a verification
    n_min: int = 2
    n_max: int = 4
    # each step verifies the draft length that maximises expected committed tokens per second
    # (`gate.DraftGate`: measured forward costs, learned acceptance; 0 is a plain step);
    # False verifies every proposed draft
    gate: bool = True
    # DAS-style length-aware budget: a sample that has produced t tokens drafts up to
    # min(k, k_min + t // k_ramp) tokens, so long trajectories get longer drafts; None: always k
    k_min: int | None = None
    k_ramp: int = 16

    def __post_init__(self):
        if self.draft not in DRAFTS:
            raise ValueError(f"unknown draft {self.draft!r}: use {', '.join(DRAFTS)}")
        if self.k < 1 or self.budget < 1:
            raise ValueError("k and the prefetch budget must be >= 1")
        if self.k_min is not None and not 1 <= self.k_min <= self.k or self.k_ramp < 1:
            raise ValueError(f"need 1 <= k_min <= k and k_ramp >= 1, got k_min {self.k_min}, k {self.k}, k_ramp {self.k_ramp}")
        if self.prefetch and self.draft != "ngram":
            raise ValueError("--prefetch needs --draft ngram: it reads the n-gram cache")

    def new_gate(self, engine, group: bool = False) -> DraftGate | None:
        """The gate this configuration asks for over `engine`'s measured costs (None: draft every
        step); `group`: for rows that finish together (`gate.DraftGate`)."""
        return DraftGate(step_cost(engine), group) if self.gate else None

    def k_for(self, produced: int) -> int:
        """The draft budget of a sample that has produced `produced` tokens."""
        return self.k if self.k_min is None else min(self.k, self.k_min + produced // self.k_ramp)


def new_drafters(
    config: DraftConfig, prompt: list[int], samples: int = 1, shared: NgramCache | None = None,
    previous: dict[int, list[int]] | None = None, indices: list[int] | None = None,
) -> tuple[list[Drafter], NgramCache | None]:
    """`samples` drafters for one prompt, and the n-gram cache they share (None unless the draft
    is 'ngram'): sibling samples draft from what each other wrote. `shared`: the prompt's cache
    when one is kept already (a store of earlier rollouts of the prompt); else a new one.
    `previous`: the prompt's previous rollouts by sample index; sample i (`indices[i]`, default
    i) drafts from its own first, then the others."""
    if config.draft == "ngram":
        if shared is not None and (shared.n_min, shared.n_max) != (config.n_min, config.n_max):
            raise ValueError(f"the prompt's cache holds {shared.n_min}..{shared.n_max}-grams, the drafter uses {config.n_min}..{config.n_max}")
        shared = shared if shared is not None else NgramCache(prompt, config.n_min, config.n_max)
        # each previous rollout indexed once for the group, not once per sample
        indexed = {j: IndexedRollout(tokens, config.n_min, config.n_max) for j, tokens in (previous or {}).items()}
        indices = indices if indices is not None else list(range(samples))
        own_first = lambda i: sorted(indexed, key=lambda j: (j != i, j))  # noqa: E731
        return [NgramDrafter(shared, prompt, [indexed[j] for j in own_first(i)]) for i in indices], shared
    if config.draft == "prompt-lookup":
        return [PromptLookupDrafter(config.n_min, config.n_max) for _ in range(samples)], None
    return [NoDrafter() for _ in range(samples)], None


@dataclass
class SpecStats:
    """Counters of speculative steps, for benchmarks."""

    k: int
    steps: int = 0  # verification forwards
    request_steps: int = 0  # (request, step) pairs
    drafted: int = 0
    accepted: int = 0
    prefetched: int = 0  # request-steps whose verified draft was a prefetch hit
    drafted_rows: int = 0  # request-steps that verified a draft
    drafting_steps: int = 0  # steps that verified a draft (the gate's K > 0)
    k_sum: int = 0  # the gate's K summed over those steps
    accept_hist: list[int] = field(default_factory=list)  # index j: request-steps that accepted j
    # per draft source (`NgramDrafter.SOURCES`, "prefetch" for a prefetch hit): [request-steps, drafted, accepted]
    sources: dict[str, list[int]] = field(default_factory=dict)
    # per draft source, every proposal verified or not (`NgramDrafter.matched`): [tokens compared, tokens that landed]
    proposals: dict[str, list[int]] = field(default_factory=dict)
    device_s: float = 0.0  # the verification forwards
    lookup_s: float = 0.0  # drafting on the critical path (synchronous lookups and prefetch misses)
    host_s: float = 0.0  # the rest of each step outside the forward: verify, commit, rollback
    prefetcher: Prefetcher | None = None  # its probes, hits and coverage-vs-budget record

    def __post_init__(self):
        self.accept_hist = self.accept_hist or [0] * (self.k + 1)

    @property
    def probes(self) -> int:
        return self.prefetcher.probes if self.prefetcher is not None else 0

    @property
    def hits(self) -> int:
        return self.prefetcher.hits if self.prefetcher is not None else 0

    @property
    def mean_accept_len(self) -> float:
        return self.accepted / self.request_steps if self.request_steps else 0.0

    @property
    def coverage(self) -> float:
        return self.hits / self.probes if self.probes else 0.0

    @property
    def rows_drafted(self) -> float:
        """The share of request-steps that verified a draft."""
        return self.drafted_rows / self.request_steps if self.request_steps else 0.0

    @property
    def mean_k(self) -> float:
        """The mean draft length of the steps that verified one."""
        return self.k_sum / self.drafting_steps if self.drafting_steps else 0.0

    @property
    def accept_by_source(self) -> dict[str, dict]:
        """Per draft source: the request-steps that verified its draft, the tokens drafted and
        accepted, and the accepted share."""
        return {
            source: {"rows": rows, "drafted": drafted, "accepted": accepted, "accept_rate": accepted / drafted if drafted else 0.0}
            for source, (rows, drafted, accepted) in sorted(self.sources.items())
        }

    @property
    def match_by_source(self) -> dict[str, float]:
        """Per draft source, the share of its proposed tokens (verified or not, compared with what
        the request committed next) that would have been accepted: what the source is worth,
        whatever the gate verified."""
        return {source: landed / compared for source, (compared, landed) in sorted(self.proposals.items()) if compared}

    def add(self, other: "SpecStats") -> None:
        """Add another run's counters (the groups of one pass summed; the prefetcher stays this one's)."""
        for name in ("steps", "request_steps", "drafted", "accepted", "prefetched", "drafted_rows", "drafting_steps", "k_sum",
                     "device_s", "lookup_s", "host_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accept_hist = [a + b for a, b in zip(self.accept_hist, other.accept_hist)]
        for mine, theirs in ((self.sources, other.sources), (self.proposals, other.proposals)):
            for source, counts in theirs.items():
                total = mine.setdefault(source, [0] * len(counts))
                total[:] = [a + b for a, b in zip(total, counts)]

    def add_proposals(self, drafter) -> None:
        """Add a finished request's drafter's per-source tally (drafters that keep none add nothing)."""
        for source, (compared, landed) in getattr(drafter, "matched", {}).items():
            total = self.proposals.setdefault(source, [0, 0])
            total[0], total[1] = total[0] + compared, total[1] + landed

    def as_dict(self) -> dict:
        return {
            "k": self.k,
            "steps": self.steps,
            "mean_accept_len": self.mean_accept_len,
            "accept_hist": self.accept_hist,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "prefetched": self.prefetched,
            "rows_drafted": self.rows_drafted,
            "mean_k": self.mean_k,
            "accept_by_source": self.accept_by_source,
            "match_by_source": self.match_by_source,
            "device_ms_per_step": 1000 * self.device_s / max(1, self.steps),
            "lookup_ms_per_step": 1000 * self.lookup_s / max(1, self.steps),
            "host_ms_per_step": 1000 * (self.host_s + self.lookup_s) / max(1, self.steps),
            "coverage": self.coverage if self.probes else None,
        }


@dataclass
class SpecRequest:
    """One request between steps. Invariant: the batch cache holds `context[:-1]`; the last
    committed token (pending) is fed by the next step."""

    key: int  # names the request to the gate and the prefetcher
    seq: SequenceState
    context: list[int]  # prompt and committed tokens
    config: GenerationConfig
    drafter: Drafter
    sample_key: SampleKey | None = None  # the noise its sampled tokens are drawn with (None: greedy only)
    eos: set[int] = field(default_factory=set)
    on_text: Callable[[int, str], None] | None = None
    ngram: NgramCache | None = None  # the cache the prefetcher reads; None: not prefetched
    k_for: Callable[[int], int] | None = None  # draft budget by tokens produced (`DraftConfig.k_for`); None: the step's k
    ready: list[int] | None = None  # the prefetch hit for the next step's draft
    rescue: DecodeRescue | None = None  # RidgeFill's rescue of filled prompt rows (`fill.rescue`); None: none
    offset: int = 0  # cached positions before the prompt (a prompt that continues a cache)
    acceptance: Acceptance = field(default_factory=Acceptance)  # what its proposals are worth, for the gate
    error: str | None = None  # why its share of a step failed (`speculative_step(isolate=True)`); it is finished
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    prefetched: int = 0  # steps whose draft was a prefetch hit

    @property
    def pending(self) -> int:
        return self.context[-1]

    @property
    def finished(self) -> bool:
        return self.seq.finish_reason is not None

    @property
    def mean_accept_len(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0


@dataclass
class StepOutcome:
    """One request's share of a step."""

    drafted: int  # draft tokens verified
    accepted: int
    committed: int  # accepted + bonus, fewer when the request finished
    prefetch_hit: bool | None  # None: not probed


def commit(
    request: SpecRequest, tokens: list[int], tokenizer, context_limit: int, now: float | None = None, logits: torch.Tensor | None = None
) -> list[int]:
    """Commit `tokens` in order until the request finishes (EOS, a stop string, max tokens, the
    context's end); the drafter observes what was committed. `logits` (len(tokens), V): the rows
    the tokens were chosen from, for their log-probabilities. Returns the committed tokens."""
    now = time.perf_counter() if now is None else now
    logprobs = request.config.token_logprobs(logits, tokens) if logits is not None else None
    committed = []
    for i, token in enumerate(tokens):
        commit_token(request.seq, token, now, tokenizer, request.eos, request.config, request.on_text, logprobs[i] if logprobs else None)
        request.context.append(token)
        committed.append(token)
        if request.finished:
            break
    if not request.finished and request.offset + len(request.context) >= context_limit:
        request.seq.finish_reason = "length"
    request.drafter.observe(committed)
    return committed


def verification_batch(pending: list[int], drafts: list[list[int]], starts: list[int], fill: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One verification forward's inputs: per request its pending token at position starts[i]
    then its draft, padded to the longest draft with invisible slots (position -1), or with
    `fill` with copies of its pending token at the positions that follow: rows no query of the
    request sees (each sees only earlier positions), never accepted (past its draft's length),
    rolled back with the rest, which keep every sequence's rows contiguous, so the forward takes
    attention's unmasked path (a masked step of 8 sampled rows of smollm2-135m in bf16 on AMX,
    one thread: a quarter slower). Returns ids (B, K+1), positions (B, K+1) and the draft
    lengths (B,)."""
    width = max(len(d) for d in drafts)
    ids = torch.tensor(pending, dtype=torch.long).unsqueeze(1).repeat(1, width + 1)
    positions = torch.tensor(starts, dtype=torch.long).unsqueeze(1) + torch.arange(width + 1)
    for row, d in enumerate(drafts):
        ids[row, 1 : 1 + len(d)] = torch.tensor(d, dtype=torch.long)
        if not fill:
            positions[row, 1 + len(d) :] = -1
    return ids, positions, torch.tensor([len(d) for d in drafts], dtype=torch.long)


@torch.inference_mode()
def speculative_step(
    engine,
    cache,
    requests: list[SpecRequest],
    k: int,
    gate: DraftGate | None = None,
    prefetcher: Prefetcher | None = None,
    stats: SpecStats | None = None,
    isolate: bool = False,
) -> list[StepOutcome]:
    """One step for the batch in `cache` (row b is requests[b]); the cache is rolled back in
    place. Drafts of up to `k` tokens come from the prefetch hit of the previous step, else the
    request's drafter (each request's budget: its `k_for`, at most `k`); `gate` (None: verify
    every proposed draft) cuts them to the step's draft length, 0 for a plain step. With a `prefetcher`, requests with an `ngram` cache
    whose draft came from the n-gram chain get their next drafts built during the forward (a hit keeps
    the chain until a miss consults the drafter's sources again). `isolate`: a request whose own share of the step raises
    (drafting, committing, streaming its text) fails alone (`SpecRequest.error`, finish reason
    "error") and the others go on; else the exception propagates. The forward is the batch's."""
    limit = engine.rollback_rows
    if limit is not None and k + 1 > limit:
        raise ValueError(f"k {k} is too long for this model: its recurrent layers roll back steps of at most {limit} rows (k <= {limit - 1})")
    stats = stats if stats is not None else SpecStats(k)
    tokenizer, context_limit = engine.model.tokenizer, engine.model.context_length
    # a batch of plain requests has nothing to gate: its step costs are never measured for it (a
    # measurement is a pause of every stream, seconds at a batch of 16 on a CPU without AMX)
    gating = gate is not None and any(not isinstance(r.drafter, NoDrafter) or r.ready is not None for r in requests)
    if gating:
        gate.prepare(len(requests), k + 1)
    step_start, lookup_s = time.perf_counter(), 0.0
    rooms = [_room(r, k, context_limit) for r in requests]
    context = max(len(r.context) for r in requests)
    remaining = [r.config.max_new_tokens - len(r.seq.token_ids) for r in requests]
    together = len({r.offset + len(r.context) for r in requests}) == 1  # the sequences end at the same row
    # a step that would verify no draft however long the rows' drafts came out looks up none,
    # but on every PROBE_EVERY-th step of a request: its acceptance keeps learning
    probing_only = gating and not gate.would_draft(rooms, [r.acceptance for r in requests], context, remaining, together)
    proposals, prefetched, sources = [], [], []  # per row: the draft proposed, 1 when it is the previous step's prefetch hit, its source
    for r, room in zip(requests, rooms):
        ready, r.ready = r.ready, None
        proposal, flag, source = [], 0, None
        if room > 0 and ready is not None:
            proposal, flag, source = ready[:room], 1, "prefetch"
        elif room > 0 and not (probing_only and r.steps % PROBE_EVERY):
            t = time.perf_counter()
            try:
                proposal, source = r.drafter.propose(r.context, room)[:room], getattr(r.drafter, "source", None)
            except Exception as exc:
                _fail(r, exc, isolate)
            lookup_s += time.perf_counter() - t
        proposals.append(proposal)
        prefetched.append(flag)
        sources.append(source)
    # RidgeFill's rescue: the pending token triggers what its n-gram calls for; a draft ends before
    # a token that would trigger one, which triggers it as a later step's pending token (`fill.rescue`)
    rescued = [r.rescue.due(r.context) if r.rescue is not None else [] for r in requests]
    proposals = [r.rescue.draft_before(r.context, p) if r.rescue is not None else p for r, p in zip(requests, proposals)]
    step_k = gate.choose(proposals, [r.acceptance for r in requests], context, remaining, together) if gating else k
    drafts = [p[:step_k] for p in proposals]
    prefetched = [flag if d else 0 for flag, d in zip(prefetched, drafts)]
    starts = [r.offset + len(r.context) - 1 for r in requests]
    # fillers, not padding, where every filler stays inside the context and no recurrent layer
    # (a hybrid's) would run them
    fill = engine.rollback_rows is None and max(starts) + max(map(len, drafts)) < context_limit
    ids, positions, lengths = verification_batch([r.pending for r in requests], drafts, starts, fill)
    width = ids.shape[1] - 1
    future = None
    if prefetcher is not None and width:  # a plain step (the gate's choice) is likely followed by another: no tables
        # the tables hold the n-gram chain's next drafts: a row whose drafter chose another source
        # (a previous rollout, prompt lookup: a slice or an index lookup, cheap) looks that up at its next step
        prefetching = {r.key: (r.ngram, r.context[:], d) for r, d, source in zip(requests, drafts, sources)
                       if r.ngram is not None and source in PREFETCHED_SOURCES}
        future = prefetcher.start(prefetching) if prefetching else None
    t = time.perf_counter()
    for row, (r, rows) in enumerate(zip(requests, rescued)):
        if rows:  # before the forward, in a pass of their own: the step's rows keep the shapes (and bits) of a step without them
            r.rescue.late_layers(engine, cache.sequence(row), rows)
            cache.unshare(rows[0])
    rescue_s = time.perf_counter() - t
    t = time.perf_counter()
    logits = engine.forward(ids.to(engine.device), positions.to(engine.device), cache, "all")  # (B, K+1, V)
    device_s = time.perf_counter() - t
    accepted, bonus = _verify_rows(logits, ids, lengths, requests)
    if width:  # keep the pending row and the accepted drafts (a plain step has nothing to drop)
        cache.rollback([width - j for j in accepted])
    branches = future.result() if future is not None else {}  # the n-gram caches change only after this
    now = time.perf_counter()
    outcomes = []
    stats.steps += 1
    if width:
        stats.drafting_steps += 1
        stats.k_sum += width
    for row, r in enumerate(requests):
        if r.error is not None:  # failed while drafting: its rows go with it
            outcomes.append(StepOutcome(0, 0, 0, None))
            continue
        j, d = accepted[row], drafts[row]
        stats.request_steps += 1
        stats.accept_hist[j] += 1
        stats.drafted_rows += bool(d)
        if d:
            counts = stats.sources.setdefault(sources[row] or "other", [0, 0, 0])
            counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + len(d), counts[2] + j
        r.steps += 1
        for counts in (stats, r):
            counts.drafted += len(d)
            counts.accepted += j
            counts.prefetched += prefetched[row]
        committed, hit = [], None
        try:
            committed = commit(r, d[:j] + [bonus[row]], tokenizer, context_limit, now, logits[row, : j + 1])
            r.acceptance.observe(proposals[row], committed)
            if r.key in branches:
                r.ready = prefetcher.probe(r.key, branches[r.key], j, bonus[row])
                hit = r.ready is not None
        except Exception as exc:
            _fail(r, exc, isolate)
        outcomes.append(StepOutcome(len(d), j, len(committed), hit))
    host_s = time.perf_counter() - step_start - device_s - rescue_s
    if gate is not None:  # the step's own forward and host work: a rescue pass is RidgeFill's, not the draft width's
        gate.record(len(requests), width + 1, context, device_s, host_s)
    stats.device_s += device_s + rescue_s
    stats.lookup_s += lookup_s
    stats.host_s += host_s - lookup_s
    return outcomes


def _room(request: SpecRequest, k: int, context_limit: int) -> int:
    """The most draft tokens `request` may verify this step: its budget (`k_for`, at most `k`),
    cut to leave its pending token's bonus inside its token limit and the context."""
    r = request
    budget = min(k, r.k_for(len(r.seq.token_ids))) if r.k_for is not None else k
    return min(budget, r.config.max_new_tokens - len(r.seq.token_ids) - 1, context_limit - r.offset - len(r.context) - 1)


def _verify_rows(logits: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, requests: list[SpecRequest]) -> tuple[list[int], list[int]]:
    """Accept lengths and bonus tokens per row; rows that share sampling settings are verified in
    one call (every greedy row together). Each row's tokens depend on its own logits and key
    alone, whatever it is batched with."""
    groups: dict[object, tuple] = {}
    for row, r in enumerate(requests):
        params = r.config.sampling
        groups.setdefault("greedy" if params.greedy else params, (params, []))[1].append(row)
    drafts, lengths = ids[:, 1:].to(logits.device), lengths.to(logits.device)
    accepted, bonus = [0] * len(requests), [0] * len(requests)
    for params, rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        width = int(lengths[index].max())
        keys = [requests[row].sample_key for row in rows]
        positions = [requests[row].offset + len(requests[row].context) for row in rows]  # the pending token sits one before
        a, b = verify(logits[index, : width + 1], drafts[index, :width], lengths[index], params, keys, positions)
        for row, j, token in zip(rows, a.tolist(), b.tolist()):
            accepted[row], bonus[row] = j, token
    return accepted, bonus


def _fail(request: SpecRequest, exc: Exception, isolate: bool) -> None:
    """Finish `request` with the error its share of a step raised (logged with its traceback), or
    re-raise it when the step does not isolate requests."""
    if not isolate:
        raise exc
    log.exception("request %s failed in a decode step", request.key)
    request.error = f"{type(exc).__name__}: {exc}"
    request.seq.finish_reason = "error"


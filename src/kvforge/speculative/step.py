"""One speculative step over a batch of requests: draft, verify in one forward, commit, roll back.

Shapes: B requests in the batch, K the longest draft this step, V vocabulary.

Each request's cache rows hold its committed tokens except the last one (pending). A step feeds
every request's pending token and its draft (padded to K with invisible slots) through the model
at once, verifies each row (`verify.py`, with the request's own sampling settings and
generator), commits the accepted draft tokens and the bonus token, and rolls the cache back to
the committed rows (per request: requests accept different lengths). The bonus becomes the next
pending token. A request without a drafter verifies an empty draft: plain decoding is the same
step. Drafters, the gate and the prefetcher only decide what is verified, so the committed
tokens are plain decoding's: the same tokens greedy, the same distribution when sampling.
A committed token's log-probabilities (when its request records them) are read off the row of
the verification logits it was chosen at, the row plain decoding would have computed: a bonus
drawn after a rejection still reports its probability under the model's sampling distribution,
not under the residual it was resampled from (its marginal is that distribution).

With a `Prefetcher`, the next step's drafts are built on a worker thread while the model
verifies; after verification one probe per request finds the draft for its outcome (accept
length, bonus), which the next step verifies; a miss falls back to the drafter's own lookup.

The offline loop (`decode.speculative_generate`) and the server (`serve.scheduler`) are loops
over `speculative_step`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvforge.generation import GenerationConfig, SequenceState, commit_token
from kvforge.speculative.ngram import Drafter, NgramCache, NgramDrafter, NoDrafter, PromptLookupDrafter
from kvforge.speculative.prefetch import Prefetcher
from kvforge.speculative.verify import verify

DRAFTS = ("none", "prompt-lookup", "ngram")


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
    # stop drafting for a request while it accepts < 1 token per drafted step, retry after
    # `gate_retry` steps, doubling the wait after each failed retry up to `gate_max_retry`;
    # False drafts every step. On the copy prompts (`benchmarks/gate_replay.py`, greedy outputs
    # replayed) a fixed retry of 8 steps gave up 25 % of the tokens per step that drafting every
    # step gets (2.74 vs 3.66), retry 2 with doubling 2 % (3.58), while a request that never
    # accepts (sampling at temperature 1) still drafts ever more rarely.
    gate: bool = True
    gate_retry: int = 2
    gate_max_retry: int = 64
    # DAS-style length-aware budget: a sample that has produced t tokens drafts up to
    # min(k, k_min + t // k_ramp) tokens, so long trajectories get longer drafts; None: always k
    k_min: int | None = None
    k_ramp: int = 16

    def __post_init__(self):
        if self.draft not in DRAFTS:
            raise ValueError(f"unknown draft {self.draft!r}: use {', '.join(DRAFTS)}")
        if self.k < 1 or self.budget < 1:
            raise ValueError("k and the prefetch budget must be >= 1")
        if not 1 <= self.gate_retry <= self.gate_max_retry:
            raise ValueError(f"need 1 <= gate_retry <= gate_max_retry, got {self.gate_retry}, {self.gate_max_retry}")
        if self.k_min is not None and not 1 <= self.k_min <= self.k or self.k_ramp < 1:
            raise ValueError(f"need 1 <= k_min <= k and k_ramp >= 1, got k_min {self.k_min}, k {self.k}, k_ramp {self.k_ramp}")
        if self.prefetch and self.draft != "ngram":
            raise ValueError("--prefetch needs --draft ngram: it reads the n-gram cache")

    def new_gate(self) -> "DraftGate | None":
        """The gate this configuration asks for (None: draft every step)."""
        return DraftGate(retry=self.gate_retry, max_retry=self.gate_max_retry) if self.gate else None

    def k_for(self, produced: int) -> int:
        """The draft budget of a sample that has produced `produced` tokens."""
        return self.k if self.k_min is None else min(self.k, self.k_min + produced // self.k_ramp)


def new_drafters(
    config: DraftConfig, prompt: list[int], samples: int = 1, shared: NgramCache | None = None
) -> tuple[list[Drafter], NgramCache | None]:
    """`samples` drafters for one prompt, and the n-gram cache they share (None unless the draft
    is 'ngram'): sibling samples draft from what each other wrote. `shared`: the prompt's cache
    when one is kept already (a store of earlier rollouts of the prompt); else a new one."""
    if config.draft == "ngram":
        if shared is not None and (shared.n_min, shared.n_max) != (config.n_min, config.n_max):
            raise ValueError(f"the prompt's cache holds {shared.n_min}..{shared.n_max}-grams, the drafter uses {config.n_min}..{config.n_max}")
        shared = shared if shared is not None else NgramCache(prompt, config.n_min, config.n_max)
        return [NgramDrafter(shared, prompt) for _ in range(samples)], shared
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
    accept_hist: list[int] = field(default_factory=list)  # index j: request-steps that accepted j
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

    def as_dict(self) -> dict:
        return {
            "k": self.k,
            "steps": self.steps,
            "mean_accept_len": self.mean_accept_len,
            "accept_hist": self.accept_hist,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "prefetched": self.prefetched,
            "device_ms_per_step": 1000 * self.device_s / max(1, self.steps),
            "lookup_ms_per_step": 1000 * self.lookup_s / max(1, self.steps),
            "host_ms_per_step": 1000 * (self.host_s + self.lookup_s) / max(1, self.steps),
            "coverage": self.coverage if self.probes else None,
        }


class DraftGate:
    """Drafting widens the verification forward (on this CPU 2..9 tokens cost 1.6-1.9x one), so it
    pays only while drafts are accepted. A request whose recent accepted tokens per drafted step
    (exponential average) fall below `min_accepted` stops drafting and retries every `retry`
    steps; with `max_retry` > `retry`, each retry that fails doubles the wait (up to `max_retry`),
    so a request that never accepts (sampling at temperature 1) drafts ever more rarely. Only
    timing depends on it: committed tokens are the model's either way."""

    def __init__(self, min_accepted: float = 1.0, decay: float = 0.7, retry: int = 8, max_retry: int | None = None):
        self.min_accepted, self.decay, self.retry = min_accepted, decay, retry
        self.max_retry = max(retry, max_retry or retry)
        self.average: dict[int, float] = {}
        self.idle: dict[int, int] = {}
        self.wait: dict[int, int] = {}  # the request's current retry interval

    def allows(self, request: int) -> bool:
        if self.average.get(request, self.min_accepted) >= self.min_accepted:
            return True
        self.idle[request] = self.idle.get(request, 0) + 1
        return self.idle[request] >= self.wait.get(request, self.retry)

    def forget(self, request: int) -> None:
        """Drop a finished request's history (a server sees unboundedly many)."""
        self.average.pop(request, None)
        self.idle.pop(request, None)
        self.wait.pop(request, None)

    def record(self, request: int, drafted: int, accepted: int) -> None:
        if drafted:
            previous = self.average.get(request, float(accepted))
            self.average[request] = self.decay * previous + (1 - self.decay) * accepted
            if self.idle.get(request, 0) > 0 and self.average[request] < self.min_accepted:  # a retry that failed
                self.wait[request] = min(2 * self.wait.get(request, self.retry), self.max_retry)
            elif self.average[request] >= self.min_accepted:
                self.wait.pop(request, None)
            self.idle[request] = 0


@dataclass
class SpecRequest:
    """One request between steps. Invariant: the batch cache holds `context[:-1]`; the last
    committed token (pending) is fed by the next step."""

    key: int  # names the request to the gate and the prefetcher
    seq: SequenceState
    context: list[int]  # prompt and committed tokens
    config: GenerationConfig
    drafter: Drafter
    generator: torch.Generator | None = None  # requests may share one (a batch) or own one (a server)
    eos: set[int] = field(default_factory=set)
    on_text: Callable[[int, str], None] | None = None
    ngram: NgramCache | None = None  # the cache the prefetcher reads; None: not prefetched
    k_for: Callable[[int], int] | None = None  # draft budget by tokens produced (`DraftConfig.k_for`); None: the step's k
    ready: list[int] | None = None  # the prefetch hit for the next step's draft
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
    if not request.finished and len(request.context) >= context_limit:
        request.seq.finish_reason = "length"
    request.drafter.observe(committed)
    return committed


def verification_batch(pending: list[int], drafts: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One verification forward's inputs: per request its pending token at position starts[i]
    then its draft, padded to the longest draft with invisible slots (position -1).
    Returns ids (B, K+1), positions (B, K+1) and the draft lengths (B,)."""
    width = max(len(d) for d in drafts)
    ids = torch.zeros(len(drafts), width + 1, dtype=torch.long)
    positions = torch.full((len(drafts), width + 1), -1, dtype=torch.long)
    for row, (token, d, n) in enumerate(zip(pending, drafts, starts)):
        ids[row, 0] = token
        ids[row, 1 : 1 + len(d)] = torch.tensor(d, dtype=torch.long)
        positions[row, : 1 + len(d)] = torch.arange(n, n + 1 + len(d))
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
) -> list[StepOutcome]:
    """One step for the batch in `cache` (row b is requests[b]); the cache is rolled back in
    place. Drafts of up to `k` tokens come from the prefetch hit of the previous step, else the
    request's drafter (each request's budget: its `k_for`, at most `k`); `gate` (None: draft
    every step) may skip a request's draft. With a `prefetcher`, requests with an `ngram` cache
    get their next drafts built during the forward."""
    limit = engine.rollback_rows
    if limit is not None and k + 1 > limit:
        raise ValueError(f"k {k} is too long for this model: its recurrent layers roll back steps of at most {limit} rows (k <= {limit - 1})")
    stats = stats if stats is not None else SpecStats(k)
    tokenizer, context_limit = engine.model.tokenizer, engine.model.context_length
    step_start, lookup_s = time.perf_counter(), 0.0
    drafts, prefetched = [], []  # per row: the draft, and 1 when it is the previous step's prefetch hit
    for r in requests:
        ready, r.ready = r.ready, None
        budget = min(k, r.k_for(len(r.seq.token_ids))) if r.k_for is not None else k
        room = min(budget, r.config.max_new_tokens - len(r.seq.token_ids) - 1, context_limit - len(r.context) - 1)
        if room <= 0 or (gate is not None and not gate.allows(r.key)):
            drafts.append([])
            prefetched.append(0)
        elif ready is not None:
            drafts.append(ready[:room])
            prefetched.append(1)
        else:
            t = time.perf_counter()
            drafts.append(r.drafter.propose(r.context, room)[:room])
            lookup_s += time.perf_counter() - t
            prefetched.append(0)
    ids, positions, lengths = verification_batch([r.pending for r in requests], drafts, [len(r.context) - 1 for r in requests])
    width = ids.shape[1] - 1
    future = None
    if prefetcher is not None:
        prefetching = {r.key: (r.ngram, r.context[:], d) for r, d in zip(requests, drafts) if r.ngram is not None}
        future = prefetcher.start(prefetching) if prefetching else None
    t = time.perf_counter()
    logits = engine.forward(ids.to(engine.device), positions.to(engine.device), cache, "all")  # (B, K+1, V)
    device_s = time.perf_counter() - t
    accepted, bonus = _verify_rows(logits, ids, lengths, requests)
    cache.rollback([width - j for j in accepted])  # keep the pending row and the accepted drafts
    branches = future.result() if future is not None else {}  # the n-gram caches change only after this
    now = time.perf_counter()
    outcomes = []
    stats.steps += 1
    for row, r in enumerate(requests):
        j, d = accepted[row], drafts[row]
        stats.request_steps += 1
        stats.accept_hist[j] += 1
        r.steps += 1
        for counts in (stats, r):
            counts.drafted += len(d)
            counts.accepted += j
            counts.prefetched += prefetched[row]
        if gate is not None:
            gate.record(r.key, len(d), j)
        committed = commit(r, d[:j] + [bonus[row]], tokenizer, context_limit, now, logits[row, : j + 1])
        hit = None
        if r.key in branches:
            r.ready = prefetcher.probe(r.key, branches[r.key], j, bonus[row])
            hit = r.ready is not None
        outcomes.append(StepOutcome(len(d), j, len(committed), hit))
    stats.device_s += device_s
    stats.lookup_s += lookup_s
    stats.host_s += time.perf_counter() - step_start - device_s - lookup_s
    return outcomes


def _verify_rows(logits: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor, requests: list[SpecRequest]) -> tuple[list[int], list[int]]:
    """Accept lengths and bonus tokens per row. Rows that share sampling settings and a generator
    are verified in one call (every greedy row together), cut to their own longest draft; a
    request with its own generator then draws from it as it would alone, so a seeded request is
    reproducible whatever it is batched with."""
    groups: dict[object, tuple] = {}
    for row, r in enumerate(requests):
        params = r.config.sampling
        key = "greedy" if params.greedy else (params, id(r.generator))
        groups.setdefault(key, (params, r.generator, []))[2].append(row)
    drafts, lengths = ids[:, 1:].to(logits.device), lengths.to(logits.device)
    accepted, bonus = [0] * len(requests), [0] * len(requests)
    for params, generator, rows in groups.values():
        index = torch.tensor(rows, device=logits.device)
        width = int(lengths[index].max())  # the group's own longest draft: its draws do not depend on other rows
        a, b = verify(logits[index, : width + 1], drafts[index, :width], lengths[index], params, generator)
        for row, j, token in zip(rows, a.tolist(), b.tolist()):
            accepted[row], bonus[row] = j, token
    return accepted, bonus

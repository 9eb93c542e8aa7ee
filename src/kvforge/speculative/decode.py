"""Speculative decoding: draft, verify in one batched forward, commit, roll the cache back.

Shapes: B requests in the batch, K the longest draft this step, V vocabulary.

Each request's cache holds its committed tokens except the last one (pending). A step feeds every
request's pending token and its draft (padded to K with invisible slots) through the model at
once, verifies (`verify.py`), commits the accepted draft tokens and the bonus token, and rolls
the cache back to the committed rows (per request: requests accept different lengths). The bonus
becomes the next pending token. Drafters only decide what is verified, so the committed tokens
are plain decoding's: the same tokens greedy, the same distribution when sampling.

With a `Prefetcher`, the next step's drafts are built on a worker thread while the model
verifies; after verification one probe per request picks the draft for its outcome, and a miss
falls back to the drafter's own lookup for that request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvforge.generation import Generation, GenerationConfig, _commit, _flush, _Sequence, check_prompts, eos_token_ids
from kvforge.sampling import sample
from kvforge.speculative.ngram import Drafter
from kvforge.speculative.prefetch import Prefetcher
from kvforge.speculative.verify import verify


@dataclass
class SpecStats:
    """Counters of one speculative run, for benchmarks."""

    k: int
    steps: int = 0  # verification forwards
    request_steps: int = 0  # (request, step) pairs
    drafted: int = 0
    accepted: int = 0
    accept_hist: list[int] = field(default_factory=list)  # index j: request-steps that accepted j
    device_s: float = 0.0  # the verification forwards
    lookup_s: float = 0.0  # drafting on the critical path (synchronous lookups and prefetch misses)
    host_s: float = 0.0  # the rest of each step outside the forward: verify, commit, rollback
    prefetcher: Prefetcher | None = None  # its probes, hits and coverage-vs-budget record

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
            "device_ms_per_step": 1000 * self.device_s / max(1, self.steps),
            "lookup_ms_per_step": 1000 * self.lookup_s / max(1, self.steps),
            "host_ms_per_step": 1000 * (self.host_s + self.lookup_s) / max(1, self.steps),
            "coverage": self.coverage if self.probes else None,
        }


class DraftGate:
    """Drafting widens the verification forward (on this CPU 2..9 tokens cost 1.6-1.9x one), so it
    pays only while drafts are accepted. A request whose recent accepted tokens per drafted step
    (exponential average) fall below `min_accepted` stops drafting and retries every `retry`
    steps. Only timing depends on it: committed tokens are the model's either way."""

    def __init__(self, min_accepted: float = 1.0, decay: float = 0.7, retry: int = 8):
        self.min_accepted, self.decay, self.retry = min_accepted, decay, retry
        self.average: dict[int, float] = {}
        self.idle: dict[int, int] = {}

    def allows(self, request: int) -> bool:
        if self.average.get(request, self.min_accepted) >= self.min_accepted:
            return True
        self.idle[request] = self.idle.get(request, 0) + 1
        return self.idle[request] >= self.retry

    def forget(self, request: int) -> None:
        """Drop a finished request's history (a server sees unboundedly many)."""
        self.average.pop(request, None)
        self.idle.pop(request, None)

    def record(self, request: int, drafted: int, accepted: int) -> None:
        if drafted:
            previous = self.average.get(request, float(accepted))
            self.average[request] = self.decay * previous + (1 - self.decay) * accepted
            self.idle[request] = 0


@torch.inference_mode()
def speculative_generate(
    engine,
    prompts: list[list[int]],
    drafters: list[Drafter],
    config: GenerationConfig | None = None,
    k: int = 4,
    prefetcher: Prefetcher | None = None,
    caches: list | None = None,
    on_text: Callable[[int, str], None] | None = None,
    plan=None,
    gate: DraftGate | None = None,
) -> tuple[list[Generation], SpecStats]:
    """Generate for a batch of prompts with one drafter each. `caches[i]`, with a prefetcher, is
    request i's n-gram cache (the prefetcher reads its successors). `plan`: a `PrefillPlan` for
    a single prompt (RidgeFill, SPEED); verification always runs every layer."""
    config = config or GenerationConfig()
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if len(drafters) != len(prompts):
        raise ValueError("one drafter per prompt")
    context_limit = check_prompts(prompts, engine.model.context_length)
    tokenizer, eos, params = engine.model.tokenizer, (set() if config.ignore_eos else eos_token_ids(engine.model)), config.sampling
    generator = params.generator(engine.device)
    stats = SpecStats(k, accept_hist=[0] * (k + 1), prefetcher=prefetcher)
    seqs = [_Sequence(i, len(p)) for i, p in enumerate(prompts)]
    contexts = [list(p) for p in prompts]

    start = time.perf_counter()
    logits, cache = engine.prefill(prompts, plan=plan)
    first = sample(logits, params, generator).tolist()
    now = time.perf_counter()
    for i, tok in enumerate(first):
        _commit(seqs[i], tok, now, tokenizer, eos, config, on_text)
        contexts[i].append(tok)
        drafters[i].observe([tok])
    active = list(range(len(prompts)))
    pending = first[:]  # per request: the committed token not yet in the cache
    ready: dict[int, list[int]] = {}  # prefetched drafts for the next step
    active, cache = _drop_finished(seqs, active, cache, contexts, context_limit)
    while active:
        step_start, lookup_before = time.perf_counter(), stats.lookup_s
        drafts = []
        for i in active:
            room = min(k, config.max_new_tokens - len(seqs[i].token_ids) - 1, context_limit - len(contexts[i]) - 1)
            if room <= 0 or (gate is not None and not gate.allows(i)):
                drafts.append([])
                continue
            if i in ready:
                drafts.append(ready.pop(i)[:room])
            else:
                t = time.perf_counter()
                drafts.append(drafters[i].propose(contexts[i], room)[:room])
                stats.lookup_s += time.perf_counter() - t
        ready.clear()
        ids, positions, lengths = verification_batch([pending[i] for i in active], drafts, [len(contexts[i]) - 1 for i in active])
        width = ids.shape[1] - 1
        future = None
        if prefetcher is not None:
            future = prefetcher.start({i: (caches[i], contexts[i][:], d) for i, d in zip(active, drafts)})
        host_before = time.perf_counter() - step_start - (stats.lookup_s - lookup_before)
        t = time.perf_counter()
        logits = engine.forward(ids.to(engine.device), positions.to(engine.device), cache, "all")
        stats.device_s += time.perf_counter() - t
        t = time.perf_counter()
        accepted, bonus = verify(logits, ids[:, 1:].to(logits.device), lengths.to(logits.device), params, generator)
        accepted, bonus = accepted.tolist(), bonus.tolist()
        cache.rollback([width - j for j in accepted])  # keep the pending row and the accepted drafts
        branches = future.result() if future is not None else {}
        now = time.perf_counter()
        stats.steps += 1
        for row, i in enumerate(active):
            j, d = accepted[row], drafts[row]
            stats.request_steps += 1
            stats.drafted += len(d)
            stats.accepted += j
            stats.accept_hist[j] += 1
            if gate is not None:
                gate.record(i, len(d), j)
            committed = []
            for tok in d[:j] + [bonus[row]]:
                _commit(seqs[i], tok, now, tokenizer, eos, config, on_text)
                contexts[i].append(tok)
                committed.append(tok)
                if seqs[i].finish_reason is not None:
                    break
            drafters[i].observe(committed)
            pending[i] = committed[-1]
            if i in branches:
                hit = prefetcher.probe(i, branches[i], j, bonus[row])
                if hit is not None:
                    ready[i] = hit
        active, cache = _drop_finished(seqs, active, cache, contexts, context_limit)
        stats.host_s += host_before + (time.perf_counter() - t)
    for seq in seqs:
        _flush(seq, on_text)
    outputs = [
        Generation(s.token_ids, s.text, s.finish_reason, s.prompt_tokens, s.first_token_at - start, s.last_token_at - s.first_token_at, s.stop_matched)
        for s in seqs
    ]
    return outputs, stats


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


def _drop_finished(seqs, active: list[int], cache, contexts, context_limit: int):
    """Requests still running (a request at the context's end finishes with 'length'), and the
    cache restricted to them."""
    for i in active:
        if seqs[i].finish_reason is None and len(contexts[i]) >= context_limit:
            seqs[i].finish_reason = "length"
    keep = [row for row, i in enumerate(active) if seqs[i].finish_reason is None]
    if len(keep) < len(active) and keep:
        cache = cache.select_batch(torch.tensor(keep, device=cache[0].k.device))
    return [active[row] for row in keep], cache

"""NgramRL as a vLLM speculative proposer (`method="custom_class"`).

Shapes: R rows in vLLM's input batch this step, L the model's maximum length.

After every step vLLM calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`:
`sampled_token_ids[i]` the tokens row i committed this step (the accepted drafts, then the bonus;
empty while its prompt is still being prefilled in chunks), `token_ids_cpu[i, :num_tokens_no_spec[i]]`
its prompt and every committed token. It names no request, and rows move within the batch as
requests finish, so a row is recognised by its content: the state a row left behind is stored
under a hash of all its tokens, and found next step under the hash of all its tokens before this
step's commit. A row with no stored state is a new request, and its tokens before the first commit
are its prompt: the key of the prompt's n-gram cache (`RolloutHistory`), which every sample of the
prompt shares (`n=G` in one request, G requests with the same prompt, later epochs). Each row's
output is also one of the prompt's rollouts there (the list itself, growing as the row commits),
so a row of a later epoch drafts from the earlier rows' outputs first (`previous.py`: the one
whose text its own follows; vLLM names no sample index, so the alignment finds it). A request
resumed after preemption is found the same way, its state intact unless evicted meanwhile (then it
starts over as a new request whose "prompt" includes what it had written: slower, still lossless).

Drafts only choose what vLLM verifies; vLLM's own rejection sampler commits the tokens, so the
output is vLLM's plain decoding's (greedy) or its distribution (sampling: vLLM's sampler, not
kvforge's counter-keyed one, so a seeded vLLM request is not token-identical with and without
drafting). The gate is kvforge's (`gate.DraftGate`) over vLLM's own step cost: the time from one
`propose` call to the next, by batch, width and context, learned as the steps run (an unmeasured
width is assumed to cost what the nearest measured one does, so it is tried once, after a plain
step has been measured). Each row's acceptance is learned from every proposal, verified or not: a
proposal that was not verified is compared with the tokens the row committed (under sampling,
plain decoding picks a drafted token with the probability verification accepts it). The length
ramp is `DraftConfig.k_for`. With `prefetch`, the next
step's (accept length, bonus) tables are built on a worker thread while vLLM verifies the drafts
just returned, and probed at the next call; a miss falls back to the lookup.

Memory: row states are bounded (least recently seen first out, at a few times vLLM's maximum
batch), so finished and aborted requests leave nothing behind beyond the bound; the prompt caches are bounded by `max_entries` n-gram pairs (`RolloutHistory`).
"""

from __future__ import annotations

import json
import os
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field, fields

import numpy as np

from kvforge.fill.rescue import DecodeRescue
from kvforge.speculative.history import DEFAULT_MAX_ENTRIES, RolloutHistory
from kvforge.speculative.ngram import NgramCache, NgramDrafter
from kvforge.speculative.prefetch import PREFETCHED_SOURCES, Branch, Prefetcher
from kvforge.speculative.gate import Acceptance, DraftGate, StepCost
from kvforge.speculative.step import DraftConfig
from kvforge.vllm import DRAFT_ENV
from kvforge.vllm.rescue import tracker

LIVE: "weakref.WeakSet[NgramRLProposer]" = weakref.WeakSet()  # proposers in this process, for in-process benches


@dataclass(frozen=True)
class ProposerConfig:
    k: int = 8
    n_min: int = 2
    n_max: int = 4
    gate: bool = True
    prefetch: bool = False
    budget: int = 16
    k_min: int | None = None
    k_ramp: int = 16
    max_entries: int = DEFAULT_MAX_ENTRIES
    # False: index and track as usual but never draft (what vLLM's speculative machinery costs alone)
    drafting: bool = True
    # True: the rows finish together (offline `LLM.generate` of RL groups, one max_tokens for all):
    # the gate judges a draft by how much it shortens the rows with the fewest tokens so far (their
    # chance of running to the budget left at the gate's 1/2: vLLM does not say how a request ended)
    # (`gate.DraftGate`, group); False: by the tokens it commits per second (a server's requests)
    group: bool = False

    def __post_init__(self):
        self.draft  # DraftConfig validates the shared fields
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}")
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {self.max_entries}")

    @property
    def draft(self) -> DraftConfig:
        return DraftConfig(draft="ngram", k=self.k, prefetch=self.prefetch, budget=self.budget, n_min=self.n_min,
                           n_max=self.n_max, gate=self.gate, k_min=self.k_min, k_ramp=self.k_ramp)

    @classmethod
    def from_dict(cls, values: dict) -> "ProposerConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown kvforge proposer setting(s) {', '.join(unknown)}: use {', '.join(sorted(known))}")
        return cls(**values)


@dataclass
class RowState:
    """What a request's row left behind at its last step."""

    key: int  # names the row to the gate and the prefetcher
    drafter: NgramDrafter  # the prompt's shared n-gram cache, its previous rollouts, and prompt lookup over the row's own tokens
    output: list[int] = field(default_factory=list)  # its committed tokens: one of its prompt's rollouts in the history
    produced: int = 0  # tokens committed since the prompt
    draft: list[int] | None = None  # the draft returned for this row at the last step (verified)
    proposal: list[int] | None = None  # the draft looked up at the last step, returned or not
    source: str | None = None  # where `draft` came from (`NgramDrafter.SOURCES`, or "prefetch")
    acceptance: Acceptance = field(default_factory=Acceptance)
    # a RidgeFill prompt's rescue schedule (`vllm.rescue`), fed every committed token: drafts end
    # before a token that would trigger a rescue
    rescue: DecodeRescue | None = None


@dataclass
class ProposerStats:
    calls: int = 0
    request_steps: int = 0  # (row, step) pairs after the prompt
    drafted_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    new_rows: int = 0
    prefetch_hits: int = 0
    rescue_cuts: int = 0  # proposals ended before a token that would trigger a RidgeFill rescue
    lookup_s: float = 0.0  # drafting on vLLM's critical path: lookups and prefetch misses
    propose_s: float = 0.0  # the whole propose call
    # per draft source: [drafts verified, tokens drafted, tokens accepted]
    sources: dict[str, list[int]] = field(default_factory=dict)
    # per draft source, every proposal verified or not: [tokens compared, tokens that landed]
    matched: dict[str, list[int]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The counters (per-source tallies apart: `by_source`)."""
        counters = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("sources", "matched")}
        return {**counters, "rows_drafted": self.drafted_steps / max(1, self.request_steps),
                "mean_k": self.drafted / max(1, self.drafted_steps)}

    def by_source(self) -> dict[str, dict]:
        """The per-source tallies, copied (`SpecStats`'s `accept_by_source` and `match_by_source`
        come from the same counts)."""
        return {"sources": {s: list(c) for s, c in self.sources.items()}, "matched": {s: list(c) for s, c in self.matched.items()}}


class NgramRLProposer:
    """vLLM `custom_class` proposer: kvforge's per-prompt n-gram drafts, shared by a prompt's samples."""

    def __init__(self, vllm_config, config: ProposerConfig | None = None):
        spec = vllm_config.speculative_config
        if config is None:
            config = ProposerConfig.from_dict({**json.loads(os.environ.get(DRAFT_ENV) or "{}"),
                                               "k": spec.num_speculative_tokens})
        if config.k != spec.num_speculative_tokens:
            raise ValueError(f"the proposer drafts {config.k} tokens, vLLM verifies {spec.num_speculative_tokens}")
        self.config = config
        self.draft_config = config.draft  # built once: `k_for` is asked per row per step
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_rows = 4 * vllm_config.scheduler_config.max_num_seqs + 64
        self.history = RolloutHistory(config.n_min, config.n_max, config.max_entries)
        # content hash -> the states of rows with those tokens (siblings can be identical so far),
        # least recently seen first
        self.rows: OrderedDict[int, list[RowState]] = OrderedDict()
        self.gate = self._new_gate()
        self.prefetcher = Prefetcher(config.k, config.budget) if config.prefetch else None
        self.pending: Future | None = None  # the prefetch tables being built for the drafts last returned
        self.stats = ProposerStats()
        self._next_key = 0
        LIVE.add(self)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM hands its model to proposers on CPU; n-gram drafting needs none."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None, **kwargs) -> list[list[int]]:
        start = time.perf_counter()
        self.stats.calls += 1
        branches = self.pending.result() if self.pending is not None else {}
        self.pending = None
        rows: list[tuple[int, RowState, list[int], int]] = []  # (row, state, proposal, its tokens)
        new_rows = self.stats.new_rows
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:  # still prefilling (or discarded this step): nothing to continue yet
                continue
            n = int(num_tokens_no_spec[i])
            tokens = token_ids_cpu[i, :n]
            state = self._row(tokens, len(sampled))
            rows.append((i, state, self._proposal(state, tokens, sampled, branches.get(state.key), n), n))
        k = self.config.k if self.config.drafting else 0
        if self.gate is not None and rows:
            context = max(n for *_, n in rows)
            # vLLM's step since the last call, at the width returned then; not when rows joined or
            # left in between (that step also prefilled, or the batch was another)
            last = self._last_step
            if last is not None and last[0] == len(rows) and self.stats.new_rows == new_rows:
                self.gate.record(*last, start - self._last_call, 0.0)
            # vLLM names no request's budget: with one max_tokens for all, the row with the fewest tokens has the most left
            remaining = [-state.produced for _, state, _, _ in rows]
            k = self.gate.choose([p for _, _, p, _ in rows], [state.acceptance for _, state, _, _ in rows], context, remaining)
            self._last_step = (len(rows), 1 + max(min(k, len(p)) for _, _, p, _ in rows), context)
        else:
            self._last_step = None
        self._last_call = start
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        prefetch: dict[int, tuple[NgramCache, list[int], list[int]]] = {}
        for i, state, proposal, n in rows:
            draft = proposal[:k]
            state.draft = draft or None
            drafts[i] = draft
            if self.prefetcher is not None and draft and state.source in PREFETCHED_SOURCES:
                prefetch[state.key] = (state.drafter.cache, token_ids_cpu[i, :n][-self.config.n_max - 1:].tolist(), draft)
        if prefetch:
            self.pending = self.prefetcher.start(prefetch)
        self._evict()
        self.stats.propose_s += time.perf_counter() - start
        return drafts

    def _row(self, tokens: np.ndarray, committed: int) -> RowState:
        """The row's state, found by its tokens before this step's commit, or a new request's."""
        before = hash(tokens[:-committed].tobytes())
        states = self.rows.get(before)
        state = states.pop() if states else None
        if states is not None and not states:
            del self.rows[before]
        if state is None:
            prompt = tokens[:-committed].tolist()
            cache = self.history.get(prompt)
            previous = self.history.previous(prompt)
            state = RowState(self._next_key, NgramDrafter(cache, prompt, [previous[i] for i in sorted(previous)]), rescue=tracker(prompt))
            self.history.record(prompt, state.key, state.output)  # this row's output, as it grows
            self.history.settle(prompt)  # evict other prompts' caches beyond the bound
            if self.gate is not None:
                state.acceptance = self.gate.new_acceptance()
            self._next_key += 1
            self.stats.new_rows += 1
        new = tokens[-committed:].tolist()
        before = {source: tuple(tally) for source, tally in state.drafter.matched.items()}
        state.drafter.observe(new)  # indexes them in the prompt's cache, and scores each source's proposal
        for source, (compared, landed) in state.drafter.matched.items():
            was = before.get(source, (0, 0))
            if compared != was[0]:
                total = self.stats.matched.setdefault(source, [0, 0])
                total[0], total[1] = total[0] + compared - was[0], total[1] + landed - was[1]
        state.output.extend(new)
        if state.rescue is not None:  # as the model class will: the last (the next pending token) included
            for token in new:
                state.rescue.observe(token)
        after = hash(tokens.tobytes())
        self.rows.setdefault(after, []).append(state)
        self.rows.move_to_end(after)
        return state

    def _proposal(self, state: RowState, tokens: np.ndarray, sampled: list[int], branch: Branch | None, n: int) -> list[int]:
        """Score the row's last step (its verified draft, and its proposal against what it committed),
        then look up this step's proposal: the prefetch hit, else the drafter (the n-gram chain or prompt
        lookup, whichever has matched more of late)."""
        config, stats = self.config, self.stats
        if state.produced:
            stats.request_steps += 1
        if state.draft:  # last step's verified draft: j accepted, then the bonus
            stats.drafted_steps += 1
            stats.drafted += len(state.draft)
            stats.accepted += len(sampled) - 1
            tally = stats.sources.setdefault(state.source or "other", [0, 0, 0])
            tally[0], tally[1], tally[2] = tally[0] + 1, tally[1] + len(state.draft), tally[2] + len(sampled) - 1
        if state.proposal:
            state.acceptance.observe(state.proposal, sampled)
        state.produced += len(sampled)
        room = min(self.draft_config.k_for(state.produced), self.max_model_len - n)
        hit = None
        if branch is not None and state.draft:
            hit = self.prefetcher.probe(state.key, branch, len(sampled) - 1, sampled[-1])
        if room <= 0 or not config.drafting:
            state.proposal = None
            return []
        if hit is not None:
            stats.prefetch_hits += 1
            proposal, state.source = hit[:room], "prefetch"
        else:
            lookup = time.perf_counter()
            proposal = state.drafter.propose(tokens, room)
            state.source = state.drafter.source
            stats.lookup_s += time.perf_counter() - lookup
        if state.rescue is not None and proposal:  # cut before the gate weighs it, as kvforge's step does
            cut = state.rescue.draft_before(state.rescue.tokens, proposal)
            stats.rescue_cuts += len(cut) < len(proposal)
            proposal = cut
        state.proposal = proposal or None
        return proposal

    def _evict(self) -> None:
        """Forget the least recently seen rows beyond the bound (finished or aborted requests)."""
        while len(self.rows) > self.max_rows:
            _, states = self.rows.popitem(last=False)
            for state in states:
                if self.prefetcher is not None:
                    self.prefetcher.forget(state.key)

    def forget_history(self) -> None:
        """Drop every prompt's cache and row state: the next requests draft from their own prompts
        only (benchmarks of first visits; a trainer keeps history across epochs)."""
        self.history = RolloutHistory(self.config.n_min, self.config.n_max, self.config.max_entries)
        self.rows.clear()
        self.gate = self._new_gate()

    def _new_gate(self) -> DraftGate | None:
        self._last_step: tuple[int, int, int] | None = None  # (rows, width, context) of the last call's drafts
        self._last_call = 0.0
        return DraftGate(StepCost(engine=None), self.config.group) if self.config.gate else None

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()

"""The decode loop every offline path runs: prefill a batch of prompts, then `speculative_step`
until every request finishes (the step states the mechanism and its invariant: committed tokens
are plain decoding's). Plain decoding (`generate`) is the same loop with no drafter: each step
verifies an empty draft. A finished request leaves the batch: the batch's last request moves into
its slot (`KVCache.leave`).

A planned prefill returns what decoding needs beside the cache: RidgeFill's rescue
(`fill.rescue.DecodeRescue`) rides with the steps of the request it was started for.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from kvforge.fill.rescue import DecodeRescue
from kvforge.generation import (
    Generation, GenerationConfig, SequenceState, check_prompts, eos_token_ids, flush_text, planned_report,
)
from kvforge.sampling import sample, sample_keys
from kvforge.speculative.gate import Acceptance, DraftGate
from kvforge.speculative.ngram import Drafter, NoDrafter
from kvforge.speculative.prefetch import Prefetcher
from kvforge.speculative.step import SpecRequest, SpecStats, commit, speculative_step


def generate(engine, prompts: list[list[int]] | list[int], config: GenerationConfig | None = None,
             on_text: Callable[[int, str], None] | None = None, plan=None, cache=None) -> list[Generation]:
    """Plain decoding of one prompt (a list of ids) or a batch (a list of lists): the decode loop
    with no drafter. `on_text(i, delta)` receives sequence i's new text as it is produced.
    `plan`: a `PrefillPlan` for the prompt (one prompt); decoding runs every layer, with the
    plan's rescue when it asks for one. `cache`: the prompts continue the sequences it holds (a
    translated cache, for a hand-off)."""
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    return speculative_generate(engine, prompts, [NoDrafter() for _ in prompts], config, k=1, on_text=on_text, plan=plan, gate=None, cache=cache)[0]


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
    k_for: Callable[[int], int] | None = None,
    cache=None,
) -> tuple[list[Generation], SpecStats]:
    """Generate for a batch of prompts with one drafter each. `caches[i]`, with a prefetcher, is
    request i's n-gram cache (the prefetcher reads its successors). `plan`: a `PrefillPlan` for
    a single prompt (RidgeFill, SPEED); verification always runs every layer. `gate`: None
    drafts every step. `k_for`: each request's draft budget by tokens produced (None: `k`).
    `cache`: the prompts continue the sequences it holds."""
    config = config or GenerationConfig()
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if len(drafters) != len(prompts):
        raise ValueError("one drafter per prompt")
    offsets = cache.next_positions().tolist() if cache is not None else [0] * len(prompts)
    context_limit = check_prompts(prompts, engine.model.context_length, offsets)
    eos = set() if config.ignore_eos else eos_token_ids(engine.model)
    keys = sample_keys(prompts, config.seed, config.epoch)  # as plain decoding keys the batch
    stats = SpecStats(k, prefetcher=prefetcher)
    requests = [
        SpecRequest(i, SequenceState(i, len(p)), list(p), config, drafters[i], keys[i], eos, on_text,
                    acceptance=gate.new_acceptance() if gate is not None else Acceptance(),
                    ngram=caches[i] if prefetcher is not None and caches is not None else None, k_for=k_for, offset=offsets[i])
        for i, p in enumerate(prompts)
    ]

    start = time.perf_counter()
    logits, cache, states = engine.prefill_with_states(prompts, cache=cache, chunk_size=config.chunk_size, plan=plan)
    report = planned_report(plan, cache, prompts, offsets[0])
    if len(prompts) == 1:
        requests[0].rescue = DecodeRescue.start(engine, prompts[0], cache, states, plan)
    first = sample(logits, config.sampling, keys, [o + len(p) for o, p in zip(offsets, prompts)]).tolist()
    now = time.perf_counter()
    for row, (r, token) in enumerate(zip(requests, first)):
        commit(r, [token], engine.model.tokenizer, context_limit, now, logits[row : row + 1])
    active, cache = _drop_finished(requests, cache, gate)
    while active:
        speculative_step(engine, cache, active, k, gate, prefetcher, stats)
        active, cache = _drop_finished(active, cache, gate)
    results = []
    for r in requests:
        flush_text(r.seq, on_text)
        stats.add_proposals(r.drafter)
        results.append(r.seq.result(start, report))
        results[-1].rescued_rows = r.rescue.rescued_rows if r.rescue is not None else None
    return results, stats


def _drop_finished(requests: list[SpecRequest], cache, gate: DraftGate | None = None):
    """The requests still running, and the cache holding their rows: a finished request's slot
    takes the last request's rows (`KVCache.leave`), so the others' rows are not copied. The
    gate learns whether each finished one ran to its token budget (a failed one says nothing)."""
    active = list(requests)
    for row in reversed(range(len(active))):
        if active[row].finished:
            done = active[row]
            if gate is not None and done.error is None:
                gate.finished(len(done.seq.token_ids) >= done.config.max_new_tokens)
            last = active.pop()
            if row < len(active):
                active[row] = last
            if active:
                cache.leave(row)
    return active, cache

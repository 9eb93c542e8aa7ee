"""Continuous batching: requests join the running batch between decode steps.

One thread owns the engine. Each loop iteration it admits queued requests (up to `max_batch`
running): a new request is prefilled alone, by its own method's plan (exact, RidgeFill, SPEED,
or a KV-Lingo hand-off that fills the cache from another model's), commits its first token and
joins the batch cache (`KVCache.concat_batch`). Then one step runs for the whole batch: each
request's pending token plus its draft (empty without a drafter) in one forward, verified per
request with its own sampling settings and generator (`speculative.verify`), committed through
generation's `_commit` (EOS, stop strings, max tokens, streaming), the cache rolled back per
request. A plain request is a speculative request with no draft: one mechanism. Finished or
cancelled requests (a client that disconnected) leave the batch and free their cache rows.

Limits: a long prompt's prefill holds up the running batch (no chunked prefill interleaving);
sampling with a seed is reproducible per request because each request has its own generator.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvforge.cache import KVCache
from kvforge.generation import GenerationConfig, _commit, _flush, _Sequence, eos_token_ids
from kvforge.sampling import sample
from kvforge.speculative.decode import DraftGate, verification_batch
from kvforge.speculative.ngram import NgramCache, NgramDrafter, NoDrafter, PromptLookupDrafter
from kvforge.speculative.prefetch import Prefetcher
from kvforge.speculative.verify import verify

# prefill(request) -> (first-token logits (1, V), the request's cache)
Prefiller = Callable[["ServeRequest"], tuple[torch.Tensor, KVCache]]


@dataclass
class ServeRequest:
    """One completion request as the scheduler sees it. `emit(kind, payload)` is called from the
    scheduler thread: ("text", delta) while decoding, then ("done", request)."""

    prompt_ids: list[int]
    config: GenerationConfig
    text: str | None = None  # the prompt as text (a hand-off tokenizes it for both models)
    prefill: str = "exact"
    draft: str = "none"
    prefetch: bool = False
    emit: Callable[[str, object], None] = lambda kind, payload: None
    cancelled: threading.Event = field(default_factory=threading.Event)
    # filled in by the scheduler
    id: int = 0
    seq: _Sequence | None = None
    context: list[int] = field(default_factory=list)
    pending: int = 0
    drafter: object = None
    ngram: NgramCache | None = None
    generator: torch.Generator | None = None
    submitted_at: float = 0.0
    ttft_s: float = 0.0
    accepted: int = 0
    steps: int = 0
    error: str | None = None

    @property
    def mean_accept_len(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0


class QueueFull(Exception):
    pass


class Scheduler:
    def __init__(self, engine, prefillers: dict[str, Prefiller], max_batch: int = 16, queue_size: int = 64, k: int = 8,
                 budget: int = 16, metrics=None):
        """`prefillers`: prefill method name -> how a request's cache is made."""
        self.engine, self.prefillers, self.max_batch, self.k = engine, prefillers, max_batch, k
        self.queue: queue.Queue[ServeRequest] = queue.Queue(maxsize=queue_size)
        self.metrics = metrics
        self.tokenizer = engine.model.tokenizer
        self.eos = eos_token_ids(engine.model)
        self.context = engine.model.context_length
        self.prefetcher = Prefetcher(k, budget)
        self.gate = DraftGate()
        self.active: list[ServeRequest] = []
        self.cache: KVCache | None = None
        self._ids = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="kvforge-scheduler", daemon=True)

    def start(self) -> "Scheduler":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)
        self.prefetcher.close()

    def submit(self, request: ServeRequest) -> None:
        self._ids += 1
        request.id, request.submitted_at = self._ids, time.perf_counter()
        try:
            self.queue.put_nowait(request)
        except queue.Full as exc:
            raise QueueFull(f"the request queue is full ({self.queue.maxsize} waiting)") from exc

    @property
    def kv_bytes(self) -> int:
        cache = self.cache
        return cache.nbytes if cache is not None else 0

    # --- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._admit()
                if self.active:
                    with torch.inference_mode():
                        self._step()
            except Exception as exc:  # never let one bad step kill the server: fail the batch
                for r in self.active:
                    self._finish(r, error=f"{type(exc).__name__}: {exc}")
                self.active, self.cache = [], None

    def _admit(self) -> None:
        while len(self.active) < self.max_batch:
            try:
                request = self.queue.get(timeout=0.05) if not self.active else self.queue.get_nowait()
            except queue.Empty:
                return
            if request.cancelled.is_set():
                self._finish(request, error="cancelled")
                continue
            try:
                with torch.inference_mode():
                    self._start(request)
            except Exception as exc:
                self._finish(request, error=f"{type(exc).__name__}: {exc}")

    def _start(self, r: ServeRequest) -> None:
        logits, cache = self.prefillers[r.prefill](r)  # a hand-off may re-tokenize the prompt
        params = r.config.sampling
        r.generator = params.generator(self.engine.device)
        r.seq = _Sequence(0, len(r.prompt_ids))
        r.context = list(r.prompt_ids)
        if r.draft == "ngram":
            r.ngram = NgramCache(r.prompt_ids, 2, 4)
            r.drafter = NgramDrafter(r.ngram, r.prompt_ids)
        elif r.draft == "prompt-lookup":
            r.drafter = PromptLookupDrafter(2, 4)
        else:
            r.drafter = NoDrafter()
        token = int(sample(logits, params, r.generator)[0])
        self._commit(r, [token])
        r.ttft_s = time.perf_counter() - r.submitted_at
        if self.metrics is not None:
            self.metrics.observe_ttft(r)
        if r.seq.finish_reason is not None:
            self._finish(r)
            return
        self.active.append(r)
        self.cache = cache if self.cache is None else KVCache.concat_batch([self.cache, cache])

    def _commit(self, r: ServeRequest, tokens: list[int]) -> list[int]:
        now, committed = time.perf_counter(), []
        on_text = lambda _index, delta: r.emit("text", delta)  # noqa: E731
        for tok in tokens:
            _commit(r.seq, tok, now, self.tokenizer, self.eos, r.config, on_text)
            r.context.append(tok)
            committed.append(tok)
            if r.seq.finish_reason is not None:
                break
        if r.seq.finish_reason is None and len(r.context) >= self.context:
            r.seq.finish_reason = "length"
        r.drafter.observe(committed)
        r.pending = committed[-1]
        return committed

    def _step(self) -> None:
        drafts = []
        for r in self.active:
            room = min(self.k, r.config.max_new_tokens - len(r.seq.token_ids) - 1, self.context - len(r.context) - 1)
            use = r.draft != "none" and room > 0 and self.gate.allows(r.id)
            drafts.append(r.drafter.propose(r.context, room)[:room] if use else [])
        ids, positions, lengths = verification_batch([r.pending for r in self.active], drafts, [len(r.context) - 1 for r in self.active])
        width = ids.shape[1] - 1
        future = None
        prefetching = {r.id: (r.ngram, r.context[:], d) for r, d in zip(self.active, drafts) if r.prefetch and r.ngram is not None}
        if prefetching:
            future = self.prefetcher.start(prefetching)
        start = time.perf_counter()
        logits = self.engine.forward(ids.to(self.engine.device), positions.to(self.engine.device), self.cache, "all")
        accepted, bonus = [], []
        for row, (r, d) in enumerate(zip(self.active, drafts)):
            a, b = verify(logits[row : row + 1], ids[row : row + 1, 1:].to(logits.device), lengths[row : row + 1].to(logits.device),
                          r.config.sampling, r.generator)
            accepted.append(int(a[0]))
            bonus.append(int(b[0]))
        self.cache.rollback([width - j for j in accepted])
        branches = future.result() if future is not None else {}
        step_s = time.perf_counter() - start
        for row, (r, d) in enumerate(zip(self.active, drafts)):
            j = accepted[row]
            self.gate.record(r.id, len(d), j)
            r.steps, r.accepted = r.steps + 1, r.accepted + j
            committed = self._commit(r, d[:j] + [bonus[row]])
            if self.metrics is not None:
                self.metrics.observe_step(len(committed), step_s, j if d else None)
            if r.id in branches:
                hit = self.prefetcher.probe(r.id, branches[r.id], j, bonus[row])
                if self.metrics is not None:
                    self.metrics.observe_probe(hit is not None)
        keep = []
        for row, r in enumerate(self.active):
            if r.seq.finish_reason is not None or r.cancelled.is_set():
                self._finish(r, error="cancelled" if r.seq.finish_reason is None else None)
            else:
                keep.append(row)
        if len(keep) < len(self.active):
            self.active = [self.active[row] for row in keep]
            self.cache = self.cache.select_batch(torch.tensor(keep, device=self.engine.device)) if keep else None

    def _finish(self, r: ServeRequest, error: str | None = None) -> None:
        r.error = error
        if r.seq is not None:
            _flush(r.seq, lambda _i, delta: r.emit("text", delta))
        self.prefetcher.forget(r.id)
        self.gate.forget(r.id)
        if self.metrics is not None:
            self.metrics.observe_done(r)
        r.emit("done", r)

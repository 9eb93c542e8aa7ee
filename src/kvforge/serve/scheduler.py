"""Continuous batching: requests join the running batch between decode steps.

One thread owns the engine. Each loop iteration it admits queued requests (up to `max_batch`
running): a new request is prefilled alone, by its own method's plan (exact, RidgeFill, SPEED,
or a KV-Lingo hand-off that fills the cache from another model's), commits its first token and
joins the batch cache: its rows are written into a free slot of the batch's buffers
(`KVCache.join`), and a request that finishes leaves by the batch's last request moving into its
slot (`KVCache.leave`), so no admission or finish copies the running requests' rows. On CPU,
where attention reads only the rows in use (`attention.reads_rows_in_use`), the batch's buffers
are allocated once, `max_batch` slots of a whole context each, and never grow: the OS backs their
keys and values a page at a time as rows are written and takes a leaving request's pages back
(`KVCache.allocate`), so they hold the memory of the rows in use, not of their capacity.
Elsewhere (a GPU) they grow with the longest sequence, copying the batch when they do.

With a KV-cache budget (`kv_cache_bytes`) the running requests share a pool of rows: a request
reserves its prompt and `max_new_tokens` rows at admission (with a draft's spare rows) and gives
them back when it finishes, and a request the pool cannot hold waits in the queue until running
ones finish. On CPU a long request uses the rows short ones leave; elsewhere each slot holds an
even share of the pool, allocated whole. The rows written never pass the budget: no request is
preempted, none runs out of memory.
Then one `speculative_step` runs for the whole batch, the same step as offline decoding: each
request's pending token plus its draft (empty without a drafter, or the prefetch hit of its last
step) in one forward, verified with the request's own sampling settings and sample key, committed
(EOS, stop strings, max tokens, streaming), the cache rolled back per request; a RidgeFill
request's rescue runs in it. A plain request is a speculative request with no draft: one
mechanism. Finished or cancelled requests (a client that disconnected) leave the batch.

Chunked prefill: a prefiller may prefill in chunks (the app's exact, SPEED and RidgeFill prefills do, in
chunks of `--max-num-batched-tokens`). While requests run, each loop iteration runs one chunk of prefill (a
short prompt is one chunk) and then one step of the running batch, so streams keep flowing while a
long prompt arrives. A prompt longer than one chunk runs its exact, SPEED or RidgeFill chunks' layers (a long
chunk's attention by blocks of its query rows) in slices of
about one step's time (`PREFILL_SLICE`), a step between two slices, so however long the prompt,
a stream waits about two steps for a token. The chunk runs in its own forward: a decode row's bits do not depend on a
prompt prefilled beside it. One prompt is prefilled at a time. RidgeFill prompts chunk in two
phases (`Engine.prefill_steps`), a hybrid's too. A hand-off prompt chunks its source prefill and its
native tail and translates a target layer at a time (`hand_off_steps`).

The `n` choices of one API request are a group: queued as one item, admitted together when the
batch has room for all of them, prefilled once (its rows joined once per choice), and drafting
from one n-gram cache of the prompt (`new_drafters`). With a `RolloutHistory` (the default in the
app) that cache is the prompt's history: a later request with the same prompt tokens (or the same
`rollout_key`) drafts from every earlier request's choices too, sample s from the last rollout of
sample s first (`previous.py`; a choice's sample index is `ServeRequest.sample`), and requests with
the same prompt running at once share it. A choice that finishes is recorded as its sample's latest
rollout and the history settled (its bound enforced); a request opts out with `history=False`.

Between steps the loop holds no lock (`step_lock` is held for each admission and step), so a
weight update (`app.update_weights`) pauses every scheduler (`paused`: the loop yields the lock to
it) and swaps the weights between two steps; requests running or mid-prefill then finish on the
new weights and are marked `crossed`, and queued requests of a method whose artifacts no longer
fit fail. `abort()` finishes every queued, prefilling and running request at once with finish
reason "abort" and the tokens it has, as RL frameworks stop a rollout before an update.

A request whose prefill or own share of a step raises (its drafter, committing or streaming its
text) fails alone and the batch goes on; a failure of the batch's forward fails the batch. Errors
are logged (`kvforge.serve`) with their traceback.

Sampling with a seed is reproducible per request, batched with anything, drafted or not: a
sampled token is a function of its logits and its key (the seed and the prompt's tokens; choices
of one request differ by seed, `app.choice_seed`), and drafting commits the tokens plain decoding
would (in fp32, up to near-ties a wider step rounds apart). A request without a seed takes a random
one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvforge.attention import reads_rows_in_use
from kvforge.cache import KVCache, LayerCache
from kvforge.engine import PAUSE_POINTS
from kvforge.fill.rescue import DecodeRescue
from kvforge.generation import GenerationConfig, SequenceState, eos_token_ids, flush_text
from kvforge.sampling import SampleKey, fresh_seed, prompt_key, sample
from kvforge.speculative.history import RolloutHistory
from kvforge.speculative.prefetch import Prefetcher
from kvforge.rows import backs_on_demand
from kvforge.speculative.step import DraftConfig, SpecRequest, SpecStats, commit, new_drafters, speculative_step

log = logging.getLogger("kvforge.serve")

# prefill(request) -> (first-token logits (1, V), the request's cache, its RidgeFill rescue or None),
# or a generator that yields between chunks of the prefill and returns that (`Engine.prefill_steps`)
Prefiller = Callable[["ServeRequest"], tuple[torch.Tensor, KVCache, DecodeRescue | None]]


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
    history: bool = True  # with draft "ngram": use the scheduler's rollout history of the prompt
    rollout_key: str | None = None  # names the rollout in the history (None: the prompt's tokens)
    index: int = 0  # the choice this request is, of its API request's n
    sample: int = 0  # its sample index in the rollout history (`kvforge.sample_index` + its choice)
    emit: Callable[[str, object], None] = lambda kind, payload: None
    cancelled: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False  # stopped by `Scheduler.abort`: finishes with what it has, reason "abort"
    done: bool = False  # finished: its "done" was emitted
    crossed: bool = False  # running when the weights were updated: its tokens come from both
    # filled in by the scheduler
    id: int = 0
    state: SpecRequest | None = None  # the decoding state, from the first token on
    reserved_rows: int = 0  # the rows of the KV-cache budget it holds from its admission on
    submitted_at: float = 0.0
    ttft_s: float = 0.0
    error: str | None = None

    @property
    def seq(self) -> SequenceState | None:
        return self.state.seq if self.state is not None else None

    @property
    def steps(self) -> int:
        return self.state.steps if self.state is not None else 0

    @property
    def mean_accept_len(self) -> float:
        return self.state.mean_accept_len if self.state is not None else 0.0


def _prefill_steps(prefill: Prefiller, request: "ServeRequest"):
    """A prefill as steps to drive (`Scheduler._prefill_chunk`), run from the first step on, so
    that whatever it raises is raised there: a prefiller that is a generator yields between its
    chunks; a plain one runs whole."""
    prefilled = prefill(request)
    if inspect.isgenerator(prefilled):
        return (yield from prefilled)
    return prefilled


# While requests decode, a prompt longer than one chunk runs its exact, SPEED or RidgeFill
# chunks in slices of their layers (`Engine.prefill_steps` pauses between two layers, and between two
# blocks of a long chunk's attention query rows: `engine.PAUSE_POINTS`) of at most PREFILL_SLICE
# times the requests' recent step time (a slice ends before a piece that would cost past it, judged
# by the piece before; at least one piece a slice), with a step of theirs between two slices: a
# stream then waits about two steps for a token however long the prompt and its context (a 64-token
# chunk of smollm2-135m at 4K of context costs five 15-row steps in bf16 on AVX512-BF16, one
# thread), and the prompt gets a third to two fifths of the time while they run. A prompt of one chunk runs
# whole: slicing every admission would run the decode steps more often, with fewer rows each, and
# lower the throughput of many short prompts.
PREFILL_SLICE = 1.0
GROWING_ROWS = 256  # where the batch's buffers grow (`Scheduler.on_demand` false, no budget): the rows they start with
STEP_AVERAGE = 0.2  # the weight of the latest step in the average step time


class QueueFull(Exception):
    pass


class Scheduler:
    def __init__(self, engine, prefillers: dict[str, Prefiller], max_batch: int = 16, queue_size: int = 64,
                 draft: DraftConfig | None = None, metrics=None, history: RolloutHistory | None = None, kv_cache_bytes: int | None = None,
                 chunk_size: int | None = None):
        """`prefillers`: prefill method name -> how a request's cache is made. `draft`: k, the
        prefetch budget, the n-gram sizes and the gate for every request; each request picks
        its drafter and whether it is prefetched. `history`: the per-prompt n-gram store that
        n-gram requests draft from (its n-gram sizes are `draft`'s); None: each request's own.
        `kv_cache_bytes`: the KV-cache budget, a pool of `pool_rows` rows the running requests
        reserve from (each its prompt, `max_new_tokens` and a draft's spare rows); None: no bound
        but `max_batch` and the context.
        `chunk_size`: the prefillers' chunk (`--max-num-batched-tokens`): a prompt longer than it is
        sliced from its first chunk on (`PREFILL_SLICE`); None: a prompt's first chunk runs whole."""
        self.engine, self.prefillers, self.max_batch, self.chunk_size = engine, prefillers, max_batch, chunk_size
        self.draft = draft or DraftConfig()
        self.history = history
        self.queue: queue.Queue[list[ServeRequest]] = queue.Queue(maxsize=queue_size)
        self._next: list[ServeRequest] | None = None  # a group taken off the queue that waits for room
        self.metrics = metrics
        self.tokenizer = engine.model.tokenizer
        self.eos = eos_token_ids(engine.model)
        self.context = engine.model.context_length
        # a verification step writes every sequence's rows to the batch's widest draft: k + 1 spare rows each
        self.spare_rows = self.draft.k + 1
        probe = engine.new_cache(1, capacity=1)
        # buffers of every slot's whole context, backed as rows are written, where attention reads only the rows in use
        self.on_demand = backs_on_demand(engine.device) and reads_rows_in_use(
            engine.dtype, engine.device, [(layer.k.shape[-1], layer.v.shape[-1]) for layer in probe.layers if isinstance(layer, LayerCache)])
        self.pool_rows: int | None = None
        self.slot_rows = self.context + self.spare_rows  # the most rows a request may hold
        if kv_cache_bytes is not None:
            row = probe.row_bytes()
            self.pool_rows = kv_cache_bytes // row if row else self.slot_rows * max_batch
            # a slot holds up to the whole pool where its pages are backed on demand, else an even share allocated whole
            self.slot_rows = min(self.slot_rows, self.pool_rows if self.on_demand else self.pool_rows // max_batch)
            if self.slot_rows < 16 + self.spare_rows:
                share = "" if self.on_demand else f" for each of {max_batch} sequences"
                raise ValueError(f"a KV cache of {kv_cache_bytes} bytes holds {self.slot_rows} rows{share} ({row} bytes a row, "
                                 f"{self.spare_rows} of a request's spare for drafts): give more memory"
                                 + ("" if self.on_demand else " or a smaller --max-batch"))
        self.cache = self._empty_batch()
        self.prefetcher = Prefetcher(self.draft.k, self.draft.budget)
        self.gate = self.draft.new_gate(engine)
        self.stats = SpecStats(self.draft.k, prefetcher=self.prefetcher)  # every step since the start
        self.active: list[ServeRequest] = []
        self._ids = 0
        self._stop = threading.Event()
        self.step_lock = threading.RLock()  # held through each admission and step: a weight swap waits for it
        self._pausing = 0  # callers waiting in `paused`: the loop lets them take the lock first
        self.refused: dict[str, str] = {}  # prefill methods no longer served (artifacts fitted for old weights): the reason
        self._prefilling: tuple[list[ServeRequest], object] | None = None  # the group being prefilled, and its prefill's steps
        self._chunk_ran = False  # a prefill chunk ran in this loop iteration
        # since the start: seconds in decode steps and in prefills, and the tokens the steps committed
        self.decode_s, self.prefill_s, self.decoded_tokens = 0.0, 0.0, 0
        self.peak_running, self.peak_reserved_rows = 0, 0  # the most requests running and budget rows reserved at once
        self._step_seconds: float | None = None  # the running batch's recent decode step time (an exponential average)
        self._sliced = False  # whether the prompt being prefilled runs its chunks in slices while requests decode
        self.thread = threading.Thread(target=self._loop, name="kvforge-scheduler", daemon=True)

    def _empty_batch(self) -> KVCache:
        """An empty batch with `max_batch` slots of `slot_rows` rows (`KVCache.allocate`: keys and
        values take memory as rows are written), or, where they are allocated whole with no budget
        to hold, of a few rows that grow with the longest sequence."""
        cache = self.engine.new_cache(1, capacity=1)
        cache.leave(0)
        whole = self.on_demand or self.pool_rows is not None
        cache.allocate(self.max_batch, self.slot_rows if whole else min(self.slot_rows, GROWING_ROWS), self.on_demand)
        return cache

    def _drop_batch(self) -> None:
        """No request runs any more (aborted or failed): every sequence leaves the batch (its
        buffers stay), or, where that fails or leaves its buffers apart, the batch starts anew."""
        self.active = []
        try:
            while self.cache.batch_size:
                self.cache.leave(self.cache.batch_size - 1)
            if not self.cache.intact():
                raise ValueError("the batch's buffers disagree")
        except Exception:
            log.exception("emptying the batch failed: it is allocated anew")
            self.cache = self._empty_batch()
        self._shrink()

    def _shrink(self) -> None:
        """An empty batch whose buffers grew (no budget, not backed on demand: a GPU) gives their
        memory back: the next requests start small again."""
        if not self.on_demand and self.pool_rows is None and self.cache.batch_size == 0 and self.cache[0].capacity > GROWING_ROWS:
            self.cache = self._empty_batch()

    def rows_needed(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The rows of the KV-cache budget a request reserves: its prompt, its tokens, a draft's spare."""
        return min(prompt_tokens + max_new_tokens, self.context) + self.spare_rows

    def room(self, choices: int) -> int:
        """The most rows each of a request's `choices` may reserve: a slot's, and its share of the pool."""
        return self.slot_rows if self.pool_rows is None else min(self.slot_rows, self.pool_rows // choices)

    @property
    def reserved_rows(self) -> int:
        """The budget's rows held by the requests running or being prefilled."""
        return sum(r.reserved_rows for r in self.started)

    def start(self) -> "Scheduler":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)
        self.prefetcher.close()

    def submit(self, request: ServeRequest | list[ServeRequest]) -> None:
        """Queue a request, or a group (the choices of one request, same prompt and method)."""
        group = [request] if isinstance(request, ServeRequest) else list(request)
        if not 1 <= len(group) <= self.max_batch:
            raise ValueError(f"a group of {len(group)} requests does not fit a batch of {self.max_batch}")
        now = time.perf_counter()
        for r in group:
            self._ids += 1
            r.id, r.submitted_at = self._ids, now
        try:
            self.queue.put_nowait(group)
        except queue.Full as exc:
            raise QueueFull(f"the request queue is full ({self.queue.maxsize} waiting)") from exc

    @property
    def started(self) -> list[ServeRequest]:
        """The requests running and those whose prompt is being prefilled."""
        return self.active + self.prefilling

    @property
    def prefilling(self) -> list[ServeRequest]:
        """The requests whose prompt is being prefilled (read once: the metrics read it from another thread)."""
        prefilling = self._prefilling
        return prefilling[0] if prefilling is not None else []

    @property
    def kv_bytes(self) -> int:
        return self.cache.nbytes

    # --- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            while self._pausing:  # an update or an abort waits for the lock: let it have it
                time.sleep(0.001)
            with self.step_lock:
                try:
                    self._chunk_ran = False
                    self._prefill_chunk()
                    self._admit()
                    if self.active:
                        with torch.inference_mode():
                            self._step()
                except Exception as exc:  # the batch's own forward failed (a request's share fails alone): fail the batch
                    log.exception("a decode step failed: its %d requests fail", len(self.active))
                    for r in self.active:
                        self._finish(r, error=f"{type(exc).__name__}: {exc}")
                    self._drop_batch()

    @contextlib.contextmanager
    def paused(self):
        """Hold the loop between two steps (an idle loop waits at most its 50 ms queue poll)."""
        self._pausing += 1
        try:
            with self.step_lock:
                yield
        finally:
            self._pausing -= 1

    def abort(self) -> int:
        """Finish every queued and running request now, with reason "abort" and the tokens each
        has (none for one not started). Returns how many were aborted."""
        with self.paused():
            groups = [self._next] if self._next is not None else []
            self._next = None
            while True:
                try:
                    groups.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            if self._prefilling is not None:
                groups.append(self._prefilling[0])
                self._prefilling[1].close()
                self._prefilling = None
            stopped = [r for group in groups for r in group] + self.active
            for r in stopped:
                r.aborted = True
                r.cancelled.set()
                self._finish(r)
            self._drop_batch()
        return len(stopped)

    def _admit(self) -> None:
        # one prompt is prefilled at a time (a long one holds the queue), and while requests run,
        # one chunk of prefill goes between two of their steps (a short prompt is one chunk)
        while self._prefilling is None and not (self.active and self._chunk_ran):
            if self._next is None:
                try:  # idle: wait a little for work (an update or an abort waits as long at most)
                    self._next = self.queue.get(timeout=0.05) if not self.active else self.queue.get_nowait()
                except queue.Empty:
                    return
            group = self._next
            need = self.rows_needed(len(group[0].prompt_ids), group[0].config.max_new_tokens)
            refused = None
            if group[0].prefill in self.refused:  # queued before its method's artifacts went stale
                refused = self.refused[group[0].prefill]
            elif any(r.cancelled.is_set() for r in group):
                refused = "cancelled"
            elif need > self.room(len(group)):  # only under a budget: without one a request fits its slot
                refused = (f"{need} rows a request (prompt, max tokens and a draft's spare rows) do not fit the KV cache's "
                           f"{self.room(len(group))} for each of {len(group)} (--kv-cache-memory)")
            if refused is not None:
                self._next = None
                for r in group:
                    self._finish(r, error=refused)
                continue
            if len(self.active) + len(group) > self.max_batch:
                return  # the group joins when there is room for all of it
            if self.pool_rows is not None and self.reserved_rows + len(group) * need > self.pool_rows:
                return  # the group waits until running requests give back enough rows
            self._next = None
            for r in group:
                r.reserved_rows = need if self.pool_rows is not None else 0
            self._prefilling = (group, _prefill_steps(self.prefillers[group[0].prefill], group[0]))  # a hand-off may re-tokenize the prompt
            self.peak_reserved_rows = max(self.peak_reserved_rows, self.reserved_rows)
            self._sliced = bool(self.chunk_size) and len(group[0].prompt_ids) > self.chunk_size  # 0: whole prompts
            self._prefill_chunk()

    def _slice_seconds(self) -> float:
        """How long a slice of a prefill chunk (a prompt longer than one chunk) may run while
        requests decode: `PREFILL_SLICE` of their recent step time."""
        return PREFILL_SLICE * (self._step_seconds or 0.0)

    def _prefill_chunk(self) -> None:
        """The next chunk of the prompt being prefilled (a prefiller that is a generator yields
        between chunks: `Engine.prefill_steps`), or, for a prompt longer than one chunk while
        requests run, the next slice of its pieces (layers, blocks of a layer's attention query rows:
        `PREFILL_SLICE`); when its prefill is done, its group joins."""
        if self._prefilling is None:
            return
        group, steps = self._prefilling
        self._chunk_ran = True
        if any(r.cancelled.is_set() for r in group):
            steps.close()
            self._prefilling = None
            for r in group:
                self._finish(r, error="cancelled")
            return
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                try:
                    # the chunk's layers to its end; for a prompt longer than one chunk, while requests
                    # run, as long as the next piece (a layer, or a block of its attention's query
                    # rows), costing what the last one did, fits the slice's time
                    budget, last = self._slice_seconds(), start
                    sliced = bool(self.active) and self._sliced
                    while (point := next(steps)) in PAUSE_POINTS:
                        now = time.perf_counter()
                        if sliced and 2 * now - last - start > budget:
                            break
                        last = now
                    self._sliced |= point is None  # a prompt the prefillers chunk though it is not longer than `chunk_size`
                    return  # more of the prompt: the running requests' step goes first
                except StopIteration as done:
                    self._prefilling = None
                    self._start(group, *done.value)
        except Exception as exc:
            log.exception("a request's prefill failed")
            self._prefilling = None
            for r in group:
                self._finish(r, error=f"{type(exc).__name__}: {exc}")
        finally:
            self.prefill_s += time.perf_counter() - start

    def _start(self, group: list[ServeRequest], logits: torch.Tensor, cache: KVCache, rescue: DecodeRescue | None) -> None:
        """Commit each choice's first token from its prompt's prefill, and join the batch with the
        choices still running (all or none of them: an error leaves the batch as it was)."""
        first = group[0]
        prompt = first.prompt_ids
        if self.rows_needed(len(prompt), first.config.max_new_tokens) > self.slot_rows:  # a hand-off's prompt, re-tokenized: never grow past a slot
            raise ValueError(f"the prompt's {len(prompt)} tokens and {first.config.max_new_tokens} more do not fit a sequence of the KV cache "
                             f"({self.slot_rows} rows with a draft's spare, --kv-cache-memory)")
        drafting = dataclasses.replace(self.draft, draft=first.draft, prefetch=first.prefetch)
        kept, previous = None, None
        if self._keeps_history(first):
            kept, previous = self.history.get(prompt, first.rollout_key), self.history.previous(prompt, first.rollout_key)
        drafters, ngram = new_drafters(drafting, prompt, len(group), kept, previous, [r.sample for r in group])
        running = []
        rescues = [rescue if i == 0 or rescue is None else rescue.copy() for i in range(len(group))]  # each choice rescues its own rows
        for r, drafter, rescue in zip(group, drafters, rescues):
            r.prompt_ids = prompt
            key = SampleKey(fresh_seed() if r.config.seed is None else r.config.seed, prompt_key(prompt), epoch=r.config.epoch)
            r.state = SpecRequest(
                r.id, SequenceState(0, len(prompt)), list(prompt), r.config, drafter, key,
                set() if r.config.ignore_eos else self.eos, lambda _index, delta, r=r: r.emit("text", delta), ngram if r.prefetch else None,
                k_for=drafting.k_for, rescue=rescue,
            )
            if self.pool_rows is not None:  # a hand-off's prompt, in the served model's tokens
                r.reserved_rows = self.rows_needed(len(prompt), r.config.max_new_tokens)
            if self.gate is not None:
                r.state.acceptance = self.gate.new_acceptance()
            commit(r.state, [int(sample(logits, r.config.sampling, [key], [len(prompt)])[0])], self.tokenizer, self.context, logits=logits)
            r.ttft_s = time.perf_counter() - r.submitted_at
            if self.metrics is not None:
                self.metrics.observe_ttft(r, prefilled=r is first)
            if not r.state.finished:
                running.append(r)
        if running:
            self._join(cache, len(running))
            self.active.extend(running)
            self.peak_running = max(self.peak_running, len(self.active))
            self.peak_reserved_rows = max(self.peak_reserved_rows, self.reserved_rows)
        for r in group:
            if r.state.finished:
                self._finish(r)

    def _join(self, cache: KVCache, copies: int) -> None:
        """`copies` copies of the one sequence in `cache` join the batch cache, all or none, each
        into a free slot: the running sequences' rows stay where they are."""
        before = self.cache.batch_size
        try:
            if before == 0 and copies > 1:  # copies of one prompt joined at once into an empty batch: their shared rows are read once
                self.cache.join(cache.select_batch(torch.zeros(copies, dtype=torch.long)), self.max_batch)
            else:
                for _ in range(copies):
                    self.cache.join(cache, self.max_batch)
        except Exception:
            for layer in self.cache.layers:  # the batch as it was: the joined sequences leave, the last first
                while layer.batch > before:
                    layer.leave(layer.batch - 1)
            raise

    def _keeps_history(self, r: ServeRequest) -> bool:
        return self.history is not None and r.history and r.draft == "ngram"

    def _step(self) -> None:
        start = time.perf_counter()
        outcomes = speculative_step(self.engine, self.cache, [r.state for r in self.active], self.draft.k, self.gate, self.prefetcher, self.stats,
                                    isolate=True)
        step_s = time.perf_counter() - start
        self.decode_s += step_s
        self._step_seconds = step_s if self._step_seconds is None else (1 - STEP_AVERAGE) * self._step_seconds + STEP_AVERAGE * step_s
        self.decoded_tokens += sum(outcome.committed for outcome in outcomes)
        if self.metrics is not None:
            for outcome in outcomes:
                self.metrics.observe_step(outcome.committed, step_s, outcome.accepted if outcome.drafted else None)
                if outcome.prefetch_hit is not None:
                    self.metrics.observe_probe(outcome.prefetch_hit)
        for row in reversed(range(len(self.active))):  # from the end: a leaving row's slot takes the last row
            r = self.active[row]
            if r.state.error is not None:
                self._finish(r, error=r.state.error)
            elif r.state.finished or r.cancelled.is_set():
                self._finish(r, error=None if r.state.finished else "cancelled")
            else:
                continue
            self._leave(row)

    def _leave(self, row: int) -> None:
        """Drop a running request from the batch: the last one takes its slot, in the cache (only
        that request's rows are copied) and in `active`."""
        last = self.active.pop()
        if row < len(self.active):
            self.active[row] = last
        self.cache.leave(row)
        self._shrink()

    def _finish(self, r: ServeRequest, error: str | None = None) -> None:
        """Finish a request once (its "done" is emitted once); what goes wrong while finishing it is
        logged, never raised into the loop."""
        if r.done:
            return
        r.done = True
        try:
            self._finish_request(r, error)
        except Exception:
            log.exception("finishing request %s failed", r.id)

    def _finish_request(self, r: ServeRequest, error: str | None) -> None:
        r.error = None if r.aborted else error
        if r.state is not None:
            if r.aborted and r.state.seq.finish_reason is None:
                r.state.seq.finish_reason = "abort"
            flush_text(r.state.seq, r.state.on_text)
        self.prefetcher.forget(r.id)
        if r.state is not None and self._keeps_history(r):
            if r.error is None and not r.aborted:
                self.history.record(r.prompt_ids, r.sample, list(r.seq.token_ids), r.rollout_key)
            self.history.settle(r.prompt_ids, r.rollout_key)
        if self.metrics is not None:
            self.metrics.observe_done(r)
        r.emit("done", r)

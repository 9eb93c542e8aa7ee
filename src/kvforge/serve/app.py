"""The FastAPI app: OpenAI routes over one `Scheduler` per served model.

Served models: the one given (`--model`), and with `--translator F --target B` also B, whose
requests may ask for `"prefill": "handoff"`: the first model prefills the text, its cache is
translated into B's, and B decodes (B's requests are batched by B's own scheduler).

Methods are resolved by the library (`fill.ridgefill.resolve`, `fill.speed.resolve`), as the CLI
does. The base weights serve every method but SPEED with an adapter, whose LoRA weights are a
second weight set beside them (`lora.adapted_engine`): a batch runs one set of weights, so those
requests have their own scheduler. A response says what its prefill ran (`PrefillReport`: the
method, or exact with the reason, and the rows filled or left shallow).

A request for `n` choices is a group of n scheduler requests (`Scheduler.submit`): choice i is
sample s = `kvforge.sample_index` + i (0 + i by default) and samples with its own seed, derived
from the request's `seed` and s (`choice_seed`), so G requests for samples 0..G-1 with one seed are
the group one request with n = G samples. Each scheduler keeps a rollout history
(`--history-entries`, 0: off): n-gram requests with the same prompt tokens, or the same
`kvforge.rollout_key`, draft from every earlier request's choices, sample s from the last rollout
of sample s first (`speculative.history`).

Weights are updated in place without a restart (`POST /v1/update_weights` with a safetensors
path, or `update_weights` in process with tensors): the swap waits for the step running, happens
with every scheduler paused between steps, and requests running then finish on the new weights,
their responses marked `kvforge.weights_crossed`. Methods whose artifacts were fitted for the old
weights (RidgeFill maps, a SPEED adapter, a hand-off translator) are refused from then on with a
400 that says so. `POST /v1/abort` finishes every queued and running request with finish reason
"abort". Every choice carries its `token_ids`, and the response its `prompt_token_ids`.

Limits: a body over `--max-body-bytes` is a 413; `max_tokens` past the context's end, more than
16 stop strings or one over 256 characters, and more than 4096 messages are 400s. Templating and
tokenizing run off the event loop. A request that fails inside the server answers a 500 naming
its request id; the error itself goes to the server's log (`kvforge.serve`), not to the client.

With an API key every route but /health (and /metrics when it is public) needs
`Authorization: Bearer KEY`; the key is compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvforge.fill.rescue import DecodeRescue
from kvforge.generation import GenerationConfig
from kvforge.models.loading import dtype_name
from kvforge.plan import PrefillReport
from kvforge.prompting import encode_prompt
from kvforge.serve.metrics import ServerMetrics
from kvforge.models.weights import WeightUpdateError, read_update
from kvforge.serve.protocol import (
    AbortRequest, ChatCompletionRequest, CompletionRequest, UpdateWeightsRequest, choice_body, completion_body, error_body, logprobs_body, new_id, usage,
)
from kvforge.serve.scheduler import QueueFull, Scheduler, ServeRequest
from kvforge.speculative.history import DEFAULT_MAX_ENTRIES, RolloutHistory
from kvforge.speculative.step import DraftConfig
from kvforge.translate.align import Tokenized, tokenize

log = logging.getLogger("kvforge.serve")
MAX_BODY_BYTES = 16 * 2**20  # a 128K-token prompt as text or as token ids fits several times over


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


@dataclass
class ServeConfig:
    model: str = "smollm2-135m"
    maps: Path | None = None
    adapter: Path | None = None
    translator: Path | None = None
    target: str | None = None
    max_batch: int = 16
    queue_size: int = 64
    device: str = "cpu"
    dtype: str = "auto"  # a `--dtype` name: every served model's weights and caches
    # RidgeFill (with maps): the preset and its overrides
    preset: str = "fast"
    split: int | None = None
    tail: int | None = None
    attended_rows: int | None = None
    # SPEED: None takes the adapter's recorded setting, else the default
    cut: str | None = None
    anchors: str | None = None
    speed_tail: int | None = None
    history_entries: int = DEFAULT_MAX_ENTRIES  # per scheduler, (n-gram, successor) pairs; 0: no history
    handoff_native_tail: int = 0  # a hand-off's last prompt tokens the target prefills itself (`translate_cache`)
    # an exact, SPEED or RidgeFill prompt longer than this is prefilled in chunks of it, each
    # beside a step of the running requests (vLLM's name; None: whole prompts)
    max_num_batched_tokens: int | None = 512
    # bytes of KV cache per weight set: a pool of rows each request reserves its prompt and max
    # tokens from (`Scheduler`); None: no bound but --max-batch and the context
    kv_cache_memory: int | None = None


@dataclass
class AppRequest(ServeRequest):
    """A request as the app sees it: the scheduler's fields, the target's tokenization of the
    text for a hand-off (the ids it serves, with their character spans) and what its prefill ran."""

    tokens: Tokenized | None = None
    report: PrefillReport | None = None


class Served:
    """One served model: its engine, the prefill methods it has artifacts for, and a scheduler
    per weight set (`groups`: (engine, prefillers) pairs; the first is the base model's).
    `fitted`: per method, the engines whose weights its artifacts were fitted for (the method's
    scheduler keeps what it refuses since an update: `Scheduler.refused`). `chunk_size`: the
    prefillers' chunk, so a longer prompt is sliced from its first chunk (`Scheduler`)."""

    def __init__(self, name: str, groups: list[tuple[object, dict]], max_batch: int, queue_size: int, history_entries: int = DEFAULT_MAX_ENTRIES,
                 fitted: dict[str, list] | None = None, kv_cache_bytes: int | None = None, chunk_size: int | None = None):
        self.name, self.engine = name, groups[0][0]
        self.fitted = fitted or {}
        draft = DraftConfig()
        history = lambda: RolloutHistory(draft.n_min, draft.n_max, history_entries) if history_entries > 0 else None  # noqa: E731
        # one history per scheduler: read and written under its scheduler's step lock only
        self.schedulers = [Scheduler(engine, prefillers, max_batch, queue_size, draft, history=history(), kv_cache_bytes=kv_cache_bytes,
                                     chunk_size=chunk_size) for engine, prefillers in groups]
        self.routes = {method: s for s in self.schedulers for method in s.prefillers}
        every = self.schedulers
        budgeted = [s for s in every if s.pool_rows is not None]
        self.metrics = ServerMetrics(
            lambda: sum(s.kv_bytes for s in every), lambda: sum(s.queue.qsize() for s in every), lambda: sum(len(s.active) for s in every),
            lambda: sum(s.reserved_rows for s in budgeted) / sum(s.pool_rows for s in budgeted) if budgeted else 0.0,
        )
        for s in every:
            s.metrics = self.metrics


def build_served(config: ServeConfig) -> dict[str, Served]:
    """Load the model(s) and artifacts named by `config`; artifacts are checked against the base
    model's fingerprint (computed once, at load), methods resolved as the CLI resolves them."""
    from kvforge.engine import Engine
    from kvforge.fill import ridgefill, speed
    from kvforge.models import load_model

    if (config.translator is None) != (config.target is None):
        raise ValueError("--translator and --target go together")
    load = lambda spec: Engine(load_model(spec, device=config.device, dtype=config.dtype))  # noqa: E731
    engine = load(config.model)
    chunk = config.max_num_batched_tokens
    base = {"exact": planned_prefiller(engine, lambda ids: None, chunk)}
    groups = [(engine, base)]
    spd = speed.resolve(engine, config.cut, config.anchors, config.speed_tail, config.adapter)
    speed_prefill = planned_prefiller(spd.engine, lambda ids: spd.plan(len(ids)), chunk)
    fitted = {}
    if spd.engine is engine:
        base["speed"] = speed_prefill
    else:
        groups.append((spd.engine, {"speed": speed_prefill}))
        fitted["speed"] = [engine]
    if config.maps is not None:
        rf, maps = ridgefill.resolve(engine, config.maps, config.preset, config.split, config.tail, config.attended_rows)
        base["ridgefill"] = planned_prefiller(engine, lambda ids: ridgefill.ridgefill_plan(engine, ids, rf, maps), chunk)
        fitted["ridgefill"] = [engine]
    served = {config.model: Served(config.model, groups, config.max_batch, config.queue_size, config.history_entries, fitted, config.kv_cache_memory, chunk)}
    if config.translator is not None:
        from kvforge.translate.translator import ModelSide, Translator

        translator = Translator.load(config.translator)
        target = load(config.target)
        translator.check_pair(ModelSide.of(engine), ModelSide.of(target))
        target_prefillers = {"exact": planned_prefiller(target, lambda ids: None, chunk), "handoff": handoff_prefiller(translator, engine, target, config.handoff_native_tail, chunk)}
        served[config.target] = Served(config.target, [(target, target_prefillers)], config.max_batch, config.queue_size, config.history_entries,
                                       {"handoff": [engine, target]}, config.kv_cache_memory, chunk)
    for each in served.values():  # every engine and adapted weight set is built: the weights are kept packed only
        for scheduler in each.schedulers:
            scheduler.engine.release_unpacked_weights()
    return served


def update_weights(served: dict[str, Served], model: str, tensors, lora_scale: float = 1.0) -> dict:
    """Swap `model`'s weights in place (full or LoRA, `models.weights`) between two steps: every
    scheduler of the app waits (a hand-off target prefills with its source's weights). An update
    that does not fit raises `WeightUpdateError` with the weights unchanged. Requests running on
    the model are marked crossed; methods fitted for its old weights are refused from then on.
    Returns what was done."""
    s = served[model]
    with contextlib.ExitStack() as paused:
        for scheduler in (sch for each in served.values() for sch in each.schedulers):
            paused.enter_context(scheduler.paused())
        kind = s.engine.update_weights(tensors, lora_scale)
        crossed = [r for scheduler in s.schedulers for r in scheduler.started]  # a prompt mid-prefill has rows from both weights too
        # a hand-off mid-prefill on another model's scheduler: its source's rows come from both weights
        crossed += [r for each in served.values() if each is not s for method, engines in each.fitted.items() if any(e is s.engine for e in engines)
                    for r in each.routes[method].prefilling if r.prefill == method]
        for r in crossed:
            r.crossed = True
        refused = []
        for each in served.values():
            for method, engines in each.fitted.items():
                scheduler = each.routes[method]
                if method not in scheduler.refused and any(e is s.engine for e in engines):
                    scheduler.refused[method] = (f"prefill {method!r} of {each.name} was fitted for {model}'s weights before they were updated: "
                                                 "refit it for the new weights and restart the server with it")
                    refused.append(f"{each.name}:{method}")
    return {"model": model, "kind": kind, "weights_version": s.engine.model.weights_version, "crossed_requests": len(crossed), "refused": refused}


def planned_prefiller(engine, make_plan, chunk_size: int | None = None):
    """Prefill a request by `make_plan(prompt_ids)` (None: exact) and record what ran; the
    request decodes with the rescue its plan asks for (RidgeFill). An exact, SPEED or RidgeFill
    prefill runs in chunks of `chunk_size` tokens (None: whole; `Engine.prefill_steps`), and the
    scheduler decodes between them."""

    def prefill(r: AppRequest):
        plan = make_plan(r.prompt_ids)
        logits, cache, states = yield from engine.prefill_steps([r.prompt_ids], chunk_size=chunk_size, plan=plan)
        r.report = PrefillReport.of(plan, cache, len(r.prompt_ids))
        return logits, cache, DecodeRescue.start(engine, r.prompt_ids, cache, states, plan)

    return prefill


def handoff_prefiller(translator, source, target, native_tail: int = 0, chunk_size: int | None = None):
    """Prefill a request by a hand-off: the source's prefill in chunks of `chunk_size` tokens, the
    translation a target layer at a time, the native tail in chunks (`hand_off_steps`; None:
    whole), with the scheduler's decode steps between them."""
    import torch

    from kvforge.translate.handoff import hand_off_steps

    def prefill(r: AppRequest):
        h = yield from hand_off_steps(translator, source, target, r.text, target_tokens=r.tokens, native_tail=native_tail, chunk_size=chunk_size)
        r.prompt_ids = h.target_ids  # the ids the request was checked with, when it tokenized them
        r.report = PrefillReport("handoff", len(h.target_ids), None, None)
        logits = target.decode_step(torch.tensor([h.pending]), h.cache)
        return logits, h.cache, None

    return prefill


def create_app(served: dict[str, Served], api_key: str | None = None, metrics_public: bool = False,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app over `served`; with `api_key`, every route but /health (and /metrics when
    `metrics_public`) answers 401 without `Authorization: Bearer <api_key>`. A request body over
    `max_body_bytes` answers 413."""
    app = FastAPI(title="kvforge", description="OpenAI-compatible server with forged KV caches.")
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if api_key:
        open_paths = {"/health", "/metrics"} if metrics_public else {"/health"}
        app.middleware("http")(_require_key(api_key, open_paths))

    @app.on_event("startup")
    async def _start():
        for s in served.values():
            for scheduler in s.schedulers:
                scheduler.start()

    @app.on_event("shutdown")
    async def _stop():
        for s in served.values():
            for scheduler in s.schedulers:
                scheduler.stop()

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"malformed JSON: {first.get('msg')}"), status_code=400)
        return JSONResponse(error_body(f"{where or 'body'}: {first.get('msg', 'invalid')}", param=where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "not_found_error" if exc.status_code == 404 else "invalid_request_error"), status_code=exc.status_code)

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": list(served), "dtype": {name: dtype_name(s.engine.dtype) for name, s in served.items()}}

    @app.get("/metrics")
    async def metrics():
        body = b"".join(s.metrics.render() for s in served.values())
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "kvforge", "created": 0} for name in served]}

    @app.post("/v1/update_weights")
    async def update_weights_route(body: UpdateWeightsRequest):
        name = body.model or next(iter(served))
        if name not in served:
            raise _unknown_model(name, served)
        try:
            tensors, scale = await asyncio.to_thread(read_update, body.path)
            return await asyncio.to_thread(update_weights, served, name, tensors, body.lora_scale or scale)
        except WeightUpdateError as exc:
            raise ApiError(400, str(exc), "path") from exc

    @app.post("/v1/abort")
    async def abort(body: AbortRequest | None = None):
        names = [body.model] if body is not None and body.model else list(served)
        unknown = [n for n in names if n not in served]
        if unknown:
            raise _unknown_model(unknown[0], served)
        counts = await asyncio.to_thread(lambda: [scheduler.abort() for n in names for scheduler in served[n].schedulers])
        return {"aborted": sum(counts)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        return await _serve(http, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        return await _serve(http, body, chat=True)

    async def _serve(http: Request, body, chat: bool):
        s = served.get(body.model)
        if s is None:
            raise _unknown_model(body.model, served)
        group = await asyncio.to_thread(_make_group, s, body, chat)  # templating and tokenizing off the event loop
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        for r in group:
            r.emit = lambda kind, payload, i=r.index: loop.call_soon_threadsafe(events.put_nowait, (i, kind, payload))
        try:
            s.routes[group[0].prefill].submit(group)
        except QueueFull as exc:
            raise ApiError(429, str(exc), code="queue_full", kind="rate_limit_error") from exc
        rid = new_id("chatcmpl" if chat else "cmpl")
        reply = _Reply(s.engine.model.tokenizer, group, chat, body.kvforge.logprobs_of)
        if body.stream:
            return StreamingResponse(_stream(s.name, group, events, rid, reply), media_type="text/event-stream")
        finished = 0
        while finished < len(group):
            try:
                _, kind, _payload = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    for r in group:
                        r.cancelled.set()
                    return Response(status_code=499)
                continue
            finished += kind == "done"
        failed = next((r for r in group if r.error is not None), None)
        if failed is not None:
            raise ApiError(500, _failure(rid, failed), kind="server_error")
        choices = [choice_body(r.index, r.seq.text if r.seq else "", r.seq.finish_reason if r.seq else "abort", chat, reply.logprobs(r), reply.token_ids(r))
                   for r in group]
        return completion_body(rid, s.name, choices, chat, _extra(group))

    async def _stream(model: str, group: list[AppRequest], events: asyncio.Queue, rid: str, reply: "_Reply"):
        """Chunks as the choices produce text, each with the log-probabilities of the tokens its
        choice committed since its last chunk; a choice's last chunk has its finish reason, and
        the last of all carries usage and what ran."""
        finished = 0
        try:
            while finished < len(group):
                i, kind, payload = await events.get()
                r = group[i]
                if kind == "text":
                    delta = choice_body(i, payload, None, reply.chat, reply.logprobs(r, new=True), reply.token_ids(r, new=True), stream=True)
                    yield f"data: {json.dumps(completion_body(rid, model, [delta], reply.chat, stream=True))}\n\n"
                    continue
                finished += 1
                if r.error is not None:
                    yield f"data: {json.dumps(error_body(_failure(rid, r), 'server_error'))}\n\n"
                    break
                last = _extra(group) if finished == len(group) else None
                final = choice_body(i, "", r.seq.finish_reason if r.seq else "abort", reply.chat, reply.logprobs(r, new=True), reply.token_ids(r, new=True), stream=True)
                yield f"data: {json.dumps(completion_body(rid, model, [final], reply.chat, last, stream=True))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for r in group:
                r.cancelled.set()  # a no-op when finished; frees the slots when the client went away

    return app


def _failure(rid: str, r: AppRequest) -> str:
    """What a client is told of a request that failed inside the server: the request id, with the
    error itself in the server's log (internal exception text is not sent)."""
    if r.error == "cancelled":
        return "generation failed: the request was cancelled"
    log.error("request %s (choice %d) failed: %s", rid, r.index, r.error)
    return f"generation failed (request {rid}): the server's log has the details"


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes answers 413, by its Content-Length or,
    when it is sent in chunks, once the chunks received pass the limit. The body is read here
    (at most `limit` bytes held) and handed on whole."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before its body was whole: nothing to serve
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._refuse(send)
            chunks.append(message)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(m.get("body", b"") for m in chunks), "more_body": False}]

        async def replayed():
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, send):
        body = json.dumps(error_body(f"the request body is larger than this server takes ({self.limit} bytes)", code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _unknown_model(name: str, served: dict) -> ApiError:
    return ApiError(404, f"the model `{name}` does not exist; served: {', '.join(served)}", "model", "model_not_found")


def _require_key(api_key: str, open_paths: set[str]):
    """The middleware that answers 401 without the key. Both sides are hashed before the
    constant-time comparison, so not even the key's length leaks through timing."""
    expected = hashlib.sha256(api_key.encode()).digest()

    async def require_key(request: Request, call_next):
        if request.url.path in open_paths:
            return await call_next(request)
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(given.strip().encode()).digest(), expected):
            return await call_next(request)
        message = "invalid API key" if given else "missing API key: send the header `Authorization: Bearer <key>`"
        return JSONResponse(error_body(message, code="invalid_api_key"), status_code=401)

    return require_key


class _Reply:
    """How a group's choices are written back: chat or completion shape, and their
    log-probabilities (None when not asked for) in OpenAI's shape, under `logprobs_of`."""

    def __init__(self, tokenizer, group: list[AppRequest], chat: bool, logprobs_of: str):
        self.tokenizer, self.chat, self.logprobs_of = tokenizer, chat, logprobs_of
        self.sent = [0] * len(group)  # per choice: log-probability entries already sent (streaming)
        self.sent_ids = [0] * len(group)  # per choice: token ids already sent (streaming)
        self.offset = [0] * len(group)  # per choice: characters of token text before them

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def token_ids(self, r: AppRequest, new: bool = False) -> list[int]:
        """The choice's token ids: all of them, or (`new`) those committed since the last call."""
        ids = list(r.seq.token_ids) if r.seq is not None else []
        start = self.sent_ids[r.index] if new else 0
        if new:
            self.sent_ids[r.index] = len(ids)
        return ids[start:]

    def logprobs(self, r: AppRequest, new: bool = False) -> dict | None:
        """The choice's log-probabilities: all of them, or (`new`) those committed since the
        last call; the scheduler records a token's before streaming its text."""
        if not r.config.logprobs or r.seq is None:
            return None
        start = self.sent[r.index] if new else 0
        entries = r.seq.logprobs[start:]
        body = logprobs_body(entries, self.token_text, self.logprobs_of, self.chat, self.offset[r.index] if new else 0)
        if new:
            self.sent[r.index] += len(entries)
            self.offset[r.index] += sum(len(self.token_text(e.token)) for e in entries)
        return body


def choice_seed(seed: int | None, choice: int) -> int | None:
    """Sample 0 samples with the request's seed (n = 1 is unchanged); sample i > 0 with a seed
    hashed from (seed, i), so no sample repeats another request's seed + i."""
    if seed is None or choice == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # in [0, 2**63): a valid torch seed


def _make_group(s: Served, body, chat: bool) -> list[AppRequest]:
    """The request's n choices, its prompt tokenized once: the ids checked against the context
    are the ids served (a hand-off keeps them, with their character spans, for the alignment)."""
    engine, options = s.engine, body.kvforge
    if options.prefill in s.routes and options.prefill in s.routes[options.prefill].refused:
        raise ApiError(400, s.routes[options.prefill].refused[options.prefill], "kvforge.prefill")
    if options.prefill not in s.routes:
        hint = {"ridgefill": "start the server with --maps (no fitted or shipped maps were found for this model)", "handoff": "start the server with --translator and --target, and ask the target model"}
        raise ApiError(400, f"prefill {options.prefill!r} is not available for {s.name}: {hint.get(options.prefill, 'not loaded')}", "kvforge.prefill")
    if options.prefetch and options.draft != "ngram":
        raise ApiError(400, "prefetch needs draft 'ngram': it reads the n-gram cache", "kvforge.prefetch")
    refused = body.unsupported()
    if refused:
        raise ApiError(400, refused)
    n, limit = body.choices(), s.routes[options.prefill].max_batch
    if n > limit:
        raise ApiError(400, f"n = {n} is more than this server decodes together (--max-batch {limit}): ask for at most {limit} choices", "n")
    try:
        top = body.top_logprobs_wanted()
    except ValueError as exc:
        raise ApiError(400, str(exc), "top_logprobs") from exc
    ids, text, tokens = _prompt_ids(s, body, chat)
    context = engine.model.context_length
    if len(ids) >= context:
        raise ApiError(400, f"prompt has {len(ids)} tokens but the model's context is {context} tokens", "prompt", "context_length_exceeded")
    scheduler, limit = s.routes[options.prefill], f"this model's maximum context length is {context} tokens"
    if scheduler.pool_rows is not None:  # the KV-cache budget bounds a request's tokens, each of its n choices reserving its own
        held = scheduler.room(n) - scheduler.spare_rows
        if held < 1:
            raise ApiError(400, f"n = {n} choices do not fit this server's KV cache (--kv-cache-memory): ask for fewer", "n")
        if held < context:
            each = f" for each of {n} choices" if n > 1 else ""
            limit = f"this server's KV cache holds {held} tokens{each} (--kv-cache-memory)"
            if len(ids) >= held:
                raise ApiError(400, f"prompt has {len(ids)} tokens but {limit}", "prompt", "context_length_exceeded")
            context = held
    asked = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
    room = context - len(ids)
    max_tokens = asked or (room if chat else min(16, room))  # OpenAI's defaults: the context's rest (chat), 16 (completions)
    if len(ids) + max_tokens > context:
        field = "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"
        raise ApiError(400, f"{limit}; the prompt has {len(ids)} tokens and {field} asks for "
                            f"{max_tokens} more: ask for at most {room}", field, "context_length_exceeded")
    try:
        config = GenerationConfig(
            max_new_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=max(body.top_k or 0, 0), ignore_eos=bool(body.ignore_eos),
            seed=body.seed, stop=body.stops(),
            logprobs=top is not None, top_logprobs=top or 0, logprobs_of=options.logprobs_of, epoch=options.epoch,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    return [
        AppRequest(ids, replace(config, seed=choice_seed(body.seed, options.sample_index + i)), text, options.prefill, options.draft,
                   options.prefetch, options.history, options.rollout_key, i, options.sample_index + i, tokens=tokens)
        for i in range(n)
    ]


def _prompt_ids(s: Served, body, chat: bool) -> tuple[list[int], str | None, Tokenized | None]:
    """The prompt's token ids, its text (None when given as ids) and, for a hand-off, the
    target's tokenization with character spans."""
    tokenizer, prefill = s.engine.model.tokenizer, body.kvforge.prefill
    try:
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ApiError(400, f"{s.name} has no chat template: use /v1/completions")
            if not any(m.text().strip() for m in body.messages):
                raise ApiError(400, "empty prompt: the messages hold no text", "messages")
            messages = [m.for_template() for m in body.messages]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            prompt = body.prompt_value()
            if not isinstance(prompt, str):
                return _checked_ids(s, prompt, prefill), None, None
            text = prompt
        if prefill == "handoff":
            if not text.strip():
                raise ApiError(400, "empty prompt: give some text", "prompt")
            # The rendered template holds its special tokens already; plain text gets them.
            tokens = tokenize(tokenizer, text, add_special_tokens=not chat)
            return tokens.ids, text, tokens
        ids = list(tokenizer(text, add_special_tokens=False).input_ids) if chat else encode_prompt(tokenizer, text)
        return ids, text, None
    except ApiError:
        raise
    except Exception as exc:
        raise ApiError(400, str(exc).splitlines()[0], "prompt") from exc


def _checked_ids(s: Served, ids: list[int], prefill: str) -> list[int]:
    """A prompt given as token ids, served as given once each id is in the vocabulary."""
    if prefill == "handoff":
        raise ApiError(400, "prefill 'handoff' needs the prompt as text (both models tokenize it)", "prompt")
    vocab = s.engine.model.config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"prompt token id {bad} is outside the vocabulary (0 to {vocab - 1})", "prompt")
    return list(ids)


def _extra(group: list[AppRequest]) -> dict:
    """Usage over every choice (the prompt counted once) and what ran."""
    first = group[0]
    ran = first.report.as_dict() if first.report is not None else {"prefill": first.prefill}
    ran.pop("prompt_tokens", None)  # in usage
    steps = sum(r.steps for r in group)
    mean_accept_len = sum(r.state.accepted for r in group if r.state is not None) / steps if steps else 0.0  # per choice and step
    return {
        "usage": usage(len(first.prompt_ids), sum(len(r.seq.token_ids) for r in group if r.seq is not None)),
        "prompt_token_ids": list(first.prompt_ids),
        "kvforge": {
            **ran, "draft": first.draft, "prefetch": first.prefetch, "ttft_s": max(r.ttft_s for r in group),
            "mean_accept_len": mean_accept_len if first.draft != "none" else None, "steps": max(r.steps for r in group),
            "weights_crossed": any(r.crossed for r in group),
        },
    }

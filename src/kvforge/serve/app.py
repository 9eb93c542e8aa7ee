"""The FastAPI app: OpenAI routes over one `Scheduler` per served model.

Served models: the one given (`--model`), and with `--translator F --target B` also B, whose
requests may ask for `"prefill": "handoff"`: the first model prefills the text, its cache is
translated into B's, and B decodes (B's requests are batched by B's own scheduler).

Methods are resolved by the library (`fill.ridgefill.resolve`, `fill.speed.resolve`), as the CLI
does. The base weights serve every method but SPEED with an adapter, whose LoRA weights are a
second weight set beside them (`lora.adapted_engine`): a batch runs one set of weights, so those
requests have their own scheduler. A response says what its prefill ran (`PrefillReport`: the
method, or exact with the reason, and the rows filled or left shallow).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvforge.generation import GenerationConfig
from kvforge.models.loading import dtype_name
from kvforge.plan import PrefillReport
from kvforge.prompting import encode_prompt
from kvforge.serve.metrics import ServerMetrics
from kvforge.serve.protocol import ChatCompletionRequest, CompletionRequest, completion_body, error_body, new_id, usage
from kvforge.serve.scheduler import QueueFull, Scheduler, ServeRequest
from kvforge.translate.align import Tokenized, tokenize


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


@dataclass
class AppRequest(ServeRequest):
    """A request as the app sees it: the scheduler's fields, the target's tokenization of the
    text for a hand-off (the ids it serves, with their character spans) and what its prefill ran."""

    tokens: Tokenized | None = None
    report: PrefillReport | None = None


class Served:
    """One served model: its engine, the prefill methods it has artifacts for, and a scheduler
    per weight set (`groups`: (engine, prefillers) pairs; the first is the base model's)."""

    def __init__(self, name: str, groups: list[tuple[object, dict]], max_batch: int, queue_size: int):
        self.name, self.engine = name, groups[0][0]
        self.schedulers = [Scheduler(engine, prefillers, max_batch, queue_size) for engine, prefillers in groups]
        self.routes = {method: s for s in self.schedulers for method in s.prefillers}
        every = self.schedulers
        self.metrics = ServerMetrics(
            lambda: sum(s.kv_bytes for s in every), lambda: sum(s.queue.qsize() for s in every), lambda: sum(len(s.active) for s in every)
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
    base = {"exact": planned_prefiller(engine, lambda ids: None)}
    groups = [(engine, base)]
    spd = speed.resolve(engine, config.cut, config.anchors, config.speed_tail, config.adapter)
    speed_prefill = planned_prefiller(spd.engine, lambda ids: spd.plan(len(ids)))
    if spd.engine is engine:
        base["speed"] = speed_prefill
    else:
        groups.append((spd.engine, {"speed": speed_prefill}))
    if config.maps is not None:
        rf, maps = ridgefill.resolve(engine, config.maps, config.preset, config.split, config.tail, config.attended_rows)
        base["ridgefill"] = planned_prefiller(engine, lambda ids: ridgefill.ridgefill_plan(engine, ids, rf, maps))
    served = {config.model: Served(config.model, groups, config.max_batch, config.queue_size)}
    if config.translator is not None:
        from kvforge.translate.translator import ModelSide, Translator

        translator = Translator.load(config.translator)
        target = load(config.target)
        translator.check_pair(ModelSide.of(engine), ModelSide.of(target))
        target_prefillers = {"exact": planned_prefiller(target, lambda ids: None), "handoff": handoff_prefiller(translator, engine, target)}
        served[config.target] = Served(config.target, [(target, target_prefillers)], config.max_batch, config.queue_size)
    return served


def planned_prefiller(engine, make_plan):
    """Prefill a request by `make_plan(prompt_ids)` (None: exact) and record what ran."""

    def prefill(r: AppRequest):
        plan = make_plan(r.prompt_ids)
        logits, cache = engine.prefill([r.prompt_ids], plan=plan)
        r.report = PrefillReport.of(plan, cache, len(r.prompt_ids))
        return logits, cache

    return prefill


def handoff_prefiller(translator, source, target):
    import torch

    from kvforge.translate.handoff import hand_off

    def prefill(r: AppRequest):
        h = hand_off(translator, source, target, r.text, target_tokens=r.tokens)
        r.prompt_ids = h.target_ids  # the ids the request was checked with, when it tokenized them
        r.report = PrefillReport("handoff", len(h.target_ids), None, None)
        logits = target.decode_step(torch.tensor([h.pending]), h.cache)
        return logits, h.cache

    return prefill


def create_app(served: dict[str, Served]) -> FastAPI:
    app = FastAPI(title="kvforge", description="OpenAI-compatible server with forged KV caches.")

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

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        try:
            text = body.text()
        except ValueError as exc:
            raise ApiError(400, str(exc), "prompt") from exc
        return await _serve(http, body, text, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        return await _serve(http, body, None, chat=True)

    async def _serve(http: Request, body, text: str | None, chat: bool):
        s = served.get(body.model)
        if s is None:
            raise ApiError(404, f"the model `{body.model}` does not exist; served: {', '.join(served)}", "model", "model_not_found")
        request = _make_request(s, body, text, chat)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        request.emit = lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
        try:
            s.routes[request.prefill].submit(request)
        except QueueFull as exc:
            raise ApiError(429, str(exc), code="queue_full", kind="rate_limit_error") from exc
        rid = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            return StreamingResponse(_stream(http, s.name, request, events, rid, chat), media_type="text/event-stream")
        text_out = []
        while True:
            try:
                kind, payload = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    request.cancelled.set()
                    return Response(status_code=499)
                continue
            if kind == "text":
                text_out.append(payload)
            else:
                break
        if request.error is not None:
            raise ApiError(500, f"generation failed: {request.error}", kind="server_error")
        return completion_body(rid, s.name, "".join(text_out), request.seq.finish_reason, chat, _extra(request))

    async def _stream(http: Request, model: str, request: AppRequest, events: asyncio.Queue, rid: str, chat: bool):
        try:
            while True:
                kind, payload = await events.get()
                if kind == "text":
                    yield f"data: {json.dumps(completion_body(rid, model, payload, None, chat, stream=True))}\n\n"
                    continue
                if request.error is not None:
                    yield f"data: {json.dumps(error_body(f'generation failed: {request.error}', 'server_error'))}\n\n"
                else:
                    final = completion_body(rid, model, "", request.seq.finish_reason, chat, _extra(request), stream=True)
                    yield f"data: {json.dumps(final)}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            request.cancelled.set()  # a no-op when finished; frees the slot when the client went away

    return app


def _make_request(s: Served, body, text: str | None, chat: bool) -> AppRequest:
    """The request, its prompt tokenized once: the ids checked against the context are the ids
    served (a hand-off keeps them, with their character spans, for the alignment)."""
    engine, options = s.engine, body.kvforge
    tokenizer = engine.model.tokenizer
    if options.prefill not in s.routes:
        hint = {"ridgefill": "start the server with --maps", "handoff": "start the server with --translator and --target, and ask the target model"}
        raise ApiError(400, f"prefill {options.prefill!r} is not available for {s.name}: {hint.get(options.prefill, 'not loaded')}", "kvforge.prefill")
    if options.prefetch and options.draft != "ngram":
        raise ApiError(400, "prefetch needs draft 'ngram': it reads the n-gram cache", "kvforge.prefetch")
    tokens = None
    try:
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ApiError(400, f"{s.name} has no chat template: use /v1/completions")
            messages = [m.model_dump() for m in body.messages]
            if not any(m["content"].strip() for m in messages):
                raise ApiError(400, "empty prompt: the messages hold no text", "messages")
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if options.prefill == "handoff":
            if not text.strip():
                raise ApiError(400, "empty prompt: give some text", "prompt")
            # The rendered template holds its special tokens already; plain text gets them.
            tokens = tokenize(tokenizer, text, add_special_tokens=not chat)
            ids = tokens.ids
        elif chat:
            ids = list(tokenizer(text, add_special_tokens=False).input_ids)
        else:
            ids = encode_prompt(tokenizer, text)
    except ApiError:
        raise
    except Exception as exc:
        raise ApiError(400, str(exc).splitlines()[0], "prompt") from exc
    context = engine.model.context_length
    if len(ids) >= context:
        raise ApiError(400, f"prompt has {len(ids)} tokens but the model's context is {context} tokens", "prompt", "context_length_exceeded")
    max_tokens = body.max_tokens or (16 if not chat else context - len(ids) - 1)
    try:
        config = GenerationConfig(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=body.stops())
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    return AppRequest(ids, config, text, options.prefill, options.draft, options.prefetch, tokens=tokens)


def _extra(r: AppRequest) -> dict:
    ran = r.report.as_dict() if r.report is not None else {"prefill": r.prefill}
    ran.pop("prompt_tokens", None)  # in usage
    return {
        "usage": usage(len(r.prompt_ids), len(r.seq.token_ids)),
        "kvforge": {
            **ran, "draft": r.draft, "prefetch": r.prefetch, "ttft_s": r.ttft_s,
            "mean_accept_len": r.mean_accept_len if r.draft != "none" else None, "steps": r.steps,
        },
    }

"""The OpenAI wire format: request bodies (validated by pydantic), responses, stream chunks and
errors. kvforge's own per-request options ride in a `kvforge` field (the openai client's
`extra_body={"kvforge": {...}}`); other unknown fields are ignored, as vLLM does. A response's
`kvforge` field says what ran: `prefill` (the method asked for, or "exact" with a `reason` when
its plan computed every row exactly), `filled_rows` and `shallow_rows` (`plan.PrefillReport`),
the drafter and its acceptance.

Every field the OpenAI schema gives a text-only model is accepted in each of its shapes (null
included: it means the default); a value outside what the sampler takes is a 400, never a 500.
Fields kvforge cannot honour (penalties, logit bias, `best_of`, `suffix`, `echo`) are accepted
at their neutral value and refused otherwise, with a message naming them (`unsupported`).

Log-probabilities come in OpenAI's shapes: chat `logprobs.content[]` entries with `token`,
`logprob`, `bytes` and `top_logprobs`; completions `tokens`, `token_logprobs`, `top_logprobs`
(token -> logprob, the chosen token included) and `text_offset`. They are under the model's raw
distribution, as OpenAI and vLLM report them, or with `kvforge.logprobs_of = "sampling"` under
the distribution the token was drawn from (after temperature and top-p); a token that
distribution excludes reports -9999.0 (vLLM's stand-in for -inf, which JSON cannot carry).
"""

from __future__ import annotations

import time
import uuid
from itertools import accumulate
from typing import Annotated, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvforge.sampling import TokenLogprob

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on chat top_logprobs; vLLM's default on completions logprobs
INT64 = 2**63  # seeds are int64 in the schema, and torch takes no more
NO_PROBABILITY = -9999.0
# bounds on what one request may ask the server to hold and check per token (the body itself is
# bounded by `ServeConfig.max_body_bytes`)
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class KvforgeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill: Literal["exact", "ridgefill", "speed", "handoff"] = "exact"
    draft: Literal["none", "ngram", "prompt-lookup"] = "none"
    prefetch: bool = False
    # with draft "ngram": draft from (and add to) the server's history of this prompt's earlier rollouts
    history: bool = True
    # names the rollout in that history (an RL prompt's id); None: the prompt's tokens name it
    rollout_key: str | None = Field(default=None, min_length=1, max_length=256)
    # the first choice's sample index in the rollout (choice i is sample_index + i): a group sent as
    # G requests with sample_index 0..G-1 and one seed is the group of one request with n = G
    sample_index: int = Field(default=0, ge=0, lt=1 << 20)
    # the RL epoch: part of every sampled token's noise key, so one seed draws fresh noise each
    # epoch; leave it at 0 to couple epochs (a sample replays its last draw where the policy agrees)
    epoch: int = Field(default=0, ge=0, lt=2**63)
    # which distribution log-probabilities are reported under (see the module docstring)
    logprobs_of: Literal["model", "sampling"] = "model"


class UpdateWeightsRequest(BaseModel):
    """POST /v1/update_weights: a safetensors file (full weights by parameter name, or a LoRA's
    lora_A/lora_B factors; a PEFT directory's adapter_model.safetensors) for `model` (default:
    the first served). `lora_scale` overrides the PEFT config's lora_alpha / r."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    path: str = Field(min_length=1)
    lora_scale: float | None = Field(default=None, gt=0.0)


class AbortRequest(BaseModel):
    """POST /v1/abort: finish every queued and running request of `model` (default: every model)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None


class ContentPart(BaseModel):
    """One part of a message's content. A text-only model takes text parts; any other type is
    refused by name when the prompt is built (a clearer 400 than a union's validation error)."""

    type: str
    text: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool | None = None  # usage rides on the last chunk either way


class _Sampling(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)  # NaN would pass no bound check clearly
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # vLLM's extra sampling parameters, as its clients send them (`vllm bench serve` sets
    # ignore_eos): top_k 0 or -1 is off; ignore_eos decodes past the end-of-sequence token
    top_k: int | None = Field(default=None, ge=-1)
    ignore_eos: bool | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=128)  # the server's --max-batch bounds it further
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    kvforge: KvforgeOptions = Field(default_factory=KvforgeOptions)

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> str | None:
        """The first field set to something kvforge cannot do, or None."""
        if self.frequency_penalty or self.presence_penalty:
            return "frequency_penalty and presence_penalty are not supported (give 0 or leave them out)"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    def choices(self) -> int:
        return self.n if self.n is not None else 1

    def top_logprobs_wanted(self) -> int | None:
        """None: no log-probabilities; else how many alternatives per token."""
        raise NotImplementedError


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(default=None, ge=1, le=20)
    suffix: str | None = None

    def prompt_value(self) -> str | list[int]:
        """The one prompt, as text or as token ids (a list of one prompt is that prompt)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("this server takes one prompt per request (got a list of %d)" % len(prompt))
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise ValueError("empty prompt: give some text or token ids")
        return prompt

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo is not supported (prompt log-probabilities would need the head over every prompt row)"
        if self.best_of is not None and self.best_of != self.choices():
            return "best_of is not supported (leave it out or equal to n)"
        if self.suffix:
            return "suffix is not supported"
        return super().unsupported()

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content parts of type {part.type!r} are not served: this is a text-only model")
            if part.text is None:
                raise ValueError("a content part of type 'text' needs a `text` field")
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        # Chat templates know system, not OpenAI's newer name for it.
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # what newer clients send for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def choice_body(index: int, text: str, finish: str | None, chat: bool, logprobs: dict | None = None, token_ids: list[int] | None = None,
                stream: bool = False) -> dict:
    """One choice of a response (stream=False) or of a stream chunk; `token_ids`: the tokens its
    text came from (a chunk: those committed since the last chunk)."""
    if chat:
        message = {"role": "assistant", "content": text}
        return {"index": index, "delta" if stream else "message": message, "logprobs": logprobs, "finish_reason": finish, "token_ids": token_ids or []}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "token_ids": token_ids or []}


def completion_body(rid: str, model: str, choices: list[dict], chat: bool, extra: dict | None = None, stream: bool = False) -> dict:
    """A whole response (stream=False) or one stream chunk."""
    obj = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices}
    body.update(extra or {})
    return body


def logprobs_body(entries: list[TokenLogprob], token_text: Callable[[int], str], of: str, chat: bool, offset: int = 0) -> dict:
    """OpenAI's `logprobs` of a choice (or of a chunk's share of it) for the tokens `entries`
    record; `offset`: characters of completion text before the first of them (text_offset)."""

    def value(lp: float) -> float:
        return lp if lp > NO_PROBABILITY else NO_PROBABILITY  # -inf: outside top-k / top-p

    chosen = [value(e.model if of == "model" else e.sampling) for e in entries]
    texts = [token_text(e.token) for e in entries]
    if chat:
        return {"content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()),
             "top_logprobs": [{"token": token_text(i), "logprob": value(v), "bytes": list(token_text(i).encode())} for i, v in e.top]}
            for e, t, lp in zip(entries, texts, chosen)
        ]}
    tops = []
    for e, t, lp in zip(entries, texts, chosen):
        top = {token_text(i): value(v) for i, v in e.top}
        top.setdefault(t, lp)  # the chosen token is always listed, as vLLM does
        tops.append(top)
    offsets = list(accumulate((len(t) for t in texts), initial=offset))[: len(texts)]
    return {"tokens": texts, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}

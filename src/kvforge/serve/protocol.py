"""The OpenAI wire format: request bodies (validated by pydantic), responses, stream chunks and
errors. kvforge's own per-request options ride in a `kvforge` field (the openai client's
`extra_body={"kvforge": {...}}`); other unknown fields are ignored, as vLLM does. A response's
`kvforge` field says what ran: `prefill` (the method asked for, or "exact" with a `reason` when
its plan computed every row exactly), `filled_rows` and `shallow_rows` (`plan.PrefillReport`),
the drafter and its acceptance."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class KvforgeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill: Literal["exact", "ridgefill", "speed", "handoff"] = "exact"
    draft: Literal["none", "ngram", "prompt-lookup"] = "none"
    prefetch: bool = False


class _Sampling(BaseModel):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)  # one choice per request
    kvforge: KvforgeOptions = Field(default_factory=KvforgeOptions)

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[str]

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ValueError("this server takes one prompt per request (got a list of %d)" % len(self.prompt))
            return self.prompt[0]
        return self.prompt


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish: str | None, chat: bool, extra: dict | None = None, stream: bool = False) -> dict:
    """A whole response (stream=False) or one stream chunk."""
    if chat:
        key = "delta" if stream else "message"
        choice = {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}
        obj = "chat.completion.chunk" if stream else "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    body.update(extra or {})
    return body

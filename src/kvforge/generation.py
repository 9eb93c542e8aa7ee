"""What decoding is asked for and what it returns: `GenerationConfig`, `Generation`, and one
sequence's state while it decodes (`SequenceState`, `commit_token`). The loop that decodes is
`speculative.decode` (plain decoding is a step with no draft).

Decoding ends at max tokens, EOS, a stop string or the context's end. Streaming hands each
sequence's new text to a callback, holding back what may still become a stop string or an
incomplete UTF-8 character. With `logprobs`, each committed token's log-probabilities are
recorded from the logits it was chosen from (`sampling.token_logprobs`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from kvforge.errors import PromptError
from kvforge.plan import PrefillReport
from kvforge.sampling import SamplingParams, TokenLogprob, token_logprobs


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    chunk_size: int | None = None  # prefill chunk; None: the engine's default
    # Record each token's log-probabilities (`Generation.logprobs`), with the `top_logprobs`
    # likeliest tokens per position under `logprobs_of`: "model" (the raw distribution, what
    # OpenAI reports) or "sampling" (after temperature, top-k, top-p).
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_of: str = "model"
    # the RL epoch a rollout belongs to: part of every sampled token's noise key (`SampleKey`), so
    # two epochs with one seed draw fresh noise; the same epoch number replays the same noise
    epoch: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.top_logprobs < 0 or self.logprobs_of not in ("model", "sampling"):
            raise ValueError(f"top_logprobs must be >= 0 and logprobs_of 'model' or 'sampling', got {self.top_logprobs}, {self.logprobs_of!r}")
        if self.epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {self.epoch}")
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)

    def token_logprobs(self, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
        """The log-probabilities to record for `tokens` chosen from logits (N, V); None when not asked."""
        if not self.logprobs:
            return None
        return token_logprobs(logits, tokens, self.sampling, self.top_logprobs, self.logprobs_of)


@dataclass
class Generation:
    """One sequence's output. `token_ids` are the generated ids (prompt excluded)."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prompt_tokens: int
    ttft_s: float  # request start to first token
    decode_s: float  # first token to last token
    stop_matched: str | None = None
    prefill: PrefillReport | None = None  # what the prompt's prefill ran (one planned prompt)
    logprobs: list[TokenLogprob] | None = None  # one per token id, with `GenerationConfig.logprobs`
    rescued_rows: int | None = None  # filled prompt rows RidgeFill's rescue recomputed while decoding (None: no rescue ran)

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclass
class SequenceState:
    """One sequence while it decodes: what `commit_token` has committed so far. Shared by plain
    decoding, the speculative step and the server."""

    index: int
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    streamed: int = 0  # characters of text already handed to the callback
    finish_reason: str | None = None
    stop_matched: str | None = None
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id when recorded
    # incremental detokenization (`detokenize`): text holds `settled` characters decoded for sure,
    # then the text of the tokens from `prefix` on beyond the text of tokens [prefix, read)
    settled: str = ""
    prefix: int = 0
    read: int = 0

    def result(self, start: float, prefill: PrefillReport | None = None) -> Generation:
        """The finished sequence; `start`: when its request started (for the time to first token)."""
        return Generation(self.token_ids, self.text, self.finish_reason, self.prompt_tokens, self.first_token_at - start,
                          self.last_token_at - self.first_token_at, self.stop_matched, prefill,
                          self.logprobs or None)


def planned_report(plan, cache, prompts: list[list[int]], start: int = 0) -> PrefillReport | None:
    """What a planned prefill of one prompt ran, read off its cache (None without a plan)."""
    if plan is None or len(prompts) != 1:
        return None
    return PrefillReport.of(plan, cache, len(prompts[0]), start)


def check_prompts(prompts: list[list[int]], context: int, cached: list[int] | None = None) -> int:
    """Raise a PromptError for an empty prompt or one that fills the context (with the `cached`
    tokens before it); returns the context."""
    for i, p in enumerate(prompts):
        if not p:
            raise PromptError("empty prompt: give at least one token")
        before = cached[i] if cached else 0
        if before + len(p) >= context:
            held = f" after {before} cached" if before else ""
            raise PromptError(f"prompt has {len(p)} tokens{held} but the model's context is {context} tokens")
    return context


def eos_token_ids(model) -> set[int]:
    """End-of-sequence ids from the tokenizer and the generation config."""
    ids: set[int] = set()
    for source in (getattr(model.hf, "generation_config", None), model.tokenizer, model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def commit_token(
    seq: SequenceState, token: int, now: float, tokenizer, eos: set[int], config: GenerationConfig, on_text, logprob: TokenLogprob | None = None
) -> None:
    """Append one token (and its `logprob`, recorded before any text is streamed, so a reader of
    the stream finds it): finish on EOS (kept in the ids), a stop string (cut from the text) or
    max tokens; stream the text that can no longer change to `on_text(seq.index, delta)`."""
    if not seq.token_ids:
        seq.first_token_at = now
    seq.last_token_at = now
    if logprob is not None:
        seq.logprobs.append(logprob)
    if token in eos:
        seq.token_ids.append(token)
        seq.finish_reason = "stop"
        return
    seq.token_ids.append(token)
    detokenize(seq, tokenizer)
    for stop in config.stop:
        # A stop string can only newly appear in the text's tail.
        at = seq.text.find(stop, max(0, seq.streamed - len(stop)))
        if at >= 0:
            seq.text = seq.text[:at]
            seq.finish_reason = "stop"
            seq.stop_matched = stop
            return
    if len(seq.token_ids) >= config.max_new_tokens:
        seq.finish_reason = "length"
        return
    if on_text is not None:
        hold = max((len(s) - 1 for s in config.stop), default=0)
        safe = len(seq.text) - hold
        while safe > seq.streamed and seq.text[safe - 1] == "\ufffd":  # incomplete UTF-8 sequence
            safe -= 1
        if safe > seq.streamed:
            on_text(seq.index, seq.text[seq.streamed : safe])
            seq.streamed = safe


def detokenize(seq: SequenceState, tokenizer) -> None:
    """Bring `seq.text` up to its token ids at a cost independent of the output's length: only the
    tokens since the last settled point are decoded, once beside the window before them
    (`prefix`..`read`), and the new text is what they add to it. A window whose text ends in an
    incomplete UTF-8 character stays open until a later token completes it. The text equals the
    whole output decoded at once wherever the tokenizer decodes a concatenation as the
    concatenation of its parts past the first token of a window (byte-level BPE and SentencePiece
    tokenizers do), as vLLM's incremental detokenizer assumes. A special token adds no text (it is
    skipped, as the whole decode skips it) and opens no window of its own."""
    if seq.token_ids[-1] in _special_ids(tokenizer):
        return
    before = tokenizer.decode(seq.token_ids[seq.prefix : seq.read], skip_special_tokens=True)
    window = tokenizer.decode(seq.token_ids[seq.prefix :], skip_special_tokens=True)
    if not window.startswith(before):  # a tokenizer that rewrites text across tokens: decode it all, once
        seq.text = tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        if not seq.text.endswith("\ufffd"):
            seq.settled, seq.prefix, seq.read = seq.text, len(seq.token_ids) - 1, len(seq.token_ids)
        return
    new = window[len(before) :]
    seq.text = seq.settled + new
    if new and not new.endswith("\ufffd"):
        seq.settled, seq.prefix, seq.read = seq.text, seq.read, len(seq.token_ids)


_SPECIAL_IDS: "weakref.WeakKeyDictionary[object, frozenset[int]]" = weakref.WeakKeyDictionary()


def _special_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's special token ids, read once per tokenizer (transformers builds the list anew at each read)."""
    ids = _SPECIAL_IDS.get(tokenizer)
    if ids is None:
        ids = _SPECIAL_IDS[tokenizer] = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
    return ids


def flush_text(seq: SequenceState, on_text) -> None:
    """Stream what `commit_token` held back (the sequence has finished)."""
    if on_text is not None and len(seq.text) > seq.streamed:
        on_text(seq.index, seq.text[seq.streamed :])
    seq.streamed = len(seq.text)

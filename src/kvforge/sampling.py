"""Token selection: greedy, temperature, top-k, top-p, with noise from a counter.

Shapes: B batch (or N rows), V vocabulary. `probabilities` is the distribution a sampled token is
drawn from, after every filter. `token_logprobs` reports a chosen token's log-probability under
that distribution and under the model's own (the raw logits' softmax), which is what RL trainers
build importance ratios from.

A sampled token is the Gumbel-max of the filtered distribution p: argmax_i p_i / E_i with E_i
independent Exp(1) noise (the exponential race; log p_i - log E_i is log p_i plus Gumbel noise),
which is exact sampling from p. The noise is not drawn from a stateful stream: it is a function of
the sample's `SampleKey` (seed, request, sample index) and the token's position, read from a
counter-based generator (Philox, the key as its key, the position, index and epoch in its
counter). A sampled token is therefore a function of its logits and its key alone: decoding one token per
step or verifying a draft of many commits the same tokens wherever the logits are the same bits,
and two runs with one seed agree whatever else is batched with them.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean no filter."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0



@dataclass(frozen=True)
class SampleKey:
    """Names one sample's noise: the seed, its request (`prompt_key` of the prompt's tokens, so
    that distinct prompts in one batch draw apart) and its index among the samples of that
    request (the G samples of an RL group), and the RL epoch it belongs to. The same key gives the
    same noise at every position across calls: an RL sample keyed alike in two epochs (`epoch`
    left at 0: coupled epochs) replays its earlier draw wherever the policy did not move, while a
    new epoch number draws fresh noise."""

    seed: int
    request: int
    index: int = 0
    epoch: int = 0

    def noise(self, position: int, vocab: int) -> torch.Tensor:
        """(V,) float64 Exp(1) noise of the token at `position` (its index in the sequence)."""
        generator = np.random.Philox(
            key=np.array([self.seed & _U64, self.request & _U64], dtype=np.uint64),
            # the draws advance the lowest word: the position, index and epoch sit above it, so
            # the streams of two positions never overlap
            counter=np.array([0, position & _U64, self.index & _U64, self.epoch & _U64], dtype=np.uint64),
        )
        return torch.from_numpy(np.random.Generator(generator).standard_exponential(vocab))

    def draw(self, probs: torch.Tensor, position: int) -> int:
        """The token the exponential race picks from probs (V,) at `position`."""
        return int((probs.double() / self.noise(position, probs.shape[-1]).to(probs.device)).argmax())


def prompt_key(tokens: Sequence[int]) -> int:
    """A stable 64-bit name of a prompt's tokens (the same in every process)."""
    return int.from_bytes(hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=8).digest(), "little")


def fresh_seed() -> int:
    """A random seed, for a request that names none."""
    return secrets.randbits(63)


def sample_keys(prompts: Sequence[Sequence[int]], seed: int | None, epoch: int = 0) -> list[SampleKey]:
    """One key per prompt of a batch: repeats of one prompt (a group) take indices 0, 1, ...;
    `seed` None takes a fresh random one for the whole batch."""
    seed = fresh_seed() if seed is None else seed
    seen: dict[int, int] = {}
    keys = []
    for prompt in prompts:
        request = prompt_key(prompt)
        keys.append(SampleKey(seed, request, seen.get(request, 0), epoch))
        seen[request] = seen.get(request, 0) + 1
    return keys


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (B, V) -> the sampling distribution (B, V) after temperature, top-k, then top-p
    (the order transformers applies them). Greedy gives a one-hot at the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # Shifted so the largest logit is 0 before dividing, by at least float32's smallest normal: a
    # tiny temperature then sends the others to -inf (near-greedy), never to nan.
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass; the top
        # token always stays (a top_p below float32's resolution would otherwise drop it too).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, keys: Sequence[SampleKey], positions: Sequence[int]) -> torch.Tensor:
    """logits (B, V), each row's key and the position of the token it samples -> token ids (B,)."""
    if params.greedy:
        return logits.argmax(-1)
    probs = probabilities(logits, params)
    return torch.tensor([key.draw(row, int(n)) for row, key, n in zip(probs, keys, positions)], dtype=torch.long, device=logits.device)


@dataclass(frozen=True)
class TokenLogprob:
    """One chosen token's log-probabilities. `sampling`: under the distribution it was drawn from
    (`probabilities`: after temperature, top-k, top-p; 0.0 under greedy); `model`: under the
    model's unmodified distribution (log-softmax of the raw logits). `top`: the likeliest tokens
    at its position with their log-probabilities, under the distribution asked for."""

    token: int
    sampling: float
    model: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams, top: int = 0, top_of: str = "model") -> list[TokenLogprob]:
    """logits (N, V), the N tokens chosen from them -> one `TokenLogprob` each; `top` > 0 adds
    the `top` likeliest tokens of each row under `top_of` ("model" or "sampling")."""
    logits = logits.float()
    model = logits.log_softmax(-1)  # (N, V)
    sampling = probabilities(logits, params).log()  # (N, V); -inf where a filter dropped the token
    chosen = torch.tensor(tokens, dtype=torch.long, device=logits.device).view(-1, 1)
    sampled, raw = sampling.gather(1, chosen).squeeze(1).tolist(), model.gather(1, chosen).squeeze(1).tolist()
    tops = [()] * len(tokens)
    if top > 0:
        values, ids = (model if top_of == "model" else sampling).topk(min(top, logits.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(t, s, m, tp) for t, s, m, tp in zip(tokens, sampled, raw, tops)]

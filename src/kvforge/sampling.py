"""Token selection: greedy, temperature, top-k, top-p, with a seeded generator.

Shapes: B batch (or N rows), V vocabulary. `probabilities` is what speculative verification
needs: the distribution a sampled token is actually drawn from, after every filter.
`token_logprobs` reports a chosen token's log-probability under that distribution and under
the model's own (the raw logits' softmax), which is what RL trainers build importance ratios from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> token ids (B,)."""
    if params.greedy:
        return logits.argmax(-1)
    probs = probabilities(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


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

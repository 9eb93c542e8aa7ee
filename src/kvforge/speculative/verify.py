"""Lossless verification of draft tokens. Knows nothing of where drafts come from.

Shapes: B requests, K draft slots (drafts shorter than K are padded), V vocabulary.

The model has scored, in one forward, each request's last committed token followed by its draft;
row i of its logits is the distribution of the token after draft position i. Greedy: accept while
the draft equals the argmax. Sampling, with a point-mass draft x at each position: accept x with
probability p(x) (p: the distribution plain sampling draws from, after temperature / top-k /
top-p); on rejection draw from p with x removed, renormalised, so every committed token is
distributed exactly as p. After the accepted prefix comes the bonus token: the resampled one on a
rejection, a draw from p (the argmax, greedy) after a full accept.
"""

from __future__ import annotations

import torch

from kvforge.sampling import SamplingParams, probabilities


def verify(
    logits: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, K+1, V), drafts (B, K), lengths (B,) real draft tokens per request ->
    (accepted (B,) in 0..lengths, bonus (B,) the token after the accepted prefix)."""
    b, k1, v = logits.shape
    k = k1 - 1
    real = torch.arange(k, device=drafts.device).unsqueeze(0) < lengths.unsqueeze(1)  # (B, K)
    rows = torch.arange(b, device=logits.device)
    if params.greedy:
        target = logits.argmax(-1)  # (B, K+1)
        accepted = ((drafts == target[:, :k]) & real).long().cumprod(1).sum(1)
        return accepted, target[rows, accepted]
    probs = probabilities(logits.reshape(b * k1, v), params).view(b, k1, v)
    p_draft = probs[:, :k].gather(-1, drafts.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, K)
    u = torch.rand(p_draft.shape, generator=generator, device=p_draft.device)
    accepted = ((u < p_draft) & real).long().cumprod(1).sum(1)
    p = probs[rows, accepted].clone()  # (B, V) the distribution at the first unaccepted slot
    rejected = accepted < lengths
    if bool(rejected.any()):
        x = drafts[rows[rejected], accepted[rejected]]
        p[rows[rejected], x] = 0.0
        p[rejected] /= p[rejected].sum(-1, keepdim=True)
    bonus = torch.multinomial(p, 1, generator=generator).squeeze(-1)
    return accepted, bonus

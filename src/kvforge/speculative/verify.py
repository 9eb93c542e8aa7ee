"""Verification of draft tokens. Knows nothing of where drafts come from.

Shapes: B requests, K draft slots (past a draft's length, slots that are never accepted), V vocabulary.

The model has scored, in one forward, each request's last committed token followed by its draft;
row i of its logits is the distribution of the token after draft position i. Each position's token
is the one plain decoding would sample there: the argmax (greedy), or the Gumbel-max draw of the
request's `SampleKey` at that position (`sampling.py`), a function of the logits and the key alone.
Accept while that token equals the drafted one; the first position where it differs gives the
bonus token (after a full accept, the token at the row past the draft). Nothing is resampled and
nothing needs rolling back: the committed tokens are plain decoding's, token for token, wherever
the verification rows are the same bits as plain decoding's one-row steps.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvforge.sampling import SampleKey, SamplingParams, probabilities


def verify(
    logits: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor, params: SamplingParams,
    keys: Sequence[SampleKey] = (), positions: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, K+1, V), drafts (B, K), lengths (B,) real draft tokens per request; `keys` and
    `positions` (B,): each request's key and the position of the token its row 0 samples (unused
    when greedy) -> (accepted (B,) in 0..lengths, bonus (B,) the token after the accepted prefix)."""
    b, k1, v = logits.shape
    k = k1 - 1
    rows = torch.arange(b, device=logits.device)
    if params.greedy:
        target = logits.argmax(-1)  # (B, K+1)
        real = torch.arange(k, device=drafts.device).unsqueeze(0) < lengths.unsqueeze(1)  # (B, K)
        accepted = ((drafts == target[:, :k]) & real).long().cumprod(1).sum(1)
        return accepted, target[rows, accepted]
    accepted, bonus = [], []
    for row, (key, start) in enumerate(zip(keys, positions)):
        n = int(lengths[row])
        probs = probabilities(logits[row, : n + 1], params)  # (n+1, V)
        for i in range(n + 1):  # draws stop at the first position that differs from the draft
            token = key.draw(probs[i], int(start) + i)
            if i == n or token != int(drafts[row, i]):
                accepted.append(i)
                bonus.append(token)
                break
    return torch.tensor(accepted, device=logits.device), torch.tensor(bonus, device=logits.device)

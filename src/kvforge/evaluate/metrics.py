"""Quality metrics against exact: token classes, perplexity gap with a paired bootstrap interval.

Token classes (n = 3 by default), for a scored token t_i of a sequence:
  - novel: the n-gram ending at t_i never occurred earlier in the sequence, so no earlier n-gram
    of the context predicts it (average loss is dominated by predictable tokens; these are not);
  - key: the n-gram ending at t_i occurred earlier with its last token in the filled region, so
    predicting t_i well means reading the filled rows.
"""

from __future__ import annotations

import math

import torch


def token_classes(tokens: list[int], scored_from: int, filled: torch.Tensor, n: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(novel, key) bool masks over tokens[scored_from:]. `filled` (P,) marks filled prompt rows."""
    seen: dict[tuple[int, ...], list[int]] = {}
    novel, key = [], []
    for i in range(len(tokens)):
        gram = tuple(tokens[max(0, i - n + 1) : i + 1])
        earlier = seen.get(gram, []) if len(gram) == n else []
        if i >= scored_from:
            novel.append(not earlier)
            key.append(any(j < filled.numel() and bool(filled[j]) for j in earlier))
        if len(gram) == n:
            seen.setdefault(gram, []).append(i)
    return torch.tensor(novel, dtype=torch.bool), torch.tensor(key, dtype=torch.bool)


def mean_nll(nll: list[torch.Tensor], masks: list[torch.Tensor]) -> float:
    """Mean nats/token over the masked tokens of every sample, pooled."""
    total = sum(float(x[m].sum()) for x, m in zip(nll, masks))
    count = sum(int(m.sum()) for m in masks)
    return total / count if count else float("nan")


def ppl_gap_pct(arm: list[torch.Tensor], exact: list[torch.Tensor], masks: list[torch.Tensor]) -> float:
    """Perplexity of `arm` over exact's on the masked tokens, minus 1, in percent."""
    return 100.0 * (math.exp(mean_nll(arm, masks) - mean_nll(exact, masks)) - 1.0)


def paired_bootstrap_ci(
    arm: list[torch.Tensor], exact: list[torch.Tensor], masks: list[torch.Tensor], resamples: int = 2000, seed: int = 0
) -> list[float]:
    """95 % interval of `ppl_gap_pct`, resampling whole samples (paired: both arms share a draw)."""
    sums_arm = torch.tensor([float(x[m].sum()) for x, m in zip(arm, masks)], dtype=torch.float64)
    sums_exact = torch.tensor([float(x[m].sum()) for x, m in zip(exact, masks)], dtype=torch.float64)
    counts = torch.tensor([int(m.sum()) for m in masks], dtype=torch.float64)
    if len(masks) < 2 or counts.sum() == 0:
        return [float("nan"), float("nan")]
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, len(masks), (resamples, len(masks)), generator=g)
    c = counts[draws].sum(1).clamp(min=1)
    gaps = 100.0 * (torch.exp((sums_arm[draws].sum(1) - sums_exact[draws].sum(1)) / c) - 1.0)
    low, high = torch.quantile(gaps, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return [low, high]

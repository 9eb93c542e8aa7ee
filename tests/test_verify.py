"""Sampling verification in distribution, under top-k and top-p, with a statistic strong enough
to reject the known ways of getting it wrong.

One draft token x per request, N requests: the first committed token (x when accepted, else the
recovered token) must follow p, the model's distribution after temperature, top-k and top-p.
"""

import math

import pytest
import torch

from kvforge.sampling import SamplingParams, probabilities
from kvforge.speculative.verify import verify

V, N = 24, 40_000
# Four strong tokens, then a slow tail: top-k keeps 12 tokens, top-p keeps 5 of those, and the
# raw softmax puts 10 % of its mass on the tokens the filters drop.
LOGITS = torch.tensor([4.0, 3.4, 2.8, 2.2] + [0.6 - 0.12 * i for i in range(V - 4)])
PARAMS = SamplingParams(temperature=1.0, top_k=12, top_p=0.92)
P = probabilities(LOGITS.view(1, V), PARAMS)[0]
LOW = 4  # the last token top-p keeps: p ~ 0.016
OUTSIDE = 5  # the first token top-p drops: p = 0, raw softmax ~ 0.013


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic and its critical value at p = 0.001 (Wilson-Hilferty). Bins expecting
    fewer than 5 are pooled; a draw of a token p gives no mass makes the statistic infinite, so
    tokens outside top-k / top-p count instead of being dropped with their zero expectation."""
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)]).double()
    exp = torch.cat([expected[big], expected[~big].sum().view(1)]).double()
    keep = exp > 0
    df = int(keep.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    if bool(counts[expected == 0].any()):
        return math.inf, critical
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), critical


def _resample_keeping_x(logits, drafts, lengths, params, generator):
    """Bug: on rejection, draw from p itself, so the rejected x can come straight back."""
    p = probabilities(logits[:, 0], params)
    x = drafts[:, 0]
    accepted = torch.rand(x.shape, generator=generator) < p.gather(-1, x.view(-1, 1)).view(-1)
    return accepted.long(), torch.multinomial(p, 1, generator=generator).view(-1)


def _accept_before_filters(logits, drafts, lengths, params, generator):
    """Bug: accept x with its probability before top-k / top-p."""
    raw = probabilities(logits[:, 0], SamplingParams(temperature=params.temperature))
    x = drafts[:, 0]
    accepted = torch.rand(x.shape, generator=generator) < raw.gather(-1, x.view(-1, 1)).view(-1)
    p = probabilities(logits[:, 0], params).scatter(-1, x.view(-1, 1), 0.0)
    return accepted.long(), torch.multinomial(p / p.sum(-1, keepdim=True), 1, generator=generator).view(-1)


def _first_token_counts(verifier, x: int) -> torch.Tensor:
    """(V,) how often each token is committed first over N requests drafting x (fixed seed)."""
    generator = torch.Generator().manual_seed(0)
    logits = LOGITS.expand(N, 2, V)  # the draft position, then the bonus position
    drafts = torch.full((N, 1), x)
    accepted, bonus = verifier(logits, drafts, torch.ones(N, dtype=torch.long), PARAMS, generator)
    first = torch.where(accepted >= 1, drafts[:, 0], bonus)
    return torch.bincount(first, minlength=V).double()


def test_the_filters_leave_a_low_probability_token_and_drop_real_mass():
    raw = LOGITS.softmax(-1)
    assert P.gt(0).sum() == 5 and probabilities(LOGITS.view(1, V), SamplingParams(1.0, top_k=12)).gt(0).sum() == 12
    assert 0.01 < P[LOW] < 0.02 and P[OUTSIDE] == 0 and raw[OUTSIDE] > 0.01
    assert 0.09 < raw[P == 0].sum() < 0.11


@pytest.mark.parametrize(
    "draft, bug",
    [(LOW, _resample_keeping_x), (OUTSIDE, _accept_before_filters)],
    ids=["low-probability draft vs resampling with x", "draft outside the filters vs accepting before them"],
)
def test_committed_tokens_follow_p_and_the_statistic_rejects_the_bug(draft, bug):
    stat, critical = chi_square(_first_token_counts(verify, draft), N * P.double())
    assert stat < critical, (stat, critical)
    stat, critical = chi_square(_first_token_counts(bug, draft), N * P.double())
    assert stat > critical, (stat, critical)

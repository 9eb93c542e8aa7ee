"""Verification by the counter-keyed sample: in distribution under top-k and top-p, independent
across positions, and token for token what plain sampling draws, each with a statistic or a
table strong enough to reject the known ways of getting it wrong.

N requests, each with its own `SampleKey`: the first committed token (the draft when accepted,
else the bonus) must follow p, the model's distribution after temperature, top-k and top-p.
"""

import math

import pytest
import torch

from kvforge.sampling import SampleKey, SamplingParams, probabilities, sample
from kvforge.speculative.verify import verify

V, N = 24, 20_000
# Four strong tokens, then a slow tail: top-k keeps 12 tokens, top-p keeps 5 of those, and the
# raw softmax puts 10 % of its mass on the tokens the filters drop.
LOGITS = torch.tensor([4.0, 3.4, 2.8, 2.2] + [0.6 - 0.12 * i for i in range(V - 4)])
PARAMS = SamplingParams(temperature=1.0, top_k=12, top_p=0.92)
P = probabilities(LOGITS.view(1, V), PARAMS)[0]
LOW = 4  # the last token top-p keeps: p ~ 0.016
OUTSIDE = 5  # the first token top-p drops: p = 0, raw softmax ~ 0.013
KEYS = [SampleKey(3, 17, i) for i in range(N)]
START = 100  # the position row 0 of every request samples


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


def _noise_before_filters(logits, drafts, lengths, params, keys, positions):
    """Bug: the race over the raw softmax, before top-k / top-p."""
    return verify(logits, drafts, lengths, SamplingParams(temperature=params.temperature), keys, positions)


def _noise_without_position(logits, drafts, lengths, params, keys, positions):
    """Bug: every position of a request draws the same noise."""
    probs = probabilities(logits.reshape(-1, V), params).view(logits.shape)
    accepted, bonus = [], []
    for row, key in enumerate(keys):
        noise = key.noise(positions[row], V)
        tokens = [int((probs[row, i].double() / noise).argmax()) for i in range(int(lengths[row]) + 1)]
        j = next((i for i, t in enumerate(tokens[:-1]) if t != int(drafts[row, i])), len(tokens) - 1)
        accepted.append(j)
        bonus.append(tokens[j])
    return torch.tensor(accepted), torch.tensor(bonus)


def _committed(verifier, drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens committed at the first two positions by N requests drafting `drafts`."""
    logits = LOGITS.expand(N, len(drafts) + 1, V)
    draft = torch.tensor(drafts).expand(N, len(drafts))
    accepted, bonus = verifier(logits, draft, torch.full((N,), len(drafts)), PARAMS, KEYS, [START] * N)
    tokens = torch.where(torch.arange(len(drafts) + 1).view(1, -1) < accepted.view(-1, 1), torch.cat([draft, draft[:, :1]], 1), -1)
    tokens[torch.arange(N), accepted] = bonus
    return tokens[:, 0], tokens[:, 1]


def test_the_filters_leave_a_low_probability_token_and_drop_real_mass():
    raw = LOGITS.softmax(-1)
    assert P.gt(0).sum() == 5 and probabilities(LOGITS.view(1, V), SamplingParams(1.0, top_k=12)).gt(0).sum() == 12
    assert 0.01 < P[LOW] < 0.02 and P[OUTSIDE] == 0 and raw[OUTSIDE] > 0.01
    assert 0.09 < raw[P == 0].sum() < 0.11


@pytest.mark.parametrize("draft", [LOW, OUTSIDE], ids=["low-probability draft", "draft outside the filters"])
def test_committed_tokens_follow_p_and_the_statistic_rejects_the_bug(draft):
    first, _ = _committed(verify, [draft])
    stat, critical = chi_square(torch.bincount(first, minlength=V).double(), N * P.double())
    assert stat < critical, (stat, critical)
    first, _ = _committed(_noise_before_filters, [draft])
    stat, critical = chi_square(torch.bincount(first, minlength=V).double(), N * P.double())
    assert stat > critical, (stat, critical)


def test_two_positions_are_independent_and_the_statistic_rejects_shared_noise():
    """A draft of the likeliest token twice: where the first is accepted, the second position's
    token must still follow p (with noise shared across positions it would repeat the first)."""
    for verifier, independent in ((verify, True), (_noise_without_position, False)):
        first, second = _committed(verifier, [0, 0])
        second = second[first == 0]
        stat, critical = chi_square(torch.bincount(second, minlength=V).double(), len(second) * P.double())
        assert (stat < critical) == independent, (verifier.__name__, stat, critical)


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, top_k=5, top_p=0.9)], ids=["greedy", "T=1", "filters"])
def test_verification_commits_the_tokens_plain_sampling_draws(params):
    """Drafts that copy plain sampling's tokens up to a chosen position and then differ: the
    accepted length is that position and the bonus is plain sampling's token there."""
    g = torch.Generator().manual_seed(1)
    b, k = 64, 5
    logits = torch.randn(b, k + 1, V, generator=g) * 2
    keys = [SampleKey(9, 4, i) for i in range(b)]
    plain = torch.stack([sample(logits[:, i], params, keys, [START + i] * b) for i in range(k + 1)], 1)  # (B, K+1)
    cut = torch.randint(0, k + 1, (b,), generator=g)  # where each draft first differs (k: never)
    lengths = torch.randint(1, k + 1, (b,), generator=g)
    drafts = plain[:, :k].clone()
    for row in range(b):
        if cut[row] < k:
            drafts[row, cut[row]] = (plain[row, cut[row]] + 1) % V
    accepted, bonus = verify(logits, drafts, lengths, params, keys, [START] * b)
    expect = torch.minimum(cut, lengths)
    assert torch.equal(accepted, expect)
    assert torch.equal(bonus, plain[torch.arange(b), expect])

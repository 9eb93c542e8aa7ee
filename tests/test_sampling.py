"""Sampling filters as tables, seeded determinism, and the sampled distribution."""

import pytest
import torch

from kvforge.sampling import SamplingParams, probabilities, sample

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=1.0), [0.5, 0.3, 0.15, 0.05]),
        (SamplingParams(temperature=1.0, top_k=2), [0.625, 0.375, 0.0, 0.0]),
        (SamplingParams(temperature=1.0, top_p=0.8), [0.625, 0.375, 0.0, 0.0]),
        (SamplingParams(temperature=1.0, top_p=0.81), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (SamplingParams(temperature=1.0, top_p=0.1), [1.0, 0.0, 0.0, 0.0]),
        (SamplingParams(temperature=0.0), [1.0, 0.0, 0.0, 0.0]),
    ],
)
def test_probability_filters(params, expected):
    assert torch.allclose(probabilities(LOGITS, params)[0], torch.tensor(expected), atol=1e-6)


def test_temperature_sharpens():
    p = probabilities(LOGITS, SamplingParams(temperature=0.5))[0]
    expect = torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 2
    assert torch.allclose(p, expect / expect.sum(), atol=1e-6)


def test_invalid_settings_are_rejected():
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_seed_makes_sampling_repeatable():
    params = SamplingParams(temperature=1.0, seed=7)
    a = [sample(LOGITS, params, g).item() for g in [params.generator()] for _ in range(20)]
    b = [sample(LOGITS, params, g).item() for g in [params.generator()] for _ in range(20)]
    assert a == b


def test_sampled_frequencies_follow_the_distribution():
    params = SamplingParams(temperature=1.0, seed=0)
    g = params.generator()
    draws = torch.stack([sample(LOGITS.expand(1000, 4), params, g) for _ in range(20)]).flatten()
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    # 20,000 draws: 4 standard errors of the largest cell is about 0.014
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015)

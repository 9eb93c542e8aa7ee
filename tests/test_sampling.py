"""Sampling filters as tables, keyed determinism, and the sampled distribution."""

import pytest
import torch

from kvforge.sampling import SampleKey, SamplingParams, prompt_key, probabilities, sample, sample_keys

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


def test_a_key_and_position_name_one_token_whatever_the_batch():
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    keys = [SampleKey(7, 11, i) for i in range(6)]
    batch = sample(logits, params, keys, range(40, 46)).tolist()
    alone = [sample(logits[i : i + 1], params, keys[i : i + 1], [40 + i]).item() for i in range(6)]
    assert batch == alone == sample(logits, params, keys, range(40, 46)).tolist()


@pytest.mark.parametrize("other", [SampleKey(8, 11, 0), SampleKey(7, 12, 0), SampleKey(7, 11, 1), SampleKey(7, 11, 0, 1)],
                         ids=["seed", "request", "index", "epoch"])
def test_each_part_of_the_key_changes_the_noise(other):
    key = SampleKey(7, 11, 0)
    assert not torch.equal(key.noise(3, 64), other.noise(3, 64))
    assert not torch.equal(key.noise(3, 64), key.noise(4, 64))  # and the position
    assert torch.equal(key.noise(3, 64), SampleKey(7, 11, 0).noise(3, 64))


def test_keys_of_a_batch_name_repeats_of_a_prompt_apart():
    keys = sample_keys([[1, 2], [3], [1, 2]], seed=5)
    assert [k.index for k in keys] == [0, 0, 1] and keys[0].request == keys[2].request == prompt_key([1, 2]) != keys[1].request
    assert {k.seed for k in keys} == {5}
    assert sample_keys([[1]], None)[0].seed != sample_keys([[1]], None)[0].seed  # no seed: a fresh one
    assert [k.epoch for k in sample_keys([[1], [1]], 5, epoch=3)] == [3, 3]


def test_sampled_frequencies_follow_the_distribution():
    params = SamplingParams(temperature=1.0)
    keys = [SampleKey(0, 1, i) for i in range(20_000)]
    draws = sample(LOGITS.expand(len(keys), 4), params, keys, [9] * len(keys))
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    # 20,000 draws: 4 standard errors of the largest cell is about 0.014
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.015)

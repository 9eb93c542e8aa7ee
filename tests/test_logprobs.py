"""Log-probabilities of committed tokens: what `token_logprobs` reports, that drafting commits
plain decoding's log-probabilities position by position (greedy and seeded sampling), and what
`kvforge rollout` writes."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_loaded
from kvforge.cli import app
from kvforge.engine import Engine
from kvforge.generation import GenerationConfig
from kvforge.sampling import SamplingParams, probabilities, token_logprobs
from kvforge.speculative.rollout import DraftConfig, generate_group

# fp32: a verification forward over k+1 rows and a one-row decode step round a logit apart by
# ~1e-6 (7e-7 measured on the tiny model's log-probabilities); 1e-5 leaves room and still fails
# a log-probability read off the wrong row or the wrong distribution, which moves it by > 0.1.
TOL = 1e-5
LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_loaded("llama"))


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(3, 9, (40,), generator=torch.Generator().manual_seed(4)).tolist()  # a small alphabet: drafts hit


@pytest.mark.parametrize(
    "params, token, sampling, model",
    [
        (SamplingParams(temperature=1.0), 1, math.log(0.3), math.log(0.3)),  # temperature 1, no filter: the same
        (SamplingParams(temperature=1.0, top_p=0.8), 1, math.log(0.375), math.log(0.3)),  # renormalised over the top-p set
        (SamplingParams(temperature=1.0, top_p=0.8), 2, -math.inf, math.log(0.15)),  # outside the top-p set
        (SamplingParams(temperature=0.5), 0, math.log(0.25 / 0.365), math.log(0.5)),  # p^2 renormalised
        (SamplingParams(), 0, 0.0, math.log(0.5)),  # greedy: drawn from a one-hot
    ],
)
def test_token_logprobs_under_the_sampling_and_the_model_distribution(params, token, sampling, model):
    (lp,) = token_logprobs(LOGITS, [token], params, top=2)
    assert lp.token == token and lp.sampling == pytest.approx(sampling, abs=1e-6) and lp.model == pytest.approx(model, abs=1e-6)
    assert [t for t, _ in lp.top] == [0, 1] and lp.top[0][1] == pytest.approx(math.log(0.5), abs=1e-6)
    (ranked,) = token_logprobs(LOGITS, [token], params, top=2, top_of="sampling")
    assert [v for _, v in ranked.top] == pytest.approx(probabilities(LOGITS, params)[0, :2].log().tolist(), abs=1e-6)


def test_a_tiny_temperature_or_top_p_stays_a_distribution():
    """Below float32's resolution the filters used to leave nan (a 500 in the server)."""
    for params in (SamplingParams(temperature=1e-300), SamplingParams(temperature=1.0, top_p=1e-300)):
        p = probabilities(LOGITS, params)
        assert torch.equal(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def _one_row_decoding(engine, prompt, tokens, params):
    """What plain decoding computes for `tokens`: prefill, then one-token decode steps, each
    token's log-probabilities read off the logits it was chosen from."""
    logits, cache = engine.prefill([prompt])
    out = []
    for t in tokens:
        out += token_logprobs(logits, [t], params)
        logits = engine.decode_step(torch.tensor([t]), cache)
    return out


def _assert_close(got, expected):
    assert len(got) == len(expected)
    for position, (a, b) in enumerate(zip(got, expected)):
        assert a.token == b.token, position
        assert abs(a.model - b.model) < TOL and abs(a.sampling - b.sampling) < TOL, (position, a, b)


def test_plain_decoding_records_what_one_row_steps_compute(engine, prompt):
    config = GenerationConfig(max_new_tokens=30, temperature=0.7, top_p=0.9, seed=2, ignore_eos=True, logprobs=True)
    out = engine.generate(prompt, config)[0]
    _assert_close(out.logprobs, _one_row_decoding(engine, prompt, out.token_ids, config.sampling))
    assert all(abs(lp.sampling - lp.model) > 1e-3 for lp in out.logprobs)  # two distributions, both recorded


def test_greedy_drafted_logprobs_equal_plain_decodings_position_by_position(engine, prompt):
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True, logprobs=True, top_logprobs=3)
    plain = engine.generate([prompt] * 3, config)
    drafted, stats = generate_group(engine, prompt, 3, config, DraftConfig("ngram", k=4, gate=False))
    assert stats.accepted > 0  # committed tokens came out of verification rows, not only bonus rows
    for p, d in zip(plain, drafted):
        assert d.token_ids == p.token_ids
        _assert_close(d.logprobs, p.logprobs)
        assert all(lp.sampling == 0.0 for lp in d.logprobs)  # greedy: drawn from a one-hot
        for a, b in zip(d.logprobs, p.logprobs):
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and a.top[0][0] == a.token
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < TOL


def test_seeded_sampling_drafted_logprobs_equal_plain_decodings_at_the_same_positions(engine, prompt):
    """Drafted sampling commits other tokens than plain sampling with the same seed (the draws
    differ), so each drafted sample is compared with plain decoding's computation on its own
    tokens. Temperature 0.3 makes drafts both accepted and rejected: tokens come from accepted
    draft rows, bonus rows after a full accept, and resampled bonus rows after a rejection,
    whose log-probability is still under the sampling distribution, not the residual."""
    config = GenerationConfig(max_new_tokens=40, temperature=0.3, seed=3, ignore_eos=True, logprobs=True)
    drafted, stats = generate_group(engine, prompt, 4, config, DraftConfig("ngram", k=4, gate=False))
    assert 0 < stats.accepted < stats.drafted and stats.accept_hist[0] > 0
    for d in drafted:
        _assert_close(d.logprobs, _one_row_decoding(engine, prompt, d.token_ids, config.sampling))
        assert all(lp.sampling > -math.inf and lp.sampling != lp.model for lp in d.logprobs)


def test_rollout_writes_sampling_and_model_logprobs(tiny_model_dir, tmp_path):
    from kvforge.models import load_model

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abcabcabc\nhello hello\n")
    out = tmp_path / "rollouts.jsonl"
    args = ["rollout", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--no-chat", "-G", "2", "-n", "12", "--temperature", "0.7",
            "--top-p", "0.9", "--seed", "5", "--draft", "ngram", "--k", "4", "--no-gate", "--dtype", "fp32", "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args + ["--model-logprobs"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 4
    engine = Engine(load_model(str(tiny_model_dir), dtype="fp32"))
    params = SamplingParams(temperature=0.7, top_p=0.9)
    for line in lines:
        ids = engine.model.tokenizer(["abcabcabc", "hello hello"][line["prompt_index"]]).input_ids
        expected = _one_row_decoding(engine, ids, line["token_ids"], params)
        assert len(line["sampling_logprobs"]) == len(line["model_logprobs"]) == len(line["token_ids"])
        assert line["sampling_logprobs"] == pytest.approx([e.sampling for e in expected], abs=TOL)
        assert line["model_logprobs"] == pytest.approx([e.model for e in expected], abs=TOL)
    result = CliRunner().invoke(app, args)  # without the flag: the sampling distribution's only
    assert result.exit_code == 0, result.output
    line = json.loads(out.read_text().splitlines()[0])
    assert "model_logprobs" not in line and len(line["sampling_logprobs"]) == len(line["token_ids"])

"""Slow test on the packaged smollm2-135m: SPEED's cache at the default cut, and teacher-forced
reply scoring on a real held-out conversation."""

import itertools

import pytest
import torch

from kvforge.data.prompts import held_out_text_tokens
from kvforge.data.replies import reply_samples
from kvforge.engine import Engine
from kvforge.fill.speed import DEFAULT_CUT, SpeedConfig, resolve_cut, speed_plan
from kvforge.fill.speed_fit import reply_nll, sample_plan

pytestmark = pytest.mark.slow


def test_speed_cache_on_a_real_prompt_holds_the_prompt_only_below_the_cut(real_model):
    engine = Engine(real_model)
    cut = resolve_cut(DEFAULT_CUT, engine.num_layers)
    assert cut == 22  # floor(0.75 * 30)
    prompt = held_out_text_tokens(engine.model.tokenizer, 600)
    logits, cache = engine.prefill([prompt], plan=speed_plan(len(prompt), SpeedConfig(cut), engine.num_layers))
    assert cache.lengths() == [600] * cut + [1 + 64] * (engine.num_layers - cut)  # BoS anchor + the default tail
    exact_logits, exact_cache = engine.prefill([prompt])
    full_rows = 65 / 600
    expected = 1 - (cut + (engine.num_layers - cut) * full_rows) / engine.num_layers
    assert abs((1 - cache.nbytes / exact_cache.nbytes) - expected) < 1e-9
    # the first token's distribution moves but stays a distribution over the same vocabulary
    assert torch.isfinite(logits).all() and not torch.equal(logits, exact_logits)


def _inference_nll(engine, sample, speed: SpeedConfig) -> torch.Tensor:
    """(R,) nats of each reply token as inference computes them: the prompt prefilled under SPEED
    (through `run_plan`), then the reply continuing that cache on the exact path."""
    p = sample.prompt_tokens
    prompt, reply = sample.ids[:p], sample.ids[p:]
    first, cache = engine.prefill([prompt], plan=speed_plan(p, speed, engine.num_layers), exact_shortcut=False)
    logits = [first]
    if len(reply) > 1:
        logits.append(engine.prefill([reply[:-1]], cache=cache, logits="all")[0][0])
    return torch.nn.functional.cross_entropy(torch.cat(logits), torch.tensor(reply), reduction="none")


def test_reply_scoring_of_a_real_conversation_matches_exact_and_inference(real_model):
    """Teacher-forced scoring (one `run_plan` over prompt + reply, what SPEED trains on) is the
    exact model's at full depth, and at the default cut equals what SPEED inference computes."""
    engine = Engine(real_model)
    cut = resolve_cut(DEFAULT_CUT, engine.num_layers)
    sample = next(itertools.islice(reply_samples(engine.model.tokenizer, "held_out", 512), 1))
    with torch.inference_mode():
        full_depth = reply_nll(engine, sample, sample_plan(engine, sample, SpeedConfig(engine.num_layers)))
        shallow = reply_nll(engine, sample, sample_plan(engine, sample, SpeedConfig(cut)))
        shallow_inference = _inference_nll(engine, sample, SpeedConfig(cut))
        # the exact model: one plain forward over the whole conversation
        logits = engine.prefill([sample.ids], logits="all")[0][0, sample.prompt_tokens - 1 : -1]
    reference = torch.nn.functional.cross_entropy(logits, torch.tensor(sample.ids[sample.prompt_tokens :]), reduction="none")
    assert (full_depth - reference).abs().max() < 1e-4
    assert (shallow - shallow_inference).abs().max() < 1e-4
    assert (shallow - reference).abs().max() > 1e-3  # and the cut does move the scores

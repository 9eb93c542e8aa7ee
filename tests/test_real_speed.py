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
    assert cache.lengths() == [600] * cut + [2] * (engine.num_layers - cut)  # BoS anchor + last row
    exact_logits, exact_cache = engine.prefill([prompt])
    full_rows = 2 / 600
    expected = 1 - (cut + (engine.num_layers - cut) * full_rows) / engine.num_layers
    assert abs((1 - cache.nbytes / exact_cache.nbytes) - expected) < 1e-9
    # the first token's distribution moves but stays a distribution over the same vocabulary
    assert torch.isfinite(logits).all() and not torch.equal(logits, exact_logits)


def test_reply_scoring_of_a_real_conversation_matches_exact_at_full_depth(real_model):
    engine = Engine(real_model)
    sample = next(itertools.islice(reply_samples(engine.model.tokenizer, "held_out", 512), 1))
    with torch.inference_mode():
        exact = reply_nll(engine, sample, sample_plan(engine, sample, None))
        full_cut = reply_nll(engine, sample, sample_plan(engine, sample, SpeedConfig(engine.num_layers)))
        shallow = reply_nll(engine, sample, sample_plan(engine, sample, SpeedConfig(22)))
        # exact scoring equals one plain forward over the whole conversation
        logits = engine.prefill([sample.ids], logits="all")[0][0, sample.prompt_tokens - 1 : -1]
    reference = torch.nn.functional.cross_entropy(logits, torch.tensor(sample.ids[sample.prompt_tokens :]), reduction="none")
    assert (exact - reference).abs().max() < 1e-4
    assert torch.equal(full_cut, exact)
    assert shallow.shape == exact.shape and torch.isfinite(shallow).all() and not torch.equal(shallow, exact)

"""Slow test on the packaged smollm2-135m: maps fitted on real chat text beat the identity fill."""

import pytest
import torch

from kvforge.cache import RowKind
from kvforge.data.prompts import held_out_text_tokens, token_sequences
from kvforge.engine import Engine
from kvforge.fill.calibrate import CalibrationConfig, fit_ridgefill
from kvforge.fill.ridgefill import RidgeFillConfig, ridgefill_plan

pytestmark = pytest.mark.slow


def test_fitted_maps_predict_late_inputs_and_beat_the_identity_fill(real_model):
    engine = Engine(real_model)
    split = 20
    fit = token_sequences(engine.model.tokenizer, 512, "fit")
    sequences = [next(fit) for _ in range(20)]
    config = CalibrationConfig(splits=(split,), tokens=20 * 508, seq_len=512)
    maps = fit_ridgefill(engine, config, engine.model.name, sequences=sequences)
    r2 = maps.info["splits"][str(split)]["r2"]
    assert r2[str(split + 1)] > 0.5 and all(0 < v < 1 for v in r2.values())

    prompt = held_out_text_tokens(engine.model.tokenizer, 768)
    exact = engine.prefill([prompt])[0].log_softmax(-1)
    kl = {}
    for fill in ("ridge", "identity"):
        plan = ridgefill_plan(engine, prompt, RidgeFillConfig(split=split, tail=32, fill=fill), maps)
        logits, cache = engine.prefill([prompt], plan=plan)
        kl[fill] = float(torch.nn.functional.kl_div(logits.log_softmax(-1), exact, log_target=True, reduction="sum"))
        assert int((cache[split].row_kinds() == RowKind.FILLED).sum()) == int((plan.depth < engine.num_layers).sum())
    assert kl["ridge"] < kl["identity"]

"""Slow test on the packaged pair (gemma3-270m → smollm2-135m: cross-tokenizer, cross-depth): a
small closed-form translator fitted here beats the zero translator on held-out text, and a
hand-off generates."""

import pytest

from kvforge.engine import Engine
from kvforge.evaluate.lingo import LingoEvalSettings, eval_lingo
from kvforge.models import load_model
from kvforge.translate.fit import LingoFitConfig, fit_lingo
from kvforge.translate.handoff import hand_off

pytestmark = pytest.mark.slow


def test_small_translator_beats_zero_maps_and_hands_off(real_model):
    target, source = Engine(real_model), Engine(load_model("gemma3-270m", dtype="fp32"))
    # Source rows alone: 4 conversations (~3K rows) are too few for the 2 x 576 own-token inputs as
    # well (unregularised, they then score worse than zero maps; docs/lingo.md).
    translator = fit_lingo(source, target, LingoFitConfig(assign="depth", nu=1, conversations=4, max_chars=2000, own_tokens=0))
    assert [chosen[0] for chosen in translator.sources["k"]][:3] == [0, 1, 1]  # c(ℓ) = ℓ · 17/29, rounded
    report = eval_lingo(translator, source, target, LingoEvalSettings(samples=2, prefix_chars=800, continuation_chars=200))
    assert report["bpb_target_translated"] < report["bpb_target_zero"]
    assert report["kl"] < report["kl_zero"]
    h = hand_off(translator, source, target, "The Eiffel Tower is in Paris. It was built in 1889 and it is")
    assert h.cache.lengths()[0] == len(h.target_ids) - 1
    assert target.generate([h.pending], cache=h.cache)[0].token_ids

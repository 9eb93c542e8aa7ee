"""`kvforge eval ridgefill` on a tiny model: the report's figures, the needle arms, and a memo
that a sweep can share without reading stale results."""

import math
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import char_tokenizer, tiny_config
from kvforge.engine import Engine
from kvforge.evaluate.ridgefill import EvalSettings, eval_ridgefill, summary
from kvforge.fill.calibrate import CalibrationConfig, fit_ridgefill
from kvforge.fill.rescue import RescueConfig
from kvforge.fill.ridgefill import RidgeFillConfig
from kvforge.models.adapters import adapter_for
from kvforge.models.loading import LoadedModel

SETTINGS = EvalSettings(samples=2, prompt_tokens=64, continuation=12, needles=2, needle_tokens=120, needle_depths=(0.2, 0.6))
CONFIG = RidgeFillConfig(split=2, tail=16, attended_rows=2, attended_span=2)


def _engine(seed=0) -> Engine:
    """A tiny llama with room for a needle haystack in characters."""
    config = tiny_config("llama")
    config.max_position_embeddings = 1024
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.eval()
    return Engine(LoadedModel(f"tiny-llama-{seed}", "test", model, char_tokenizer(), adapter_for(model), torch.device("cpu"), torch.float32))


def _same(a: dict, b: dict) -> bool:
    """Equal arm reports, NaN equal to NaN (no key tokens in random text)."""
    return a.keys() == b.keys() and all(
        x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)) or (isinstance(x, list) and _same(dict(enumerate(x)), dict(enumerate(y))))
        for x, y in ((a[k], b[k]) for k in a)
    )


@pytest.fixture(scope="module")
def setup():
    engine = _engine()
    sequences = [torch.randint(3, 97, (48,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(20)]
    maps = fit_ridgefill(engine, CalibrationConfig(splits=(2,), tokens=20 * 44, seq_len=48, lam=1e-6), engine.model.name, sequences=sequences)
    memo: dict = {}
    return engine, maps, memo, eval_ridgefill(engine, maps, CONFIG, SETTINGS, memo=memo)


def test_the_all_token_gap_and_its_interval_sit_beside_the_novel_one(setup):
    engine, _, _, report = setup
    arms = report["arms"]
    for name in ("ridgefill", "identity", "splice_filled_keys", "splice_filled_values"):
        a = arms[name]
        assert math.isclose(a["ppl_gap_all_pct"], 100 * (math.exp(a["all_nll"] - arms["exact"]["all_nll"]) - 1), rel_tol=1e-9, abs_tol=1e-9)
        low, high = a["ppl_gap_all_ci"]
        assert low <= high
    assert report["all_tokens"] == SETTINGS.samples * SETTINGS.continuation
    out = summary(report, "tiny", CONFIG, SETTINGS.prompt_tokens)
    assert out["ppl_gap_all_pct"] == arms["ridgefill"]["ppl_gap_all_pct"] and out["ppl_gap_all_ci"] == arms["ridgefill"]["ppl_gap_all_ci"]
    assert out["identity_ppl_gap_all_pct"] == arms["identity"]["ppl_gap_all_pct"] and len(out["identity_ppl_gap_all_ci"]) == 2


def test_the_decode_time_rescue_is_scored_beside_the_same_prefill_without_it(setup):
    engine, maps, _, report = setup
    arms, rescue = report["arms"], report["rescue"]
    assert {"ridgefill", "ridgefill_no_rescue"} <= arms.keys()
    assert rescue["ngram"] == CONFIG.rescue.ngram and 0 <= rescue["share_of_filled"] <= 1
    out = summary(report, "tiny", CONFIG, SETTINGS.prompt_tokens)
    assert out["rescue"] == rescue and out["no_rescue_ppl_gap_all_pct"] == arms["ridgefill_no_rescue"]["ppl_gap_all_pct"]
    off = eval_ridgefill(engine, maps, replace(CONFIG, rescue=None), replace(SETTINGS, needles=0))
    assert "ridgefill_no_rescue" not in off["arms"] and "rescue" not in off
    # without the rescue the plain arm is what the rescued run scored beside it
    assert _same(off["arms"]["ridgefill"], arms["ridgefill_no_rescue"])
    if rescue["rows_per_sample"] == 0:
        assert _same(arms["ridgefill"], arms["ridgefill_no_rescue"])
    # a one-token trigger rescues rows in random text, and the rescued arm then scores differently
    eager = eval_ridgefill(engine, maps, replace(CONFIG, rescue=RescueConfig(ngram=1, window=4)), replace(SETTINGS, needles=0))
    assert eager["rescue"]["rows_per_sample"] > 0 and eager["rescue"]["events_per_sample"] > 0
    assert eager["arms"]["ridgefill"]["all_nll"] != eager["arms"]["ridgefill_no_rescue"]["all_nll"]
    assert _same(eager["arms"]["ridgefill_no_rescue"], arms["ridgefill_no_rescue"])  # the same prefill without it


def test_needles_are_reported_per_arm_among_those_really_filled(setup):
    _, _, _, report = setup
    needle = report["needle"]
    arms = ("ridgefill", "identity", "ridgefill_no_attended", "ridgefill_no_rescue")
    assert set(needle["filled"]) == set(arms) and needle["needle_filled"] == needle["filled"]["ridgefill"]
    # Without the attended-row rescue every needle before the tail is wholly in filled rows.
    assert needle["filled"]["ridgefill_no_attended"] == SETTINGS.needles
    for arm in arms:
        assert 0 <= needle["answered_in_filled"][arm] <= needle["filled"][arm] <= SETTINGS.needles
        expected = 100 * needle["answered_in_filled"][arm] / needle["filled"][arm] if needle["filled"][arm] else None
        assert needle["in_filled_pct"][arm] == expected
    out = summary(report, "tiny", CONFIG, SETTINGS.prompt_tokens)
    assert out["needle_ridgefill_no_attended"] == needle["ridgefill_no_attended"]
    assert set(out["needle_by_arm"]) == set(arms)
    assert out["needle_by_arm"]["ridgefill_no_attended"]["filled"] == SETTINGS.needles


def test_the_memo_is_reused_only_where_nothing_that_changes_the_result_changed(setup):
    engine, maps, memo, report = setup
    before = dict(memo)
    again = eval_ridgefill(engine, maps, replace(CONFIG, attended_rows=0), SETTINGS, memo=memo)
    assert memo.keys() == before.keys() and all(memo[k] is before[k] for k in before)  # same prompts, same model: reused
    assert _same(again["arms"]["exact"], report["arms"]["exact"])
    # Another prompt length: new entries, and the exact arm equals a run without any memo.
    longer = replace(SETTINGS, prompt_tokens=80, needles=0)
    shared = eval_ridgefill(engine, maps, CONFIG, longer, memo=memo)
    fresh = eval_ridgefill(engine, maps, CONFIG, longer)
    assert len(memo) > len(before)
    assert _same(shared["arms"]["exact"], fresh["arms"]["exact"]) and _same(shared["arms"]["ridgefill"], fresh["arms"]["ridgefill"])
    # Another model on the same prompts: nothing of the first model's is read.
    other = _engine(seed=1)
    other_maps = fit_ridgefill(other, CalibrationConfig(splits=(2,), tokens=20 * 44, seq_len=48, lam=1e-6), other.model.name,
                               sequences=[torch.randint(3, 97, (48,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(20)])
    size = len(memo)
    mixed = eval_ridgefill(other, other_maps, CONFIG, replace(SETTINGS, needles=0), memo=memo)
    assert len(memo) == size + SETTINGS.samples
    assert _same(mixed["arms"]["exact"], eval_ridgefill(other, other_maps, CONFIG, replace(SETTINGS, needles=0))["arms"]["exact"])


def test_the_cli_json_carries_the_new_figures(tiny_model_dir, tmp_path, monkeypatch):
    import functools
    import json

    from typer.testing import CliRunner

    import kvforge.evaluate.ridgefill as module
    from kvforge.cli import app

    run = lambda *args: CliRunner().invoke(app, [str(a) for a in args])  # noqa: E731
    maps = tmp_path / "maps.safetensors"
    assert run("fit", "ridgefill", "--model", tiny_model_dir, "--split", 2, "--calib-tokens", 700, "--seq-len", 64, "--out", maps).exit_code == 0
    # Haystacks short enough for the tiny model's 256-position context.
    monkeypatch.setattr(module, "EvalSettings", functools.partial(EvalSettings, continuation=8, needle_tokens=10))
    common = ("eval", "ridgefill", "--model", tiny_model_dir, "--maps", maps, "--split", 2, "--tail", 8, "--samples", 2, "--needles", 1, "--prompt-tokens", 48)
    result = run(*common, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"ppl_gap_all_pct", "ppl_gap_all_ci", "identity_ppl_gap_all_pct", "identity_ppl_gap_all_ci", "needle_ridgefill_no_attended", "needle_by_arm"} <= set(out)
    assert set(out["needle_by_arm"]) == {"ridgefill", "identity", "ridgefill_no_attended", "ridgefill_no_rescue"} and out["all_tokens"] == 16
    table = run(*common)
    assert table.exit_code == 0 and "ridgefill_no_attended" in table.stdout and "wholly filled answered" in table.stdout


def test_a_hybrid_reports_filled_kv_under_the_exact_recurrent_states():
    """qwen3_5 tiny (layers 0-2 Gated DeltaNet, 3 full attention), split 1: layer 2's state is
    updated from predicted inputs and layer 3's K/V are filled. The third splice arm takes RidgeFill's cache with every recurrent
    state from the exact cache, so it is neither of the two caches it is made of."""
    from conftest import tiny_loaded
    from kvforge.cache import RecurrentLayerCache
    from kvforge.evaluate.ridgefill import _prefill, _with_states_of
    from kvforge.fill.ridgefill import ridgefill_plan

    engine = Engine(tiny_loaded("qwen3_5"))
    sequences = [torch.randint(3, 97, (48,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(20)]
    maps = fit_ridgefill(engine, CalibrationConfig(splits=(1,), tokens=20 * 44, seq_len=48, lam=1e-6), engine.model.name, sequences=sequences)
    config = replace(CONFIG, split=1, attended_rows=0)  # no attention layer below the split to read attended rows from
    prompt = sequences[0][:40]
    exact, ridge = _prefill(engine, prompt, None), _prefill(engine, prompt, ridgefill_plan(engine, prompt, config, maps))
    spliced = _with_states_of(exact, ridge)
    assert isinstance(spliced[2], RecurrentLayerCache) and not torch.equal(exact[2].state, ridge[2].state)
    assert torch.equal(spliced[2].state, exact[2].state) and torch.equal(spliced[2].conv, exact[2].conv)
    assert torch.equal(spliced[3].keys(), ridge[3].keys()) and not torch.equal(spliced[3].keys(), exact[3].keys())

    report = eval_ridgefill(engine, maps, config, replace(SETTINGS, needles=0))
    arms = report["arms"]
    assert math.isfinite(arms["splice_exact_state"]["all_nll"])
    assert arms["splice_exact_state"]["all_nll"] not in (arms["ridgefill"]["all_nll"], arms["exact"]["all_nll"])
    out = summary(report, "tiny", config, SETTINGS.prompt_tokens)
    assert out["splice"]["filled_kv_exact_recurrent_state"] == arms["splice_exact_state"]

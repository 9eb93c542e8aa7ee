"""PrefillPlan: exact, filled and absent rows through one engine loop."""

import pytest
import torch

from conftest import tiny_loaded
from kvforge.cache import RecurrentLayerCache, RowKind
from kvforge.engine import Engine
from kvforge.plan import PrefillPlan

T = 24
TOL = 1e-4


def _ids(seed=0):
    return torch.randint(3, 97, (1, T), generator=torch.Generator().manual_seed(seed))


def _layer_inputs(engine, ids):
    """The residual stream entering every layer, from an exact run: list of (1, T, E)."""
    cache = engine.new_cache()
    positions = torch.arange(T).unsqueeze(0)
    inputs = []
    with torch.inference_mode():
        h = engine.adapter.embed(ids)
        rope = engine.adapter.rope(h, positions)
        for layer in range(engine.num_layers):
            inputs.append(h.clone())
            h = engine.run_layer(layer, h, positions, cache, rope)
    return inputs


def _depth(split, shallow):
    depth = torch.full((T,), 4, dtype=torch.long)
    depth[shallow] = split
    return depth


def test_plan_with_every_row_full_depth_is_exact(family):
    engine = Engine(tiny_loaded(family))
    ids = _ids()
    exact, exact_cache = engine.prefill(ids)
    plan = PrefillPlan.exact(T, engine.num_layers)
    with torch.inference_mode():
        h, _ = engine.run_plan(*engine.pad_batch(ids), engine.new_cache(), plan)
        logits = engine.adapter.head(h[:, -1]).float()
    assert (logits - exact).abs().max() < TOL
    assert plan.is_exact(engine.num_layers)


def test_filling_with_the_true_inputs_reproduces_exact_prefill(family):
    """An oracle filler (the exact input of each layer) makes filled rows' K/V exact, so the
    whole prefill equals exact: the fill machinery adds no error of its own."""
    engine = Engine(tiny_loaded(family))
    ids = _ids(1)
    inputs = _layer_inputs(engine, ids)
    depth = _depth(2, slice(2, T - 3))  # rows 2..T-4 filled above layer 2
    oracle = lambda layer, h, rows: inputs[layer][:, rows]  # noqa: E731
    logits, cache = engine.prefill(ids, plan=PrefillPlan(depth, oracle, "oracle"))
    exact, exact_cache = engine.prefill(ids)
    assert (logits - exact).abs().max() < TOL
    for layer in range(2, engine.num_layers):
        held = cache[layer].row_positions()[0]
        kinds = cache[layer].row_kinds()[0]
        window = engine.adapter.windows[layer]
        # on a sliding-window layer only filled rows the exact rows (from T-3 on) can see are written
        filled = [p for p in range(2, T - 3) if window is None or (T - 3) - p < window]
        assert held[kinds == RowKind.FILLED].tolist() == filled
        assert held.tolist() == sorted(held.tolist())  # position order
        if isinstance(cache[layer], RecurrentLayerCache):  # it saw every row, filled ones from their true input
            assert (cache[layer].state - exact_cache[layer].state).abs().max() < TOL
            assert (cache[layer].conv - exact_cache[layer].conv).abs().max() < TOL
            continue
        assert (cache[layer].keys() - exact_cache[layer].keys()[:, :, held]).abs().max() < TOL
        assert cache[layer].contiguous == (window is None)


def test_absent_rows_are_not_cached_above_their_depth_and_decode_continues(family):
    engine = Engine(tiny_loaded(family))
    ids = _ids(2)
    depth = _depth(3, slice(1, T - 2))  # keep row 0 (anchor) and the last two rows full depth
    logits, cache = engine.prefill(ids, plan=PrefillPlan(depth, None, "absent"))
    for layer in range(engine.num_layers):
        held = cache[layer].row_positions()[0].tolist()
        assert held == (list(range(T)) if layer < 3 else [0, T - 2, T - 1])
    exact_cache = engine.prefill(ids)[1]
    for layer in range(engine.num_layers):  # K/V bytes shrink with the rows held; a recurrent state is one size
        rows = T if layer < 3 or isinstance(cache[layer], RecurrentLayerCache) else 3
        assert cache[layer].nbytes() == exact_cache[layer].nbytes() * rows // T
    step = engine.decode_step(logits.argmax(-1), cache)
    assert torch.isfinite(step).all() and cache[3].row_positions()[0, -1] == T


def test_invalid_plans_are_rejected():
    engine = Engine(tiny_loaded("llama"))
    ids = _ids()
    bad_last = _depth(2, slice(5, T))
    with pytest.raises(ValueError, match="last prompt row"):
        engine.prefill(ids, plan=PrefillPlan(bad_last))
    with pytest.raises(ValueError, match="covers"):
        engine.prefill(ids, plan=PrefillPlan(torch.full((T - 1,), 2)))
    with pytest.raises(ValueError, match="one prompt"):
        engine.prefill([[5] * T, [6] * T], plan=PrefillPlan(_depth(2, slice(3, 6))))


def test_generate_with_an_oracle_plan_commits_the_exact_tokens():
    from kvforge.generation import GenerationConfig

    engine = Engine(tiny_loaded("qwen3"))
    ids = _ids(3)
    inputs = _layer_inputs(engine, ids)
    depth = _depth(1, slice(1, T - 4))
    oracle = lambda layer, h, rows: inputs[layer][:, rows]  # noqa: E731
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    planned = engine.generate(ids[0].tolist(), config, plan=PrefillPlan(depth, oracle, "oracle"))[0]
    assert planned.token_ids == engine.generate(ids[0].tolist(), config)[0].token_ids


def test_what_a_prefill_ran_is_read_off_the_cache(family):
    """final_depth and PrefillReport from the cache's row kinds: filled rows (RidgeFill), absent
    rows (SPEED), and a chooser's final choice, with no record kept on the plan or chooser."""
    from kvforge.plan import PrefillReport, final_depth

    engine = Engine(tiny_loaded(family))
    ids = _ids(5)
    inputs = _layer_inputs(engine, ids)
    oracle = lambda layer, h, rows: inputs[layer][:, rows]  # noqa: E731
    filled = PrefillPlan(_depth(2, slice(2, T - 3)), oracle, "ridgefill")
    _, cache = engine.prefill(ids, plan=filled)
    assert final_depth(cache, T).tolist() == _depth(2, slice(2, T - 3)).tolist()
    ran = PrefillReport.of(filled, cache, T)
    if all(w is None for w in engine.adapter.windows):
        assert (ran.prefill, ran.filled_rows, ran.shallow_rows, ran.reason) == ("ridgefill", T - 5, 0, None)
    else:  # a sliding layer leaves out the filled rows no exact row can read
        assert ran.prefill == "ridgefill" and ran.filled_rows + ran.shallow_rows == T - 5 and ran.filled_rows > 0
    absent = PrefillPlan(_depth(3, slice(1, T - 2)), None, "speed")
    ran = PrefillReport.of(absent, engine.prefill(ids, plan=absent)[1], T)
    assert (ran.prefill, ran.filled_rows, ran.shallow_rows) == ("speed", 0, T - 3)
    assert PrefillReport.planned(absent, T, engine.num_layers) == ran

    def keep_row_5(layer, h_before, positions, cache, depth):
        depth = depth.clone()
        depth[5] = engine.num_layers
        return depth

    chosen = PrefillPlan(_depth(2, slice(2, T - 3)), oracle, "ridgefill", keep_row_5)
    _, cache = engine.prefill(ids, plan=chosen)
    expected = _depth(2, slice(2, T - 3))
    expected[5] = engine.num_layers
    assert final_depth(cache, T).tolist() == expected.tolist()
    assert PrefillReport.planned(chosen, T, engine.num_layers).filled_rows is None  # the choice is made during the prefill


def test_a_method_whose_plan_ran_exact_reports_exact_with_the_reason():
    from kvforge.plan import PrefillReport

    engine = Engine(tiny_loaded("llama"))
    ids = _ids(6)
    everything = lambda layer, h_before, positions, cache, depth: torch.full_like(depth, engine.num_layers)  # noqa: E731
    plan = PrefillPlan(_depth(2, slice(2, T - 3)), lambda layer, h, rows: h[:, rows], "ridgefill", everything)
    ran = PrefillReport.of(plan, engine.prefill(ids, plan=plan)[1], T)
    assert ran.prefill == "exact" and ran.filled_rows == 0 and "ridgefill kept every row" in ran.reason
    short = PrefillPlan.exact(T, engine.num_layers, "the prompt is no longer than the exact rows")
    assert PrefillReport.of(short, engine.prefill(ids, plan=short)[1], T).reason == short.reason
    assert PrefillReport.of(None, engine.prefill(ids)[1], T) == PrefillReport("exact", T)

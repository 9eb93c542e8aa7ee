"""RidgeFill: plans, maps, calibration and the artifact, on tiny random models."""

import pytest
import torch
from safetensors import safe_open

from conftest import held, tiny_loaded
from kvforge.flops import exact_macs, prefill_macs
from kvforge.cache import RecurrentLayerCache, RowKind
from kvforge.engine import Engine
from kvforge.errors import ArtifactError
from kvforge.fill.calibrate import CalibrationConfig, fit_ridgefill, layer_inputs
from kvforge.fill.maps import INPUTS, RidgeMaps, map_key
from kvforge.fill.ridgefill import AttendedRows, RidgeFillConfig, exact_row_mask, parse_splits, preset, ridgefill_plan
from kvforge.plan import PrefillPlan, final_depth

T = 40
TOL = 1e-4


def _ids(seed=0, t=T):
    return torch.randint(3, 97, (t,), generator=torch.Generator().manual_seed(seed)).tolist()


def _random_sequences(count, length=48, seed=0):
    return [_ids(seed + i, length) for i in range(count)]


def _fit(engine, splits, **kw):
    config = CalibrationConfig(splits=tuple(splits), tokens=20 * 44, seq_len=48, lam=kw.pop("lam", 1e-6), **kw)
    return fit_ridgefill(engine, config, engine.model.name, sequences=_random_sequences(20))


def _zero_late_layers(engine, split):
    """Zero the attention and MLP outputs of layers >= split: every late input then equals h_split."""
    with torch.no_grad():
        for layer in engine.adapter.layers[split:]:
            mixer = layer.self_attn.o_proj if hasattr(layer, "self_attn") else layer.linear_attn.out_proj
            mixer.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def test_split_equal_to_depth_is_exact_bit_for_bit(family):
    """Through `run_plan` itself (prefill would otherwise take the exact path for this plan)."""
    engine = Engine(tiny_loaded(family))
    ids = _ids()
    plan = ridgefill_plan(engine, ids, RidgeFillConfig(split=engine.num_layers, tail=4, fill="identity"))
    assert plan.is_exact(engine.num_layers)
    planned, cache = engine.prefill([ids], plan=plan, exact_shortcut=False)
    exact, exact_cache = engine.prefill([ids])
    assert torch.equal(planned, exact)
    for a, b in zip(cache.layers, exact_cache.layers):
        assert all(torch.equal(x, y) for x, y in zip(held(a), held(b)))
        assert torch.equal(a.row_kinds(), b.row_kinds())


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen3_5"])
def test_fitted_maps_reproduce_exact_when_late_inputs_equal_the_split_state(family):
    engine = Engine(tiny_loaded(family, seed=1))
    split = 2
    _zero_late_layers(engine, split)
    maps = _fit(engine, [split], normed_target=False)  # the normed input is not linear in h_split: the input is
    assert maps.target == "input" and min(maps.info["splits"][str(split)]["r2"].values()) > 0.999
    ids = _ids(3)
    config = RidgeFillConfig(split=split, tail=6, sinks=2)
    plan = ridgefill_plan(engine, ids, config, maps)
    logits, cache = engine.prefill([ids], plan=plan)
    exact, exact_cache = engine.prefill([ids])
    assert (logits - exact).abs().max() < TOL
    for layer in range(split, engine.num_layers):
        if isinstance(cache[layer], RecurrentLayerCache):  # filled rows updated the state from their predicted input
            assert (cache[layer].state - exact_cache[layer].state).abs().max() < 1e-3
            continue
        held = cache[layer].row_positions()[0]
        assert (cache[layer].keys() - exact_cache[layer].keys()[:, :, held]).abs().max() < 1e-3
        assert (cache[layer].values() - exact_cache[layer].values()[:, :, held]).abs().max() < 1e-3


def test_filled_rows_are_recorded_and_decode_runs_the_full_model():
    engine = Engine(tiny_loaded("llama"))
    ids = _ids(4)
    plan = ridgefill_plan(engine, ids, RidgeFillConfig(split=2, tail=5, sinks=3, fill="identity"))
    logits, cache = engine.prefill([ids], plan=plan)
    for layer in range(engine.num_layers):
        kinds = cache[layer].row_kinds()[0]
        expected_filled = 0 if layer < 2 else T - 8
        assert int((kinds == RowKind.FILLED).sum()) == expected_filled
        assert cache[layer].row_positions()[0].tolist() == list(range(T))
    before = cache.lengths()
    step = engine.decode_step(logits.argmax(-1), cache)
    assert torch.isfinite(step).all()
    assert cache.lengths() == [n + 1 for n in before]
    assert all(int(layer.row_kinds()[0, -1]) == RowKind.EXACT for layer in cache.layers)


def _previous_row_maps(engine, split, target="input"):
    """Maps that predict every late (normed) input as the previous row's split state: W = [0; 2I], b = 1."""
    e, layers = engine.adapter.hidden_size, range(split + 1, engine.num_layers)
    w = torch.cat([torch.zeros(e, e), 2 * torch.eye(e)])
    tensors = {map_key(split, l, "weight"): w for l in layers} | {map_key(split, l, "bias"): torch.ones(e) for l in layers}
    return RidgeMaps(engine.num_layers, e, engine.model.fingerprint, engine.model.name, [split], False, {}, INPUTS, target, tensors)


class _PreviousRowOracle:
    """What `_previous_row_maps` should write, from the previous rows' split states of a separate
    exact run: for maps of the input, through the layer's own norm; for maps of the normed input,
    the prediction times the norm's gain through the K/V projection, not renormalised."""

    def __init__(self, engine, h_split, split, normed):
        self.a, self.h_split, self.split, self.normed = engine.adapter, h_split, split, normed

    def __call__(self, layer, h, rows):
        before = (rows.nonzero().squeeze(1) - 1).clamp(min=0)
        return self.h_split[:, rows] if layer == self.split else 2 * self.h_split[:, before] + 1

    def key_value(self, layer, h, rows, rope):
        if layer == self.split or not self.normed:
            return self.a.key_value(layer, self(layer, h, rows), rope)
        weight, bias = self.a.kv_weights(layer)
        return self.a.cache_rows(layer, torch.nn.functional.linear(self(layer, h, rows) * self.a.input_norm(layer)[0], weight, bias), rope)


@pytest.mark.parametrize("target", ["input", "normed_input"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_previous_row_maps_read_the_row_before_each_filled_row(family, target):
    """Against an oracle fill given the previous rows' split states from a separate exact run: a
    filled row after an exact one (a sink, an attended row) reads the exact row's split state.
    Maps of the normed input write the cache rows through their fold with the layer's norm gain
    and K/V projection (`fold_kv`); the oracle applies the gain and projection one after another."""
    engine = Engine(tiny_loaded(family, seed=2))
    with torch.no_grad():  # a norm gain that is not all ones, so the fold must carry it
        for layer in engine.adapter.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
    split, ids = 1, _ids(8)
    maps = _previous_row_maps(engine, split, target)
    config = RidgeFillConfig(split=split, tail=5, sinks=2, attended_rows=2, attended_span=1)
    plan = ridgefill_plan(engine, ids, config, maps)
    with torch.inference_mode():
        h_split = layer_inputs(engine, ids, split + 1)[split].unsqueeze(0)  # (1, T, E)
    oracle = _PreviousRowOracle(engine, h_split, split, normed=target == "normed_input")
    _, cache = engine.prefill([ids], plan=plan)
    _, expected = engine.prefill([ids], plan=PrefillPlan(plan.depth, oracle, "oracle", plan.choose, choose_at=plan.choose_at))
    kept = final_depth(cache, T) == engine.num_layers
    assert torch.equal(kept, final_depth(expected, T) == engine.num_layers) and int(kept.sum()) > 7  # sinks, tail and attended rows
    assert bool((~kept[1:] & kept[:-1]).any())  # some filled row follows an exact one
    for layer in range(split + 1, engine.num_layers):
        assert (cache[layer].keys() - expected[layer].keys()).abs().max() < TOL
        assert (cache[layer].values() - expected[layer].values()).abs().max() < TOL


def test_maps_of_the_split_state_alone_still_load_and_a_wrong_shape_is_refused(tmp_path):
    engine = Engine(tiny_loaded("llama"))
    alone = _fit(engine, [2], previous_row=False)
    assert alone.inputs == ("split",) and alone.weights(2, 3)[0].shape == (engine.adapter.hidden_size,) * 2
    both = _fit(engine, [2], normed_target=True)
    assert both.inputs == INPUTS and both.weights(2, 3)[0].shape == (2 * engine.adapter.hidden_size, engine.adapter.hidden_size)
    assert both.target == "normed_input"
    assert both.layer_bytes() > alone.layer_bytes()
    from safetensors.torch import load_file, save_file

    alone.save(tmp_path / "alone.safetensors")
    with safe_open(str(tmp_path / "alone.safetensors"), "pt") as f:
        meta = f.metadata()
    old = {k: v for k, v in meta.items() if k not in ("inputs", "target")}  # a file written before maps read the previous row
    save_file(load_file(tmp_path / "alone.safetensors"), tmp_path / "old.safetensors", old)
    loaded = RidgeMaps.load(tmp_path / "old.safetensors")
    assert loaded.inputs == ("split",) and loaded.target == "input"
    ids = _ids(9)
    config = RidgeFillConfig(split=2, tail=4)
    assert torch.equal(engine.prefill([ids], plan=ridgefill_plan(engine, ids, config, loaded))[0],
                       engine.prefill([ids], plan=ridgefill_plan(engine, ids, config, alone))[0])
    save_file(load_file(tmp_path / "alone.safetensors"), tmp_path / "wrong.safetensors", old | {"inputs": '["split", "previous"]'})
    with pytest.raises(ArtifactError, match="shape"):
        RidgeMaps.load(tmp_path / "wrong.safetensors")
    save_file(load_file(tmp_path / "alone.safetensors"), tmp_path / "target.safetensors", old | {"target": "keys"})
    with pytest.raises(ArtifactError, match="predicting 'keys'"):
        RidgeMaps.load(tmp_path / "target.safetensors")


def test_identity_fill_differs_from_exact_and_ridge_fill_needs_maps():
    engine = Engine(tiny_loaded("llama"))
    ids = _ids(5)
    identity = ridgefill_plan(engine, ids, RidgeFillConfig(split=1, tail=4, fill="identity"))
    assert not torch.allclose(engine.prefill([ids], plan=identity)[0], engine.prefill([ids])[0])
    with pytest.raises(ValueError, match="needs maps"):
        ridgefill_plan(engine, ids, RidgeFillConfig(split=1, tail=4))


def test_exact_rows_sinks_tail_specials_and_a_list():
    config = RidgeFillConfig(split=1, tail=3, sinks=2, rows=(7,))
    prompt = [5, 6, 1, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    mask = exact_row_mask(prompt, config, special_ids={1})
    assert mask.nonzero().flatten().tolist() == [0, 1, 2, 7, 9, 10, 11]
    with pytest.raises(ValueError, match="outside"):
        exact_row_mask(prompt, RidgeFillConfig(split=1, rows=(40,)), set())


def test_a_tail_longer_than_the_prompt_falls_back_to_exact():
    engine = Engine(tiny_loaded("llama"))
    plan = ridgefill_plan(engine, _ids(0, 10), RidgeFillConfig(split=1, tail=16, fill="identity"))
    assert plan.is_exact(engine.num_layers) and "no longer than" in plan.reason


def test_attended_rows_keep_exact_the_rows_the_tail_attends_to_and_those_after():
    engine = Engine(tiny_loaded("qwen2"))
    ids = _ids(6)
    chooser = AttendedRows(engine, count=3, tail=4, span=2)
    plan = ridgefill_plan(engine, ids, RidgeFillConfig(split=2, tail=4, sinks=2, fill="identity"))
    plan = type(plan)(plan.depth, plan.fill, plan.method, chooser)
    _, cache = engine.prefill([ids], plan=plan)
    before, after = plan.depth, final_depth(cache, T)
    assert bool((after[before == engine.num_layers] == engine.num_layers).all())
    # reference: the candidates with the largest attention weight from any tail query at layer 1
    cache = engine.new_cache()
    with torch.inference_mode():
        h = engine.adapter.embed(torch.tensor([ids]))
        pos = torch.arange(T).unsqueeze(0)
        rope = engine.adapter.rope(h, pos)
        h1 = engine.run_layer(0, h, pos, cache, rope)
        engine.run_layer(1, h1, pos, cache, rope)
        q = engine.adapter.attention_inputs(1, h1[:, -4:], engine.adapter.rope(h1[:, -4:], pos[:, -4:]))[0]
        k = cache[1].keys().repeat_interleave(2, dim=1)
        s = (q @ k.transpose(-1, -2)) * engine.adapter.scaling[1]
        s = s + torch.triu(torch.full((4, T), float("-inf")), diagonal=T - 4 + 1)
        weight = s.softmax(-1).amax((0, 1, 2)).clone()
    weight = weight.clone()
    weight[before == engine.num_layers] = -1
    expected = (before == engine.num_layers).clone()
    for anchor in weight.topk(3).indices.tolist():
        expected[anchor : anchor + 3] = True
    assert (after == engine.num_layers).tolist() == expected.tolist()


def test_attended_rows_are_read_from_the_last_global_layer_below_the_split(monkeypatch):
    """A sliding-window layer's tail queries cannot see a row more than a window back, so on a model
    with global layers (Gemma 3) the rows to keep exact are chosen from the last global layer below
    the split, and the chooser runs right after it; without one, from the layer below the split."""
    from kvforge.fill.ridgefill import attention_read_layer

    assert attention_read_layer([8, None, 8, 8, 8], 4) == 1
    assert attention_read_layer([None] * 6, 4) == 3
    assert attention_read_layer([8, 8, 8, None], 3) == 2  # no global layer below the split
    hybrid = [True, True, True, False] * 2  # three linear-attention layers to one full-attention layer
    assert attention_read_layer([None] * 8, 6, hybrid) == 3
    assert attention_read_layer([None] * 8, 3, hybrid) is None
    engine = Engine(tiny_loaded("gemma3"))
    engine.adapter.windows = [8, None, 8, 8]  # layer 1 global, the rest sliding (window 8 < T)
    called = []
    real = AttendedRows.__call__
    monkeypatch.setattr(AttendedRows, "__call__", lambda self, layer, *rest: called.append(layer) or real(self, layer, *rest))
    plan = ridgefill_plan(engine, _ids(3), RidgeFillConfig(split=3, tail=4, sinks=2, attended_rows=2, attended_span=1, fill="identity"))
    assert plan.choose_at == 2
    _, cache = engine.prefill([_ids(3)], plan=plan)
    assert called == [2]
    kept = final_depth(cache, T) == engine.num_layers
    assert int(kept.sum()) == int((plan.depth == engine.num_layers).sum()) + 4  # two anchors, one row after each


def test_maps_round_trip_resident_streamed_and_int8(tmp_path):
    engine = Engine(tiny_loaded("llama"))
    maps = _fit(engine, [1, 2])
    path = tmp_path / "maps.safetensors"
    maps.save(path)
    resident, streamed = RidgeMaps.load(path), RidgeMaps.load(path, streamed=True)
    assert resident.splits == [1, 2] and streamed.tensors is None
    for layer in (2, 3):
        w, b = maps.weights(1, layer)
        assert torch.equal(resident.weights(1, layer)[0], w) and torch.equal(streamed.weights(1, layer)[1], b)
    q = _fit(engine, [1], int8=True)
    report = q.info["splits"]["1"]
    assert max(report["int8_rel_error"].values()) < 0.02
    w_q, _ = q.weights(1, 2)
    assert (w_q - maps.weights(1, 2)[0]).norm() / maps.weights(1, 2)[0].norm() < 0.02
    q.save(tmp_path / "q.safetensors")
    assert RidgeMaps.load(tmp_path / "q.safetensors").int8


def test_maps_for_another_model_or_split_and_damaged_files_are_clear_errors(tmp_path):
    engine = Engine(tiny_loaded("llama"))
    path = tmp_path / "maps.safetensors"
    _fit(engine, [2]).save(path)
    maps = RidgeMaps.load(path)
    other = Engine(tiny_loaded("llama", seed=7))
    with pytest.raises(ArtifactError, match="fitted for tiny-llama .* not for tiny-llama"):
        ridgefill_plan(other, _ids(), RidgeFillConfig(split=2, tail=4), maps)
    with pytest.raises(ArtifactError, match="not split 1"):
        ridgefill_plan(engine, _ids(), RidgeFillConfig(split=1, tail=4), maps)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ArtifactError):
        RidgeMaps.load(truncated)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ArtifactError):
        RidgeMaps.load(garbage)
    with pytest.raises(ArtifactError, match="does not exist"):
        RidgeMaps.load(tmp_path / "missing.safetensors")


def test_split_settings_are_validated():
    engine = Engine(tiny_loaded("llama"))
    with pytest.raises(ValueError, match="outside 1..3"):
        ridgefill_plan(engine, _ids(), RidgeFillConfig(split=0, fill="identity"))
    with pytest.raises(ValueError, match="outside 1..3"):
        parse_splits("4", 4)
    assert parse_splits("fast,quality,1", 30) == [1, 15, 20]
    assert preset("quality", 30, tail=100).tail == 100
    with pytest.raises(ValueError, match="unknown RidgeFill preset"):
        preset("turbo", 30)


def test_mac_ceiling_is_one_for_exact_and_grows_with_the_filled_share():
    adapter = tiny_loaded("llama").adapter
    full = torch.full((T,), 4)
    assert prefill_macs(adapter, full, None, True) == exact_macs(adapter, T)
    shallow = full.clone()
    shallow[2:-4] = 1
    deeper = full.clone()
    deeper[2:-4] = 3
    assert exact_macs(adapter, T) > prefill_macs(adapter, deeper, 3, True) > prefill_macs(adapter, shallow, 1, True)
    # a map that also reads the previous row costs one more E x E per filled row and mapped layer (2 and 3)
    e = adapter.hidden_size
    assert prefill_macs(adapter, shallow, 1, True, 2) - prefill_macs(adapter, shallow, 1, True) == (T - 6) * 2 * e * e
    # folded into the k/v projection, those two layers' map and projection are one 2E x 2 kv-width multiply
    kv = 2 * adapter.kv_heads * adapter.head_dim
    saved = (T - 6) * 2 * (2 * e * e + e * kv - 2 * e * kv)
    assert prefill_macs(adapter, shallow, 1, True, 2) - prefill_macs(adapter, shallow, 1, True, 2, folded=True) == saved


# bf16 against fp32, same weights and maps: measured at most 0.026 in logits (gemma3; 0.007
# llama, 0.012 qwen3) and 0.027 in the first decode step; 0.1 leaves ~4x margin and is well
# below what filling itself moves (0.08-0.17 from exact here).
BF16_TOL = 0.1


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_maps_fitted_in_fp32_run_on_a_bf16_engine(family):
    """A bf16 model keeps the fp32 fingerprint, so fp32 maps load on it; the plan fills the
    same rows, every cached row is bf16, and the logits stay close to the fp32 RidgeFill's."""
    fp32 = Engine(tiny_loaded(family, seed=1))
    bf16 = Engine(tiny_loaded(family, seed=1, dtype=torch.bfloat16))
    maps = _fit(fp32, [2])
    maps.check_model(bf16.model.name, bf16.model.fingerprint, bf16.num_layers)  # no ArtifactError
    ids = _ids(3)
    config = RidgeFillConfig(split=2, tail=6, sinks=2)
    logits32, cache32 = fp32.prefill([ids], plan=ridgefill_plan(fp32, ids, config, maps))
    logits16, cache16 = bf16.prefill([ids], plan=ridgefill_plan(bf16, ids, config, maps))
    assert {cache16[layer].keys().dtype for layer in range(bf16.num_layers)} == {torch.bfloat16}
    for layer in range(bf16.num_layers):
        assert torch.equal(cache16[layer].row_kinds(), cache32[layer].row_kinds())
    assert int((cache16[bf16.num_layers - 1].row_kinds() == RowKind.FILLED).sum()) == T - 8
    assert (logits16 - logits32).abs().max() < BF16_TOL
    token = logits32.argmax(-1)
    assert (bf16.decode_step(token, cache16) - fp32.decode_step(token, cache32)).abs().max() < BF16_TOL


def test_cache_rows_are_linear_in_the_normed_input_as_the_fold_assumes(family):
    """Every family's cache rows: `key_value` is the layer's own k, v (as attention computes them),
    and equals `cache_rows` over the normed input (h / RMS) times `input_norm`'s gain through
    `kv_weights` -- the chain `fold_kv` turns into one matrix."""
    engine = Engine(tiny_loaded(family, seed=4))
    a = engine.adapter
    with torch.no_grad():  # a gain that is not all ones
        for layer in a.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(5))
    h = torch.randn(1, 7, a.hidden_size, generator=torch.Generator().manual_seed(6))
    rope = a.rope(h, torch.arange(7).view(1, -1))
    checked = 0
    for layer in range(a.num_layers):
        if a.is_recurrent(layer):
            continue
        _, k, v, _ = a.attention_inputs(layer, h, rope)
        k_only, v_only = a.key_value(layer, h, rope)
        assert torch.allclose(k_only, k, atol=1e-5) and torch.allclose(v_only, v, atol=1e-5)
        gain, eps = a.input_norm(layer)
        normed = torch.nn.functional.rms_norm(h, h.shape[-1:], None, eps)
        k_fold, v_fold = a.cache_rows(layer, torch.nn.functional.linear(normed * gain, *a.kv_weights(layer)), rope)
        assert torch.allclose(k_fold, k, atol=1e-5) and torch.allclose(v_fold, v, atol=1e-5)
        checked += 1
    assert checked > 0


def test_maps_restricted_to_one_split_keep_its_tensors_and_drop_the_rest(tmp_path):
    """`RidgeMaps.only`: the shipped maps hold the split the demo uses; the same tensors, a smaller file."""
    e, layers = 4, 5
    tensors = {map_key(s, l, p): torch.randn(e, e) if p == "weight" else torch.randn(e)
               for s in (2, 3) for l in range(s + 1, layers) for p in ("weight", "bias")}
    maps = RidgeMaps(layers, e, "fp", "m", [2, 3], False, {"splits": {"2": {"r2": 1}, "3": {"r2": 2}}}, tensors=tensors)
    one = maps.only([3])
    assert one.splits == [3] and one.info["splits"] == {"3": {"r2": 2}}
    assert set(one.tensors) == {k for k in tensors if k.startswith("split.3.")}
    one.save(tmp_path / "one.safetensors")
    back = RidgeMaps.load(tmp_path / "one.safetensors")
    assert back.splits == [3] and all(torch.equal(back.tensors[k], tensors[k]) for k in back.tensors)
    assert len(back.tensors) == 2 * (layers - 3 - 1) and maps.splits == [2, 3]
    with pytest.raises(ValueError, match="only splits they hold"):
        maps.only([1])


def _prefill_in_steps(engine, ids, chunk, plan):
    """((how many times the prefill yielded between its chunks, and between two layers of a
    chunk), what it returned)."""
    steps, points = engine.prefill_steps([ids], chunk_size=chunk, plan=plan), []
    with pytest.raises(StopIteration) as done:
        while True:
            points.append(next(steps))
    return (points.count(None), points.count("layer")), done.value.value


@pytest.mark.parametrize("family, chunk, attended", [("llama", 8, 2), ("gemma3", 8, 2), ("llama", 4, 0), ("qwen3_5", 4, 0)])
def test_a_ridgefill_prefill_in_chunks_leaves_the_rows_one_pass_does(family, chunk, attended):
    """RidgeFill prefills in two phases of chunks (the server's chunked prefill): the layers below
    the split chunk by chunk, then the choice of exact rows (all rows cached by then), then the late
    layers over chunks of a chunk's worth of work, each chunk's filled rows written among its exact
    rows from the maps (which read the row before each filled row, across a chunk's edge too), and
    a chunk of filled rows only written without running the layer (chunks of 4, no attended rows).
    Each layer holds the rows of one pass, of the same kinds, within rounding; the same rows are
    chosen; the logits and the rescue's states agree and greedy decoding continues alike. On Gemma 3
    the sliding layers see 8 rows back, so a filled row is written where an exact row of a later
    chunk sees it, and the choice is read below a late exact layer (split 3, read at layer 1). On
    the hybrid (no attention layer below its split, so no attended rows) the late recurrent layer's
    state takes each chunk's exact and filled rows in position order, as one pass gives them."""
    from dataclasses import replace

    from kvforge.engine import _late_chunks
    from kvforge.generation import GenerationConfig

    engine = Engine(tiny_loaded(family, seed=2))
    split = 3 if family == "gemma3" else 2
    if family == "gemma3":
        engine.adapter.windows = [8, None, 8, 8]
    ids = _ids(8)
    config = RidgeFillConfig(split=split, tail=5, sinks=2, attended_rows=attended, attended_span=1)
    plan = ridgefill_plan(engine, ids, config, _previous_row_maps(engine, split))
    assert (plan.choose is not None and plan.choose_at == 2) if attended else plan.choose is None
    whole_logits, whole, whole_states = engine.prefill_with_states([ids], plan=plan)
    (yields, layer_points), (chunked_logits, chunked, chunked_states) = _prefill_in_steps(engine, ids, chunk, plan)
    kept = final_depth(whole, T) == engine.num_layers
    assert torch.equal(kept, final_depth(chunked, T) == engine.num_layers) and (8 if attended else 6) < int(kept.sum()) < T
    assert 0 < plan.fill_cost < 1  # the maps' share of a late layer's work (`flops.filled_row_share`)
    starts = _late_chunks(kept.tolist(), chunk, plan.fill_cost)
    assert yields == T // chunk + len(starts) - 1  # the chunks below the split, then the late chunks
    # and a pause between two layers of each chunk, where a server may run a decode step
    assert layer_points == T // chunk * (split - 1) + len(starts) * (engine.num_layers - split - 1)
    if not attended:  # some late chunk holds filled rows only
        assert any(not bool(kept[a:b].any()) for a, b in zip(starts, starts[1:] + [T]))
    for layer in range(engine.num_layers):
        assert torch.equal(whole[layer].row_positions(), chunked[layer].row_positions())
        assert torch.equal(whole[layer].row_kinds(), chunked[layer].row_kinds())
        if engine.adapter.is_recurrent(layer):  # the state after every row, and the convolution's window
            assert (whole[layer].state - chunked[layer].state).abs().max() < TOL
            assert (whole[layer].conv - chunked[layer].conv).abs().max() < TOL
            continue
        assert (whole[layer].keys() - chunked[layer].keys()).abs().max() < TOL
        assert (whole[layer].values() - chunked[layer].values()).abs().max() < TOL
    assert (whole_logits - chunked_logits).abs().max() < TOL and (whole_states - chunked_states).abs().max() < TOL
    greedy = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    assert engine.generate(ids, replace(greedy, chunk_size=chunk), plan=plan)[0].token_ids == engine.generate(ids, greedy, plan=plan)[0].token_ids


def test_a_chunked_ridgefill_prefill_cuts_its_late_layers_by_the_plans_fill_cost():
    """The engine's late-layer chunks follow the plan's `fill_cost`: a cheaper filled row packs
    more rows into a chunk, so fewer chunks; a plan with none counts a filled row as an exact one.
    The rows are the same whichever way the work is cut, within rounding."""
    from dataclasses import replace

    from kvforge.engine import _late_chunks

    engine = Engine(tiny_loaded("llama", seed=2))
    ids = _ids(8)
    config = RidgeFillConfig(split=2, tail=5, sinks=2, attended_rows=0, attended_span=1)
    plan = ridgefill_plan(engine, ids, config, _previous_row_maps(engine, 2))
    chunk, results = 4, {}
    for cost in (0.1, 1.0, None):
        results[cost] = _prefill_in_steps(engine, ids, chunk, replace(plan, fill_cost=cost))
    kept = final_depth(results[None][1][1], T) == engine.num_layers
    late = {cost: len(_late_chunks(kept.tolist(), chunk, 1.0 if cost is None else cost)) for cost in results}
    assert late[0.1] < late[1.0] == late[None] == T // chunk  # filled rows at full cost: chunks of `chunk` rows
    assert all(results[cost][0][0] == T // chunk + late[cost] - 1 for cost in results)
    for layer in range(engine.num_layers):
        assert (results[0.1][1][1][layer].keys() - results[None][1][1][layer].keys()).abs().max() < TOL
    assert (results[0.1][1][0] - results[None][1][0]).abs().max() < TOL


def test_late_chunks_hold_a_chunk_of_work_with_filled_rows_at_their_share():
    """The late layers of a chunked RidgeFill prefill run in chunks of about `chunk` exact rows'
    worth of work, a filled row counting its plan's share (writing it is cheaper than running a
    row), so a long run of filled rows is split too and written without running the layer; a plan
    with no share counts a filled row as an exact one."""
    from kvforge.engine import _late_chunks

    rows = [True] * 3 + [False] * 40 + [True] * 10
    assert _late_chunks(rows, 8, 0.25) == [0, 23, 46]  # 3 + 20 x 0.25 = 8; 20 x 0.25 + 3 = 8; the last 7
    assert _late_chunks(rows, 8, 0.5) == [0, 13, 29, 44, 52]  # 3 + 10 x 0.5; 16 x 0.5; 14 x 0.5 + 1; 8 exact; the last 1
    assert _late_chunks(rows, 8, 1.0) == list(range(0, 53, 8))  # every row counted whole
    assert _late_chunks([True] * 20, 8, 0.25) == [0, 8, 16]
    assert _late_chunks([True] * 4, 8, 0.25) == [0]

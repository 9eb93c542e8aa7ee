"""Hybrid models (Gated DeltaNet + full attention): the recurrent state's rollback, persistence
and memory accounting. Parity with transformers runs in test_engine_parity (FAMILIES)."""

import pytest
import torch

from conftest import HYBRID_FAMILIES, tiny_loaded
from kvforge.cache import KVCache, RecurrentLayerCache
from kvforge.engine import Engine
from kvforge.generation import GenerationConfig
from kvforge.speculative.decode import speculative_generate

K = 4


class WrongAt:
    """Drafts the plain continuation with its j-th token wrong, j cycling 0..K (K: all right), so
    verification accepts every length 0..K in turn and rolls the state back by every amount."""

    def __init__(self, prompt: list[int], plain: list[int], shift: int = 0):
        self.prompt, self.plain, self.calls = prompt, plain, shift

    def propose(self, context, k):
        done = len(context) - len(self.prompt)
        draft = list(self.plain[done : done + k])
        wrong = self.calls % (K + 1)
        self.calls += 1
        if wrong < len(draft):
            draft[wrong] = 3 + (draft[wrong] - 2) % 94  # any other token of the tiny vocabulary
        return draft

    def observe(self, tokens):
        pass


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in (21, 9, 34)]


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_accept_length_commits_the_plain_tokens(family, dtype):
    """Greedy drafting on a hybrid is token-identical to plain decoding at every accept length:
    a verification over k+1 rows runs the recurrence token by token, as decode steps do, and a
    rejection restores the state after the last accepted token."""
    engine = Engine(tiny_loaded(family, dtype=dtype))
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    for prompt in _prompts():
        plain = engine.generate(prompt, config)[0].token_ids
        out, stats = speculative_generate(engine, [prompt], [WrongAt(prompt, plain)], config, k=K)
        assert out[0].token_ids == plain
        assert all(count > 0 for count in stats.accept_hist[: K + 1]), stats.accept_hist


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_batch_rolls_each_sequence_back_by_its_own_amount(family):
    engine = Engine(tiny_loaded(family))
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    prompts = _prompts()
    plain = [engine.generate(p, config)[0].token_ids for p in prompts]
    drafters = [WrongAt(p, t, shift=i) for i, (p, t) in enumerate(zip(prompts, plain))]  # out of step with each other
    out, stats = speculative_generate(engine, prompts, drafters, config, k=K)
    assert [o.token_ids for o in out] == plain
    assert stats.accepted > 0


def test_rollback_past_the_last_step_is_refused_and_within_it_restores_the_state():
    engine = Engine(tiny_loaded("qwen3_next"))
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    _, cache = engine.prefill(ids[:, :30])
    recurrent = [i for i, layer in enumerate(cache.layers) if isinstance(layer, RecurrentLayerCache)]
    before = {i: (cache[i].state.clone(), cache[i].conv.clone()) for i in recurrent}
    with torch.inference_mode():  # the cache's tensors are inference tensors
        engine.forward(ids[:, 30:35], torch.arange(30, 35).view(1, -1), cache, "none")  # a 5-token step
        assert not torch.equal(cache[0].state, before[0][0])
        cache.trim(5)
        for i in recurrent:  # every recurrent layer's state and conv history as they were
            assert torch.equal(cache[i].state, before[i][0]) and torch.equal(cache[i].conv, before[i][1])
        assert cache.lengths() == [30] * 4
        with pytest.raises(ValueError, match="rolls back only within its last step"):
            cache.trim(1)  # the step is gone: the state before it is not kept
        # a long step (prefill) keeps only the state before it: all of it or nothing rolls back
        _, cache = engine.prefill(ids[:, :3])
        engine.forward(ids[:, 3:40], torch.arange(3, 40).view(1, -1), cache, "none")
        with pytest.raises(ValueError, match="whole"):
            cache.trim(2)
        cache.trim(37)
        assert cache.lengths() == [3] * 4


def test_a_hybrid_cache_saves_loads_and_decodes_on(tmp_path):
    engine = Engine(tiny_loaded("qwen3_5"))
    ids = torch.randint(3, 97, (1, 25), generator=torch.Generator().manual_seed(2))
    logits, cache = engine.prefill(ids)
    cache.save(tmp_path / "c.safetensors")
    loaded, _ = KVCache.load(tmp_path / "c.safetensors")
    assert isinstance(loaded[0], RecurrentLayerCache) and not isinstance(loaded[3], RecurrentLayerCache)
    nxt = logits.argmax(-1)
    assert torch.equal(engine.decode_step(nxt, loaded), engine.decode_step(nxt, cache))


def test_a_recurrent_layer_is_a_row_log_and_a_state_with_no_keys_or_values(tmp_path):
    """A recurrent layer logs its rows' positions and kinds like an attention layer and keeps a
    state in place of K/V; its file holds no keys or values, and a file of format 1 (zero-head K/V
    beside the state) still loads as the same layer."""
    from safetensors.torch import load_file, save_file

    engine = Engine(tiny_loaded("qwen3_5"))
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    logits, cache = engine.prefill(ids)
    layer = cache[0]
    assert isinstance(layer, RecurrentLayerCache) and not hasattr(layer, "k")
    assert layer.row_positions().tolist() == [list(range(12))] * 2 and cache[3].row_positions().tolist() == [list(range(12))] * 2
    cache.save(tmp_path / "c.safetensors")
    tensors = load_file(tmp_path / "c.safetensors")
    assert "layers.0.state" in tensors and "layers.0.k" not in tensors and "layers.3.k" in tensors
    from safetensors import safe_open

    with safe_open(str(tmp_path / "c.safetensors"), framework="pt") as f:
        meta = f.metadata()
    tensors["layers.0.k"] = tensors["layers.0.v"] = torch.zeros(2, 0, 12, 0)
    save_file(tensors, tmp_path / "zero-head.safetensors", metadata={**meta, "format_version": "1"})
    loaded, _ = KVCache.load(tmp_path / "zero-head.safetensors")
    assert isinstance(loaded[0], RecurrentLayerCache) and loaded[0].length == 12
    nxt = logits.argmax(-1)
    assert torch.equal(engine.decode_step(nxt, loaded), engine.decode_step(nxt, cache))


def test_a_recurrent_layer_costs_the_same_bytes_at_any_length():
    engine = Engine(tiny_loaded("qwen3_next"))
    short = engine.prefill(torch.randint(3, 97, (1, 10)))[1]
    long = engine.prefill(torch.randint(3, 97, (1, 80)))[1]
    spec = engine.adapter.state_spec(0)  # conv channels, K-1, (Hv, Dk, Dv)
    state_bytes = spec[0] * spec[1] * 4 + spec[2][0] * spec[2][1] * spec[2][2] * 4  # fp32 model: both fp32
    # a prefill keeps the state before it too (it rolls back whole): two states' worth
    assert short[0].nbytes() == long[0].nbytes() == 2 * state_bytes
    assert long[3].nbytes() == 8 * short[3].nbytes()  # the attention layer's K/V grow with the rows
    # a k-token verification keeps the state after each of its tokens until the next step
    with torch.inference_mode():
        engine.forward(torch.randint(3, 97, (1, 5)), torch.arange(80, 85).view(1, -1), long, "none")
    recurrent = spec[2][0] * spec[2][1] * spec[2][2] * 4
    window = spec[0] * (spec[1] + 5) * 4
    assert long[0].nbytes() == state_bytes + window + 5 * recurrent  # the current state; the record: window, the state before and after tokens 1-4 (after 5 is the current state)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_continuous_batching_joins_and_drops_recurrent_states(family):
    """What the server does: a request prefilled alone joins the running batch (`join`: its rows
    and states into a free slot), a finished one leaves it (`leave`: the last sequence moves into
    its slot); each sequence decodes as it would alone."""
    engine = Engine(tiny_loaded(family))
    a, b = _prompts()[:2]
    la, batch = engine.prefill([a])
    lb, cb = engine.prefill([b])
    with torch.inference_mode():  # the cache's tensors are inference tensors, written in place
        batch.join(cb)
    tokens = torch.cat([la.argmax(-1), lb.argmax(-1)])
    step = engine.decode_step(tokens, batch)
    alone = [engine.decode_step(tokens[i : i + 1], c) for i, c in enumerate((engine.prefill([a])[1], engine.prefill([b])[1]))]
    for i in range(2):
        assert (step[i] - alone[i][0]).abs().max() < 1e-4
    with torch.inference_mode():
        batch.leave(0)
    kept = batch
    nxt = step[1:].argmax(-1)
    _, cb2 = engine.prefill([b + [int(tokens[1])]])
    assert (engine.decode_step(nxt, kept)[0] - engine.decode_step(nxt, cb2)[0]).abs().max() < 1e-4


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_left_padding_leaves_a_state_with_history_as_it_was(family):
    """A batch continuing cached sequences left-pads the shorter continuation: its padding rows
    must neither decay nor write the state it already holds, nor shift its conv history."""
    engine = Engine(tiny_loaded(family))
    a, b = _prompts()[:2]
    more = [[20, 21, 22], [30]]
    _, batch = engine.prefill([a, b])
    together, _ = engine.prefill(more, cache=batch)
    for i, (prompt, extra) in enumerate(zip((a, b), more)):
        alone, _ = engine.prefill([prompt + extra])
        assert (together[i] - alone[0]).abs().max() < 1e-4


def test_a_refused_rollback_changes_nothing_and_long_drafts_are_refused_up_front():
    engine = Engine(tiny_loaded("qwen3_5"))
    _, cache = engine.prefill([_prompts()[0], _prompts()[1]])
    with torch.inference_mode():
        engine.forward(torch.randint(3, 97, (2, 3)), cache.next_positions().view(-1, 1) + torch.arange(3), cache, "none")
        state, conv, lengths = cache[0].state.clone(), cache[0].conv.clone(), cache.lengths()
        with pytest.raises(ValueError, match="rolls back only within its last step"):
            cache.rollback([1, 4])  # sequence 1 asks past the 3-token step
    assert torch.equal(cache[0].state, state) and torch.equal(cache[0].conv, conv) and cache.lengths() == lengths
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="k 32 is too long"):
        speculative_generate(engine, [_prompts()[0]], [WrongAt(_prompts()[0], [5] * 40)], config, k=32)

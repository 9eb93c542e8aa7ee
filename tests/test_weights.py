"""In-place weight updates: full and LoRA, refused whole when a tensor does not fit, and every
derived copy (fused projections, packed weights, the fingerprint) following the new values."""

import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_hf_model, tiny_loaded
from kvforge.engine import Engine
from kvforge.generation import GenerationConfig
from kvforge.models.weights import WeightUpdateError, read_update


def _logits(engine: Engine, ids=(1, 5, 9, 4, 7)) -> torch.Tensor:
    logits, _ = engine.prefill([list(ids)])
    return logits


def test_a_full_update_serves_the_new_weights_as_a_fresh_load_would(family):
    engine, other = Engine(tiny_loaded(family, seed=0)), Engine(tiny_loaded(family, seed=1))
    before_fingerprint, old = engine.model.fingerprint, _logits(engine)
    new = {name: p.detach().clone() for name, p in tiny_hf_model(family, seed=1).named_parameters()}
    assert engine.update_weights(new) == "full"
    assert torch.equal(_logits(engine), _logits(other))  # fused q/k/v and gate/up follow the modules
    assert not torch.equal(_logits(engine), old)
    assert engine.model.weights_version == 1
    assert engine.model.fingerprint == other.model.fingerprint != before_fingerprint


def test_an_update_that_does_not_fit_is_refused_whole_and_names_the_tensor():
    engine = Engine(tiny_loaded("llama"))
    old, fingerprint = _logits(engine), engine.model.fingerprint
    params = dict(engine.model.hf.named_parameters())
    good = {name: torch.zeros_like(p) for name, p in list(params.items())[:3]}
    first = next(iter(params))
    for bad, named in [
        ({**good, "model.nope.weight": torch.zeros(2)}, "model.nope.weight"),
        ({**good, first: torch.zeros(3, 3)}, first),
        ({**good, first: params[first].detach().to(torch.bfloat16)}, first),
    ]:
        with pytest.raises(WeightUpdateError, match=named.replace(".", r"\.")):
            engine.update_weights(bad)
    assert torch.equal(_logits(engine), old) and engine.model.fingerprint == fingerprint and engine.model.weights_version == 0


def test_lora_updates_replace_each_other_over_the_kept_base():
    engine = Engine(tiny_loaded("llama"))
    hf = engine.model.hf
    name = "model.layers.0.self_attn.q_proj.weight"
    base = dict(hf.named_parameters())[name].detach().clone()
    out_features, in_features = base.shape
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, in_features, generator=g), torch.randn(out_features, 2, generator=g)
    lora = {f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight": a, f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight": b}
    assert engine.update_weights(lora, lora_scale=0.5) == "lora"
    assert torch.allclose(dict(hf.named_parameters())[name], base + 0.5 * b @ a)
    engine.update_weights(lora, lora_scale=0.5)  # the same adapter again: still base + delta, not twice
    assert torch.allclose(dict(hf.named_parameters())[name], base + 0.5 * b @ a)
    other = "model.layers.1.mlp.down_proj.weight"
    down = dict(hf.named_parameters())[other].detach().clone()
    o, i = down.shape
    engine.update_weights({f"{other.removesuffix('.weight')}.lora_A.weight": torch.zeros(1, i), f"{other.removesuffix('.weight')}.lora_B.weight": torch.ones(o, 1)})
    assert torch.equal(dict(hf.named_parameters())[name], base)  # left out of the new adapter: back to the base
    with pytest.raises(WeightUpdateError, match="lora_B"):
        engine.update_weights({f"{name.removesuffix('.weight')}.lora_A.weight": a})
    with pytest.raises(WeightUpdateError, match=r"\(r, "):
        engine.update_weights({f"{name.removesuffix('.weight')}.lora_A.weight": a, f"{name.removesuffix('.weight')}.lora_B.weight": b.T})


def test_a_packed_weight_copy_is_remade_after_an_update():
    """Linears keep a packed copy of their weight on the tensor. An inference tensor (a merged
    LoRA weight, say) has no version counter to show an in-place write, so an update marks every
    packed copy stale."""
    from kvforge.ops import linear as ops_linear

    packs = []
    pack = lambda w: packs.append(w.clone()) or packs[-1]  # noqa: E731
    with torch.inference_mode():
        weight = torch.ones(4, 4)
    assert ops_linear._packed(weight, pack) is ops_linear._packed(weight, pack) and len(packs) == 1
    with torch.inference_mode():
        weight.fill_(2.0)
    ops_linear.invalidate_packed()
    assert torch.equal(ops_linear._packed(weight, pack), weight) and len(packs) == 2


def test_read_update_takes_the_peft_scale_and_names_a_damaged_file(tmp_path):
    save_file({"x.lora_A.weight": torch.zeros(2, 3), "x.lora_B.weight": torch.zeros(4, 2)}, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text('{"lora_alpha": 16, "r": 8}')
    tensors, scale = read_update(tmp_path)
    assert set(tensors) == {"x.lora_A.weight", "x.lora_B.weight"} and scale == 2.0
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WeightUpdateError, match="cannot read"):
        read_update(tmp_path / "bad.safetensors")
    with pytest.raises(WeightUpdateError, match="no weights file"):
        read_update(tmp_path / "missing.safetensors")


def test_a_vllm_update_is_checked_against_the_served_checkpoint(tmp_path):
    """What `update_vllm_weights` sends vLLM: every tensor of the checkpoint by its name and shape
    (a tied head's name dropped); anything else refused, naming the tensor, before vLLM is called."""
    from kvforge.vllm.weights import check_update

    checkpoint = {"model.embed_tokens.weight": torch.zeros(8, 4), "model.norm.weight": torch.ones(4)}
    save_file(checkpoint, str(tmp_path / "model.safetensors"))
    update = {name: t + 1 for name, t in checkpoint.items()}
    sent = check_update(tmp_path, True, {**update, "lm_head.weight": update["model.embed_tokens.weight"]})
    assert sent.keys() == checkpoint.keys()
    assert check_update(tmp_path, False, {"base_model.model." + n: t for n, t in update.items()}).keys() == checkpoint.keys()
    for bad, named in [
        ({**update, "lm_head.weight": torch.zeros(8, 4)}, "lm_head.weight"),  # untied: not in the checkpoint
        ({**update, "model.norm.weight": torch.ones(5)}, "model.norm.weight"),
        ({**update, "model.norm.weight": torch.ones(4, dtype=torch.int32)}, "model.norm.weight"),
        ({"model.norm.weight": torch.ones(4)}, "model.embed_tokens.weight"),  # missing
    ]:
        with pytest.raises(WeightUpdateError, match=named.replace(".", r"\.")):
            check_update(tmp_path, False, bad)
    with pytest.raises(WeightUpdateError, match="no safetensors"):
        check_update(tmp_path / "elsewhere", False, update)
    stored = tmp_path / "with-head"  # a tied checkpoint that stores the head as well: not required
    stored.mkdir()
    save_file({**checkpoint, "lm_head.weight": torch.zeros(8, 4)}, str(stored / "model.safetensors"))
    assert check_update(stored, True, update).keys() == checkpoint.keys()


def test_vllm_update_tensors_travel_as_bytes_and_come_back_equal(monkeypatch):
    """What `update_vllm_weights` sends through vLLM's RPC: dtype, shape and byte pieces (views of
    the tensor), rebuilt bit for bit, scalars, empty and transposed tensors and split pieces too."""
    import kvforge.vllm.weights as vllm_weights

    tensors = [torch.randn(3, 5).to(torch.bfloat16), torch.tensor(1.5), torch.zeros(0, 4), torch.randn(4, 3).t()]
    monkeypatch.setattr(vllm_weights, "PIECE_BYTES", 7)  # pieces of 7 bytes: a tensor's bytes split across many
    for t in tensors:
        pieces = vllm_weights._pieces(t)
        assert len(pieces) == max(1, -(-t.numel() * t.element_size() // 7))
        rebuilt = vllm_weights._tensor(str(t.dtype).removeprefix("torch."), tuple(t.shape), [bytes(p) for p in pieces])
        assert rebuilt.dtype == t.dtype and torch.equal(rebuilt, t)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "deepseek_v3", "qwen3_next"])
def test_weights_released_to_their_packed_pairs_give_the_same_bits_and_take_updates(family, monkeypatch):
    """A serving engine keeps each projection weight only as `small_linear`'s packed pairs. Its
    steps give the bits they gave before: short steps from the pairs, a prefill (steps longer than
    `small_rows`, lowered here so a short prompt is one) and a view's rows (the K/V rows RidgeFill
    computes from a slice of q/k/v) from the weight unpacked for the call. An update restores the
    weights and packs and releases them again before it returns; one that does not fit leaves
    them released and unchanged."""
    from kvforge.ops import kernels

    if kernels.kind() == "none":
        pytest.skip("no compiled kernels here: nothing is packed, so nothing is released")
    monkeypatch.setattr(kernels, "SMALL_ROWS", 4)
    monkeypatch.setattr(kernels, "AMX_SMALL_ROWS", 4)
    kept, engine = (Engine(tiny_loaded(family, dtype=torch.bfloat16)) for _ in range(2))
    engine.model.hf.requires_grad_(False)  # as `load_model` leaves a model
    prompt, config = [(7 * i) % 90 + 3 for i in range(40)], GenerationConfig(max_new_tokens=6)
    expected = kept.generate([prompt], config)[0].token_ids
    engine.generate([prompt], config)  # packs every weight
    assert engine.release_unpacked_weights() > 0
    weight = engine.adapter.gate_up[0][0]  # a dense MLP in every family here
    assert weight.untyped_storage().nbytes() == 0
    assert engine.release_unpacked_weights() == 0  # released once
    assert torch.equal(_logits(engine, prompt), _logits(kept, prompt))
    assert engine.generate([prompt], config)[0].token_ids == expected
    layer = engine.num_layers - 1  # an attention layer in every family here
    for tokens in (3, 6):  # a step short enough for the packed path, and a longer one
        h = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
        for k_kept, k_engine in zip(*(e.adapter.key_value(layer, h, e.adapter.rope(h, torch.arange(tokens)[None])) for e in (kept, engine))):
            assert torch.equal(k_kept, k_engine)
    new = {name: p.detach().clone().bfloat16() for name, p in tiny_hf_model(family, seed=1).named_parameters()}
    with pytest.raises(WeightUpdateError):
        engine.update_weights({**new, "model.norm.weight": torch.zeros(3, dtype=torch.bfloat16)})
    assert weight.untyped_storage().nbytes() == 0 and torch.equal(_logits(engine, prompt), _logits(kept, prompt))
    kept.update_weights(new)
    engine.update_weights(new)
    assert weight.untyped_storage().nbytes() == 0  # packed from the new values and released again
    assert torch.equal(_logits(engine, prompt), _logits(kept, prompt))
    assert engine.generate([prompt], config)[0].token_ids == kept.generate([prompt], config)[0].token_ids
    assert engine.model.fingerprint == kept.model.fingerprint  # hashed from the values unpacked, the storage left freed
    assert weight.untyped_storage().nbytes() == 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: an embedding module that scales its rows
def test_an_embedding_table_tied_to_a_released_head_looks_its_rows_up_in_the_pairs(family):
    from kvforge.ops import kernels
    from kvforge.ops.released import is_released

    if kernels.kind() == "none":
        pytest.skip("no compiled kernels here: nothing is packed, so nothing is released")
    kept, engine = (Engine(tiny_loaded(family, dtype=torch.bfloat16, vocab_size=112, tie_word_embeddings=True)) for _ in range(2))
    engine.model.hf.requires_grad_(False)  # as `load_model` leaves a model
    prompt, config = [(7 * i) % 90 + 3 for i in range(20)], GenerationConfig(max_new_tokens=6)
    engine.generate([prompt], config)
    engine.release_unpacked_weights()
    table = engine.model.hf.get_input_embeddings().weight
    assert table is engine.model.hf.lm_head.weight and is_released(table)
    ids = torch.tensor([[0] + prompt[:6], prompt[7:14]])  # 0: the padding id
    assert torch.equal(engine.adapter.embed(ids), kept.adapter.embed(ids))
    assert engine.generate([prompt], config)[0].token_ids == kept.generate([prompt], config)[0].token_ids



def test_released_k_v_rows_run_as_the_kept_weights_slice_does():
    """RidgeFill computes K/V rows from a slice of q/k/v, which `linear` runs through F.linear (a
    view has no packed copy). With the weight released, the slice is its values unpacked, and a
    short step must still take that path, not the packed one, whose sums round in another order."""
    from unittest import mock

    from kvforge.ops import kernels

    if kernels.kind() == "none":
        pytest.skip("no compiled kernels here: nothing is packed, so nothing is released")
    kept, engine = (Engine(tiny_loaded("llama", dtype=torch.bfloat16)) for _ in range(2))
    engine.model.hf.requires_grad_(False)
    engine.generate([[5, 6, 7]], GenerationConfig(max_new_tokens=2))
    assert engine.release_unpacked_weights() > 0
    h = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    rope = kept.adapter.rope(h, torch.arange(3)[None])
    with torch.inference_mode(), mock.patch.object(kernels, "small_linear", wraps=kernels.small_linear) as small:
        rows = [e.adapter.key_value(1, h, rope) for e in (kept, engine)]
        assert small.call_count == 0
    assert all(torch.equal(a, b) for a, b in zip(*rows))

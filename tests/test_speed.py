"""SPEED: the shallow-prefill plan, its visibility against transformers with per-layer masks,
the LoRA adapter artifact and adaptation."""

import pytest
import torch

from conftest import held, tiny_loaded
from kvforge.cache import RecurrentLayerCache
from kvforge.data.replies import ReplySample
from kvforge.engine import Engine
from kvforge.errors import ArtifactError, KvforgeError
from kvforge.fill.lora import LoraAdapter, adapted_engine
from kvforge.fill.speed import SpeedConfig, parse_anchors, resolve_cut, speed_plan
from kvforge.fill.speed_fit import SpeedFitConfig, fit_speed, reply_nll, sample_plan
from kvforge.generation import GenerationConfig

T = 24


def _prompt(seed=0, n=T):
    return torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_cut_at_full_depth_equals_exact_bit_for_bit(family):
    """Through `run_plan` itself (prefill would otherwise take the exact path for this plan)."""
    engine = Engine(tiny_loaded(family))
    prompt = _prompt()
    plan = speed_plan(T, SpeedConfig(cut=engine.num_layers), engine.num_layers)
    logits, cache = engine.prefill([prompt], plan=plan, exact_shortcut=False)
    exact, exact_cache = engine.prefill([prompt])
    assert torch.equal(logits, exact)
    for a, b in zip(cache.layers, exact_cache.layers):
        assert all(torch.equal(x, y) for x, y in zip(held(a), held(b)))
    for _ in range(3):  # decode continues from the planned cache exactly as from the exact one
        token = exact.argmax(-1)
        logits, exact = engine.decode_step(token, cache), engine.decode_step(token, exact_cache)
        assert torch.equal(logits, exact)
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    assert engine.generate(prompt, config, plan=plan)[0].token_ids == engine.generate(prompt, config)[0].token_ids


def test_shallow_rows_are_absent_above_the_cut(family):
    engine = Engine(tiny_loaded(family))
    config = SpeedConfig(cut=2, first=1, rows=(7,), tail=3)
    logits, cache = engine.prefill([_prompt(1)], plan=speed_plan(T, config, engine.num_layers))
    full = [0, 7, T - 3, T - 2, T - 1]
    for layer in range(engine.num_layers):
        held = cache[layer].row_positions()[0].tolist()
        assert held == (list(range(T)) if layer < 2 else full)
    exact_cache = engine.prefill([_prompt(1)])[1]
    for layer in range(engine.num_layers):  # K/V bytes shrink with the rows held; a recurrent state is one size
        rows = T if layer < 2 or isinstance(cache[layer], RecurrentLayerCache) else len(full)
        assert cache[layer].nbytes() == exact_cache[layer].nbytes() * rows // T
    engine.decode_step(logits.argmax(-1), cache)
    assert cache[3].row_positions()[0].tolist() == full + [T]  # decode rows are full depth


def _hf_logits_with_layer_masks(loaded, ids: list[int], cut: int, full: torch.Tensor) -> torch.Tensor:
    """transformers' own forward over every row, with each decoder layer's attention mask
    replaced: below the cut causal, at and above it causal over the full-depth rows only (each
    row also sees itself, so a shallow row's own, unused output stays finite)."""
    n = len(ids)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    upper = causal & (full.unsqueeze(0) | torch.eye(n, dtype=torch.bool))
    hooks = []
    for i, layer in enumerate(loaded.hf.model.layers):
        mask = (causal if i < cut else upper)[None, None]

        def hook(module, args, kwargs, mask=mask):
            kwargs["attention_mask"] = mask
            return args, kwargs

        hooks.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            return loaded.hf(torch.tensor([ids])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("family_name", ["llama", "qwen3"])
def test_decode_sees_only_anchors_tail_and_decode_rows_above_the_cut(family_name):
    """Prefill with SPEED, then decode: every full-depth row's logits equal transformers run with
    per-layer masks that hide shallow rows above the cut."""
    loaded = tiny_loaded(family_name)
    engine = Engine(loaded)
    prompt, cut = _prompt(2), 2
    config = SpeedConfig(cut=cut, first=2, tail=2)
    logits, cache = engine.prefill([prompt], plan=speed_plan(T, config, engine.num_layers))
    steps, token = [logits[0]], logits.argmax(-1)
    decoded = []
    for i in range(5):
        decoded.append(int(token))
        out = engine.decode_step(token, cache)
        steps.append(out[0])
        token = out.argmax(-1)
    ids = prompt + decoded
    full = torch.zeros(len(ids), dtype=torch.bool)
    full[:2] = True
    full[T - 2 :] = True
    reference = _hf_logits_with_layer_masks(loaded, ids, cut, full)
    ours = torch.stack(steps)  # rows T-1 .. T+4
    assert (ours - reference[T - 1 :]).abs().max() < 1e-4
    # and the policy matters: plain causal attention gives different logits
    with torch.no_grad():
        plain = loaded.hf(torch.tensor([ids])).logits[0].float()
    assert (plain[T - 1 :] - reference[T - 1 :]).abs().max() > 1e-3


def test_teacher_forced_reply_scoring_equals_prefill_then_decode():
    """reply_nll under a plan over prompt + reply equals SPEED prefill followed by decode steps:
    training and evaluation see exactly what inference sees."""
    engine = Engine(tiny_loaded("gemma3"))
    ids = _prompt(3, T + 6)
    sample = ReplySample(ids, T)
    config = SpeedConfig(cut=2)
    with torch.inference_mode():
        nll = reply_nll(engine, sample, sample_plan(engine, sample, config))
    logits, cache = engine.prefill([ids[:T]], plan=speed_plan(T, config, engine.num_layers))
    expected = []
    for i in range(6):
        expected.append(torch.nn.functional.cross_entropy(logits, torch.tensor([ids[T + i]])))
        logits = engine.decode_step(torch.tensor([ids[T + i]]), cache)
    assert (nll - torch.stack(expected)).abs().max() < 1e-4


@pytest.mark.parametrize(
    "value, layers",
    [("0.75", 3), (0.5, 2), ("1.0", 4), ("3", 3), (4, 4)],
)
def test_resolve_cut(value, layers):
    assert resolve_cut(value, 4) == layers


@pytest.mark.parametrize("value", ["0", "5", "0.1", "1.5", "-1", "deep"])
def test_resolve_cut_rejects_cuts_outside_the_model(value):
    with pytest.raises(ValueError):
        resolve_cut(value, 4)


def test_anchors_parse_and_must_lie_in_the_prompt():
    assert parse_anchors("bos") == (1, ())
    assert parse_anchors("first:4,9,2") == (4, (2, 9))
    assert parse_anchors("none") == (0, ())
    with pytest.raises(ValueError):
        parse_anchors("first:x")
    with pytest.raises(KvforgeError, match="past the 10-token prompt"):
        speed_plan(10, SpeedConfig(cut=2, rows=(12,)), 4)
    with pytest.raises(KvforgeError, match="past the 3-token prompt"):
        speed_plan(3, SpeedConfig(cut=2, first=4), 4)


def _lora(engine, seed=0):
    lora = LoraAdapter.new(engine.adapter, 4, 8.0, engine.model.name, engine.model.fingerprint, seed)
    for value in lora.tensors.values():  # B starts at zero; give it weight so the delta is visible
        value.add_(0.05 * torch.randn(value.shape, generator=torch.Generator().manual_seed(1)))
    return lora


def test_adapter_round_trip_and_the_adapted_engine_equals_applied(tmp_path):
    engine = Engine(tiny_loaded("llama"))
    lora = _lora(engine)
    lora.info = {"method": "speed", "cut": 2}
    lora.save(tmp_path / "a.safetensors")
    loaded = LoraAdapter.load(tmp_path / "a.safetensors")
    assert loaded.info == lora.info and loaded.rank == 4 and loaded.fingerprint == engine.model.fingerprint
    for key, value in lora.tensors.items():
        assert torch.equal(loaded.tensors[key], value)
    prompt = _prompt(4)
    base = engine.prefill([prompt])[0]
    with torch.inference_mode(), loaded.applied(engine.adapter):
        applied = engine.prefill([prompt])[0]
    assert torch.equal(engine.prefill([prompt])[0], base)  # restored after the block
    assert (applied - base).abs().max() > 1e-3
    adapted = adapted_engine(engine, loaded)  # a second weight set: the base engine keeps the base weights
    assert (adapted.prefill([prompt])[0] - applied).abs().max() < 1e-4
    assert torch.equal(engine.prefill([prompt])[0], base)
    assert adapted.model.fingerprint != engine.model.fingerprint  # base-model artifacts are refused for it


def test_adapter_refuses_another_model_and_damaged_files(tmp_path):
    engine = Engine(tiny_loaded("llama"))
    lora = _lora(engine)
    other = Engine(tiny_loaded("llama", seed=5))
    with pytest.raises(ArtifactError, match="trained on"):
        lora.check_model(other.model.name, other.model.fingerprint, other.num_layers)
    path = tmp_path / "a.safetensors"
    lora.save(path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ArtifactError, match="cannot read adapter"):
        LoraAdapter.load(path)
    with pytest.raises(ArtifactError, match="does not exist"):
        LoraAdapter.load(tmp_path / "missing.safetensors")


def test_training_under_the_plan_moves_only_the_adapter_and_lowers_the_loss():
    engine = Engine(tiny_loaded("qwen3"))
    sample = ReplySample(_prompt(5, T + 8), T)
    plan = sample_plan(engine, sample, SpeedConfig(cut=2))
    for p in engine.model.hf.parameters():
        p.requires_grad_(False)
    lora = LoraAdapter.new(engine.adapter, 4, 8.0, "tiny", engine.model.fingerprint)
    params = lora.parameters()
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(8):
        with lora.applied(engine.adapter):
            loss = reply_nll(engine, sample, plan).mean()
        loss.backward()
        assert all(p.grad is None for p in engine.model.hf.parameters())
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.1


def test_fit_speed_on_real_chat_text_produces_an_adapter(monkeypatch):
    engine = Engine(tiny_loaded("llama"))
    steps = []
    lora = fit_speed(engine, SpeedConfig(cut=2), SpeedFitConfig(steps=3, max_tokens=200), "tiny-llama", lambda s, loss: steps.append(loss))
    assert len(steps) == 3 and all(loss > 0 for loss in steps)
    assert lora.info["cut"] == 2 and lora.info["training"]["steps"] == 3 and lora.info["training"]["tokens"] > 0
    assert lora.tensors["layers.0.qkv.B"].abs().sum() > 0  # the adapter moved away from the base model


def test_an_interrupted_fit_resumes_from_its_checkpoint_to_the_same_adapter(tmp_path):
    """Stopped after 2 of 4 steps (checkpoint every 2), a rerun with the same settings resumes and
    ends with the same losses and factors, to the bit, as one straight run; other settings or
    another kind of checkpoint are refused in one line."""
    speed, config = SpeedConfig(cut=2, tail=3), SpeedFitConfig(steps=4, max_tokens=200, lr=1e-3)
    straight = fit_speed(Engine(tiny_loaded("llama")), speed, config, "tiny-llama")

    class Interrupt(Exception):
        pass

    def stop_after_two(step, _loss):
        if step == 1:
            raise Interrupt

    checkpoint = tmp_path / "speed.ckpt"
    with pytest.raises(Interrupt):
        fit_speed(Engine(tiny_loaded("llama")), speed, config, "tiny-llama", stop_after_two, checkpoint, checkpoint_every=2)
    saved = torch.load(checkpoint, weights_only=True)  # plain tensors, numbers and lists only
    assert saved["state"]["step"] == 2 and saved["format"] == "kvforge.speed-fit-checkpoint"
    steps = []
    resumed = fit_speed(Engine(tiny_loaded("llama")), speed, config, "tiny-llama", lambda s, loss: steps.append(s), checkpoint, checkpoint_every=2)
    assert steps == [2, 3]  # only the steps left ran
    assert resumed.info["loss_first"] == straight.info["loss_first"] and resumed.info["loss_last"] == straight.info["loss_last"]
    assert resumed.info["training"]["tokens"] == straight.info["training"]["tokens"]
    assert resumed.tensors.keys() == straight.tensors.keys()
    for name in straight.tensors:
        torch.testing.assert_close(resumed.tensors[name], straight.tensors[name], atol=0, rtol=0)
    with pytest.raises(ValueError, match="other settings"):
        fit_speed(Engine(tiny_loaded("llama")), SpeedConfig(cut=2, tail=4), config, "tiny-llama", checkpoint=checkpoint)
    other = tmp_path / "other.ckpt"
    torch.save({"format": "kvforge.distill-checkpoint", "version": 2}, other)
    with pytest.raises(ArtifactError, match="not a version-1 kvforge SPEED fit checkpoint") as error:
        fit_speed(Engine(tiny_loaded("llama")), speed, config, "tiny-llama", checkpoint=other)
    assert "\n" not in str(error.value)


def test_distilling_from_full_depth_starts_at_the_policy_kl_and_lowers_it():
    """loss="kl": the first step's loss is KL(base at full depth || base under SPEED) on the reply
    (the adapter starts as the base model), computed here by hand; the trained adapter lowers that
    KL on the samples it trained on (the teacher stays the base model)."""
    from kvforge.fill.speed_fit import _fit_samples, reply_log_probs

    engine = Engine(tiny_loaded("llama"))
    speed, config = SpeedConfig(cut=2), SpeedFitConfig(steps=12, max_tokens=200, loss="kl", lr=1e-3)
    samples = _fit_samples(engine, config)

    def log_probs(sample, plan_speed):
        with torch.no_grad():
            return reply_log_probs(engine, sample, plan_speed)

    full = [log_probs(sample, None) for sample in samples]

    def policy_kl(i: int) -> float:
        return float((full[i].exp() * (full[i] - log_probs(samples[i], speed))).sum(-1).mean())

    before = [policy_kl(i) for i in range(len(samples))]
    steps = []
    lora = fit_speed(engine, speed, config, "tiny-llama", lambda s, loss: steps.append(loss))
    assert before[0] > 1e-3 and steps[0] == pytest.approx(before[0], rel=1e-4)
    with lora.applied(engine.adapter):
        after = [policy_kl(i) for i in range(len(samples))]
    assert sum(after) < 0.8 * sum(before), (before, after)
    with pytest.raises(ValueError, match="--loss"):
        SpeedFitConfig(loss="mse")


def test_cross_entropy_beside_self_distillation_uses_the_adapted_model_at_full_depth_as_teacher(tmp_path):
    """loss="ce+kl": each step's loss is the reply's cross entropy under SPEED plus KL(the adapter's
    own model at full depth || it under SPEED) (times `kl_weight`, 1.5 unless given), both computed here by hand with
    the weights the step saw (the second step's from the checkpoint written after the first); the
    teacher is the adapted model, not the base (a base teacher gives another loss at the second step)."""
    from kvforge.fill.lora import LoraAdapter
    from kvforge.fill.speed_fit import _fit_samples, reply_log_probs
    from kvforge.scoring import token_nll

    engine = Engine(tiny_loaded("llama"))
    speed, config = SpeedConfig(cut=2), SpeedFitConfig(steps=3, max_tokens=200, loss="ce+kl", lr=1e-2, rank=4)
    samples = _fit_samples(engine, config)

    @torch.no_grad()
    def by_hand(sample, teacher_adapted: bool, lora: LoraAdapter | None, kl_weight: float = 1.5) -> float:
        def log_probs(plan_speed, adapted):
            if adapted and lora is not None:
                with lora.applied(engine.adapter):
                    return reply_log_probs(engine, sample, plan_speed)
            return reply_log_probs(engine, sample, plan_speed)

        student, teacher = log_probs(speed, True), log_probs(None, teacher_adapted)
        kl = float((teacher.exp() * (teacher - student)).sum(-1).mean())
        return kl_weight * kl + float(token_nll(student, sample.ids[sample.prompt_tokens :]).mean())

    class Interrupt(Exception):
        pass

    def stop_after_one(step, _loss):
        raise Interrupt

    checkpoint = tmp_path / "speed.ckpt"
    with pytest.raises(Interrupt):
        fit_speed(Engine(tiny_loaded("llama")), speed, config, "tiny-llama", stop_after_one, checkpoint, checkpoint_every=1)
    after_one = LoraAdapter.new(engine.adapter, 4, config.alpha, "tiny-llama", engine.model.fingerprint, config.seed)
    for name, tensor in zip(after_one.tensors, torch.load(checkpoint, weights_only=True)["params"]):
        after_one.tensors[name] = tensor
    steps = []
    fit_speed(Engine(tiny_loaded("llama")), speed, config, "tiny-llama", lambda s, loss: steps.append(loss))
    assert steps[0] == pytest.approx(by_hand(samples[0], True, None), rel=1e-4)
    assert steps[1] == pytest.approx(by_hand(samples[1], True, after_one), rel=1e-4)
    assert abs(steps[1] - by_hand(samples[1], False, after_one)) > 1e-3
    weighted = []
    fit_speed(Engine(tiny_loaded("llama")), speed, SpeedFitConfig(steps=1, max_tokens=200, loss="ce+kl", rank=4, kl_weight=3.0),
              "tiny-llama", lambda s, loss: weighted.append(loss))
    assert weighted[0] == pytest.approx(by_hand(samples[0], True, None, kl_weight=3.0), rel=1e-4) and weighted[0] > steps[0] + 1e-3
    assert config.kl_weight == 1.5 and SpeedFitConfig(loss="ce").kl_weight is None  # the default applies to ce+kl only
    for bad in ({"kl_weight": 0}, {"kl_weight": 1.5, "loss": "ce"}, {"kl_weight": 1.0, "loss": "kl"}):
        with pytest.raises(ValueError, match="--kl-weight"):
            SpeedFitConfig(**bad)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_full_fine_tuning_deltas_equal_the_model_with_those_weights(family, tmp_path):
    """A rank-0 adapter on layers 2..3 carries a whole delta on every projection there (q/k/v,
    o, gate/up, down) and none below; its adapted engine gives the logits of the same model with
    the deltas written into transformers' own weights (what full fine-tuning would have saved),
    and survives a save/load round trip."""
    from conftest import tiny_hf_model

    engine = Engine(tiny_loaded(family))
    full = LoraAdapter.new(engine.adapter, 0, 1.0, engine.model.name, engine.model.fingerprint, layers=[2, 3])
    assert {key.rsplit(".", 2)[0] for key in full.tensors} == {"layers.2", "layers.3"}
    assert {key.split(".")[2] for key in full.tensors} == {"qkv", "o", "gate_up", "down"}
    g = torch.Generator().manual_seed(3)
    for value in full.tensors.values():
        value.add_(0.05 * torch.randn(value.shape, generator=g))
    full.save(tmp_path / "full.safetensors")
    loaded = LoraAdapter.load(tmp_path / "full.safetensors")
    assert loaded.rank == 0 and loaded.layers == (2, 3) and "full fine-tuning of layers 2..3" in loaded.kind
    prompt = _prompt(6)
    adapted = adapted_engine(engine, loaded)
    hf = tiny_hf_model(family)  # the same seed's weights, edited as a fine-tuned checkpoint would be
    with torch.no_grad():
        for layer in (2, 3):
            attn, mlp = hf.model.layers[layer].self_attn, hf.model.layers[layer].mlp
            qkv = full.delta(layer, "qkv").split([attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features])
            for proj, d in zip((attn.q_proj, attn.k_proj, attn.v_proj), qkv):
                proj.weight += d
            attn.o_proj.weight += full.delta(layer, "o")
            gate, up = full.delta(layer, "gate_up").chunk(2)
            mlp.gate_proj.weight += gate
            mlp.up_proj.weight += up
            mlp.down_proj.weight += full.delta(layer, "down")
        expected = hf(torch.tensor([prompt])).logits[0, -1]  # prefill returns the last position's
    got = adapted.prefill([prompt])[0][0]
    assert (got - expected).abs().max() < 1e-4
    assert (got - engine.prefill([prompt])[0][0]).abs().max() > 1e-2  # the deltas changed the model
    for layer in (0, 1):  # untouched below: the base engine's own tensors
        assert adapted.adapter.qkv[layer][0] is engine.adapter.qkv[layer][0]
        assert adapted.adapter.down[layer][0] is engine.adapter.down[layer][0]


def test_full_fine_tuning_above_the_cut_trains_only_those_layers():
    engine = Engine(tiny_loaded("llama"))
    config = SpeedFitConfig(steps=3, max_tokens=200, train="full-above-cut", lr=1e-3)
    lora = fit_speed(engine, SpeedConfig(cut=2), config, "tiny-llama")
    assert lora.rank == 0 and lora.layers == (2, 3) and lora.info["training"]["train"] == "full-above-cut"
    assert all(value.abs().sum() > 0 for value in lora.tensors.values())  # every projection above the cut moved
    everywhere = fit_speed(Engine(tiny_loaded("llama")), SpeedConfig(cut=2), SpeedFitConfig(steps=2, max_tokens=200, train="full"), "tiny-llama")
    assert everywhere.layers is None and {key.split(".")[1] for key in everywhere.tensors} == {"0", "1", "2", "3"}
    with pytest.raises(ValueError, match="--train"):
        SpeedFitConfig(train="half")
    with pytest.raises(ValueError, match="--lora-rank"):
        SpeedFitConfig(rank=0)


# Adapted bf16 against adapted fp32 under the same SPEED plan: measured at most 0.018 (llama)
# and 0.015 (gemma3) in logits (0.028 on another prompt); 0.1 leaves >3x margin and is far below
# the adapter's own effect on the logits (1.05-1.10 here), which the test also requires.
BF16_TOL = 0.1


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_an_fp32_adapter_runs_speed_on_a_bf16_engine(family):
    fp32 = Engine(tiny_loaded(family))
    bf16 = Engine(tiny_loaded(family, dtype=torch.bfloat16))
    lora = _lora(fp32)  # fp32 tensors, fitted against the fp32 fingerprint
    lora.check_model(bf16.model.name, bf16.model.fingerprint, bf16.num_layers)
    adapted32, adapted16 = adapted_engine(fp32, lora), adapted_engine(bf16, lora)
    for layer in range(bf16.num_layers):  # merged in fp32, rounded once to the model's dtype
        weight = bf16.adapter.qkv[layer][0]
        expected = (weight.float() + lora.delta(layer, "qkv")).to(torch.bfloat16)
        assert torch.equal(adapted16.adapter.qkv[layer][0], expected)
    prompt = _prompt(2)
    plan = speed_plan(T, SpeedConfig(cut=2, first=1, tail=3), bf16.num_layers)
    logits32, _ = adapted32.prefill([prompt], plan=plan)
    logits16, cache16 = adapted16.prefill([prompt], plan=plan)
    assert {cache16[layer].keys().dtype for layer in range(bf16.num_layers)} == {torch.bfloat16}
    assert cache16[3].row_positions()[0].tolist() == [0, T - 3, T - 2, T - 1]
    assert (logits16 - logits32).abs().max() < BF16_TOL
    assert (logits16 - bf16.prefill([prompt], plan=plan)[0]).abs().max() > 3 * BF16_TOL
    with torch.inference_mode(), lora.applied(bf16.adapter):  # the training path merges the same way
        assert torch.equal(bf16.prefill([prompt], plan=plan)[0], logits16)
    out = adapted16.generate(prompt, GenerationConfig(max_new_tokens=6, ignore_eos=True), plan=plan)[0]
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("family, refusal", [("qwen3_moe", "mixtures of experts"), ("qwen3_5", "Gated DeltaNet")])
def test_lora_refuses_layers_it_cannot_cover(family, refusal):
    engine = Engine(tiny_loaded(family))
    with pytest.raises(ValueError, match=refusal):
        LoraAdapter.new(engine.adapter, 4, 8.0, "tiny", engine.model.fingerprint)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_shallow_rows_never_enter_a_recurrent_state_above_the_cut(family):
    """SPEED on a hybrid: above the cut a shallow row is absent from a linear-attention layer too --
    its update is skipped, so the state is the one the full-depth rows alone leave, in order."""
    engine = Engine(tiny_loaded(family))
    config = SpeedConfig(cut=1, first=1, rows=(7,), tail=3)
    prompt = _prompt(2)
    _, cache = engine.prefill([prompt], plan=speed_plan(T, config, engine.num_layers))
    full = torch.tensor([0, 7, T - 3, T - 2, T - 1])
    with torch.inference_mode():  # layer 1 by hand: the full-depth rows' exact inputs, alone
        ids, positions = torch.tensor([prompt]), torch.arange(T).unsqueeze(0)
        reference = engine.new_cache(1, T)
        h = engine.adapter.embed(ids)
        h = engine.run_layer(0, h, positions, reference, engine.adapter.rope(h, positions))
        engine.run_layer(1, h[:, full], positions[:, full], reference, engine.adapter.rope(h[:, full], positions[:, full]))
    assert cache[1].row_positions()[0].tolist() == full.tolist()
    assert (cache[1].state - reference[1].state).abs().max() < 1e-5
    assert (cache[1].conv - reference[1].conv).abs().max() < 1e-5


def test_an_adapter_stored_in_bf16_is_half_the_file_and_loads_as_float32(tmp_path):
    engine = Engine(tiny_loaded("llama"))
    lora = _lora(engine)
    lora.save(tmp_path / "fp32.safetensors")
    lora.save(tmp_path / "bf16.safetensors", storage=torch.bfloat16)
    assert (tmp_path / "bf16.safetensors").stat().st_size < 0.6 * (tmp_path / "fp32.safetensors").stat().st_size
    loaded = LoraAdapter.load(tmp_path / "bf16.safetensors")
    for key, value in lora.tensors.items():
        assert loaded.tensors[key].dtype == torch.float32 and torch.equal(loaded.tensors[key], value.to(torch.bfloat16).float())


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_a_speed_prefill_in_chunks_leaves_the_rows_one_pass_does(family):
    """SPEED's row depths are known from the prompt's length, so its plan runs in chunks (the
    server's chunked prefill): each layer holds the same rows, the logits and the greedy
    continuation are those of one pass (a hybrid's recurrent state carried across chunks too)."""
    engine = Engine(tiny_loaded(family))
    prompt = [3 + (i * 7) % 90 for i in range(100)]
    plan = speed_plan(len(prompt), SpeedConfig(cut=2, first=2, tail=6), engine.num_layers)
    whole_logits, whole = engine.prefill([prompt], plan=plan)
    passes, run_plan_steps = [], engine.run_plan_steps
    engine.run_plan_steps = lambda ids, *rest: passes.append(ids.shape[1]) or run_plan_steps(ids, *rest)
    chunked_logits, chunked = engine.prefill([prompt], plan=plan, chunk_size=8)
    del engine.run_plan_steps
    assert passes == [8] * 12 + [4]  # the plan ran in chunks
    for layer in range(engine.num_layers):
        if not isinstance(whole[layer], RecurrentLayerCache):
            assert torch.equal(whole[layer].row_positions(), chunked[layer].row_positions())
    assert whole[engine.num_layers - 1].row_positions().shape[1] == 8  # above the cut: anchors and tail only
    assert torch.allclose(whole_logits, chunked_logits, atol=1e-4)
    config = GenerationConfig(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    from dataclasses import replace

    assert engine.generate(prompt, replace(config, chunk_size=8), plan=plan)[0].token_ids == engine.generate(prompt, config, plan=plan)[0].token_ids

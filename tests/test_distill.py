"""KV-Lingo stage 2 (self-distillation) on a tiny cross-family pair sharing a tokenizer."""

import copy
import dataclasses
import math

import pytest
import torch

from conftest import tiny_loaded
from kvforge.engine import Engine
from kvforge.errors import ArtifactError, KvforgeError
from kvforge.evaluate.lingo import HeldOutBpb, LingoEvalSettings, eval_lingo
from kvforge.scoring import continuation_logits
from kvforge.translate.distill import DistillConfig, distill, prepare, student_kl, student_logits, trainable
from kvforge.translate.fit import LingoFitConfig, fit_lingo
from kvforge.translate.capture import own_tokens
from kvforge.translate.handoff import translate_cache
from kvforge.translate.split import split_text
from kvforge.translate.translator import Translator

TEXTS = [
    ("User: name three colours.\n\nAssistant: red, green and blue are three colours.", len("User: name three colours.\n\nAssistant:")),
    ("User: count to five please.\n\nAssistant: one, two, three, four, five.", len("User: count to five please.\n\nAssistant:")),
]


@pytest.fixture(scope="module")
def setup():
    source, target = Engine(tiny_loaded("gemma3", seed=1)), Engine(tiny_loaded("llama", seed=2))
    translator = fit_lingo(source, target, LingoFitConfig(assign="depth", nu=1, conversations=2, max_chars=300))
    samples = [prepare(translator, source, target, text, cut, top_k=8) for text, cut in TEXTS]
    return source, target, translator, samples


def test_samples_hold_the_teacher_once_and_split_at_the_reply(setup):
    _, target, _, samples = setup
    for (text, cut), s in zip(TEXTS, samples):
        assert s.prefix == cut + 1  # one token per character here: the prefix ends with the space after "Assistant:"
        assert s.teacher_logp.shape == s.teacher_index.shape == (len(s.target_ids) - s.prefix, 8)
        torch.testing.assert_close(s.teacher_logp.exp().sum(-1), torch.ones(s.teacher_logp.shape[0]))


def test_a_few_steps_lower_the_kl_and_touch_only_the_maps(setup):
    source, target, translator, samples = setup
    tr = copy.deepcopy(translator)
    with torch.no_grad():
        before = [float(student_kl(tr, target, s)) for s in samples]
    calls = []
    original = target.prefill
    target.prefill = lambda prompts, *a, **k: calls.append(len(prompts[0])) or original(prompts, *a, **k)
    try:
        tr, state = distill(tr, target, samples, samples, DistillConfig(steps=6, lr=3e-3, accumulate=2, warmup_fraction=0.2, validate_every=3))
    finally:
        target.prefill = original
    with torch.no_grad():
        after = [float(student_kl(tr, target, s)) for s in samples]
    assert sum(after) < sum(before)
    assert calls and all(n <= max(s.head for s in samples) for n in calls)  # head rows only: no teacher prefill again
    assert [step for step, _ in state.validation] == [0, 3, 6] and tr.info["stage"] == 2
    assert state.validation[-1][1] < state.validation[0][1]
    assert all(p.grad is None for p in target.model.hf.parameters())


def test_gradients_reach_the_maps(setup):
    _, target, translator, samples = setup
    tr = copy.deepcopy(translator)
    params = trainable(tr)
    student_kl(tr, target, samples[0]).backward()
    assert all(p.grad is not None for p in params) and any(float(p.grad.abs().sum()) > 0 for p in params)


class Interrupt(Exception):
    pass


def stop_at_two(state, _seconds):
    """A progress callback that stops a run after its second step, as a killed process would."""
    if state.step == 2:
        raise Interrupt


def test_resume_from_a_checkpoint_continues_identically(setup, tmp_path):
    _, target, translator, samples = setup
    config = DistillConfig(steps=4, lr=1e-3, accumulate=1, checkpoint_every=2, validate_every=100)
    straight, straight_state = distill(copy.deepcopy(translator), target, samples, [], config)

    checkpoint = tmp_path / "ckpt.pt"
    with pytest.raises(Interrupt):
        distill(copy.deepcopy(translator), target, samples, [], config, checkpoint, stop_at_two)
    saved = torch.load(checkpoint, weights_only=True)  # plain tensors, numbers and lists only
    assert saved["state"]["step"] == 2 and saved["format"] == "kvforge.distill-checkpoint"
    resumed, state = distill(copy.deepcopy(translator), target, samples, [], config, checkpoint)
    assert state.step == 4 and len(state.losses) == 4
    assert state.losses == straight_state.losses  # the same steps, to the bit
    for side in "kv":
        for store in ("weights", "biases"):
            for a, b in zip(getattr(straight, store)[side], getattr(resumed, store)[side]):
                torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="other settings"):
        distill(copy.deepcopy(translator), target, samples, [], DistillConfig(steps=5, lr=1e-3), checkpoint)
    # In pieces: paused at step 3 with the checkpoint written there, then on to the end, to the bit.
    pieces = tmp_path / "pieces.pt"
    paused, first = distill(copy.deepcopy(translator), target, samples, samples, config, pieces, pause_at=3)
    assert first.step == 3 and paused.info["distill"]["step"] == 3 and torch.load(pieces, weights_only=True)["state"]["step"] == 3
    assert [step for step, _ in first.validation] == [0, 3]  # validated where it paused
    _, rest = distill(copy.deepcopy(translator), target, samples, samples, config, pieces)
    assert rest.losses == straight_state.losses and [step for step, _ in rest.validation] == [0, 3, 4]
    with pytest.raises(ValueError, match="at step 4 already"):
        distill(copy.deepcopy(translator), target, samples, [], config, pieces, pause_at=2)


class _RunsCode:
    """Pickles as a call to os.system: what a hostile checkpoint would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", ["bare", "inside_a_checkpoint"])
def test_a_checkpoint_that_would_run_code_is_refused_in_one_line(setup, tmp_path, payload):
    _, target, translator, samples = setup
    config = DistillConfig(steps=2, lr=1e-3, accumulate=1, checkpoint_every=1, validate_every=100)
    checkpoint, marker = tmp_path / "ckpt.pt", tmp_path / "pwned"
    if payload == "bare":
        torch.save(_RunsCode(marker), checkpoint)
    else:  # a real checkpoint with one object slipped in
        distill(copy.deepcopy(translator), target, samples, [], config, checkpoint)
        saved = torch.load(checkpoint, weights_only=True)
        saved["state"]["losses"].append(_RunsCode(marker))
        torch.save(saved, checkpoint)
    with pytest.raises(ArtifactError) as error:
        distill(copy.deepcopy(translator), target, samples, [], config, checkpoint)
    assert isinstance(error.value, KvforgeError) and "\n" not in str(error.value) and str(checkpoint) in str(error.value)
    assert "could run code; refused" in str(error.value)
    assert not marker.exists()


def test_a_checkpoint_that_is_not_one_is_refused(setup, tmp_path):
    _, target, translator, samples = setup
    config = DistillConfig(steps=2, lr=1e-3, accumulate=1)
    for name, content in (("garbage.pt", b"not a checkpoint at all"), ("other.pt", None)):
        path = tmp_path / name
        if content is None:
            torch.save({"params": [], "config": {}}, path)  # loads, but is not ours
        else:
            path.write_bytes(content)
        with pytest.raises(ArtifactError, match="not a version-2 kvforge distillation checkpoint") as error:
            distill(copy.deepcopy(translator), target, samples, [], config, path)
        assert "could run code" not in str(error.value)


def test_the_sweep_extends_past_an_edge_until_the_best_rate_is_interior(setup, monkeypatch):
    _, target, translator, samples = setup
    import kvforge.translate.distill as distill_module

    tried = []

    def fake_distill(tr, tgt, train, validation, config, *a, **k):  # validation KL a bowl with its floor at 1e-5
        tried.append(config.lr)
        return tr, distill_module.DistillState(step=config.steps, validation=[(config.steps, (math.log10(config.lr) + 5) ** 2)])

    monkeypatch.setattr(distill_module, "distill", fake_distill)
    rates = distill_module.half_decade_rates(1e-3)
    assert [round(math.log10(r), 6) for r in rates] == [-4.0, -3.5, -3.0, -2.5, -2.0]
    results = distill_module.sweep_learning_rates(translator, target, samples, samples, DistillConfig(steps=1), rates)
    lrs = [r for r, _ in results]
    best = min(results, key=lambda r: r[1])[0]
    assert math.isclose(best, 1e-5) and lrs[0] < best < lrs[-1] and len(lrs) == 8  # three added below the window: 3e-5, 1e-5, then 3e-6 shows 1e-5 is a floor


def test_a_streamed_run_prepares_each_sample_once_when_its_step_comes(setup, tmp_path):
    """`stream`: the samples are read in order, each once, prepared as its step reads it and not
    kept; the run is the fixed-set run over the same samples in that order, to the bit."""
    from kvforge.translate.distill import PreparedOnUse

    source, target, translator, _ = setup
    texts = TEXTS * 2
    lazy = PreparedOnUse(translator, source, target, iter(texts), len(texts), top_k=8)
    prepared = []
    original = lazy.__class__.__getitem__
    lazy.__class__.__getitem__ = lambda self, i: prepared.append(i) or original(self, i)
    try:
        config = DistillConfig(steps=2, lr=1e-3, accumulate=2, samples=4, stream=True, validate_every=100)
        streamed, state = distill(copy.deepcopy(translator), target, lazy, [], config)
    finally:
        lazy.__class__.__getitem__ = original
    assert prepared == [0, 1, 2, 3]  # in order, once each
    in_order = [prepare(translator, source, target, text, cut, top_k=8) for text, cut in texts]
    again, same = distill(copy.deepcopy(translator), target, in_order, [], config)
    assert state.losses == same.losses
    for side in "kv":
        for a, b in zip(streamed.weights[side], again.weights[side]):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="steps x accumulate"):
        DistillConfig(steps=2, accumulate=2, samples=3, stream=True)
    # in pieces: paused at step 1 with its checkpoint, then on with a fresh draw, to the bit
    pieces = tmp_path / "streamed.pt"
    distill(copy.deepcopy(translator), target, PreparedOnUse(translator, source, target, iter(texts), len(texts), top_k=8), [], config,
            pieces, pause_at=1)
    resumed = PreparedOnUse(translator, source, target, iter(texts), len(texts), top_k=8)
    rest, rest_state = distill(copy.deepcopy(translator), target, resumed, [], config, pieces)
    assert rest_state.losses == state.losses and len(resumed.drawn) == 4
    for side in "kv":
        for a, b in zip(streamed.weights[side], rest.weights[side]):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    short = PreparedOnUse(translator, source, target, iter(TEXTS), 4, top_k=8)  # the conversations run out before the steps do
    assert short[1].prefix > 0
    with pytest.raises(ValueError, match="hold 2 samples"):
        short[2]


def test_layer_wise_targets_add_each_layers_error_against_the_targets_own_rows(setup):
    """`layer_weight`: the loss is the KL plus the weight times the mean relative squared error of
    the translated rows against the target's own rows of the same prefix, over every layer, keys
    and values; at the native rows themselves the term is 0, and training on it moves the maps
    toward them (the error falls)."""
    from kvforge.translate.distill import student_loss

    source, target, translator, _ = setup
    text, cut = TEXTS[0]
    sample = prepare(translator, source, target, text, cut, top_k=8, layer_targets=True)
    assert sample.native_rows is not None and len(sample.native_rows["k"]) == target.num_layers
    assert sample.native_rows["k"][0].dtype == torch.bfloat16 and sample.native_rows["k"][0].shape[1] == sample.native_from - sample.head
    with torch.no_grad():
        kl = float(student_kl(translator, target, sample))
        half, one = float(student_loss(translator, target, sample, 0.5)), float(student_loss(translator, target, sample, 1.0))
    assert half > kl and math.isclose(one - kl, 2 * (half - kl), rel_tol=1e-4)  # linear in the weight
    error = one - kl
    # by hand: the translated rows of a hand-off's cache against the target's own cache
    split = split_text(source, target, text, cut + 1, translator.align)
    translated = translate_cache(translator, source, target, split.source_cache, split.alignment, split.tgt.ids)
    own = target.prefill([split.tgt.ids[: sample.prefix - 1]], logits="none")[1]
    by_hand = []
    for layer in range(target.num_layers):
        for got, want in ((translated[layer].keys(), own[layer].keys()), (translated[layer].values(), own[layer].values())):
            got, want = got[0, :, sample.head : sample.native_from].float(), want[0, :, sample.head : sample.native_from].bfloat16().float()
            by_hand.append(float((got - want).pow(2).mean() / want.pow(2).mean()))
    assert math.isclose(error, sum(by_hand) / len(by_hand), rel_tol=1e-3)
    exact = dataclasses.replace(sample, native_rows={side: [(translated[l].keys() if side == "k" else translated[l].values())[0, :, sample.head : sample.native_from]
                                                            .to(torch.bfloat16) for l in range(target.num_layers)] for side in "kv"})
    with torch.no_grad():
        assert float(student_loss(translator, target, exact, 1.0)) - kl < 1e-4  # its own rows as the targets: ~0 (bf16 targets)
    tr = copy.deepcopy(translator)
    config = DistillConfig(steps=4, lr=3e-3, accumulate=1, samples=1, layer_weight=1.0, warmup_fraction=0.25, validate_every=100)
    tr, state = distill(tr, target, [sample], [], config)
    with torch.no_grad():
        assert float(student_loss(tr, target, sample, 1.0)) < one
    with pytest.raises(ValueError, match="layer_targets"):
        student_loss(translator, target, prepare(translator, source, target, text, cut, top_k=8), 1.0)
    with pytest.raises(ValueError, match="layer-weight"):
        DistillConfig(layer_weight=-1.0)


def test_training_texts_read_around_the_conversations_they_are_told_to_avoid():
    from kvforge.translate.samples import training_texts

    first, read = training_texts("fit", 3, 2000, 3000, 200, packed_fraction=0.0)
    around, _ = training_texts("fit", 3, 2000, 3000, 200, packed_fraction=0.0, avoid=range(0, read))
    assert not {t for t, _ in first} & {t for t, _ in around}
    # natural samples, one conversation each: avoiding all but the first one's conversation keeps that one sample
    one, upto = training_texts("fit", 1, 2000, 3000, 200, packed_fraction=0.0)
    kept, _ = training_texts("fit", 1, 2000, 3000, 200, packed_fraction=0.0, avoid=range(upto, read))
    assert kept == one
    moved, _ = training_texts("fit", 1, 2000, 3000, 200, packed_fraction=0.0, avoid=range(upto - 1, read))
    assert moved != one
    assert training_texts("fit", 0, 2000, 3000, 200) == ([], 0)


def test_training_texts_mix_packed_and_natural_samples_disjointly():
    from kvforge.translate.samples import training_texts

    train, read = training_texts("fit", 6, 2000, 3000, 200)
    later, _ = training_texts("fit", 2, 2000, 3000, 200, skip=read)
    assert len(train) == 6 and not {t for t, _ in train} & {t for t, _ in later}
    for text, cut in train + later:
        assert text[:cut].endswith("\n\nAssistant:") and cut <= 3000 and len(text) - cut <= 201


def test_a_packed_sample_lifts_one_question_to_the_end_and_drops_its_answer():
    import random

    from kvforge.translate.samples import packed_sample

    group = [[("what is a?", "a is the first letter of it all")], [("what is b?", "b is the second letter, after a"), ("and c?", "c is the third one, after b")]]
    text, cut = packed_sample(group, random.Random(1), 100)
    prefix, reply = text[:cut], text[cut:].strip()
    question = next(q for ex in group for q, a in ex if a == reply)
    assert prefix.endswith(f"User: {question}\n\nAssistant:") and prefix.count(question) == 1 and reply not in prefix
    assert all(a in prefix for ex in group for _, a in ex if a != reply)


def test_one_step_lowers_the_kl_on_a_fixed_tiny_batch(setup):
    _, target, translator, samples = setup
    tr = copy.deepcopy(translator)
    with torch.no_grad():
        before = sum(float(student_kl(tr, target, s)) for s in samples)
    tr, state = distill(tr, target, samples, [], DistillConfig(steps=1, lr=1e-3, accumulate=len(samples)))
    with torch.no_grad():
        after = sum(float(student_kl(tr, target, s)) for s in samples)
    assert state.step == 1 and after < before


def test_stage_two_trains_the_own_token_part_of_a_map(setup):
    source, target, _, _ = setup
    tr = fit_lingo(source, target, LingoFitConfig(assign="depth", nu=1, conversations=2, max_chars=300, own_tokens=2))
    sample = prepare(tr, source, target, *TEXTS[0], top_k=8)
    params = trainable(tr)
    student_kl(tr, target, sample).backward()
    own_rows = slice(tr.weights["v"][0].shape[1] - 2 * target.adapter.embed(torch.tensor([[0]])).shape[-1], None)
    assert all(float(p.grad[:, own_rows].abs().sum()) > 0 for p in params if p.dim() == 3)  # every map's own-token rows


@pytest.mark.parametrize("tail", [0, 10, 1000])
def test_the_student_sees_the_cache_a_hand_off_with_that_native_tail_serves(setup, tail):
    source, target, translator, _ = setup
    text, cut = TEXTS[0]
    sample = prepare(translator, source, target, text, cut, top_k=8, native_tail=tail)
    split = split_text(source, target, text, cut + 1, translator.align)
    with torch.no_grad():
        served = translate_cache(translator, source, target, split.source_cache, split.alignment, split.tgt.ids, native_tail=tail)
        expected = continuation_logits(target, split.tgt.ids, split.target_prefix, served)
        student = student_logits(translator, target, sample)
    torch.testing.assert_close(student, expected)
    translated = sample.native_from - sample.head
    assert translated == max(0, sample.prefix - 1 - sample.head - tail)
    if tail >= sample.prefix:  # nothing translated: the student is the target on its own cache
        native = continuation_logits(target, split.tgt.ids, split.target_prefix, split.native_cache)
        torch.testing.assert_close(student, native, rtol=1e-4, atol=1e-4)


def test_gradients_reach_the_maps_through_a_native_tail(setup):
    source, target, translator, _ = setup
    tr = copy.deepcopy(translator)
    sample = prepare(tr, source, target, *TEXTS[1], top_k=8, native_tail=10)
    assert sample.head < sample.native_from < sample.prefix - 1
    params = trainable(tr)
    student_kl(tr, target, sample).backward()
    assert any(float(p.grad.abs().sum()) > 0 for p in params)


def test_a_negative_native_tail_is_refused():
    with pytest.raises(ValueError, match="native-tail"):
        DistillConfig(native_tail=-1)


def test_a_sample_whose_tail_covers_every_row_trains_nothing_and_breaks_nothing(setup):
    source, target, translator, _ = setup
    tr = copy.deepcopy(translator)
    covered = [prepare(tr, source, target, text, cut, top_k=8, native_tail=1000) for text, cut in TEXTS]
    assert all(s.native_from == s.head for s in covered)
    before = [w.clone() for w in tr.weights["k"]]
    tr, state = distill(tr, target, covered, [], DistillConfig(steps=1, lr=1e-3, accumulate=2))
    assert state.step == 1 and all(torch.equal(a, b) for a, b in zip(before, tr.weights["k"]))


def test_a_checkpoint_without_the_native_tail_setting_resumes_at_tail_0_only(setup, tmp_path):
    _, target, translator, samples = setup
    checkpoint = tmp_path / "ckpt.pt"
    config = DistillConfig(steps=2, lr=1e-3, accumulate=1)
    distill(copy.deepcopy(translator), target, samples, [], config, checkpoint)
    assert "native_tail" not in torch.load(checkpoint, weights_only=True)["config"]  # as checkpoints from before the field
    _, state = distill(copy.deepcopy(translator), target, samples, [], config, checkpoint)  # resumed (finished): no step runs
    assert state.step == 2 and len(state.losses) == 2
    with pytest.raises(ValueError, match="other settings"):
        distill(copy.deepcopy(translator), target, samples, [], DistillConfig(steps=2, lr=1e-3, accumulate=1, native_tail=8), checkpoint)


def test_a_held_out_score_is_taken_at_its_steps_and_resumes_with_the_run(setup, tmp_path):
    _, target, translator, samples = setup
    scored = []

    def score(tr):
        scored.append(float(tr.weights["k"][0].detach().sum()))
        return scored[-1]

    config = DistillConfig(steps=4, lr=1e-3, accumulate=1, checkpoint_every=2, validate_every=100)
    straight, state = distill(copy.deepcopy(translator), target, samples, [], config, heldout=score, heldout_every=3)
    assert [step for step, _ in state.heldout] == [0, 3, 4] and [v for _, v in state.heldout] == scored
    assert scored[0] != scored[-1] and straight.info["distill"]["heldout"] == state.heldout

    checkpoint = tmp_path / "ckpt.pt"
    with pytest.raises(Interrupt):
        distill(copy.deepcopy(translator), target, samples, [], config, checkpoint, stop_at_two, heldout=score, heldout_every=1)
    # Resumed under another interval (not a training setting): the scores taken before come back; on
    # other held-out settings the run is refused.
    with pytest.raises(ValueError, match="same held-out settings"):
        distill(copy.deepcopy(translator), target, samples, [], config, checkpoint, heldout=score, heldout_every=3, heldout_setting="other")
    _, resumed = distill(copy.deepcopy(translator), target, samples, [], config, checkpoint, heldout=score, heldout_every=3)
    assert [step for step, _ in resumed.heldout] == [0, 1, 2, 3, 4] and resumed.losses == state.losses


def test_the_held_out_curve_scores_what_eval_lingo_scores(setup):
    source, target, translator, _ = setup
    settings = LingoEvalSettings(samples=2, prefix_chars=200, continuation_chars=60)
    report = eval_lingo(translator, source, target, settings)
    curve = HeldOutBpb(source, target, translator.align, settings)
    assert curve(translator) == pytest.approx(report["bpb_target_translated"], rel=1e-9)
    reference = curve.reference()
    assert reference["target_native"] == pytest.approx(report["bpb_target_native"], rel=1e-9)
    assert reference["source_native"] == pytest.approx(report["bpb_source_native"], rel=1e-9)


def test_a_residual_branch_starts_at_the_linear_maps_and_trains(setup, tmp_path):
    """The nonlinear translator: a residual branch whose output starts at zero translates exactly
    as the linear maps do; stage 2 trains both (the branch's `up` leaves zero, then `down` moves),
    lowers the KL, and the file (format 2) reads back the same translation, in float32 and bf16."""
    _, target, translator, samples = setup
    wide = translator.with_residual(16, seed=0)  # the start `distill` makes (its config's seed)
    s0 = samples[0]
    aligned = s0.aligned
    own = own_tokens(target, s0.target_ids, s0.head, next(iter(aligned["k"].values())).shape[0], translator.own_tokens)
    for side in "kv":
        torch.testing.assert_close(wide.apply(side, 1, aligned[side], own), translator.apply(side, 1, aligned[side], own), atol=0, rtol=0)
    assert wide.macs_per_token() > translator.macs_per_token() and translator.residual == 0 and wide.residual == 16
    with torch.no_grad():
        before = sum(float(student_kl(translator, target, s)) for s in samples)
    config = DistillConfig(steps=6, lr=3e-3, accumulate=2, warmup_fraction=0.2, validate_every=100, residual=16)
    kept = [t.clone() for t in translator.weights["k"]]
    trained, _ = distill(translator, target, samples, [], config)
    assert all(torch.equal(a, b) for a, b in zip(kept, translator.weights["k"])) and translator.residual == 0  # the caller's maps untouched
    with torch.no_grad():
        after = sum(float(student_kl(trained, target, s)) for s in samples)
    assert after < before and trained.residual == 16 and all(bool(u.abs().sum() > 0) for u in trained.up["k"])
    assert any(not torch.equal(a, b) for a, b in zip(trained.down["k"], wide.down["k"]))  # `down` moved once `up` had
    path = trained.save(tmp_path / "residual.safetensors")
    loaded = Translator.load(path)
    assert loaded.residual == 16
    for side in "kv":
        with torch.no_grad():
            exact = trained.apply(side, 2, aligned[side], own)
            torch.testing.assert_close(loaded.apply(side, 2, aligned[side], own), exact, atol=0, rtol=0)
            half = loaded.in_dtype(torch.bfloat16).apply(side, 2, {l: f.bfloat16() for l, f in aligned[side].items()}, own)
        torch.testing.assert_close(half.float(), exact, atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match="width 16 already"):
        trained.with_residual(8)


def test_a_residual_branch_needs_a_head_mixing_translator(setup):
    _, _, translator, _ = setup
    with pytest.raises(ValueError, match="head-mixing"):
        dataclasses.replace(translator, head_wise=True).with_residual(4)

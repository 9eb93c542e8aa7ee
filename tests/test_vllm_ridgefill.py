"""RidgeFill inside a real vLLM engine (tiny random llama): vLLM's RidgeFill prefill is kvforge's
(same rows kept exact, first-token logits within 1e-3, same greedy continuation), decoding runs
kvforge's decode-time rescue (the tokens of `generate --method ridgefill` with it, alone and
batched), the switch and short prompts give vLLM's exact path, a batch of prompts in one step is
planned per prompt, kvforge's n-gram proposer decodes losslessly over the forged cache and ends
its drafts before a token that would trigger a rescue, and a scored continuation (`score_tokens`)
gets kvforge's teacher-forced logits over its RidgeFill cache.

Two engines for the module: `served` (RidgeFill, raw logits as logprobs) and `drafting`
(RidgeFill and kvforge's proposer).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if os.environ.get("KVFORGE_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from kvforge.engine import Engine  # noqa: E402
from kvforge.errors import KvforgeError  # noqa: E402
from kvforge.fill.calibrate import CalibrationConfig, fit_ridgefill  # noqa: E402
from kvforge.fill.rescue import RescueConfig  # noqa: E402
from kvforge.fill.ridgefill import resolve, ridgefill_plan  # noqa: E402
from kvforge.models import load_model  # noqa: E402
from kvforge.plan import final_depth  # noqa: E402
from kvforge.vllm import speculative_config  # noqa: E402
from kvforge.vllm.engine import close_llm, generate, spec_counters, start_llm  # noqa: E402
from kvforge.vllm.proposer import LIVE  # noqa: E402
from kvforge.vllm.ridgefill import ARCHITECTURE, SETTINGS, engine_args, ridgefill_stats, set_ridgefill  # noqa: E402

from test_vllm import MAX_LEN, save_tiny_llama  # noqa: E402

SETTING = {"split": 2, "tail": 32, "attended_rows": 4}
# a rescue on every prompt token a decoded token repeats (kvforge's default asks for two in a row),
# so the tiny model's decoding rescues often and the tokens depend on it
RESCUE = {"ngram": 1, "window": 8, "recent": 2}


def fit_maps(model_dir, path):
    engine = Engine(load_model(str(model_dir), dtype="fp32"))
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 90, (64,), generator=g).tolist() for _ in range(40)]
    maps = fit_ridgefill(engine, CalibrationConfig(splits=(2,), tokens=40 * 60, seq_len=64, lam=1e-3, normed_target=True), engine.model.name, sequences=sequences)
    maps.save(path)
    return engine


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-ridgefill")
    model_dir = save_tiny_llama(root / "model")
    engine = fit_maps(model_dir, root / "maps.safetensors")
    config, maps = resolve(engine, root / "maps.safetensors", **SETTING)
    return model_dir, root / "maps.safetensors", engine, replace(config, rescue=RescueConfig(**RESCUE)), maps


@pytest.fixture(scope="module")
def served(setup):
    model_dir, maps_path = setup[:2]
    llm = start_llm(model_dir, torch.float32, **engine_args(maps_path, max_model_len=MAX_LEN, rescue=RESCUE, **SETTING), max_num_seqs=4,
                    logprobs_mode="raw_logits")
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def drafting(setup, served):
    model_dir, maps_path = setup[:2]
    llm = start_llm(model_dir, torch.float32, **engine_args(maps_path, max_model_len=MAX_LEN, rescue=RESCUE, **SETTING), max_num_seqs=4,
                    speculative_config=speculative_config(k=4, gate=False), disable_log_stats=False)
    yield llm
    close_llm(llm)


def long_prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    loop = [3 + (i % 13) for i in range(24)]  # something to copy, so the drafter has work
    body = torch.randint(3, 90, (length - 1 - 2 * len(loop),), generator=g).tolist()
    return [1] + loop + body + loop


def params(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **extra)


def kvforge_ridgefill(engine, config, maps, prompt):
    plan = ridgefill_plan(engine, prompt, config, maps)
    logits, cache = engine.prefill([prompt], plan=plan)
    return logits[0], final_depth(cache, len(prompt)) == engine.num_layers


def assert_logits_match(logprobs: dict, logits: torch.Tensor, tol: float = 1e-3):
    """vLLM's top raw logits (logprobs_mode raw_logits) against kvforge's logits."""
    assert logprobs
    for token, lp in logprobs.items():
        assert abs(lp.logprob - logits[token].item()) < tol, (token, lp.logprob, logits[token].item())


def test_vllm_ridgefill_is_kvforges_ridgefill(setup, served):
    _, _, engine, config, maps = setup
    prompt = long_prompt(300, 0)
    logits, exact_rows = kvforge_ridgefill(engine, config, maps, prompt)
    exact_logits = engine.prefill([prompt])[0][0]
    assert (logits - exact_logits).abs().max() > 1e-2  # the fill changes the logits: the comparison below can fail
    out = generate(served, [prompt], params(logprobs=5))[0].outputs[0]
    record = ridgefill_stats(served)[0].last[0]
    assert record.reason is None and record.filled_rows == int((~exact_rows).sum()) > 100
    assert torch.equal(record.exact.cpu(), exact_rows)  # the same rows kept exact, attended rows included
    assert_logits_match(out.logprobs[0], logits)
    continuation = engine.generate([prompt], _greedy_config(24), plan=ridgefill_plan(engine, prompt, config, maps))[0].token_ids
    assert list(out.token_ids) == list(continuation)


def _greedy_config(n: int):
    from kvforge.generation import GenerationConfig

    return GenerationConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def test_decoding_rescues_filled_rows_as_kvforge_does_alone_and_batched(setup, served):
    """The class's decode-time rescue is kvforge's: the tokens `generate --method ridgefill`
    decodes with its rescue (which differ from those without it), for a request alone and for two
    decoding in one batch."""
    _, _, engine, config, maps = setup
    batch = [long_prompt(250, 6), long_prompt(240, 7)]  # 490 tokens: prefilled in one step, then decoded together
    rescued = [engine.generate([p], _greedy_config(24), plan=ridgefill_plan(engine, p, config, maps))[0] for p in batch]
    plain = [engine.generate([p], _greedy_config(24), plan=ridgefill_plan(engine, p, replace(config, rescue=None), maps))[0] for p in batch]
    assert all(r.rescued_rows > 0 and r.token_ids != p.token_ids for r, p in zip(rescued, plain))  # the rescue changes the tokens
    before = ridgefill_stats(served)[0].rescued_rows
    alone = [list(generate(served, [p], params())[0].outputs[0].token_ids) for p in batch]
    together = [list(o.outputs[0].token_ids) for o in generate(served, batch, params())]
    assert [r.tokens for r in ridgefill_stats(served)[0].last] == [250, 240]
    assert alone == together == [list(r.token_ids) for r in rescued]
    assert ridgefill_stats(served)[0].rescued_rows - before == 2 * sum(r.rescued_rows for r in rescued)
    try:  # switched off for the prompts filled from then on: kvforge's --no-rescue
        set_ridgefill(served, True, rescue=False)
        unrescued = [list(o.outputs[0].token_ids) for o in generate(served, batch, params())]
    finally:
        set_ridgefill(served, True, rescue=True)
    assert unrescued == [list(p.token_ids) for p in plain]


def test_switched_off_and_short_prompts_run_vllms_exact_prefill(setup, served):
    _, _, engine, _, _ = setup
    prompt, short = long_prompt(300, 1), long_prompt(60, 2)[-30:]  # 30 tokens: no longer than sinks + tail
    try:
        set_ridgefill(served, False)
        off = generate(served, [prompt], params(logprobs=5))[0].outputs[0]
    finally:
        set_ridgefill(served, True)
    assert_logits_match(off.logprobs[0], engine.prefill([prompt])[0][0])
    before = ridgefill_stats(served)[0].exact_prefills
    out = generate(served, [short], params(logprobs=5))[0].outputs[0]
    assert ridgefill_stats(served)[0].exact_prefills == before + 1
    assert_logits_match(out.logprobs[0], engine.prefill([short])[0][0])


def test_prompts_prefilled_in_one_step_are_planned_each_on_its_own(setup, served):
    _, _, engine, config, maps = setup
    batch = [long_prompt(200, 3), long_prompt(180, 4), long_prompt(60, 5)[-20:]]  # 400 tokens: one step
    outs = generate(served, batch, params(logprobs=5))
    stats = ridgefill_stats(served)[0]
    assert [r.tokens for r in stats.last] == [200, 180, 20]
    for prompt, out in zip(batch, outs):
        logits, _ = kvforge_ridgefill(engine, config, maps, prompt)
        assert_logits_match(out.outputs[0].logprobs[0], logits)


def test_ngram_drafting_is_lossless_over_the_forged_cache(setup, served, drafting):
    batch = [long_prompt(300, 6), long_prompt(250, 7)]
    forged = [o.outputs[0].token_ids for o in generate(served, batch, params())]
    before = spec_counters(drafting)
    drafted = [o.outputs[0].token_ids for o in generate(drafting, batch, params())]
    after = spec_counters(drafting)
    assert ridgefill_stats(drafting)[0].filled_prefills >= 1
    assert after["accepted_tokens"] > before["accepted_tokens"]  # drafts were accepted, so verification ran
    assert drafted == forged


def test_drafts_end_before_a_token_that_would_trigger_a_rescue(served, drafting):
    """A second request with a prompt drafts the first one's tokens, among them those that
    triggered rescues; its drafts end before such tokens, so it commits plain RidgeFill's tokens."""
    prompt = long_prompt(250, 6)
    plain = list(generate(served, [prompt], params())[0].outputs[0].token_ids)
    rescues = ridgefill_stats(drafting)[0].rescue_events
    before = spec_counters(drafting)
    first, second = (list(generate(drafting, [prompt], params())[0].outputs[0].token_ids) for _ in range(2))
    assert sum(p.stats.rescue_cuts for p in LIVE if p.config.k == 4) > 0  # a proposal did reach such a token
    assert spec_counters(drafting)["accepted_tokens"] > before["accepted_tokens"]
    assert ridgefill_stats(drafting)[0].rescue_events > rescues
    assert first == second == plain


def test_maps_for_another_model_or_chunked_prefill_are_refused(setup, tmp_path):
    model_dir, maps_path = setup[:2]
    other = save_tiny_llama(tmp_path / "other", seed=1)
    with pytest.raises(Exception, match="fitted for"):
        start_llm(other, torch.float32, **engine_args(maps_path, max_model_len=MAX_LEN, **SETTING))
    overrides = {"architectures": [ARCHITECTURE], SETTINGS: {"maps": str(maps_path), **SETTING}}
    with pytest.raises(Exception, match="enable_chunked_prefill=False"):
        start_llm(model_dir, torch.float32, MAX_LEN, hf_overrides=overrides, enable_chunked_prefill=True)
    with pytest.raises(KvforgeError, match="does not exist"):
        engine_args(tmp_path / "missing.safetensors")


def test_scored_continuation_is_kvforges_continuation_loss_over_a_ridgefill_cache(setup, served):
    """`score_tokens` (what `eval ridgefill --engine vllm` uses): one request's prompt logprobs over
    the continuation equal kvforge's teacher-forced loss over its RidgeFill cache of the context."""
    from kvforge.scoring import continuation_logits

    _, _, engine, config, maps = setup
    seq = long_prompt(340, 9)
    prefix = 300  # context: the first 299 tokens; scored: tokens 300..339
    context = seq[: prefix - 1]
    _, cache = engine.prefill([context], plan=ridgefill_plan(engine, context, config, maps))
    ours = continuation_logits(engine, seq, prefix, cache)  # (40, V): the logits that score tokens 300..339
    try:
        set_ridgefill(served, True, score_tokens=len(seq) - len(context))
        out = generate(served, [seq], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
        record = ridgefill_stats(served)[0].last[0]
    finally:
        set_ridgefill(served, True, score_tokens=0)
    assert record.context == len(context) and record.filled_rows > 100
    # this engine reports raw logits as logprobs (prompt logprobs too): the scored token's logit
    served = torch.tensor([out.prompt_logprobs[j][seq[j]].logprob for j in range(prefix, len(seq))])
    expected = ours[torch.arange(len(seq) - prefix), torch.tensor(seq[prefix:])]
    assert (served - expected).abs().max() < 1e-3


def test_a_ridgefill_prefill_is_not_read_out_as_an_exact_cache(served):
    """The connector's save path sees only layers that pass through vLLM's attention op; a RidgeFill
    prefill's late layers do not, so nothing is stored (a partial or forged cache labelled exact
    would be worse than none). A prompt too short to fill runs stock and is saved whole."""
    from kvforge.vllm.store import MEMORY

    save = lambda key: SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"kvforge_save": key}})  # noqa: E731
    generate(served, [long_prompt(300, 10)], save("forged"))
    generate(served, [long_prompt(60, 11)[-30:]], save("short"))
    try:
        assert "forged" not in MEMORY
        assert "short" in MEMORY and len(MEMORY["short"].cache) == 4
    finally:
        MEMORY.pop("forged", None)
        MEMORY.pop("short", None)

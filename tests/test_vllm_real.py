"""The connector's write path on the packaged models (slow): kvforge's exact fp32 cache of a prompt,
loaded into vLLM, gives vLLM's own first-token log-probabilities (within 1e-3) and its own greedy
continuation over 32 tokens. Gemma 3 has sliding-window layers: every row is loaded in every
layer and vLLM's kernels apply the window."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("KVFORGE_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from kvforge.bench.lingo import text_of_tokens  # noqa: E402
from kvforge.engine import Engine  # noqa: E402
from kvforge.models import load_model  # noqa: E402
from kvforge.models.loading import hf_directory  # noqa: E402
from kvforge.translate.align import tokenize  # noqa: E402
from kvforge.vllm.engine import close_llm, generate, start_llm  # noqa: E402
from kvforge.vllm.store import MEMORY, CacheStore, config_id  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_injected_exact_cache_matches_vllms_own_prefill(name):
    engine = Engine(load_model(name, dtype="fp32"))
    directory = hf_directory(name)
    ids = tokenize(engine.model.tokenizer, text_of_tokens(engine.model.tokenizer, 700)).ids  # > gemma3's 512-token window
    _, cache = engine.prefill([ids[:-1]], logits="none")
    key = CacheStore("memory").put(ids, cache, ids[:-1], config_id(directory))
    llm = start_llm(directory, torch.float32, 1024, max_num_seqs=2)
    try:
        params = dict(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
        own = generate(llm, [ids], SamplingParams(**params))[0]
        injected = generate(llm, [ids], SamplingParams(**params, extra_args={"kv_transfer_params": {"kvforge_cache": key}}))[0]
    finally:
        close_llm(llm)
        MEMORY.pop(key, None)
    assert injected.num_cached_tokens == len(ids) - 1
    assert injected.outputs[0].token_ids == own.outputs[0].token_ids
    first_own, first_injected = own.outputs[0].logprobs[0], injected.outputs[0].logprobs[0]
    assert first_own.keys() == first_injected.keys()
    for token, lp in first_own.items():
        assert abs(lp.logprob - first_injected[token].logprob) < 1e-3


def test_vllm_ridgefill_matches_kvforges_on_smollm2(tmp_path):
    """RidgeFill in vLLM on the packaged smollm2-135m, fp32, a 1024-token held-out prompt: the same
    rows filled as kvforge's engine fills them, first-token logits within 1e-3, the same greedy
    continuation. Maps fitted here, small (the fit is not what is tested)."""
    from kvforge.data.prompts import held_out_text_tokens, token_sequences
    from kvforge.fill.calibrate import CalibrationConfig, fit_ridgefill
    from kvforge.fill.ridgefill import resolve, ridgefill_plan
    from kvforge.generation import GenerationConfig
    from kvforge.plan import final_depth
    from kvforge.vllm.ridgefill import engine_args, ridgefill_stats

    engine = Engine(load_model("smollm2-135m", dtype="fp32"))
    fit = token_sequences(engine.model.tokenizer, 512, "fit")
    maps = fit_ridgefill(engine, CalibrationConfig(splits=(15,), tokens=12 * 508, seq_len=512), engine.model.name,
                         sequences=[next(fit) for _ in range(12)])
    maps.save(tmp_path / "maps.safetensors")
    setting = {"split": 15, "tail": 256, "attended_rows": 16}
    config, maps = resolve(engine, tmp_path / "maps.safetensors", **setting)
    prompt = held_out_text_tokens(engine.model.tokenizer, 1024)
    plan = ridgefill_plan(engine, prompt, config, maps)
    logits, cache = engine.prefill([prompt], plan=plan)
    exact_rows = final_depth(cache, len(prompt)) == engine.num_layers
    ours = engine.generate([prompt], GenerationConfig(max_new_tokens=16, ignore_eos=True), plan=ridgefill_plan(engine, prompt, config, maps))
    llm = start_llm(hf_directory("smollm2-135m"), torch.float32, max_num_seqs=1, logprobs_mode="raw_logits",
                    **engine_args(tmp_path / "maps.safetensors", max_model_len=1280, **setting))
    try:
        out = generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5))[0].outputs[0]
        record = ridgefill_stats(llm)[0].last[0]
    finally:
        close_llm(llm)
    assert torch.equal(record.exact.cpu(), exact_rows) and record.filled_rows > 600
    for token, lp in out.logprobs[0].items():
        assert abs(lp.logprob - logits[0, token].item()) < 1e-3
    assert list(out.token_ids) == list(ours[0].token_ids)


def test_vllm_serves_updated_weights_as_kvforge_does():
    """An in-place update of a running vLLM engine (SmolLM2: tied head) gives the logits and greedy
    tokens kvforge's engine gives with the same update. Without repacking the tied head, vLLM's
    logits would still come from the old embedding (its greedy tokens then differ here)."""
    from safetensors.torch import load_file

    from kvforge.generation import GenerationConfig
    from kvforge.vllm.weights import update_vllm_weights

    directory = hf_directory("smollm2-135m")
    weights = {}
    for path in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(str(path)))
    noise = torch.Generator().manual_seed(0)
    moved = {name: t.float() * (1 + 0.01 * torch.randn(t.shape, generator=noise)) for name, t in weights.items()}
    engine = Engine(load_model("smollm2-135m", dtype="fp32"))
    engine.update_weights({**moved, "lm_head.weight": moved["model.embed_tokens.weight"]})
    prompt = [1, 504, 3458, 282, 4649, 314, 216]
    logits, _ = engine.prefill([prompt])
    ours = engine.generate([prompt], GenerationConfig(max_new_tokens=16, ignore_eos=True))[0]
    llm = start_llm(directory, torch.float32, 256, max_num_seqs=1)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
        before = generate(llm, [prompt], params)[0].outputs[0]
        update_vllm_weights(llm, moved)
        after = generate(llm, [prompt], params)[0].outputs[0]
    finally:
        close_llm(llm)
    assert list(after.token_ids) == list(ours.token_ids) != list(before.token_ids)
    for token, lp in after.logprobs[0].items():
        assert abs(lp.logprob - torch.log_softmax(logits[0].float(), -1)[token].item()) < 1e-3

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
    engine = Engine(load_model(name))
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

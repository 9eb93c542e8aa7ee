"""`update_served_weights`, the client of a `vllm serve` weight update, against a stand-in server
that answers vLLM's dev endpoints: the calls it makes and their order, and its one-line errors.
The real server runs in `tests/test_vllm_serve.py`."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvforge.models.weights import WeightUpdateError
from kvforge.vllm.weights import update_served_weights


class StandIn:
    """vLLM's /pause, /collective_rpc, /reset_prefix_cache and /resume, with chosen answers."""

    def __init__(self, answers: dict[str, tuple[int, str]] | None = None, slow: dict[str, float] | None = None):
        self.calls: list[tuple[str, dict, str | None]] = []
        self.answers, self.slow = answers or {}, slow or {}
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                stand_in.calls.append((self.path, body, self.headers.get("Authorization")))
                route = self.path.split("?")[0]
                default = (200, json.dumps({"results": [{"tensors": 3}]})) if route == "/collective_rpc" else (200, "")
                code, text = stand_in.answers.get(route, default)
                time.sleep(stand_in.slow.get(route, 0.0))
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(text.encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def routes(self) -> list[str]:
        return [path for path, _, _ in self.calls]


@pytest.fixture
def stand_in():
    servers = []

    def make(answers=None, slow=None):
        servers.append(StandIn(answers, slow))
        return servers[-1]

    yield make
    for s in servers:
        s.server.shutdown()


def test_an_update_pauses_reloads_from_the_path_drops_the_prefix_cache_and_resumes(stand_in, tmp_path):
    server = stand_in()
    seconds = update_served_weights(server.url + "/v1/", tmp_path / "update.safetensors", api_key="k")
    assert seconds >= 0
    assert server.routes() == ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/resume"]
    _, body, auth = server.calls[1]
    assert body == {"method": "kvforge_reload_file", "args": [str((tmp_path / "update.safetensors").resolve())], "timeout": 600.0}
    assert auth == "Bearer k"


def test_a_refused_update_resumes_generation_and_says_why_in_one_line(stand_in, tmp_path):
    detail = "WeightUpdateError: model.norm.weight: shape (3,), the served checkpoint's is (64,)"
    server = stand_in({"/collective_rpc": (500, json.dumps({"error": detail}))})
    with pytest.raises(WeightUpdateError, match=r"HTTP 500: .*model\.norm\.weight: shape \(3,\)") as refused:
        update_served_weights(server.url, tmp_path)
    assert "\n" not in str(refused.value)
    assert server.routes() == ["/pause?mode=wait", "/collective_rpc", "/resume"]  # generation resumes, weights as they were


@pytest.mark.parametrize(("answers", "hint"), [
    ({"/pause": (404, json.dumps({"detail": "Not Found"}))}, "VLLM_SERVER_DEV_MODE=1"),
    ({"/collective_rpc": (500, json.dumps({"error": "'CPUWorker' object has no attribute 'kvforge_reload_file'"}))},
     "--worker-extension-cls kvforge.vllm.weights.WeightUpdates"),
    ({"/collective_rpc": (200, "")}, "not the workers' reload results"),
])
def test_a_server_without_the_endpoints_or_the_extension_is_named_as_such(stand_in, tmp_path, answers, hint):
    with pytest.raises(WeightUpdateError, match=hint.replace(".", r"\.")):
        update_served_weights(stand_in(answers).url, tmp_path)


@pytest.mark.parametrize("slow_route", ["/pause", "/collective_rpc"])
def test_a_call_past_its_timeout_still_resumes_generation(stand_in, tmp_path, slow_route):
    server = stand_in(slow={slow_route: 1.5})
    with pytest.raises(WeightUpdateError, match=f"POST {server.url}{slow_route}.*(timed out|Timeout)"):
        update_served_weights(server.url, tmp_path, timeout=0.5)
    deadline = time.monotonic() + 5
    while "/resume" not in server.routes() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.routes()[-1] == "/resume" and "/reset_prefix_cache" not in server.routes()


def test_a_prefix_cache_that_did_not_reset_is_said_and_generation_resumes(stand_in, tmp_path):
    server = stand_in({"/reset_prefix_cache": (200, json.dumps({"success": False}))})
    with pytest.raises(WeightUpdateError, match="did not reset"):
        update_served_weights(server.url, tmp_path)
    assert server.routes()[-1] == "/resume"


def test_no_server_is_a_one_line_error():
    with pytest.raises(WeightUpdateError, match="POST http://127.0.0.1:9/pause"):
        update_served_weights("http://127.0.0.1:9", "x.safetensors", timeout=5)

"""`bench serve`: a live server (uvicorn on a free loopback port, in this process) under
1..N concurrent streaming clients, each method in turn: output tokens/s over the wall time of a
level, TTFT percentiles as clients see them (request sent to first streamed text), and responses
that failed or ended without a finish reason and [DONE]. What the prefills ran comes from the
responses: the share of prompt rows filled (RidgeFill) or left shallow (SPEED), and how many
requests ran exact instead (a prompt no longer than RidgeFill's exact rows), so a method that
never engaged is not reported as measured."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx

from kvforge.bench.harness import environment
from kvforge.data.prompts import plain_texts

METHOD_OPTIONS = {
    "exact": {},
    "ridgefill": {"prefill": "ridgefill"},
    "speed": {"prefill": "speed"},
    "ngram": {"draft": "ngram"},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(app) -> tuple[object, str]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    server.thread = threading.Thread(target=server.run, daemon=True)  # joined by `stop_server`
    server.thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start within 60 s")
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


def stop_server(server) -> None:
    """Shut the server down and wait for it: its shutdown stops the scheduler thread, which must not
    be mid-forward when the interpreter exits (a native op killed there aborts the process)."""
    server.should_exit = True
    server.thread.join(timeout=60)


def stream_completion(client: httpx.Client, url: str, body: dict) -> dict:
    """One streaming request: {ttft_s, tokens, complete, text, status} and, from the final chunk,
    prompt_tokens and what the prefill ran (prefill, filled_rows, shallow_rows, reason)."""
    start, ttft, text, final, done = time.perf_counter(), None, [], None, False
    try:
        with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=600) as response:
            if response.status_code != 200:
                return {"ttft_s": None, "tokens": 0, "complete": False, "status": response.status_code}
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                choice = chunk.get("choices", [{}])[0]
                if choice.get("text") and ttft is None:
                    ttft = time.perf_counter() - start
                text.append(choice.get("text", ""))
                if choice.get("finish_reason"):
                    final = chunk
    except httpx.HTTPError:
        return {"ttft_s": None, "tokens": 0, "complete": False, "status": None}
    tokens = final["usage"]["completion_tokens"] if final else 0
    out = {"ttft_s": ttft, "tokens": tokens, "complete": bool(final and done), "text": "".join(text), "status": 200}
    if final:
        ran = final.get("kvforge", {})
        out.update(prompt_tokens=final["usage"]["prompt_tokens"], **{key: ran.get(key) for key in ("prefill", "filled_rows", "shallow_rows", "reason")})
    return out


def run_level(url: str, model: str, prompts: list[str], clients: int, per_client: int, options: dict, max_tokens: int) -> dict:
    results: list[dict] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        with httpx.Client() as http:
            for j in range(per_client):
                prompt = prompts[(index * per_client + j) % len(prompts)]
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "kvforge": options}
                r = stream_completion(http, url, body)
                with lock:
                    results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttfts = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
    served = [r for r in results if r.get("prompt_tokens")]
    prompt_rows = sum(r["prompt_tokens"] for r in served)
    share = lambda key: sum(r.get(key) or 0 for r in served) / prompt_rows if prompt_rows else 0.0  # noqa: E731
    asked = options.get("prefill", "exact")
    fell_back = [r for r in served if asked != "exact" and r.get("prefill") == "exact"]
    return {
        "concurrency": clients,
        "requests": len(results),
        "failed": sum(1 for r in results if not r["complete"]),
        "completion_tokens": sum(r["tokens"] for r in results),
        "wall_s": wall,
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))] if ttfts else None,
        "prompt_tokens": prompt_rows,
        "filled_share": share("filled_rows"),
        "shallow_share": share("shallow_rows"),
        "ran_exact": len(fell_back),
        "ran_exact_reasons": sorted({r["reason"] for r in fell_back if r.get("reason")}),
    }


def bench_serve(model: str, maps: Path | None, methods: list[str], levels: list[int], per_client: int, max_tokens: int,
                prompt_tokens: int, device: str = "cpu", progress=None, preset: str = "fast", tail: int | None = None,
                attended_rows: int | None = None, dtype: str = "auto", speed_tail: int | None = None) -> dict:
    """`preset`, `tail`, `attended_rows`: the server's RidgeFill setting (a tail as long as the
    prompt fills nothing; attended rows with their spans may cover a short prompt's other rows);
    `speed_tail`: SPEED's full-depth tail (default 64)."""
    from kvforge.artifacts import find_artifact
    from kvforge.serve.app import ServeConfig, build_served, create_app

    unknown = [m for m in methods if m not in METHOD_OPTIONS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}: use {', '.join(METHOD_OPTIONS)}")
    if "ridgefill" in methods and maps is None:
        maps = find_artifact("maps", model)
    served = build_served(ServeConfig(model, maps=maps, max_batch=max(levels), queue_size=max(levels) * per_client + 4, device=device, dtype=dtype,
                                      preset=preset, tail=tail, attended_rows=attended_rows, speed_tail=speed_tail))
    tokenizer = served[model].engine.model.tokenizer
    texts = plain_texts("held_out", max(levels) * per_client, min_chars=prompt_tokens * 6, max_chars=prompt_tokens * 12)
    prompts = [tokenizer.decode(tokenizer(t).input_ids[:prompt_tokens]) for t in texts]
    server, url = start_server(create_app(served))
    results = []
    try:
        for method in methods:
            with httpx.Client() as http:  # warm-up
                stream_completion(http, url, {"model": model, "prompt": prompts[0], "max_tokens": 4, "temperature": 0, "kvforge": METHOD_OPTIONS[method]})
            base = None
            for level in levels:
                if progress:
                    progress(f"{method}: {level} concurrent client(s) × {per_client}")
                row = {"method": method, "tokens": prompt_tokens, **run_level(url, model, prompts, level, per_client, METHOD_OPTIONS[method], max_tokens)}
                base = base or row["tokens_per_s"]
                row["scaling"] = row["tokens_per_s"] / base if base else 0.0
                results.append(row)
    finally:
        stop_server(server)
    return {
        "command": "bench serve", "model": model, "method": ",".join(methods), "tokens": prompt_tokens, "max_tokens": max_tokens,
        "requests_per_client": per_client, "ridgefill_preset": preset, "ridgefill_tail": tail,
        "ridgefill_attended_rows": attended_rows, **environment(served[model].engine), "results": results,
    }

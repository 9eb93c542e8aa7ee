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
from dataclasses import replace
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


def warm_gates(schedulers, batch: int) -> None:
    """Measure the drafting gate's step costs up to `batch` rows before a timed level: a server
    measures a batch size the first time drafting requests reach it, a pause of every stream (seconds
    at 16 rows on a CPU without AMX), once in its life; a level would otherwise time that pause."""
    for scheduler in schedulers:
        if scheduler.gate is not None:
            with scheduler.paused():
                scheduler.gate.prepare(min(batch, scheduler.max_batch), scheduler.draft.k + 1)


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


def run_level(url: str, model: str, prompts: list[str], clients: int, per_client: int, options: dict, max_tokens: int,
              schedulers: list | None = None) -> dict:
    """One concurrency level. `schedulers`: the server's, in this process: their decode steps'
    time and tokens give the decode-only throughput (prefills excluded), and their peaks the most
    requests that ran at once and the KV-cache budget's rows they reserved."""
    results: list[dict] = []
    before = [(s.decode_s, s.prefill_s, s.decoded_tokens) for s in schedulers or []]
    for s in schedulers or []:
        s.peak_running, s.peak_reserved_rows = 0, 0
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
    spent = [(s.decode_s - d, s.prefill_s - p, s.decoded_tokens - n) for s, (d, p, n) in zip(schedulers or [], before)]
    decode_s, prefill_s, decoded = (sum(x[i] for x in spent) for i in range(3))
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
        "decode_tokens_per_s": decoded / decode_s if decode_s else None,  # tokens the decode steps committed over their time
        "prefill_share": prefill_s / wall if schedulers else None,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))] if ttfts else None,
        "prompt_tokens": prompt_rows,
        "filled_share": share("filled_rows"),
        "shallow_share": share("shallow_rows"),
        "ran_exact": len(fell_back),
        "ran_exact_reasons": sorted({r["reason"] for r in fell_back if r.get("reason")}),
        "peak_running": max((s.peak_running for s in schedulers or []), default=None),
        "peak_reserved_rows": max((s.peak_reserved_rows for s in schedulers or []), default=None),
    }


# How the arriving prompt of `run_arrival` may be prefilled: a method, or a hand-off from the source model
ARRIVAL_OPTIONS = {**{m: METHOD_OPTIONS[m] for m in ("exact", "ridgefill", "speed")}, "handoff": {"prefill": "handoff"}}


def run_arrival(url: str, model: str, stream_prompts: list[str], long_prompt: list[int] | str, max_tokens: int, steady: int = 8,
                method: str = "exact", arrival_tokens: int | None = None) -> dict:
    """Streams decoding when a long prompt arrives (prefilled by `method`: exact, ridgefill,
    speed, or handoff, whose prompt is text: `arrival_tokens` then gives its length in the served
    model's tokens): each stream's inter-token latencies (the time
    between two streamed chunks as the client reads them; a reader never blocks). Their median
    over a steady stretch before the arrival (every stream running, `steady` chunks each), and
    their 99th percentile over the gaps that overlap the long prompt's prefill (from its request's
    sending to its first token). The streams are closed once the long prompt has its first token."""
    arrivals: list[list[float]] = [[] for _ in stream_prompts]
    ended = [False] * len(stream_prompts)
    stop = threading.Event()

    def stream(index: int) -> None:
        body = {"model": model, "prompt": stream_prompts[index], "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "kvforge": {"draft": "none"}}
        try:
            with httpx.Client() as http, http.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                        arrivals[index].append(time.perf_counter())
                    if stop.is_set():
                        break
        finally:
            ended[index] = True

    def wait_until(condition) -> None:
        while not condition():
            time.sleep(0.01)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(stream_prompts))]
    for t in threads:
        t.start()
    wait_until(lambda: all(times or done for times, done in zip(arrivals, ended)))  # every stream admitted and decoding
    steady_from = time.perf_counter()
    counts = [len(times) for times in arrivals]
    wait_until(lambda: all(len(times) >= n + steady or done for times, n, done in zip(arrivals, counts, ended)))
    sent = time.perf_counter()
    with httpx.Client() as http:
        long = stream_completion(http, url, {"model": model, "prompt": long_prompt, "max_tokens": 1, "temperature": 0,
                                             "kvforge": ARRIVAL_OPTIONS[method]})
    first = sent + (long["ttft_s"] or 0.0)
    time.sleep(0.5)  # a few steps after it joins
    stop.set()
    for t in threads:
        t.join()
    steady_gaps, during = [], []
    for times in arrivals:
        for before, after in zip(times, times[1:]):
            if before >= steady_from and after <= sent:
                steady_gaps.append(after - before)
            if after > sent and before < first:
                during.append(after - before)
    steady_gaps.sort()
    during.sort()
    pick = lambda values, q: values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else None  # noqa: E731
    median, p99 = pick(steady_gaps, 0.5), pick(during, 0.99)
    return {
        "streams": len(stream_prompts), "arrival_tokens": arrival_tokens or len(long_prompt), "arrival_method": method, "arrival_ttft_s": long["ttft_s"],
        "median_itl_ms": 1000 * median if median else None, "p99_itl_ms_during_prefill": 1000 * p99 if p99 else None,
        "max_itl_ms_during_prefill": 1000 * during[-1] if during else None, "chunks_during_prefill": len(during),
        "p99_over_median": p99 / median if median and p99 else None, "failed": int(not long["complete"]),
    }


def bench_serve(model: str, maps: Path | None, methods: list[str], levels: list[int], per_client: int, max_tokens: int,
                prompt_tokens: int, device: str = "cpu", progress=None, preset: str = "fast", tail: int | None = None,
                attended_rows: int | None = None, dtype: str = "auto", speed_tail: int | None = None,
                arrival_tokens: int = 0, streams: int = 15, chunks: list[int | None] | None = None, arrival_method: str = "exact",
                source: str | None = None, translator: Path | None = None, kv_cache_memory: int | None = None) -> dict:
    """`preset`, `tail`, `attended_rows`: the server's RidgeFill setting (a tail as long as the
    prompt fills nothing; attended rows with their spans may cover a short prompt's other rows);
    `speed_tail`: SPEED's full-depth tail (default 64). `arrival_tokens` > 0: also a prompt of
    that many tokens arriving while `streams` streams decode (`run_arrival`), once per server
    chunk size in `chunks` (`--max-num-batched-tokens`; None: whole prompts), prefilled by
    `arrival_method`; "handoff": handed off from `source` through `translator` (default: the pair's
    translator) by a server of both models, the streams on `model`. `kv_cache_memory`: the
    servers' KV-cache budget (`--kv-cache-memory`)."""
    from kvforge.artifacts import find_artifact
    from kvforge.serve.app import ServeConfig, build_served, create_app

    unknown = [m for m in methods if m not in METHOD_OPTIONS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}: use {', '.join(METHOD_OPTIONS)}")
    if arrival_method not in ARRIVAL_OPTIONS:
        raise ValueError(f"unknown arrival method {arrival_method!r}: use {', '.join(ARRIVAL_OPTIONS)}")
    if (arrival_method == "handoff") != (source is not None) or (translator is not None and source is None):
        raise ValueError("--arrival-method handoff and --source go together (and --translator needs them): the model the arriving prompt is handed off from")
    if source is not None and translator is None:
        from kvforge.artifacts import default_translator_path

        translator = default_translator_path(source, model)
    if "ridgefill" in (*methods, arrival_method) and maps is None:
        maps = find_artifact("maps", model)
    chunks = chunks or [512]
    levels = levels or [1]
    config = lambda chunk: ServeConfig(  # noqa: E731
        model, maps=maps, max_batch=max(*levels, streams + 1 if arrival_tokens else 1), queue_size=max(levels) * per_client + streams + 4,
        device=device, dtype=dtype,
        preset=preset, tail=tail, attended_rows=attended_rows, speed_tail=speed_tail, max_num_batched_tokens=chunk, kv_cache_memory=kv_cache_memory)
    served = build_served(config(chunks[0]))
    tokenizer = served[model].engine.model.tokenizer
    texts = plain_texts("held_out", max(*levels, streams) * per_client, min_chars=prompt_tokens * 6, max_chars=prompt_tokens * 12)
    prompts = [tokenizer.decode(tokenizer(t).input_ids[:prompt_tokens]) for t in texts]
    arrivals = []
    if arrival_tokens:
        from kvforge.data.prompts import held_out_text_tokens

        long_prompt = held_out_text_tokens(tokenizer, arrival_tokens)
        # the streams decode past the arrival: 400 tokens, or what the context leaves them
        stream_tokens = min(400, served[model].engine.model.context_length - 2 * prompt_tokens)
        if stream_tokens < 16:
            raise ValueError(f"--prompt-tokens {prompt_tokens} leaves the streams no room to decode in {model}'s context")
        arriving: list[int] | str = long_prompt
        if source is not None:  # the arriving prompt as text, served by a server of both models
            arriving = tokenizer.decode(long_prompt, skip_special_tokens=True)
            arrival_config = lambda chunk: replace(config(chunk), model=source, maps=None, translator=translator, target=model)  # noqa: E731
        for chunk in chunks:  # a server per chunk size (a server's scheduler threads start once)
            server, url = start_server(create_app(build_served((arrival_config if source is not None else config)(chunk))))
            try:
                if progress:
                    progress(f"a {arrival_tokens}-token prompt arriving while {streams} streams decode, chunks of {chunk or 'the whole prompt'}")
                with httpx.Client() as http:  # warm-up, of the arrival's prefill too
                    stream_completion(http, url, {"model": model, "prompt": prompts[0], "max_tokens": 4, "temperature": 0})
                    if source is not None:
                        stream_completion(http, url, {"model": model, "prompt": prompts[0], "max_tokens": 4, "temperature": 0,
                                                      "kvforge": ARRIVAL_OPTIONS["handoff"]})
                arrivals.append({"max_num_batched_tokens": chunk, **run_arrival(url, model, prompts[:streams], arriving, stream_tokens, method=arrival_method,
                                                                                 arrival_tokens=len(tokenizer(arriving).input_ids) if source else None)})
            finally:
                stop_server(server)
    server, url = start_server(create_app(served))
    results = []
    try:
        for method in methods:
            with httpx.Client() as http:  # warm-up
                stream_completion(http, url, {"model": model, "prompt": prompts[0], "max_tokens": 4, "temperature": 0, "kvforge": METHOD_OPTIONS[method]})
            if "draft" in METHOD_OPTIONS[method]:  # the gate's step costs at every level's batch size, measured once per server
                warm_gates(served[model].schedulers, max(levels))
            base = None
            for level in levels:
                if progress:
                    progress(f"{method}: {level} concurrent client(s) × {per_client}")
                row = {"method": method, "tokens": prompt_tokens,
                       **run_level(url, model, prompts, level, per_client, METHOD_OPTIONS[method], max_tokens, served[model].schedulers)}
                base = base or row
                row["scaling"] = row["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
                row["decode_scaling"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"] if base["decode_tokens_per_s"] else None
                results.append(row)
    finally:
        stop_server(server)
    return {
        "command": "bench serve", "model": model, "method": ",".join(methods), "tokens": prompt_tokens, "max_tokens": max_tokens,
        "requests_per_client": per_client, "ridgefill_preset": preset, "ridgefill_tail": tail,
        "ridgefill_attended_rows": attended_rows, "kv_cache_memory": kv_cache_memory, "pool_rows": served[model].schedulers[0].pool_rows,
        **environment(served[model].engine), "results": results, "arrival": arrivals,
        **({"arrival_source": source, "arrival_translator": str(translator)} if source is not None else {}),
    }

"""Prometheus metrics for `GET /metrics`, in one registry per server (tests start several)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)


class ServerMetrics:
    def __init__(self, kv_bytes=lambda: 0, queued=lambda: 0, running=lambda: 0, kv_usage=lambda: 0.0):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvforge_requests", "Finished requests (each choice of an n > 1 request) by outcome.", ["prefill", "draft", "outcome"], registry=r)
        self.ttft = Histogram("kvforge_time_to_first_token_seconds", "Request arrival to first token.", ["prefill"], buckets=LATENCY_BUCKETS, registry=r)
        self.per_token = Histogram("kvforge_time_per_output_token_seconds", "Decode step time per committed token.", buckets=TOKEN_BUCKETS, registry=r)
        self.generated = Counter("kvforge_generated_tokens", "Tokens generated.", registry=r)
        self.prompt = Counter("kvforge_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.throughput = Gauge("kvforge_tokens_per_second", "Generated tokens per second over the last 10 s.", registry=r)
        self.drafted_steps = Counter("kvforge_ngram_draft_steps", "Request steps that verified a draft.", registry=r)
        self.accepted = Counter("kvforge_ngram_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.probes = Counter("kvforge_prefetch_probes", "Prefetch table probes.", registry=r)
        self.hits = Counter("kvforge_prefetch_hits", "Prefetch table hits.", registry=r)
        Gauge("kvforge_kv_cache_bytes", "Bytes of the keys and values the running batch holds, each request's rows to its own end.", registry=r).set_function(kv_bytes)
        Gauge("kvforge_kv_cache_usage", "Share of the KV-cache budget's rows reserved by the requests running or prefilling (0 without a budget).",
              registry=r).set_function(kv_usage)
        Gauge("kvforge_queue_length", "Requests waiting.", registry=r).set_function(queued)
        Gauge("kvforge_running_requests", "Requests in the running batch.", registry=r).set_function(running)
        self._window: list[tuple[float, int]] = []

    def observe_ttft(self, request, prefilled: bool = True) -> None:
        """A request's first token; `prefilled`: its prompt was prefilled for it (the choices of
        one request after the first share that prefill)."""
        self.ttft.labels(request.prefill).observe(request.ttft_s)
        if prefilled:
            self.prompt.inc(len(request.prompt_ids))
        self._tokens(1)

    def observe_step(self, committed: int, step_s: float, accepted: int | None) -> None:
        """One request's share of a decode step; `accepted` draft tokens, None when it drafted none."""
        self.per_token.observe(step_s / max(committed, 1))
        self._tokens(committed)
        if accepted is not None:
            self.drafted_steps.inc()
            self.accepted.inc(accepted)

    def observe_probe(self, hit: bool) -> None:
        self.probes.inc()
        if hit:
            self.hits.inc()

    def observe_done(self, request) -> None:
        outcome = "aborted" if getattr(request, "aborted", False) else "ok" if request.error is None else (
            "cancelled" if request.error == "cancelled" else "error")
        self.requests.labels(request.prefill, request.draft, outcome).inc()

    def _tokens(self, n: int) -> None:
        now = time.monotonic()
        self.generated.inc(n)
        self._window = [(t, c) for t, c in self._window if now - t < 10.0] + [(now, n)]
        span = max(now - self._window[0][0], 1.0)
        self.throughput.set(sum(c for _, c in self._window) / span)

    def render(self) -> bytes:
        return generate_latest(self.registry)

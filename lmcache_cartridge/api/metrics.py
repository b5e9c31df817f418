"""The gateway's own Prometheus metrics, served on its `/metrics`: requests by endpoint, HTTP
status and reason (one of `REASONS`: which 503 was a cartridge not yet served, which a trained
load that failed, which the upstream's own), time spent waiting for an instance to serve a
request's cartridges, and upstream latency (to the answer, or to the first byte of a stream).
Every label takes a bounded set of values (`ENDPOINTS`, `REASONS`): a client's path never
becomes a series.

Runs in the gateway process; one `GatewayMetrics` per app, on a registry of its own (several
apps in one process, as in tests, never share series). The names are `lmcache_cartridge_gateway_*`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

# The gateway's routes counted by name; any other /v1 path (a 404) is "other".
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
# Why a request got its answer. `handle` names it; what it does not name is "ok" below 400, else "other".
REASONS = (
    "ok",
    "invalid",              # 400: a malformed request or a cartridge that cannot be used
    "forbidden",            # 403: outside the roots, the tenant's ids, or a disabled option
    "not_found",            # 404: no such cartridge or model
    "conflict",             # 409: an id another origin holds
    "too_large",            # 413: body or S3 object over its limit
    "rate_limited",         # 429: force_redownload too often
    "not_served",           # 503 (or 404): no instance serves the cartridge (yet)
    "trained_load_failed",  # 503: the engine could not load a trained cartridge's KV (never recomputed)
    "upstream",             # the router's or vLLM's own error answer, or unreachable (502)
    "other",
)
STATUS_REASON = {400: "invalid", 403: "forbidden", 404: "not_found", 409: "conflict", 413: "too_large",
                 429: "rate_limited"}
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("lmcache_cartridge_gateway_requests",
                                "requests answered, by endpoint, HTTP status and reason",
                                ["endpoint", "status", "reason"], registry=self.registry)
        self.ready_wait = Histogram("lmcache_cartridge_gateway_ready_wait_seconds",
                                    "waiting for an instance to serve the request's cartridges",
                                    registry=self.registry, buckets=BUCKETS)
        self.upstream = Histogram("lmcache_cartridge_gateway_upstream_seconds",
                                  "upstream (router or vLLM) latency to the answer or a stream's first byte",
                                  ["endpoint"], registry=self.registry, buckets=BUCKETS)

    def answered(self, path: str, status: int, reason: str | None = None) -> None:
        endpoint = path if path in ENDPOINTS else "other"
        if reason not in REASONS:
            reason = "ok" if status < 400 else "other"
        self.requests.labels(endpoint, str(status), reason).inc()

    @contextmanager
    def timed(self, histogram, *labels: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            (histogram.labels(*labels) if labels else histogram).observe(time.perf_counter() - t0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

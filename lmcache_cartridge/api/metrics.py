"""The gateway's own Prometheus metrics, served on its `/metrics`: requests by endpoint and
status (4xx, 5xx and 503 apart), time spent waiting for an instance to serve a request's
cartridges, and upstream latency (to the answer, or to the first byte of a stream).

Runs in the gateway process; one `GatewayMetrics` per app, on a registry of its own (several
apps in one process, as in tests, never share series). The names are `lmcache_cartridge_gateway_*`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("lmcache_cartridge_gateway_requests", "requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=self.registry)
        self.ready_wait = Histogram("lmcache_cartridge_gateway_ready_wait_seconds",
                                    "waiting for an instance to serve the request's cartridges",
                                    registry=self.registry, buckets=BUCKETS)
        self.upstream = Histogram("lmcache_cartridge_gateway_upstream_seconds",
                                  "upstream (router or vLLM) latency to the answer or a stream's first byte",
                                  ["endpoint"], registry=self.registry, buckets=BUCKETS)

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    @contextmanager
    def timed(self, histogram, *labels: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            (histogram.labels(*labels) if labels else histogram).observe(time.perf_counter() - t0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

"""Per-tier counters: kept per plugin instance (for `lmcache-cartridge stats`) and mirrored to
prometheus_client, as LMCache does, under `lmcache_cartridge_*` names with `tier` and `cartridge_instance`
labels.

How they reach vLLM's own `/metrics`: the plugin runs in vLLM's engine-core (worker) process, the
API server serving `/metrics` is another process. vLLM's API server reads every process's values
through prometheus_client's `MultiProcessCollector` when `PROMETHEUS_MULTIPROC_DIR` is set in its
environment (`vllm/v1/metrics/prometheus.py: get_prometheus_registry`); the engine core inherits
the variable, so prometheus_client there writes our counters to mmap files in that directory.
Without it (the default for one API server: `vllm serve` sets it only for `--api-server-count` > 1)
the API server serves its in-process registry and these counters never appear: set it, one empty
directory per server (several servers sharing one would merge). A warning says so once when the
collectors are created inside a vLLM process without it.

`cartridge_instance` (`INSTANCE_LABEL`) tells servers apart across a fleet:
`$LMCACHE_CARTRIDGE_INSTANCE`, else the host name (a Kubernetes pod's name). A label of our own:
Prometheus attaches its own `instance` (the scrape target) and, with its default `honor_labels:
false`, would rename a label of ours called `instance` to `exported_instance`, so a dashboard's
`$instance` would never see the pod.

Where it runs: inside each plugin instance; the tiers (`residency`) count into it from whatever
thread served the read. It lives with the tiers because they are what it counts. Each instance
owns its counters; the prometheus collectors are process-wide (prometheus' design), and its
`snapshot` travels in the instance's serving-state record (`store.serving_state`), which other
processes (`lmcache-cartridge stats`, benchmarks) read.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from lmcache_cartridge.settings_reference import INSTANCE

logger = logging.getLogger("lmcache_cartridge.metrics")

ENV_INSTANCE = INSTANCE.name
INSTANCE_LABEL = "cartridge_instance"
LABELS = ["tier", INSTANCE_LABEL]
# Tiers `residency` counts under. Their series are created at zero when an instance starts: a
# labelled counter is otherwise absent from /metrics until its first event, and dashboards show
# "no data" (not 0) for errors and evictions, and rate() misses the first increment.
KNOWN_TIERS = ("cpu", "disk", "local", "s3")
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@functools.lru_cache(maxsize=1)
def warn_if_not_multiprocess() -> None:
    """Once per process, inside vLLM: without `PROMETHEUS_MULTIPROC_DIR` our collectors (these and
    the connector's, `vllm.lookup_metrics`) never reach vLLM's /metrics (module docstring)."""
    if "vllm" in sys.modules and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        logger.warning("lmcache_cartridge: PROMETHEUS_MULTIPROC_DIR is not set, so the lmcache_cartridge_* "
                       "metrics stay in this process and do not reach vLLM's /metrics; start the server "
                       "with PROMETHEUS_MULTIPROC_DIR set to an empty directory of its own")


@functools.lru_cache(maxsize=1)
def _prometheus():
    """Collectors are process-wide by prometheus' design: create them once per process."""
    try:
        from prometheus_client import Counter, Histogram
    except ImportError:  # metrics are optional
        return None
    warn_if_not_multiprocess()
    return {
        "hits": Counter("lmcache_cartridge_hits", "chunk reads served by a tier", LABELS),
        "misses": Counter("lmcache_cartridge_misses", "chunk reads a tier could not serve", LABELS),
        "bytes": Counter("lmcache_cartridge_bytes", "bytes served by a tier", LABELS),
        "evictions": Counter("lmcache_cartridge_evictions", "chunks evicted from a tier", LABELS),
        "errors": Counter("lmcache_cartridge_errors", "failed chunk reads (served as misses)", LABELS),
        "latency": Histogram("lmcache_cartridge_read_seconds", "chunk read latency", LABELS,
                             buckets=LATENCY_BUCKETS),
    }


def default_instance() -> str:
    """This server's name in a fleet: `$LMCACHE_CARTRIDGE_INSTANCE`, else the host (pod) name."""
    return os.environ.get(ENV_INSTANCE) or socket.gethostname()


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes: int = 0
    evictions: int = 0
    errors: int = 0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))


class Metrics:
    """Counters for one plugin instance. Thread-safe."""

    def __init__(self, instance: str | None = None) -> None:
        self._lock = threading.Lock()
        self.tiers: dict[str, TierStats] = {}
        self.stages: dict[str, dict[str, float]] = {}  # stage -> {"seconds", "count", "items"}
        self.instance = instance or default_instance()
        prom = _prometheus()
        if prom is not None:
            for collector in prom.values():
                for tier in KNOWN_TIERS:
                    collector.labels(tier, self.instance)

    def _tier(self, tier: str) -> TierStats:
        return self.tiers.setdefault(tier, TierStats())

    def _inc(self, what: str, tier: str, n: int = 1) -> None:
        with self._lock:
            s = self._tier(tier)
            setattr(s, what, getattr(s, what) + n)
        prom = _prometheus()
        if prom is not None:
            prom[what].labels(tier, self.instance).inc(n)

    def hit(self, tier: str, nbytes: int, seconds: float) -> None:
        self._inc("hits", tier)
        self._inc("bytes", tier, nbytes)
        with self._lock:
            self._tier(tier).latency_buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        prom = _prometheus()
        if prom is not None:
            prom["latency"].labels(tier, self.instance).observe(seconds)

    def miss(self, tier: str) -> None:
        self._inc("misses", tier)

    def eviction(self, tier: str, n: int = 1) -> None:
        self._inc("evictions", tier, n)

    def error(self, tier: str) -> None:
        self._inc("errors", tier)

    def stage(self, name: str, seconds: float, items: int = 1) -> None:
        """Time spent in one step of serving (a lookup batch, a load batch, encoding a chunk):
        totals a benchmark subtracts between two snapshots for the mean per request."""
        with self._lock:
            st = self.stages.setdefault(name, {"seconds": 0.0, "count": 0, "items": 0})
            st["seconds"] += seconds
            st["count"] += 1
            st["items"] += items

    @contextlib.contextmanager
    def timing(self, name: str, items: int = 1):
        """Count the time spent in the `with` block as one event of stage `name` (`stage`)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stage(name, time.perf_counter() - t0, items)

    def snapshot(self) -> dict:
        with self._lock:
            return {"tiers": {t: asdict(s) for t, s in self.tiers.items()},
                    "stages": {k: dict(v) for k, v in self.stages.items()},
                    "latency_bucket_bounds": list(LATENCY_BUCKETS), "time": time.time(),
                    "instance": self.instance}

"""How long the connector's answer to vLLM's scheduler takes, and what it was:
`lmcache_cartridge_scheduler_lookup_seconds{outcome, cartridge_instance}`.

Why it is measured: vLLM's scheduler asks the connector for each waiting request's external hit
(`get_num_new_matched_tokens`) on its own thread, inside `Scheduler.schedule`, after it took the
step's "scheduled" timestamp. The lookup made in the step that schedules a request is therefore
part of that request's prefill time in vLLM's own histograms (scheduled to first token), and
every lookup delays the whole step; no vLLM or LMCache metric shows it. On vLLM's CPU backend the
worker is another process (its multiprocess executor), so LMCache's lookup is a ZMQ round trip
to the worker's lookup server after hashing the prompt's chunks (docs/benchmarks.md, time to first token).

Outcomes: `hit` (tokens offered to load; vLLM may still load fewer), `miss` (none), `wait` (a
trained cartridge not loadable yet: None, vLLM asks again next step), `promised` (the wait ran
out: the cartridge's tokens reported as a hit whose load must fail, `readiness`), `error` (the
lookup raised; the request recomputes, or waits if it carries a trained cartridge).

Where it runs: in the scheduler-role connector (EngineCore process), one `LookupTimer` each. It
reaches vLLM's /metrics as the plugin's counters do (`store.metrics`: `PROMETHEUS_MULTIPROC_DIR`).
Metrics never stop the scheduler: a collector that fails is logged once and then left alone.
"""

from __future__ import annotations

import functools
import logging

from lmcache_cartridge.store.metrics import INSTANCE_LABEL, default_instance, warn_if_not_multiprocess

logger = logging.getLogger("lmcache_cartridge.lookup_metrics")

NAME = "lmcache_cartridge_scheduler_lookup_seconds"
OUTCOMES = ("hit", "miss", "wait", "promised", "error")
# Sub-millisecond buckets: a lookup usually takes 0.5-2 ms.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0)


@functools.lru_cache(maxsize=1)
def _histogram():
    """The collector, created once per process (prometheus' collectors are process-wide)."""
    try:
        from prometheus_client import Histogram
    except ImportError:  # metrics are optional
        return None
    warn_if_not_multiprocess()
    return Histogram(NAME, "CartridgeConnector.get_num_new_matched_tokens on vLLM's scheduler thread, by outcome",
                     ["outcome", INSTANCE_LABEL], buckets=BUCKETS)


def outcome_of(answer: tuple) -> str:
    """hit / miss / wait for an answer `(tokens or None, load_async)` to vLLM's scheduler, given
    it was neither promised nor an error (the connector knows those; the answer does not say)."""
    n = answer[0]
    return "wait" if n is None else "hit" if n > 0 else "miss"


class LookupTimer:
    """Scheduler side: the scheduler-role connector's lookup histogram, this instance's series
    declared at zero on construction (an instance that has looked nothing up shows 0, not "no
    data"). Its methods never raise."""

    def __init__(self, instance: str | None = None) -> None:
        self.instance = instance or default_instance()
        self._series: dict = {}
        try:
            h = _histogram()
            if h is not None:
                self._series = {o: h.labels(o, self.instance) for o in OUTCOMES}
        except Exception:  # noqa: BLE001 - e.g. PROMETHEUS_MULTIPROC_DIR naming no directory
            logger.exception("lmcache_cartridge: scheduler lookup metrics are off")

    def observe(self, seconds: float, outcome: str) -> None:
        """One answer to vLLM's scheduler took `seconds`; called on the scheduler's thread."""
        series = self._series.get(outcome)
        if series is None:
            return
        try:
            series.observe(seconds)
        except Exception:  # noqa: BLE001 - never stop the scheduler for a metric
            logger.exception("lmcache_cartridge: scheduler lookup metrics are off")
            self._series = {}

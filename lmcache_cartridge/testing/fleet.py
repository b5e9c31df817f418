"""Start vllm-router in front of local vLLM servers, and read the counters that tell the servers of
a fleet apart. Used by `benchmarks/fleet.py` and `tests/test_fleet.py`, so both run the router
with the same flags.

vllm-router (PyPI `vllm-router`, the vLLM project's Rust router) is not a dependency of this
package: `find_router()` looks for it in `$VLLM_ROUTER`, then on PATH, then in a side venv
`.venv-router/` of the checkout (it pins its own aiohttp/fastapi; kept out of the main venv).

Health checking: every second, a worker is marked unhealthy after 2 failed checks, healthy again
after 1 good one (the defaults, 60 s and 3 failures, leave a dead instance in rotation for up to
three minutes).

Runs in the caller's process; the router is a child process group it owns and kills.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from lmcache_cartridge.tools import starts
from lmcache_cartridge.tools.vllm_process import free_port

ROUTER_HEALTH_FLAGS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "2",
                       "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
                       "--worker-startup-check-interval", "1")


def find_router() -> str | None:
    """The vllm-router executable, or None when it is not installed anywhere we look."""
    env = os.environ.get("VLLM_ROUTER")
    if env:
        return env if Path(env).is_file() else None
    found = shutil.which("vllm-router")
    if found:
        return found
    side = Path(__file__).resolve().parents[2] / ".venv-router" / "bin" / "vllm-router"
    return str(side) if side.is_file() else None


class RouterProcess:
    """`vllm-router --policy P --worker-urls ...` on 127.0.0.1; ready once it answers /v1/models."""

    def __init__(self, binary: str, workers: list[str], policy: str, log_dir: Path, *,
                 extra: tuple[str, ...] = (), timeout: float = 60) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"router-{policy}-{self.port}.log"
        self.command = [binary, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                        "--worker-urls", *workers, *ROUTER_HEALTH_FLAGS, "--log-level", "info", *extra]
        self._log = open(self.log_path, "wb")  # a file, not a pipe: it logs every request
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t0 = time.time()
        deadline = t0 + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                starts.record("vllm-router", "", None, ok=False)
                raise RuntimeError(f"vllm-router exited: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=3) as r:
                    if r.status == 200:
                        starts.record("vllm-router", "", time.time() - t0, mode=policy)
                        return
            except OSError:  # not listening yet: ask again
                pass
            time.sleep(0.3)
        self.stop()
        starts.record("vllm-router", "", None, ok=False, mode=policy)
        raise TimeoutError(f"vllm-router not ready after {timeout}s: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> "RouterProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def metric_samples(url: str, timeout: float = 10):
    """Every sample of one vLLM server's `/metrics` now (prometheus_client's parser), one read."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def instance_counters(url: str, timeout: float = 10) -> dict:
    """One vLLM server's `/metrics`, reduced to what a fleet benchmark compares: finished requests,
    prompt tokens, prompt tokens taken from the KV connector and from vLLM's own prefix cache
    (vLLM's counter), the
    plugin's chunk hits and misses per tier, and the connector's scheduler-side lookups per outcome
    (these need `PROMETHEUS_MULTIPROC_DIR`, as `launch.VllmServer` sets it)."""
    out: dict = {"requests": 0.0, "prompt_tokens": 0.0, "external_tokens": 0.0, "cached_tokens": 0.0,
                 "hits": {}, "misses": {}, "lookups": {}}
    for s in metric_samples(url, timeout):
        if s.name == "vllm:request_success_total":
            out["requests"] += s.value
        elif s.name == "vllm:prompt_tokens_total":
            out["prompt_tokens"] += s.value
        elif s.name == "vllm:prompt_tokens_by_source_total" and s.labels.get("source") == "external_kv_transfer":
            out["external_tokens"] += s.value
        elif s.name == "vllm:prompt_tokens_by_source_total" and s.labels.get("source") == "local_cache_hit":
            out["cached_tokens"] += s.value  # vLLM's own prefix cache
        elif s.name in ("lmcache_cartridge_hits_total", "lmcache_cartridge_misses_total"):
            d = out["hits" if s.name.startswith("lmcache_cartridge_hits") else "misses"]
            d[s.labels["tier"]] = d.get(s.labels["tier"], 0.0) + s.value
        elif s.name == "lmcache_cartridge_scheduler_lookup_seconds_count":
            out["lookups"][s.labels["outcome"]] = out["lookups"].get(s.labels["outcome"], 0.0) + s.value
    return out


def counters_delta(after: dict, before: dict) -> dict:
    """`after - before` for two `instance_counters` results (per tier for the nested ones)."""
    out = {}
    for k, v in after.items():
        out[k] = ({t: x - before[k].get(t, 0.0) for t, x in v.items()} if isinstance(v, dict)
                  else v - before[k])
    return out

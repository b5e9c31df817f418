"""The plugin's worker threads and the cores they run on: the cores of the engine's own threads.

Why: vLLM-CPU binds its worker's OpenMP threads one per core. By default it preloads torch's
libgomp and sets `GOMP_CPU_AFFINITY` to the worker's cores (or, with Intel OpenMP preloaded,
`KMP_AFFINITY=...,explicit,proclist=[...]`), so the worker's main thread runs on the first of
them from the start, and a thread inherits the affinity of the thread that creates it. Left
alone, every thread the plugin starts (the readers a first hit waits on, prefetch, downloads,
disk writes) shares that one core with the thread waiting for them, while the worker's other
cores sit idle during the load; and several readers taking turns on one core are slower than
one thread reading alone (`benchmarks/hit_path.py`). So:

- `engine_cores()` is the union of the cores this process's threads may run on: the OpenMP
  threads' one-core masks together (vLLM's set for this worker), or the process's own mask where
  no thread is narrowed;
- a pool made by `pool()` moves each of its threads onto them as it starts;
- `parallel()` says whether reading chunks on several threads can run in parallel at all (the
  engine has more than one core); where it cannot, the plugin reads on the retrieving thread.

A thread moved here must not start an OpenMP team: libgomp binds a thread that does to its first
place (the native copy kernel runs one-thread work outside OpenMP for that reason).

Where it runs: `engine_cores` and `parallel` in any thread, `run_on_engine_cores` in each pool
thread as it starts (ThreadPoolExecutor's initializer). It owns nothing; Linux only (elsewhere
threads keep the mask they inherit, and reads stay parallel).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger("lmcache_cartridge.store.threads")

_logged = False


def engine_cores() -> set[int]:
    """Every core some thread of this process may run on (empty where Linux's per-thread
    affinity cannot be read)."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return set(os.sched_getaffinity(0))
    cores: set[int] = set()
    for tid in tids:
        try:
            cores |= os.sched_getaffinity(int(tid))  # Linux: a thread id names that thread
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return cores


def parallel() -> bool:
    """Whether threads of this process can run on more than one core."""
    cores = engine_cores()
    return not cores or len(cores) > 1


def run_on_engine_cores() -> None:
    """Move the calling thread onto `engine_cores()` where its own mask is narrower (a pool's
    initializer: the thread that created the pool may be bound to one core)."""
    global _logged
    if not hasattr(os, "sched_setaffinity"):
        return
    mine, cores = os.sched_getaffinity(0), engine_cores()
    if not cores or cores <= mine:
        return
    try:
        os.sched_setaffinity(0, cores)  # 0: the calling thread
    except OSError as e:  # a cpuset that changed under us: keep the inherited mask
        logger.warning("lmcache_cartridge: cannot move a plugin thread onto cores %s: %s", sorted(cores), e)
        return
    if not _logged:
        _logged = True
        logger.info("lmcache_cartridge: plugin threads run on the engine's cores %s, not only on %s "
                    "(the cores of the thread that started them)", sorted(cores), sorted(mine))


def pool(max_workers: int, prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run on the engine's cores (`run_on_engine_cores`)."""
    return ThreadPoolExecutor(max_workers=max(1, max_workers), thread_name_prefix=prefix,
                              initializer=run_on_engine_cores)

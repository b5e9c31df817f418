"""The plugin's worker threads and the cores they run on: the engine's own cores, and for the reads
a retrieve waits on, the cores vLLM's binding leaves to no worker.

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
- `spare_cores()` are the cores an explicit `VLLM_CPU_OMP_THREADS_BIND` gives to no worker:
  vLLM's frontend and engine-core processes run there (with `auto`, vLLM sets such cores aside
  itself: one per rank for them, one more for a KV connector's own work), idle while the
  worker waits for a load;
- `reader_cores(setting)` are where the chunk reads a retrieve waits on run: by default the
  engine's cores and the spare ones (`auto`), or the engine's only (`engine`), or a list;
- a pool made by `pool()` moves each of its threads onto its cores (the engine's by default) as
  it starts;
- `parallel(cores)` says whether reader threads there can do better than the retrieving thread
  alone (more than one core, or another core); where they cannot, the plugin reads on the
  retrieving thread.

A thread moved here must not start an OpenMP team: libgomp binds a thread that does to its first
place (the native copy kernel runs one-thread work outside OpenMP for that reason).

Where it runs: `engine_cores`, `spare_cores`, `reader_cores` and `parallel` in any thread, a
pool's initializer in each of its threads as it starts. It owns nothing; Linux only (elsewhere
threads keep the mask they inherit, and reads stay parallel).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

logger = logging.getLogger("lmcache_cartridge.store.threads")


def engine_cores() -> set[int]:
    """Every core some thread of this process may run on, the threads the plugin moved aside
    (empty where Linux's per-thread affinity cannot be read)."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return set(os.sched_getaffinity(0))
    cores: set[int] = set()
    for tid in tids:
        if int(tid) in _moved:  # ours, moved onto reader cores: not where vLLM put the engine
            continue
        try:
            cores |= os.sched_getaffinity(int(tid))  # Linux: a thread id names that thread
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return cores


def parallel(cores: set[int] | None = None) -> bool:
    """Whether reading on threads on `cores` (default: the engine's) can beat the calling
    thread reading alone: more than one core, or one that is not the calling thread's only core
    (unknown cores: assume so)."""
    cores = engine_cores() if cores is None else cores
    if not cores or len(cores) > 1:
        return True
    return not hasattr(os, "sched_getaffinity") or cores != os.sched_getaffinity(0)


def reader_cores(setting: str = "auto") -> set[int]:
    """Where the reads a retrieve waits on run (`reader_cores` setting): `auto` -> the engine's
    cores and `spare_cores()`, `engine` -> the engine's only, else the cores of a cpu list
    ("0-3,8")."""
    if setting == "engine":
        return engine_cores()
    if setting == "auto":
        return engine_cores() | spare_cores()
    return parse_cpu_list(setting)


_logged: set[tuple[str, frozenset[int]]] = set()
# Native ids of the threads `_move_onto` moved: `engine_cores` leaves them out (a reader moved
# onto a spare core would otherwise make that core the engine's for every later pool). An id a
# finished thread leaves here can only be reused by a later thread, which is then left out too.
_moved: set[int] = set()


def _move_onto(cores: Callable[[], set[int]], spread: Callable[[], int] | None) -> None:
    """A pool's initializer: move the calling thread onto `cores()` (the thread that created the
    pool may be bound to one core); with `spread`, onto one of them: the `spread()`-th, in turn."""
    if not hasattr(os, "sched_setaffinity"):
        return
    mine, want = os.sched_getaffinity(0), cores()
    if want and spread is not None:
        ordered = sorted(want)
        want = {ordered[spread() % len(ordered)]}
    if not want or want == mine:
        return
    try:
        os.sched_setaffinity(0, want)  # 0: the calling thread
        _moved.add(threading.get_native_id())
    except OSError as e:  # a cpuset that changed under us: keep the inherited mask
        logger.warning("lmcache_cartridge: cannot move a plugin thread onto cores %s: %s", sorted(want), e)
        return
    name = threading.current_thread().name.rsplit("_", 1)[0]
    if (name, frozenset(want)) not in _logged:
        _logged.add((name, frozenset(want)))
        logger.info("lmcache_cartridge: a %s thread runs on cores %s, not only on %s (the cores of "
                    "the thread that started it)", name, sorted(want), sorted(mine))


def pool(max_workers: int, prefix: str, cores: Callable[[], set[int]] = engine_cores, *,
         spread: bool = False) -> ThreadPoolExecutor:
    """A thread pool whose threads run on `cores()` (asked as each starts: vLLM binds a worker
    before it serves), the engine's cores by default. `spread`: each thread on one of them, in
    turn, instead of all of them: threads a retrieve waits on stay where their buffers are (a
    thread the scheduler moves to another core finds its scratch buffers in the other core's
    cache, and on the 2-core machine here that costs more than the second core brings,
    `benchmarks/hit_path.py`)."""
    turn = itertools.count().__next__ if spread else None
    return ThreadPoolExecutor(max_workers=max(1, max_workers), thread_name_prefix=prefix,
                              initializer=_move_onto, initargs=(cores, turn))


def parse_cpu_list(text: str) -> set[int]:
    """`"0-3,8"` -> {0, 1, 2, 3, 8} (the syntax of `VLLM_CPU_OMP_THREADS_BIND`'s lists and of
    Linux's cpu lists). Raises ValueError on anything else."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad cpu range {part!r}")
        cores.update(range(first, last + 1))
    return cores


def spare_cores() -> set[int]:
    """The cores this worker's process tree may use that an explicit `VLLM_CPU_OMP_THREADS_BIND`
    ("1", "0-3|4-7": one list per local rank) gives to no rank's OpenMP threads; empty when the
    binding is `auto` or `nobind` or unset (which cores another rank or process holds is not
    known then), or nothing is left over.

    "May use" is the parent process's mask joined with this one's threads': vLLM narrows only
    the worker's threads (its main thread from the start, `GOMP_CPU_AFFINITY`), not the engine
    process that starts it."""
    spec = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").strip()
    if spec in ("", "auto", "nobind") or not hasattr(os, "sched_getaffinity"):
        return set()
    try:
        bound = set().union(*(parse_cpu_list(part) for part in spec.split("|")))
        allowed = set(os.sched_getaffinity(os.getppid()))
    except (ValueError, OSError):
        return set()
    return (allowed | engine_cores()) - bound

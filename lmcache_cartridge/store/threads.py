"""The plugin's worker threads and the cores they run on: the engine's own cores, and for the work
a retrieve waits on (chunk reads, the copy into vLLM's cache), the cores vLLM's binding leaves to
no worker.

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
- `spare_cores()` are the cores an explicit `VLLM_CPU_OMP_THREADS_BIND` gives to no worker of a
  server confined to a few more cores than its workers': the cores its frontend and engine-core
  processes share (vLLM's `auto` binding sets such cores aside itself: one per rank, one more
  per rank with a KV connector), mostly waiting while the worker loads KV;
- `reader_cores(setting)` are where the chunk reads a retrieve waits on run: by default the
  engine's cores, then the spare ones (`auto`), or the engine's only (`engine`), or a list;
- `helper_cores(setting)` are the reader cores that are not the engine's: large copies into and
  out of vLLM's cache are split onto them too (`vllm.cpu_kv`);
- a pool made by `pool()` moves each of its threads onto its cores (the engine's by default) as
  it starts;
- `parallel(cores)` says whether reader threads there can do better than the retrieving thread
  alone (more than one core, or another core); where they cannot, the plugin reads on the
  retrieving thread.

The pools' threads never hold up the process's exit: the stdlib's `ThreadPoolExecutor` joins every
thread of every pool when the interpreter exits, so one task stuck on an origin that hangs
mid-download, or on a peer that died, kept a process alive after SIGTERM until it ended. Here the
threads are daemons the interpreter does not wait for; a caller that must wait for its tasks (a
load writing into buffers about to be freed) says so with `shutdown(wait=True)`.

A thread moved here must not start an OpenMP team: libgomp binds a thread that does to its first
place (the native copy kernel runs one-thread work outside OpenMP for that reason).

Where it runs: `engine_cores`, `spare_cores`, `reader_cores`, `helper_cores` and `parallel` in any thread, a
pool's initializer in each of its threads as it starts. It owns nothing; Linux only (elsewhere
threads keep the mask they inherit, and reads stay parallel).
"""

from __future__ import annotations

import concurrent.futures.thread as _cf_thread
import inspect
import itertools
import logging
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

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


def parallel(cores=None) -> bool:
    """Whether chunks go to reader threads on `cores` (default: the engine's) rather than being
    read by the calling thread: more than one core (readers in parallel), or one core that is not
    the calling thread's (a list that moves reads off it); unknown cores: assume several."""
    cores = engine_cores() if cores is None else set(cores)
    if not cores or len(cores) > 1:
        return True
    return not hasattr(os, "sched_getaffinity") or cores != os.sched_getaffinity(0)


def reader_cores(setting: str = "auto", engine: set[int] | None = None) -> list[int]:
    """Where the reads a retrieve waits on run (`reader_cores` setting), in the order reader
    threads take them: `auto` -> the engine's cores, then `spare_cores()`; `engine` -> the
    engine's only; else the cores of a cpu list ("0-3,8") this process may use (none of them:
    the engine's, with a warning). `engine`: `engine_cores()`, where the caller has it already."""
    mine = engine_cores() if engine is None else engine
    engine = sorted(mine)
    if setting == "engine":
        return engine
    if setting == "auto":
        return engine + sorted(spare_cores(mine) - mine)
    listed = parse_cpu_list(setting)
    usable = listed & (mine | _parent_cores())
    if usable != listed:
        logger.warning("lmcache_cartridge: reader_cores %s: cores %s are not this process's to use%s",
                       setting, sorted(listed - usable), "" if usable else "; reading on the engine's cores")
    return sorted(usable) if usable else engine


def helper_cores(setting: str = "auto") -> list[int]:
    """The reader cores that are not the engine's: where work the worker's thread waits on can run
    beside it rather than take turns with it on its cores (the copy into vLLM's cache,
    `vllm.cpu_kv`). Empty with `engine`, and with `auto` wherever no core is spare."""
    mine = engine_cores()
    return [c for c in reader_cores(setting, mine) if c not in mine]


def _parent_cores() -> set[int]:
    try:
        return set(os.sched_getaffinity(os.getppid()))
    except (AttributeError, OSError):
        return set()


_logged: set[tuple[str, frozenset[int]]] = set()
# Native ids of the threads `_move_onto` moved: `engine_cores` leaves them out (a reader moved
# onto a spare core would otherwise make that core the engine's for every later pool). An id a
# finished thread leaves here can only be reused by a later thread, which is then left out too.
_moved: set[int] = set()


def _move_onto(cores: Callable[[], Iterable[int]], spread: Callable[[], int] | None) -> None:
    """A pool's initializer: move the calling thread onto `cores()` (the thread that created the
    pool may be bound to one core); with `spread`, onto one of them: the `spread()`-th, in the
    order `cores()` gives them."""
    if not hasattr(os, "sched_setaffinity"):
        return
    mine, ordered = os.sched_getaffinity(0), list(cores())
    want = set(ordered)
    if ordered and spread is not None:
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


def pool(max_workers: int, prefix: str, cores: Callable[[], Iterable[int]] = engine_cores, *,
         spread: bool = False) -> ThreadPoolExecutor:
    """A thread pool whose threads run on `cores()` (asked as each starts: vLLM binds a worker
    before it serves), the engine's cores by default. `spread`: each thread on one of them, in
    turn, instead of all of them (give it no more threads than cores): threads a retrieve waits
    on stay where their buffers are (a thread the scheduler moves to another core finds its
    scratch buffers in the other core's cache, and on the 2-core machine here that costs more
    than the second core brings, `benchmarks/hit_path.py`)."""
    turn = itertools.count().__next__ if spread else None
    cls = DaemonPool if _DAEMON_POOL else ThreadPoolExecutor
    return cls(max_workers=max(1, max_workers), thread_name_prefix=prefix, initializer=_move_onto,
               initargs=(cores, turn))


def start_thread(target: Callable[..., None], name: str, *args,
                 cores: Callable[[], Iterable[int]] = engine_cores) -> threading.Thread:
    """Start a daemon thread running `target(*args)` on `cores()` (as a `pool`'s threads: moved
    there as it starts), for work that manages its own threads instead of a pool's."""
    def run() -> None:
        _move_onto(cores, None)
        target(*args)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t


# The stdlib's worker loop as `DaemonPool` starts it (CPython 3.9-3.13); another signature: plain
# pools, whose threads the interpreter waits for at exit.
_DAEMON_POOL = tuple(inspect.signature(_cf_thread._worker).parameters) == \
    ("executor_reference", "work_queue", "initializer", "initargs")


class DaemonPool(ThreadPoolExecutor):
    """A `ThreadPoolExecutor` whose threads are daemons the interpreter does not join at exit (the
    stdlib registers every pool thread to be joined then, so a stuck task keeps the process
    alive). `shutdown(wait=True)` still joins them."""

    def _adjust_thread_count(self) -> None:  # the stdlib's, with daemon threads left unregistered
        if self._idle_semaphore.acquire(timeout=0):
            return

        def weakref_cb(_, q=self._work_queue):
            q.put(None)

        n = len(self._threads)
        if n < self._max_workers:
            t = threading.Thread(name=f"{self._thread_name_prefix or self}_{n}", target=_cf_thread._worker,
                                 args=(weakref.ref(self, weakref_cb), self._work_queue, self._initializer,
                                       self._initargs), daemon=True)
            t.start()
            self._threads.add(t)


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


# At most this many leftover cores per rank count as spare: what vLLM's own `auto` binding sets
# aside (one per rank for its engine-core process, one more with a KV connector). A larger
# leftover is a machine the operator did not confine to this server, whose other cores may well
# be another process's (another instance, another NUMA node's work): not taken.
SPARE_PER_RANK = 2


def spare_cores(engine: set[int] | None = None) -> set[int]:
    """The cores this server's processes may use that an explicit `VLLM_CPU_OMP_THREADS_BIND`
    ("1", "0-3|4-7": one list per local rank, data-parallel ranks included) gives to no rank's
    OpenMP threads, where they are few enough to be the server's own (`SPARE_PER_RANK` per rank:
    a server confined by taskset or a cpuset, as the TTFT runs are); empty when the binding is
    `auto`, `nobind` or unset (whose cores are whose is not known then), when the leftover is
    larger, or nothing is left over.

    "May use" is the parent process's mask joined with this one's threads': vLLM narrows only
    the worker's threads (its main thread from the start, `GOMP_CPU_AFFINITY`), not the engine
    process that starts it. `engine`: `engine_cores()`, where the caller has it already."""
    spec = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").strip()
    if spec in ("", "auto", "nobind") or not hasattr(os, "sched_getaffinity"):
        return set()
    try:
        ranks = [parse_cpu_list(part) for part in spec.split("|")]
    except ValueError:
        return set()
    left = (_parent_cores() | (engine_cores() if engine is None else engine)) - set().union(*ranks)
    return left if len(left) <= SPARE_PER_RANK * len(ranks) else set()

"""The MP adapter's reader: the thread its lookups and loads run on, which one stuck read cannot stop.

Why: the `lmcache server`'s prefetch controller waits on each L2 adapter's lookups and loads with
no deadline of its own, and vLLM's scheduler asks the server again each step while a prefetch is
not done (`LMCacheMPConnector`). One read that never returns (a disk or network filesystem that
stops answering) would keep that request, and every request queued behind it on the adapter,
waiting for ever, plain prompts included. So here:

- a task that makes no progress for `stall_seconds` (its submission, its start, then each key it
  finishes: `Task.beat`) is answered as a miss: plain and first-k requests compute their tokens,
  a trained one waits for a later lookup (vLLM's readiness rule, bounded) or fails with an error;
- the tasks queued behind a stuck one run on a fresh thread; the stuck thread is left to come back
  when its read does, and then ends (at most `MAX_STUCK` are left so at a time: beyond that the
  queue waits for one of them, its tasks answered as misses meanwhile);
- nothing a task read after it was answered reaches the server: a load writes each L1 object only
  inside `Task.writing`, which an answered task refuses, and answering one waits for a write in
  progress (memory speed), so once the miss is out the server may reuse that load's L1 buffers;
  a lookup takes its locks only inside `Task.writing` too.

Tasks without a result (`run`: an origin's close after the loads queued before it) are never
answered early; they run on whichever thread serves the queue then.

Where it runs: `submit` and `run` on the caller's thread (the server's prefetch controller, the
adapter's watcher), the tasks on the reader threads, the stall check on a thread of its own,
`close` on the server's storage manager's thread (before it frees L1). It owns its threads; what
the tasks read and write is the adapter's.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable

from lmcache_cartridge.store import threads

logger = logging.getLogger("lmcache_cartridge.mp_reader")

MAX_STUCK = 4  # threads left on reads that never returned, at most, before the queue waits for one

_QUEUED, _RUNNING, _DONE, _ANSWERED = "queued", "running", "done", "answered"


class Abandoned(Exception):
    """Raised inside a task the reader has answered as a miss: stop, write nothing."""


class Task:
    """One lookup or load (or, with `kind` None, a job without a result) and its progress."""

    def __init__(self, kind: str | None, tid: int, n: int, fn: Callable, args: tuple) -> None:
        self.kind, self.tid, self.n, self.fn, self.args = kind, tid, n, fn, args
        self.beat_at = time.monotonic()
        self.state = _QUEUED
        self._guard = threading.Lock()

    def beat(self) -> None:
        """The task made progress (a key finished): its stall clock starts again."""
        self.beat_at = time.monotonic()

    @property
    def answered(self) -> bool:
        """Answered as a miss by the reader: the task's work is no longer wanted."""
        return self.state == _ANSWERED

    @contextmanager
    def writing(self):
        """Write what the server will see (an L1 object, a lookup's locks) only while the task has
        not been answered; raises `Abandoned` once it has. Answering waits for the block to end."""
        with self._guard:
            if self.state == _ANSWERED:
                raise Abandoned(f"{self.kind} {self.tid} was answered as a miss")
            yield

    def _settle(self, state: str) -> bool:
        """Move to `state` (`_DONE` or `_ANSWERED`) unless settled already; True if this call did."""
        with self._guard:
            if self.state in (_DONE, _ANSWERED):
                return False
            self.state = state
            return True


class Reader:
    """A queue of tasks served in order by one thread at a time, with a stall check (module doc).

    `complete(kind, tid, result)` delivers a task's result; `miss(n)` makes the miss of a task of
    `n` keys. A task is called as `fn(task, *args)` and returns its result; an exception in it is
    logged and answered as a miss."""

    def __init__(self, name: str, complete: Callable[[str, int, Any], None], miss: Callable[[int], Any],
                 stall_seconds: float) -> None:
        self._name, self._complete, self._miss = name, complete, miss
        self.stall_seconds = float(stall_seconds)
        self._cv = threading.Condition()
        self._queue: deque[Task] = deque()
        self._running: dict[int, Task] = {}  # worker number -> its task
        self._stuck: set[int] = set()  # workers whose task was answered while it ran
        self._current: int | None = None  # the worker that serves the queue
        self._numbers = itertools.count()
        self._closed = False
        self.answered_late = 0  # tasks answered as misses (stalled, or closed before they ran)
        with self._cv:
            self._start_worker()
        self._checker = threading.Thread(target=self._check, name=f"{name}-stall", daemon=True)
        self._checker.start()

    # --- callers ----------------------------------------------------------------------------------
    def submit(self, kind: str, tid: int, n: int, fn: Callable, *args: Any) -> None:
        """Queue a task whose result (or miss) `complete` delivers as (kind, tid)."""
        self._queue_task(Task(kind, tid, n, fn, args))

    def run(self, fn: Callable, *args: Any) -> None:
        """Queue `fn(*args)` after the tasks queued so far; it has no result and is never answered
        early. Run here and now once the reader is closed."""
        if not self._queue_task(Task(None, 0, 0, lambda _task, *a: fn(*a), args)):
            fn(*args)

    def close(self) -> None:
        """Stop: answer every task not done as a miss (waiting for a write in progress), so that no
        reader thread writes anything the server sees after this returns; queued jobs without a
        result run here. Threads on a stuck read are left to end when it returns."""
        with self._cv:
            self._closed = True
            queued, running = list(self._queue), list(self._running.values())
            self._queue.clear()
            self._cv.notify_all()
        for task in running + queued:
            if task.kind is None:
                if task.state == _QUEUED:
                    self._call(task)
            else:
                self._answer(task, "the adapter closed")

    def _queue_task(self, task: Task) -> bool:
        with self._cv:
            if self._closed:
                closed = True
            else:
                closed = False
                self._queue.append(task)
                self._cv.notify_all()
        if closed and task.kind is not None:
            self._answer(task, "the adapter closed")
        return not closed

    # --- reader threads -------------------------------------------------------------------------
    def _start_worker(self) -> None:
        """Caller holds `_cv`: a new thread serves the queue from now on."""
        number = next(self._numbers)
        self._current = number
        threads.start_thread(self._work, f"{self._name}_{number}", number)

    def _next(self, me: int) -> Task | None:
        """Caller holds `_cv`: wait until this worker has a task to run, or None when it must end."""
        while True:
            if self._closed:
                return None
            if me in self._stuck:  # back from a task answered while it ran
                self._stuck.discard(me)
                if self._current is not None and self._current != me and self._current not in self._stuck:
                    return None  # the thread started in its place serves the queue
                self._current = me  # that one is stuck as well: serve the queue again
            if me == self._current and self._queue:
                task = self._queue.popleft()
                task.state = _RUNNING
                task.beat()
                self._running[me] = task
                return task
            self._cv.wait()

    def _work(self, me: int) -> None:
        while True:
            with self._cv:
                task = self._next(me)
            if task is None:
                return
            result = self._call(task)
            with self._cv:
                self._running.pop(me, None)
            if task.kind is not None and task._settle(_DONE):
                self._complete(task.kind, task.tid, result)

    def _call(self, task: Task) -> Any:
        try:
            return task.fn(task, *task.args)
        except Abandoned:
            return None
        except Exception as e:
            logger.error("lmcache_cartridge MP adapter: %s failed: %s: %s", task.kind or "a reader job",
                         type(e).__name__, e)
            return self._miss(task.n) if task.kind is not None else None

    # --- the stall check --------------------------------------------------------------------------
    def _check(self) -> None:
        period = max(0.05, min(1.0, self.stall_seconds / 4))
        while True:
            with self._cv:
                if self._cv.wait_for(lambda: self._closed, timeout=period):
                    return
                now = time.monotonic()
                late = [(me, t) for me, t in self._running.items() if now - t.beat_at > self.stall_seconds]
                # queued tasks wait for a thread that serves the queue; only when none does (every
                # thread stuck, `MAX_STUCK` reached) are they answered instead
                nobody = self._current in self._stuck
                waiting = [t for t in self._queue
                           if nobody and t.kind is not None and now - t.beat_at > self.stall_seconds]
                for t in waiting:
                    self._queue.remove(t)
            for me, task in late:
                if task.kind is None or self._answer(task, f"no progress for {self.stall_seconds:g}s"):
                    with self._cv:
                        if me in self._running and me not in self._stuck:
                            self._stuck.add(me)
                            if me == self._current and len(self._stuck) <= MAX_STUCK:
                                self._start_worker()
                            logger.warning("lmcache_cartridge MP adapter: a reader thread is stuck (%s); "
                                           "%d stuck, the queue served by %s", task.kind or "a reader job",
                                           len(self._stuck), "a fresh thread" if self._current not in
                                           self._stuck else "nobody until one comes back")
            for task in waiting:
                self._answer(task, f"waited {self.stall_seconds:g}s behind a stuck read")

    def _answer(self, task: Task, why: str) -> bool:
        """Answer `task` as a miss now, unless it is done; True if this call answered it."""
        if not task._settle(_ANSWERED):
            return False
        self.answered_late += 1
        logger.warning("lmcache_cartridge MP adapter: %s %d answered as a miss: %s", task.kind, task.tid, why)
        self._complete(task.kind, task.tid, self._miss(task.n))
        return True

    def stuck(self) -> int:
        """Reader threads on a task answered while it ran, not back yet."""
        with self._cv:
            return len(self._stuck)

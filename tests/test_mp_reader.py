"""The MP adapter's reader (`lmcache.mp_reader`) on its own: stuck tasks are answered as misses,
the queue moves to a fresh thread at most `MAX_STUCK` times, then waits (its tasks answered as
misses) until a stuck thread comes back and serves it again. Tasks block on events here: a read
that never returns cannot be caused without root (the adapter's own test holds its origin's read)."""

from __future__ import annotations

import threading
import time

from lmcache_cartridge.lmcache.mp_reader import MAX_STUCK, Reader

STALL = 0.2


def _reader():
    results: dict[int, object] = {}
    done = threading.Condition()

    def complete(kind, tid, result):
        with done:
            results[tid] = result
            done.notify_all()

    def wait(tid, timeout=10.0):
        with done:
            assert done.wait_for(lambda: tid in results, timeout), f"task {tid} was never answered"
            return results[tid]

    return Reader("test-reader", complete, lambda n: ("miss", n), STALL), wait


def test_stuck_tasks_are_answered_and_the_queue_moves_on_until_every_spare_thread_is_stuck():
    reader, wait = _reader()
    release = threading.Event()
    ran: list[int] = []

    def stuck(task, tid):
        release.wait(30)
        with task.writing():  # what the server would see: refused once answered
            ran.append(tid)
        return ("hit", tid)

    def quick(task, tid):
        return ("hit", tid)

    try:
        # the first thread and MAX_STUCK fresh ones each get stuck: every task answered as a miss
        for tid in range(MAX_STUCK + 1):
            reader.submit("load", tid, 3, stuck, tid)
            assert wait(tid) == ("miss", 3)
        assert reader.stuck() == MAX_STUCK + 1
        # no thread serves the queue now: a task waits its stall period, then is answered
        late = reader.answered_late
        reader.submit("lookup", 100, 1, quick, 100)
        assert wait(100) == ("miss", 1) and reader.answered_late == late + 1

        release.set()  # the reads come back: nothing written, one thread serves the queue again
        deadline = time.monotonic() + 10
        while reader.stuck() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reader.stuck() == 0 and ran == []
        reader.submit("lookup", 101, 1, quick, 101)
        assert wait(101) == ("hit", 101)
        jobs: list[str] = []
        reader.run(jobs.append, "after 101")  # a job without a result, in order
        reader.submit("lookup", 102, 1, quick, 102)
        assert wait(102) == ("hit", 102) and jobs == ["after 101"]
        assert reader.answered_late == MAX_STUCK + 2
    finally:
        release.set()
        reader.close()


def test_a_task_that_keeps_making_progress_is_never_answered_early():
    reader, wait = _reader()

    def slow(task, steps):
        for _ in range(steps):  # each step well inside the stall period, the whole well beyond it
            time.sleep(STALL / 4)
            task.beat()
        return "all of it"

    try:
        reader.submit("load", 1, 1, slow, 20)
        reader.submit("lookup", 2, 1, lambda task: "behind it")
        assert wait(1) == "all of it" and wait(2) == "behind it"
        assert reader.answered_late == 0
    finally:
        reader.close()

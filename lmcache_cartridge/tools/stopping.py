"""SIGTERM stops a command the way Ctrl-C does, so that what it started stops with it.

`create` runs a private vLLM server (the KV maker) in a session of its own, and `train` a vLLM
engine core with its workers: on SIGTERM's default action (a `kill`, a job scheduler, a
container stop) the command died at once and those processes ran on, holding their cores,
memory and port. Turned into `KeyboardInterrupt`, the signal unwinds the command's `with`
blocks and `finally` clauses, which stop them.

Runs in the command's main thread (`tools.cli.main`, `tools.train.main`); elsewhere (a thread,
a test calling a command in-process) it changes nothing.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises `KeyboardInterrupt` in the main thread; the previous
    handler is put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

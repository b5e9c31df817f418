"""The `lmcache server`'s L1 memory faulted in at start, so a cartridge's first load does not pay
for the kernel's page allocation.

Why: LMCache maps its L1 arena (a `/dev/shm` segment under `lmcache-cartridge mp-server`) without
touching it, and the kernel allocates and zeroes each page the first time something writes it. A
cartridge's first load writes chunks into L1 pages nobody used before: at 16K tokens of
SmolLM2-135M (377 MB) that cost more than the load itself (0.3-0.6 s on two cores;
docs/benchmarks.md). vLLM's own KV that the server stores pays it when stored, off the hit. With
`prefault_l1` on (the default) the whole arena is faulted in once, in the background, right after
the server starts: `madvise(MADV_POPULATE_WRITE)` (Linux 5.14) allocates the pages without
changing their contents, so it is safe beside a server that already stores and loads. The
arena's memory is committed at start instead of as it fills (`--l1-size-gb` is what the operator
set aside for it). Where the call is not supported (another OS, an older kernel) nothing happens
but a log line.

Where it runs: inside the `lmcache server`, on one daemon thread the server module starts
(`vllm.mp_server`), in `STEP`-sized calls. It reads the arena's address from LMCache's
`StorageManager.l1_memory_desc` and owns nothing.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
import time

logger = logging.getLogger("lmcache_cartridge.l1_prefault")

MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14
STEP = 64 << 20  # bytes per madvise call: the thread gives up the mm's lock between calls


def populate(ptr: int, size: int, step: int = STEP) -> int:
    """Fault in the whole pages of [ptr, ptr + size) for writing, contents unchanged; return the
    bytes populated. `OSError` (errno of the failing call) where the kernel refuses."""
    if not sys.platform.startswith("linux"):
        raise OSError(0, "MADV_POPULATE_WRITE is Linux's")
    page = mmap.PAGESIZE
    start, end = -(-ptr // page) * page, (ptr + size) // page * page  # whole pages inside the range
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    done = 0
    for at in range(start, end, step):
        n = min(step, end - at)
        if libc.madvise(at, n, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
        done += n
    return done


def prefault_l1(storage_manager) -> threading.Thread | None:
    """Start faulting in the server's L1 arena in the background (see module doc); None when the
    server exposes no single L1 arena (several L1s, GDS)."""
    try:
        desc = storage_manager.l1_memory_desc
    except (AttributeError, ValueError) as e:
        logger.info("lmcache_cartridge: L1 not faulted in at start: %s", e)
        return None

    def run() -> None:
        t0 = time.perf_counter()
        try:
            n = populate(int(desc.ptr), int(desc.size))
        except OSError as e:
            logger.info("lmcache_cartridge: L1 not faulted in at start (%s); its pages are allocated "
                        "as they are first written", e)
            return
        logger.info("lmcache_cartridge: faulted in %.2f GiB of L1 in %.1f s", n / (1 << 30),
                    time.perf_counter() - t0)

    thread = threading.Thread(target=run, name="cartridge-l1-prefault", daemon=True)
    thread.start()
    return thread

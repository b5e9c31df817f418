"""The `lmcache server`'s L1 memory faulted in at start, so a cartridge's first load does not pay
for the kernel's page allocation.

Why: on a CPU host LMCache maps its L1 arena (a `/dev/shm` segment under
`lmcache-cartridge mp-server`) without touching it (with CUDA it pins it, which allocates it at
start), and the kernel allocates and zeroes each page the first time something writes it. A
cartridge's first load writes chunks into L1 pages nobody used before: writing 377 MB (16K tokens
of SmolLM2-135M) into fresh shared-memory pages took 0.58 s against 0.05 s into used ones on two
shared cores (see also docs/benchmarks.md). vLLM's own KV that the server stores pays it when
stored, off the hit. With `prefault_l1` on (the default) the whole arena is faulted in once, in
the background, right after the server starts: `madvise(MADV_POPULATE_WRITE)` (Linux 5.14) allocates the pages without
changing their contents, so it is safe beside a server that already stores and loads. The
arena's memory is committed at start instead of as it fills (`--l1-size-gb` is what the operator
set aside for it). Where the call is not supported (another OS, an older kernel) nothing happens
but a log line.

A vLLM worker attached to the server maps the same segment (LMCache's engine-driven transfer in
shared memory) and pays a smaller cost on its first read of each page, whose mapping it sets up
then (a minor fault, no allocation): about a third of the server's. `map_l1_pages` sets them up
in the background once the server has faulted its L1 in (the segment fully allocated), so a
worker never allocates L1 pages the server left to be allocated as they are written.

Where it runs: inside the `lmcache server`, on one daemon thread the server module starts
(`vllm.mp_server`), in `STEP`-sized calls, reading the arena's address from LMCache's
`StorageManager.l1_memory_desc`; and in each vLLM worker on `CartridgeMPConnector`
(`vllm.mp_connector`), on one daemon thread after its KV caches are registered, reading its
mappings of the server's segment from /proc/self/maps. It owns nothing.
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

MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # <linux/mman.h>, Linux 5.14
# LMCache names a shared-memory L1 pool `lmcache_l1_pool_<--shm-name>` (and unlinks a stale segment
# of that name at start); `tools.lmcache_server` names its servers' pools after it.
SHM_PREFIX = "lmcache_l1_pool_"
L1_SEGMENT = f"/dev/shm/{SHM_PREFIX}"
STEP = 64 << 20  # bytes per madvise call: the thread gives up the mm's lock between calls


def populate(ptr: int, size: int, step: int = STEP, advice: int = MADV_POPULATE_WRITE) -> int:
    """Fault in the whole pages of [ptr, ptr + size) (for writing, or reading with
    `MADV_POPULATE_READ`), contents unchanged; return the bytes populated. `OSError` (errno of
    the failing call) where the kernel refuses."""
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
        if libc.madvise(at, n, advice) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise({advice}): {os.strerror(err)}")
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


def l1_mappings(maps: str = "/proc/self/maps") -> list[tuple[int, int, str]]:
    """(start, length, path) of this process's mappings of a server's shared-memory L1."""
    out = []
    with open(maps, encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip().startswith(L1_SEGMENT):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi - lo, parts[5].strip()))
    return out


def map_l1_pages(wait_s: float = 120.0, poll_s: float = 0.5) -> threading.Thread:
    """A vLLM worker's side (see module doc): in the background, once each mapped L1 segment is
    fully allocated (the server faulted it in; waited for at most `wait_s`), set up this
    process's mappings of its pages. Segments the server leaves unallocated are left alone."""

    def run() -> None:
        deadline = time.monotonic() + wait_s
        try:
            pending = {(start, length): path for start, length, path in l1_mappings()}
        except OSError as e:  # no /proc: pages are mapped as they are read
            logger.info("lmcache_cartridge: the server's L1 is mapped as it is read: %s", e)
            return
        while pending:
            for (start, length), path in list(pending.items()):
                try:
                    st = os.stat(path)
                    if st.st_blocks * 512 < st.st_size:
                        continue  # the server is still faulting it in (or leaves it lazy)
                    t0 = time.perf_counter()
                    populate(start, length, advice=MADV_POPULATE_READ)
                    logger.info("lmcache_cartridge: mapped %.2f GiB of the server's L1 (%s) in %.1f s",
                                length / (1 << 30), path, time.perf_counter() - t0)
                except OSError as e:
                    logger.info("lmcache_cartridge: the server's L1 (%s) is mapped as it is read: %s", path, e)
                del pending[(start, length)]
            if pending and time.monotonic() >= deadline:
                logger.info("lmcache_cartridge: the server's L1 (%s) is not allocated after %.0f s: its pages "
                            "are mapped as they are read", ", ".join(sorted(set(pending.values()))), wait_s)
                return
            time.sleep(poll_s)

    thread = threading.Thread(target=run, name="cartridge-l1-map", daemon=True)
    thread.start()
    return thread

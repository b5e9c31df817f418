"""The `lmcache server`'s L1 faulted in at start (`lmcache.l1_prefault`): the pages of a real
/dev/shm segment are allocated without changing a byte, and a REAL `lmcache server` with the
cartridge adapter has its whole shared-memory L1 allocated shortly after start (with
`prefault_l1: false`, as LMCache leaves it, only what was written)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time
from multiprocessing import shared_memory

import pytest

from lmcache_cartridge.lmcache.l1_prefault import populate



def _kernel_populates() -> bool:
    """Whether this kernel has MADV_POPULATE_WRITE (Linux 5.14+); older ones answer EINVAL."""
    if not sys.platform.startswith("linux"):
        return False
    m = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        populate(ctypes.addressof(ctypes.c_char.from_buffer(m)), mmap.PAGESIZE)
        return True
    except OSError:
        return False
    finally:
        m.close()


pytestmark = pytest.mark.skipif(not _kernel_populates(), reason="no MADV_POPULATE_WRITE (Linux 5.14+) here")


def allocated(path: str) -> int:
    """Bytes the kernel holds for a /dev/shm file (its pages that were faulted in)."""
    return os.stat(path).st_blocks * 512


def test_populate_allocates_every_page_and_keeps_the_bytes():
    size = 64 * mmap.PAGESIZE
    shm = shared_memory.SharedMemory(create=True, size=size)
    try:
        path = f"/dev/shm/{shm.name}"
        shm.buf[5 * mmap.PAGESIZE:5 * mmap.PAGESIZE + 4] = b"kept"
        assert allocated(path) <= 2 << 20  # only the page written (a huge page where /dev/shm uses them)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(shm.buf))
        assert populate(ptr, size, step=16 * mmap.PAGESIZE) == size
        assert allocated(path) == size
        assert bytes(shm.buf[5 * mmap.PAGESIZE:5 * mmap.PAGESIZE + 4]) == b"kept"
        assert not any(shm.buf[:5 * mmap.PAGESIZE])  # the others as they were: zero
        # a range not on page boundaries: only the whole pages inside it
        assert populate(ptr + 1, 3 * mmap.PAGESIZE) == 2 * mmap.PAGESIZE
    finally:
        shm.close()
        shm.unlink()


@pytest.mark.parametrize("prefault", [True, False])
def test_an_mp_server_faults_its_l1_in_at_start(tmp_path, prefault):
    import torch

    if not prefault and torch.cuda.is_available():
        pytest.skip("LMCache pins a shared-memory L1 where CUDA is present, which allocates it at start")
    from lmcache_cartridge.tools.lmcache_server import LmcacheServer

    params = {"registry": str(tmp_path / "registry.db"), "cache_dir": str(tmp_path / "cache"),
              **({} if prefault else {"prefault_l1": False})}
    size = 1 << 28
    with LmcacheServer(tmp_path / "server", params, l1_size_gb=size / (1 << 30)) as server:
        server.wait_ready()
        path = f"/dev/shm/{server.shm_name}"
        deadline = time.time() + (60 if prefault else 3)
        line = "faulted in 0.25 GiB of L1"  # logged once the last call returned
        while (allocated(path) < size or line not in server.log_text()) and time.time() < deadline:
            time.sleep(0.2)
        if prefault:
            assert allocated(path) >= size, server.log_tail()
            assert line in server.log_text(), server.log_tail()
        else:
            assert allocated(path) < size // 10, server.log_tail()


def rss(start: int) -> int:
    """Bytes of this process's mapping at `start` that are mapped in (/proc/self/smaps)."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if not found and "-" in line.split()[0] and int(line.split("-")[0], 16) == start:
                found = True
            elif found and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at {start:#x}")


@pytest.mark.parametrize("allocated_first", [True, False])
def test_a_worker_maps_the_servers_l1_pages_once_the_server_allocated_them(allocated_first):
    """The worker's side (`map_l1_pages`, started by CartridgeMPConnector once LMCache mapped the
    server's L1): its mapping of a fully allocated segment is set up in the background; a
    segment the server leaves to be allocated as written (`prefault_l1: false`) stays as it is."""
    from uuid import uuid4

    from lmcache_cartridge.lmcache.l1_prefault import MADV_POPULATE_WRITE, L1_SEGMENT, l1_mappings, map_l1_pages

    size = 256 * mmap.PAGESIZE
    name = f"{L1_SEGMENT.rsplit('/', 1)[1]}test_{uuid4().hex[:8]}"
    server = shared_memory.SharedMemory(name=name, create=True, size=size)
    worker = shared_memory.SharedMemory(name=name)  # a second mapping, as the worker's
    try:
        if allocated_first:
            populate(ctypes.addressof(ctypes.c_char.from_buffer(server.buf)), size, advice=MADV_POPULATE_WRITE)
        start = ctypes.addressof(ctypes.c_char.from_buffer(worker.buf))
        assert any(s == start and path == f"/dev/shm/{name}" for s, _, path in l1_mappings())
        assert rss(start) == 0
        map_l1_pages(wait_s=2.0, poll_s=0.1).join(timeout=30)
        if allocated_first:
            assert rss(start) == size
        else:
            assert rss(start) == 0 and allocated(f"/dev/shm/{name}") == 0
    finally:
        worker.close()
        server.close()
        server.unlink()

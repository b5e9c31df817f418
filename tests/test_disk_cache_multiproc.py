"""One disk cache per host: several real processes (spawned, not threads) share one `DiskTier`
directory, with a budget below the working set.

What is checked, against the files on disk: no process errors, every read returns the chunk's
exact bytes, the directory never holds more than the budget (sampled while the processes run,
and at the end), a process SIGKILLed in the middle of a write leaves nothing that breaks the
others and its temp file is reclaimed, and a starting process leaves live writers' temp files
alone.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import random
import re
import signal
import sqlite3
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import random_kv
from lmcache_cartridge.cartridge.packed import PackedCartridge, pack_kv
from lmcache_cartridge.store.disk_cache import INDEX_NAME, MUTEX_NAME, OWNERS_DIR, DiskTier
from lmcache_cartridge.store.origins import LocalOrigin
from lmcache_cartridge.store.metrics import Metrics
from lmcache_cartridge.store.residency import Handle, MemoryTier, NotLocal, Residency

CHUNK = 16
N_CHUNKS = 24  # working set: 24 chunks of 64 KiB
BUDGET_CHUNKS = 7  # host budget: 7 chunks
TMP = re.compile(r"^\.(\d+)\.chunk\..*\.tmp$")


def _pack(root: Path) -> PackedCartridge:
    kv = random_kv(2, N_CHUNKS * CHUNK, 8, 64, seed=3)  # 4 KiB per token, 64 KiB per chunk
    pack_kv(kv, root / "cart", cartridge_id="mp", model="m", kind="first_k",
            token_ids=list(range(N_CHUNKS * CHUNK)), chunk_size=CHUNK)
    return PackedCartridge(root / "cart")


def _chunk(p: PackedCartridge, i: int) -> torch.Tensor:
    return p.read_raw(i).clone()  # payload bytes, as the disk tier holds them


def _cache_bytes(root: Path) -> tuple[int, int]:
    """(bytes of chunk and temp files, the same counting each chunk once). The second is what
    the budget bounds: a rename observed half-way by a directory walk can list one chunk under
    both its temp and its final name."""
    raw, per_chunk = 0, {}
    for d in root.iterdir():
        if not d.is_dir() or len(d.name) != 64:
            continue
        for f in d.iterdir():
            try:
                size = f.stat().st_size
            except FileNotFoundError:
                continue
            m = TMP.match(f.name)
            idx = int(m.group(1)) if m else int(f.stem) if f.suffix == ".chunk" and f.stem.isdigit() else None
            if idx is None:
                continue
            raw += size
            per_chunk[(d.name, idx)] = max(size, per_chunk.get((d.name, idx), 0))
    return raw, sum(per_chunk.values())


def _sample_locked(root: Path) -> tuple[int, int]:
    """Measure while holding the index's write lock (as a writer takes it): no process reserves,
    evicts or publishes meanwhile, so the sample is one consistent state of the cache."""
    fd = os.open(root / MUTEX_NAME, os.O_RDWR)
    db = sqlite3.connect(root / INDEX_NAME, timeout=60, isolation_level=None)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        db.execute("BEGIN IMMEDIATE")
        try:
            return _cache_bytes(root)
        finally:
            db.execute("COMMIT")
    finally:
        db.close()
        os.close(fd)


# --- child processes (spawned: module-level functions) ----------------------------------------
def _hammer(root: str, cart: str, budget: int, ops: int, seed: int, progress, results) -> None:
    """Read a random chunk from the shared cache; on a miss, "fetch" it (the packed file is the
    origin) and put it. Every hit is compared byte for byte."""
    out = {"seed": seed, "hits": 0, "misses": 0, "puts": 0, "kept": 0, "mismatch": 0, "error": None}
    try:
        torch.set_num_threads(1)  # four processes on a small machine: torch's pool only spins
        p = PackedCartridge(Path(cart))
        handle = Handle(p.manifest, LocalOrigin(p.directory))
        expected = [_chunk(p, i).numpy() for i in range(N_CHUNKS)]
        disk = DiskTier(root, budget, janitor_interval_s=0.2)
        rng = random.Random(seed)
        buf = np.empty_like(expected[0])
        t0 = time.perf_counter()
        for n in range(ops):
            i = rng.randrange(N_CHUNKS)
            cid = (p.manifest.content_hash, i)
            buf.fill(0)
            if disk.get_into(cid, memoryview(buf), handle):
                out["hits"] += 1
                out["mismatch"] += int(not np.array_equal(buf, expected[i]))
            else:
                out["misses"] += 1
                out["puts"] += 1
                out["kept"] += int(disk.put(cid, memoryview(expected[i])))
            progress.value = n + 1
        out["loop_s"] = time.perf_counter() - t0
        out["disk_errors"] = disk.metrics.tiers["disk"].errors if "disk" in disk.metrics.tiers else 0
    except BaseException:
        out["error"] = traceback.format_exc()
    results.put(out)


def _slow_writer(root: str, cart: str, budget: int, index: int, marker: str, go: str, results) -> None:
    """Put one chunk with a disk that stalls in fsync (a slow disk cannot be caused on demand):
    `marker` appears once the temp file is written; the write finishes when `go` appears."""
    real_fsync = os.fsync

    def slow_fsync(fd):
        Path(marker).write_text(str(os.getpid()))
        while not Path(go).exists():
            time.sleep(0.02)
        real_fsync(fd)

    try:
        p = PackedCartridge(Path(cart))
        disk = DiskTier(root, budget)
        os.fsync = slow_fsync
        ok = disk.put((p.manifest.content_hash, index), memoryview(_chunk(p, index).numpy()))
        results.put({"ok": ok, "error": None})
    except BaseException:
        results.put({"ok": False, "error": traceback.format_exc()})


# --- tests -----------------------------------------------------------------------------------
@pytest.fixture
def cart(tmp_path):
    return _pack(tmp_path)


def _ctx():
    return mp.get_context("spawn")


def test_processes_share_one_budget_no_corrupt_reads_survive_sigkill(tmp_path, cart):
    root = tmp_path / "chunks"
    size = cart.manifest.chunks[0].nbytes
    budget = BUDGET_CHUNKS * size
    ctx = _ctx()
    results = ctx.Queue()
    n_procs, ops = 4, 600
    progress = [ctx.Value("i", 0) for _ in range(n_procs)]
    # process 0 runs until it is killed: however fast the machine, it dies part-way through its work
    procs = [ctx.Process(target=_hammer, args=(str(root), str(cart.directory), budget, ops if s else 10**9, s,
                                               progress[s], results))
             for s in range(n_procs)]
    for pr in procs:
        pr.start()
    samples, killed = [], False
    while any(pr.is_alive() for pr in procs):
        if (root / MUTEX_NAME).exists() and (root / INDEX_NAME).exists():
            samples.append(_sample_locked(root))
        # SIGKILL one process part-way through, wherever it is (mid-write, mid-read, in a txn); at the
        # latest when the others are done
        if not killed and (progress[0].value >= ops // 3 or not any(pr.is_alive() for pr in procs[1:])):
            procs[0].kill()
            killed = True
        time.sleep(0.02)
    for pr in procs:
        pr.join()
    assert killed and procs[0].exitcode == -signal.SIGKILL and progress[0].value >= ops // 3
    outs = [results.get(timeout=30) for _ in range(n_procs - 1)]
    for o in outs:
        assert o["error"] is None, o["error"]
    assert sum(o["mismatch"] for o in outs) == 0
    assert sum(o["disk_errors"] for o in outs) == 0  # no short/corrupt file was ever read
    hits, puts = sum(o["hits"] for o in outs), sum(o["puts"] for o in outs)
    assert hits > 0 and puts > 0  # both paths were exercised, evictions happened
    assert len(samples) >= 5
    assert max(s[1] for s in samples) <= budget, (max(samples), budget)
    # the survivors and a fresh process see one consistent cache within the budget
    fresh = DiskTier(root, budget)  # a starting process reclaims what the killed one left
    raw, _ = _cache_bytes(root)
    assert raw <= budget and fresh.used <= budget
    names = [f.name for d in root.iterdir() if d.is_dir() and len(d.name) == 64 for f in d.iterdir()]
    assert not [n for n in names if n.startswith(".")]  # no temp file left behind
    assert sorted(fresh.keys()) == sorted((cart.manifest.content_hash, int(n.split(".")[0])) for n in names)
    assert [f.name for f in (root / OWNERS_DIR).iterdir()] == [f"{fresh._owner.token}.lock"]
    handle = Handle(cart.manifest, LocalOrigin(cart.directory))
    buf = torch.empty(size, dtype=torch.uint8)
    for cid in fresh.keys():
        assert fresh.get_into(cid, memoryview(buf.numpy()), handle) and torch.equal(buf, _chunk(cart, cid[1]))
    print(f"\nmultiproc disk cache: {n_procs} processes (1 SIGKILLed), hits={hits} puts={puts} "
          f"kept={sum(o['kept'] for o in outs)}, budget={budget}, max sampled={max(s[1] for s in samples)} "
          f"(raw {max(s[0] for s in samples)}) over {len(samples)} samples, end={raw}, "
          f"loop seconds {[round(o['loop_s'], 1) for o in outs]}")


def test_starting_process_keeps_a_live_writers_temp_file(tmp_path, cart):
    """Fails on the old per-process index: a starting instance deleted every dot-file, so the
    live writer's rename failed and its chunk was not cached."""
    root = tmp_path / "chunks"
    size = cart.manifest.chunks[0].nbytes
    marker, go = tmp_path / "in-fsync", tmp_path / "go"
    ctx = _ctx()
    results = ctx.Queue()
    writer = ctx.Process(target=_slow_writer,
                         args=(str(root), str(cart.directory), 4 * size, 2, str(marker), str(go), results))
    writer.start()
    deadline = time.time() + 60
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.02)
    assert marker.exists()
    d = root / cart.manifest.content_hash
    tmps = [f for f in d.iterdir() if f.name.startswith(".")]
    assert len(tmps) == 1  # the writer's temp file, complete but not yet renamed
    DiskTier(root, 4 * size)  # another instance starts on the host
    assert tmps[0].exists()
    go.write_text("")
    out = results.get(timeout=60)
    writer.join(30)
    assert out["error"] is None, out["error"]
    assert out["ok"] and (d / "2.chunk").read_bytes() == bytes(_chunk(cart, 2).numpy())


def test_writer_killed_mid_write_is_reclaimed_and_others_go_on(tmp_path, cart):
    root = tmp_path / "chunks"
    size = cart.manifest.chunks[0].nbytes
    budget = 3 * size
    marker, go = tmp_path / "in-fsync", tmp_path / "never"
    ctx = _ctx()
    results = ctx.Queue()
    writer = ctx.Process(target=_slow_writer,
                         args=(str(root), str(cart.directory), budget, 0, str(marker), str(go), results))
    writer.start()
    deadline = time.time() + 60
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.02)
    assert marker.exists()
    other = DiskTier(root, budget, janitor_interval_s=3600)  # running before the writer dies
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(30)
    d = root / cart.manifest.content_hash
    assert [f for f in d.iterdir() if f.name.startswith(".")]  # its temp file is still there
    # the other process fills the cache: the dead writer's reservation is in the way of the
    # third chunk, so that put reclaims it (row, temp file and lock file) before evicting
    # anything, and the budget holds
    handle = Handle(cart.manifest, LocalOrigin(cart.directory))
    for i in (1, 2, 3):
        assert other.put((cart.manifest.content_hash, i), memoryview(_chunk(cart, i).numpy()))
    assert not [f for f in d.iterdir() if f.name.startswith(".")]
    assert sorted(other.keys()) == [(cart.manifest.content_hash, i) for i in (1, 2, 3)]  # nothing evicted
    assert other.used <= budget and _cache_bytes(root)[0] <= budget
    assert [f.name for f in (root / OWNERS_DIR).iterdir()] == [f"{other._owner.token}.lock"]
    buf = torch.empty(size, dtype=torch.uint8)
    assert not other.get_into((cart.manifest.content_hash, 0), memoryview(buf.numpy()), handle)  # a miss
    assert other.put((cart.manifest.content_hash, 0), memoryview(_chunk(cart, 0).numpy()))
    assert other.get_into((cart.manifest.content_hash, 0), memoryview(buf.numpy()), handle)
    assert torch.equal(buf, _chunk(cart, 0))


def test_reader_of_a_file_another_process_evicted_gets_a_clean_miss(tmp_path, cart):
    """Process A indexed a chunk, process B evicted it: A's read is a miss (no error counted),
    and A's lookup stops claiming it."""
    root = tmp_path / "chunks"
    size = cart.manifest.chunks[0].nbytes
    handle = Handle(cart.manifest, LocalOrigin(cart.directory))
    a = DiskTier(root, 2 * size)
    cid0 = (cart.manifest.content_hash, 0)
    assert a.put(cid0, memoryview(_chunk(cart, 0).numpy())) and cid0 in a
    ctx = _ctx()
    results = ctx.Queue()
    # B: a real other process that fills the budget with other chunks (evicting chunk 0)
    b = ctx.Process(target=_fill, args=(str(root), str(cart.directory), 2 * size, [5, 6], results))
    b.start()
    assert results.get(timeout=60) == [True, True]
    b.join(30)
    assert not (root / cart.manifest.content_hash / "0.chunk").exists()
    buf = torch.empty(size, dtype=torch.uint8)
    assert not a.get_into(cid0, memoryview(buf.numpy()), handle)
    assert "disk" not in a.metrics.tiers and cid0 not in a  # no error counted
    # through the tiers: the hot path says NotLocal (a miss), a download fetches it again
    res = Residency(MemoryTier("cpu", 0), a, Metrics(), prefetch=False)
    remote = Handle(cart.manifest, _RemoteOrigin(cart.directory))
    out = torch.empty(cart.chunk_shape(0), dtype=torch.bfloat16)
    with pytest.raises(NotLocal):
        res.read_into(remote, 0, out, network=False)
    assert res.read_into(remote, 0, out) == "s3" and torch.equal(out, cart.read_chunk(0))
    assert "disk" not in res.metrics.tiers or res.metrics.tiers["disk"].errors == 0
    res.close()


def test_a_held_chunk_survives_another_processs_eviction_until_released(tmp_path, cart):
    """A lookup's hold (`DiskTier.hold`, a shared flock) keeps a published file from eviction by
    any process on the host: B's put that would need A's held chunks does not fit (False,
    nothing evicted); once A releases one, B's put evicts that one and no other. A `discard`
    (force_redownload) still removes a held file, and the read then misses."""
    root = tmp_path / "chunks"
    size = cart.manifest.chunks[0].nbytes
    handle = Handle(cart.manifest, LocalOrigin(cart.directory))
    a = DiskTier(root, 2 * size)
    cid0, cid1 = (cart.manifest.content_hash, 0), (cart.manifest.content_hash, 1)
    for cid in (cid0, cid1):
        assert a.put(cid, memoryview(_chunk(cart, cid[1]).numpy()))
    h0, h1 = a.hold(cid0), a.hold(cid1)
    assert h0 is not None and h1 is not None and h0.held
    assert a.hold((cart.manifest.content_hash, 9)) is None  # no such file: nothing to promise
    ctx = _ctx()
    results = ctx.Queue()

    def b_puts(indices):  # a real other process over the same directory and budget
        b = ctx.Process(target=_fill, args=(str(root), str(cart.directory), 2 * size, indices, results))
        b.start()
        got = results.get(timeout=60)
        b.join(30)
        return got

    assert b_puts([5]) == [False]  # both candidates held: no room, nothing evicted
    assert sorted(c[1] for c in a.keys()) == [0, 1]
    h0.release()
    h0.release()  # idempotent
    assert not h0.held
    assert b_puts([5]) == [True]  # the released one went, the held one stayed
    assert sorted(c[1] for c in a.keys()) == [1, 5] and a.hold(cid0) is None
    buf = torch.empty(size, dtype=torch.uint8)
    assert a.get_into(cid1, memoryview(buf.numpy()), handle) and torch.equal(buf, _chunk(cart, 1))
    assert a.discard(cart.manifest.content_hash) == 2  # force_redownload: held or not
    assert not a.get_into(cid1, memoryview(buf.numpy()), handle)
    h1.release()


class _RemoteOrigin(LocalOrigin):
    """A real local origin that residency treats as remote (as an S3 one), so the disk tier is used."""

    local = False


def _fill(root: str, cart: str, budget: int, indices: list[int], results) -> None:
    p = PackedCartridge(Path(cart))
    disk = DiskTier(root, budget)
    results.put([disk.put((p.manifest.content_hash, i), memoryview(_chunk(p, i).numpy())) for i in indices])

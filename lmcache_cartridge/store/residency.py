"""Tiered residency for cartridge chunks: CPU memory -> local disk cache -> origin (local or S3).

Where it runs: inside each plugin instance (one per LMCache engine / vLLM worker rank). The hot
path (`read_into(..., network=False)`) is called from LMCache's retrieve on the worker thread,
copies exactly the chunk asked for and never touches the network: a remote chunk that is not in
memory or the disk cache is `NotLocal` (a miss). Remote bytes arrive only through background
downloads (`download_async`, started by a lookup that missed or by the plugin for trained
cartridges), prefetch and preload, on their own thread pools.

Who owns what: each tier owns its bytes and its LRU order; `Residency` owns the in-flight table
(single flight: N concurrent misses on one chunk make one origin read; a local chunk encoded in
place is read by each reader, which only happens across retrieves, and LMCache runs those one at
a time on the worker thread) and the set of chunks this process has verified. A chunk is
identified by `Handle.chunk_id`: the content hash and the origin (`tier_key`) and the rank's heads, so two
cartridges never share bytes, a re-packed cartridge never reuses stale ones, and a cartridge is
served only bytes verified against its own origin. (The content hash alone is derived from chunk
digests, which anyone can copy into a manifest of their own: keyed by it, a forged manifest over
a payload of zeros was served another cartridge's cached bytes.)

Per rank: a handle's `RankView` says which KV heads this process serves. Only those heads' bytes
are read (one contiguous range of a `by_head` chunk) and cached on disk (under
`Handle.chunk_id`, shared by the host's processes that read the same heads); the CPU tier keeps them
already in LMCache's layout for this rank (`RankView.to_engine`, once, when they enter it), so
budgets count what a rank holds and a repeat hit is one plain copy. Where memory objects hold an
engine layout, a local origin's chunk is encoded from its payload bytes in place instead
(`RankView.engine_view`) and not kept here (`read_into`).

Invariant: nothing unverified is served or cached. Origin bytes are checked against the
manifest's chunk digest (`integrity.chunk_digest`: BLAKE3, or sha256 for
cartridges packed before it) before use; disk-cache files are checked on their first read in a process.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.cartridge.manifest import Manifest
from lmcache_cartridge.cartridge.tp import RankView
from lmcache_cartridge.store.disk_cache import ChunkId, DiskHold, DiskTier, belongs_to
from lmcache_cartridge.store import threads
from lmcache_cartridge.store.metrics import Metrics
from lmcache_cartridge.store.origins import Origin
from lmcache_cartridge.cartridge.integrity import check_chunk
from lmcache_cartridge.cartridge.buffers import as_bytes, clone_bytes, copy_into

logger = logging.getLogger("lmcache_cartridge.store.residency")

_SPARE_SCRATCH = 4  # scratch buffers kept between reads (up to two per read): reads at once, not threads


class NotLocal(CartridgeError):
    """The chunk is not readable without the network (hot-path reads never wait on an origin)."""


def tier_key(content_hash: str, origin_uri: str) -> str:
    """The tiers' name for a cartridge's bytes: `<content_hash>.o<origin tag>`. Bytes enter a
    tier verified against the manifest's chunk digests, read from one origin; the digests are
    anyone's to copy into a manifest of their own, the origin is not. So bytes one origin gave
    are served only to handles of that origin (`Handle.key`), and each origin's copies of a
    content hash stay apart (`MemoryTier.discard` and `DiskTier.discard` of the bare content
    hash drop them all)."""
    import hashlib

    return f"{content_hash}.o{hashlib.sha256(origin_uri.encode()).hexdigest()[:16]}"


@dataclass
class Handle:
    """A served cartridge as residency sees it: what to read and where it comes from."""

    manifest: Manifest
    origin: Origin
    servable: int | None = None  # chunks LMCache can look up (keyed); None = all
    retired: bool = False  # set by the plugin when it stops serving it: downloads stop
    view: RankView | None = None  # the heads this process serves; None = all of them
    key: str = field(init=False)  # the tiers' name for its bytes (`tier_key`)

    def __post_init__(self) -> None:
        if self.view is None:
            self.view = RankView.of(self.manifest)
        self.key = tier_key(self.manifest.content_hash, self.origin.uri)

    @property
    def content_hash(self) -> str:
        return self.manifest.content_hash

    @property
    def rank_key(self) -> str:
        """`key` and the rank's heads: what `chunk_id`s of this handle start with."""
        return self.key + self.view.heads_suffix

    def chunk_id(self, index: int) -> ChunkId:
        """Every tier's name for this rank's bytes of chunk `index`: the cartridge's `key` and the
        rank's heads (`RankView.heads_suffix`), so that ranks served by one process (MP mode) never
        take each other's bytes, nor each other's verification."""
        return (self.rank_key, index)


# --- memory tier ------------------------------------------------------------------------------
class MemoryTier:
    """Byte-budgeted LRU of whole chunks in memory on one device (CPU, or CUDA for the GPU tier).

    Device-agnostic on purpose: the same logic is tested on CPU and used on CUDA. Pinned chunks
    (in use by a lookup) are never evicted.
    """

    def __init__(self, name: str, budget_bytes: int, device: str = "cpu", metrics: Metrics | None = None) -> None:
        self.name, self.budget, self.device = name, int(budget_bytes), torch.device(device)
        self.metrics = metrics or Metrics()
        self._lock = threading.Lock()
        self._chunks: OrderedDict[ChunkId, torch.Tensor] = OrderedDict()
        self._pins: dict[ChunkId, int] = {}
        self.used = 0

    def __contains__(self, cid: ChunkId) -> bool:
        with self._lock:
            return cid in self._chunks

    def fits(self, nbytes: int) -> bool:
        """Whether a chunk of `nbytes` could be kept at all (the budget, not what is free now)."""
        return 0 < nbytes <= self.budget

    def keys(self) -> list[ChunkId]:
        with self._lock:
            return list(self._chunks)

    def get_into(self, cid: ChunkId, out: torch.Tensor,
                 copy: Callable[[torch.Tensor, torch.Tensor], None] = copy_into) -> bool:
        """Copy a resident chunk into `out` (flat uint8) with `copy(out, kept)`; True on a hit. A
        hit refreshes LRU.

        The copy runs outside the lock: a stored tensor is never written again (eviction only
        drops the dict's reference; ours keeps the bytes alive), so lookups and other reads never
        wait behind a large copy."""
        with self._lock:
            data = self._chunks.get(cid)
            if data is None:
                return False
            self._chunks.move_to_end(cid)
        copy(out, data)
        return True

    def put(self, cid: ChunkId, data: torch.Tensor, *, adopt: bool = False) -> bool:
        """Keep a copy of `data` (flat uint8) if the budget allows after evicting unpinned LRU.
        The copy is made before taking the lock; the lock only guards the bookkeeping.
        `adopt`: keep `data` itself, no copy (a fresh buffer its caller never writes again)."""
        n = data.numel()
        if n > self.budget:
            return False
        with self._lock:
            if cid in self._chunks:
                self._chunks.move_to_end(cid)
                return True
        if adopt and data.device == self.device and data.is_contiguous() and data.dtype == torch.uint8:
            copy = data
        else:
            copy = torch.empty(n, dtype=torch.uint8, device=self.device)
            copy_into(copy, data)
        with self._lock:
            if cid in self._chunks:  # another thread stored it meanwhile: keep theirs
                self._chunks.move_to_end(cid)
                return True
            if not self._make_room(n):
                return False
            self._chunks[cid] = copy
            self.used += n
        return True

    def _make_room(self, n: int) -> bool:
        evicted = 0
        for victim in list(self._chunks):
            if self.used + n <= self.budget:
                break
            if self._pins.get(victim):
                continue
            self.used -= self._chunks.pop(victim).numel()
            evicted += 1
        if evicted:
            self.metrics.eviction(self.name, evicted)
        return self.used + n <= self.budget

    def pin(self, cid: ChunkId) -> None:
        self.pin_many((cid,))

    def pin_many(self, cids) -> None:
        with self._lock:
            for cid in cids:
                self._pins[cid] = self._pins.get(cid, 0) + 1

    def unpin(self, cid: ChunkId) -> None:
        self.unpin_many((cid,))

    def unpin_many(self, cids) -> None:
        with self._lock:
            for cid in cids:
                n = self._pins.get(cid, 0) - 1
                if n > 0:
                    self._pins[cid] = n
                else:
                    self._pins.pop(cid, None)

    def discard(self, key: str) -> int:
        """Drop every chunk of one cartridge (removal, force_redownload); pinned ones included.
        `key`: a `tier_key` (one origin's copies), or a bare content hash (every origin's)."""
        with self._lock:
            victims = [c for c in self._chunks if belongs_to(c[0], key)]
            for c in victims:
                self.used -= self._chunks.pop(c).numel()
        return len(victims)


# --- the manager ------------------------------------------------------------------------------
class _Flight:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.data: torch.Tensor | None = None
        self.error: Exception | None = None
        self.waiters = 0


class Residency:
    """Serves chunk bytes from the closest tier, filling the tiers on the way up.

    Two kinds of callers: the hot path (LMCache's retrieve, `network=False` from the plugin)
    reads only what is local (memory, disk cache, a local origin) and raises `NotLocal` otherwise;
    background downloads (`download_async`, prefetch) fetch from remote origins into the tiers.
    """

    def __init__(self, cpu: MemoryTier, disk: DiskTier | None, metrics: Metrics,
                 prefetch_workers: int = 2, prefetch: bool = True,
                 write_behind_bytes: int = 256 << 20, download_workers: int = 4) -> None:
        self.cpu, self.disk, self.metrics, self.prefetch = cpu, disk, metrics, prefetch
        self._lock = threading.Lock()
        self._flights: dict[ChunkId, _Flight] = {}
        # Origin chunks verified in this process, by `Handle.chunk_id`: a rank's heads. One process
        # serves every rank in MP mode, and a span's check covers only its own heads' bytes.
        self._verified: set[ChunkId] = set()
        self._prefetched: set[str] = set()
        self._downloading: set[str] = set()  # `Handle.rank_key`s with a download under way
        self._spare: list[torch.Tensor] = []  # scratch buffers (`_into_engine`, local reads in `read_into`)
        self._pool = threads.pool(prefetch_workers, "cartridge-prefetch")
        # Downloads may hang on a stalled origin for minutes: their own threads, so prefetch and
        # disk writes of other cartridges never queue behind them.
        self._downloads = threads.pool(download_workers, "cartridge-download")
        self.write_behind_limit = int(write_behind_bytes)  # bytes of chunk clones queued for disk
        self._write_behind_pending = 0
        self.write_behind_skipped = 0
        self.origin_reads = 0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._downloads.shutdown(wait=False, cancel_futures=True)

    # -- where a chunk is -------------------------------------------------------------------------
    def is_local(self, handle: Handle, index: int) -> bool:
        """Whether chunk `index` can be read without the network (what a lookup may promise)."""
        if handle.origin.local:
            return True
        cid = handle.chunk_id(index)
        return cid in self.cpu or (self.disk is not None and cid in self.disk)

    def hold_local(self, handle: Handle, index: int) -> tuple[bool, DiskHold | None]:
        """`is_local` for a lookup that promises the chunk (the plugin's pin=True, the MP
        adapter's lookup-and-lock): (local, hold). A caller with a CPU tier has pinned the chunk
        there first, so a CPU-tier copy needs nothing more. Where only the disk tier has the
        chunk, `hold` keeps its file from eviction until the caller releases it when the promise
        ends. A disk copy that cannot be held is not local: promised unheld, any download could
        evict it before the retrieve, which then returns fewer tokens than the lookup said (a
        trained request fails). Runs on the lookup's thread."""
        if handle.origin.local or handle.chunk_id(index) in self.cpu:
            return True, None
        if self.disk is None:
            return False, None
        hold = self.disk.hold(handle.chunk_id(index))
        return hold is not None, hold

    def touch(self, handle: Handle, index: int) -> None:
        """Chunk `index` is in use without being read here: keep it warm in the disk tier's LRU
        (a local origin's chunks are never evicted; the CPU tier is not consulted: nothing in MP
        mode has one)."""
        if self.disk is not None and not handle.origin.local:
            self.disk.touch(handle.chunk_id(index))

    def local_prefix(self, handle: Handle, indices) -> int:
        """How many of `indices` (in order) are local before the first that is not."""
        n = 0
        for i in indices:
            if not self.is_local(handle, i):
                break
            n += 1
        return n

    def resident(self, handle: Handle) -> bool:
        """Every servable chunk is local: a lookup of the whole cartridge hits."""
        n = len(handle.manifest.chunks) if handle.servable is None else handle.servable
        return self.local_prefix(handle, range(n)) == n

    def downloading(self, handle: Handle) -> bool:
        with self._lock:
            return handle.rank_key in self._downloading

    def download_async(self, handle: Handle, on_done=None):
        """Bring every servable chunk of a remote cartridge to a local tier in the background
        (disk cache, else memory). One download per cartridge at a time; returns its future, or
        None when one is already under way or nothing needs fetching. `on_done(handle)` runs when
        it ends, success or not (a later call retries what is still missing)."""
        if handle.origin.local or handle.retired:
            return None
        with self._lock:
            if handle.rank_key in self._downloading:
                return None
            self._downloading.add(handle.rank_key)

        def finished(_fut) -> None:
            with self._lock:
                self._downloading.discard(handle.rank_key)
            if on_done is not None:
                try:
                    on_done(handle)
                except Exception as e:  # a callback must not break the pool
                    logger.warning("lmcache_cartridge: download callback failed: %s", e)

        try:
            fut = self._downloads.submit(self._download, handle)
        except RuntimeError:  # shut down
            with self._lock:
                self._downloading.discard(handle.rank_key)
            return None
        fut.add_done_callback(finished)
        return fut

    def _download(self, handle: Handle) -> int:
        fetched = 0
        for info in handle.manifest.chunks[: handle.servable]:
            if handle.retired:
                break
            if self.is_local(handle, info.index):
                continue
            scratch = torch.empty(handle.view.engine_nbytes(info.index), dtype=torch.uint8)
            t0 = time.perf_counter()
            try:
                tier = self._fetch(handle, info.index, scratch, background=True, adopt=True)
                # the bytes the origin gave
                self.metrics.hit(tier, handle.view.span(info.index).nbytes, time.perf_counter() - t0)
                fetched += 1
            except Exception as e:  # the next lookup (or the plugin's watcher) asks again
                logger.warning("lmcache_cartridge: download of chunk %d of %r failed: %s",
                               info.index, handle.manifest.cartridge_id, e)
                break
        return fetched

    # -- hot path ---------------------------------------------------------------------------------
    def read_into(self, handle: Handle, index: int, out: torch.Tensor, *, network: bool = True,
                  encode: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> str:
        """Fill `out` (contiguous: this rank's chunk in LMCache's `KV_2LTD`, `handle.view.engine_shape`)
        with verified bytes; return the tier.

        With `network=False` (LMCache's retrieve) only local tiers are read: a remote chunk that
        is not cached raises `NotLocal` at once instead of waiting on the origin.
        `encode(dst, src)`, when given, writes `out` from the chunk's `KV_2LTD` values instead of
        a copy: the memory object holds an engine layout (`lmcache.memory_layout`). A CPU-tier hit
        is encoded straight from the kept `KV_2LTD` bytes. A chunk of a local origin is read (and
        checked, once per process) into a reused buffer and encoded from its payload bytes where
        they lie (`RankView.engine_view`), one pass, and the CPU tier keeps nothing: the page cache
        holds the file and LMCache keeps the encoded object, so a `KV_2LTD` copy would cost a
        second pass over the chunk, fresh memory and its page faults on every first hit, for a
        re-read that `pread` serves at memory speed (`benchmarks/hit_path.py`). Other chunks
        are converted into a buffer the CPU tier then keeps (or scratch) and encoded from it.
        Raises `CartridgeError`/`OSError` when no tier can supply good bytes: the caller makes it
        a miss and the request recomputes.
        """
        flat = out.reshape(-1).view(torch.uint8)
        cid = handle.chunk_id(index)
        t0 = time.perf_counter()
        if self.cpu.get_into(cid, flat if encode is None else out, copy=encode or copy_into):
            self.metrics.hit("cpu", flat.numel(), time.perf_counter() - t0)
            return "cpu"
        self.metrics.miss("cpu")
        if encode is None:
            tier = self._read_below(handle, index, flat, network)
        elif handle.origin.local:
            with self._spare_buffer(handle.view.span(index).nbytes) as raw:
                tier = self._read_raw(handle, index, raw)
                encode(out, handle.view.engine_view(index, raw))
        else:
            # Where the CPU tier can keep the chunk, a fresh buffer it keeps as it is: converted
            # into once, kept without a copy, encoded from (a copy into the tier would be a fourth
            # pass over the chunk); else a reused scratch buffer.
            adopt = self.cpu.fits(flat.numel())
            with contextlib.nullcontext(torch.empty(flat.numel(), dtype=torch.uint8)) if adopt \
                    else self._spare_buffer(flat.numel()) as kv_2ltd:
                tier = self._read_below(handle, index, kv_2ltd, network, adopt=adopt)
                encode(out, kv_2ltd)
        self.metrics.hit(tier, flat.numel(), time.perf_counter() - t0)
        return tier

    def _read_below(self, handle: Handle, index: int, flat: torch.Tensor, network: bool, *, adopt: bool = False) -> str:
        """`adopt`: `flat` is a fresh buffer nobody writes after this read: the CPU tier may keep it
        instead of a copy (`MemoryTier.put`)."""
        if network:
            return self._fetch(handle, index, flat, adopt=adopt)
        return self._read_local(handle, index, flat, adopt=adopt)

    @contextlib.contextmanager
    def _spare_buffer(self, n: int) -> Iterator[torch.Tensor]:
        """A flat uint8 scratch buffer of `n` bytes. Buffers are reused (a fresh chunk-sized
        buffer costs its page faults on every read, as much as a conversion itself); at most
        `_SPARE_SCRATCH` are kept between reads."""
        with self._lock:  # by position: `list.remove` would compare tensors with ==
            i = next((i for i, b in enumerate(self._spare) if b.numel() >= n), None)
            spare = None if i is None else self._spare.pop(i)
        scratch = spare if spare is not None else torch.empty(n, dtype=torch.uint8)
        try:
            yield scratch[:n]
        finally:
            with self._lock:
                if len(self._spare) < _SPARE_SCRATCH:
                    self._spare.append(scratch)

    def _read_local(self, handle: Handle, index: int, flat: torch.Tensor, *, adopt: bool = False) -> str:
        if handle.origin.local:  # single flight among local readers only: no network involved
            return self._fetch(handle, index, flat, adopt=adopt)
        if self.disk is not None and self._into_engine(
                handle, index, flat, lambda raw: self.disk.get_into(handle.chunk_id(index), as_bytes(raw), handle),
                adopt=adopt):
            return "disk"
        if self.disk is not None:
            self.metrics.miss("disk")
        raise NotLocal(f"chunk {index} of {handle.manifest.cartridge_id!r} is not local yet")

    def _fetch(self, handle: Handle, index: int, flat: torch.Tensor, *, background: bool = False,
               adopt: bool = False) -> str:
        """Single flight: the first caller reads; concurrent callers wait and copy its bytes."""
        cid = handle.chunk_id(index)
        with self._lock:
            flight = self._flights.get(cid)
            leader = flight is None
            if leader:
                flight = self._flights[cid] = _Flight()
            else:
                flight.waiters += 1
        if not leader:
            if not flight.done.wait(timeout=120):
                raise CartridgeError(f"timed out waiting for chunk {index} of {handle.manifest.cartridge_id}")
            if flight.error is not None:
                raise flight.error
            copy_into(flat, flight.data)
            return "shared"
        try:
            if self.cpu.get_into(cid, flat):  # filled while we were deciding to lead
                tier = "cpu"
            else:
                tier = self._read_below_cpu(handle, index, flat, background=background, adopt=adopt)
        except BaseException as e:
            with self._lock:
                flight.error = e if isinstance(e, Exception) else CartridgeError(f"read interrupted: {e!r}")
                self._flights.pop(cid, None)
            flight.done.set()
            raise
        # Our buffer belongs to our caller: waiters get a copy. Publishing and leaving the flight
        # table happen under one lock, so a waiter that joins at the last moment still gets data.
        data = clone_bytes(flat) if flight.waiters else None
        with self._lock:
            if flight.waiters and data is None:
                data = clone_bytes(flat)
            flight.data = data
            self._flights.pop(cid, None)
        flight.done.set()
        return tier

    def _into_engine(self, handle: Handle, index: int, flat: torch.Tensor,
                     read: Callable[[torch.Tensor], Any], *, adopt: bool = False) -> Any:
        """`read(raw)` fills `raw` with this rank's verified payload bytes of chunk `index`
        (`view.span`) and returns a tier name, or something false for a miss; on a hit the bytes
        end up in `flat`, the rank's `KV_2LTD` chunk, and a copy in the CPU tier (`flat` itself
        with `adopt`).

        Bytes already in `KV_2LTD` (`view.identity`) are read straight into `flat`; others land
        in a scratch buffer and are converted into `flat` in one pass."""
        view = handle.view
        if view.identity:
            got = read(flat)
        else:
            with self._spare_buffer(view.span(index).nbytes) as raw:
                got = read(raw)
                if got:
                    view.to_engine(index, raw, flat)
        if got:
            self.cpu.put(handle.chunk_id(index), flat, adopt=adopt)
        return got

    def _read_below_cpu(self, handle: Handle, index: int, flat: torch.Tensor, *, background: bool = False,
                        adopt: bool = False) -> str:
        return self._into_engine(handle, index, flat,
                                 lambda raw: self._read_raw(handle, index, raw, background=background), adopt=adopt)

    def _read_raw(self, handle: Handle, index: int, raw: torch.Tensor, *, background: bool = False) -> str:
        """This rank's verified payload bytes of chunk `index` (`view.span`) from the disk cache or
        the origin into `raw`; remote bytes are also written to the disk cache."""
        cid = handle.chunk_id(index)
        buf = as_bytes(raw)
        if self.disk is not None and not handle.origin.local:
            if self.disk.get_into(cid, buf, handle):
                return "disk"  # counted by read_into, with the whole read's latency
            self.metrics.miss("disk")
        tier = "local" if handle.origin.local else "s3"
        info, dtype = handle.view.span(index), handle.manifest.torch_dtype
        try:
            handle.origin.read_into(info, buf)
            with self._lock:
                self.origin_reads += 1
                # a local origin's chunk is verified once per process; remote bytes every time
                verify = not handle.origin.local or cid not in self._verified
            if verify:
                check_chunk(info, buf, handle.origin.uri, dtype)
                if handle.origin.local:
                    with self._lock:
                        self._verified.add(cid)
        except Exception:
            self.metrics.error(tier)
            raise
        if self.disk is not None and not handle.origin.local and buf.nbytes <= self.disk.budget:
            if background:  # a download: write it here, the chunk is then local for good
                self.disk.put(cid, buf)
            else:
                self._write_behind(cid, raw)
        return tier

    def _write_behind(self, cid: ChunkId, flat: torch.Tensor) -> None:
        """Queue a copy for the disk cache without making the caller wait. Bounded: the queue
        holds whole-chunk clones, so past `write_behind_limit` bytes a chunk is not written
        (it stays in memory; a later download writes it)."""
        n = flat.numel()
        with self._lock:
            if self._write_behind_pending + n > self.write_behind_limit:
                self.write_behind_skipped += 1
                return
            self._write_behind_pending += n
        data = clone_bytes(flat)

        def write() -> None:
            try:
                self.disk.put(cid, as_bytes(data))
            finally:
                with self._lock:
                    self._write_behind_pending -= n

        try:
            self._pool.submit(write)
        except RuntimeError:  # shut down
            with self._lock:
                self._write_behind_pending -= n

    @property
    def write_behind_pending(self) -> int:
        with self._lock:
            return self._write_behind_pending

    # -- background -------------------------------------------------------------------------------
    def prefetch_rest(self, handle: Handle, *, preload: bool = False) -> None:
        """Warm a cartridge in the background: once per cartridge with `prefetch` on, or always
        for a preloaded one (`preload=True`, whatever `prefetch` says). The plugin calls it when
        a retrieve that read the cartridge is done, not at its first chunk: started there, the
        prefetch read the retrieve's own chunks beside it, on the same core where the worker is
        bound to one, joining its reads (a copy each), and took that core from the retrieve
        (`benchmarks/hit_path.py`)."""
        with self._lock:
            if not preload and (not self.prefetch or handle.rank_key in self._prefetched):
                return
            self._prefetched.add(handle.rank_key)
        self._pool.submit(self.warm, handle, preload=preload)

    def warm(self, handle: Handle, *, preload: bool = False) -> int:
        """Bring every chunk of a cartridge as close as the budgets allow (prefetch, preload).
        A prefetch skips the chunks of a local origin this process has verified (a retrieve read
        them; where memory objects hold an engine layout it encodes them from the file, so keeping
        a `KV_2LTD` copy would only cost memory); it still keeps the chunks no retrieve has read,
        checked, in the CPU tier. A preload keeps every chunk in memory."""
        warmed = 0
        for info in handle.manifest.chunks[: handle.servable]:
            cid, nbytes = handle.chunk_id(info.index), handle.view.engine_nbytes(info.index)
            if cid in self.cpu or (self.disk is not None and not handle.origin.local
                                   and cid in self.disk
                                   and self.cpu.used + nbytes > self.cpu.budget):
                continue
            if not preload and handle.origin.local:
                with self._lock:
                    if cid in self._verified:
                        continue
            scratch = torch.empty(nbytes, dtype=torch.uint8)
            try:
                self._fetch(handle, info.index, scratch, background=True, adopt=True)
                warmed += 1
            except Exception as e:  # prefetch failures only cost a later miss
                logger.warning("lmcache_cartridge: prefetch of chunk %d of %r failed: %s",
                               info.index, handle.manifest.cartridge_id, e)
                break
        return warmed

    def forget(self, key: str, *, disk: bool = False) -> None:
        """Drop a cartridge from memory (removal), and from disk too (force_redownload). `key`: a
        handle's `key` (its origin's copies), or a bare content hash (every origin's)."""
        self.cpu.discard(key)
        if disk and self.disk is not None:
            self.disk.discard(key)
        with self._lock:
            self._prefetched = {k for k in self._prefetched if not belongs_to(k, key)}
            self._verified = {c for c in self._verified if not belongs_to(c[0], key)}

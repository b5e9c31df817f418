"""The read-only LMCache storage plugin that serves cartridge chunks.

Where it runs: LMCache builds it inside every engine (each vLLM worker rank; also vLLM's
scheduler process when `enable_scheduler_bypass_lookup` is on, then with `local_cpu_backend=None`).
Who calls it: LMCache's `StorageManager`, from the worker thread (lookup with `pin=True`,
`batched_get_blocking` on retrieve, `unpin` after), from the lookup-server thread, and from the
storage manager's event loop (the async pair, whose work runs on the plugin's own executor).
All state below is guarded by one lock.

What it owns: an index `CacheEngineKey -> (cartridge, chunk)` computed in this process with
LMCache's own token database (see `keys`); which cartridges it serves, the refresh against the
registry, replacement, quarantine and retirement follow the serving set both modes share
(`lmcache.serving_set`: this class supplies how a cartridge is opened, keyed and purged); lookup
pins (with a lease); tombstones of retired keys (re-purged from LMCache's CPU cache
until no in-flight read can write them back). It never owns a cartridge's files: `remove`
forgets keys, it never deletes anything.

Hot path rule: a lookup hits only on chunks readable without the network (memory, disk cache,
local origin); a remote chunk not yet local is a miss and starts a background download. A pinned
lookup's hit is kept readable until its unpin (or the lease): the pin holds every tier the hit
relies on, the CPU-tier copy or, for a chunk only the disk cache has, its file. Trained
cartridges are downloaded as soon as they are registered, and the published state says which
cartridges are resident (the gateway holds a trained cartridge's requests until they are).
Lock order: the plugin lock is never held while a tier lock or LMCache's lock is taken.

Registered YAML (see configs/lmcache-cartridge.yaml):
    storage_plugins: ["cartridge"]
    extra_config:
      storage_plugin.cartridge.module_path: lmcache_cartridge.plugin
      storage_plugin.cartridge.class_name: CartridgeStoragePlugin
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from lmcache_cartridge.cartridge.compat import EngineShape, mismatch
from lmcache_cartridge.cartridge.tp import RankView
from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.cartridge.keys import ChunkKeyMapper, hash_config_problem
from lmcache_cartridge.paths import private_dir
from lmcache_cartridge.store.metrics import Metrics
from lmcache_cartridge.store.origins import is_s3, load_registered, open_origin
from lmcache_cartridge.store.registry import Entry
from lmcache_cartridge.store.serving_state import (ALL, CartridgeState, ServingState, process_start, prune, publish,
                                                   unpublish)
from lmcache_cartridge.store.residency import DiskHold, DiskTier, Handle, MemoryTier, NotLocal, Residency
from lmcache_cartridge.store import threads
from lmcache_cartridge.lmcache import memory_layout
from lmcache_cartridge.lmcache.catalog_sync import start_catalog_sync
from lmcache_cartridge.lmcache.leases import LeaseTable
from lmcache_cartridge.lmcache.serving_set import ServingSet, SetState
from lmcache_cartridge.lmcache.settings import PluginSettings, unknown_keys

logger = logging.getLogger("lmcache_cartridge.plugin")


@dataclass(eq=False)
class Served:
    """One cartridge this process serves: its open payload (with the heads this rank reads,
    `handle.view`) and its keys."""

    entry: Entry
    handle: Handle
    keys: list[Any]
    pins: int = 0     # lookup pins held on its chunks (plugin lock): closing waits for 0
    reads: int = 0    # retrieves reading it right now (plugin lock)

    # what the serving set reads of a served cartridge (`lmcache.serving_set`)
    @property
    def manifest(self):
        return self.handle.manifest

    @property
    def origin(self):
        return self.handle.origin

    @property
    def key(self) -> str:
        return self.handle.key


@dataclass(eq=False)
class _Pin:
    """What one lookup pin holds, leased until LMCache's unpin (`lmcache.leases`)."""

    served: Served
    index: int
    # The chunk's disk-cache file, held from eviction, where the lookup found the chunk only
    # there: without it another download could evict the file before the retrieve.
    hold: DiskHold | None = None


@dataclass(eq=False)
class _Tombstone:
    """Keys of a cartridge no longer served. LMCache writes a plugin's hits back into its
    LocalCPUBackend right after `batched_get_blocking` returns, so a read that was in flight (or
    a pinned, draining chunk) at removal can put the old bytes back after the purge. The keys
    are purged again on every refresh tick until the cartridge has no reads and no pins, and once
    more a tick after that."""

    served: Served
    idle_seen: bool = False


@dataclass
class _State(SetState):
    """The serving set's state (`served`, `index`: key -> (Served, chunk), `skipped`,
    `quarantined`) and the plugin's own: pins, draining chunks, tombstones."""

    draining: dict[Any, tuple[Served, int]] = field(default_factory=dict)  # retired but pinned
    # key -> what each pin was taken on, oldest first: after a re-registration under the same
    # keys, an unpin must release the chunk its lookup pinned, not whatever the key maps to now;
    # a pin LMCache never releases expires after `pin_lease_seconds` (`lmcache.leases`).
    pins: LeaseTable[_Pin] = field(default_factory=LeaseTable)
    tombstones: list[_Tombstone] = field(default_factory=list)


class CartridgeStoragePlugin(ServingSet, StoragePluginInterface):
    """Read-only `StoragePluginInterface` mapping LMCache chunk keys to cartridge chunks."""

    def __init__(self, dst_device: str = "cpu", config=None, metadata=None,
                 local_cpu_backend=None, loop=None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        # LMCache swallows constructor errors in one line: log our own cause first, then re-raise.
        try:
            self.settings = PluginSettings.from_config(config, type(self))
            problems = unknown_keys(config, self.settings.name)
            if problems:  # a typo would otherwise be ignored in silence; the MP adapter refuses it too
                raise CartridgeError("; ".join(problems))
            self.shape = EngineShape.from_lmcache(config, metadata, self.settings.accept_models)
            self.registry = None
            # A plain Lock, as the MP adapter's: nothing taken under it takes it again (the hooks
            # the serving set calls under it are `_claims` and `*_locked`), and a re-entry is a
            # deadlock the tests show at once rather than a lock order an RLock would hide.
            self._init_serving(_State(), threading.Lock())
            self._closed = threading.Event()
            self._publish_lock = threading.Lock()  # a record is written or withdrawn at a time
            self.healthy = True
            self.problem: str | None = None
            if getattr(config, "use_layerwise", False):
                raise CartridgeError("layerwise mode (use_layerwise: true) is not supported")
            problem = hash_config_problem(config.pre_caching_hash_algorithm)
            if problem and not self.settings.allow_unstable_hash:
                # Keys would differ between scheduler and workers: serve nothing, say why.
                self.healthy, self.problem = False, problem
                logger.error("lmcache_cartridge: serving no cartridges: %s", problem)
            self.mapper = ChunkKeyMapper(config, metadata)
            self.metrics = Metrics()
            st = self.settings
            try:
                private_dir(st.cache_dir)
            except PermissionError as e:
                raise CartridgeError(f"storage_plugin.{st.name}.cache_dir: {e}") from None
            self.residency = Residency(
                MemoryTier("cpu", st.cpu_budget_bytes, metrics=self.metrics),
                DiskTier(st.cache_dir / "chunks", st.disk_budget_bytes, metrics=self.metrics),
                self.metrics, prefetch=st.prefetch)
            # One thread per reader core, up to four (`store.threads`; made at the first
            # multi-chunk read, when vLLM has bound the worker: `_reader_pool`).
            self._readers = None
            # LMCache runs the async pair on its storage event loop: the work goes here instead,
            # so one request's reads never freeze the loop other requests' lookups run on.
            self._async_pool = threads.pool(2, "cartridge-async")
            # Where reads run and whether on several threads (`threads.reader_cores`, `parallel`),
            # asked at the first multi-chunk read (vLLM binds its OpenMP threads before serving)
            # and kept: asking reads every thread's mask from /proc, ~0.1 ms each time.
            self._readers_on: list[int] | None = None
            self._parallel: bool | None = None
            try:
                self.refresh()
            except CartridgeError as e:  # locked/corrupt registry: serve nothing, keep retrying
                logger.error("lmcache_cartridge: registry unusable, serving no cartridges until it is: %s", e)
            self._watcher = threading.Thread(target=self._watch, name="cartridge-registry-watch",
                                             daemon=True)
            self._watcher.start()
            self.warn_unmatched_preloads()
            # A fleet's catalog in S3 (storage_plugin.<name>.catalog_uri), synced into the same
            # registry this plugin watches: published cartridges arrive by the ordinary refresh.
            self._catalog_sync = start_catalog_sync(self.settings, self.shape.chunk_size)
            logger.info("lmcache_cartridge: %s", self.summary())
        except Exception as e:
            logger.error("lmcache_cartridge plugin failed to start: %s: %s", type(e).__name__, e)
            raise

    # --- registry -> index (`ServingSet.refresh`: at start and on the watcher thread) ----------
    def summary(self) -> str:
        with self._lock:
            st = self._state
            chunks = sum(len(s.keys) for s in st.served.values())
            return (
                f"plugin '{self.settings.name}' {'ready' if self.healthy else 'DISABLED'}: "
                f"{len(st.served)} cartridges ({chunks} chunks) for model {self.shape.model_names[0]!r} "
                f"rank {self.shape.rank}/{self.shape.world_size}, "
                f"{st.pins.keys_held()} chunks pinned, "
                f"{len(st.skipped)} not served"
                f"{' (' + '; '.join(f'{k}: {v}' for k, v in sorted(st.skipped.items())) + ')' if st.skipped else ''}; "
                f"registry {self.settings.registry}, hash {self.config.pre_caching_hash_algorithm}, "
                f"chunk_size {self.shape.chunk_size}, refresh {self.settings.refresh_seconds}s"
                f"{'; problem: ' + self.problem if self.problem else ''}"
            )

    # --- the serving set's hooks (`lmcache.serving_set`: refresh, quarantine) --------------------
    _log = logger

    def _can_open(self) -> bool:
        return self.healthy  # keys would differ between scheduler and workers: serve nothing

    def _claims(self, s: Served) -> list[tuple[Any, int]]:
        return [(k, i) for i, k in enumerate(s.keys)]

    def _started(self, fresh: list[Served]) -> None:
        """Cartridges just swapped in: KV that LMCache stored under their keys before we served
        them was recomputed from the cartridge's token ids (for a trained cartridge: from
        placeholders) and must never be served in place of the cartridge's own KV; trained ones
        are fetched now (the gateway waits for them to be resident); `preload` ones are read and
        verified before their first request needs them."""
        self._drop_from_cpu_cache(k for s in fresh for k in s.keys)
        for s in fresh:
            if s.entry.kind == "trained":
                self._want_download(s)
            if self.preloaded(s):
                self.residency.prefetch_rest(s.handle, preload=True)

    def _publish(self) -> None:
        self.publish()

    def _open(self, entry: Entry) -> Served:
        m = load_registered(entry)
        why = mismatch(m, self.shape)
        if why:
            raise CartridgeError(why)
        s3 = self._s3_settings() if is_s3(entry.source_uri) else None
        origin = open_origin(entry.source_uri, entry.path, s3)
        keys = self.mapper.cartridge_keys(m, entry.salt)
        view = RankView.of(m, self.shape.world_size, self.shape.rank)
        return Served(entry, Handle(m, origin, servable=len(keys), view=view), keys)

    def _s3_settings(self):
        from lmcache_cartridge.store.s3 import S3Settings

        return S3Settings.from_mapping(self.settings.s3)

    def _retire_locked(self, s: Served) -> None:
        """Stop serving `s` (plugin lock held; bookkeeping only): pinned chunks drain, and its
        keys stay tombstoned until no read or pin can write its bytes back into LMCache."""
        st = self._state
        s.handle.retired = True
        if s.pins:
            for key, p in st.pins.items():
                if p.served is s:
                    st.draining[key] = (s, p.index)
        st.tombstones.append(_Tombstone(s))

    def _after_retire(self, retired: list[Served]) -> None:
        """Outside the plugin lock, once the serving set forgot their local copies: purge their
        keys from LMCache's CPU cache (tombstones purge them again until no read can write them
        back) and close each origin nothing reads or pins any more."""
        for s in retired:
            self._drop_from_cpu_cache(s.keys)
            self._close_if_unused(s)
            logger.info("lmcache_cartridge: stopped serving %r", s.entry.id)

    def _close_if_unused(self, s: Served) -> None:
        with self._lock:
            unused = s.handle.retired and not s.pins and not s.reads
        if unused:
            s.handle.origin.close()  # closing twice is harmless

    def _drop_from_cpu_cache(self, keys) -> None:
        """Drop keys from LMCache's own CPU cache (never under the plugin lock: LMCache's lock)."""
        if self.local_cpu_backend is None:
            return
        for key in keys:
            self.local_cpu_backend.remove(key, force=True)

    def _want_download(self, s: Served) -> None:
        """Start fetching a remote cartridge to this host's tiers (no-op if local or under way);
        publish the new state when it ends so the gateway sees it resident promptly."""
        self.residency.download_async(s.handle, on_done=lambda _h: self.publish())

    def _watch_steps(self):
        return [("registry refresh (serving the current index)", self.refresh), ("housekeeping", self.tick),
                ("publishing the serving state", self.publish)]

    def _resident_handles(self, served: Served) -> list[Handle]:
        return [served.handle]

    def tick(self) -> None:
        """Once per refresh period: re-purge tombstoned keys, expire pins past their lease, keep
        trained cartridges resident (re-download what eviction or a failure lost)."""
        lease = self.settings.pin_lease_seconds
        purge: list[Any] = []
        with self._lock:
            st = self._state
            for t in list(st.tombstones):
                purge.extend(t.served.keys)
                if t.served.pins or t.served.reads:
                    t.idle_seen = False
                elif t.idle_seen:
                    st.tombstones.remove(t)
                else:
                    t.idle_seen = True
            expired = [self._release_locked(key, p) for key, p in st.pins.expire(lease)]
        if expired:
            logger.warning("lmcache_cartridge: %d lookup pins expired after %.0fs without an unpin",
                           len(expired), lease)
            self._release_tiers(expired)
            for s in {id(p.served): p.served for p in expired}.values():
                self._close_if_unused(s)
        self._drop_from_cpu_cache(purge)
        self._keep_trained_resident()

    def serving_state(self) -> ServingState:
        """This instance's serving-state record as of now (`ServingSet._serving_record`). Any thread."""
        return self._serving_record(self._state_identity(), lambda _served: dict(
            role="scheduler" if self.local_cpu_backend is None else "worker",
            model=self.shape.model_names[0], models=tuple(self.shape.model_names),
            rank=self.shape.rank, world_size=self.shape.world_size, healthy=self.healthy, problem=self.problem))

    def _cartridge_state(self, s: Served) -> CartridgeState:
        """Residency per chunk (a lookup promises only local chunks), "all" when every servable
        chunk is local; and which chunks the CPU tier holds."""
        n = len(s.keys)
        local = range(n) if s.handle.origin.local else \
            tuple(i for i in range(n) if self.residency.is_local(s.handle, i))
        mem = tuple(i for i in range(n) if s.handle.chunk_id(i) in self.residency.cpu)
        return CartridgeState(s.entry.content_hash, s.entry.epoch, s.entry.kind, n,
                              ALL if len(local) == n else local, mem)

    def _state_identity(self) -> dict:
        """Instance id, host, pid and start time: fixed at the first publication (made here, not
        in the constructor, so that publishing stays in these methods). The first one also prunes
        the records of this host's dead processes."""
        with self._lock:
            ident = getattr(self, "_identity", None)
            first = ident is None
            if first:
                pid = os.getpid()
                ident = self._identity = {
                    "instance": f"{self.settings.name}-rank{self.shape.rank}-pid{pid}-{uuid.uuid4().hex[:8]}",
                    "host": socket.gethostname(), "pid": pid, "pid_start": process_start(pid),
                    "started": time.time()}
        if first:
            prune(self.settings.cache_dir)
        return ident

    def publish(self) -> None:
        """Publish this instance's serving-state record (`store.serving_state.publish`: atomic):
        what it serves and what is resident (the gateway forwards a request only once every live
        instance of its model serves its cartridges, and for a trained one has it resident: see
        `serving.wait_served`), and its tier counters (for `lmcache-cartridge stats`). Called on
        every registry change, refresh tick and finished download. Nothing once closed: a
        download ending after `close` must not bring back the record `close` withdrew."""
        with self._publish_lock:
            if self._closed.is_set():
                return
            try:
                publish(self.settings.cache_dir, self.serving_state())
            except OSError as e:
                logger.debug("lmcache_cartridge: cannot publish serving state: %s", e)

    def _withdraw_record(self) -> None:
        """Delete this instance's record (`close`): a closed plugin in a process that lives on
        serves nothing, and the gateway counts a silent record of a live process as an instance
        that is busy, not gone (`serving.wait_served`)."""
        with self._publish_lock:
            ident = getattr(self, "_identity", None)
            if ident is not None:
                unpublish(self.settings.cache_dir, ident["instance"])

    # --- lookup ---------------------------------------------------------------------------------
    def contains(self, key, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys, pin: bool = False) -> int:
        """Leading hits: chunks this process serves AND can read without the network.

        Where it runs: LMCache's lookup (the worker's lookup-server thread with pin=True, the
        storage manager's executor for the async pair without).

        A chunk of a remote cartridge that is not in memory or the disk cache is a miss, and its
        download starts in the background. Pins (worker side only: the scheduler-side instance,
        `local_cpu_backend=None`, never retrieves, so nothing would ever release them) keep what
        the hit relies on until LMCache's unpin, or the lease: the CPU-tier copy, or where only
        the disk cache has the chunk, its file (`Residency.hold_local`); a disk copy that cannot
        be held is a miss, not a promise. The plugin lock is never held while a tier lock is
        taken."""
        taken: list[tuple[Served, int]] = []
        with self._lock:
            index = self._state.index
            for key in keys:
                where = index.get(key)
                if where is None:
                    break
                taken.append(where)
        if not taken:
            return 0
        pin = pin and self.local_cpu_backend is not None
        cids = [sv.handle.chunk_id(i) for sv, i in taken]
        if pin:  # before the locality check, so a chunk found in memory cannot be evicted after it
            self.residency.cpu.pin_many(cids)
        holds: list[DiskHold | None] = []
        for sv, i in taken:
            local, hold = self.residency.hold_local(sv.handle, i) if pin \
                else (self.residency.is_local(sv.handle, i), None)
            if not local:
                self._want_download(sv)
                break
            holds.append(hold)
        hits = len(holds)
        if pin:
            if hits < len(taken):
                self.residency.cpu.unpin_many(cids[hits:])
            if hits:
                with self._lock:
                    st = self._state
                    for key, (sv, i), hold in zip(keys, taken[:hits], holds):
                        st.pins.take(key, _Pin(sv, i, hold))
                        sv.pins += 1
                        if sv.handle.retired and key not in st.draining:  # retired since we looked
                            st.draining[key] = (sv, i)
        return hits

    # LMCache's StorageBackendInterface fixes the signatures below: arguments a read-only origin
    # has no use for stay unused (noqa: ARG002).
    async def batched_async_contains(self, lookup_id: str, keys, pin: bool = False) -> int:  # noqa: ARG002
        # LMCache 0.5.6's async path never unpins a plugin's hit keys (it releases memory
        # objects only), so a pin here would last until its lease; the get follows in the same
        # task and a chunk evicted in between is read from a lower local tier, never served wrong.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._async_pool, self.batched_contains, keys, False)

    def exists_in_put_tasks(self, key) -> bool:  # noqa: ARG002
        return False

    def pin(self, key) -> bool:
        return self.contains(key, pin=True)

    def _release_locked(self, key, p: _Pin) -> _Pin:
        """Bookkeeping of one released pin (plugin lock held); the tier unpin is the caller's."""
        st = self._state
        p.served.pins -= 1
        drained = st.draining.get(key)
        if drained is not None and drained[0] is p.served and \
                not any(q.served is p.served for q in st.pins.held(key)):
            del st.draining[key]
        return p

    def unpin(self, key) -> bool:
        """Release the oldest pin on `key`: O(1) (a deque per key, a pin count per cartridge). An
        unpin of a pin that already expired by its lease releases nothing (returns False), nor
        does it release a newer lookup's pin on the same key (`lmcache.leases`)."""
        with self._lock:
            p = self._state.pins.release(key)
            if p is None:
                return False
            self._release_locked(key, p)
        self._release_tiers([p])
        if p.served.handle.retired:
            self._close_if_unused(p.served)  # retired and now unused
        return True

    def _release_tiers(self, pins: list[_Pin]) -> None:
        """What released pins kept in the tiers: their CPU-tier pins and disk holds (outside the
        plugin lock: the tiers take their own locks)."""
        self.residency.cpu.unpin_many(p.served.handle.chunk_id(p.index) for p in pins)
        for p in pins:
            if p.hold is not None:
                p.hold.release()

    def pin_count(self, key) -> int:
        with self._lock:
            return len(self._state.pins.held(key))

    # --- retrieve ---------------------------------------------------------------------------------
    def get_blocking(self, key):
        return self.batched_get_blocking([key])[0]

    def _allocate(self, served: Served, index: int):
        m = served.handle.manifest
        obj = self.local_cpu_backend.allocate(
            torch.Size(served.handle.view.engine_shape(index)),
            self.shape.dtype, MemoryFormat.KV_2LTD, eviction=True, busy_loop=False)
        if obj is None:  # allocator full: a miss, the request recomputes
            logger.warning("lmcache_cartridge: allocator full, chunk %d of %r not served", index, m.cartridge_id)
        return obj

    def _fill(self, served: Served, index: int, obj) -> bool:
        """Put verified chunk bytes (this rank's heads) into `obj`, in the layout this process's
        memory objects hold (`memory_layout`); False on any failure."""
        m = served.handle.manifest
        try:
            enc = memory_layout.encoder_for(m.chunks[index].num_tokens)
            self.residency.read_into(served.handle, index, obj.tensor, network=False,
                                     encode=None if enc is None else enc.encode)
            return True
        except NotLocal as e:  # evicted from every local tier since the lookup: fetch, miss now
            logger.warning("lmcache_cartridge: %s (request recomputes; downloading)", e)
            self._want_download(served)
            return False
        except Exception as e:  # never let a bad chunk reach LMCache or kill the worker
            logger.error("lmcache_cartridge: chunk %d of %r not served (request recomputes): %s",
                         index, m.cartridge_id, e)
            self._read_failed(served, e)  # bad bytes at a local origin: quarantined
            return False

    def _reader_cores(self) -> list[int]:
        """The cores the reads a retrieve waits on run on (`reader_cores` setting), asked once."""
        if self._readers_on is None:
            self._readers_on = threads.reader_cores(self.settings.reader_cores)
        return self._readers_on

    def _reader_pool(self):
        """The reader threads: one per reader core, in their order, up to four (as many as the
        machine's cores where the cores are unknown). Made once, on the retrieving thread."""
        if self._readers is None:
            n = len(self._reader_cores()) or (os.cpu_count() or 1)
            self._readers = threads.pool(min(4, n), "cartridge-read", cores=self._reader_cores, spread=True)
        return self._readers

    def batched_get_blocking(self, keys):
        """Chunks for a prefix of `keys` (aligned, `None` from the first miss on, as LMCache
        expects). Buffers are allocated here in order; the reads run in parallel on reader threads
        where there is more than one reader core (the worker's own, and by default those vLLM's
        binding leaves to no worker: `store.threads.reader_cores`), else on this thread. Only local tiers are read.
        A chunk whose cartridge was retired while it was read (and that no lookup
        pinned) comes back None: LMCache would otherwise write the old bytes into its CPU cache."""
        out: list = [None] * len(keys)
        if self.local_cpu_backend is None:
            return out
        located: list[tuple[Served, int]] = []
        with self._lock:
            st = self._state
            for key in keys:
                where = st.index.get(key) or st.draining.get(key)
                if where is None:
                    break
                located.append(where)
            reading = list({id(sv): sv for sv, _ in located}.values())
            for sv in reading:
                sv.reads += 1
        try:
            jobs = []
            for sv, i in located:
                obj = self._allocate(sv, i)
                if obj is None:
                    break
                jobs.append((sv, i, obj))
            if not jobs:
                return out
            if len(jobs) > 1 and self._parallel is None:
                self._parallel = threads.parallel(self._reader_cores())
            if len(jobs) == 1 or not self._parallel:
                # One core to read on: readers would only take turns on it, slower than this
                # thread alone (`benchmarks/hit_path.py`).
                oks = [self._fill(*j) for j in jobs]
            else:
                oks = list(self._reader_pool().map(lambda j: self._fill(*j), jobs))
            with self._lock:
                st = self._state
                for n, ((sv, i, _), key) in enumerate(zip(jobs, keys)):
                    if oks[n] and sv.handle.retired and st.draining.get(key) != (sv, i):
                        oks[n] = False  # removed or replaced while we read it
            for n, ((_, _, obj), ok) in enumerate(zip(jobs, oks)):
                if ok and (n == 0 or out[n - 1] is not None):
                    out[n] = obj
                else:
                    obj.ref_count_down()
            for sv in reading:  # the rest of what was read, now that these reads are done
                if not sv.handle.retired:
                    self.residency.prefetch_rest(sv.handle)
            return out
        finally:
            with self._lock:
                for sv in reading:
                    sv.reads -= 1
            for sv in reading:
                if sv.handle.retired:
                    self._close_if_unused(sv)

    async def batched_get_non_blocking(self, lookup_id: str, keys, transfer_spec=None):  # noqa: ARG002 (LMCache's)
        loop = asyncio.get_running_loop()
        objs = await loop.run_in_executor(self._async_pool, self.batched_get_blocking, keys)
        got = []
        for obj in objs:
            if obj is None:
                break
            got.append(obj)
        return got

    # --- read-only: puts and removals never touch a cartridge ---------------------------------------
    # LMCache's signatures: their arguments stay unused (noqa: ARG002)
    def batched_submit_put_task(self, keys, objs, transfer_spec=None,  # noqa: ARG002
                                on_complete_callback: Optional[Callable] = None):  # noqa: ARG002
        return None

    def remove(self, key, force: bool = True) -> bool:  # noqa: ARG002
        return False  # never deletes an origin; registry `remove` is how a cartridge leaves

    def get_allocator_backend(self):
        return self.local_cpu_backend

    def touch_cache(self) -> None:
        return None

    def close(self) -> None:
        self._closed.set()
        self._withdraw_record()
        if getattr(self, "_catalog_sync", None) is not None:
            self._catalog_sync.stop()
        if getattr(self, "_watcher", None) is not None:
            self._watcher.join(timeout=5)
        with self._lock:
            for s in self._state.served.values():
                s.handle.retired = True
                s.handle.origin.close()
            for s, _ in self._state.draining.values():
                s.handle.origin.close()
            # Disk holds are file locks other processes' evictions respect: never leave them
            # to the garbage collector.
            holds = [p.hold for p in self._state.pins.clear() if p.hold is not None]
            self._state = _State()
        for hold in holds:
            hold.release()
        if getattr(self, "residency", None) is not None:
            self.residency.close()
        for pool in (getattr(self, "_readers", None), getattr(self, "_async_pool", None)):
            if pool is not None:
                pool.shutdown(wait=False)
        if getattr(self, "registry", None) is not None:
            self.registry.close()
            self.registry = None

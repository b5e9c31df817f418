"""The read-only LMCache storage plugin that serves cartridge chunks.

Where it runs: LMCache builds it inside every engine (each vLLM worker rank; also vLLM's
scheduler process when `enable_scheduler_bypass_lookup` is on, then with `local_cpu_backend=None`).
Who calls it: LMCache's `StorageManager`, from the worker thread (lookup with `pin=True`,
`batched_get_blocking` on retrieve, `unpin` after), from the lookup-server thread, and from the
storage manager's event loop (the async pair). All state below is guarded by one lock.

What it owns: an index `CacheEngineKey -> (cartridge, chunk)` computed in this process with
LMCache's own token database (see `keys`), rebuilt when the registry changes; pin counts; the
set of chunks whose checksum this process has verified. It never owns a cartridge's files:
`remove` forgets keys, it never deletes anything.

Registered YAML (see configs/lmcache-cartridge.yaml):
    storage_plugins: ["cartridge"]
    extra_config:
      storage_plugin.cartridge.module_path: lmcache_cartridge.plugin
      storage_plugin.cartridge.class_name: CartridgeStoragePlugin
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from lmcache_cartridge.cartridge.compat import EngineShape, mismatch, rank_slice
from lmcache_cartridge.errors import CartridgeError, ChecksumError
from lmcache_cartridge.cartridge.keys import ChunkKeyMapper, hash_config_problem
from lmcache_cartridge.cartridge.manifest import Manifest
from lmcache_cartridge.store.metrics import Metrics
from lmcache_cartridge.store.origins import is_s3, open_origin
from lmcache_cartridge.store.registry import Entry, Registry
from lmcache_cartridge.store.residency import DiskTier, Handle, MemoryTier, Residency
from lmcache_cartridge.lmcache.settings import PluginSettings

logger = logging.getLogger("lmcache_cartridge.plugin")


@dataclass
class Served:
    """One cartridge this process serves: its open payload, its keys and which columns to copy."""

    entry: Entry
    handle: Handle
    keys: list[Any]
    columns: slice
    whole_rows: bool  # True when this rank serves every head: read straight into the buffer


@dataclass
class _State:
    served: dict[str, Served] = field(default_factory=dict)          # id -> Served
    index: dict[Any, tuple[str, int]] = field(default_factory=dict)  # key -> (id, chunk)
    draining: dict[Any, tuple[Served, int]] = field(default_factory=dict)  # removed but pinned
    # key -> what each pin was taken on, oldest first: after a re-registration under the same
    # keys, an unpin must release the chunk its lookup pinned, not whatever the key maps to now.
    pins: dict[Any, list[tuple[Served, int]]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)            # id -> why not served


class CartridgeStoragePlugin(StoragePluginInterface):
    """Read-only `StoragePluginInterface` mapping LMCache chunk keys to cartridge chunks."""

    def __init__(self, dst_device: str = "cpu", config=None, metadata=None,
                 local_cpu_backend=None, loop=None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        # LMCache swallows constructor errors in one line: log our own cause first, then re-raise.
        try:
            self.settings = PluginSettings.from_config(config, type(self))
            self.shape = EngineShape.from_lmcache(config, metadata, self.settings.accept_models)
            self._lock = threading.RLock()
            self._state = _State()
            self._closed = threading.Event()
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
            self.residency = Residency(
                MemoryTier("cpu", st.cpu_budget_bytes, metrics=self.metrics),
                DiskTier(st.cache_dir / "chunks", st.disk_budget_bytes, metrics=self.metrics),
                self.metrics, prefetch=st.prefetch)
            self._readers = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                               thread_name_prefix="cartridge-read")
            self.registry: Registry | None = None
            self._version = -1
            try:
                self.refresh()
            except CartridgeError as e:  # locked/corrupt registry: serve nothing, keep retrying
                logger.error("lmcache_cartridge: registry unusable, serving no cartridges until it is: %s", e)
            self._watcher = threading.Thread(target=self._watch, name="cartridge-registry-watch",
                                             daemon=True)
            self._watcher.start()
            self._preload()
            logger.info("lmcache_cartridge: %s", self.summary())
        except Exception as e:
            logger.error("lmcache_cartridge plugin failed to start: %s: %s", type(e).__name__, e)
            raise

    # --- registry -> index (runs at start and on the watcher thread) --------------------------
    def summary(self) -> str:
        with self._lock:
            st = self._state
            chunks = sum(len(s.keys) for s in st.served.values())
            return (
                f"plugin '{self.settings.name}' {'ready' if self.healthy else 'DISABLED'}: "
                f"{len(st.served)} cartridges ({chunks} chunks) for model {self.shape.model_names[0]!r} "
                f"rank {self.shape.rank}/{self.shape.world_size}, {sum(1 for n in st.pins.values() if n)} chunks pinned, "
                f"{len(st.skipped)} not served"
                f"{' (' + '; '.join(f'{k}: {v}' for k, v in sorted(st.skipped.items())) + ')' if st.skipped else ''}; "
                f"registry {self.settings.registry}, hash {self.config.pre_caching_hash_algorithm}, "
                f"chunk_size {self.shape.chunk_size}, refresh {self.settings.refresh_seconds}s"
                f"{'; problem: ' + self.problem if self.problem else ''}"
            )

    def refresh(self) -> bool:
        """Re-read the registry if another process changed it. Returns True if it did."""
        if self.registry is None:
            self.registry = Registry(self.settings.registry)
        version = self.registry.data_version()
        if version == self._version:
            return False
        entries = {e.id: e for e in self.registry.list() if e.state == "ready"}
        with self._lock:
            current = self._state.served
        keep = {i for i, s in current.items()
                if i in entries and entries[i].content_hash == s.entry.content_hash
                and entries[i].path == s.entry.path and entries[i].epoch == s.entry.epoch}
        added: dict[str, Served] = {}
        skipped: dict[str, str] = {}
        if self.healthy:
            for cid, entry in entries.items():
                if cid in keep:
                    continue
                try:
                    added[cid] = self._open(entry)
                except Exception as e:  # one bad entry (unreadable manifest, bad S3 settings) never blocks the rest
                    skipped[cid] = str(e) if isinstance(e, CartridgeError) else f"{type(e).__name__}: {e}"
                    logger.error("lmcache_cartridge: not serving cartridge %r: %s", cid, skipped[cid])
        with self._lock:
            st = self._state
            for cid in [c for c in st.served if c not in keep]:
                old = st.served.pop(cid)
                self._retire(old)
                new = entries.get(cid)
                if new is not None and new.epoch != old.entry.epoch:  # force_redownload
                    self.residency.forget(old.handle.content_hash, disk=True)
            if self.local_cpu_backend is not None:
                # KV that LMCache stored under these keys before we served them was recomputed
                # from the cartridge's token ids (for a trained cartridge: from placeholders):
                # it must never be served in place of the cartridge's own KV.
                for s in added.values():
                    for key in s.keys:
                        self.local_cpu_backend.remove(key, force=True)
            st.served.update(added)
            st.index = {k: (cid, i) for cid, s in st.served.items() for i, k in enumerate(s.keys)}
            st.skipped = skipped
        self._version = version  # only once the index reflects it: a failed refresh is retried
        if added or len(keep) != len(current):
            logger.info("lmcache_cartridge: registry changed: %s", self.summary())
        self.dump_stats()
        return True

    def _open(self, entry: Entry) -> Served:
        m = Manifest.load(entry.path)
        if m.cartridge_id != entry.id or m.content_hash != entry.content_hash:
            raise CartridgeError(f"{entry.path} no longer holds what was registered; re-register it")
        why = mismatch(m, self.shape)
        if why:
            raise CartridgeError(why)
        s3 = self._s3_settings() if is_s3(entry.source_uri) else None
        origin = open_origin(entry.source_uri, entry.path, s3)
        keys = self.mapper.keys(m.token_ids)
        cols = rank_slice(m, self.shape)
        return Served(entry, Handle(m, origin, servable=len(keys)), keys, cols, whole_rows=(cols.stop - cols.start) == m.hidden_dim)

    def _s3_settings(self):
        from lmcache_cartridge.store.s3 import S3Settings

        return S3Settings.from_mapping(self.settings.s3)

    def _retire(self, s: Served) -> None:
        """Stop serving `s` (lock held): pinned chunks drain; cached copies are dropped."""
        st = self._state
        for i, key in enumerate(s.keys):
            if any(t[0] is s for t in st.pins.get(key, ())):
                st.draining[key] = (s, i)
            if self.local_cpu_backend is not None:
                self.local_cpu_backend.remove(key, force=True)
        self.residency.forget(s.handle.content_hash)
        if not self._pinned(s):
            s.handle.origin.close()
        logger.info("lmcache_cartridge: stopped serving %r", s.entry.id)

    def _preload(self) -> None:
        """Warm the configured cartridges in the background (ids or labels)."""
        with self._lock:
            served = dict(self._state.served)
        for name in self.settings.preload:
            s = served.get(name) or next((v for v in served.values() if name in v.entry.labels), None)
            if s is None:
                logger.warning("lmcache_cartridge: preload %r: no such served cartridge", name)
                continue
            self.residency.prefetch_async(s.handle)

    def _watch(self) -> None:
        while not self._closed.wait(self.settings.refresh_seconds):
            try:
                self.refresh()
            except Exception as e:  # a locked/corrupt registry must not kill serving
                logger.warning("lmcache_cartridge: registry refresh failed (keeping current index): %s", e)
            self.dump_stats()

    def served_now(self) -> dict[str, list]:
        """`{cartridge id: [content_hash, epoch]}` this instance serves right now."""
        with self._lock:
            return {cid: [s.entry.content_hash, s.entry.epoch] for cid, s in self._state.served.items()}

    def dump_stats(self) -> None:
        """Publish this instance's tier counters (for `lmcache-cartridge stats`) and what it
        serves (the gateway forwards a request only once every live instance serves its
        cartridges: see `serving.wait_served`)."""
        try:
            self.metrics.dump(self.settings.cache_dir / "stats",
                              f"{self.settings.name}-rank{self.shape.rank}-pid{os.getpid()}",
                              {"registry": str(self.settings.registry), "served": self.served_now(),
                               "skipped": dict(self._state.skipped),
                               "refresh_seconds": self.settings.refresh_seconds, "pid": os.getpid()})
        except OSError as e:
            logger.debug("lmcache_cartridge: cannot write stats: %s", e)

    # --- lookup ---------------------------------------------------------------------------------
    def contains(self, key, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys, pin: bool = False) -> int:
        """Leading hits, under one lock (this runs for every lookup of every request)."""
        hits = 0
        with self._lock:
            st = self._state
            index = st.index
            for key in keys:
                if key not in index:
                    break
                hits += 1
            if pin and hits:
                pins, served = st.pins, st.served
                taken = [(served[cid], i) for cid, i in map(index.__getitem__, keys[:hits])]
                for key, t in zip(keys, taken):
                    pins.setdefault(key, []).append(t)
                self.residency.cpu.pin_many((sv.handle.content_hash, i) for sv, i in taken)
        return hits

    async def batched_async_contains(self, lookup_id: str, keys, pin: bool = False) -> int:
        # LMCache 0.5.6's async path never unpins a plugin's hit keys (it releases memory
        # objects only), so a pin here would last forever; the get follows in the same task and
        # a chunk evicted in between is read again from a lower tier, never served wrong.
        return self.batched_contains(keys, pin=False)

    def exists_in_put_tasks(self, key) -> bool:
        return False

    def pin(self, key) -> bool:
        return self.contains(key, pin=True)

    def unpin(self, key) -> bool:
        with self._lock:
            st = self._state
            taken = st.pins.get(key)
            if not taken:
                return False
            sv, i = taken.pop(0)
            if not taken:
                del st.pins[key]
            self.residency.cpu.unpin((sv.handle.content_hash, i))
            drained = st.draining.get(key)
            if drained is not None and not any(t[0] is drained[0] for t in st.pins.get(key, ())):
                del st.draining[key]
            if st.served.get(sv.entry.id) is not sv and not self._pinned(sv):
                sv.handle.origin.close()  # retired and now unused (closing twice is harmless)
            return True

    def _pinned(self, s: Served) -> bool:
        """Whether any pin is held on a chunk of `s` (lock held)."""
        return any(t[0] is s for taken in self._state.pins.values() for t in taken)

    def pin_count(self, key) -> int:
        with self._lock:
            return len(self._state.pins.get(key, ()))

    # --- retrieve ---------------------------------------------------------------------------------
    def _locate(self, key) -> Optional[tuple[Served, int]]:
        with self._lock:
            st = self._state
            where = st.index.get(key)
            if where is not None:
                return st.served[where[0]], where[1]
            return st.draining.get(key)

    def get_blocking(self, key):
        return self.batched_get_blocking([key])[0]

    def _allocate(self, served: Served, index: int):
        m = served.handle.manifest
        cols = served.columns
        obj = self.local_cpu_backend.allocate(
            torch.Size([2, m.num_layers, m.chunks[index].num_tokens, cols.stop - cols.start]),
            self.shape.dtype, MemoryFormat.KV_2LTD, eviction=True, busy_loop=False)
        if obj is None:  # allocator full: a miss, the request recomputes
            logger.warning("lmcache_cartridge: allocator full, chunk %d of %r not served", index, m.cartridge_id)
        return obj

    def _fill(self, served: Served, index: int, obj) -> bool:
        """Put verified chunk bytes (this rank's columns) into `obj`; False on any failure."""
        m = served.handle.manifest
        try:
            if served.whole_rows:
                self.residency.read_into(served.handle, index, obj.tensor)
            else:
                full = torch.empty(m.chunk_shape(m.chunks[index].num_tokens), dtype=m.torch_dtype)
                self.residency.read_into(served.handle, index, full)
                obj.tensor.copy_(full[..., served.columns])
            return True
        except Exception as e:  # never let a bad chunk reach LMCache or kill the worker
            logger.error("lmcache_cartridge: chunk %d of %r not served (request recomputes): %s",
                         index, m.cartridge_id, e)
            if isinstance(e, ChecksumError) and served.handle.origin.local:
                self._quarantine(served, str(e))
            return False

    def _quarantine(self, served: Served, why: str) -> None:
        """A cartridge whose origin bytes are bad is not served again until re-registered."""
        with self._lock:
            st = self._state
            if st.served.get(served.entry.id) is served:
                self._retire(st.served.pop(served.entry.id))
                st.index = {k: v for k, v in st.index.items() if v[0] != served.entry.id}
                st.skipped[served.entry.id] = why

    def batched_get_blocking(self, keys):
        """Chunks for a prefix of `keys` (aligned, `None` from the first miss on, as LMCache
        expects). Buffers are allocated here in order; the reads run in parallel."""
        out: list = [None] * len(keys)
        if self.local_cpu_backend is None:
            return out
        jobs = []
        for i, key in enumerate(keys):
            found = self._locate(key)
            if found is None:
                break
            obj = self._allocate(*found)
            if obj is None:
                break
            jobs.append((found[0], found[1], obj))
        if not jobs:
            return out
        if len(jobs) == 1:
            oks = [self._fill(*jobs[0])]
        else:
            oks = list(self._readers.map(lambda j: self._fill(*j), jobs))
        for i, ((_, _, obj), ok) in enumerate(zip(jobs, oks)):
            if ok and (i == 0 or out[i - 1] is not None):
                out[i] = obj
            else:
                obj.ref_count_down()
        return out

    async def batched_get_non_blocking(self, lookup_id: str, keys, transfer_spec=None):
        objs = self.batched_get_blocking(keys)
        got = []
        for obj in objs:
            if obj is None:
                break
            got.append(obj)
        return got

    # --- read-only: puts and removals never touch a cartridge ---------------------------------------
    def batched_submit_put_task(self, keys, objs, transfer_spec=None,
                                on_complete_callback: Optional[Callable] = None):
        return None

    def remove(self, key, force: bool = True) -> bool:
        return False  # never deletes an origin; registry `remove` is how a cartridge leaves

    def get_allocator_backend(self):
        return self.local_cpu_backend

    def touch_cache(self) -> None:
        return None

    def close(self) -> None:
        self._closed.set()
        if getattr(self, "_watcher", None) is not None:
            self._watcher.join(timeout=5)
        with self._lock:
            for s in self._state.served.values():
                s.handle.origin.close()
            for s, _ in self._state.draining.values():
                s.handle.origin.close()
            self._state = _State()
        if getattr(self, "residency", None) is not None:
            self.residency.close()
        if getattr(self, "_readers", None) is not None:
            self._readers.shutdown(wait=False)
        if getattr(self, "registry", None) is not None:
            self.registry.close()
            self.registry = None

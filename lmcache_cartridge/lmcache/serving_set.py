"""The serving set: which registered cartridges an adapter serves, one lifecycle for both modes.

Cartridges reach LMCache through one adapter per mode: in-process, the storage plugin
(`lmcache.plugin.CartridgeStoragePlugin`) in each vLLM worker (and vLLM's scheduler); in
multiprocess (MP) mode, the L2 adapter (`lmcache.mp_adapter.CartridgeL2Adapter`) in
`lmcache server`. Their keys, objects, locks and reads differ; what they serve does not, and is
decided here, once (the way LMCache's `l2_adapters/base.py` holds what every L2 adapter needs):

- Registered -> served. A refresh reads the registry when its version changed, opens every entry
  it does not serve yet (the adapter's `_open`; one that fails is "skipped" with its reason and
  never blocks the rest), settles keys several entries claim (`store.claims`: the operator's
  over a catalog's, ambiguity refused), and swaps the new set in whole under the adapter's lock;
  an exception before the swap leaves the old set serving. The version is recorded only once
  the swap is done: a failed refresh is retried.
- Replacement only when the bytes differ. A cartridge already served is kept, object and all,
  while its entry names the same bytes (`same_bytes`: content hash, path, epoch) under the same
  keys (`keeps`: a client's KV is keyed under its tag); else it is opened again and the old one
  retired. A re-registration with the same bytes but a new epoch (force_redownload) drops the
  bytes' local copies before the new epoch is served.
- Quarantine. A chunk read from a local origin that fails verification (`spoils`) takes its
  cartridge out of service at once, and it stays out, across unrelated registry changes, until
  its registration names other bytes (`Quarantine.matches`, the same `same_bytes`).
- Retirement. A cartridge removed, replaced or quarantined is retired under the lock (the
  adapter's bookkeeping: pins drain, tombstones), then, outside the lock, its local copies are
  forgotten unless a served cartridge reads the same bytes, and the adapter purges what LMCache
  holds of it and closes it when nothing reads it any more.
- Publication. Every refresh that read a changed registry and every quarantine publishes the
  adapter's serving state (`store.serving_state`; the record itself is the adapter's: their
  roles and residency differ).

Methods, by who calls them and where they run. "The lock" is the adapter's `_lock` (it guards
`_state`); `_refresh_lock` serializes refreshes.

Provided here, called by the adapter:
    _init_serving(state, lock)
        the adapter's constructor, once, before its first refresh.
    refresh() -> bool
        the adapter's start (plugin constructor; MP `attach`), its registry watcher thread every
        `refresh_seconds`, tests. Takes `_refresh_lock`, then the lock twice (a snapshot, the
        swap); never holds the lock while it opens a cartridge or calls `_after_retire`/`_started`.
    _read_failed(served, error)
        the adapter's read path when a chunk could not be read (plugin `_fill`: LMCache's
        retrieving thread or a reader thread; MP `_load`: the adapter's reader thread), without
        the lock. Quarantines the cartridge where `spoils` says so.
    _quarantine(served, why)
        from `_read_failed`; takes the lock, then retires and publishes outside it.
    served_now() -> {id: [content_hash, epoch]}
        any thread (serving state, tests).
    preloaded(served) -> bool
        any thread: whether the `preload` setting names it (an id, a label, or `*`).
    warn_unmatched_preloads()
        the adapter's start, after its first refresh: say which `preload` names match nothing.
    _serving_record(identity, fields) -> ServingState
        whichever thread publishes (the adapter's `publish`): the record, built once.
    _watch()
        the adapter's watcher thread (its target), until the adapter's `_closed` event is set.
    _keep_trained_resident()
        a watcher step of both adapters (and the plugin's `tick`).

Supplied by each adapter, called from here:
    _can_open() -> bool
        refresh, first, no lock: False serves nothing and reads no registry (plugin: its hash
        config is unstable; MP: the server module has not attached the server's hasher yet).
    _open(entry) -> served
        refresh thread, no lock: open a registered cartridge for serving in this process
        (manifest, origin, keys); raise to refuse it (the message is the reason published).
    _claims(served) -> [(key, chunk index)]
        refresh thread, the lock held: the index keys it serves.
    _retire_locked(served)
        refresh thread or the reading thread (quarantine), the lock held: stop serving it
        (bookkeeping only: no tier or LMCache lock may be taken here).
    _after_retire(retired)
        the same thread, no lock, once per swap (also with nothing retired): purge what LMCache
        holds of them, close their origins when no read or pin needs them.
    _started(fresh)
        refresh thread, no lock, after the swap and `_after_retire` (even when those raised): purge
        KV LMCache stored under their keys before they were served, start downloads and preloads.
        One that raises is called again with the cartridges still served at the next refresh.
    _publish()
        after a refresh or a quarantine, no lock: publish the serving state.
    summary() -> str
        refresh thread, for the log line of a changed registry.
    _resident_handles(served) -> [Handle]
        watcher thread, no lock: the residency handles of a trained cartridge its lookups read
        (plugin: its one handle; MP: each rank's of the engines attached), kept on this host by
        `_keep_trained_resident`.
    _cartridge_state(served) -> CartridgeState
        whichever thread publishes, no lock: one served cartridge's entry in the record (its
        bytes, kind, chunks and what of them is resident).
    _watch_steps() -> [(what, step)]
        watcher thread, each period: the adapter's housekeeping, run in turn by `_watch`.

A served cartridge, as seen here, has `entry` (the registry row it was opened from), `manifest`,
`origin` (`close()`, `local`) and `key` (its bytes' name in the tiers, `residency.tier_key`).
The adapter also provides `settings` (`registry`, `refresh_seconds`), `residency`, `metrics`,
`registry` (a `Registry`, or None to open it at the first refresh) and `_closed` (a
`threading.Event`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from lmcache_cartridge.errors import CartridgeError, ChecksumError
from lmcache_cartridge.store.claims import Claim, settle
from lmcache_cartridge.store.registry import Entry, Registry
from lmcache_cartridge.store.serving_state import CartridgeState, ServingState

logger = logging.getLogger("lmcache_cartridge.serving_set")


def same_bytes(a: Entry, b: Entry) -> bool:
    """Whether two registrations name the same bytes: the one rule for keeping a served cartridge
    across a refresh (with its keys: `keeps`) and for a quarantine's end. Content hash, where
    they are read from (path), and epoch (a force_redownload bumps it: the local copies must be
    fetched again)."""
    return (a.content_hash, a.path, a.epoch) == (b.content_hash, b.path, b.epoch)


def keeps(served: Entry, registered: Entry) -> bool:
    """Whether a served cartridge stays, object and all, across a refresh: its registration
    names the same bytes (`same_bytes`) under the same keys. A client's first-k KV is keyed under
    its own tag (`Entry.salt`); the operator's registration of the very same bytes has none, so
    it must be opened again to serve the prompt's own keys."""
    return same_bytes(served, registered) and served.salt == registered.salt


def spoils(served, error: BaseException) -> bool:
    """Whether a failed read quarantines its cartridge: a chunk failed verification at a local
    origin, so the registered bytes themselves are bad. (A remote chunk is read from the disk
    cache here, which drops a bad copy and fetches it again: a miss, not a quarantine.)"""
    return isinstance(error, ChecksumError) and served.origin.local


def reason(error: BaseException) -> str:
    """Why an entry is not served, as published (`skipped`)."""
    return str(error) if isinstance(error, CartridgeError) else f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class Quarantine:
    """Bytes found bad at their origin: not served again until the registered bytes change."""

    entry: Entry
    why: str

    def matches(self, e: Entry) -> bool:
        return same_bytes(self.entry, e)


@dataclass
class SetState:
    """What is served, guarded by the adapter's lock. Each field is replaced whole, never
    mutated in place, so a copy taken under the lock stays consistent after it."""

    served: dict[str, Any] = field(default_factory=dict)               # id -> served cartridge
    index: dict[Any, tuple[Any, int]] = field(default_factory=dict)    # key -> (served, chunk)
    skipped: dict[str, str] = field(default_factory=dict)              # id -> why not served
    quarantined: dict[str, Quarantine] = field(default_factory=dict)   # id -> bad bytes


class ServingSet(ABC):
    """The registry -> served lifecycle both adapters inherit (see the module docstring)."""

    _mode = ""  # in log lines: where this set serves (" in MP mode")
    _log = logger

    def _init_serving(self, state: SetState, lock) -> None:
        self._state = state
        self._lock = lock
        self._refresh_lock = threading.Lock()  # one refresh at a time (watcher vs. callers)
        self._version = -1
        self._unstarted: list = []  # swapped in, `_started` failed: tried again at the next refresh
        if not hasattr(self, "registry"):
            self.registry: Registry | None = None

    # --- hooks (each adapter) ------------------------------------------------------------------
    @abstractmethod
    def _can_open(self) -> bool: ...

    @abstractmethod
    def _open(self, entry: Entry): ...

    @abstractmethod
    def _claims(self, served) -> list[tuple[Any, int]]: ...

    @abstractmethod
    def _retire_locked(self, served) -> None: ...

    @abstractmethod
    def _after_retire(self, retired: list) -> None: ...

    @abstractmethod
    def _started(self, fresh: list) -> None: ...

    @abstractmethod
    def _publish(self) -> None: ...

    @abstractmethod
    def summary(self) -> str: ...

    @abstractmethod
    def _resident_handles(self, served) -> list: ...

    @abstractmethod
    def _watch_steps(self) -> list[tuple[str, Callable[[], Any]]]: ...

    @abstractmethod
    def _cartridge_state(self, served) -> CartridgeState: ...

    # --- the serving-state record ------------------------------------------------------------------
    def _serving_record(self, identity: dict, fields: Callable[[list], dict]) -> ServingState:
        """The serving-state record both adapters publish (`store.serving_state`): who it is
        (`identity`), what it serves with which bytes and residency (`_cartridge_state` of each),
        what it refused and why, its tier counters; `fields(served)` gives the adapter's own (its
        role, models, rank, health). The lock is not held while a tier is asked."""
        with self._lock:
            served = list(self._state.served.values())
            skipped = dict(self._state.skipped)
        return ServingState(**identity, updated=time.time(), refresh_seconds=self.settings.refresh_seconds,
                            registry=str(Path(self.settings.registry).resolve()),
                            cartridges={s.entry.id: self._cartridge_state(s) for s in served}, skipped=skipped,
                            tiers=self.metrics.snapshot()["tiers"], metrics_instance=self.metrics.instance,
                            **fields(served))

    # --- the watcher -------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Watcher thread: every `refresh_seconds` until `_closed` is set, the adapter's
        `_watch_steps` in turn, each on its own: one that raises (a locked registry, a full disk,
        an origin that fails) is logged and the others still run, so serving goes on with what it
        has and the next period tries again."""
        while not self._closed.wait(self.settings.refresh_seconds):
            for what, step in self._watch_steps():
                try:
                    step()
                except Exception as e:  # noqa: BLE001 (logged; the next period tries again)
                    self._log.warning("lmcache_cartridge%s: %s failed: %s", self._mode, what, e)

    def _keep_trained_resident(self) -> None:
        """Watcher step: a served trained cartridge on a remote origin whose bytes left this host's
        tiers (another cartridge's download evicted them, a fetch failed) is fetched again. The
        gateway forwards a trained request only once its cartridge is resident, so no lookup would
        ever ask for it again: without this it stayed unservable until registered again. What is
        kept is what the adapter's lookups read (`_resident_handles`)."""
        with self._lock:
            trained = [s for s in self._state.served.values()
                       if s.manifest.kind == "trained" and not s.origin.local]
        for s in trained:
            for h in self._resident_handles(s):
                if not self.residency.resident(h):
                    self.residency.download_async(h, on_done=lambda _h: self._publish())

    # --- registry -> served ------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Re-read the registry if another process changed it; True if it did. Serialized: two
        concurrent refreshes would both open and swap in the same change, and the second would
        retire the first's fresh cartridges."""
        with self._refresh_lock:
            return self._refresh()

    def _refresh(self) -> bool:
        if not self._can_open():
            return False
        self._start_again()
        if self.registry is None:
            self.registry = Registry(self.settings.registry)
        version = self.registry.data_version()
        if version == self._version:
            return False
        entries = {e.id: e for e in self.registry.list()}
        with self._lock:
            current = dict(self._state.served)
            quarantined = dict(self._state.quarantined)
        keep = {cid for cid, s in current.items() if cid in entries and keeps(s.entry, entries[cid])}
        opened: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        for cid, entry in entries.items():
            if cid in keep or (cid in quarantined and quarantined[cid].matches(entry)):
                continue
            try:
                opened[cid] = self._open(entry)
            except Exception as e:  # one bad entry (unreadable manifest, bad S3 settings) never blocks the rest
                skipped[cid] = reason(e)
                self._log.error("lmcache_cartridge: not serving cartridge %r%s: %s", cid, self._mode, skipped[cid])
        # force_redownload (same bytes, new epoch): drop the local copies *before* the new epoch is
        # visible, so no lookup under the new epoch is answered from the copies it asked to drop.
        redownload = {s.key for cid, s in opened.items()
                      if cid in current and current[cid].key == s.key and current[cid].entry.epoch != s.entry.epoch}
        for key in redownload:
            self.residency.forget(key, disk=True)
        with self._lock:
            st = self._state
            # Against the state as it is now: a reader may have quarantined a cartridge meanwhile.
            still = {cid: q for cid, q in st.quarantined.items() if cid in entries and q.matches(entries[cid])}
            served = {cid: s for cid, s in st.served.items() if cid in keep}
            served.update({cid: s for cid, s in opened.items() if cid not in still})
            # keys several entries claim: the operator's over a catalog's, ambiguity refused (whose
            # registration it is as the registry says now: a catalog's sync may record it later)
            index, refused = settle([Claim(s, entries[cid], s.manifest, self._claims(s)) for cid, s in served.items()])
            served = {cid: s for cid, s in served.items() if cid not in refused}
            dropped = [s for cid, s in opened.items() if served.get(cid) is not s]
            retired = [s for cid, s in st.served.items() if served.get(cid) is not s]
            st.served, st.index, st.quarantined = served, index, still
            st.skipped = skipped | refused | {cid: q.why for cid, q in still.items()}
            for s in retired:
                self._retire_locked(s)
        for cid, why in refused.items():
            self._log.error("lmcache_cartridge: not serving cartridge %r%s: %s", cid, self._mode, why)
        for s in dropped:  # opened for this refresh only
            s.origin.close()
        gone = {id(s) for s in dropped}
        self._after_swap(retired, set(redownload) | {s.key for s in served.values()},
                         [s for s in opened.values() if id(s) not in gone])
        self._version = version  # only once the set reflects it: a failed refresh is retried
        if opened or len(keep) != len(current):
            self._log.info("lmcache_cartridge: registry changed: %s", self.summary())
        self._publish()
        return True

    def _after_swap(self, retired: list, live: set, fresh: list) -> None:
        """Outside the lock, once a swap is done: the retired cartridges' copies forgotten and
        purged (`_forget`, `_after_retire`), then the fresh ones started (`_started`). Each step
        runs whatever the one before it raised (logged): `_started` purges KV that LMCache stored
        under the fresh cartridges' keys before they were served (recomputed; for a trained
        cartridge from placeholder ids), and without it that KV would answer for them. A
        `_started` that fails is tried again at the next refresh (`_start_again`)."""
        for step in (functools.partial(self._forget, retired, live), functools.partial(self._after_retire, retired)):
            try:
                step()
            except Exception:  # noqa: BLE001 (logged; the fresh cartridges must still start)
                self._log.exception("lmcache_cartridge: retiring %d cartridge(s)%s failed",
                                    len(retired), self._mode)
        self._start(fresh)

    def _start(self, fresh: list) -> None:
        if not fresh:
            return
        try:
            self._started(fresh)
        except Exception:  # noqa: BLE001 (logged; retried)
            self._log.exception("lmcache_cartridge: starting %d cartridge(s)%s failed; tried again at the "
                                "next refresh", len(fresh), self._mode)
            with self._lock:
                self._unstarted = [*self._unstarted, *fresh]

    def _start_again(self) -> None:
        """Refresh thread: `_started` for the cartridges whose start failed and that are still
        served."""
        with self._lock:
            pending, self._unstarted = self._unstarted, []
            served = {id(s) for s in self._state.served.values()}
        self._start([s for s in pending if id(s) in served])

    def _forget(self, retired: list, live: set) -> None:
        """Retired cartridges' local copies go, unless a served one reads the same bytes (or they
        were dropped already for a force_redownload)."""
        for s in retired:
            if s.key not in live:
                self.residency.forget(s.key)

    # --- quarantine ----------------------------------------------------------------------------------
    def _read_failed(self, served, error: BaseException) -> None:
        """A chunk of `served` could not be read (any thread, no lock): quarantine its cartridge
        where the error says its registered bytes are bad (`spoils`)."""
        if spoils(served, error):
            self._quarantine(served, str(error))

    def _quarantine(self, served, why: str) -> None:
        """Take `served` out of service until its registered bytes change (sticky across
        unrelated registry changes: `refresh` skips it while `Quarantine.matches`)."""
        e = served.entry
        with self._lock:
            st = self._state
            if st.served.get(e.id) is not served:  # already retired or quarantined
                return
            st.served = {cid: s for cid, s in st.served.items() if s is not served}
            st.index = {k: v for k, v in st.index.items() if v[0] is not served}
            st.quarantined = {**st.quarantined, e.id: Quarantine(e, why)}
            st.skipped = {**st.skipped, e.id: why}
            self._retire_locked(served)
            live = {s.key for s in st.served.values()}
        self._log.error("lmcache_cartridge: quarantined cartridge %r%s until its registered bytes change: %s",
                        e.id, self._mode, why)
        self._after_swap([served], live, [])
        self._publish()

    # --- what is served ----------------------------------------------------------------------------
    def served_now(self) -> dict[str, list]:
        """`{cartridge id: [content_hash, epoch]}` served right now."""
        with self._lock:
            return {cid: [s.entry.content_hash, s.entry.epoch] for cid, s in self._state.served.items()}

    # --- `preload`: what each adapter warms ahead of its first request -----------------------------
    @staticmethod
    def _names(name: str, served) -> bool:
        """A `preload` name: a cartridge id, a label, or "*" (every cartridge). A label names
        the operator's registrations only (`registry.labelled`: a catalog's `demo` is not the
        operator's); a catalog's entry is preloaded by its id or "*"."""
        return name == "*" or name == served.entry.id or (name in served.entry.labels and served.entry.rank == 0)

    def preloaded(self, served) -> bool:
        return any(self._names(name, served) for name in self.settings.preload)

    def warn_unmatched_preloads(self) -> None:
        """Say which `preload` names match nothing served (yet): a typo otherwise passes silently.
        (A cartridge `preload` names is warmed when it starts being served, so one registered
        later is still preloaded.)"""
        with self._lock:
            served = list(self._state.served.values())
        for name in self.settings.preload:
            if name != "*" and not any(self._names(name, s) for s in served):
                self._log.warning("lmcache_cartridge%s: preload %r: no such served cartridge (yet)",
                                  self._mode, name)

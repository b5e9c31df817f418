"""Lookup leases: what a lookup's hit holds until LMCache reads it, with one late-release rule.

LMCache asks an adapter which chunks it has (a lookup), then reads them (a retrieve, a load) and
then releases what the lookup holds. Between the two the adapter must keep every chunk it promised
readable: in-process, the plugin's lookup pins hold the CPU-tier copy or the disk-cache file
(`lmcache.plugin`, released by LMCache's `unpin`); in MP mode, the L2 adapter's lookup locks hold
the disk-cache file (`lmcache.mp_adapter`, released by the server's `submit_unlock`). Either is
a lease here: one entry per hit, per key, oldest first, whose value is what the adapter holds.

The rule both adapters follow. A release ends the oldest lease on its key. A lease not released
within `lease_seconds` of being taken expires (LMCache lost the request, or never releases on
that path): `expire` hands its value back so the adapter lets go of what it holds, and the table
keeps a record of it for one more lease. A release that comes after its lease expired finds that
record first and ends it instead of a newer lookup's lease on the same key (which LMCache has not
read yet); a record older than one more lease is forgotten, so a lease never released cannot
absorb releases for ever.

Where it runs: inside whichever adapter owns the table, on the threads that adapter names (lookup,
release, the watcher's `expire`). Not thread-safe on its own: the owner guards it with its lock,
the same lock as the state the values point into.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, Iterator, TypeVar

V = TypeVar("V")


@dataclass
class _Slot(Generic[V]):
    """One key's leases: live ones `(taken, value)` oldest first, and the expiry times of the
    expired ones a late release may still end, oldest first."""

    live: deque = field(default_factory=deque)
    expired: deque = field(default_factory=deque)


class LeaseTable(Generic[V]):
    """Lookup leases per key (see the module docstring for the rule). Times are
    `time.monotonic()` unless a caller passes `now` (tests)."""

    def __init__(self) -> None:
        self._slots: dict[Hashable, _Slot[V]] = {}

    def take(self, key: Hashable, value: V, now: float | None = None) -> None:
        """A lookup hit `key`: lease `value` (what it holds) until its release or expiry."""
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot()
        slot.live.append((time.monotonic() if now is None else now, value))

    def release(self, key: Hashable) -> V | None:
        """End the oldest lease on `key` and return its value for the caller to let go of. None
        when there is nothing to end, or when the oldest is an expired lease (a late release: its
        value was already handed back by `expire`, and a newer lease stays)."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        if slot.expired:
            slot.expired.popleft()
            value = None
        else:
            value = slot.live.popleft()[1]
        self._drop_if_empty(key, slot)
        return value

    def expire(self, lease_seconds: float, now: float | None = None) -> list[tuple[Hashable, V]]:
        """Leases older than `lease_seconds`: removed, returned as (key, value) for the caller to
        let go of, and recorded for one more lease; records older than that are forgotten."""
        now = time.monotonic() if now is None else now
        out: list[tuple[Hashable, V]] = []
        for key in list(self._slots):
            slot = self._slots[key]
            while slot.expired and now - slot.expired[0] > lease_seconds:
                slot.expired.popleft()
            while slot.live and now - slot.live[0][0] > lease_seconds:
                out.append((key, slot.live.popleft()[1]))
                slot.expired.append(now)
            self._drop_if_empty(key, slot)
        return out

    def held(self, key: Hashable) -> tuple[V, ...]:
        """The values of the live leases on `key`, oldest first."""
        slot = self._slots.get(key)
        return tuple(v for _, v in slot.live) if slot is not None else ()

    def items(self) -> Iterator[tuple[Hashable, V]]:
        """(key, value) of every live lease."""
        for key, slot in self._slots.items():
            for _, value in slot.live:
                yield key, value

    def keys_held(self) -> int:
        """How many keys have a live lease."""
        return sum(1 for slot in self._slots.values() if slot.live)

    def clear(self) -> list[V]:
        """Forget every lease and record; return the live leases' values (to let go of)."""
        values = [v for _, v in self.items()]
        self._slots.clear()
        return values

    def __len__(self) -> int:
        """Live leases, all keys together (expired records not counted)."""
        return sum(len(slot.live) for slot in self._slots.values())

    def _drop_if_empty(self, key: Hashable, slot: _Slot[Any]) -> None:
        if not slot.live and not slot.expired:
            del self._slots[key]

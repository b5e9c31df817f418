"""`preload` in MP mode: the cartridges it names loaded into the `lmcache server`'s L1 ahead of use.

What it asks is what a first request's lookup asks (`StorageManager.submit_prefetch_task`: the
server's lookup and load through the cartridge L2 adapter, `lmcache.mp_adapter`, under the
cartridge's keys and salt), unlocked (`NO_LOCK`): the chunks stay in L1 as anything stored there
does, until evicted; a request after that is an ordinary first hit. Once per (cartridge, model,
world size) of the engines attached whose model the cartridge serves; a cartridge served before an
engine attached is preloaded once it does. Purges of L1 (removal, replacement) reach preloaded
chunks as any (their lookups recorded the keys).

Where it runs: on the adapter's watcher thread, every refresh period (`preload_due`), in the
`lmcache server` process; the prefetch it submits runs on the server's prefetch controller
thread, which calls the adapter's lookup and load. Owns nothing: the tries it counts are kept on
each served cartridge (`preloads`), which only the watcher touches.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterable

logger = logging.getLogger("lmcache_cartridge.mp_adapter")

PRELOAD_DONE = -1
PRELOAD_TRIES = 5  # a preload that left chunks out (a download under way) is asked again, this often
PRELOAD_WAIT_S = 120.0  # longest a preload's prefetch is waited for


def preload_due(sm, layouts, wanted: Iterable[Any], engines: set[tuple[str, int]], *,
                residency, metrics, closed: threading.Event) -> None:
    """Preload each of `wanted` (served cartridges `preload` names) for every engine in `engines`
    whose model it serves and that it was not preloaded for yet. `sm`: the server's storage
    manager; `layouts`: its layout descriptor registry. A preload that left chunks out while a
    download its lookups started is under way is asked again (not counted) once it is local; else
    it is counted and asked again up to `PRELOAD_TRIES` times."""
    for s in wanted:
        for model, world in sorted(engines):
            tries = s.preloads.get((model, world), 0)
            if model not in s.models or tries == PRELOAD_DONE or closed.is_set() or s.retired:
                continue
            got, asked = preload(sm, layouts, s, model, world, metrics=metrics, closed=closed)
            with s.lock:
                handles = list(s.handles.values())
            if got < asked and any(residency.downloading(h) for h in handles):
                continue
            s.preloads[(model, world)] = PRELOAD_DONE if got == asked or tries + 1 >= PRELOAD_TRIES else tries + 1
            if s.preloads[(model, world)] == PRELOAD_DONE and got < asked:
                logger.warning("lmcache_cartridge MP adapter: preload of %r for %s (world size %d) left %d of "
                               "%d chunks out of L1 after %d tries: their requests load them as first hits",
                               s.entry.id, model, world, asked - got, asked, tries + 1)


def preload(sm, layouts, s, model: str, world: int, *, metrics, closed: threading.Event) -> tuple[int, int]:
    """(chunks in L1, chunks asked) of one preload of `s` for the engines of (model, world)."""
    from lmcache.v1.distributed.api import PrefetchLockMode, PrefetchTaskSpec

    rows = _key_rows(layouts, s, model, world)
    if not rows:
        return 0, 0
    asked = sum(len(r.keys) for r in rows)
    with metrics.timing("preload", asked):
        handle = sm.submit_prefetch_task(
            PrefetchTaskSpec(key_groups=rows, fetching_policy="prefix", lock_mode=PrefetchLockMode.NO_LOCK),
            external_request_id=f"cartridge-preload-{s.entry.id}")
        deadline = time.monotonic() + PRELOAD_WAIT_S
        while not sm.wait_prefetch_status(handle, 0.5):
            if closed.is_set() or time.monotonic() > deadline:
                return 0, asked  # its result, when it comes, stays with the server's controller
        result = sm.query_prefetch_status(handle)
    got = sum(row.popcount() for row in result.hit_cells) if result is not None else 0
    logger.info("lmcache_cartridge MP adapter: preloaded %d of %d chunks of %r into L1 for %s (world size %d)",
                got, asked, s.entry.id, model, world)
    return got, asked


def _key_rows(layouts, s, model: str, world: int) -> list:
    """The keys a first request of (model, world) would look up for `s`: one row per object group
    and rank, under the cartridge's salt; [] when that engine is gone or its world size does not
    split the cartridge's heads."""
    from lmcache.v1.distributed.api import GroupedObjectKeys, ObjectKey

    try:
        s.handle(world, 0)  # an engine whose world size does not split the heads is never served
        attn = layouts.find_attn_desc(model, world)
        whole = layouts.find(model, world)
        descs = layouts.find_group_layout_descs(model, world) or {
            g: whole for g in range(attn.num_object_groups) if whole is not None}
    except Exception as e:  # noqa: BLE001 (the engine left, or its heads do not split: nothing to ask)
        logger.info("lmcache_cartridge MP adapter: no preload of %r for %s (world size %d): %s",
                    s.entry.id, model, world, e)
        return []
    return [GroupedObjectKeys(keys=[ObjectKey(h, model, rank, group, s.salt) for h in s.hashes],
                              object_group_id=group, layout_desc=descs[group],
                              sliding_window_size=attn.num_chunks_in_sw[group])
            for group in range(attn.num_object_groups) if group in descs
            for rank in (ObjectKey.ComputeKVRank(world_size=world, global_rank=r, local_world_size=world,
                                                 local_rank=r) for r in range(world))]

"""The byte budget of what clients make the gateway store: S3 inputs it downloads (`objects/`)
and the cartridges it converts them, and local input files, into (`packed/`).

Runs in the gateway process, on the resolver's worker threads, after each download or
conversion (`enforce`). Least recently used first (a directory's mtime, refreshed when it is
reused), an item goes with the registry entries that point at it and the composites made from
it, so that nothing registered is left without its bytes; a request naming it again downloads and
converts it again. What the operator registered (`Entry.client` false: the CLI, the catalog)
is never evicted, nor the item a resolution is using now (`keep`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

AREAS = ("objects", "packed")  # under the cache dir: one directory per item
_lock = threading.Lock()       # one eviction pass at a time in this process


@dataclass(frozen=True)
class Item:
    path: Path
    nbytes: int
    used: float  # mtime of the item's directory: when it was made or last reused


def touch(path: Path) -> None:
    """Mark an item as used now (it is reused from the cache dir)."""
    try:
        os.utime(path)
    except OSError:  # gone meanwhile, or not ours to touch: it is only evicted sooner
        pass


def _size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):  # os.walk does not follow symlinks
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed while walking: it no longer takes space
                pass
    return total


def usage(cache_dir: Path) -> list[Item]:
    """Every item under the budget, with its size and when it was last used."""
    items = []
    for area in AREAS:
        base = Path(cache_dir) / area
        if not base.is_dir():
            continue
        for d in base.iterdir():
            if d.name.startswith("."):  # a conversion or download still being written
                continue
            try:
                st = d.lstat()
            except OSError:
                continue
            items.append(Item(d, _size(d), st.st_mtime))
    return items


def _users(registry, item: Path) -> tuple[list, bool]:
    """Registry entries that read `item` (directly, or as a composite's part) and whether one of
    them is the operator's."""
    from lmcache_cartridge.store.composite import PARTS_NAME

    users, pinned = [], False
    for e in registry.list():
        paths = [Path(e.path)]
        parts = Path(e.path) / PARTS_NAME
        if parts.is_file():
            try:
                paths += [Path(p["path"]) for p in json.loads(parts.read_text(encoding="utf-8"))]
            except (OSError, ValueError, KeyError, TypeError):  # unreadable parts: the entry's own path
                pass
        if any(p == item or item in p.parents for p in paths):
            users.append(e)
            pinned |= not e.client and Path(e.path) == item
    return users, pinned


def enforce(cache_dir: Path, registry, max_bytes: int, keep: tuple[Path, ...] = ()) -> list[Path]:
    """Evict least recently used items until `objects/` and `packed/` hold at most `max_bytes`;
    returns what was evicted. `keep`: the items the caller is using (never evicted)."""
    with _lock:
        items = usage(cache_dir)
        total = sum(i.nbytes for i in items)
        evicted: list[Path] = []
        for item in sorted(items, key=lambda i: i.used):
            if total <= max_bytes:
                break
            if item.path in keep:
                continue
            users, pinned = _users(registry, item.path)
            if pinned:
                continue
            for e in users:
                registry.remove(e.id)
            shutil.rmtree(item.path, ignore_errors=True)
            total -= item.nbytes
            evicted.append(item.path)
            logger.info("lmcache_cartridge: cache budget: evicted %s (%d bytes; %d registry entries)",
                        item.path, item.nbytes, len(users))
        if total > max_bytes:
            logger.warning("lmcache_cartridge: %s holds %d bytes of inputs and conversions, over the %d-byte "
                           "budget, with nothing more that may be evicted", cache_dir, total, max_bytes)
        return evicted

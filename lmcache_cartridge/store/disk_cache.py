"""The local disk cache of chunks: one cache per host, shared by every process that opens it.

Where it runs: inside every plugin instance on a host (each TP rank of a vLLM server, each server),
all over the same `<cache_dir>/chunks`. Reads (`get_into`) run on LMCache's retrieve path or a
download thread; writes (`put`) run on download / write-behind threads, never on the hot path.

Why a shared index: with an index and budget of its own in each process over the same files,
budgets would count N times, one process's eviction would unlink files others still index, and a
starting process would delete the temp files of live writers. So:

- `index.sqlite` (WAL) next to the chunk files holds one row per chunk file, published or being
  written: `(hash, idx, size, used, owner)`. The host's budget is `SUM(size)` over that table;
  every reservation and eviction runs in one `BEGIN IMMEDIATE` transaction (writers queue on
  `flock(index.lock)` before it, which wakes them at once), so N processes
  evict against one budget and two writers never reserve the same chunk. `used` is the shared
  LRU clock (reads are batched into it about once a second). SQLite rather than a lock file plus
  directory scans: the budget check is one indexed query instead of a walk of every file, and
  the LRU order is shared, which flock alone cannot give. The directory must be on a local
  filesystem (SQLite WAL needs shared memory; not NFS).
- Writes go to `.<idx>.chunk.<owner>.<unique>.tmp` and are renamed into place (atomic publish).
  `<owner>` is a per-process token whose lock file `.owners/<owner>.lock` the process holds with
  `flock` for its whole life: a temp file is reclaimed only once its owner's lock can be taken,
  i.e. its process is gone (SIGKILL included; the kernel drops the lock). Rows reserved by a dead
  owner are adopted if its rename happened, else deleted. Nothing else deletes a temp file.
- A reader holds `flock(LOCK_SH)` on the chunk file while it reads; eviction takes
  `LOCK_EX | LOCK_NB` first and skips a file being read. In the microsecond window between a
  reader's `open` and its `flock`, an eviction can still unlink the name, which is harmless on
  POSIX: the open descriptor keeps the inode and the reader gets all its bytes.
- A reader whose file vanished (evicted by another process) gets a miss, not an error, and
  the chunk is fetched again by the ordinary download path.
- A lookup that promises a chunk only this tier has holds the same shared lock from the lookup
  until its retrieve (`hold`, a `DiskHold`): LRU eviction in any process on the host skips the
  file meanwhile, so another cartridge's download cannot break the promise. Only a `discard`
  (force_redownload) or a corrupt read still removes a held file; the retrieve then misses.

Bytes are verified against the manifest on their first read in each process, and again on any
read that finds the file changed since this process checked or wrote it (`_signature`: another
program writing into it, a file swapped behind our back): a long-running process (the MP
server, whose only tier this is) would otherwise serve a file corrupted after its first read for
as long as it runs. A corrupt file is deleted and reported as a miss.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import re
import secrets
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from lmcache_cartridge.cartridge.integrity import check_chunk
from lmcache_cartridge.cartridge.manifest import Manifest
from lmcache_cartridge.cartridge.tp import RankView
from lmcache_cartridge.errors import ChecksumError
from lmcache_cartridge.store.metrics import Metrics

logger = logging.getLogger("lmcache_cartridge.store.disk_cache")

# (key, chunk index). The key is the handle's `residency.tier_key` (`<content_hash>.o<origin
# tag>`: one origin's bytes) for whole chunks, with `.h<start>-<end>` appended for the heads one
# tensor-parallel rank reads of a `by_head` payload (`Handle.chunk_id`): ranks holding the same
# heads share one file. Directories named by a content hash alone are an older version's: still
# indexed (and evicted in LRU order), never read.
ChunkId = tuple[str, int]
_KEY = re.compile(r"^[0-9a-f]{64}(\.o[0-9a-f]{16})?(\.h\d+-\d+)?\Z")


class Verifiable(Protocol):
    """What a first read checks a chunk file against (a `residency.Handle`): the manifest's
    digests and dtype, and the heads this process reads."""

    manifest: Manifest
    view: RankView


def _signature(st: os.stat_result) -> tuple[int, int, int, int]:
    """What a chunk file's check holds for: its inode, size and modification and change times.
    A write into the file, or another file renamed over it, changes the change time (which no
    `utime` sets back), so a read that finds another signature checks the bytes again. Where
    the kernel keeps file times in coarse ticks, a write within the tick of our own check or
    write looks unchanged until the next first read."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def belongs_to(key: str, prefix: str) -> bool:
    """Is `key` (a directory, a ChunkId's first part) one of `prefix`'s: a tier key (that
    origin's chunks, every rank's heads) or a bare content hash (every origin's)?"""
    return key == prefix or key.startswith(prefix + ".")

INDEX_NAME = "index.sqlite"
MUTEX_NAME = "index.lock"
OWNERS_DIR = ".owners"
_TMP = re.compile(r"^\.(\d+)\.chunk\.([0-9a-f]+-[0-9a-f]+)\.[0-9a-z]+\.tmp\Z")
_LEGACY_TMP = re.compile(r"^\.(\d+)\.chunk\.(\d+)\.(\d+)\Z")  # `.<i>.chunk.<pid>.<tid>` (before the index)
_TOUCH_FLUSH_S = 1.0
_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    hash TEXT NOT NULL, idx INTEGER NOT NULL, size INTEGER NOT NULL, used REAL NOT NULL,
    owner TEXT,  -- NULL when published, else the token of the process writing it
    PRIMARY KEY (hash, idx));
CREATE INDEX IF NOT EXISTS chunks_lru ON chunks (used);
CREATE INDEX IF NOT EXISTS chunks_owner ON chunks (owner);
"""


class _Owner:
    """This process's liveness token: `.owners/<token>.lock`, held with `flock` while we live.

    The file is created, locked, then checked to still be the file at that name: a janitor that
    judged it dead in the moment before our lock would have unlinked it, and we start over with a
    new token (no temp file was ever named after the old one)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        while True:
            token = f"{os.getpid():x}-{secrets.token_hex(6)}"
            path = directory / f"{token}.lock"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.token, self.path, self.fd, self.pid = token, path, fd, os.getpid()

    def close(self) -> None:
        if self.fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = -1


class DiskHold:
    """A shared `flock` on one published chunk file (`DiskTier.hold`): eviction skips the file,
    in every process on the host, until `release`. Reads still go by the path (`get_into`), so a
    held file that `discard` removed (force_redownload) is a miss, never old bytes.

    Where it runs: taken on a lookup's thread (LMCache's lookup server, the MP adapter's reader);
    released by whatever ends the promise (LMCache's unpin on the worker thread, the pin lease on
    the watcher thread, close). `release` is idempotent and thread-safe."""

    __slots__ = ("cid", "_fd", "_lock")

    def __init__(self, cid: ChunkId, fd: int) -> None:
        self.cid, self._fd, self._lock = cid, fd, threading.Lock()

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # closing the descriptor drops its lock


class DiskTier:
    """Byte-budgeted LRU of chunk files under `root`, shared by every process on the host.

    Layout: `root/<key>/<index>.chunk` (`ChunkId`), `root/index.sqlite` (the shared index and
    budget), `root/index.lock` (writers' queue), `root/.owners/` (one lock file per live process).
    `budget_bytes` is the host's budget: every process enforces it against the shared total (give
    all instances the same value; with different values each put is held to its own process's
    value).
    """

    def __init__(self, root: str | Path, budget_bytes: int, metrics: Metrics | None = None, *,
                 janitor_interval_s: float = 30.0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget = int(budget_bytes)
        self.metrics = metrics or Metrics()
        self.janitor_interval_s = float(janitor_interval_s)
        self._lock = threading.Lock()  # this process's connection and sets
        self._present: set[ChunkId] = set()  # seen published by this process (lookup fast path)
        # checked against the manifest (or written) by this process: the file's `_signature` then
        self._verified: dict[ChunkId, tuple[int, int, int, int]] = {}
        self._touched: dict[ChunkId, float] = {}  # reads not yet written to the shared LRU clock
        self._last_flush = time.monotonic()
        self._last_janitor = time.monotonic()
        self._seq = itertools.count()
        self._open()
        with self._lock, self._txn() as db:
            self._reconcile(db)

    # -- process state ------------------------------------------------------------------------
    def _open(self) -> None:
        self._owner = _Owner(self.root / OWNERS_DIR)
        self._mutex = os.open(self.root / MUTEX_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        self._db = sqlite3.connect(self.root / INDEX_NAME, timeout=60, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA synchronous=NORMAL")
        fcntl.flock(self._mutex, fcntl.LOCK_EX)  # N ranks starting at once: one switches to WAL
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
        finally:
            fcntl.flock(self._mutex, fcntl.LOCK_UN)
        with self._txn() as db:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)

    def _check_fork(self) -> None:
        """A forked child must not share the parent's connection or owner token (caller holds _lock)."""
        if self._owner.pid != os.getpid():
            self._open()

    @contextmanager
    def _txn(self, *, blocking: bool = True):
        """One write transaction on the shared index (caller holds `_lock`). Writers queue on
        `flock(index.lock)` first: the kernel wakes the next one the moment the lock is free,
        where SQLite's own busy handler sleeps and polls (tens of ms per put under contention).
        Non-blocking raises BlockingIOError when another process is in a transaction."""
        fcntl.flock(self._mutex, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        finally:
            fcntl.flock(self._mutex, fcntl.LOCK_UN)

    def close(self) -> None:
        """Release the index and this process's token (exit does the same)."""
        with self._lock:
            self._flush_touches_locked()
            self._db.close()
            os.close(self._mutex)
            self._owner.close()

    # -- paths --------------------------------------------------------------------------------
    def _path(self, cid: ChunkId) -> Path:
        return self.root / cid[0] / f"{cid[1]}.chunk"

    def _tmp_path(self, cid: ChunkId) -> Path:
        unique = f"{os.getpid():x}x{threading.get_ident():x}x{next(self._seq):x}"
        return self.root / cid[0] / f".{cid[1]}.chunk.{self._owner.token}.{unique}.tmp"

    # -- queries ------------------------------------------------------------------------------
    def __contains__(self, cid: ChunkId) -> bool:
        """Whether the chunk is published on this host. Called per lookup key: a set hit, else
        one `stat`. Another process may evict it after we said yes; the read is then a miss."""
        if cid in self._present:
            return True
        if self._path(cid).is_file():
            self._present.add(cid)
            return True
        return False

    @property
    def used(self) -> int:
        """Bytes the host's cache holds or has reserved for writes under way (all processes)."""
        with self._lock:
            self._check_fork()
            return self._total(self._db)

    def keys(self) -> list[ChunkId]:
        """Published chunks, least recently used first (all processes)."""
        with self._lock:
            self._check_fork()
            self._flush_touches_locked()
            rows = self._db.execute("SELECT hash, idx FROM chunks WHERE owner IS NULL ORDER BY used").fetchall()
        return [(h, int(i)) for h, i in rows]

    # -- reads --------------------------------------------------------------------------------
    def get_into(self, cid: ChunkId, buf: memoryview, handle: Verifiable) -> bool:
        """Read a cached chunk into `buf`. A missing file (another process evicted it) is a plain
        miss; a short or corrupt file is deleted and reported as a miss."""
        path = self._path(cid)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._present.discard(cid)
            return False
        except OSError as e:
            logger.error("lmcache_cartridge: disk cache chunk unreadable (%s); fetching it again", e)
            self.metrics.error("disk")
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # eviction skips a file being read
            try:
                with open(fd, "rb", buffering=0, closefd=False) as f:
                    n = f.readinto(buf)
                if n != buf.nbytes:
                    raise ChecksumError(f"{path}: {n} bytes, expected {buf.nbytes}")
                sig = _signature(os.fstat(fd))  # after the read: a write before or during it shows
                verify = self._verified.get(cid) != sig
                if verify:
                    check_chunk(handle.view.span(cid[1]), buf, str(path), handle.manifest.torch_dtype)
            except (OSError, ChecksumError) as e:
                logger.error("lmcache_cartridge: disk cache chunk dropped (%s); fetching it again", e)
                self.metrics.error("disk")
                self._drop_bad(cid, os.fstat(fd).st_ino)
                return False
        finally:
            os.close(fd)
        self._present.add(cid)
        if verify:
            self._verified[cid] = sig
        self._touch(cid)
        return True

    def hold(self, cid: ChunkId) -> DiskHold | None:
        """Keep a published chunk from eviction until the returned hold is released; None when
        its file is gone or being evicted at this moment. Called by a pinned lookup for a chunk
        only this tier has (`Residency.hold_local`), so that what the lookup promises the
        retrieve can still read. One descriptor per hold: holds last from a lookup to its
        retrieve, and are bounded by the pins in flight and their lease."""
        path = self._path(cid)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._present.discard(cid)
            return None
        except OSError as e:
            logger.warning("lmcache_cartridge: could not hold disk cache chunk %s: %s", path, e)
            return None
        try:
            # Non-blocking: an evictor holds LOCK_EX only just before it unlinks the name, so a
            # file we cannot lock now is going away.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            # An eviction between our open and our lock unlinked the name: a lock on that orphaned
            # inode would protect nothing (a new file under the name is not ours either).
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                raise FileNotFoundError(path)
        except OSError:
            os.close(fd)
            self._present.discard(cid)
            return None
        return DiskHold(cid, fd)

    def touch(self, cid: ChunkId) -> None:
        """Mark a chunk used now, as a read does, without reading it (a chunk the engine still
        holds: LMCache's touch); a chunk this tier does not hold is left alone."""
        self._touch(cid)

    def _touch(self, cid: ChunkId) -> None:
        """Record a read for the shared LRU; written about once a second, never waiting on
        another process's transaction (the hot path skips a busy index and tries later). A chunk
        without a row is not inserted (the flush only updates rows)."""
        self._touched[cid] = time.time()
        if time.monotonic() - self._last_flush < _TOUCH_FLUSH_S or not self._lock.acquire(blocking=False):
            return
        try:
            self._check_fork()
            self._flush_touches_locked(blocking=False)
        except (BlockingIOError, sqlite3.OperationalError):  # the index is busy: next time
            pass
        finally:
            self._lock.release()

    def _flush_touches_locked(self, db: sqlite3.Connection | None = None, *, blocking: bool = True) -> None:
        self._last_flush = time.monotonic()
        if not self._touched:
            return
        touched, self._touched = self._touched, {}
        rows = [(t, h, i) for (h, i), t in touched.items()]
        try:
            if db is not None:
                db.executemany("UPDATE chunks SET used = MAX(used, ?) WHERE hash = ? AND idx = ?", rows)
            else:
                with self._txn(blocking=blocking) as d:
                    d.executemany("UPDATE chunks SET used = MAX(used, ?) WHERE hash = ? AND idx = ?", rows)
        except BaseException:
            for cid, t in touched.items():  # keep them for the next flush
                self._touched.setdefault(cid, t)
            raise

    def _drop_bad(self, cid: ChunkId, inode: int) -> None:
        """Delete a file that failed its read, unless another writer has replaced it since."""
        with self._lock:
            self._check_fork()
            self._present.discard(cid)
            self._verified.pop(cid, None)
            with self._txn() as db:
                path = self._path(cid)
                try:
                    if os.stat(path).st_ino == inode:
                        path.unlink()
                        db.execute("DELETE FROM chunks WHERE hash = ? AND idx = ? AND owner IS NULL", cid)
                except FileNotFoundError:
                    db.execute("DELETE FROM chunks WHERE hash = ? AND idx = ? AND owner IS NULL", cid)
                except OSError as e:
                    logger.warning("lmcache_cartridge: could not delete %s: %s", path, e)

    # -- writes -------------------------------------------------------------------------------
    def put(self, cid: ChunkId, buf: memoryview) -> bool:
        """Store verified bytes atomically under the host's budget; False (nothing kept) if it
        does not fit, another process is writing the same chunk, or I/O fails."""
        n = buf.nbytes
        if n > self.budget:
            return False
        path = self._path(cid)
        with self._lock:
            self._check_fork()
            with self._txn() as db:
                row = db.execute("SELECT owner FROM chunks WHERE hash = ? AND idx = ?", cid).fetchone()
                if row is not None:
                    if row[0] is not None:
                        return False  # being written by someone (us on another thread, or another process)
                    if path.is_file():
                        self._present.add(cid)
                        self._touched[cid] = time.time()
                        return True
                    db.execute("DELETE FROM chunks WHERE hash = ? AND idx = ?", cid)  # its file vanished
                self._flush_touches_locked(db)
                # Reservations of dead writers go before any live chunk is evicted for room.
                if (time.monotonic() - self._last_janitor >= self.janitor_interval_s
                        or self._total(db) + n > self.budget):
                    self._janitor(db)
                fits, evicted = self._make_room(db, n)
                if fits:
                    db.execute("INSERT INTO chunks (hash, idx, size, used, owner) VALUES (?, ?, ?, ?, ?)",
                               (cid[0], cid[1], n, time.time(), self._owner.token))
            tmp = self._tmp_path(cid)
        if evicted:
            self.metrics.eviction("disk", evicted)
        if not fits:
            return False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with open(fd, "wb", buffering=0) as f:
                view, done = memoryview(buf).cast("B"), 0
                while done < n:
                    done += f.write(view[done:])
                os.fsync(f.fileno())
                os.replace(tmp, path)
                sig = _signature(os.fstat(f.fileno()))  # after the rename, which sets the change time
        except BaseException as e:  # disk full, permissions: keep serving from memory/origin
            tmp.unlink(missing_ok=True)
            with self._lock, self._txn() as db:  # a live owner's reservation would never be reclaimed
                db.execute("DELETE FROM chunks WHERE hash = ? AND idx = ? AND owner = ?", (*cid, self._owner.token))
            if not isinstance(e, OSError):
                raise
            logger.warning("lmcache_cartridge: could not write disk cache %s: %s", path, e)
            self.metrics.error("disk")
            return False
        with self._lock, self._txn() as db:
            published = db.execute("UPDATE chunks SET owner = NULL, used = ? WHERE hash = ? AND idx = ? AND owner = ?",
                                   (time.time(), *cid, self._owner.token)).rowcount
            if not published:  # dropped while we wrote (force_redownload): no file without its row
                if db.execute("SELECT 1 FROM chunks WHERE hash = ? AND idx = ?", cid).fetchone() is None:
                    path.unlink(missing_ok=True)
                return False
            self._present.add(cid)
            self._verified[cid] = sig
        return True

    def _make_room(self, db: sqlite3.Connection, n: int) -> tuple[bool, int]:
        """Evict published files, least recently used first, until `n` more bytes fit the budget.
        Files being read or held for a lookup (`hold`) and reservations of writers under way are
        skipped: with only those left, the put does not fit (the chunk stays in memory, or a later
        download writes it)."""
        used = self._total(db)
        evicted = skipped = 0
        while used + n > self.budget:
            rows = db.execute("SELECT hash, idx, size FROM chunks WHERE owner IS NULL ORDER BY used LIMIT 64 OFFSET ?",
                              (skipped,)).fetchall()
            if not rows:
                break
            for h, i, size in rows:
                if used + n <= self.budget:
                    break
                if self._unlink_unless_read((h, i)):
                    db.execute("DELETE FROM chunks WHERE hash = ? AND idx = ?", (h, i))
                    self._present.discard((h, i))
                    self._verified.pop((h, i), None)
                    used -= size
                    evicted += 1
                else:
                    skipped += 1
        return used + n <= self.budget, evicted

    @staticmethod
    def _total(db: sqlite3.Connection) -> int:
        return int(db.execute("SELECT COALESCE(SUM(size), 0) FROM chunks").fetchone()[0])

    def _unlink_unless_read(self, cid: ChunkId) -> bool:
        path = self._path(cid)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        except OSError as e:
            logger.warning("lmcache_cartridge: could not evict %s: %s", path, e)
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a reader or a lookup's hold has it: pick another victim
            path.unlink(missing_ok=True)
            return True
        except OSError as e:
            logger.warning("lmcache_cartridge: could not evict %s: %s", path, e)
            return False
        finally:
            os.close(fd)

    def discard(self, prefix: str) -> int:
        """Delete every published chunk of one cartridge (force_redownload), from every process's
        view; writes under way by others finish (their bytes are verified origin bytes).
        `prefix`: a tier key (that origin's chunks) or a bare content hash (every origin's)."""
        mine = (prefix, prefix + ".%")  # whole chunks and every rank's head slices
        with self._lock:
            self._check_fork()
            with self._txn() as db:
                writing = set(db.execute(
                    "SELECT hash, idx FROM chunks WHERE (hash = ? OR hash LIKE ?) AND owner IS NOT NULL", mine))
                db.execute("DELETE FROM chunks WHERE (hash = ? OR hash LIKE ?) AND owner IS NULL", mine)
                removed = 0
                for d in self.root.glob(prefix + "*"):
                    if not d.is_dir() or not belongs_to(d.name, prefix):
                        continue
                    for f in d.iterdir():
                        if f.suffix == ".chunk" and f.stem.isdigit() and (d.name, int(f.stem)) not in writing:
                            try:
                                f.unlink()
                                removed += 1
                            except FileNotFoundError:  # another process removed it first
                                pass
                            except OSError as e:
                                logger.warning("lmcache_cartridge: could not delete %s: %s", f, e)
            self._present = {c for c in self._present if not belongs_to(c[0], prefix)}
            self._verified = {c: v for c, v in self._verified.items() if not belongs_to(c[0], prefix)}
            self._touched = {c: t for c, t in self._touched.items() if not belongs_to(c[0], prefix)}
        return removed

    # -- housekeeping (inside a transaction) -----------------------------------------------------
    def _owner_alive(self, token: str, dead: set[str]) -> bool:
        """A token is alive while its process holds its lock file. A dead one's lock file is
        removed here, while we hold it."""
        if token == self._owner.token:
            return True
        if token in dead:
            return False
        path = self.root / OWNERS_DIR / f"{token}.lock"
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            dead.add(token)
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            path.unlink(missing_ok=True)
            dead.add(token)
            return False
        finally:
            os.close(fd)

    def _janitor(self, db: sqlite3.Connection) -> set[str]:
        """Reclaim what dead processes left: their reservations (adopted if their rename
        happened, else deleted), their temp files, their lock files. Returns the dead tokens."""
        self._last_janitor = time.monotonic()
        dead: set[str] = set()
        owners = self.root / OWNERS_DIR
        for f in (owners.iterdir() if owners.is_dir() else ()):
            if f.suffix == ".lock":
                self._owner_alive(f.stem, dead)
        rows = db.execute("SELECT hash, idx, size, owner FROM chunks WHERE owner IS NOT NULL").fetchall()
        for h, i, size, token in rows:
            if self._owner_alive(token, dead):
                continue
            path = self._path((h, i))
            try:
                st = path.stat()
            except OSError:
                st = None
            if st is not None and st.st_size == size:
                db.execute("UPDATE chunks SET owner = NULL, used = ? WHERE hash = ? AND idx = ?", (st.st_mtime, h, i))
            else:
                db.execute("DELETE FROM chunks WHERE hash = ? AND idx = ?", (h, i))
            d = self.root / h
            for tmp in (d.glob(f".{i}.chunk.{token}.*.tmp") if d.is_dir() else ()):
                tmp.unlink(missing_ok=True)
        return dead

    def _reconcile(self, db: sqlite3.Connection) -> None:
        """At start: index chunk files the index does not know (a cache from before the index,
        or an index deleted by hand), forget rows whose file is gone, and reclaim temp files of
        dead processes. Live processes' temp files are left alone."""
        dead = self._janitor(db)
        rows = {(h, int(i)): owner for h, i, owner in db.execute("SELECT hash, idx, owner FROM chunks")}
        seen: set[ChunkId] = set()
        for d in self.root.iterdir():
            if not d.is_dir() or not _KEY.match(d.name):
                continue
            for f in d.iterdir():
                name = f.name
                if name.startswith("."):
                    m = _TMP.match(name)
                    if m and not self._owner_alive(m.group(2), dead):
                        f.unlink(missing_ok=True)
                    elif not m and (legacy := _LEGACY_TMP.match(name)) and not _pid_alive(int(legacy.group(2))):
                        f.unlink(missing_ok=True)
                    continue
                if f.suffix != ".chunk" or not f.stem.isdigit():
                    continue
                cid = (d.name, int(f.stem))
                seen.add(cid)
                if cid not in rows:
                    try:
                        st = f.stat()
                    except FileNotFoundError:
                        continue
                    db.execute("INSERT INTO chunks (hash, idx, size, used, owner) VALUES (?, ?, ?, ?, NULL)",
                               (cid[0], cid[1], st.st_size, st.st_mtime))
        gone = [cid for cid, owner in rows.items() if owner is None and cid not in seen]
        db.executemany("DELETE FROM chunks WHERE hash = ? AND idx = ? AND owner IS NULL", gone)


def _pid_alive(pid: int) -> bool:
    """For temp files named by versions before the shared index (`.<i>.chunk.<pid>.<tid>`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

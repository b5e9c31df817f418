"""A cartridge catalog in an object store: publish once, every host syncs it into its registry.

No shared filesystem: the S3 prefix is the source of truth and each host's SQLite registry stays
its own index. Layout under the catalog prefix (`s3://bucket/catalog/`):

    cartridges/<id>/<content_hash>/kv.bin, manifest.json   packed cartridges, never overwritten
    index/v000000000007.json                                every version of the index, immutable
    CURRENT                                                 {"version": 7}: a hint for readers

Atomicity, from a reader's point of view: a publisher uploads the cartridge (payload first, then
its manifest), then creates index version N+1 with `If-None-Match: *`, then moves `CURRENT`
(`If-Match` on the ETag it read). A reader sees either version N or N+1, never a half-written one
(a PUT is atomic), and only cartridges whose bytes are complete. Two concurrent publishers: both
try to create N+1, S3 lets exactly one succeed (412 for the other), the loser re-reads N+1 and
retries on top of it, so no update is lost and versions stay a line. `CURRENT` may lag a crashed
publisher; readers and publishers therefore also probe forward from it (`index/v<N+1>` ...).
Removal and `force_redownload` are new index versions too (the entry goes; its `epoch` goes up).
Old index versions and removed cartridges' bytes are left in place (hosts may still be reading
them); deleting them is an operator's lifecycle rule, not done here.

`CatalogSync` pulls the index into one host's registry every `period` seconds, calling
`registration.register_s3` for new or changed entries and removing entries that left the catalog
(only those this catalog added on this host: local registrations are never touched). Bound: a
change published at time t is in every live host's registry by t + period + one sync (a GET of
`CURRENT`, one or two of the index, and a manifest GET per changed entry), and served by its
plugins one `refresh_seconds` later. A missing or corrupt index keeps the last good state, with
one error log line per distinct problem.

Where it runs: `publish`/`unpublish` in the CLI (the operator's process); `CatalogSync` in a
daemon thread of the serving process (see `lmcache/catalog_sync.py`), one syncer per host and
catalog at a time (an `flock` under the cache dir), or in tests. It owns the catalog objects it
writes and, on each host, `cache_dir/catalog/<catalog hash>.json`: which registry entries it added.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, Field, ValidationError

from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME, PAYLOAD_NAME, validate_id
from lmcache_cartridge.cartridge.packed import PackedCartridge
from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.paths import atomic_write

logger = logging.getLogger("lmcache_cartridge.catalog")

FORMAT = "lmcache-cartridge-catalog/1"
POINTER = "CURRENT"
MAX_PROBE = 64          # index versions a reader walks forward from a lagging CURRENT
MAX_COMMIT_ATTEMPTS = 20


class CatalogError(CartridgeError):
    """The catalog cannot be read or written (missing, corrupt, contention, refused input)."""


class CatalogEntry(BaseModel):
    """One published cartridge as every host sees it."""

    uri: str                          # s3://bucket/catalog/cartridges/<id>/<content_hash>
    content_hash: str
    model: str
    kind: str
    num_tokens: int
    chunk_size: int
    labels: list[str] = Field(default_factory=list)
    epoch: int = 0                    # bumped by force_redownload
    published_at: float = 0.0


class CatalogIndex(BaseModel):
    format: str = FORMAT
    version: int = 0
    updated_at: float = 0.0
    entries: dict[str, CatalogEntry] = Field(default_factory=dict)


def _index_key(version: int) -> str:
    return f"index/v{version:012d}.json"


class _Catalog:
    """The catalog prefix through one `S3Origin` (its client, settings and error mapping)."""

    def __init__(self, catalog_uri: str, settings=None) -> None:
        from lmcache_cartridge.store.s3 import S3Origin

        self.origin = S3Origin(catalog_uri, settings)
        self.uri = self.origin.uri
        # S3Origin exposes reads only; conditional PUTs and boto3's transfer manager need its client.
        self.client = self.origin._client

    def close(self) -> None:
        self.origin.close()

    def get(self, suffix: str) -> tuple[bytes, str] | None:
        """(body, ETag), or None when the object does not exist."""
        from lmcache_cartridge.store.s3 import NotFound

        try:
            r = self.client.get_object(Bucket=self.origin.bucket, Key=self.origin.key(suffix))
            return r["Body"].read(), r["ETag"]
        except Exception as e:
            err = self.origin._map_error(e, suffix, "GET")
            if isinstance(err, NotFound):
                return None
            raise err from e

    def exists(self, suffix: str) -> bool:
        from lmcache_cartridge.store.s3 import NotFound

        try:
            self.origin.head(suffix)
            return True
        except NotFound:
            return False

    def put(self, suffix: str, body: bytes, *, if_match: str | None = None, create_only: bool = False) -> bool:
        """PUT; False when the precondition failed (412: someone else wrote first)."""
        from botocore.exceptions import ClientError

        kw = {}
        if create_only:
            kw["IfNoneMatch"] = "*"
        elif if_match:
            kw["IfMatch"] = if_match
        try:
            self.client.put_object(Bucket=self.origin.bucket, Key=self.origin.key(suffix), Body=body,
                                   ContentType="application/json", **kw)
            return True
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 412 or e.response.get("Error", {}).get("Code") in ("PreconditionFailed",
                                                                           "ConditionalRequestConflict"):
                return False
            raise self.origin._map_error(e, suffix, "PUT") from e
        except Exception as e:
            raise self.origin._map_error(e, suffix, "PUT") from e

    def upload(self, path: Path, suffix: str) -> None:
        """One file through boto3's transfer manager (multipart and parallel above part_size)."""
        from boto3.s3.transfer import TransferConfig

        s = self.origin.settings
        cfg = TransferConfig(multipart_threshold=s.part_size, multipart_chunksize=s.part_size,
                             max_concurrency=s.max_concurrency)
        try:
            self.client.upload_file(str(path), self.origin.bucket, self.origin.key(suffix), Config=cfg)
        except Exception as e:
            raise self.origin._map_error(e, suffix, "PUT") from e

    # --- the index -------------------------------------------------------------------------
    def pointer(self) -> tuple[int, str | None]:
        """(version CURRENT names, its ETag); (0, None) when there is none yet."""
        got = self.get(POINTER)
        if got is None:
            return 0, None
        try:
            version = int(json.loads(got[0])["version"])
        except (ValueError, KeyError, TypeError) as e:
            raise CatalogError(f"{self.uri}/{POINTER} is corrupt ({type(e).__name__}): {got[0][:80]!r}") from e
        return version, got[1]

    def read_version(self, version: int) -> CatalogIndex | None:
        got = self.get(_index_key(version))
        if got is None:
            return None
        try:
            index = CatalogIndex.model_validate_json(got[0])
        except ValidationError as e:
            raise CatalogError(f"{self.uri}/{_index_key(version)} is corrupt: "
                               f"{e.error_count()} problems, first: {e.errors()[0]['msg']}") from e
        if index.format != FORMAT or index.version != version:
            raise CatalogError(f"{self.uri}/{_index_key(version)} is not catalog version {version} "
                               f"of format {FORMAT} (format {index.format!r}, version {index.version})")
        return index

    def latest(self) -> tuple[CatalogIndex | None, str | None]:
        """The newest index (walking forward from CURRENT), and CURRENT's ETag."""
        version, etag = self.pointer()
        index = self.read_version(version) if version else None
        if version and index is None:
            raise CatalogError(f"{self.uri}/{POINTER} names version {version}, which is missing")
        for _ in range(MAX_PROBE):
            nxt = self.read_version((index.version if index else 0) + 1)
            if nxt is None:
                return index, etag
            index = nxt
        raise CatalogError(f"{self.uri}: more than {MAX_PROBE} index versions beyond {POINTER}")

    def commit(self, change: Callable[[CatalogIndex], None]) -> CatalogIndex:
        """Apply `change` to the newest index and create it as the next version (optimistic
        concurrency: retried on top of whoever won), then move CURRENT forward."""
        for attempt in range(MAX_COMMIT_ATTEMPTS):
            base, etag = self.latest()
            new = base.model_copy(deep=True) if base else CatalogIndex()
            change(new)
            new.version = (base.version if base else 0) + 1
            new.updated_at = time.time()
            if not self.put(_index_key(new.version), new.model_dump_json(indent=1).encode(), create_only=True):
                time.sleep(random.uniform(0.01, 0.05) * (attempt + 1))  # lost the race: rebase
                continue
            self._advance_pointer(new.version, etag)
            return new
        raise CatalogError(f"{self.uri}: could not commit after {MAX_COMMIT_ATTEMPTS} attempts (contention)")

    def _advance_pointer(self, version: int, etag: str | None) -> None:
        body = json.dumps({"version": version}).encode()
        for _ in range(MAX_COMMIT_ATTEMPTS):
            if self.put(POINTER, body, if_match=etag, create_only=etag is None):
                return
            current, etag = self.pointer()
            if current >= version:
                return  # a later publisher already moved it past us
        logger.warning("lmcache_cartridge catalog %s: could not move %s to %d (readers probe forward)",
                       self.uri, POINTER, version)


def _checked(packed_dir: str | Path) -> PackedCartridge:
    packed = PackedCartridge(packed_dir)
    report = packed.verify()
    if not report.ok:
        packed.close()
        raise CatalogError(f"{packed_dir} fails verification, not publishing it: {'; '.join(report.problems[:3])}")
    return packed


def publish(packed_dir: str | Path, catalog_uri: str, settings=None, *, labels=(),
            force_redownload: bool = False) -> CatalogEntry:
    """Upload a packed cartridge (verified first) into the catalog and add it to the index.

    Re-publishing the same bytes uploads nothing and only updates labels (and bumps `epoch` with
    `force_redownload`, which makes every host drop its cached copies and fetch it again); a
    re-packed cartridge under the same id gets a new `content_hash` prefix and replaces the entry.
    """
    cat = _Catalog(catalog_uri, settings)
    try:
        with _checked(packed_dir) as packed:
            m = packed.manifest
            cid = validate_id(m.cartridge_id)
            prefix = f"cartridges/{cid}/{m.content_hash}"
            if not cat.exists(f"{prefix}/{MANIFEST_NAME}"):
                cat.upload(packed.payload_path, f"{prefix}/{PAYLOAD_NAME}")
                cat.upload(Path(packed_dir) / MANIFEST_NAME, f"{prefix}/{MANIFEST_NAME}")  # last: marks it complete
            entry = CatalogEntry(uri=cat.origin.uri_of(prefix), content_hash=m.content_hash, model=m.model,
                                 kind=m.kind, num_tokens=m.num_tokens, chunk_size=m.chunk_size,
                                 labels=sorted(set(m.labels) | set(labels)), published_at=time.time())

        def change(index: CatalogIndex) -> None:
            old = index.entries.get(cid)
            if old is not None:
                entry.epoch = old.epoch + (1 if force_redownload else 0)
            index.entries[cid] = entry

        new = cat.commit(change)
        logger.info("lmcache_cartridge catalog %s: published %r (%s) as version %d", cat.uri, cid,
                    m.content_hash[:12], new.version)
        return new.entries[cid]
    finally:
        cat.close()


def unpublish(cartridge_id: str, catalog_uri: str, settings=None) -> int:
    """Remove a cartridge from the index (its bytes stay); returns the new index version."""
    cat = _Catalog(catalog_uri, settings)
    try:
        def change(index: CatalogIndex) -> None:
            if index.entries.pop(cartridge_id, None) is None:
                raise CatalogError(f"{cartridge_id!r} is not in catalog {cat.uri}")

        return cat.commit(change).version
    finally:
        cat.close()


def read_catalog(catalog_uri: str, settings=None) -> CatalogIndex | None:
    """The newest index, or None for a catalog nothing was ever published to."""
    cat = _Catalog(catalog_uri, settings)
    try:
        return cat.latest()[0]
    finally:
        cat.close()


# --- the host side --------------------------------------------------------------------------


@dataclass
class SyncReport:
    version: int | None = None
    added: list[str] = field(default_factory=list)       # registered or re-registered
    removed: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # id (or "index") -> why
    skipped: bool = False                                 # another process on this host syncs


class CatalogSync:
    """Pull one catalog into one host's registry, once (`sync_once`) or every `period` s (`start`).

    Runs in the serving process (a daemon thread) or the CLI. `registry` is a `Registry`;
    `cache_dir` is where `register_s3` keeps manifests and where this host's sync state lives.
    """

    def __init__(self, registry, catalog_uri: str, s3_settings=None, period: float = 30.0, *,
                 cache_dir: str | Path | None = None, chunk_size: int | None = None,
                 allow_uris: tuple[str, ...] = ()) -> None:
        from lmcache_cartridge.paths import default_cache_dir
        from lmcache_cartridge.store.s3 import parse_s3_uri

        bucket, prefix = parse_s3_uri(catalog_uri)
        self.catalog_uri = f"s3://{bucket}/{prefix}".rstrip("/")
        # Where an entry's bytes may be: the catalog's own bucket, and what the operator adds
        # (`catalog_allow_uris`): the catalog writer may name ids, not any bucket the host can read.
        self.allow_uris = (f"s3://{bucket}/", *(u.rstrip("/") + "/" for u in allow_uris))
        self.registry = registry
        self.settings = s3_settings
        self.period = float(period)
        if not self.period > 0:  # 0 or NaN would list the catalog in a busy loop
            raise ValueError(f"catalog_period must be a positive number of seconds, got {period!r}")
        self.chunk_size = chunk_size
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        tag = hashlib.sha256(self.catalog_uri.encode()).hexdigest()[:16]
        self._state_path = self.cache_dir / "catalog" / f"{tag}.json"
        self._lock_path = self.cache_dir / "catalog" / f"{tag}.lock"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_problem: dict[str, str] = {}
        self._cat: _Catalog | None = None  # one client for the life of the syncer
        self.last_good_version: int | None = self._load_state().get("version")

    # -- state: what this catalog added to this host's registry --
    def _load_state(self) -> dict:
        try:
            state = json.loads(self._state_path.read_text())
            return state if state.get("catalog") == self.catalog_uri else {}
        except (OSError, ValueError):
            return {}

    def _save_state(self, state: dict) -> None:
        atomic_write(self._state_path, json.dumps(state, indent=1))

    def _log_problem(self, key: str, msg: str) -> None:
        if self._last_problem.get(key) != msg:  # one line per distinct problem, not one per period
            logger.error("lmcache_cartridge catalog %s: %s", self.catalog_uri, msg)
            self._last_problem[key] = msg

    # -- one pass --
    def sync_once(self) -> SyncReport:
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return SyncReport(skipped=True)
            return self._sync_locked()

    def _sync_locked(self) -> SyncReport:
        from lmcache_cartridge.store.registration import register_s3

        report = SyncReport()
        state = self._load_state()
        try:
            if self._cat is None:
                self._cat = _Catalog(self.catalog_uri, self.settings)
            index = self._cat.latest()[0]
            if index is None:
                raise CatalogError("no catalog index (no CURRENT and no index/v000000000001.json)")
        except CartridgeError as e:
            report.errors["index"] = f"keeping the last good state (version {state.get('version')}): {e}"
            self._log_problem("index", report.errors["index"])
            return report
        self._last_problem.pop("index", None)
        ours: dict[str, dict] = state.get("entries", {})
        for cid, entry in sorted(index.entries.items()):
            want = {"uri": entry.uri, "epoch": entry.epoch, "labels": entry.labels}
            have = self.registry.get(cid)
            if cid not in ours and have is not None:
                self._log_problem(cid, f"not syncing {cid!r}: registered locally from {have.source_uri}; "
                                       "local registrations take precedence")
                report.errors[cid] = "registered locally"
                continue
            if ours.get(cid) == want and have is not None and have.source_uri == entry.uri \
                    and have.catalog == self.catalog_uri:  # (registered before entries recorded it: again)
                continue
            prev = ours.get(cid)
            force = prev is not None and entry.epoch > prev["epoch"] and have is not None
            try:
                validate_id(cid)
                if not (entry.uri.rstrip("/") + "/").startswith(self.allow_uris):
                    raise CatalogError(f"entry {cid!r}: {entry.uri[:200]} is outside the catalog's bucket "
                                       f"and the URIs allowed ({', '.join(self.allow_uris)})")
                # the key is the id: a manifest naming another id would register (and replace) that one
                register_s3(self.registry, entry.uri, self.cache_dir, self.settings, labels=entry.labels,
                            force_redownload=force, chunk_size=self.chunk_size, expect_id=cid,
                            catalog=self.catalog_uri)  # its claims yield to the operator's (`store.claims`)
            except CartridgeError as e:
                report.errors[cid] = str(e)
                self._log_problem(cid, f"cannot register {cid!r}: {e}")
                continue
            self._last_problem.pop(cid, None)
            ours[cid] = want
            report.added.append(cid)
        for cid in [c for c in ours if c not in index.entries]:
            have = self.registry.get(cid)
            if have is not None and have.source_uri == ours[cid]["uri"]:  # still the one we added
                self.registry.remove(cid)
                report.removed.append(cid)
            del ours[cid]
        self._save_state({"catalog": self.catalog_uri, "version": index.version, "entries": ours})
        self.last_good_version = report.version = index.version
        if report.added or report.removed:
            logger.info("lmcache_cartridge catalog %s: version %d: registered %s, removed %s",
                        self.catalog_uri, index.version, report.added or "-", report.removed or "-")
        return report

    # -- the thread --
    @property
    def running(self) -> bool:
        """Whether its thread is syncing (between `start` and `stop`)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "CatalogSync":
        self._thread = threading.Thread(target=self._run, name="cartridge-catalog-sync", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                self.sync_once()
            except Exception as e:  # never let the thread die: the next period retries
                self._log_problem("sync", f"sync failed ({type(e).__name__}): {e}")
            if self._stop.wait(self.period):
                return

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._cat is not None:
            self._cat.close()

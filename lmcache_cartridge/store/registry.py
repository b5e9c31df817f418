"""SQLite index of packed cartridges, shared by the CLI, the gateway and every serving process.

Who owns it: one database per host (`registry.db` under the cache root unless configured), owned
by that host's operator. Its writers are the CLI (`register`, `remove`, `label`), the gateway
(registering what a request names) and the catalog syncer (`store.catalog`, a thread of the
serving process); the plugins only read it. It indexes cartridge directories it does not own:
`remove` forgets a row and never deletes files.

WAL mode lets one writer and many readers work at once across processes. Readers notice other
processes' commits cheaply with `PRAGMA data_version`, which is how a running plugin picks up
`register`/`remove` without a restart. Every statement is parameterised.

Databases written before the always-"ready" `state` column was dropped still open: every
statement names its columns, and that column has a default.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from lmcache_cartridge.errors import CartridgeError, ManifestError
from lmcache_cartridge.cartridge.keys import client_kv_salt
from lmcache_cartridge.cartridge.manifest import Manifest, validate_id
from lmcache_cartridge.cartridge.packed import PackedCartridge
from lmcache_cartridge.paths import default_registry_path

SCHEMA = """
CREATE TABLE IF NOT EXISTS cartridges (
    id            TEXT PRIMARY KEY,
    path          TEXT NOT NULL,
    source_uri    TEXT NOT NULL,
    model         TEXT NOT NULL,
    kind          TEXT NOT NULL,
    num_layers    INTEGER NOT NULL,
    num_kv_heads  INTEGER NOT NULL,
    head_dim      INTEGER NOT NULL,
    dtype         TEXT NOT NULL,
    num_tokens    INTEGER NOT NULL,
    chunk_size    INTEGER NOT NULL,
    content_hash  TEXT NOT NULL,
    labels        TEXT NOT NULL DEFAULT '[]',
    added_at      REAL NOT NULL,
    epoch         INTEGER NOT NULL DEFAULT 0,
    salt          TEXT NOT NULL DEFAULT '',
    client        INTEGER NOT NULL DEFAULT 0,
    catalog       TEXT NOT NULL DEFAULT ''
);
"""
# columns added since the first schema: (name, definition), added to older databases on open
_ADDED_COLUMNS = (("salt", "TEXT NOT NULL DEFAULT ''"), ("client", "INTEGER NOT NULL DEFAULT 0"),
                  ("catalog", "TEXT NOT NULL DEFAULT ''"))


class RegistryError(CartridgeError):
    """The registry database cannot be used (locked, corrupt, unknown id, ...)."""


class IdTaken(RegistryError):
    """A registration would give an id that another origin holds to a new one: only an operator
    may do that (`register(..., replace_origin=True)`, the CLI's default)."""


class IdOutOfScope(RegistryError):
    """A registration for a client whose scope (a tenant's `ids`) does not include the id the
    manifest claims: a tenant cannot squat ids that another tenant's key names."""



@dataclass
class Entry:
    """One registry row. `path` is the packed directory serving reads from."""

    id: str
    path: str
    source_uri: str
    model: str
    kind: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_tokens: int
    chunk_size: int
    content_hash: str
    labels: list[str] = field(default_factory=list)
    added_at: float = 0.0
    epoch: int = 0  # bumped by force_redownload: servers drop cached copies of the old bytes
    # "" or `keys.client_kv_salt`: first-k KV a client brought (named by path or S3 URI in a
    # request, not registered by the operator) is keyed under this tag, so it reaches only
    # requests that name it: a manifest's ids are a claim nobody checked.
    salt: str = ""
    # registered for a client's request (the gateway), not by the operator (CLI, catalog): its
    # bytes may be evicted under the cache dir's budget (`store.cache_budget`)
    client: bool = False
    # the catalog (its s3:// URI) whose syncer registered it, "" for the operator's and clients'
    # registrations: a catalog's claims on chunk keys yield to the operator's (`store.claims`)
    catalog: str = ""

    @property
    def rank(self) -> int:
        """Whose registration it is, most trusted first: the operator's (0), a catalog's (1), a
        client's (2). Decides whose cartridge serves chunk keys several claim (`store.claims`)."""
        return 2 if self.client else 1 if self.catalog else 0


_COLUMNS = [f for f in Entry.__dataclass_fields__]


def _row_to_entry(row: tuple) -> Entry:
    d = dict(zip(_COLUMNS, row))
    d["labels"] = json.loads(d["labels"])
    d["client"] = bool(d["client"])
    return Entry(**d)


def _standing(previous: Entry, content_hash: str) -> tuple[bool, str]:
    """`(client, catalog)` of a registration a client's request makes of the origin `previous`
    was registered from: never more trusted than `previous` (`Entry.rank`). The very bytes the
    operator registered stay the operator's, the very bytes a catalog registered stay that
    catalog's (a client naming a catalog entry's URI must not lift it to the operator's
    precedence); other bytes, or an origin a client brought, are the client's."""
    if previous.client or previous.content_hash != content_hash:
        return True, previous.catalog
    return False, previous.catalog


def labelled(label: str, entries: list[Entry]) -> list[Entry]:
    """The entries `label` names: those carrying it of the most trusted rank that does
    (`Entry.rank`). A catalog's or a client's label never shadows, nor makes ambiguous, a
    label the operator gave: `demo` stays the operator's `demo`."""
    having = [e for e in entries if label in e.labels]
    top = min((e.rank for e in having), default=0)
    return [e for e in having if e.rank == top]


class Registry:
    """A connection to the registry. One per thread-owner; methods are serialised by a lock."""

    def __init__(self, path: str | Path | None = None, *, timeout: float = 10.0, create: bool = True) -> None:
        """`create=False` (read-only commands: `list`, `doctor`, ...): a registry that does not exist
        is an error naming the path, never a new empty one (a misspelled path would look empty)."""
        self.path = Path(path) if path else default_registry_path()
        if not create and not self.path.is_file():
            raise RegistryError(f"no cartridge registry at {self.path}: check the path (the `registry` setting "
                                "or --registry); registering a cartridge creates it")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.writes = 0  # statements this connection ran that change rows (tests count them)
        try:
            self._db = sqlite3.connect(str(self.path), timeout=timeout, check_same_thread=False,
                                       isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA busy_timeout=%d" % int(timeout * 1000))
            self._db.executescript(SCHEMA)
            have = {r[1] for r in self._db.execute("PRAGMA table_info(cartridges)").fetchall()}
            for name, definition in _ADDED_COLUMNS:
                if name not in have:
                    self._db.execute(f"ALTER TABLE cartridges ADD COLUMN {name} {definition}")
        except sqlite3.DatabaseError as e:
            raise RegistryError(f"cannot open cartridge registry {self.path}: {e}") from e

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _q(self, sql: str, params: tuple = (), *, write: bool = False) -> list[tuple]:
        with self._lock:
            try:
                self.writes += write
                return self._db.execute(sql, params).fetchall()
            except sqlite3.DatabaseError as e:
                raise RegistryError(f"cartridge registry {self.path}: {e}") from e

    def data_version(self) -> int:
        """Changes whenever another connection commits: the cheap 'anything new?' probe."""
        return int(self._q("PRAGMA data_version")[0][0])

    # --- writes ------------------------------------------------------------------------------
    def register(self, directory: str | Path, *, source_uri: str | None = None,
                 labels: list[str] | tuple[str, ...] = (), replace: bool = True,
                 force_redownload: bool = False, replace_origin: bool = True, client: bool = False,
                 may_claim: Callable[[str], bool] | None = None, expect_id: str | None = None,
                 catalog: str = "") -> Entry:
        """Index a packed cartridge directory (validated: manifest, and payload size if local).

        For an S3 cartridge `directory` holds only its manifest and `source_uri` is the
        `s3://` prefix the chunks are fetched from; for a composite (`store.composite`) it holds
        its manifest and parts list. Labels it had before are kept.

        The id is the manifest's own: whoever wrote the manifest chose it. `replace_origin=False`
        (what the gateway passes for cartridges its clients name) refuses an id already held by
        another origin (`IdTaken`), so a client cannot take over a name everyone else uses.
        `client=True` (the gateway, for what a request names): first-k KV is salted
        (`Entry.salt`) unless the operator registered these very bytes from this origin before.
        `may_claim` (the gateway, for a tenant's request): the ids that client may hold; another
        is `IdOutOfScope`, checked before the registry is read (whether it exists is not told).
        The manifest's labels it does not match are not registered.
        `expect_id` (a re-registration of an entry, e.g. for force_redownload): the manifest must
        still name that id; one rewritten to claim another is `IdTaken`, whatever `replace_origin`.
        `catalog`: the catalog whose syncer registers it (`Entry.catalog`).
        """
        from lmcache_cartridge.store.origins import first_k_segment_problem, has_payload

        directory = Path(directory).resolve()
        if source_uri and not has_payload(source_uri):
            m: Manifest = Manifest.load(directory)
        else:
            with PackedCartridge(directory) as packed:
                m = packed.manifest
        why = first_k_segment_problem(m, source_uri or "")
        if why:
            raise ManifestError(f"{directory}: {why}")
        if may_claim is not None and not may_claim(m.cartridge_id):
            raise IdOutOfScope(f"cartridge id {m.cartridge_id!r} (its manifest's) is outside the ids this key may "
                               "name: a tenant registers only ids its own patterns match")
        if expect_id is not None and m.cartridge_id != expect_id:
            raise IdTaken(f"{directory}: its manifest now names cartridge {m.cartridge_id!r}, not {expect_id!r} "
                          "(it changed after it was registered); a re-registration keeps its id")
        previous = self.get(m.cartridge_id)
        if previous is not None and not replace_origin and previous.source_uri != (source_uri or str(directory)):
            raise IdTaken(f"cartridge id {m.cartridge_id!r} is already registered from another origin; "
                          "replacing it is an operator's act (`lmcache-cartridge register`)")
        origin = source_uri or str(directory)
        same_origin = previous is not None and previous.source_uri == origin
        if client and same_origin:
            client, catalog = _standing(previous, m.content_hash)
        salt = client_kv_salt(m) if client and m.kind == "first_k" else ""
        epoch = (previous.epoch if previous else 0) + (1 if force_redownload else 0)
        # a manifest's labels are its writer's claims: for a tenant, only names its own ids' patterns
        # match (another tenant's label, or `prod-faq`, would answer requests for that name)
        claimed = {label for label in m.labels if may_claim is None or may_claim(label)}
        all_labels = sorted(claimed | set(labels) | set(previous.labels if previous else ()))
        entry = Entry(
            id=m.cartridge_id, path=str(directory), source_uri=source_uri or str(directory),
            model=m.model, kind=m.kind, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim, dtype=m.dtype, num_tokens=m.num_tokens, chunk_size=m.chunk_size,
            content_hash=m.content_hash, labels=all_labels,
            # when this origin was first registered under this id: the tie-break among the
            # operator's own claims (`store.claims`), which a re-registration does not reset
            added_at=previous.added_at if same_origin and previous.added_at else time.time(),
            epoch=epoch, salt=salt, client=client, catalog=catalog,
        )
        if not replace and previous is not None:
            raise RegistryError(f"cartridge {entry.id!r} is already registered")
        values = [getattr(entry, c) for c in _COLUMNS]
        values[_COLUMNS.index("labels")] = json.dumps(all_labels)
        values[_COLUMNS.index("client")] = int(client)
        placeholders = ",".join("?" for _ in _COLUMNS)
        self._q(f"INSERT OR REPLACE INTO cartridges ({','.join(_COLUMNS)}) VALUES ({placeholders})",
                tuple(values), write=True)
        return entry

    def remove(self, cartridge_id: str) -> bool:
        """Forget a cartridge (its files stay where they are). True if it was registered."""
        validate_id(cartridge_id)
        existed = self.get(cartridge_id) is not None
        self._q("DELETE FROM cartridges WHERE id = ?", (cartridge_id,), write=True)
        return existed

    def label(self, cartridge_id: str, add: list[str] = (), remove: list[str] = ()) -> Entry:
        entry = self.get(cartridge_id)
        if entry is None:
            raise RegistryError(f"no cartridge {cartridge_id!r} in {self.path}")
        labels = sorted((set(entry.labels) | set(add)) - set(remove))
        self._q("UPDATE cartridges SET labels = ? WHERE id = ?", (json.dumps(labels), cartridge_id), write=True)
        entry.labels = labels
        return entry

    # --- reads -------------------------------------------------------------------------------
    def get(self, cartridge_id: str) -> Entry | None:
        rows = self._q(f"SELECT {','.join(_COLUMNS)} FROM cartridges WHERE id = ?", (cartridge_id,))
        return _row_to_entry(rows[0]) if rows else None

    def resolve(self, id_or_label: str, visible=None) -> Entry:
        """An id, else the single cartridge carrying that label (`labelled`); ambiguity is an error.
        `visible(id)`: only such entries exist for this caller (a tenant's view)."""
        entry = self.get(id_or_label)
        if entry is not None and (visible is None or visible(entry.id)):
            return entry
        matches = labelled(id_or_label, [e for e in self.list() if visible is None or visible(e.id)])
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise RegistryError(f"no cartridge with id or label {id_or_label!r}")
        raise RegistryError(
            f"label {id_or_label!r} names {len(matches)} cartridges ({', '.join(e.id for e in matches)}); use an id"
        )

    def list(self) -> list[Entry]:
        rows = self._q(f"SELECT {','.join(_COLUMNS)} FROM cartridges ORDER BY id")
        return [_row_to_entry(r) for r in rows]

    def after(self, cartridge_id: str | None, batch: int = 256) -> Iterator[Entry]:
        """The entries whose id sorts after `cartridge_id` (None: all), in id order, read
        `batch` rows at a time: a reader that stops early has not loaded the rest."""
        while True:
            rows = self._q(f"SELECT {','.join(_COLUMNS)} FROM cartridges WHERE id > ? ORDER BY id LIMIT ?",
                           ("" if cartridge_id is None else cartridge_id, batch))
            yield from (_row_to_entry(r) for r in rows)
            if len(rows) < batch:
                return
            cartridge_id = rows[-1][_COLUMNS.index("id")]

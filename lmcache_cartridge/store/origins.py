"""Where a cartridge's bytes originally live: a local packed directory, an S3 prefix, or (for
cartridges served together as one KV head: trained ones, after a first-k one at position 0) a
composite whose chunks are its parts' chunks.

An origin only moves raw chunk bytes; verifying them and caching them is `residency`'s job.
Owned by the plugin (one per served cartridge); reads are thread-safe. Which origin a registry
entry gets is decided here alone, from its `source_uri` (`open_origin`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Protocol

from lmcache_cartridge.cartridge.manifest import PARTS_NAME, PAYLOAD_NAME, ChunkInfo, Span
from lmcache_cartridge.cartridge.packed import PackedCartridge


class Origin(Protocol):
    uri: str
    local: bool  # local origins are their own disk tier: nothing is copied to the disk cache
    bytes_read: int  # payload bytes this origin has returned (what a rank really reads)

    def read_into(self, info: ChunkInfo | Span, buf: memoryview) -> None:
        """Fill `buf` with the payload bytes a span (a rank's heads of a chunk, or a whole chunk)
        names: one `pread` or one ranged GET at its offset. Unverified: the caller checks them."""
        ...

    def close(self) -> None: ...


COMPOSITE = "composite:"        # composite:<dir>: every part is local
COMPOSITE_S3 = "composite+s3:"  # some part is read from S3: the opener passes S3 settings


def is_s3(uri: str) -> bool:
    """Does opening this origin need S3 settings?"""
    return uri.startswith(("s3://", COMPOSITE_S3))


def is_composite(uri: str) -> bool:
    return uri.startswith((COMPOSITE, COMPOSITE_S3))


def first_k_segment_problem(m, source_uri: str) -> str | None:
    """Why manifest `m` may not be read from `source_uri`, else None: a `first_k` segment (a
    document's own ids, unchecked and unsalted: `Manifest.composes_first_k`) only in a composite
    this host built from registered parts. The registry refuses to register it otherwise, and the
    plugin to serve it (a manifest can be swapped after its registration)."""
    if m.composes_first_k and not is_composite(source_uri):
        return ("a manifest with a first_k segment is only ever a composite this host built from registered "
                "parts (`store.composite`); it is neither registered nor served from another origin")
    return None


def has_payload(uri: str) -> bool:
    """Is the registered directory a full packed cartridge (manifest + kv.bin)?"""
    return not uri.startswith("s3://") and not is_composite(uri)


class LocalOrigin:
    local = True

    def __init__(self, directory: str | Path) -> None:
        self.packed = PackedCartridge(directory)
        self.uri = str(self.packed.directory)
        self.bytes_read = 0

    def read_into(self, info: ChunkInfo | Span, buf: memoryview) -> None:
        self.packed.read_span_into(info, buf)
        self.bytes_read += info.nbytes

    def close(self) -> None:
        self.packed.close()


class S3ChunkOrigin:
    local = False

    def __init__(self, uri: str, settings) -> None:
        from lmcache_cartridge.store.s3 import S3Origin

        self.uri = uri
        self.s3 = S3Origin(uri, settings)
        self.bytes_read = 0

    def read_into(self, info: ChunkInfo | Span, buf: memoryview) -> None:
        self.s3.read_range_into(PAYLOAD_NAME, info.offset, buf)
        self.bytes_read += info.nbytes

    def close(self) -> None:
        self.s3.close()  # its connection pool; a re-opened cartridge builds a new client


class CompositeOrigin:
    """Chunks of several cartridges in request order, every part whole chunks (`store.composite`
    writes the directory: a manifest whose chunks are the parts' chunks renumbered, and `parts.json`).
    Reading chunk i reads the part's own chunk: no byte is copied on disk."""

    def __init__(self, uri: str, directory: str | Path, s3_settings=None) -> None:
        import json

        from lmcache_cartridge.cartridge.manifest import Manifest

        self.uri = uri
        parts = json.loads((Path(directory) / PARTS_NAME).read_text(encoding="utf-8"))
        self._origins: list[Origin] = []
        self._chunks: list[tuple[Origin, ChunkInfo, int]] = []  # (part origin, part chunk, our offset)
        offset = 0
        try:
            for p in parts:
                origin = open_origin(p["source_uri"], p["path"], s3_settings)
                self._origins.append(origin)
                for c in Manifest.load(p["path"]).chunks:
                    self._chunks.append((origin, c, offset))
                    offset += c.nbytes
        except BaseException:
            self.close()
            raise
        self.local = all(o.local for o in self._origins)

    @property
    def bytes_read(self) -> int:
        return sum(o.bytes_read for o in self._origins)

    def read_into(self, info: ChunkInfo | Span, buf: memoryview) -> None:
        origin, part_info, ours = self._chunks[info.index]
        # the same bytes of the part's chunk as of ours (a composite's chunk is its part's chunk)
        origin.read_into(replace(info, index=part_info.index, offset=part_info.offset + info.offset - ours),
                         buf)

    def close(self) -> None:
        for o in self._origins:
            o.close()


def open_origin(source_uri: str, path: str, s3_settings=None) -> Origin:
    if is_composite(source_uri):
        return CompositeOrigin(source_uri, path, s3_settings)
    if source_uri.startswith("s3://"):
        return S3ChunkOrigin(source_uri, s3_settings)
    return LocalOrigin(path)


def load_registered(entry):
    """The manifest of a registry entry, checked as every server reads it before serving: it still
    holds what was registered (id and content hash), and a first_k segment of a trained manifest
    is only read from a composite origin (`first_k_segment_problem`). Raises `CartridgeError`.
    Shared by the in-process plugin and the MP-mode adapter (`lmcache.mp_adapter`)."""
    from lmcache_cartridge.cartridge.manifest import Manifest
    from lmcache_cartridge.errors import CartridgeError

    m = Manifest.load(entry.path)
    if m.cartridge_id != entry.id or m.content_hash != entry.content_hash:
        raise CartridgeError(f"{entry.path} no longer holds what was registered; re-register it")
    why = first_k_segment_problem(m, entry.source_uri)
    if why:
        raise CartridgeError(f"{entry.path}: {why}")
    return m

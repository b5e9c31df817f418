"""Where a cartridge's bytes originally live: a local packed directory or an S3 prefix.

An origin only moves raw chunk bytes; verifying them and caching them is `residency`'s job.
Owned by the plugin (one per served cartridge); reads are thread-safe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

from .errors import CartridgeError
from .manifest import MANIFEST_NAME, PAYLOAD_NAME, ChunkInfo, Manifest
from .packed import PackedCartridge


class Origin(Protocol):
    uri: str
    local: bool  # local origins are their own disk tier: nothing is copied to the disk cache

    def read_into(self, info: ChunkInfo, buf: memoryview,
                  on_data: Callable[[int, int], None] | None = None) -> None:
        """Fill `buf` with the chunk's payload bytes; tell `on_data(pos, n)` in order as bytes
        land (a retry starts again at 0), so a check can run while they arrive."""
        ...

    def close(self) -> None: ...


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


class LocalOrigin:
    local = True

    def __init__(self, directory: str | Path) -> None:
        self.packed = PackedCartridge(directory)
        self.uri = str(self.packed.directory)

    def read_into(self, info: ChunkInfo, buf: memoryview,
                  on_data: Callable[[int, int], None] | None = None) -> None:
        self.packed.read_raw_into(info.index, buf)
        if on_data is not None:
            on_data(0, info.nbytes)

    def close(self) -> None:
        self.packed.close()


class S3ChunkOrigin:
    local = False

    def __init__(self, uri: str, settings) -> None:
        from .s3 import S3Origin

        self.uri = uri
        self.s3 = S3Origin(uri, settings)

    def read_into(self, info: ChunkInfo, buf: memoryview,
                  on_data: Callable[[int, int], None] | None = None) -> None:
        self.s3.read_range_into(PAYLOAD_NAME, info.offset, buf, on_data=on_data)

    def close(self) -> None:
        self.s3.close()  # its connection pool; a re-opened cartridge builds a new client


def fetch_s3_manifest(uri: str, settings, into_dir: Path) -> Manifest:
    """Download and validate an S3 cartridge's manifest into `into_dir` (atomically)."""
    import json
    import os
    import tempfile

    from .s3 import S3Origin

    raw = S3Origin(uri, settings).get_manifest_bytes()
    try:
        manifest = Manifest.from_dict(json.loads(raw))
    except ValueError as e:
        raise CartridgeError(f"{uri}/{MANIFEST_NAME} is not valid JSON: {e}") from e
    into_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=into_dir, prefix=".manifest.")
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    os.replace(tmp, into_dir / MANIFEST_NAME)
    return manifest


def register_s3(registry, uri: str, cache_dir: Path, settings, *, labels=(), force_redownload: bool = False,
                chunk_size: int | None = None):
    """Register an S3 cartridge: fetch and validate its manifest; chunks are fetched on demand.

    Runs in the CLI or the gateway. The manifest lands in `cache_dir/manifests/<uri hash>`, the
    directory the registry entry points at; servers then read chunks from `uri`.
    """
    import hashlib

    from .s3 import parse_s3_uri

    bucket, prefix = parse_s3_uri(uri)
    uri = f"s3://{bucket}/{prefix}".rstrip("/")
    into = Path(cache_dir) / "manifests" / hashlib.sha256(uri.encode()).hexdigest()[:24]
    manifest = fetch_s3_manifest(uri, settings, into)
    if chunk_size and manifest.chunk_size != chunk_size:
        raise CartridgeError(
            f"{uri} was packed with chunk_size {manifest.chunk_size}, the server uses {chunk_size}: "
            f"re-pack it with `lmcache-cartridge pack --chunk-size {chunk_size}` and upload it again"
        )
    return registry.register(into, source_uri=uri, labels=list(labels), force_redownload=force_redownload)


def open_origin(source_uri: str, path: str, s3_settings=None) -> Origin:
    if is_s3(source_uri):
        return S3ChunkOrigin(source_uri, s3_settings)
    return LocalOrigin(path)

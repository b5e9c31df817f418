"""Where a cartridge's bytes originally live: a local packed directory or an S3 prefix.

An origin only moves raw chunk bytes; verifying them and caching them is `residency`'s job.
Owned by the plugin (one per served cartridge); reads are thread-safe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .errors import CartridgeError
from .manifest import MANIFEST_NAME, PAYLOAD_NAME, ChunkInfo, Manifest
from .packed import PackedCartridge


class Origin(Protocol):
    uri: str
    local: bool  # local origins are their own disk tier: nothing is copied to the disk cache

    def read_into(self, info: ChunkInfo, buf: memoryview) -> None: ...

    def close(self) -> None: ...


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


class LocalOrigin:
    local = True

    def __init__(self, directory: str | Path) -> None:
        self.packed = PackedCartridge(directory)
        self.uri = str(self.packed.directory)

    def read_into(self, info: ChunkInfo, buf: memoryview) -> None:
        self.packed.read_raw_into(info.index, buf)

    def close(self) -> None:
        self.packed.close()


class S3ChunkOrigin:
    local = False

    def __init__(self, uri: str, settings) -> None:
        from .s3 import S3Origin

        self.uri = uri
        self.s3 = S3Origin(uri, settings)

    def read_into(self, info: ChunkInfo, buf: memoryview) -> None:
        self.s3.read_range_into(PAYLOAD_NAME, info.offset, buf)

    def close(self) -> None:
        return None


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


def open_origin(source_uri: str, path: str, s3_settings=None) -> Origin:
    if is_s3(source_uri):
        return S3ChunkOrigin(source_uri, s3_settings)
    return LocalOrigin(path)

"""Where a cartridge's bytes originally live: a local packed directory or an S3 prefix.

An origin only moves raw chunk bytes; verifying them and caching them is `residency`'s job.
Owned by the plugin (one per served cartridge); reads are thread-safe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

from lmcache_cartridge.cartridge.manifest import PAYLOAD_NAME, ChunkInfo
from lmcache_cartridge.cartridge.packed import PackedCartridge


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
        from lmcache_cartridge.store.s3 import S3Origin

        self.uri = uri
        self.s3 = S3Origin(uri, settings)

    def read_into(self, info: ChunkInfo, buf: memoryview,
                  on_data: Callable[[int, int], None] | None = None) -> None:
        self.s3.read_range_into(PAYLOAD_NAME, info.offset, buf, on_data=on_data)

    def close(self) -> None:
        self.s3.close()  # its connection pool; a re-opened cartridge builds a new client


def open_origin(source_uri: str, path: str, s3_settings=None) -> Origin:
    if is_s3(source_uri):
        return S3ChunkOrigin(source_uri, s3_settings)
    return LocalOrigin(path)

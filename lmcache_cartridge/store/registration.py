"""Registering a cartridge that lives in S3: fetch and check its manifest, index it locally.

Runs in the CLI (`register s3://...`) and the gateway; the serving plugins then read chunks from
the S3 prefix on demand. Owns the manifest copies under `cache_dir/manifests/`.
"""

from __future__ import annotations

from pathlib import Path

from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME, Manifest
from lmcache_cartridge.errors import CartridgeError


def fetch_s3_manifest(uri: str, settings, into_dir: Path) -> Manifest:
    """Download and validate an S3 cartridge's manifest into `into_dir` (atomically)."""
    import json
    import os
    import tempfile

    from lmcache_cartridge.store.s3 import S3Origin

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

    from lmcache_cartridge.store.s3 import parse_s3_uri

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

"""Is a chunk's payload exactly what its manifest promised? A digest per chunk, plus a NaN/Inf scan.

Runs wherever bytes enter from outside (the plugin's first read of a chunk in a process, S3
downloads, disk-cache files, `verify`), on the thread that read the bytes. It owns nothing.

Which digest: the chunk's BLAKE3 when its manifest has one (`pack_kv` writes it), else its sha256
(manifests without per-chunk BLAKE3 digests). `manifest.whole_chunk_digest` is the one place that
decides; a read of some heads of a `by_head` chunk checks each head's own BLAKE3 (`Manifest.span`). Both are
cryptographic, so a reader that checks BLAKE3 gives the same guarantee as one that checks sha256,
at ~3x the speed here (one thread: ~5-6.6 GB/s against ~1.8; `benchmarks/integrity.py`); sha256
stays the chunk's identity (`content_hash` is made from the chunks' sha256) and `verify` checks
both. Hashing is single-threaded on purpose: it runs on vLLM's worker thread, bound to its core,
where BLAKE3's own threads would only compete with it (and, in production, with vLLM's).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import blake3 as _blake3
import numpy as np
import torch

from lmcache_cartridge.cartridge.manifest import ChunkInfo, Span, whole_chunk_digest
from lmcache_cartridge.errors import ChecksumError


def blake3_hex(data) -> str:
    """The per-chunk BLAKE3 digest `pack_kv` stores (default BLAKE3, 32 bytes, one thread)."""
    return _blake3.blake3(data).hexdigest()


Digest = tuple[str, Callable[[], Any], str]  # (name, new hasher, expected hex digest)
_HASHERS: dict[str, Callable[[], Any]] = {"blake3": _blake3.blake3, "sha256": hashlib.sha256}


def chunk_digest(info: ChunkInfo) -> Digest:
    name, expected = whole_chunk_digest(info)
    return name, _HASHERS[name], expected


def _every_digest(info: ChunkInfo) -> list[Digest]:
    """Every digest the manifest records for a chunk (`verify`: the identity is checked too)."""
    out: list[Digest] = [("sha256", hashlib.sha256, info.sha256)]
    if info.blake3 is not None:
        out.append(("blake3", _blake3.blake3, info.blake3))
    return out


def _span_of(info: ChunkInfo | Span) -> Span:
    if isinstance(info, Span):
        return info
    name, expected = whole_chunk_digest(info)
    return Span(info.index, info.offset, info.nbytes, info.num_tokens, ((info.nbytes, name, expected),))


def _checksum_error(info: ChunkInfo, where: str, digest: str) -> ChecksumError:
    return ChecksumError(f"{where}: chunk {info.index} checksum mismatch ({digest}: corrupted or replaced "
                         "bytes); re-pack or re-download the cartridge")


def _nonfinite_error(info: ChunkInfo, where: str) -> ChecksumError:
    return ChecksumError(f"{where}: chunk {info.index} contains NaN or Inf values; refusing to serve it")


# IEEE formats: a value is Inf or NaN exactly when its exponent bits are all ones. Read as integers
# of its width, the positive ones are the signed values >= `positive` (bf16: 0x7F80) and the
# negative ones the unsigned values >= `negative` (the same with the sign bit: 0xFF80): two max
# reductions over the same bytes, no temporary. numpy's SIMD max runs them at ~2.5 ms per 64 MiB
# here, where an AND and a max in torch took ~5.4 ms and `torch.isfinite(t).all()` ~200
# (`benchmarks/integrity.py`; a first hit's second-largest check after BLAKE3).
_NONFINITE_FROM = {
    torch.bfloat16: (np.int16, np.uint16, 0x7F80, 0xFF80),
    torch.float16: (np.int16, np.uint16, 0x7C00, 0xFC00),
    torch.float32: (np.int32, np.uint32, 0x7F800000, 0xFF800000),
}


def _all_finite(buf: memoryview, dtype: torch.dtype | None) -> bool:
    if dtype is None or not dtype.is_floating_point or len(buf) == 0:
        return True
    spec = _NONFINITE_FROM.get(dtype)
    if spec is None:
        return bool(torch.isfinite(torch.frombuffer(buf, dtype=dtype)).all())
    signed, unsigned, positive, negative = spec
    bits = np.frombuffer(buf, dtype=signed)
    return int(bits.max()) < positive and int(bits.view(unsigned).max()) < negative


def check_chunk(info: ChunkInfo | Span, buf: memoryview, where: str, dtype: torch.dtype | None = None,
                *, every_digest: bool = False) -> None:
    """Raise `ChecksumError` unless `buf` hashes to the manifest's digest for this chunk
    (`chunk_digest`; with `every_digest`, to each one it records, per-head ones included) or, for
    a `Span`, to each of its parts; and, given its dtype, holds only finite values (a packer
    elsewhere may have hashed NaNs)."""
    buf = memoryview(buf).cast("B")
    if every_digest and isinstance(info, ChunkInfo):
        for name, new, expected in _every_digest(info):
            if new(buf).hexdigest() != expected:
                raise _checksum_error(info, where, name)
        if info.heads:
            hb = info.nbytes // len(info.heads)
            for h, expected in enumerate(info.heads):
                if _blake3.blake3(buf[h * hb:(h + 1) * hb]).hexdigest() != expected:
                    raise _checksum_error(info, where, f"blake3 of head {h}")
    else:
        pos = 0
        for n, name, expected in _span_of(info).parts:
            if _HASHERS[name](buf[pos:pos + n]).hexdigest() != expected:
                raise _checksum_error(info, where, name)
            pos += n
    if not _all_finite(buf, dtype):
        raise _nonfinite_error(info, where)

"""Writing and reading packed cartridges (layout described in `manifest`).

Writers: `pack_kv` (CLI `pack`/`create`, registration-time re-chunking). Readers: the plugin and
the CLI, in any number of processes at once: payloads are immutable and read with `pread`, so
readers share no file position and need no locks.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from lmcache_cartridge.cartridge.buffers import as_bytes
from lmcache_cartridge.cartridge.integrity import blake3_hex, check_chunk
from lmcache_cartridge.paths import atomic_dir
from lmcache_cartridge.errors import CartridgeFormatError, ChecksumError, ManifestError
from lmcache_cartridge.cartridge.keys import placeholder_token_ids
from lmcache_cartridge.cartridge.manifest import (KINDS, LAYOUT_2LTD, LAYOUT_BY_HEAD, LAYOUTS, MANIFEST_NAME,
                                                  PAYLOAD_NAME, ChunkInfo, Manifest, Span, derive_content_hash,
                                                  dtype_name, validate_id)

DEFAULT_CHUNK_SIZE = 256


@dataclass(frozen=True)
class VocabInfo:
    """What placeholder ids may be drawn from (trained cartridges only)."""

    vocab_size: int
    special_ids: tuple[int, ...] = ()

    def as_record(self) -> dict:
        """What a trained manifest records (`Manifest.vocab`): enough to re-derive its ids."""
        return {"vocab_size": int(self.vocab_size), "special_ids": sorted({int(i) for i in self.special_ids})}

    @classmethod
    def from_record(cls, record: dict) -> "VocabInfo":
        return cls(int(record["vocab_size"]), tuple(record["special_ids"]))


# --- the payload layouts: the one place that knows how a chunk's bytes are ordered -------------
def to_chunk_layout(kv: torch.Tensor, start: int, end: int, layout: str = LAYOUT_BY_HEAD) -> torch.Tensor:
    """Canonical `[2, L, T, H, D]` tokens `[start, end)` -> one contiguous payload chunk:
    `[H, 2, L, t, D]` (`by_head`) or LMCache's `KV_2LTD` `[2, L, t, H*D]` (`2ltd`)."""
    two, layers, _, heads, dim = kv.shape
    part = kv[:, :, start:end]
    if layout == LAYOUT_BY_HEAD:
        return part.permute(3, 0, 1, 2, 4).contiguous()
    return part.reshape(two, layers, end - start, heads * dim).contiguous()


def payload_view(m: Manifest, num_tokens: int, heads: tuple[int, int], raw: torch.Tensor) -> torch.Tensor:
    """Payload bytes of KV heads `[start, end)` of a chunk, read in place as the `[2, L, t, end -
    start, D]` values of LMCache's `KV_2LTD` (a strided view, nothing copied). `raw` holds exactly
    what `Manifest.span(index, heads)` names: those heads (`by_head`: heads first, so the view is
    a permutation) or the whole chunk (`2ltd`: the view narrows the heads)."""
    start, end = heads
    src = raw.reshape(-1).view(torch.uint8).view(m.torch_dtype)
    if m.layout == LAYOUT_BY_HEAD:
        return src.view(end - start, 2, m.num_layers, num_tokens, m.head_dim).permute(1, 2, 3, 0, 4)
    return src.view(2, m.num_layers, num_tokens, m.num_kv_heads, m.head_dim)[:, :, :, start:end]


def payload_to_engine(m: Manifest, num_tokens: int, heads: tuple[int, int], raw: torch.Tensor,
                      out: torch.Tensor) -> None:
    """Payload bytes of KV heads `[start, end)` of a chunk -> LMCache's `KV_2LTD` for those heads
    (`out`: `[2, L, t, (end - start) * D]`, contiguous); `raw` as `payload_view` takes it."""
    src = payload_view(m, num_tokens, heads, raw)
    dst = out.reshape(-1).view(torch.uint8).view(src.dtype).view(src.shape)
    if m.layout == LAYOUT_BY_HEAD:
        for h in range(src.shape[3]):  # one head at a time: ~memcpy speed here, a 5-d permuted copy ~0.8x
            dst[:, :, :, h].copy_(src[:, :, :, h])
    else:
        dst.copy_(src)


def check_output_dir(out_dir: str | Path, overwrite: bool = False) -> None:
    """Refuse, before minutes of compute, an output directory `pack_kv` would then fail to write.

    `pack_kv` calls it first, and commands that compute before packing (`create`) call it before
    they compute: one rule. Probes rather than guessing from mode bits: `pack_kv` refuses an
    existing directory without `overwrite`, creates missing parents, and writes a temporary
    directory next to the output, so the nearest existing ancestor must be a directory this
    process can create a directory in (tried and removed at once; nothing else is created).
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise CartridgeFormatError(f"{out} already exists (use --overwrite to replace it)")
    ancestor = out.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise CartridgeFormatError(f"cannot write {out}: {ancestor} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=ancestor))
    except OSError as e:
        raise CartridgeFormatError(f"cannot write {out}: cannot create anything in {ancestor} ({e.strerror})") from None


def pack_kv(
    kv: torch.Tensor,
    out_dir: str | Path,
    *,
    cartridge_id: str,
    model: str,
    kind: str,
    token_ids: Sequence[int] | None = None,
    vocab: VocabInfo | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    dtype: torch.dtype | None = None,
    provenance: dict[str, Any] | None = None,
    labels: Iterable[str] = (),
    overwrite: bool = False,
    progress: bool = False,
    layout: str = LAYOUT_BY_HEAD,
) -> Manifest:
    """Write canonical KV `[2, L, T, H, D]` as a packed cartridge directory; return its manifest.

    `layout` is `by_head` (format 2, the default) or `2ltd` (format 1: what versions before it
    wrote, kept so that their cartridges can be made again for compatibility tests).

    First-k cartridges need their real `token_ids`. Trained ones get placeholder ids derived
    from the content hash, drawn from `vocab` (recorded in the manifest, so that every read
    re-derives them: `Manifest.check_placeholder_ids`); they cannot be given.
    The directory appears atomically: readers never see a half-written cartridge.
    """
    _check_request(kv, cartridge_id, kind, layout)
    if dtype is not None:
        kv = kv.to(dtype)
    kv = kv.contiguous()
    _, num_layers, num_tokens, num_heads, head_dim = kv.shape
    _check_kv(kv, kind, chunk_size, token_ids, vocab)

    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)
    with atomic_dir(out_dir, replace=True) as tmp:  # a finished cartridge or none, never half of one
        chunks = _write_payload(kv, tmp / PAYLOAD_NAME, chunk_size, layout,
                                f"pack {cartridge_id}" if progress else None)
        content_hash = _content_hash(kv, chunks, chunk_size)
        if kind == "trained":
            assert vocab is not None
            token_ids = placeholder_token_ids(content_hash, num_tokens, vocab.vocab_size, vocab.special_ids)
        manifest = Manifest(
            cartridge_id=cartridge_id,
            model=model,
            num_layers=num_layers,
            num_kv_heads=num_heads,
            head_dim=head_dim,
            dtype=dtype_name(kv.dtype),
            num_tokens=num_tokens,
            kind=kind,
            token_ids=[int(t) for t in token_ids],
            chunk_size=chunk_size,
            chunks=chunks,
            content_hash=content_hash,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            provenance=dict(provenance or {}),
            labels=sorted(set(labels)),
            vocab=vocab.as_record() if kind == "trained" else None,
            format_version=next(v for v, lay in LAYOUTS.items() if lay == layout),
            layout=layout,
        )
        manifest.validate()
        (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    return manifest


def _check_request(kv: torch.Tensor, cartridge_id: str, kind: str, layout: str) -> None:
    """What `pack_kv` is asked to write, before it looks at the KV's values."""
    validate_id(cartridge_id)
    if kind not in KINDS:
        raise CartridgeFormatError(f"kind must be one of {KINDS}, got {kind!r}")
    if layout not in LAYOUTS.values():
        raise CartridgeFormatError(f"layout must be one of {sorted(LAYOUTS.values())}, got {layout!r}")
    if kv.dim() != 5 or kv.shape[0] != 2:
        raise CartridgeFormatError(f"KV must be [2, L, T, H, D], got {tuple(kv.shape)}")


def _check_kv(kv: torch.Tensor, kind: str, chunk_size: int, token_ids: Sequence[int] | None,
              vocab: VocabInfo | None) -> None:
    """The KV (in the dtype it is packed in) and the ids and vocabulary that go with it."""
    num_tokens = kv.shape[2]
    if chunk_size <= 0:
        raise CartridgeFormatError(f"chunk_size must be positive, got {chunk_size}")
    if kind == "trained" and num_tokens % chunk_size:
        raise CartridgeFormatError(
            f"trained cartridge has {num_tokens} tokens, not a multiple of chunk_size {chunk_size}: "
            f"LMCache loads only full chunks and would recompute the last {num_tokens % chunk_size} "
            f"from meaningless placeholder tokens. Train {num_tokens - num_tokens % chunk_size} or "
            f"{num_tokens + chunk_size - num_tokens % chunk_size} tokens instead."
        )
    if not torch.isfinite(kv).all():
        raise CartridgeFormatError("KV contains NaN or Inf values; refusing to pack it")
    if kind == "first_k" and token_ids is None:
        raise CartridgeFormatError("a first_k cartridge needs the token ids its KV was computed from")
    if token_ids is not None and len(token_ids) != num_tokens:
        raise CartridgeFormatError(f"{len(token_ids)} token ids for {num_tokens} KV tokens")
    if kind == "trained" and vocab is None:
        raise CartridgeFormatError(
            "a trained cartridge needs the model's vocabulary to draw placeholder token ids: "
            "pass --model DIR (or --vocab-size N)"
        )
    if kind == "trained" and token_ids is not None:
        raise CartridgeFormatError("a trained cartridge's token ids are derived from its KV, never given")


def _write_payload(kv: torch.Tensor, path: Path, chunk_size: int, layout: str,
                   progress: str | None) -> list[ChunkInfo]:
    """Write `kv`'s chunks in `layout` to `path`, one after another; their records, digests
    included. `progress`: the label of a progress bar, None for none."""
    num_tokens, num_heads = kv.shape[2], kv.shape[3]
    chunks: list[ChunkInfo] = []
    offset = 0
    starts = range(0, num_tokens, chunk_size)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc=progress, unit="chunk")
    with open(path, "wb") as f:
        for i, start in enumerate(starts):
            end = min(start + chunk_size, num_tokens)
            chunk = to_chunk_layout(kv, start, end, layout)
            data = as_bytes(chunk)
            f.write(data)
            heads = [blake3_hex(as_bytes(chunk[h])) for h in range(num_heads)] \
                if layout == LAYOUT_BY_HEAD else None
            chunks.append(ChunkInfo(i, offset, len(data), end - start, hashlib.sha256(data).hexdigest(),
                                    blake3_hex(data), heads))
            offset += len(data)
    return chunks


def _content_hash(kv: torch.Tensor, chunks: list[ChunkInfo], chunk_size: int) -> str:
    return derive_content_hash(list(kv.shape), kv.dtype, chunk_size, chunks)


@dataclass
class VerifyReport:
    ok: bool
    problems: list[str] = field(default_factory=list)
    chunks_checked: int = 0


class PackedCartridge:
    """Read access to one packed cartridge directory. Cheap to open; holds one fd lazily.

    Thread-safe for reads (pread). Owned by whoever opened it; `close()` releases the fd.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.manifest = Manifest.load(self.directory)
        self.payload_path = self.directory / self.manifest.payload
        try:
            size = self.payload_path.stat().st_size
        except FileNotFoundError:
            raise ManifestError(f"{self.payload_path}: payload missing") from None
        if size != self.manifest.payload_nbytes:
            raise ManifestError(
                f"{self.payload_path}: payload is {size} bytes, manifest says "
                f"{self.manifest.payload_nbytes} (truncated or replaced?)"
            )
        self._fd: int | None = None

    def _fileno(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.payload_path, os.O_RDONLY)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "PackedCartridge":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chunk_shape(self, index: int) -> tuple[int, int, int, int]:
        return self.manifest.chunk_shape(self.manifest.chunks[index].num_tokens)

    def read_span_into(self, span: ChunkInfo | Span, buf: memoryview) -> None:
        """The payload bytes a span (or a whole chunk) names into `buf` (exactly that size),
        unverified: one `pread` loop at the span's offset."""
        if buf.nbytes != span.nbytes:
            raise ValueError(f"buffer of {buf.nbytes} bytes for a read of {span.nbytes}")
        fd, done = self._fileno(), 0
        while done < span.nbytes:
            n = os.preadv(fd, [buf[done:]], span.offset + done)
            if n <= 0:
                raise ManifestError(f"{self.payload_path}: unexpected end of payload in chunk {span.index}")
            done += n

    def read_raw_into(self, index: int, buf: memoryview) -> None:
        """Chunk `index`'s payload bytes (in the payload's layout) into `buf`, unverified."""
        self.read_span_into(self.manifest.chunks[index], buf)

    def read_raw(self, index: int, *, verify: bool = True, every_digest: bool = False) -> torch.Tensor:
        """Chunk `index`'s payload bytes (flat uint8, the payload's layout), checked against its
        reading digest (`integrity.chunk_digest`), or every digest it records."""
        info = self.manifest.chunks[index]
        raw = torch.empty(info.nbytes, dtype=torch.uint8)
        buf = as_bytes(raw)
        self.read_raw_into(index, buf)
        if verify:
            check_chunk(info, buf, str(self.payload_path), every_digest=every_digest)
        return raw

    def read_chunk(self, index: int, *, verify: bool = True, every_digest: bool = False) -> torch.Tensor:
        """Chunk `index` in LMCache's `KV_2LTD` `[2, L, t, H*D]`, whatever the payload's layout."""
        m = self.manifest
        raw = self.read_raw(index, verify=verify, every_digest=every_digest)
        if m.layout == LAYOUT_2LTD:
            return raw.view(m.torch_dtype).view(self.chunk_shape(index))
        out = torch.empty(self.chunk_shape(index), dtype=m.torch_dtype)
        payload_to_engine(m, m.chunks[index].num_tokens, (0, m.num_kv_heads), raw, out)
        return out

    def load_kv(self, *, verify: bool = True) -> torch.Tensor:
        """The whole cartridge in canonical `[2, L, T, H, D]`."""
        m = self.manifest
        parts = [self.read_chunk(i, verify=verify) for i in range(len(m.chunks))]
        kv = torch.cat(parts, dim=2)
        return kv.reshape(2, m.num_layers, m.num_tokens, m.num_kv_heads, m.head_dim)

    def verify(self) -> VerifyReport:
        """Recompute every checksum (sha256 and, where recorded, BLAKE3) and look for NaN/Inf;
        never raises for bad content."""
        report = VerifyReport(ok=True)
        for i in range(len(self.manifest.chunks)):
            try:
                chunk = self.read_chunk(i, verify=True, every_digest=True)
            except (ChecksumError, ManifestError) as e:
                report.problems.append(str(e))
                continue
            finally:
                report.chunks_checked += 1
            if not torch.isfinite(chunk).all():
                report.problems.append(f"chunk {i} contains NaN or Inf values")
        report.ok = not report.problems
        return report


def rechunk(src: PackedCartridge, out_dir: str | Path, chunk_size: int, *, overwrite: bool = False) -> Manifest:
    """Re-pack a cartridge to another chunk size, keeping its id, kind, a first-k cartridge's
    token ids and a trained one's vocabulary (its placeholder ids follow its new chunks' hash).

    Trained cartridges must still be a whole number of chunks; `pack_kv` refuses otherwise.
    """
    m = src.manifest
    trained = m.kind == "trained"
    return pack_kv(
        src.load_kv(verify=True),
        out_dir,
        cartridge_id=m.cartridge_id,
        model=m.model,
        kind=m.kind,
        token_ids=None if trained else m.token_ids,
        vocab=VocabInfo.from_record(m.vocab) if trained else None,
        chunk_size=chunk_size,
        provenance={**m.provenance, "rechunked_from": m.chunk_size},
        labels=m.labels,
        overwrite=overwrite,
    )

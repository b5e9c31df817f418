"""A composite's manifest: what `composite_manifest` makes of parts in order, and the check that
a manifest with a first-k segment is exactly that (`check_composite`). Pure manifest logic (no
registry, no origin): the cartridge layer reads it when a manifest is loaded; `store.composite`
registers composites with it. The composition rule itself is described in `store.composite`.
"""

from __future__ import annotations

import hashlib
import json
from contextvars import ContextVar
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from lmcache_cartridge.cartridge.manifest import ChunkInfo, Manifest
from lmcache_cartridge.errors import CartridgeError, ManifestError

PARTS_NAME = "parts.json"  # beside a composite's manifest: its parts' directories, in order

_SAME = ("model", "num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_size", "layout")


def _identity(m: Manifest) -> str:
    """What makes a part this part: its bytes, and for a first-k part also its token ids (its
    content hash covers the KV only; a trained part's ids are derived from its content hash)."""
    if m.kind == "trained":
        return m.content_hash
    return m.content_hash + ":" + hashlib.sha256(json.dumps(m.token_ids).encode()).hexdigest()


def composite_manifest(parts: list[Manifest], context_ids: list[int] | tuple[int, ...] = ()) -> Manifest:
    """The manifest of `parts` served in this order after `context_ids`; an error names the first
    disagreement."""
    context_ids = [int(t) for t in context_ids]
    if len(parts) < (1 if context_ids else 2) or not any(p.kind == "trained" for p in parts):
        raise CartridgeError("a composite needs a trained cartridge and another cartridge or context tokens")
    first = parts[0]
    for p in parts:
        if p.kind not in ("trained", "first_k"):
            raise CartridgeError(f"{p.cartridge_id!r} is {p.kind}: it has no KV to compose")
        if p.num_tokens % p.chunk_size:
            raise CartridgeError(f"{p.cartridge_id!r} has {p.num_tokens} tokens, not whole chunks of "
                                 f"{p.chunk_size}: a composite's parts must be whole chunks")
        for f in _SAME:
            if getattr(p, f) != getattr(first, f):
                raise CartridgeError(
                    f"cartridges {first.cartridge_id!r} and {p.cartridge_id!r} cannot be served together: "
                    f"{f} {getattr(first, f)!r} vs {getattr(p, f)!r}")
    vocabs = {json.dumps(p.vocab, sort_keys=True) for p in parts if p.kind == "trained"}
    if len(vocabs) != 1:
        raise CartridgeError(f"trained parts {[p.cartridge_id for p in parts]} drew their placeholder ids "
                             "from different vocabularies")
    chunks: list[ChunkInfo] = []
    offset = 0
    for p in parts:
        for c in p.chunks:
            chunks.append(replace(c, index=len(chunks), offset=offset))
            offset += c.nbytes
    identity = "composite:" + ",".join(_identity(p) for p in parts)
    if context_ids:  # the same parts after other tokens are another composite (other keys)
        identity += ";after:" + hashlib.sha256(json.dumps(context_ids).encode()).hexdigest()
    digest = hashlib.sha256(identity.encode()).hexdigest()
    m = replace(
        first, cartridge_id=f"composite-{digest[:24]}", kind="trained", num_tokens=sum(p.num_tokens for p in parts),
        token_ids=[t for p in parts for t in p.token_ids], chunks=chunks, content_hash="",
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        provenance={"composite_of": [p.cartridge_id for p in parts],
                    "content_hashes": [p.content_hash for p in parts]},
        labels=[], context_ids=context_ids, vocab=json.loads(vocabs.pop()),
        segments=[s for p in parts for s in (p.segments or [[p.kind, p.num_tokens]])])
    m.content_hash = m.derived_content_hash()  # its bytes are the parts' bytes: their hash, as any cartridge's
    m.validate()
    return m


_CHECKING: ContextVar[frozenset[str]] = ContextVar("lmcache_cartridge_composite_checking", default=frozenset())


def check_composite(m: Manifest, directory: str | Path | None) -> None:
    """Refuse `m`, a manifest whose segments name a first-k part (`Manifest.composes_first_k`),
    unless it is exactly what `composite_manifest` makes of the parts `parts.json` beside it
    lists: same id, token ids, segments and content hash (so the same chunk digests). Then each
    first-k segment's ids and KV are a first-k cartridge's own, read (and checked) from where
    that part lives, and `register_composite` composes registered, unsalted parts only.

    A manifest written anywhere else (a client's directory or S3 prefix, a catalog entry) has no
    `parts.json`, or one naming a first-k part that nobody registered as the operator's: the
    first case is refused here, the second by the plugin, which serves a composed first-k
    segment only from a composite origin (`lmcache.plugin`, `origins.is_composite`)."""
    where = f"manifest {m.cartridge_id!r}" + (f" in {directory}" if directory is not None else "")
    listing_path = Path(directory) / PARTS_NAME if directory is not None else None
    if listing_path is None or not listing_path.is_file():
        raise ManifestError(
            f"{where} has a first_k segment but is not a composite made by this host (no {PARTS_NAME} "
            "beside it): a first-k part's ids are nobody's checked claim, so only the gateway composes "
            "them, from registered first-k cartridges. Serve first-k KV as a first_k cartridge")
    here = str(Path(directory).resolve())
    checking = _CHECKING.get()
    if here in checking:
        raise ManifestError(f"{where}: its {PARTS_NAME} lists the composite itself")
    token = _CHECKING.set(checking | {here})
    try:
        listing = json.loads(listing_path.read_text(encoding="utf-8"))
        if not isinstance(listing, list) or not all(isinstance(p, dict) and isinstance(p.get("path"), str)
                                                    for p in listing):
            raise ManifestError(f"{where}: {PARTS_NAME} is not a list of parts with paths")
        want = composite_manifest([Manifest.load(p["path"]) for p in listing], m.context_ids)
    except ManifestError:
        raise
    except (OSError, ValueError, CartridgeError) as e:
        raise ManifestError(f"{where}: not the composite of the parts its {PARTS_NAME} lists: {e}") from None
    finally:
        _CHECKING.reset(token)
    if (want.cartridge_id, want.content_hash, want.token_ids, want.segments) \
            != (m.cartridge_id, m.content_hash, m.token_ids, m.segments):
        raise ManifestError(f"{where} is not the composite of the parts its {PARTS_NAME} lists "
                            f"({want.cartridge_id}): its ids, segments or chunks differ from theirs")

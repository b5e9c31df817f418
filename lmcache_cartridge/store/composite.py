"""Several cartridges' KV served as one, as the Cartridges paper composes trained cartridges.

Composition rule (arXiv 2506.06266, "composing cartridges"): the parts' KV tensors are
concatenated in request order, each part keeping the positions it was trained at (its keys are
already rotated), and the user's tokens start after the total length. A first-k part may lead
the composite (the gateway puts one only where its KV is exact: at position 0), so its KV too is
at the positions it was computed at. For LMCache the composite is one more trained cartridge:
its token ids are the parts' ids in order (real ids, then placeholder ids), so its chained chunk
keys differ from the parts' own keys after the first part, and each of its chunks is a part's
chunk (every part is whole chunks: trained ones always, first-k ones are required to be). No KV
byte is copied: the composite's directory holds a manifest and `parts.json`, and
`store.origins.CompositeOrigin` reads each chunk from its part's origin.

After tokens the engine computes (a token-only cartridge, a first-k one that is not exact where
it sits, tokens between trained ones), a run of parts is a composite with `context_ids`: the ids
before it, whole chunks. Its chunk keys are chained over them (LMCache keys a chunk by every
token before it), its KV is only the parts'; the context's chunks are computed by the engine
and kept by LMCache (the gateway's priming request stores them). Such a composite may have one
part: the same trained cartridge after other tokens has other keys.

Runs in the gateway (or any registering process); the composite directory under
`cache_dir/composites/` is owned by whoever made it, the plugin only reads it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME, PARTS_NAME, Manifest, composite_manifest
from lmcache_cartridge.errors import CartridgeError, ManifestError
from lmcache_cartridge.paths import atomic_dir
from lmcache_cartridge.store.origins import COMPOSITE, COMPOSITE_S3, is_s3
from lmcache_cartridge.store.registry import Entry

def register_composite(registry, parts: list[tuple[Entry, Manifest]], cache_dir: Path,
                       context_ids: list[int] | tuple[int, ...] = ()) -> tuple[Entry, Manifest]:
    """Write (once) and register the composite of `parts`, in this order, after `context_ids`.

    Never of a part a client brought under its salt (`Entry.salt`): the composite is keyed
    without one, so that KV would reach requests that never named it (the resolver never asks
    for it; a recipe in a request's kv_transfer_params, `ensure_composite`, might)."""
    salted = [e.id for e, _ in parts if e.salt]
    if salted:
        raise CartridgeError(f"cartridges {salted} are KV a client brought, served only to requests that "
                             "name them (under their salt): never part of a composite")
    manifest = composite_manifest([m for _, m in parts], context_ids)
    listing = [{"id": e.id, "source_uri": e.source_uri, "path": e.path} for e, _ in parts]
    # named by what it is (its id: the parts and the context ids before them), its bytes, AND
    # where the parts are read from: a part moved elsewhere gets a new one, and so do the same
    # parts after other tokens (other keys)
    where = hashlib.sha256(json.dumps([manifest.cartridge_id, manifest.content_hash, listing]).encode()).hexdigest()
    directory = Path(cache_dir) / "composites" / where[:32]
    scheme = COMPOSITE_S3 if any(is_s3(e.source_uri) for e, _ in parts) else COMPOSITE
    uri = scheme + str(directory)
    existing = registry.get(manifest.cartridge_id)
    if (directory / MANIFEST_NAME).is_file():
        try:
            made = Manifest.load(directory)
            if made.cartridge_id != manifest.cartridge_id:
                raise ManifestError(f"{directory} holds {made.cartridge_id}")  # named by an older version
            if existing is not None and existing.source_uri == uri:
                return existing, made
        except ManifestError:  # written by an older version (no placeholder vocab, named otherwise): again
            shutil.rmtree(directory, ignore_errors=True)
    with atomic_dir(directory) as tmp:  # made meanwhile by another request: same content by construction, kept
        (tmp / PARTS_NAME).write_text(json.dumps(listing, indent=1), encoding="utf-8")
        (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    return registry.register(directory, source_uri=uri), Manifest.load(directory)


# --- the same composite on another host --------------------------------------------------------
# In a fleet the gateway's registry is not the instances': each host has its own, synced from the
# S3 catalog. So the gateway sends each composite's recipe with the request (kv_transfer_params
# `vllm.composites.COMPOSE_PARAM`), and the instance's scheduler builds the same composite in its
# own host's registry from its own entries of the parts (`ensure_composite`). The id is a function
# of the parts' bytes and the context ids, so both hosts name it alike.

def recipe(parts: list[Entry], start: int) -> dict:
    """The wire form of one composite: its parts (id and content hash, in order) and where it
    starts in the prompt (its context ids are the prompt's first `start` ids)."""
    return {"parts": [[e.id, e.content_hash] for e in parts], "start": int(start)}


def ensure_composite(registry, wire: dict, prompt_ids: list[int], cache_dir: Path) -> Entry:
    """The composite `wire` describes, registered in `registry` if this host lacks it; parts are
    this host's entries of the same ids with the same bytes. Raises `CartridgeError` saying what
    is missing (the request then waits on the instance and fails cleanly, never recomputed)."""
    try:
        start = int(wire["start"])
        named = [(str(i), str(h)) for i, h in wire["parts"]]
    except (KeyError, TypeError, ValueError) as e:
        raise CartridgeError(f"malformed composite recipe {wire!r}: {e}") from None
    if not 0 <= start <= len(prompt_ids) or not named:
        raise CartridgeError(f"composite recipe {wire!r} does not fit a prompt of {len(prompt_ids)} tokens")
    parts: list[tuple[Entry, Manifest]] = []
    for cid, content_hash in named:
        e = registry.get(cid)
        if e is None or e.content_hash != content_hash:
            raise CartridgeError(f"composite part {cid!r} ({content_hash[:12]}) is not registered on this host"
                                 + ("" if e is None else f" (this host has {e.content_hash[:12]})"))
        parts.append((e, Manifest.load(e.path)))
    context = [int(t) for t in prompt_ids[:start]]
    want = composite_manifest([m for _, m in parts], context)
    have = registry.get(want.cartridge_id)
    if have is not None and have.content_hash == want.content_hash:
        return have  # made on this host already (by this instance, or a gateway sharing the registry)
    return register_composite(registry, parts, cache_dir, context)[0]

"""A manifest is someone else's file: its content hash (the CPU tier's key, disk-cache file
names) is derived from its chunk digests on every load, never taken from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import random_kv
from lmcache_cartridge.cartridge.manifest import (MANIFEST_NAME, PAYLOAD_NAME, Manifest, derive_content_hash,
                                                  legacy_content_hash)
from lmcache_cartridge.cartridge.keys import placeholder_token_ids
from lmcache_cartridge.cartridge.packed import PackedCartridge, VocabInfo, pack_kv
from lmcache_cartridge.errors import CartridgeError, ManifestError


def _pack(tmp_path, name, seed):
    return pack_kv(random_kv(2, 64, 2, 8, seed=seed), tmp_path / name, cartridge_id=name, model="m",
                   kind="first_k", token_ids=list(range(1, 65)), chunk_size=32)


def _edit(directory, change) -> None:
    d = json.loads((directory / MANIFEST_NAME).read_text())
    change(d)
    (directory / MANIFEST_NAME).write_text(json.dumps(d))


def test_a_claimed_content_hash_is_refused(tmp_path):
    victim, forger = _pack(tmp_path, "victim", 1), _pack(tmp_path, "forger", 2)
    _edit(tmp_path / "forger", lambda d: d.update(content_hash=victim.content_hash))
    with pytest.raises(ManifestError, match="not the hash of its chunks"):
        Manifest.load(tmp_path / "forger")
    for bad in ("../../../etc/x", "A" * 64, ""):  # also a path component of the disk cache
        _edit(tmp_path / "forger", lambda d: d.update(content_hash=bad))  # noqa: B023 (called here)
        with pytest.raises(ManifestError, match="not the hash of its chunks"):
            PackedCartridge(tmp_path / "forger")
    assert forger.content_hash != victim.content_hash


def test_victims_sha256s_with_other_blake3s_get_another_identity(tmp_path):
    """Reads verify BLAKE3: a manifest copying the victim's sha256s (and so its old, sha256-only
    content hash) over its own bytes' BLAKE3s loads under an identity of its own."""
    victim, _ = _pack(tmp_path, "victim", 1), _pack(tmp_path, "forger", 2)
    v = json.loads((tmp_path / "victim" / MANIFEST_NAME).read_text())

    def copy_sha(d):
        for mine, theirs in zip(d["chunks"], v["chunks"]):
            mine["sha256"] = theirs["sha256"]
        m = Manifest.load(tmp_path / "victim")
        d["content_hash"] = m.derived_content_hash(legacy_content_hash)  # the sha256-only hash

    _edit(tmp_path / "forger", copy_sha)
    forged = Manifest.load(tmp_path / "forger")
    assert forged.derived_content_hash(legacy_content_hash) == victim.derived_content_hash(legacy_content_hash)
    assert forged.content_hash != victim.content_hash


def test_a_manifest_packed_before_blake3_counted_loads_under_the_derived_hash(tmp_path):
    m = _pack(tmp_path, "old", 3)
    legacy = m.derived_content_hash(legacy_content_hash)
    _edit(tmp_path / "old", lambda d: d.update(content_hash=legacy))
    assert Manifest.load(tmp_path / "old").content_hash == m.content_hash != legacy


# --- placeholder ids: derived from the KV, never taken from the manifest ----------------------
VOCAB = VocabInfo(1000, (0, 1, 2))


def _trained(tmp_path, name, seed, vocab=VOCAB, chunk=32):
    return pack_kv(random_kv(2, 64, 2, 8, seed=seed), tmp_path / name, cartridge_id=name, model="m",
                   kind="trained", vocab=vocab, chunk_size=chunk)


def test_trained_ids_claiming_a_prompt_or_another_cartridge_are_refused(tmp_path):
    """Trained KV keyed by the ids of a prompt people send (or of another trained cartridge) would
    be served to requests that never named it: LMCache keys depend on token ids only."""
    victim = _trained(tmp_path, "victim", 1)
    m = _trained(tmp_path, "forger", 2)
    assert Manifest.load(tmp_path / "forger").token_ids == m.token_ids  # its own ids load
    for claimed in (list(range(100, 164)), victim.token_ids, m.token_ids[::-1]):
        _edit(tmp_path / "forger", lambda d: d.update(token_ids=claimed))  # noqa: B023 (called here)
        with pytest.raises(ManifestError, match="not the placeholder ids of its content hash"):
            Manifest.load(tmp_path / "forger")
    # a forger that also copies the victim's hash is caught by the content hash, as before
    _edit(tmp_path / "forger", lambda d: d.update(token_ids=victim.token_ids, content_hash=victim.content_hash))
    with pytest.raises(ManifestError, match="not the hash of its chunks"):
        Manifest.load(tmp_path / "forger")


def test_trained_ids_from_a_vocabulary_too_small_to_be_unsteerable_are_refused(tmp_path):
    """Ids drawn from two candidates in chunks of 32 carry 32 bits: 2^32 packings find a chunk of
    any two-token prompt. The vocabulary recorded must leave MIN_PLACEHOLDER_BITS per chunk."""
    m = _trained(tmp_path, "c", 3)
    small = {"vocab_size": 1000, "special_ids": list(range(998))}
    _edit(tmp_path / "c", lambda d: d.update(vocab=small, token_ids=placeholder_token_ids(
        m.content_hash, 64, 1000, range(998))))
    with pytest.raises(ManifestError, match="bits"):
        Manifest.load(tmp_path / "c")
    with pytest.raises(ManifestError, match="bits"):
        _trained(tmp_path, "d", 3, vocab=VocabInfo(1000, tuple(range(998))))


@pytest.mark.parametrize("vocab", [None, {"vocab_size": 1000}, {"vocab_size": True, "special_ids": []},
                                   {"vocab_size": 1000, "special_ids": ["0"]}, "1000"])
def test_a_trained_manifest_without_a_valid_vocab_is_refused(tmp_path, vocab):
    _trained(tmp_path, "c", 4)
    _edit(tmp_path / "c", lambda d: d.pop("vocab") if vocab is None else d.update(vocab=vocab))
    with pytest.raises(ManifestError, match="vocab"):
        Manifest.load(tmp_path / "c")


def test_a_composites_ids_are_its_parts_own_placeholders(tmp_path):
    """A composite's trained parts are checked part by part (each one's hash comes from its own
    chunks, which the composite lists); claiming a first-k segment moves nothing: it is refused
    unless every id is as derived."""
    from lmcache_cartridge.store.composite import composite_manifest

    a, b = _trained(tmp_path, "a", 5), _trained(tmp_path, "b", 6)
    comp = composite_manifest([a, b])
    (tmp_path / "comp").mkdir()
    (tmp_path / "comp" / MANIFEST_NAME).write_text(comp.to_json())
    assert Manifest.load(tmp_path / "comp").token_ids == a.token_ids + b.token_ids
    assert comp.segments == [["trained", 64], ["trained", 64]]
    for change in (lambda d: d.update(token_ids=b.token_ids + a.token_ids),
                   lambda d: d.update(segments=[["trained", 128]]),
                   lambda d: d.update(segments=[["trained", 32], ["trained", 96]]),
                   lambda d: d.update(segments=[["trained", 64], ["trained", 96]])):
        _edit(tmp_path / "comp", lambda d: d.update(json.loads(comp.to_json())))
        _edit(tmp_path / "comp", change)
        with pytest.raises(ManifestError, match="placeholder|segments"):
            Manifest.load(tmp_path / "comp")
    with pytest.raises(ManifestError, match="no vocab or segments"):
        first_k = _pack(tmp_path, "f", 7)
        _edit(tmp_path / "f", lambda d: d.update(vocab={"vocab_size": 1000, "special_ids": []}))
        Manifest.load(tmp_path / "f")
    assert first_k.vocab is None


# --- first-k segments: a first-k part's ids are nobody's checked claim ------------------------
def claim_first_chunks(directory, prompt) -> None:
    """Rewrite a trained manifest as the reviewer's probe did: `segments` say its first chunks are
    a first-k part holding `prompt`'s ids, the rest trained, with the placeholder ids derived
    from those chunks (so every check a trained segment gets passes). Its KV is unchanged."""
    m = Manifest.load(directory)
    n, rest = len(prompt), m.num_tokens - len(prompt)
    chunks = m.chunks[n // m.chunk_size:]
    shape = [2, m.num_layers, rest, m.num_kv_heads, m.head_dim]
    tail = placeholder_token_ids(derive_content_hash(shape, m.torch_dtype, m.chunk_size, chunks), rest,
                                 m.vocab["vocab_size"], m.vocab["special_ids"])
    _edit(directory, lambda d: d.update(segments=[["first_k", n], ["trained", rest]], token_ids=list(prompt) + tail))


def forge_composite(directory, parts) -> Manifest:
    """What a client could write into a directory of its own: the composite of `parts` (packed
    directories) with the parts list and a payload of their bytes beside it."""
    from lmcache_cartridge.store.composite import composite_manifest
    from lmcache_cartridge.store.origins import PARTS_NAME

    comp = composite_manifest([Manifest.load(p) for p in parts])
    directory.mkdir()
    (directory / MANIFEST_NAME).write_text(comp.to_json())
    (directory / PARTS_NAME).write_text(json.dumps([{"id": Manifest.load(p).cartridge_id, "source_uri": str(p),
                                                     "path": str(p)} for p in parts]))
    (directory / PAYLOAD_NAME).write_bytes(b"".join((p / PAYLOAD_NAME).read_bytes() for p in parts))
    return comp


def test_a_first_k_segment_in_a_manifest_nobody_composed_is_refused(tmp_path):
    """A trained manifest whose segments put a prompt's real ids in a first_k part: a trained kind
    is never salted, so its KV would be served to every request sending that prompt. Read from
    a directory, an S3 manifest's bytes, a packed cartridge or a client's registration, it is
    refused: a segment is only ever the gateway's composite of registered parts."""
    from lmcache_cartridge.store.registry import Registry

    prompt = list(range(100, 132))
    _trained(tmp_path, "forger", 8)
    claim_first_chunks(tmp_path / "forger", prompt)
    raw = json.loads((tmp_path / "forger" / MANIFEST_NAME).read_text())
    reg = Registry(tmp_path / "reg.db")
    for read in (lambda: Manifest.load(tmp_path / "forger"), lambda: Manifest.from_dict(raw),
                 lambda: PackedCartridge(tmp_path / "forger"),
                 lambda: reg.register(tmp_path / "forger", client=True)):
        with pytest.raises(ManifestError, match="has a first_k segment but is not a composite"):
            read()
    assert reg.list() == []
    # a parts list beside it must compose it exactly: not other parts, not itself, not garbage
    from lmcache_cartridge.store.origins import PARTS_NAME

    _trained(tmp_path, "t1", 9)
    _pack(tmp_path, "f1", 10)
    for listing, needle in (([str(tmp_path / "f1"), str(tmp_path / "t1")], "not the composite of the parts"),
                            ([str(tmp_path / "forger")], "lists the composite itself"),
                            ("[{", "not the composite of the parts"), ([], "not the composite of the parts")):
        (tmp_path / "forger" / PARTS_NAME).write_text(
            listing if isinstance(listing, str) else json.dumps([{"path": p} for p in listing]))
        with pytest.raises(ManifestError, match=needle):
            Manifest.load(tmp_path / "forger")


def test_the_gateways_composites_with_a_first_k_part_load_and_stay_their_parts(tmp_path):
    """A composite registered from the operator's first-k cartridge and a trained one loads (its
    first-k segment is that part's own ids and KV); the same file with other ids does not; a
    first-k cartridge a client brought (salted) is never composed."""
    from lmcache_cartridge.store.composite import register_composite
    from lmcache_cartridge.store.origins import is_composite
    from lmcache_cartridge.store.registry import Registry

    reg = Registry(tmp_path / "reg.db")
    f, t = _pack(tmp_path, "doc", 11), _trained(tmp_path, "t", 12)
    parts = [(reg.register(tmp_path / "doc"), f), (reg.register(tmp_path / "t"), t)]
    entry, comp = register_composite(reg, parts, tmp_path / "cache")
    assert is_composite(entry.source_uri) and entry.salt == "" and comp.segments == [["first_k", 64], ["trained", 64]]
    assert Manifest.load(entry.path).token_ids == f.token_ids + t.token_ids
    # its cache directory edited: a prompt's ids in the first-k segment
    _edit(Path(entry.path), lambda d: d.update(token_ids=list(range(500, 564)) + t.token_ids))
    with pytest.raises(ManifestError, match="not the composite of the parts"):
        Manifest.load(entry.path)
    _pack(tmp_path, "client", 13)
    salted = reg.register(tmp_path / "client", client=True)
    assert salted.salt
    with pytest.raises(CartridgeError, match="never part of a composite"):
        register_composite(reg, [(salted, Manifest.load(tmp_path / "client")), parts[1]], tmp_path / "cache")

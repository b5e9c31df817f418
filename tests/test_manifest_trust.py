"""A manifest is someone else's file: its content hash (the CPU tier's key, disk-cache file
names) is derived from its chunk digests on every load, never taken from it."""

from __future__ import annotations

import json

import pytest

from conftest import random_kv
from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME, Manifest, legacy_content_hash
from lmcache_cartridge.cartridge.packed import PackedCartridge, pack_kv
from lmcache_cartridge.errors import ManifestError


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
        _edit(tmp_path / "forger", lambda d: d.update(content_hash=bad))
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
        d["content_hash"] = m.derived_content_hash(legacy_content_hash)  # what the old code trusted

    _edit(tmp_path / "forger", copy_sha)
    forged = Manifest.load(tmp_path / "forger")
    assert forged.derived_content_hash(legacy_content_hash) == victim.derived_content_hash(legacy_content_hash)
    assert forged.content_hash != victim.content_hash


def test_a_manifest_packed_before_blake3_counted_loads_under_the_derived_hash(tmp_path):
    m = _pack(tmp_path, "old", 3)
    legacy = m.derived_content_hash(legacy_content_hash)
    _edit(tmp_path / "old", lambda d: d.update(content_hash=legacy))
    assert Manifest.load(tmp_path / "old").content_hash == m.content_hash != legacy

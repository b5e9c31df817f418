"""Per-chunk BLAKE3 digests: `pack_kv` records one per chunk beside the sha256, every
first read checks it (`integrity.chunk_digest`), and cartridges packed before it existed still
serve, verified by their sha256.

`tests/data/legacy-sha256-cartridge` was packed by the package's last version without per-chunk
BLAKE3 (random bf16 KV `[2, 1, 256, 1, 8]`, seed 17, chunks of 64 tokens): a real old cartridge,
not one made by deleting keys from a new manifest.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import blake3
import pytest
import torch

from conftest import rehash_manifest

from lmcache_cartridge.cartridge.integrity import check_chunk, chunk_digest
from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME, PAYLOAD_NAME, Manifest, legacy_content_hash
from lmcache_cartridge.cartridge.packed import VocabInfo, PackedCartridge, pack_kv
from lmcache_cartridge.errors import ChecksumError, ManifestError
from lmcache_cartridge.store.metrics import Metrics
from lmcache_cartridge.store.origins import LocalOrigin
from lmcache_cartridge.store.residency import DiskTier, Handle, MemoryTier, Residency

LEGACY = Path(__file__).parent / "data" / "legacy-sha256-cartridge"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _repack_legacy(tmp_path: Path, name: str = "new") -> PackedCartridge:
    """The legacy fixture's KV packed again by this version, with the same arguments."""
    old = PackedCartridge(LEGACY)
    m = old.manifest
    pack_kv(old.load_kv(), tmp_path / name, cartridge_id=m.cartridge_id, model=m.model, kind=m.kind,
            token_ids=m.token_ids, chunk_size=m.chunk_size, provenance=m.provenance)
    return PackedCartridge(tmp_path / name)


def _flip(directory: Path, chunk: int, manifest: Manifest, at: int = 5) -> None:
    path = directory / PAYLOAD_NAME
    data = bytearray(path.read_bytes())
    data[manifest.chunks[chunk].offset + at] ^= 0x01
    path.write_bytes(bytes(data))


def _residency() -> Residency:
    return Residency(MemoryTier("cpu", 1 << 20), None, Metrics(), prefetch=False)


def _serve(res: Residency, handle: Handle, index: int) -> bytes:
    out = torch.empty(handle.manifest.chunks[index].nbytes, dtype=torch.uint8)
    res.read_into(handle, index, out, network=False)  # the plugin's hot path (LMCache's retrieve)
    return out.numpy().tobytes()


def _raw(p: PackedCartridge, index: int) -> bytes:
    info = p.manifest.chunks[index]
    return (p.directory / PAYLOAD_NAME).read_bytes()[info.offset:info.offset + info.nbytes]


def test_pack_records_blake3_per_chunk_and_keeps_the_content_identity(tmp_path):
    old = PackedCartridge(LEGACY)
    assert all(c.blake3 is None for c in old.manifest.chunks)
    new = _repack_legacy(tmp_path)
    assert (new.directory / PAYLOAD_NAME).read_bytes() == (LEGACY / PAYLOAD_NAME).read_bytes()
    for c, o in zip(new.manifest.chunks, old.manifest.chunks, strict=True):
        data = _raw(new, c.index)
        assert c.blake3 == blake3.blake3(data).hexdigest()
        assert c.sha256 == o.sha256 == hashlib.sha256(data).hexdigest()
        assert chunk_digest(c)[0] == "blake3" and chunk_digest(o)[0] == "sha256"
    # the identity covers every digest a reader verifies (the BLAKE3s too: reads check them, so a
    # manifest with another cartridge's sha256s and its own BLAKE3s must not share its id); the
    # sha256-only hash the old version wrote is still accepted on disk and still agrees
    assert new.manifest.content_hash != old.manifest.content_hash
    assert new.manifest.derived_content_hash(legacy_content_hash) == \
        json.loads((LEGACY / MANIFEST_NAME).read_text())["content_hash"]
    assert new.verify().ok and old.verify().ok


def test_a_cartridge_packed_before_blake3_still_serves_verified_by_sha256(tmp_path):
    legacy = _copy(LEGACY, tmp_path / "legacy")
    p = PackedCartridge(legacy)
    handle = Handle(p.manifest, LocalOrigin(legacy))
    res = _residency()
    for i in range(len(p.manifest.chunks)):
        assert _serve(res, handle, i) == _raw(p, i)
    # and the fallback really verifies: a flipped byte in an old cartridge is refused
    bad = _copy(LEGACY, tmp_path / "legacy-bad")
    _flip(bad, 2, p.manifest)
    pb = PackedCartridge(bad)
    hb = Handle(pb.manifest, LocalOrigin(bad))
    res = _residency()
    assert _serve(res, hb, 1) == _raw(p, 1)
    with pytest.raises(ChecksumError, match=r"chunk 2 checksum mismatch \(sha256"):
        _serve(res, hb, 2)
    with pytest.raises(ChecksumError):
        pb.read_chunk(2)
    # the manifest is written back as it was read (no blake3 key appears), but for its content
    # hash: the derived one, which this version also accepts on disk
    on_disk = json.loads((LEGACY / MANIFEST_NAME).read_text())
    assert Manifest.load(legacy).to_json() == json.dumps({**on_disk, "content_hash": p.manifest.content_hash}, indent=1)
    assert Manifest.from_dict(json.loads(Manifest.load(legacy).to_json())) == p.manifest


def test_a_flipped_byte_in_one_chunk_is_refused_on_every_read_path(tmp_path):
    p = _repack_legacy(tmp_path, "good")
    good = {i: _raw(p, i) for i in range(len(p.manifest.chunks))}
    bad_dir = _copy(p.directory, tmp_path / "bad")
    _flip(bad_dir, 1, p.manifest, at=77)
    bad = PackedCartridge(bad_dir)

    # the plugin's first hit on a local cartridge (Residency -> LocalOrigin -> check_chunk)
    res = _residency()
    handle = Handle(bad.manifest, LocalOrigin(bad_dir))
    assert _serve(res, handle, 0) == good[0] and _serve(res, handle, 2) == good[2]
    with pytest.raises(ChecksumError, match=r"chunk 1 checksum mismatch \(blake3"):
        _serve(res, handle, 1)
    assert (bad.manifest.content_hash, 1) not in res.cpu  # nothing unverified was cached

    # PackedCartridge readers and `verify`
    with pytest.raises(ChecksumError, match=r"\(blake3"):
        bad.read_chunk(1)
    report = bad.verify()
    assert not report.ok and len(report.problems) == 1 and "chunk 1" in report.problems[0]

    # a disk-cache file changed behind our back: dropped on its first read in a process
    info = p.manifest.chunks[1]
    disk = DiskTier(tmp_path / "cache", budget_bytes=1 << 20)
    cid = (p.manifest.content_hash, 1)
    assert disk.put(cid, memoryview(bytearray(good[1])))
    f = tmp_path / "cache" / cid[0] / "1.chunk"
    data = bytearray(f.read_bytes())
    data[3] ^= 0x80
    f.write_bytes(bytes(data))
    fresh = DiskTier(tmp_path / "cache", budget_bytes=1 << 20)
    buf = bytearray(info.nbytes)
    assert not fresh.get_into(cid, memoryview(buf), Handle(p.manifest, LocalOrigin(p.directory)))
    assert not f.exists()


def test_reads_check_blake3_and_verify_checks_both_digests(tmp_path):
    """Which digest does the work: a wrong blake3 record is refused by every read; a wrong sha256
    record (bytes intact) is not recomputed on the serving path, but `verify` reports it."""
    p = _repack_legacy(tmp_path, "c")
    d = json.loads((p.directory / MANIFEST_NAME).read_text())
    d["chunks"][0]["sha256"] = "0" * 64
    d["chunks"][1]["blake3"] = "0" * 64
    (p.directory / MANIFEST_NAME).write_text(json.dumps(rehash_manifest(d)))
    q = PackedCartridge(p.directory)
    res = _residency()
    handle = Handle(q.manifest, LocalOrigin(p.directory))
    assert _serve(res, handle, 0) == _raw(q, 0)
    with pytest.raises(ChecksumError, match=r"chunk 1 checksum mismatch \(blake3"):
        _serve(res, handle, 1)
    with pytest.raises(ChecksumError, match=r"chunk 0 checksum mismatch \(sha256"):
        check_chunk(q.manifest.chunks[0], memoryview(bytearray(_raw(q, 0))), "x", every_digest=True)
    report = q.verify()
    assert [("chunk 0" in s, "chunk 1" in s) for s in report.problems] == [(True, False), (False, True)]


def test_manifest_validates_the_blake3_field_and_round_trips_it(tmp_path):
    p = _repack_legacy(tmp_path, "c")
    assert Manifest.from_dict(json.loads(p.manifest.to_json())) == p.manifest
    d = json.loads(p.manifest.to_json())
    for bad in ("ab" * 31, "XYZ", 7, "0" * 65):
        d["chunks"][2]["blake3"] = bad
        with pytest.raises(ManifestError, match="chunk 2"):
            Manifest.from_dict(d)
    d["chunks"][2]["blake3"] = None  # one chunk without: read by its sha256
    with pytest.raises(ManifestError, match="not the hash of its chunks"):
        Manifest.from_dict(d)  # the digests changed, the content hash did not
    m = Manifest.from_dict(rehash_manifest(d))
    assert chunk_digest(m.chunks[2])[0] == "sha256" and chunk_digest(m.chunks[1])[0] == "blake3"


def test_a_composite_keeps_its_parts_blake3(tmp_path):
    from lmcache_cartridge.store.composite import composite_manifest

    parts = []
    for i in range(2):
        kv = torch.randn(2, 1, 128, 1, 8, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        parts.append(pack_kv(kv, tmp_path / f"t{i}", cartridge_id=f"t{i}", model="m", kind="trained",
                             vocab=VocabInfo(1000), chunk_size=64))
    m = composite_manifest(parts)
    assert [c.blake3 for c in m.chunks] == [c.blake3 for p in parts for c in p.chunks]
    assert all(c.blake3 for c in m.chunks)

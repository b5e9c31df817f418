"""Input formats -> pack -> load is bit-exact; unsafe or malformed input is refused clearly."""

import pickle
import os
import multiprocessing as mp

import pytest

from lmcache_cartridge.cartridge.keys import placeholder_token_ids
import torch

from conftest import random_kv
from lmcache_cartridge.errors import CartridgeFormatError, ChecksumError, ManifestError
from lmcache_cartridge.cartridge.formats import load_input
from lmcache_cartridge.cartridge.manifest import Manifest
from lmcache_cartridge.cartridge.manifest import LAYOUT_2LTD
from lmcache_cartridge.cartridge.packed import PackedCartridge, VocabInfo, pack_kv, rechunk, to_chunk_layout

L, T, H, D = 3, 40, 2, 8
CHUNK = 16


def _htd(kv, part, layer):  # canonical [2,L,T,H,D] -> [H,T,D]
    return kv[part, layer].permute(1, 0, 2).contiguous()


def _assert_chunks_equal(packed: PackedCartridge, kv: torch.Tensor):
    m = packed.manifest
    for c in m.chunks:
        start = c.index * m.chunk_size
        expected = to_chunk_layout(kv, start, start + c.num_tokens, LAYOUT_2LTD)  # LMCache's KV_2LTD
        got = packed.read_chunk(c.index)
        assert got.dtype == kv.dtype
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), f"chunk {c.index}"
    assert torch.equal(packed.load_kv(), kv)


def _kv_cache_dict_htd(kv):
    return {"token_ids": list(range(5, 5 + T)),
            "kv_cache": {f"model.layers.{i}.self_attn": torch.stack([_htd(kv, 0, i), _htd(kv, 1, i)])
                         for i in range(L)},
            "metadata": {"model": "tiny"}}


FORMATS = {
    "kv_cache_dict_HTD": _kv_cache_dict_htd,
    "kv_cache_dict_batched_tensor_ids": lambda kv: {
        "token_ids": torch.arange(5, 5 + T),
        "kv_cache": {f"layer_{i}": torch.stack([_htd(kv, 0, i), _htd(kv, 1, i)]).unsqueeze(1) for i in range(L)}},
    "kv_cache_dict_THD": lambda kv: {
        "token_ids": list(range(5, 5 + T)),
        "kv_cache": {f"layer{i}": kv[:, i].clone() for i in reversed(range(L))}},  # order from names
    "kv_cache_dict_pairs": lambda kv: {
        "token_ids": list(range(5, 5 + T)),
        "kv_cache": {f"l{i}": (_htd(kv, 0, i)[None], _htd(kv, 1, i)[None]) for i in range(L)}},
    "paper_trainable_only": lambda kv: {
        "trainable_keys": [_htd(kv, 0, i)[None] for i in range(L)],
        "trainable_values": [_htd(kv, 1, i)[None] for i in range(L)]},
    "paper_frozen_first": lambda kv: {
        "frozen_keys": [_htd(kv, 0, i)[None, :, :4] for i in range(L)],
        "frozen_values": [_htd(kv, 1, i)[None, :, :4] for i in range(L)],
        "trainable_keys": [_htd(kv, 0, i)[None, :, 4:] for i in range(L)],
        "trainable_values": [_htd(kv, 1, i)[None, :, 4:] for i in range(L)]},
    "paper_fixed_state_dict": lambda kv: {
        **{f"fixed_keys.{i}": _htd(kv, 0, i)[None, :, :8] for i in range(L)},
        **{f"fixed_values.{i}": _htd(kv, 1, i)[None, :, :8] for i in range(L)},
        **{f"trainable_keys.{i}": _htd(kv, 0, i)[None, :, 8:] for i in range(L)},
        **{f"trainable_values.{i}": _htd(kv, 1, i)[None, :, 8:] for i in range(L)}},
    "kv_pair_list": lambda kv: [(_htd(kv, 0, i)[None], _htd(kv, 1, i)[None]) for i in range(L)],
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_format_round_trips_bit_exactly(tmp_path, fmt, dtype):
    tokens = T if not fmt.startswith("paper") and fmt != "kv_pair_list" else 48  # trained: whole chunks
    kv = random_kv(L, tokens, H, D, dtype=dtype, seed=sum(map(ord, fmt)))
    path = tmp_path / "in.pt"
    torch.save(FORMATS[fmt](kv), path)
    loaded = load_input(path)
    assert torch.equal(loaded.kv, kv)
    kind = "first_k" if loaded.token_ids is not None else "trained"
    m = pack_kv(loaded.kv, tmp_path / "packed", cartridge_id="c", model="tiny", kind=kind,
                token_ids=loaded.token_ids, vocab=VocabInfo(500, (0, 1, 2)), chunk_size=CHUNK)
    assert m.kind == kind and m.num_tokens == tokens
    reopened = Manifest.load(tmp_path / "packed")
    assert reopened == m
    _assert_chunks_equal(PackedCartridge(tmp_path / "packed"), kv)
    if kind == "first_k":
        assert m.token_ids == list(range(5, 5 + T))
    else:
        assert len(m.token_ids) == tokens and not set(m.token_ids) & {0, 1, 2}
        assert all(0 <= t < 500 for t in m.token_ids)


def test_malicious_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"token_ids": [1, 2, 3], "metadata": Evil()}, f)
    # Sanity: an unsafe load really would run the code (proves the file is a working exploit).
    probe = tmp_path / "probe.pt"
    with open(probe, "wb") as f:
        pickle.dump(type("E", (), {"__reduce__": lambda s: (os.system, (f"touch {tmp_path/'probe-ran'}",))})(), f)
    with open(probe, "rb") as f:
        pickle.load(f)
    assert (tmp_path / "probe-ran").exists()

    # a bare pickle is not torch.save's zip archive: refused before anything unpickles it
    with pytest.raises(CartridgeFormatError, match="not a torch.save zip archive"):
        load_input(path)
    assert not marker.exists()

    # The same payload inside torch.save's zip container.
    zipped = tmp_path / "evil_zip.pt"
    torch.save({"token_ids": [1, 2, 3], "metadata": Evil()}, zipped)
    with pytest.raises(CartridgeFormatError, match="refused to load"):
        load_input(zipped)
    assert not marker.exists()


def test_token_only_and_malformed_inputs(tmp_path):
    p = tmp_path / "t.pt"
    torch.save({"token_ids": [1, 2, 3]}, p)
    lc = load_input(p)
    assert lc.kv is None and lc.token_ids == [1, 2, 3]
    bad = {
        "empty_dict": {},
        "float_tokens": {"token_ids": torch.tensor([1.0, 2.0])},
        "ragged": {"trainable_keys": [torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 5, 8)],
                   "trainable_values": [torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 5, 8)]},
        "keys_without_values": {"trainable_keys": [torch.zeros(1, 2, 4, 8)]},
        "unnumbered_layers": {"token_ids": [1, 2], "kv_cache": {"a": torch.zeros(2, 2, 2, 8)}},
        "ambiguous_layout": {"token_ids": [1, 2], "kv_cache": {"l0": torch.zeros(2, 2, 2, 8)}},
        "token_count_mismatch": {"token_ids": [1, 2, 3], "kv_cache": {"l0": torch.zeros(2, 2, 4, 8)}},
        "int_kv": {"trainable_keys": [torch.zeros(1, 2, 4, 8, dtype=torch.int32)],
                   "trainable_values": [torch.zeros(1, 2, 4, 8, dtype=torch.int32)]},
    }
    for obj in bad.values():
        torch.save(obj, p)
        with pytest.raises(CartridgeFormatError):
            load_input(p)
    p.write_bytes(b"not a torch file")
    with pytest.raises(CartridgeFormatError):
        load_input(p)


def test_trained_needs_whole_chunks_with_numbers_in_message(tmp_path):
    kv = random_kv(L, 40, H, D)
    with pytest.raises(CartridgeFormatError, match=r"40 tokens.*chunk_size 16.*32 or\s+48"):
        pack_kv(kv, tmp_path / "x", cartridge_id="x", model="m", kind="trained",
                vocab=VocabInfo(100), chunk_size=16)
    assert not (tmp_path / "x").exists()


def test_nan_kv_refused(tmp_path):
    kv = random_kv(L, 32, H, D)
    kv[1, 0, 3, 0, 0] = float("nan")
    with pytest.raises(CartridgeFormatError, match="NaN"):
        pack_kv(kv, tmp_path / "x", cartridge_id="x", model="m", kind="first_k",
                token_ids=list(range(32)), chunk_size=16)


def test_placeholder_ids_deterministic_and_distinct(tmp_path):
    kv_a, kv_b = random_kv(L, 32, H, D, seed=1), random_kv(L, 32, H, D, seed=2)
    args = dict(model="m", kind="trained", vocab=VocabInfo(300, (0, 1)), chunk_size=16)
    a1 = pack_kv(kv_a, tmp_path / "a1", cartridge_id="a", **args)
    a2 = pack_kv(kv_a, tmp_path / "a2", cartridge_id="a", **args)
    b = pack_kv(kv_b, tmp_path / "b", cartridge_id="b", **args)
    assert a1.token_ids == a2.token_ids and a1.content_hash == a2.content_hash
    assert a1.token_ids[:16] != b.token_ids[:16]


def _flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_verify_detects_flipped_byte_and_truncation(tmp_path):
    kv = random_kv(L, 40, H, D)
    m = pack_kv(kv, tmp_path / "c", cartridge_id="c", model="m", kind="first_k",
                token_ids=list(range(40)), chunk_size=16)
    p = PackedCartridge(tmp_path / "c")
    assert p.verify().ok
    _flip_byte(tmp_path / "c" / "kv.bin", m.chunks[1].offset + 7)
    p2 = PackedCartridge(tmp_path / "c")
    report = p2.verify()
    assert not report.ok and len(report.problems) == 1 and "chunk 1" in report.problems[0]
    with pytest.raises(ChecksumError):
        p2.read_chunk(1)
    p2.read_chunk(0)  # untouched chunks still read
    with open(tmp_path / "c" / "kv.bin", "r+b") as f:
        f.truncate(m.payload_nbytes - 10)
    with pytest.raises(ManifestError, match="truncated"):
        PackedCartridge(tmp_path / "c")


def test_manifest_rejects_inconsistency(tmp_path):
    kv = random_kv(L, 40, H, D)
    pack_kv(kv, tmp_path / "c", cartridge_id="c", model="m", kind="first_k",
            token_ids=list(range(40)), chunk_size=16)
    path = tmp_path / "c" / "manifest.json"
    good = path.read_text()
    for old, new in [('"num_layers": 3', '"num_layers": 4'), ('"chunk_size": 16', '"chunk_size": 32'),
                     ('"cartridge_id": "c"', '"cartridge_id": "../x"'), ('"format_version": 2', '"format_version": 9'),
                     ('"layout": "by_head"', '"layout": "2ltd"'), ('"format_version": 2', '"format_version": 1')]:
        assert old in good
        path.write_text(good.replace(old, new))
        with pytest.raises(ManifestError):
            PackedCartridge(tmp_path / "c")
    path.write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.load(tmp_path / "c")


def test_rechunk_keeps_bytes_and_rederives_trained_ids(tmp_path):
    kv = random_kv(L, 64, H, D)
    m = pack_kv(kv, tmp_path / "c", cartridge_id="c", model="m", kind="trained",
                vocab=VocabInfo(300), chunk_size=16)
    m2 = rechunk(PackedCartridge(tmp_path / "c"), tmp_path / "c32", 32)
    assert m2.chunk_size == 32 and len(m2.chunks) == 2 and m2.vocab == m.vocab
    # other chunks, another content hash: the placeholder ids follow it (they are never carried over)
    assert m2.token_ids == placeholder_token_ids(m2.content_hash, 64, 300) != m.token_ids
    _assert_chunks_equal(PackedCartridge(tmp_path / "c32"), kv)
    first_k = pack_kv(kv, tmp_path / "f", cartridge_id="f", model="m", kind="first_k",
                      token_ids=list(range(64)), chunk_size=16)
    assert rechunk(PackedCartridge(tmp_path / "f"), tmp_path / "f32", 32).token_ids == first_k.token_ids
    with pytest.raises(CartridgeFormatError, match="not a multiple"):
        rechunk(PackedCartridge(tmp_path / "c"), tmp_path / "c48", 48)


def _reader(path, q):
    p = PackedCartridge(path)
    q.put([p.read_chunk(i).sum().item() for i in range(len(p.manifest.chunks))])


def test_concurrent_readers_in_several_processes(tmp_path):
    kv = random_kv(L, 64, H, D)
    pack_kv(kv, tmp_path / "c", cartridge_id="c", model="m", kind="first_k",
            token_ids=list(range(64)), chunk_size=16)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(str(tmp_path / "c"), q)) for _ in range(3)]
    for pr in procs:
        pr.start()
    results = [q.get(timeout=120) for _ in procs]
    for pr in procs:
        pr.join(timeout=30)
    expected = [to_chunk_layout(kv, s, s + 16).sum().item() for s in range(0, 64, 16)]
    assert results == [expected] * 3

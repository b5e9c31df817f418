"""Each tensor-parallel rank reads only its KV heads.

A `by_head` payload (format 2) stores every chunk as `[H, 2, L, t, D]`, so the heads a rank holds
are one contiguous byte range. Each test builds real LMCache engines as rank r of world size tp
(the plugin loaded by LMCache from YAML, as in vLLM's workers) and checks two things: what the
rank retrieves equals its heads of the cartridge's KV, and the bytes it reads, counted where they
come from (the local origin's `pread`s; the S3 server's ranged GETs, at a proxy), are its share:
1/tp of the cartridge, or one head's share when heads are replicated (kv_heads < tp).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from conftest import random_kv
from lmc_helpers import Engine, make_metadata
from s3_server import s3_client, upload_dir
from test_plugin import load_config, write_yaml
from lmcache_cartridge.cartridge.manifest import LAYOUT_2LTD, MANIFEST_NAME
from lmcache_cartridge.cartridge.packed import PackedCartridge, pack_kv
from lmcache_cartridge.cartridge.tp import kv_head_range
from lmcache_cartridge.store.registry import Registry
from lmcache_cartridge.tools import cli

L, D, CHUNK, MODEL = 2, 16, 64, "tiny-test-model"
BUCKET = "tp-carts"


def _pack(tmp_path: Path, heads: int, *, layout: str | None = None, name: str = "doc", seed: int = 3):
    kv = random_kv(L, 3 * CHUNK, heads, D, seed=seed)
    extra = {"layout": layout} if layout else {}
    m = pack_kv(kv, tmp_path / name, cartridge_id=name, model=MODEL, kind="first_k",
                token_ids=list(range(100, 100 + 3 * CHUNK)), chunk_size=CHUNK, **extra)
    return m, kv


def _rank_engine(tmp_path: Path, heads: int, tp: int, rank: int, **extra) -> Engine:
    cfg_path = write_yaml(tmp_path, tmp_path / "reg.db")
    if extra:
        cfg = yaml.safe_load(cfg_path.read_text())
        cfg["extra_config"].update(extra)
        cfg_path.write_text(yaml.safe_dump(cfg))
    start, end = kv_head_range(heads, tp, rank)
    md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=end - start, head_dim=D,
                       chunk_size=CHUNK, world_size=tp, worker_id=rank)
    return Engine(load_config(cfg_path), md)


def _expected(kv: torch.Tensor, heads: int, tp: int, rank: int, n: int) -> torch.Tensor:
    start, end = kv_head_range(heads, tp, rank)
    return kv[:, :, :n, start:end].reshape(2, L, n, -1)


@pytest.mark.parametrize("heads,tps", [(8, (1, 2, 4, 8)), (2, (4, 8))], ids=["8-heads", "2-heads-replicated"])
def test_each_rank_reads_exactly_its_heads_from_a_local_cartridge(tmp_path, heads, tps):
    m, kv = _pack(tmp_path, heads)
    Registry(tmp_path / "reg.db").register(tmp_path / "doc")
    total, n = m.payload_nbytes, 3 * CHUNK
    for tp in tps:
        share = total // min(tp, heads)  # replicated heads: one head's bytes
        for rank in range(tp):
            with _rank_engine(tmp_path, heads, tp, rank) as eng:
                got_n, got = eng.retrieve(m.token_ids + [1])
                assert got_n == n
                assert torch.equal(got[:, :, :n], _expected(kv, heads, tp, rank, n)), (tp, rank)
                plugin = eng.backend("cartridge")
                origin = plugin._state.served["doc"].handle.origin
                assert origin.bytes_read == share, (tp, rank, origin.bytes_read, share)
                # the CPU tier holds this rank's heads only: its budget counts what the rank holds
                assert plugin.residency.cpu.used == share


def _s3_engine(tmp_path, proxy, heads, tp, rank):
    return _rank_engine(tmp_path, heads, tp, rank, **{
        "storage_plugin.cartridge.s3.endpoint_url": proxy.endpoint_url,
        "storage_plugin.cartridge.s3.max_attempts": "2"})


def _ranged_get_bytes(proxy) -> int:
    total = 0
    for r in proxy.requests:
        if r.method == "GET" and r.path.endswith("/kv.bin"):
            a, b = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", r.range).groups())
            total += b - a + 1
    return total


def _wait_resident(eng, token_ids, n) -> None:
    # The first lookup misses and starts the background download; a failed one is started again
    # by the next lookup. Generous: under the whole suite's load the loopback S3 server is slow.
    deadline = time.time() + 120
    while eng.engine.lookup(token_ids + [1]) != n and time.time() < deadline:
        time.sleep(0.05)
    plugin = eng.backend("cartridge")
    assert eng.engine.lookup(token_ids + [1]) == n, (plugin._state.skipped, plugin.metrics.snapshot())


def _dir_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*.chunk"))


@pytest.mark.parametrize("heads,tp", [(8, 2), (8, 8), (2, 4)], ids=["8-heads-tp2", "8-heads-tp8", "2-heads-tp4"])
def test_each_rank_downloads_exactly_its_heads_from_s3_and_caches_them_per_rank(tmp_path, moto_server, s3_proxy,
                                                                             heads, tp):
    m, kv = _pack(tmp_path, heads, name="src")
    client = s3_client(moto_server)
    client.create_bucket(Bucket=BUCKET)
    # a prefix of this test's own: `register` keeps S3 manifests in the host cache by URI, which
    # the other parameters' runs on the other test worker share (same URI, other bytes)
    prefix = f"c/doc-{heads}-{tp}-{uuid.uuid4().hex[:8]}"
    upload_dir(client, BUCKET, prefix, tmp_path / "src")
    assert cli.main(["register", f"s3://{BUCKET}/{prefix}", "--registry", str(tmp_path / "reg.db"),
                     "--s3-endpoint", s3_proxy.endpoint_url]) == 0
    n, total = 3 * CHUNK, m.payload_nbytes
    chunks_dir = tmp_path / "cache" / "chunks"
    seen_slices: set[tuple[int, int]] = set()
    for rank in range(tp):
        s3_proxy.reset()
        before = _dir_bytes(chunks_dir) if chunks_dir.exists() else 0
        with _s3_engine(tmp_path, s3_proxy, heads, tp, rank) as eng:
            _wait_resident(eng, m.token_ids, n)
            eng.clear_local_cpu()
            got_n, got = eng.retrieve(m.token_ids + [1])
            assert got_n == n and torch.equal(got[:, :, :n], _expected(kv, heads, tp, rank, n)), rank
        heads_of_rank = kv_head_range(heads, tp, rank)
        share = total // min(tp, heads)
        if heads_of_rank in seen_slices:  # a replica's heads are already on this host's disk
            assert _ranged_get_bytes(s3_proxy) == 0 and _dir_bytes(chunks_dir) == before
        else:  # one ranged GET per chunk, of exactly this rank's bytes; the disk cache keeps them
            assert s3_proxy.count("GET", r"/kv\.bin$") == len(m.chunks)
            assert _ranged_get_bytes(s3_proxy) == share, (rank, _ranged_get_bytes(s3_proxy), share)
            assert _dir_bytes(chunks_dir) - before == share
        seen_slices.add(heads_of_rank)
    assert _dir_bytes(chunks_dir) == total  # all ranks together hold the cartridge once


def test_format_1_cartridges_still_serve_every_rank(tmp_path):
    """Cartridges packed before format 2 (`2ltd`, heads interleaved in every row) are read as
    they are: a rank reads whole chunks and keeps its heads, in memory only its heads."""
    m, kv = _pack(tmp_path, 4, layout=LAYOUT_2LTD)
    raw = json.loads((tmp_path / "doc" / MANIFEST_NAME).read_text())
    assert raw["format_version"] == 1 and "layout" not in raw and "heads" not in raw["chunks"][0]
    Registry(tmp_path / "reg.db").register(tmp_path / "doc")
    for tp in (1, 2):
        for rank in range(tp):
            with _rank_engine(tmp_path, 4, tp, rank) as eng:
                got_n, got = eng.retrieve(m.token_ids + [1])
                assert got_n == 3 * CHUNK
                assert torch.equal(got[:, :, :got_n], _expected(kv, 4, tp, rank, got_n))
                plugin = eng.backend("cartridge")
                assert plugin._state.served["doc"].handle.origin.bytes_read == m.payload_nbytes
                assert plugin.residency.cpu.used == m.payload_nbytes // tp


def test_a_rank_verifies_its_heads_and_refuses_a_corrupt_one(tmp_path):
    """Each head has its own BLAKE3: a rank detects a flipped byte in its heads without reading
    the others', and a corrupt head elsewhere does not stop it."""
    m, kv = _pack(tmp_path, 4)
    payload = tmp_path / "doc" / "kv.bin"
    data = bytearray(payload.read_bytes())
    head_bytes = m.head_nbytes(CHUNK)
    data[m.chunks[0].offset + 3 * head_bytes + 7] ^= 0x01  # chunk 0, head 3 (rank 1 of 2)
    payload.write_bytes(bytes(data))
    Registry(tmp_path / "reg.db").register(tmp_path / "doc")
    with _rank_engine(tmp_path, 4, 2, 0) as eng:  # heads 0-1: unaffected
        got_n, got = eng.retrieve(m.token_ids + [1])
        assert got_n == 3 * CHUNK and torch.equal(got[:, :, :got_n], _expected(kv, 4, 2, 0, got_n))
    with _rank_engine(tmp_path, 4, 2, 1) as eng:  # heads 2-3: chunk 0 is refused, nothing served
        got_n, _ = eng.retrieve(m.token_ids + [1])
        assert got_n == 0
        plugin = eng.backend("cartridge")
        assert "checksum mismatch" in plugin._state.quarantined["doc"].why  # not served again
        assert eng.engine.lookup(m.token_ids + [1]) == 0
    report = PackedCartridge(tmp_path / "doc").verify()
    assert not report.ok and "chunk 0" in report.problems[0]


def test_pack_converts_a_format_1_cartridge_to_format_2_with_the_same_kv(tmp_path, capsys):
    m, kv = _pack(tmp_path, 4, layout=LAYOUT_2LTD, name="old")
    assert cli.main(["pack", str(tmp_path / "old"), "-o", str(tmp_path / "new"), "--chunk-size", str(CHUNK)]) == 0
    new = PackedCartridge(tmp_path / "new")
    assert new.manifest.format_version == 2 and new.manifest.layout == "by_head"
    assert new.manifest.token_ids == m.token_ids and new.verify().ok
    assert torch.equal(new.load_kv(), kv) and torch.equal(PackedCartridge(tmp_path / "old").load_kv(), kv)
    assert cli.main(["inspect", str(tmp_path / "new")]) == 0
    assert "format 2, by_head" in capsys.readouterr().out


@pytest.mark.parametrize("cpu_budget", [0, 1 << 24], ids=["cpu-tier-off", "cpu-tier-on"])
def test_residency_converts_each_rank_once_and_repeats_from_its_cpu_tier(tmp_path, cpu_budget):
    """The raw heads become the rank's KV_2LTD once (converted into the output, then copied into
    the CPU tier if it keeps them); a repeat read is a copy of that, not a re-read."""
    from lmcache_cartridge.cartridge.tp import RankView
    from lmcache_cartridge.store.metrics import Metrics
    from lmcache_cartridge.store.origins import LocalOrigin
    from lmcache_cartridge.store.residency import Handle, MemoryTier, Residency

    m, kv = _pack(tmp_path, 4)
    p = PackedCartridge(tmp_path / "doc")
    for tp in (1, 2, 4):
        for rank in range(tp):
            view = RankView.of(p.manifest, tp, rank)
            origin = LocalOrigin(p.directory)
            res = Residency(MemoryTier("cpu", cpu_budget), None, Metrics(), prefetch=False)
            h = Handle(p.manifest, origin, view=view)
            for _ in range(2):
                for i, c in enumerate(p.manifest.chunks):
                    out = torch.zeros(view.engine_shape(i), dtype=torch.bfloat16)
                    res.read_into(h, i, out, network=False)
                    a, b = view.heads
                    want = kv[:, :, i * CHUNK:i * CHUNK + c.num_tokens, a:b].reshape(2, L, c.num_tokens, -1)
                    assert torch.equal(out, want), (tp, rank, i)
            reads = 2 if cpu_budget == 0 else 1
            assert origin.bytes_read == reads * m.payload_nbytes // tp
            assert res.cpu.used == (m.payload_nbytes // tp if cpu_budget else 0)
            res.close()

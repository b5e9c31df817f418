"""Residency tiers on CPU: budgets, LRU, pinning, disk cache across restarts, single flight."""

import threading
import time

import pytest
import torch

from conftest import rehash_manifest, random_kv
from lmcache_cartridge.errors import ChecksumError
from lmcache_cartridge.store.metrics import Metrics
from lmcache_cartridge.store.origins import LocalOrigin
from lmcache_cartridge.cartridge.packed import PackedCartridge, pack_kv
from lmcache_cartridge.store import residency
from lmcache_cartridge.store.residency import DiskTier, Handle, MemoryTier, Residency

CHUNK = 16


def chunk_bytes(n, fill):
    return torch.full((n,), fill, dtype=torch.uint8)


def test_memory_tier_lru_and_pins():
    tier = MemoryTier("cpu", budget_bytes=300)
    for i in range(3):
        assert tier.put(("h", i), chunk_bytes(100, i))
    out = torch.empty(100, dtype=torch.uint8)
    assert tier.get_into(("h", 0), out) and out[0] == 0  # 0 becomes most recent
    tier.pin(("h", 1))
    assert tier.put(("h", 3), chunk_bytes(100, 3))  # evicts 2 (LRU, unpinned), not pinned 1
    assert tier.keys() == [("h", 1), ("h", 0), ("h", 3)]
    assert tier.put(("h", 4), chunk_bytes(100, 4))  # evicts 0; 1 still pinned
    assert ("h", 1) in tier and ("h", 0) not in tier
    tier.pin(("h", 3))
    tier.pin(("h", 4))
    assert not tier.put(("h", 5), chunk_bytes(100, 5))  # everything pinned: not cached
    assert not tier.put(("h", 6), chunk_bytes(400, 6))  # larger than the budget
    assert tier.used == 300 and tier.metrics.tiers["cpu"].evictions == 2
    tier.unpin(("h", 1))
    assert tier.put(("h", 7), chunk_bytes(100, 7)) and ("h", 1) not in tier
    assert tier.discard("h") == 3 and tier.used == 0


def _packed(tmp_path, name="c", tokens=4 * CHUNK, seed=0):
    kv = random_kv(2, tokens, 2, 8, seed=seed)
    pack_kv(kv, tmp_path / name, cartridge_id=name, model="m", kind="first_k",
            token_ids=list(range(tokens)), chunk_size=CHUNK)
    return PackedCartridge(tmp_path / name)


def test_disk_tier_survives_restart_verifies_and_evicts(tmp_path):
    p = _packed(tmp_path)
    h = Handle(p.manifest, LocalOrigin(p.directory))
    size = p.manifest.chunks[0].nbytes
    disk = DiskTier(tmp_path / "cache", budget_bytes=3 * size)
    for i in range(4):
        data = p.read_raw(i)  # payload bytes, as the disk tier holds them
        assert disk.put((p.manifest.content_hash, i), memoryview(data.numpy()))
    # budget of three: chunk 0 (LRU) was evicted, its file deleted
    assert (p.manifest.content_hash, 0) not in disk
    assert not (tmp_path / "cache" / p.manifest.content_hash / "0.chunk").exists()
    # a stray temp file from a crashed write is cleaned up at start; the index is rebuilt
    (tmp_path / "cache" / p.manifest.content_hash / ".2.chunk.999.1").write_bytes(b"partial")
    disk2 = DiskTier(tmp_path / "cache", budget_bytes=3 * size)
    assert sorted(c[1] for c in disk2.keys()) == [1, 2, 3] and disk2.used == 3 * size
    assert not list((tmp_path / "cache" / p.manifest.content_hash).glob(".*"))
    buf = torch.empty(size, dtype=torch.uint8)
    assert disk2.get_into((p.manifest.content_hash, 1), memoryview(buf.numpy()), h)
    assert torch.equal(buf, p.read_raw(1))
    # corruption on disk is detected on the first read after a restart: dropped, reported as a miss
    f = tmp_path / "cache" / p.manifest.content_hash / "2.chunk"
    raw = bytearray(f.read_bytes())
    raw[5] ^= 1
    f.write_bytes(bytes(raw))
    disk3 = DiskTier(tmp_path / "cache", budget_bytes=3 * size)
    assert not disk3.get_into((p.manifest.content_hash, 2), memoryview(buf.numpy()), h)
    assert not f.exists() and (p.manifest.content_hash, 2) not in disk3


def test_disk_write_failure_is_not_fatal(tmp_path):
    """A write that fails (here: the target is a directory) keeps nothing and leaks nothing."""
    p = _packed(tmp_path)
    disk = DiskTier(tmp_path / "cache", budget_bytes=1 << 30)
    blocker = tmp_path / "cache" / p.manifest.content_hash / "0.chunk"
    blocker.mkdir(parents=True)
    data = p.read_chunk(0).reshape(-1).view(torch.uint8)
    assert not disk.put((p.manifest.content_hash, 0), memoryview(data.numpy()))
    assert disk.used == 0 and (p.manifest.content_hash, 0) not in disk
    assert [f.name for f in blocker.parent.iterdir()] == ["0.chunk"]  # no temp file left


class CountingOrigin:
    """A real local origin that counts reads and can be slowed, to observe single flight."""

    def __init__(self, directory, delay=0.0, local=False):
        self.inner = LocalOrigin(directory)
        self.uri, self.local, self.delay, self.reads = str(directory), local, delay, 0
        self._lock = threading.Lock()

    def read_into(self, info, buf):
        with self._lock:
            self.reads += 1
        time.sleep(self.delay)
        self.inner.read_into(info, buf)

    def close(self):
        self.inner.close()


def test_single_flight_one_origin_read_for_concurrent_misses(tmp_path):
    p = _packed(tmp_path)
    origin = CountingOrigin(p.directory, delay=0.3)
    res = Residency(MemoryTier("cpu", 1 << 30), DiskTier(tmp_path / "cache", 1 << 30), Metrics(), prefetch=False)
    h = Handle(p.manifest, origin)
    outs = [torch.empty(p.chunk_shape(1), dtype=torch.bfloat16) for _ in range(8)]
    tiers = [None] * 8

    def worker(i):
        tiers[i] = res.read_into(h, 1, outs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert origin.reads == 1
    assert sorted(tiers).count("s3") == 1  # non-local origin label, one leader
    expected = p.read_chunk(1)
    assert all(torch.equal(o, expected) for o in outs)
    res.close()


def test_promotion_disk_after_restart_and_prefetch(tmp_path):
    p = _packed(tmp_path)
    origin = CountingOrigin(p.directory)
    res = Residency(MemoryTier("cpu", 1 << 30), DiskTier(tmp_path / "cache", 1 << 30), Metrics(), prefetch=True)
    h = Handle(p.manifest, origin)
    out = torch.empty(p.chunk_shape(0), dtype=torch.bfloat16)
    assert res.read_into(h, 0, out) == "s3"
    assert res.read_into(h, 0, out) == "cpu"
    res.prefetch_rest(h)  # what the plugin does once a retrieve's reads are done
    deadline = time.time() + 10
    while len(list((tmp_path / "cache" / h.key).glob("*.chunk"))) < 4 and time.time() < deadline:
        time.sleep(0.05)
    assert origin.reads == 4  # the rest prefetched: each chunk downloaded once
    res.close()
    # "restart": new tiers over the same cache dir serve from disk without touching the origin
    origin2 = CountingOrigin(p.directory)
    res2 = Residency(MemoryTier("cpu", 1 << 30), DiskTier(tmp_path / "cache", 1 << 30), Metrics(), prefetch=False)
    h2 = Handle(p.manifest, origin2)
    for i in range(4):
        assert res2.read_into(h2, i, out) == "disk"
        assert torch.equal(out, p.read_chunk(i))
    assert origin2.reads == 0
    # force_redownload drops disk copies: exactly one new origin read for the chunk asked
    res2.forget(p.manifest.content_hash, disk=True)
    assert res2.read_into(h2, 2, out) == "s3" and origin2.reads == 1
    res2.close()


def test_bad_origin_bytes_are_never_cached(tmp_path):
    p = _packed(tmp_path)
    f = p.payload_path
    raw = bytearray(f.read_bytes())
    raw[p.manifest.chunks[1].offset + 3] ^= 0x40
    f.write_bytes(bytes(raw))
    cpu, disk = MemoryTier("cpu", 1 << 30), DiskTier(tmp_path / "cache", 1 << 30)
    res = Residency(cpu, disk, Metrics(), prefetch=False)
    h = Handle(p.manifest, CountingOrigin(p.directory))
    out = torch.empty(p.chunk_shape(1), dtype=torch.bfloat16)
    with pytest.raises(ChecksumError):
        res.read_into(h, 1, out)
    time.sleep(0.2)
    assert (h.key, 1) not in cpu and h.chunk_id(1) not in disk
    assert res.read_into(h, 0, out) == "s3"  # other chunks still fine
    res.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_tier_on_cuda():
    tier = MemoryTier("gpu", budget_bytes=200, device="cuda")
    assert tier.put(("h", 0), chunk_bytes(100, 1)) and tier.put(("h", 1), chunk_bytes(100, 2))
    assert tier.put(("h", 2), chunk_bytes(100, 3)) and ("h", 0) not in tier
    out = torch.empty(100, dtype=torch.uint8)
    assert tier.get_into(("h", 2), out) and int(out[0]) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_tier_holds_pageable_memory_on_a_cuda_host():
    """The CPU tier only memcpys into LMCache's own (pinned) buffers: pinning our copies bought
    nothing, and the caching host allocator's rounding made the budget wrong (2 GiB per rank)."""
    tier = MemoryTier("cpu", budget_bytes=1 << 20)
    assert tier.put(("h", 0), chunk_bytes(1000, 1))
    assert not tier._chunks[("h", 0)].is_pinned() and tier.used == 1000


def test_s3_chunks_are_verified_on_the_reading_thread_after_every_attempt(tmp_path, moto_server, s3_proxy):
    """Remote bytes are checked once they have all landed, on the thread that read them (no helper
    thread per chunk: starting one cost ~2 ms a chunk in a process with LMCache's threads): a
    body cut short is re-fetched from 0 and its bytes pass; a flipped byte and NaNs whose
    checksum matches are refused and cached nowhere; the other chunks still serve."""
    import hashlib
    import json
    import shutil

    import blake3

    from s3_server import s3_client, upload_dir
    from lmcache_cartridge.store.origins import S3ChunkOrigin
    from lmcache_cartridge.store.s3 import S3Settings

    good = _packed(tmp_path, "good")
    shutil.copytree(tmp_path / "good", tmp_path / "nan")  # chunk 1: a NaN its packer hashed
    payload = bytearray((tmp_path / "nan" / "kv.bin").read_bytes())
    info = good.manifest.chunks[1]
    torch.frombuffer(payload, dtype=torch.bfloat16, offset=info.offset, count=info.nbytes // 2)[3] = float("nan")
    (tmp_path / "nan" / "kv.bin").write_bytes(bytes(payload))
    m = json.loads((tmp_path / "nan" / "manifest.json").read_text())
    m["chunks"][1]["sha256"] = hashlib.sha256(payload[info.offset:info.offset + info.nbytes]).hexdigest()
    m["chunks"][1]["blake3"] = blake3.blake3(payload[info.offset:info.offset + info.nbytes]).hexdigest()
    (tmp_path / "nan" / "manifest.json").write_text(json.dumps(rehash_manifest(m)))
    nan = PackedCartridge(tmp_path / "nan")
    client = s3_client(moto_server)
    for name in ("good", "nan"):
        upload_dir(client, "carts", name, tmp_path / name)
    flipped = bytearray((tmp_path / "good" / "kv.bin").read_bytes())
    flipped[good.manifest.chunks[2].offset + 5] ^= 0x01  # "flip": chunk 2 is not what its manifest says
    client.put_object(Bucket="carts", Key="flip/kv.bin", Body=bytes(flipped))
    client.put_object(Bucket="carts", Key="flip/manifest.json", Body=(tmp_path / "good" / "manifest.json").read_bytes())

    settings = S3Settings(endpoint_url=s3_proxy.endpoint_url, max_attempts=2)
    res = Residency(MemoryTier("cpu", 0), DiskTier(tmp_path / "cache", 1 << 30), Metrics(), prefetch=False)
    handles = {n: Handle(m.manifest, S3ChunkOrigin(f"s3://carts/{n}", settings))
               for n, m in (("good", good), ("flip", good), ("nan", nan))}
    started = []
    real_start = threading.Thread.start

    reader = threading.current_thread()

    def counting_start(self, *a, **k):  # the real start, counted when the reading thread starts one
        if threading.current_thread() is reader:  # (the proxy's server starts its own per request)
            started.append(self.name)
        return real_start(self, *a, **k)

    out = torch.empty(good.manifest.chunks[0].nbytes, dtype=torch.uint8)

    def expected(i):  # the payload's bytes in the engine's layout
        e = torch.empty_like(out)
        handles["good"].view.to_engine(i, good.read_raw(i), e)
        return e

    cut = s3_proxy.inject(method="GET", path=r"/good/kv\.bin", cut_after=100, times=1)
    threading.Thread.start = counting_start
    try:
        for i in range(4):  # chunk 0's first body ends after 100 bytes: fetched again, whole
            assert res.read_into(handles["good"], i, out, network=True) == "s3"
            assert torch.equal(out, expected(i)), i
    finally:
        threading.Thread.start = real_start
    assert cut.hits == 1 and s3_proxy.count("GET", r"/good/kv\.bin$") == 5
    res.close()
    # verification ran on this thread (the pool that writes the disk cache behind starts its worker)
    assert [t for t in started if not t.startswith("cartridge-prefetch")] == []
    # "flip" has good's content hash, and another origin: good's disk copies are not its own
    res = Residency(MemoryTier("cpu", 0), DiskTier(tmp_path / "cache2", 1 << 30), Metrics(), prefetch=False)
    for name, i, needle in (("flip", 2, r"chunk 2 checksum mismatch \(blake3"), ("nan", 1, "NaN or Inf")):
        with pytest.raises(ChecksumError, match=needle):
            res.read_into(handles[name], i, out, network=True)
        cid = (handles[name].key, i)
        assert cid not in res.disk and cid not in res.cpu
    assert res.read_into(handles["flip"], 1, out, network=True) == "s3"
    assert torch.equal(out, expected(1))
    res.close()
    for h in handles.values():
        h.origin.close()


def _kv_2ltd(h, i, raw):
    e = torch.empty(h.view.engine_nbytes(i), dtype=torch.uint8)
    h.view.to_engine(i, raw, e)
    return e


def test_layout_conversion_reuses_scratch_buffers_of_mixed_sizes(tmp_path):
    """Chunks of two sizes (a short last chunk) read by threads at once: every read converts the
    right bytes, whichever kept scratch buffer it takes (the larger one sitting behind a smaller)."""
    from concurrent.futures import ThreadPoolExecutor

    p = _packed(tmp_path, tokens=3 * CHUNK + 5)  # chunks of CHUNK, CHUNK, CHUNK and 5 tokens
    h = Handle(p.manifest, LocalOrigin(p.directory))
    assert not h.view.identity  # by_head with 2 heads: every read converts
    res = Residency(MemoryTier("cpu", 0), None, Metrics(), prefetch=False)

    want = {i: _kv_2ltd(h, i, p.read_raw(i)) for i in range(4)}
    res._spare[:] = [torch.empty(16, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8)]
    out = torch.empty(h.view.engine_nbytes(0), dtype=torch.uint8)
    res.read_into(h, 0, out, network=False)  # takes the second, larger spare
    assert torch.equal(out, want[0]) and len(res._spare) == 2

    def read(i):
        got = torch.empty(h.view.engine_nbytes(i), dtype=torch.uint8)
        res.read_into(h, i, got, network=False)
        return torch.equal(got, want[i])

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(read, [i % 4 for i in range(200)]))
    assert len(res._spare) <= residency._SPARE_SCRATCH
    res.close()


def _reversing_encoder(seen):
    def encode(dst, src):  # an engine layout: the KV_2LTD values' bytes reversed; who gave them
        seen.append(src)
        dst.reshape(-1).view(torch.uint8).copy_(src.reshape(-1).view(torch.uint8).flip(0))
    return encode


def test_an_encoded_read_of_a_local_chunk_encodes_the_payload_in_place_and_keeps_nothing(tmp_path):
    """`encode` (a memory object holding an engine layout) for a local origin's by-head chunk gets
    the payload's values where they were read (a permuted view, nothing converted first), and the
    CPU tier keeps nothing for it (the page cache holds the file, LMCache the encoded object); a
    chunk the CPU tier already holds (a plain read put it there) is encoded from the kept bytes."""
    p = _packed(tmp_path, tokens=2 * CHUNK)
    h = Handle(p.manifest, LocalOrigin(p.directory))
    assert not h.view.identity  # two heads, by head: KV_2LTD would need a conversion
    res = Residency(MemoryTier("cpu", 1 << 24), None, Metrics(), prefetch=True)
    seen = []
    encode = _reversing_encoder(seen)
    plain = torch.empty(h.view.engine_nbytes(0), dtype=torch.uint8)
    assert res.read_into(h, 0, plain, network=False) == "local"  # no encoder: the tier keeps KV_2LTD
    for i, tier in ((1, "local"), (0, "cpu")):
        out = torch.empty(h.view.engine_shape(i), dtype=torch.bfloat16)
        assert res.read_into(h, i, out, network=False, encode=encode) == tier
        assert torch.equal(out.reshape(-1).view(torch.uint8), _kv_2ltd(h, i, p.read_raw(i)).flip(0))
        src = seen[-1]
        if tier == "local":
            assert src.dim() == 5 and not src.is_contiguous()  # the by-head payload, permuted
            assert (h.key, 1) not in res.cpu
        else:
            assert src.data_ptr() == res.cpu._chunks[(h.key, 0)].data_ptr()
    assert res.cpu.keys() == [(h.key, 0)]
    # a prefetch once the retrieve is done does not bring back what the encoded read verified
    assert res.warm(h) == 0 and res.cpu.keys() == [(h.key, 0)]
    assert res.warm(h, preload=True) == 1 and (h.key, 1) in res.cpu  # a preload keeps it
    res.close()


def test_an_encoded_read_of_a_remote_chunk_keeps_kv_2ltd_in_the_cpu_tier(tmp_path):
    """Below the CPU tier for a remote origin, the chunk is converted into a buffer the tier then
    keeps (no copy of it) and encoded from that; with no room, from scratch, nothing kept."""
    p = _packed(tmp_path, tokens=2 * CHUNK)
    h = Handle(p.manifest, CountingOrigin(p.directory))
    seen = []
    encode = _reversing_encoder(seen)
    for budget in (1 << 24, 0):
        res = Residency(MemoryTier("cpu", budget), None, Metrics(), prefetch=False)
        out = torch.empty(h.view.engine_shape(1), dtype=torch.bfloat16)
        assert res.read_into(h, 1, out, network=True, encode=encode) == "s3"
        want = _kv_2ltd(h, 1, p.read_raw(1))
        assert torch.equal(out.reshape(-1).view(torch.uint8), want.flip(0))
        if budget:
            kept = res.cpu._chunks[(h.key, 1)]
            assert torch.equal(kept, want) and seen[-1].data_ptr() == kept.data_ptr()
            assert res.read_into(h, 1, out, network=True, encode=encode) == "cpu"
            assert seen[-1].data_ptr() == kept.data_ptr()
        else:
            assert not res.cpu.keys()
        res.close()


def test_a_kept_buffer_is_adopted_only_when_asked():
    tier = MemoryTier("cpu", 1 << 20)
    a, b = torch.arange(64, dtype=torch.uint8), torch.arange(64, dtype=torch.uint8)
    assert tier.put(("x", 0), a) and tier.put(("x", 1), b, adopt=True)
    assert tier._chunks[("x", 0)].data_ptr() != a.data_ptr()  # a copy
    assert tier._chunks[("x", 1)].data_ptr() == b.data_ptr()  # kept as it is
    assert tier.fits(64) and not tier.fits(2 << 20) and not MemoryTier("cpu", 0).fits(64)


def test_hold_local_holds_only_what_the_disk_tier_alone_has(tmp_path):
    """`Residency.hold_local` (a pinned lookup): a local origin's chunk and a CPU-tier chunk are
    local with no hold; a remote chunk only on disk is local with a hold that keeps its file
    from eviction until released; a remote chunk nowhere local is not."""
    from test_disk_cache_multiproc import _RemoteOrigin

    p = _packed(tmp_path)
    size = p.manifest.chunks[0].nbytes
    res = Residency(MemoryTier("cpu", 1 << 20), DiskTier(tmp_path / "cache", 2 * size), Metrics(), prefetch=False)
    local, remote = Handle(p.manifest, LocalOrigin(p.directory)), Handle(p.manifest, _RemoteOrigin(p.directory))
    assert res.hold_local(local, 3) == (True, None)
    res.disk.put(remote.chunk_id(0), memoryview(p.read_raw(0).numpy()))
    res.disk.put(remote.chunk_id(1), memoryview(p.read_raw(1).numpy()))
    res.cpu.put((remote.key, 1), torch.empty(size, dtype=torch.uint8))
    assert res.hold_local(remote, 1) == (True, None)  # the CPU tier has it (the caller pinned it there)
    ok, hold = res.hold_local(remote, 0)
    assert ok and hold is not None and hold.held
    assert res.hold_local(remote, 2) == (False, None)
    assert res.disk.put(remote.chunk_id(2), memoryview(p.read_raw(2).numpy()))
    assert remote.chunk_id(0) in res.disk and remote.chunk_id(1) not in res.disk  # 0 is the LRU, but held
    hold.release()
    assert res.disk.put(remote.chunk_id(3), memoryview(p.read_raw(3).numpy()))
    assert remote.chunk_id(0) not in res.disk  # released: the LRU victim now
    res.close()


def test_ranks_served_by_one_process_get_and_verify_their_own_heads(tmp_path):
    """MP mode serves every rank from one process, so one `Residency`: a rank's chunk in the CPU
    tier is its heads only, and a span's check covers only its heads' bytes. Each rank gets its
    own heads, and a rank whose heads are bad is refused even after another rank verified its
    own heads of the same chunk (keyed by content and origin alone, rank 1 got rank 0's bytes
    from the CPU tier, and its bad heads were served unchecked)."""
    from lmcache_cartridge.cartridge.tp import RankView

    p = _packed(tmp_path, tokens=2 * CHUNK)  # two heads, by head
    m, d = p.manifest, p.manifest.head_dim
    whole = torch.empty(Handle(m, LocalOrigin(p.directory)).view.engine_shape(0), dtype=torch.bfloat16)
    Residency(MemoryTier("cpu", 0), None, Metrics(), prefetch=False).read_into(
        Handle(m, LocalOrigin(p.directory)), 0, whole, network=False)
    res = Residency(MemoryTier("cpu", 1 << 24), None, Metrics(), prefetch=False)
    for r, tier in ((0, "local"), (1, "local"), (0, "cpu"), (1, "cpu")):
        h = Handle(m, LocalOrigin(p.directory), view=RankView.of(m, 2, r))
        out = torch.empty(h.view.engine_shape(0), dtype=torch.bfloat16)
        assert res.read_into(h, 0, out, network=False) == tier
        assert torch.equal(out, whole[..., r * d:(r + 1) * d]), (r, tier)
    res.close()

    raw = bytearray(p.payload_path.read_bytes())  # head 1 of chunk 1: the second half, by head
    info = m.chunks[1]
    raw[info.offset + info.nbytes // 2 + 3] ^= 0x40
    p.payload_path.write_bytes(bytes(raw))
    res = Residency(MemoryTier("cpu", 0), None, Metrics(), prefetch=False)  # MP mode: no CPU tier
    h0, h1 = (Handle(m, LocalOrigin(p.directory), view=RankView.of(m, 2, r)) for r in (0, 1))
    assert res.read_into(h0, 1, torch.empty(h0.view.engine_shape(1), dtype=torch.bfloat16), network=False) == "local"
    with pytest.raises(ChecksumError):
        res.read_into(h1, 1, torch.empty(h1.view.engine_shape(1), dtype=torch.bfloat16), network=False)
    res.close()

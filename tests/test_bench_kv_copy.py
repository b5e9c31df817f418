"""benchmarks/kv_copy.py at a tiny size: correctness only (no timing is asserted). The connector
LMCache calls on retrieve (native kernel and pure-torch fallback) must leave vLLM's CPU paged KV
byte-identical to what vLLM's own C++ writer (`cpu_attn_reshape_and_cache`) leaves for the same
tokens and slots, for each ISA whose writer runs here."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kv_copy  # noqa: E402

from lmcache_cartridge.vllm import native  # noqa: E402


def test_connector_writes_what_vllm_writes():
    r = kv_copy.run(tokens=512, layers=2, kv_heads=2, head_dim=128, block_size=128, reps=1)
    ours, fallback, theirs = r["caches"]["ours"], r["caches"]["ours-torch"], r["caches"]["vllm-op"]
    blocks = r["caches"]["ours-blocks"]
    assert len(ours) == 2
    for a, f, k, b in zip(ours, fallback, blocks, theirs):
        assert a[1:5].any()  # the four blocks the 512 tokens occupy were written
        assert torch.equal(a.view(torch.uint16), b.view(torch.uint16))
        assert torch.equal(f.view(torch.uint16), b.view(torch.uint16))
        assert torch.equal(k.view(torch.uint16), b.view(torch.uint16))
        assert not a[0].any() and not a[5:].any()  # and nothing else
    assert r["engine_block_copies"] > 0  # the block arm copied whole blocks
    extra = {"ours-sse2"} if native.simd() == "avx512" else set()  # AVX-512 CPUs: both levels
    assert set(r["arms"]) == {"ours-blocks", "encode", "encode-packed", "ours", "ours-torch", "vllm-op",
                              "transpose", "memcpy"} | extra
    assert_encoded_alike(r)
    for a, b in zip(r["caches"].get("ours-sse2", []), theirs):
        assert torch.equal(a.view(torch.uint16), b.view(torch.uint16))
    assert all(x["seconds"] > 0 for x in r["arms"].values())


def assert_encoded_alike(r):
    """Objects encoded from the packed by-head payload in place hold the bytes of those encoded
    from `KV_2LTD`, which the `ours-blocks` arm loaded into caches equal to vLLM's writer's."""
    assert len(r["objects"]["encode-packed"]) == len(r["objects"]["encode"]) > 0
    for a, b in zip(r["objects"]["encode"], r["objects"]["encode-packed"]):
        assert a.any() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("isa", ["vec16", "amx"])
def test_every_isa_arm_writes_what_vllm_writes(isa):
    """Each ISA arm whose writer runs on this machine (vLLM's own pick always does; another is
    tried in a child process first, as tests/test_cpu_kv.py does: "amx" needs AMX, and on
    AVX2-only machines vLLM's AVX2 build has no "amx" writer at all)."""
    from test_cpu_kv import writer_in_subprocess

    from lmcache_cartridge.vllm.cpu_kv import current_attn_isa

    if isa != current_attn_isa(torch.bfloat16, 128, 64):
        rc, last = writer_in_subprocess(isa)
        if rc != 0:
            pytest.skip(f"vLLM's '{isa}' writer does not run on this machine: rc {rc}: {last}")
    r = kv_copy.run(tokens=256, layers=1, kv_heads=2, head_dim=64, block_size=128, reps=1, isa=isa)
    assert r["isa"] == isa
    assert_encoded_alike(r)
    for name in set(r["caches"]) - {"vllm-op"}:
        for a, b in zip(r["caches"][name], r["caches"]["vllm-op"]):
            assert a.any() and torch.equal(a.view(torch.uint16), b.view(torch.uint16)), (isa, name)

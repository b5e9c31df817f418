"""benchmarks/kv_copy.py at a tiny size: correctness only (no timing is asserted). The connector
LMCache calls on retrieve must leave vLLM's CPU paged KV byte-identical to what vLLM's own C++
writer (`cpu_attn_reshape_and_cache`) leaves for the same tokens and slots."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kv_copy  # noqa: E402


def test_connector_writes_what_vllm_writes():
    r = kv_copy.run(tokens=512, layers=2, kv_heads=2, head_dim=128, block_size=128, reps=1)
    ours, theirs = r["caches"]["ours"], r["caches"]["vllm-op"]
    assert len(ours) == 2
    for a, b in zip(ours, theirs):
        assert a[1:5].any()  # the four blocks the 512 tokens occupy were written
        assert torch.equal(a.view(torch.uint16), b.view(torch.uint16))
        assert not a[0].any() and not a[5:].any()  # and nothing else
    assert set(r["arms"]) == {"ours", "vllm-op", "transpose", "memcpy"}
    assert all(x["seconds"] > 0 for x in r["arms"].values())

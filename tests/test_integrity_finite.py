"""The NaN/Inf scan of first-read verification (`cartridge/integrity._all_finite`) reads the
exponent bits directly (much faster than `torch.isfinite`): it must agree with `torch.isfinite`
on every 16-bit pattern and on fp32's edge cases, and `check_chunk` must still refuse NaNs."""

from __future__ import annotations

import hashlib

import pytest
import torch

from lmcache_cartridge.cartridge.integrity import _all_finite, check_chunk
from lmcache_cartridge.cartridge.manifest import ChunkInfo
from lmcache_cartridge.errors import ChecksumError


def _one(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16_bit_pattern_agrees_with_torch_isfinite(dtype):
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = patterns.view(dtype)
    expected = torch.isfinite(values)
    assert 0 < int(expected.sum()) < len(values)
    for i in range(len(values)):  # one element at a time: the scan's answer for that pattern
        assert _all_finite(_one(values[i:i + 1]), dtype) == bool(expected[i]), hex(int(patterns[i]))
    assert not _all_finite(_one(values), dtype)
    assert _all_finite(_one(values[expected]), dtype)


def test_float32_edges_agree_with_torch_isfinite():
    f32 = torch.finfo(torch.float32)
    vals = [0.0, -0.0, 1.0, f32.max, -f32.max, f32.tiny, 1e-45, float("inf"), float("-inf"), float("nan")]
    bits = torch.tensor(vals, dtype=torch.float32).view(torch.int32)
    extra = torch.tensor([0x7F800001, 0x7FC00000, -1, 0x7F7FFFFF, -0x00800001], dtype=torch.int32)
    for b in torch.cat([bits, extra]):
        v = b.reshape(1).view(torch.float32)
        assert _all_finite(_one(v), torch.float32) == bool(torch.isfinite(v).all()), hex(int(b))


def test_check_chunk_refuses_nans_whose_checksum_matches():
    t = torch.randn(4096).to(torch.bfloat16)
    t[1234] = float("nan")
    buf = _one(t)
    info = ChunkInfo(3, 0, len(buf), 4096, hashlib.sha256(buf).hexdigest())
    with pytest.raises(ChecksumError, match="NaN or Inf"):
        check_chunk(info, buf, "test", torch.bfloat16)
    t[1234] = 0.5
    buf = _one(t)
    check_chunk(ChunkInfo(3, 0, len(buf), 4096, hashlib.sha256(buf).hexdigest()), buf, "test",
                torch.bfloat16)

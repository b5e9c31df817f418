"""`make test-avx2`'s emulation (tests/emulate_avx2) does what it claims in a fresh process: torch
reports no AVX-512/AMX, vLLM loads its AVX2 kernel build and picks the "vec" attention ISA."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

PROBE = """
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
from lmcache_cartridge.vllm.cpu_kv import current_attn_isa
lib = [l.split()[-1].rsplit('/', 1)[-1] for l in open('/proc/self/maps') if '/vllm/_C' in l][:1]
print(torch.cpu._is_avx512_supported(), torch.cpu._is_amx_tile_supported(),
      torch.backends.cpu.get_cpu_capability(), current_attn_isa(torch.bfloat16, 128, 64), lib[0])
"""


def test_emulated_avx2_process_is_what_vllm_sees_on_an_avx2_cpu():
    env = {**os.environ, "LMCACHE_CARTRIDGE_EMULATE_AVX2": "1", "ATEN_CPU_CAPABILITY": "avx2",
           "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": str(Path(__file__).parent / "emulate_avx2")}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-5:] == ["False", "False", "AVX2", "vec", "_C_AVX2.abi3.so"], out.stdout

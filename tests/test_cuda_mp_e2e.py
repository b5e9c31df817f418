"""LMCache's multiprocess mode end to end on a CUDA machine: a REAL `lmcache server` with the
cartridge L2 adapter and a REAL CUDA vLLM on `CartridgeMPConnector`, LMCache-driven transfer (the
server copies into vLLM's GPU cache through CUDA IPC, the transfer CUDA engines use), the tiny
peaked test model. Skipped without CUDA or without a CUDA vLLM (as `test_cuda_vllm_e2e`).

vLLM >= 0.26 gives the server a fused K|V cache, whose MP objects are plain per-head K|V rows
(`lmcache.mp_layout.FUSED_ROWS`, told from vLLM-CPU's rows by the engine's registration): a
trained cartridge served so must answer as HF transformers given the same KV (`test_vllm_e2e`'s
tolerances), and its heads swapped must not; vLLM's own KV stored in the server and read back must
give the same text.
"""

from __future__ import annotations

import time

import pytest
import torch

from test_cuda_vllm_e2e import _cuda_vllm

_why = _cuda_vllm()
pytestmark = [pytest.mark.slow, pytest.mark.gpu]
if _why is not None:
    pytest.skip(_why, allow_module_level=True)

import test_vllm_e2e as e2e  # noqa: E402
from e2e_server import Server  # noqa: E402
from test_vllm_e2e import hf  # noqa: E402,F401  (the HF model fixture)


@pytest.fixture(scope="module")
def mp(tmp_path_factory):
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.launch import MpVllmServer
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    root = tmp_path_factory.mktemp("cuda_mp")
    registry = Registry(root / "registry.db")
    srv = MpVllmServer(root / "vllm", str(ensure_test_model()), registry=registry.path, cache_dir=root / "cache",
                       transfer_mode="lmcache_driven", chunk_size=e2e.CHUNK,
                       extra_args=("--gpu-memory-utilization", "0.3"))
    try:
        srv.wait_healthy(timeout=600)
        print(f"\n[cuda mp] vLLM healthy after {srv.startup_s:.1f}s (log {srv.log_path})")
        yield {"vllm": srv, "registry": registry, "root": root}
    finally:
        srv.stop()


def complete(srv, prompt: list[int]) -> dict:
    return Server.complete(srv, prompt)  # the CPU harness's greedy completion with logprobs


def test_trained_cartridge_in_mp_mode_matches_hf_and_swapped_heads_do_not(mp, hf):
    from lmcache_cartridge.cartridge.packed import PackedCartridge, VocabInfo, pack_kv

    srv, reg, root = mp["vllm"], mp["registry"], mp["root"]
    model, tok = hf
    user = e2e.user_ids(tok)
    vocab = VocabInfo(model.config.vocab_size, (0, 1, 2, 3))
    kv = e2e._trained_kv(11)
    swapped = kv[:, :, :, [1, 0]].contiguous()
    pack_kv(kv, root / "tr", cartridge_id="mp-trained", model=srv.model, kind="trained", vocab=vocab,
            chunk_size=e2e.CHUNK)
    pack_kv(swapped, root / "sw", cartridge_id="mp-swapped", model=srv.model, kind="trained", vocab=vocab,
            chunk_size=e2e.CHUNK)
    ids = PackedCartridge(root / "tr").manifest.token_ids
    ids_sw = PackedCartridge(root / "sw").manifest.token_ids
    srv.wait_served([reg.register(root / "tr"), reg.register(root / "sw")])

    ext0 = srv.external_tokens()
    got = complete(srv, ids + user)
    assert srv.external_tokens() - ext0 == e2e.CHUNK, srv.lmcache_server.log_tail()
    gen = e2e.token_ids_of(srv, tok, got)
    _, lp_bf16, best = e2e.hf_teacher_forced(model, kv, user, gen, torch.bfloat16)
    lp = got["logprobs"]
    print(f"\n[cuda mp trained] vLLM vs HF bf16: max |dlogprob| {e2e.max_diff(lp, lp_bf16):.4f} "
          f"mean {e2e.mean_diff(lp, lp_bf16):.4f}")
    assert e2e.mean_diff(lp, lp_bf16) <= e2e.HF_MEAN_TOL
    assert e2e.max_diff(lp, lp_bf16) <= e2e.HF_MAX_TOL
    assert all(b - c <= e2e.HF_MAX_TOL for b, c in zip(best, lp_bf16)), gen

    neg = complete(srv, ids_sw + user)
    gen_neg = e2e.token_ids_of(srv, tok, neg)
    _, lp_orig, _ = e2e.hf_teacher_forced(model, kv, user, gen_neg, torch.bfloat16)
    assert neg["text"] != got["text"]
    assert e2e.mean_diff(neg["logprobs"], lp_orig) >= e2e.NEG_MIN_MEAN


def test_vllms_own_kv_stored_in_the_server_reloads_with_the_same_text(mp, hf):
    srv = mp["vllm"]
    model, _ = hf
    g = torch.Generator().manual_seed(21)
    prompt = [1] + torch.randint(4, model.config.vocab_size, (e2e.CHUNK + 40,), generator=g).tolist()
    first = Server.complete(srv, prompt, skip_save=False)  # computed; its whole chunk is stored in the server
    time.sleep(1.0)  # the server's store is asynchronous
    ext0 = srv.external_tokens()
    second = complete(srv, prompt)
    assert srv.external_tokens() - ext0 == e2e.CHUNK, srv.lmcache_server.log_tail()
    d = e2e.max_diff(first["logprobs"], second["logprobs"])
    print(f"\n[cuda mp store/reload] max |dlogprob| {d:.4f}")
    assert second["text"] == first["text"]
    assert d <= e2e.FIRST_K_MAX_TOL


def test_engine_and_server_alive(mp):
    srv = mp["vllm"]
    assert srv.proc.poll() is None and srv.lmcache_server.proc.poll() is None
    assert "EngineDeadError" not in srv.log_text()
    assert "Traceback" not in srv.lmcache_server.log_text(), srv.lmcache_server.log_tail()

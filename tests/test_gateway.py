"""Gateway request handling that needs no upstream: validation, resolution, prompt building.
The forwarding path is exercised against a real vLLM server in the end-to-end tests."""

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch

from conftest import random_kv
from lmcache_cartridge.api.gateway import CartridgeRef, GatewaySettings, PromptBuilder, RequestError, Resolver, chain_prefix, create_app, parse_refs
from lmcache_cartridge.cartridge.manifest import Manifest
from lmcache_cartridge.cartridge.packed import pack_kv
from lmcache_cartridge.store.registry import Registry
from lmcache_cartridge.tools.testmodel import ensure_test_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ensure_test_model(tmp_path_factory.mktemp("models")))


@pytest.fixture
def settings(tmp_path, model_dir):
    (tmp_path / "allowed").mkdir()
    return GatewaySettings(upstream="http://127.0.0.1:9", model=model_dir, tokenizer=model_dir,
                           registry=tmp_path / "reg.db", cache_dir=tmp_path / "cache", chunk_size=32,
                           local_roots=(tmp_path / "allowed",), max_cartridges=3, max_body_bytes=20000)


def _cart(path, cid, tokens, model, seed=0):
    kv = random_kv(2, len(tokens), 2, 64, seed=seed)
    return pack_kv(kv, path, cartridge_id=cid, model=model, kind="first_k", token_ids=tokens, chunk_size=32)


def test_parse_refs_limits(settings):
    assert parse_refs(None, settings) == []
    assert parse_refs([{"id": "a", "source": "s3", "force_redownload": True}], settings) == [CartridgeRef("a", "s3", True)]
    bad = [
        ("x", "must be a list"), ([{"id": "a"}] * 4, "too many cartridges"), ([5], "must be an object"),
        ([{"id": ""}], "non-empty string"), ([{"id": "a" * 2000}], "longer than"),
        ([{"id": "a", "source": "ftp"}], "'s3' or 'local'"), ([{"id": "a", "force_redownload": "yes"}], "true or false"),
        ([{"id": "a", "extra": 1}], "unknown fields"),
    ]
    for raw, needle in bad:
        with pytest.raises(RequestError, match=needle) as e:
            parse_refs(raw, settings)
        assert e.value.status == 400


def test_chain_prefix_rules(tmp_path, model_dir):
    a = _cart(tmp_path / "a", "sys", list(range(1, 33)), model_dir)
    b = _cart(tmp_path / "b", "doc", list(range(1, 65)), model_dir)
    c = _cart(tmp_path / "c", "other", list(range(100, 132)), model_dir)
    assert chain_prefix([a, b]) == b.token_ids
    assert chain_prefix([a]) == a.token_ids
    with pytest.raises(RequestError, match="cannot be combined"):
        chain_prefix([a, c])
    with pytest.raises(RequestError, match="cannot be combined"):
        chain_prefix([b, a])


def test_resolver_local_paths_ids_and_models(tmp_path, settings, model_dir):
    reg = Registry(settings.registry)
    r = Resolver(settings, reg)
    _cart(tmp_path / "allowed" / "doc", "doc", list(range(1, 65)), model_dir)
    entry, m = r.resolve(CartridgeRef(str(tmp_path / "allowed" / "doc"), "local"))
    assert entry.id == "doc" and reg.get("doc") is not None  # registered so servers pick it up
    assert r.resolve(CartridgeRef("doc"))[1].cartridge_id == "doc"
    _cart(tmp_path / "outside", "outside", list(range(1, 33)), model_dir)
    for ref, status in [
        (CartridgeRef(str(tmp_path / "outside"), "local"), 403),
        (CartridgeRef(str(tmp_path / "allowed" / ".." / "outside"), "local"), 403),  # traversal
        (CartridgeRef(str(tmp_path / "allowed" / "missing"), "local"), 404),
        (CartridgeRef("no-such-id"), 404),
    ]:
        with pytest.raises(RequestError) as e:
            r.resolve(ref)
        assert e.value.status == status, (ref, e.value)
    _cart(tmp_path / "allowed" / "wrong", "wrong", list(range(1, 33)), "another/model")
    with pytest.raises(RequestError, match="made for model 'another/model'") as e:
        r.resolve(CartridgeRef(str(tmp_path / "allowed" / "wrong")))
    assert e.value.status == 400


def test_resolver_packs_seed000_pt_files(tmp_path, settings, model_dir):
    r = Resolver(settings, Registry(settings.registry))
    pt = tmp_path / "allowed" / "sys.pt"
    torch.save({"token_ids": [1] + list(range(300, 331)), "metadata": {"description": "system prompt"}}, pt)
    entry, m = r.resolve(CartridgeRef(str(pt), "local"))
    assert m.kind == "first_k" and m.num_tokens == 32 and m.token_ids[0] == 1
    # the KV was computed with the model: equal to create's computation for those tokens
    from lmcache_cartridge.cartridge.model_kv import compute_prefix_kv, load_model
    from lmcache_cartridge.cartridge.packed import PackedCartridge

    model, _ = load_model(model_dir)
    assert torch.equal(PackedCartridge(entry.path).load_kv(), compute_prefix_kv(model, m.token_ids))
    again, _ = r.resolve(CartridgeRef(str(pt), "local"))  # content-addressed: packed once
    assert again.path == entry.path


def test_prompt_builder_puts_cartridge_first_and_owns_bos(model_dir):
    pb = PromptBuilder(model_dir)
    prefix = [1, 50, 60]
    ids = pb.completion_ids("Hello there", prefix)
    assert ids[:3] == prefix and ids[3:] == pb.tok("Hello there", add_special_tokens=False)["input_ids"]
    assert pb.completion_ids("Hello", [])[0] == 1  # no cartridge: ordinary BOS
    chat = pb.chat_ids([{"role": "user", "content": "Hi"}], prefix)
    plain = pb.chat_ids([{"role": "user", "content": "Hi"}], [])
    assert plain[0] == 1 and chat == prefix + plain[1:]
    with pytest.raises(RequestError):
        pb.completion_ids({"x": 1}, prefix)
    with pytest.raises(RequestError):
        pb.chat_ids([{"role": "user"}], prefix)


def _call(app, method, path, **kw):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "invalid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"prompt": "x", "cartridges": [{"id": "ghost"}]}).encode(), 404, "ghost"),
    (json.dumps({"prompt": "x", "cartridges": "ghost"}).encode(), 400, "must be a list"),
    (json.dumps({"prompt": "x", "cartridges": [{"id": "a"}] * 9}).encode(), 400, "too many"),
    (json.dumps({"prompt": "x" * 30000}).encode(), 413, "over 20000 bytes"),
    (json.dumps({"cartridges": []}).encode(), 400, "'prompt' is required"),
    (json.dumps({"prompt": 3.5}).encode(), 400, "'prompt' must be"),
    (json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), 404, "not served here"),
    (json.dumps({"prompt": "x", "cartridges": [{"id": "s3://AB/x"}]}).encode(), 400, "bucket"),
    (json.dumps({"prompt": "x", "cartridges": [{"id": "/a\u0000b"}]}).encode(), 400, "null"),
])
def test_bad_requests_are_4xx_with_a_message(settings, body, status, needle):
    app = create_app(settings)
    r = _call(app, "POST", "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_bad_chat_and_unreachable_upstream(settings):
    app = create_app(settings)
    r = _call(app, "POST", "/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = _call(app, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "logprobs": True, "top_logprobs": "3"})
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"]
    # a local id whose file name is too long for the file system: a 400, not a crash
    long_id = str(settings.local_roots[0] / ("a" * 300))
    r = _call(app, "POST", "/v1/completions", json={"prompt": "hi", "cartridges": [{"id": long_id}]})
    assert r.status_code == 400 and "File name too long" in r.json()["error"]["message"], r.text
    r = _call(app, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
    assert _call(app, "GET", "/health").status_code == 503

"""Gateway request handling that needs no upstream: validation, resolution (local, registry, S3 on
a loopback moto server), the resolution cache, composition and prompt building. The forwarding
path and the served KV are exercised against a real vLLM server in test_gateway_e2e."""

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch

from conftest import random_kv
from http_stub import JsonUpstream
from lmcache_cartridge.api.gateway import GatewaySettings, RequestError, create_app
from lmcache_cartridge.api.prompts import PromptBuilder
from lmcache_cartridge.api.requests import CartridgeSpec
from lmcache_cartridge.api.resolver import Resolver
from lmcache_cartridge.cartridge.manifest import Manifest, id_from_name
from lmcache_cartridge.cartridge.packed import PackedCartridge, VocabInfo, pack_kv
from lmcache_cartridge.store.origins import open_origin
from lmcache_cartridge.store.registry import Registry
from lmcache_cartridge.tools.testmodel import ensure_test_model
from s3_server import s3_client

CHUNK = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(ensure_test_model(tmp_path_factory.mktemp("models")))


@pytest.fixture
def settings(tmp_path, model_dir):
    (tmp_path / "allowed").mkdir()
    return GatewaySettings(upstream="http://127.0.0.1:9", model=model_dir, tokenizer=model_dir,
                           registry=tmp_path / "reg.db", cache_dir=tmp_path / "cache", chunk_size=CHUNK,
                           local_roots=(tmp_path / "allowed",), s3_roots=("gw-unit/ok",),
                           max_cartridges=3, max_body_bytes=20000)


def spec(id, **kw):
    return CartridgeSpec(id=id, **kw)


def _cart(path, cid, tokens, model, seed=0, chunk=CHUNK):
    kv = random_kv(2, len(tokens), 2, 64, seed=seed)
    return pack_kv(kv, path, cartridge_id=cid, model=model, kind="first_k", token_ids=tokens, chunk_size=chunk)


def _trained(path, cid, model, chunks=1, seed=0):
    kv = random_kv(2, chunks * CHUNK, 2, 64, seed=seed)
    return kv, pack_kv(kv, path, cartridge_id=cid, model=model, kind="trained", vocab=VocabInfo(500, (0, 1, 2)),
                       chunk_size=CHUNK)


def test_resolver_local_paths_ids_and_models(tmp_path, settings, model_dir):
    reg = Registry(settings.registry)
    r = Resolver(settings, reg)
    _cart(tmp_path / "allowed" / "doc", "doc", list(range(1, 65)), model_dir)
    got = r.resolve(spec(str(tmp_path / "allowed" / "doc"), source="local"))
    assert got.entry.id == "doc" and got.kind == "first_k" and reg.get("doc") is not None
    assert r.resolve(spec("doc")).manifest.cartridge_id == "doc"  # bare id: default source s3 -> registry
    _cart(tmp_path / "outside", "outside", list(range(1, 33)), model_dir)
    for ref, status in [
        (spec(str(tmp_path / "outside"), source="local"), 403),
        (spec(str(tmp_path / "allowed" / ".." / "outside"), source="local"), 403),  # traversal
        (spec(str(tmp_path / "allowed" / "missing"), source="local"), 404),
        (spec("no-such-id"), 404),
        (spec(str(tmp_path / "allowed" / "doc"), source="s3"), 400),  # a path, but source s3
        (spec("relative/path", source="local"), 400),
        (spec("http://example.com/x.pt"), 400),
    ]:
        with pytest.raises(RequestError) as e:
            r.resolve(ref)
        assert e.value.status == status, (ref, e.value)


def test_compatibility_is_the_compat_rule_with_accept_models(tmp_path, settings, model_dir):
    """The gateway refuses exactly what the plugin would refuse (compat.mismatch), and accepts a
    cartridge made under one of the engine's accept_models names (it refused those before)."""
    from dataclasses import replace

    _cart(tmp_path / "allowed" / "alias", "alias", list(range(1, 33)), "meta-llama/Llama-3.1-8B")
    _cart(tmp_path / "allowed" / "c64", "c64", list(range(1, 65)), model_dir, chunk=64)
    r = Resolver(settings, Registry(settings.registry))
    with pytest.raises(RequestError, match="made for model 'meta-llama/Llama-3.1-8B', engine serves") as e:
        r.resolve(spec(str(tmp_path / "allowed" / "alias"), source="local"))
    assert e.value.status == 400
    with pytest.raises(
        RequestError, match="packed with chunk_size 64, engine uses 32; re-register with --chunk-size 32"
    ):
        r.resolve(spec(str(tmp_path / "allowed" / "c64"), source="local"))
    r = Resolver(replace(settings, accept_models=("meta-llama/Llama-3.1-8B",)), Registry(settings.registry))
    assert r.resolve(spec(str(tmp_path / "allowed" / "alias"), source="local")).entry.id == "alias"


def test_token_only_pt_is_a_plain_prefix(tmp_path, settings, model_dir):
    """The guide's minimal {'token_ids': [...]}: its ids go first as they are; nothing is packed or
    registered and no model is loaded (vLLM computes and caches the prefix itself)."""
    pt = tmp_path / "allowed" / "sys.pt"
    ids = [1] + list(range(300, 331))
    torch.save({"token_ids": ids, "metadata": {"description": "system prompt"}}, pt)
    reg = Registry(settings.registry)
    r = Resolver(settings, reg)
    got = r.resolve(spec(str(pt), source="local"))
    assert got.kind == "tokens" and list(got.token_ids) == ids and got.entry is None
    assert reg.list() == [] and not (settings.cache_dir / "packed").exists()
    plan = r.plan([got])
    assert plan.prefix == ids and plan.wanted == [] and not plan.trained
    torch.save({"token_ids": [5, 10**7]}, tmp_path / "allowed" / "bad.pt")
    with pytest.raises(RequestError, match="outside the model's vocabulary"):
        r.resolve(spec(str(tmp_path / "allowed" / "bad.pt"), source="local"))


def test_plan_places_cartridges_in_order(tmp_path, settings, model_dir):
    reg = Registry(settings.registry)
    r = Resolver(settings, reg)
    a = tmp_path / "allowed"
    _cart(a / "sys", "sys", list(range(1, 33)), model_dir)
    _cart(a / "doc", "doc", list(range(1, 65)), model_dir)        # extends sys
    _cart(a / "other", "other", list(range(100, 132)), model_dir)  # does not
    torch.save({"token_ids": [7, 8, 9]}, a / "t.pt")
    for n in ("sys", "doc", "other"):  # the operator's (a client's first-k KV is salted: test_client_kv_salt)
        reg.register(a / n)
    sys_, doc, other, toks = (r.resolve(spec(str(a / n), source="local")) for n in ("sys", "doc", "other", "t.pt"))
    p = r.plan([sys_, doc])
    assert p.prefix == list(range(1, 65)) and [e.id for e in p.wanted] == ["sys", "doc"]
    p = r.plan([sys_, other])  # other's KV was computed at position 0: its tokens are prefilled after sys
    assert p.prefix == list(range(1, 33)) + list(range(100, 132)) and [e.id for e in p.wanted] == ["sys"]
    p = r.plan([toks, sys_])
    assert p.prefix == [7, 8, 9] + list(range(1, 33)) and p.wanted == []
    p = r.plan([doc, sys_])  # sys after doc: plain tokens again, in order
    assert p.prefix == list(range(1, 65)) + list(range(1, 33))
    _trained(a / "ta", "ta", model_dir)
    ta = r.resolve(spec(str(a / "ta"), source="local"))
    p = r.plan([ta, toks])
    assert p.trained and p.prefix == list(ta.token_ids) + [7, 8, 9] and [e.id for e in p.wanted] == ["ta"]
    with pytest.raises(RequestError, match="would start at token 3, not a multiple") as e:
        r.plan([toks, ta])  # 3 computed tokens: ta's first chunk would hold them
    assert e.value.status == 400


def test_trained_cartridges_compose_into_one_lmcache_cartridge(tmp_path, settings, model_dir):
    """Two trained cartridges in request order: one registered composite whose token ids are the
    parts' in order and whose chunk i is, byte for byte, chunk i of the concatenated KV; a second
    request reuses it without writing to the registry."""
    a = tmp_path / "allowed"
    kv_a, _ = _trained(a / "ta", "ta", model_dir, chunks=2, seed=1)
    kv_b, _ = _trained(a / "tb", "tb", model_dir, chunks=1, seed=2)
    reg = Registry(settings.registry)
    r = Resolver(settings, reg)
    ta, tb = r.resolve(spec(str(a / "ta"), source="local")), r.resolve(spec(str(a / "tb"), source="local"))
    plan = r.plan([ta, tb])
    assert plan.trained and len(plan.wanted) == 1
    comp = plan.wanted[0]
    m = Manifest.load(comp.path)
    assert plan.prefix == list(ta.token_ids) + list(tb.token_ids) == m.token_ids
    assert m.kind == "trained" and m.num_tokens == 3 * CHUNK and reg.get(comp.id) == comp
    assert m.segments == [["trained", 2 * CHUNK], ["trained", CHUNK]]
    assert m.vocab == {"vocab_size": 500, "special_ids": [0, 1, 2]}
    # the reference: the concatenated KV packed as one cartridge (the same chunk layout; packed as
    # first-k only because a trained cartridge's ids cannot be given)
    ref = pack_kv(torch.cat([kv_a, kv_b], dim=2), tmp_path / "ref", cartridge_id="ref", model=model_dir,
                  kind="first_k", token_ids=m.token_ids, chunk_size=CHUNK)
    origin = open_origin(comp.source_uri, comp.path)
    try:
        assert origin.local
        with PackedCartridge(tmp_path / "ref") as packed:
            for info in m.chunks:
                buf, want = bytearray(info.nbytes), bytearray(info.nbytes)
                origin.read_into(info, memoryview(buf))
                packed.read_raw_into(info.index, memoryview(want))
                assert buf == want and info.sha256 == ref.chunks[info.index].sha256
    finally:
        origin.close()
    writes = reg.writes
    assert r.plan([ta, tb]).wanted[0] == comp and reg.writes == writes
    assert r.plan([tb, ta]).wanted[0].id != comp.id  # order matters: another composite
    pack_kv(random_kv(2, CHUNK, 2, 32), a / "narrow", cartridge_id="narrow", model=model_dir, kind="trained",
            vocab=VocabInfo(500, ()), chunk_size=CHUNK)
    narrow = r.resolve(spec(str(a / "narrow"), source="local"))
    with pytest.raises(RequestError, match="head_dim 64 vs 32"):
        r.plan([ta, narrow])


def test_s3_objects_downloaded_once_and_resolution_cached(tmp_path, settings, model_dir, moto_server, s3_proxy):
    """s3://bucket/key.pt (the guide's first example): one HEAD + one GET, converted once; a
    repeated request makes no S3 request, hashes nothing and writes nothing to the registry;
    force_redownload fetches it again exactly once."""
    from dataclasses import replace

    settings = replace(settings, s3={"endpoint_url": s3_proxy.endpoint_url})
    c = s3_client(moto_server)
    c.create_bucket(Bucket="gw-unit")
    pt = tmp_path / "doc.pt"
    kv = random_kv(2, 40, 2, 64, seed=5)
    torch.save({"token_ids": list(range(3, 43)), "kv_cache": {f"layer_{i}": kv[:, i].permute(0, 2, 1, 3).contiguous()
                                                             for i in range(2)}}, pt)
    c.upload_file(str(pt), "gw-unit", "ok/doc.pt")
    c.upload_file(str(pt), "gw-unit", "secret/doc.pt")
    reg = Registry(settings.registry)
    r = Resolver(settings, reg)
    got = r.resolve(spec("s3://gw-unit/ok/doc.pt"))  # source defaults to "s3"
    assert got.kind == "first_k" and list(got.token_ids) == list(range(3, 43))
    assert torch.equal(PackedCartridge(got.entry.path).load_kv(), kv)  # converted bit for bit
    assert s3_proxy.count("HEAD") == 1 and s3_proxy.count("GET") == 1
    before = (reg.writes, reg.data_version(), dict(r.stats))
    s3_proxy.reset()
    for _ in range(3):
        again = r.resolve(spec("s3://gw-unit/ok/doc.pt", source="s3"))
    assert again == got
    assert s3_proxy.count() == 0 and (reg.writes, reg.data_version(), dict(r.stats)) == before
    forced = r.resolve(spec("s3://gw-unit/ok/doc.pt", force_redownload=True))
    assert s3_proxy.count("HEAD") == 1 and s3_proxy.count("GET") == 1
    assert forced.entry.epoch == got.entry.epoch + 1 and forced.entry.path == got.entry.path
    # a restarted gateway: the object is in the cache dir, no S3 request
    s3_proxy.reset()
    r2 = Resolver(settings, Registry(settings.registry))
    assert r2.resolve(spec("s3://gw-unit/ok/doc.pt")).entry.path == got.entry.path and s3_proxy.count() == 0
    for uri, status in [("s3://gw-unit/secret/doc.pt", 403), ("s3://gw-unit/okay/doc.pt", 403),
                        ("s3://gw-unit/ok/missing.pt", 404)]:
        with pytest.raises(RequestError) as e:
            r.resolve(spec(uri))
        assert e.value.status == status, (uri, e.value)


def test_local_resolution_cached_until_the_registry_changes(tmp_path, settings, model_dir):
    pt = tmp_path / "allowed" / "t.pt"
    kv = random_kv(2, CHUNK, 2, 64, seed=9)
    torch.save({"trainable_keys": [kv[0, i].transpose(0, 1)[None] for i in range(2)],
                "trainable_values": [kv[1, i].transpose(0, 1)[None] for i in range(2)]}, pt)
    reg = Registry(settings.registry)
    r = Resolver(settings, reg)
    first = r.resolve(spec(str(pt), source="local"))
    assert first.kind == "trained" and r.stats["hashes"] == 1
    writes = reg.writes
    assert r.resolve(spec(str(pt), source="local")) == first and r.stats["hashes"] == 1 and reg.writes == writes
    other = Registry(settings.registry)  # another process re-registers it (a force_redownload)
    other.register(first.entry.path, source_uri=first.entry.source_uri, labels=["mine"], force_redownload=True)
    again = r.resolve(spec(str(pt), source="local"))
    assert again.entry.epoch == first.entry.epoch + 1 and r.stats["hashes"] == 1 and reg.writes == writes
    assert reg.get(first.entry.id).labels == ["mine"]
    reg.register(first.entry.path, source_uri=first.entry.source_uri)  # re-registration keeps labels
    assert reg.get(first.entry.id).labels == ["mine"]
    kv2 = random_kv(2, CHUNK, 2, 64, seed=10)  # the file is replaced: resolved (hashed, converted) again
    torch.save({"trainable_keys": [kv2[0, i].transpose(0, 1)[None] for i in range(2)],
                "trainable_values": [kv2[1, i].transpose(0, 1)[None] for i in range(2)]}, pt)
    changed = r.resolve(spec(str(pt), source="local"))
    assert r.stats["hashes"] == 2 and changed.entry.content_hash != first.entry.content_hash


def test_id_from_name_is_one_rule():
    assert id_from_name("my cartridge.v2") == "my-cartridge.v2"
    assert id_from_name("..__--x") == "x" and id_from_name("///") == "cartridge"
    assert id_from_name("cache-step100", "ab" * 32) == "cache-step100-abababababab"
    assert id_from_name("a..b") == "a.b"


LLAMA31_LIKE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\n"
    "Today Date: 26 Jul 2024\\n\\n' + system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def test_chat_after_a_trained_cartridge_is_the_user_turn_only(tmp_path, model_dir):
    """Llama 3.1's template puts BOS and a dated system block first; after a trained cartridge the
    user turn comes right after it. First-k keeps the model's template; the option overrides."""
    from transformers import AutoTokenizer

    d = tmp_path / "llama3tok"
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA31_LIKE
    tok.save_pretrained(d)
    pb = PromptBuilder(str(d))
    msgs = [{"role": "user", "content": "Hi"}]
    prefix = [40, 41]
    trained = pb.chat_ids(msgs, prefix, after_trained=True)
    assert trained[:2] == prefix
    text = pb.tok.decode(trained[2:])
    assert text == ("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    first_k = pb.tok.decode(pb.chat_ids(msgs, prefix)[2:])
    assert first_k.startswith("<|start_header_id|>system") and "Cutting Knowledge" in first_k  # unchanged
    assert pb.tok.bos_token not in first_k  # the cartridge owns the BOS slot
    own = PromptBuilder(str(d), "model")
    assert own.chat_ids(msgs, prefix, after_trained=True) == pb.chat_ids(msgs, prefix)
    custom = PromptBuilder(str(d), "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:")
    assert pb.tok.decode(custom.chat_ids(msgs, prefix, after_trained=True)[2:]) == "Q: Hi\nA:"


def test_a_chatml_bos_the_tokenizer_never_prepends_stays_after_a_cartridge(tmp_path):
    """SmolLM2's BOS token is ChatML's <|im_start|>, and its tokenizer prepends nothing to text:
    after a cartridge the chat turn must still open with <|im_start|> (it was dropped as if the
    cartridge owned a BOS slot, leaving 'system\n...' or 'user\n...')."""
    from transformers import AutoTokenizer

    from lmcache_cartridge.tools.testmodel import ensure_test_model

    tok = AutoTokenizer.from_pretrained(ensure_test_model(family="qwen2"))
    tok.bos_token = "<|im_start|>"
    assert tok("a")["input_ids"] == tok("a", add_special_tokens=False)["input_ids"]  # nothing prepended
    pb = PromptBuilder(tok)
    msgs = [{"role": "user", "content": "Hi"}]
    for after_trained in (False, True):
        ids = pb.chat_ids(msgs, [40, 41], after_trained=after_trained)
        assert ids[:2] == [40, 41] and ids[2] == tok.convert_tokens_to_ids("<|im_start|>"), after_trained


def test_prompt_builder_puts_cartridge_first_and_owns_bos(model_dir):
    pb = PromptBuilder(model_dir)
    prefix = [1, 50, 60]
    ids = pb.completion_ids("Hello there", prefix)
    assert ids[:3] == prefix and ids[3:] == pb.tok("Hello there", add_special_tokens=False)["input_ids"]
    assert pb.completion_ids("Hello", [])[0] == 1  # no cartridge: ordinary BOS
    chat = pb.chat_ids([{"role": "user", "content": "Hi"}], prefix)
    plain = pb.chat_ids([{"role": "user", "content": "Hi"}], [])
    assert plain[0] == 1 and chat == prefix + plain[1:]


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
    (json.dumps({"prompt": "x", "cartridges": "ghost"}).encode(), 400, "'cartridges' must be a list of {id, source"),
    (json.dumps({"prompt": "x", "cartridges": [{"id": "a"}] * 9}).encode(), 400, "too many cartridges: 9 (at most 3)"),
    (json.dumps({"prompt": "x", "cartridges": [5]}).encode(), 400, "'cartridges[0]' must be an object"),
    (json.dumps({"prompt": "x", "cartridges": [{"id": ""}]}).encode(), 400,
     "'cartridges[0].id' must be a non-empty string"),
    (json.dumps({"prompt": "x", "cartridges": [{"id": "a" * 2000}]}).encode(), 400, "longer than 1024 characters"),
    (json.dumps({"prompt": "x", "cartridges": [{"id": "a", "source": "ftp"}]}).encode(), 400,
     "'cartridges[0].source' must be 's3' or 'local', got 'ftp'"),
    (json.dumps({"prompt": "x", "cartridges": [{"id": "a", "force_redownload": "yes"}]}).encode(), 400,
     "'cartridges[0].force_redownload' must be true or false"),
    (json.dumps({"prompt": "x", "cartridges": [{"id": "a", "extra": 1}]}).encode(), 400,
     "cartridges[0] has unknown fields ['extra']"),
    (json.dumps({"prompt": "x" * 30000}).encode(), 413, "over 20000 bytes"),
    (json.dumps({"cartridges": []}).encode(), 400, "'prompt' is required"),
    (json.dumps({"prompt": 3.5}).encode(), 400, "'prompt' must be a string or a list of token ids"),
    (json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), 404, "not served here"),
    (json.dumps({"prompt": "x", "cartridges": [{"id": "s3://AB/x"}]}).encode(), 400, "bucket"),
    (json.dumps({"prompt": "x", "cartridges": [{"id": "s3://other-bucket/x.pt"}]}).encode(), 403, "outside the S3"),
    (json.dumps({"prompt": "x", "cartridges": [{"id": "/a\u0000b", "source": "local"}]}).encode(), 400, "null"),
    # kv_transfer_params: only LMCache's skip_save and tags; the connector's keys are the gateway's
    (json.dumps({"prompt": "x", "kv_transfer_params": {"lmcache_cartridge.composites": [[1]] * 1000}}).encode(), 400,
     "'kv_transfer_params': 'lmcache_cartridge.composites' may not be set by a client"),
    (json.dumps({"prompt": "x", "kv_transfer_params": {"lmcache_cartridge.no_recompute": False}}).encode(), 400,
     "'lmcache_cartridge.no_recompute' may not be set"),
    (json.dumps({"prompt": "x", "kv_transfer_params": {"lmcache_cartridge.trained_tokens": 10**9}}).encode(), 400,
     "'lmcache_cartridge.trained_tokens' may not be set"),
    (json.dumps({"prompt": "x", "kv_transfer_params": {"disagg_spec": {"req_id": 5}}}).encode(), 400,
     "'disagg_spec' may not be set by a client (allowed: lmcache.skip_save, lmcache.tag.<name>, "),
    (json.dumps({"prompt": "x", "vllm_xargs": {"kv_transfer_params": "disagg_spec"}}).encode(), 400,
     "'vllm_xargs': may not carry 'kv_transfer_params'"),
    (json.dumps({"prompt": "x", "kv_transfer_params": {"lmcache.skip_save": "no"}}).encode(), 400,
     "'lmcache.skip_save' must be true or false"),
    (json.dumps({"prompt": "x", "kv_transfer_params": {"lmcache.tag.user": 5}}).encode(), 400,
     "'lmcache.tag.user' must be a string"),
    (json.dumps({"prompt": "x", "kv_transfer_params": {f"lmcache.tag.t{i}": "v" for i in range(9)}}).encode(), 400,
     "at most 8 entries"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}],
                 "kv_transfer_params": {"do_remote_prefill": True}}).encode(),
     400, "'do_remote_prefill' may not be set"),
])
def test_bad_requests_are_4xx_with_a_message(settings, body, status, needle):
    app = create_app(settings)
    path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
    r = _call(app, "POST", path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"], r.json()


def test_bad_chat_and_unreachable_upstream(settings):
    app = create_app(settings)
    r = _call(app, "POST", "/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400 and "'messages' must be a non-empty list" in r.json()["error"]["message"]
    r = _call(app, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "logprobs": True, "top_logprobs": "3"})
    assert r.status_code == 400 and "'top_logprobs' must be an integer" in r.json()["error"]["message"]
    # a local id whose file name is too long for the file system: a 400, not a crash
    long_id = str(settings.local_roots[0] / ("a" * 300))
    r = _call(app, "POST", "/v1/completions", json={"prompt": "hi", "cartridges": [{"id": long_id, "source": "local"}]})
    assert r.status_code == 400 and "File name too long" in r.json()["error"]["message"], r.text
    r = _call(app, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
    # the gateway's own health: ready although its upstream is down (a readiness probe on it must
    # not take every gateway replica out of its Service whenever the router or vLLM is)
    r = _call(app, "GET", "/health")
    assert r.status_code == 200 and r.json() == {"gateway": "ok"}, r.text
    schema = _call(app, "GET", "/openapi.json").json()["components"]["schemas"]
    assert schema["CartridgeSpec"]["properties"]["source"]["default"] == "s3"
    assert set(schema["CartridgeSpec"]["properties"]) == {"id", "source", "force_redownload"}


@pytest.fixture
def recording_upstream():
    """A loopback HTTP server standing in for the router/vLLM hop: records each forwarded request's
    headers and answers like vLLM's /v1/completions (what it answers is not under test here)."""
    seen = []

    def answer(request, body):
        if request.command == "GET":
            return 200, {"data": [{"id": "m", "max_model_len": 4096}]}
        seen.append(({**dict(request.headers), ":path": request.path}, body))
        return 200, {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                     "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}

    with JsonUpstream(answer) as upstream:
        yield upstream.url, seen


def test_router_session_key_follows_the_cartridges(tmp_path, settings, model_dir, recording_upstream):
    """vllm-router's consistent_hash keys on X-Session-ID: the same cartridges always give the same
    key (one warm instance), requests without cartridges each get their own (spread)."""
    import dataclasses

    url, seen = recording_upstream
    app = create_app(dataclasses.replace(settings, upstream=url))
    reg = Registry(settings.registry)
    for cid, seed in (("doc-a", 1), ("doc-b", 2)):
        _cart(tmp_path / cid, cid, list(range(10 + seed, 10 + seed + CHUNK)), model_dir, seed=seed)
        reg.register(tmp_path / cid)
    for ids in (["doc-a"], ["doc-a"], ["doc-b"], []):
        body = {"prompt": "hi", "max_tokens": 1}
        if ids:
            body["cartridges"] = [{"id": i} for i in ids]
        r = _call(app, "POST", "/v1/completions", json=body)
        assert r.status_code == 200, r.text
    keys = [h.get("X-Session-ID") for h, _ in seen]
    assert keys[0] == keys[1] == "cart:doc-a" and keys[2] == "cart:doc-b"
    assert keys[3].startswith("req:")
    r = _call(app, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert seen[-1][0]["X-Session-ID"].startswith("req:") and seen[-1][0]["X-Session-ID"] != keys[3]
    # token-only cartridges (nothing registered) keep an instance too: the key follows their ids
    tok_keys = []
    for name, toks in (("sys1", [11, 12, 13]), ("sys1-again", [11, 12, 13]), ("sys2", [14, 15])):
        pt = tmp_path / "allowed" / f"{name}.pt"
        torch.save({"token_ids": toks}, pt)
        body = {"prompt": "hi", "max_tokens": 1,
                "cartridges": [{"id": str(pt), "source": "local"}, {"id": "doc-a"}]}
        r = _call(app, "POST", "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        tok_keys.append(seen[-1][0]["X-Session-ID"])
    assert tok_keys[0] == tok_keys[1] != tok_keys[2]
    assert tok_keys[0].startswith("cart:tok-") and tok_keys[0].endswith(",doc-a")
    assert all("cartridges" not in b for _, b in seen)  # the field is the gateway's, not vLLM's


def test_client_kv_params_pass_and_the_gateways_own_are_set_by_it(tmp_path, settings, model_dir, recording_upstream):
    """LMCache's skip_save and tags from a client reach the upstream unchanged; on a trained
    request the gateway's own keys are the gateway's values, whatever the client sent."""
    import dataclasses

    from lmcache_cartridge.vllm.load_failure import NO_RECOMPUTE_PARAM

    url, seen = recording_upstream
    app = create_app(dataclasses.replace(settings, upstream=url))
    params = {"lmcache.skip_save": False, "lmcache.tag.user": "u1"}
    r = _call(app, "POST", "/v1/completions", json={"prompt": [5, 6], "max_tokens": 1, "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    assert seen[-1][1]["kv_transfer_params"] == params
    _trained(tmp_path / "allowed" / "t", "t", model_dir)
    trained = [{"id": str(tmp_path / "allowed" / "t"), "source": "local"}]
    r = _call(app, "POST", "/v1/completions", json={
        "prompt": [5, 6], "max_tokens": 1, "kv_transfer_params": {"lmcache.skip_save": False}, "cartridges": trained})
    assert r.status_code == 200, r.text
    sent = seen[-1][1]["kv_transfer_params"]
    assert sent["lmcache.skip_save"] is True and sent[NO_RECOMPUTE_PARAM] is True
    # a client's tag would key the request's chunks apart from the cartridge's: never found, 503
    # after the wait; said at once instead
    n = len(seen)
    r = _call(app, "POST", "/v1/completions", json={
        "prompt": [5, 6], "max_tokens": 1, "kv_transfer_params": params, "cartridges": trained})
    assert r.status_code == 400 and "lmcache.tag.user" in r.json()["error"]["message"] and len(seen) == n


def test_a_clients_first_k_kv_goes_upstream_under_its_salt(tmp_path, settings, model_dir, recording_upstream):
    """First-k KV a client brought (a local path here): the upstream request carries its salt as
    LMCache's key tag and as vLLM's cache_salt (a client's own cache_salt kept beside it); a
    request not naming it carries neither (test_client_kv_salt, test_gateway_e2e)."""
    import dataclasses

    from lmcache_cartridge.cartridge.keys import SALT_TAG, client_kv_salt
    from lmcache_cartridge.cartridge.manifest import Manifest
    from lmcache_cartridge.vllm.readiness import CARTRIDGE_TOKENS_PARAM

    url, seen = recording_upstream
    app = create_app(dataclasses.replace(settings, upstream=url))
    pack_kv(random_kv(2, CHUNK, 2, 32), tmp_path / "allowed" / "fk", cartridge_id="fk", model=model_dir,
            kind="first_k", token_ids=list(range(20, 20 + CHUNK)), chunk_size=CHUNK)
    salt = client_kv_salt(Manifest.load(tmp_path / "allowed" / "fk"))
    fk = [{"id": str(tmp_path / "allowed" / "fk"), "source": "local"}]
    for extra, cache_salt in (({}, salt), ({"cache_salt": "mine"}, f"{salt}:mine")):
        r = _call(app, "POST", "/v1/completions", json={"prompt": [5, 6], "max_tokens": 1, "cartridges": fk, **extra})
        assert r.status_code == 200, r.text
        # (no cartridge-token count: no LMCache MP server publishes here)
        assert seen[-1][1]["kv_transfer_params"] == {SALT_TAG: salt}
        assert seen[-1][1]["cache_salt"] == cache_salt
    r = _call(app, "POST", "/v1/completions", json={"prompt": list(range(20, 20 + CHUNK)), "max_tokens": 1})
    assert r.status_code == 200 and "kv_transfer_params" not in seen[-1][1] and "cache_salt" not in seen[-1][1]
    # the operator's registration of the same KV, with the client's own cache_salt: after an empty
    # cartridge salt (MP keys carry cache_salt; the adapter serves the operator's chunks to ":...")
    pack_kv(random_kv(2, CHUNK, 2, 32), tmp_path / "op", cartridge_id="op", model=model_dir,
            kind="first_k", token_ids=list(range(20, 20 + CHUNK)), chunk_size=CHUNK)
    Registry(settings.registry).register(tmp_path / "op")
    for extra, cache_salt in (({}, None), ({"cache_salt": "mine"}, ":mine"), ({"cache_salt": salt}, f":{salt}")):
        r = _call(app, "POST", "/v1/completions", json={"prompt": [5, 6], "max_tokens": 1,
                                                        "cartridges": [{"id": "op"}], **extra})
        assert r.status_code == 200, r.text
        assert seen[-1][1].get("cache_salt") == cache_salt
        assert CARTRIDGE_TOKENS_PARAM not in (seen[-1][1].get("kv_transfer_params") or {})
    r = _call(app, "POST", "/v1/completions", json={"prompt": [5], "max_tokens": 1, "cartridges": fk,
                                                    "kv_transfer_params": {SALT_TAG: salt}})
    assert r.status_code == 400


def test_local_ids_checked_before_the_file_system_is_walked(tmp_path, settings, model_dir, monkeypatch):
    """A path outside the allowed roots is refused before anything under it is touched (the old
    order walked the whole tree first, 0.6-2.3 s for 30,000 files, and cached an entry per
    spelling); spellings of one allowed file share one cache entry; a symlink inside an allowed
    directory that points outside is refused before it is read."""

    outside = tmp_path / "outside"
    (outside / "tree").mkdir(parents=True)
    for i in range(50):
        (outside / "tree" / f"f{i}").write_text("secret contents\n")
    walked = []
    real_rglob = type(outside).rglob
    monkeypatch.setattr(type(outside), "rglob", lambda self, pat: walked.append(self) or real_rglob(self, pat))
    r = Resolver(settings, Registry(settings.registry))
    for spelling in (str(outside / "tree"), str(outside / "tree") + "/",
                     str(settings.local_roots[0] / ".." / "outside" / "tree")):
        with pytest.raises(RequestError) as e:
            r.resolve(spec(spelling, source="local"))
        assert e.value.status == 403
    assert walked == [] and len(r._cache) == 0

    allowed = settings.local_roots[0]
    torch.save({"token_ids": list(range(1, 40))}, allowed / "tok.pt")
    for spelling in (str(allowed / "tok.pt"), str(allowed / "." / "tok.pt"),
                     str(allowed / ".." / "allowed" / "tok.pt")):
        assert r.resolve(spec(spelling, source="local")).token_ids == tuple(range(1, 40))
    assert len(r._cache) == 1 and r.stats["conversions"] == 1

    # a packed directory inside the root with one file a symlink to a secret outside it
    _cart(allowed / "doc", "doc-link", list(range(1, 65)), model_dir)
    victim = next(p for p in sorted((allowed / "doc").iterdir()) if p.suffix != ".json")
    victim.unlink()
    victim.symlink_to(outside / "tree" / "f0")
    with pytest.raises(RequestError) as e:
        r.resolve(spec(str(allowed / "doc"), source="local"))
    assert e.value.status == 403 and "secret" not in str(e.value)
    assert Registry(settings.registry).get("doc-link") is None  # refused before registration read it


def test_resolution_cache_and_locks_are_bounded(tmp_path, settings, monkeypatch):
    import lmcache_cartridge.api.resolver as resolver_mod

    monkeypatch.setattr(resolver_mod, "MAX_CACHED", 3)
    monkeypatch.setattr(resolver_mod, "MAX_LOCAL_ENTRIES", 5)
    r = Resolver(settings, Registry(settings.registry))
    allowed = settings.local_roots[0]
    for i in range(6):
        torch.save({"token_ids": [1, 2, 3 + i]}, allowed / f"t{i}.pt")
        r.resolve(spec(str(allowed / f"t{i}.pt"), source="local"))
    assert len(r._cache) == 3 and r._locks == {}
    assert [k[1] for k in r._cache] == [str(allowed / f"t{i}.pt") for i in (3, 4, 5)]  # least recent dropped
    # composites: every pair of trained parts is another key; locks and cache entries stay bounded
    parts = []
    for i in range(4):
        _trained(allowed / f"tr{i}", f"tr{i}", settings.tokenizer, seed=i)
        parts.append(r.resolve(spec(str(allowed / f"tr{i}"), source="local")))
    for i in range(3):
        assert r.plan([parts[i], parts[i + 1]]).trained
    assert len(r._cache) == 3 and r._locks == {}
    (allowed / "many").mkdir()
    for i in range(6):
        (allowed / "many" / f"f{i}").write_text("x")
    with pytest.raises(RequestError, match="more than 5 entries"):
        r.resolve(spec(str(allowed / "many"), source="local"))


def test_api_keys_are_required_on_v1_and_the_upstream_key_is_sent(tmp_path, settings, recording_upstream):
    """Keys as vLLM's --api-key: /v1/* needs 'Authorization: Bearer <key>' (any of several),
    checked before the body is read; /health stays open; the upstream gets its own key."""
    import dataclasses

    url, seen = recording_upstream
    keys = ("k1-0123456789abcdef", "k2-0123456789abcdef")
    app = create_app(dataclasses.replace(settings, upstream=url, api_keys=keys, upstream_api_key="vllm-key"))
    body = {"prompt": [5, 6], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k1-0123456789abcdef"},
                    {"Authorization": "Basic k1-0123456789abcdef"}):
        r = _call(app, "POST", "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"], (headers, r.text)
    r = _call(app, "POST", "/v1/completions", content=b"x" * 50000, headers={"content-type": "application/json"})
    assert r.status_code == 401  # not 413: refused before the body is read
    assert _call(app, "GET", "/v1/models").status_code == 401
    assert seen == []
    for k in keys:
        r = _call(app, "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {k}"})
        assert r.status_code == 200, r.text
        assert seen[-1][0].get("Authorization") == "Bearer vllm-key"  # the upstream's key, not the client's
    assert _call(app, "GET", "/health").status_code == 200  # open, as vLLM's


def test_cartridge_list_names_what_a_key_may_use_and_no_paths(tmp_path, settings, model_dir):
    """GET /v1/cartridges: the registered ids with their labels, model, size and kind, as an
    OpenAI list; with keys configured it needs one like any /v1/* path. Where an entry's bytes
    lie (its packed directory, its source) is never part of it."""
    import dataclasses

    a = settings.local_roots[0]
    reg = Registry(settings.registry)
    _cart(a / "doc", "doc", list(range(1, 65)), model_dir)
    reg.register(a / "doc", labels=["handbook", "v2"])
    _trained(a / "tr", "tr", model_dir, chunks=2)
    reg.register(a / "tr")
    r = _call(create_app(settings), "GET", "/v1/cartridges")
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "list", "data": [
        {"id": "doc", "object": "cartridge", "labels": ["handbook", "v2"], "model": model_dir, "tokens": 64,
         "kind": "first_k"},
        {"id": "tr", "object": "cartridge", "labels": [], "model": model_dir, "tokens": 2 * CHUNK, "kind": "trained"}],
        "first_id": "doc", "last_id": "tr", "has_more": False}
    assert str(tmp_path) not in r.text
    keyed = create_app(dataclasses.replace(settings, api_keys=("k1-0123456789abcdef",)))
    assert _call(keyed, "GET", "/v1/cartridges").status_code == 401
    r = _call(keyed, "GET", "/v1/cartridges", headers={"Authorization": "Bearer k1-0123456789abcdef"})
    assert [c["id"] for c in r.json()["data"]] == ["doc", "tr"]


def test_cartridge_list_names_the_served_model_never_the_operators_directory(tmp_path, settings, model_dir):
    """Cartridges are made under the name in LMCache's keys (vLLM's --model: often the operator's
    model directory), and the list showed that name: a filesystem path of the operator's, to
    every key. It shows the name requests use (the served name, the gateway's --model), and
    leaves out cartridges of weights this server does not serve."""
    import dataclasses

    a = settings.local_roots[0]
    reg = Registry(settings.registry)
    _cart(a / "doc", "doc", list(range(1, 65)), model_dir)
    reg.register(a / "doc")
    _cart(a / "other", "other", list(range(1, 33)), "another/model")
    reg.register(a / "other")
    app = create_app(dataclasses.replace(settings, model="tiny-served", accept_models=(model_dir,)))
    r = _call(app, "GET", "/v1/cartridges")
    assert r.status_code == 200, r.text
    assert [(c["id"], c["model"]) for c in r.json()["data"]] == [("doc", "tiny-served")], r.text
    assert model_dir not in r.text and str(tmp_path) not in r.text and "another/model" not in r.text


def test_cartridge_list_is_paged_and_a_page_is_bounded(tmp_path, settings, model_dir):
    """The list answered every registered entry in one body, `?limit` ignored: its size grew
    with the registry. Pages of `limit` items (at most LIST_LIMIT_MAX; LIST_LIMIT where none is
    asked for), the next one `after` the previous page's `last_id`; a tenant's pages hold only
    its own ids."""
    import dataclasses

    from lmcache_cartridge.api.gateway import LIST_LIMIT, LIST_LIMIT_MAX
    from lmcache_cartridge.api.settings import Tenant

    a = settings.local_roots[0]
    reg = Registry(settings.registry)
    ids = [f"{p}-{i:03d}" for p in ("acme", "globex") for i in range(LIST_LIMIT // 2 + 3)]
    for n, cid in enumerate(ids):
        _cart(a / cid, cid, list(range(1, CHUNK + 1)), model_dir, seed=n)
        reg.register(a / cid)
    acme = "acme-key-0123456789abcdef"
    app = create_app(dataclasses.replace(settings, api_keys=("op-key-0123456789abcdef",), tenants=(
        Tenant("acme", keys=(acme,), ids=("acme-*",)),)))

    def page(key, query=""):
        r = _call(app, "GET", "/v1/cartridges" + query, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()

    got = page("op-key-0123456789abcdef")
    assert [c["id"] for c in got["data"]] == ids[:LIST_LIMIT] and got["has_more"], got["last_id"]
    seen, query = [], "?limit=7"
    while True:
        got = page(acme, query)
        assert len(got["data"]) <= 7
        seen += [c["id"] for c in got["data"]]
        if not got["has_more"]:
            break
        query = f"?limit=7&after={got['last_id']}"
    assert seen == [i for i in ids if i.startswith("acme-")]
    assert page(acme, f"?after={ids[-1]}") == {"object": "list", "data": [], "first_id": None, "last_id": None,
                                               "has_more": False}
    for bad in (0, -1, LIST_LIMIT_MAX + 1, "x"):
        r = _call(app, "GET", f"/v1/cartridges?limit={bad}", headers={"Authorization": f"Bearer {acme}"})
        assert r.status_code == 400 and "limit" in r.json()["error"]["message"], (bad, r.text)


def test_gateway_keys_from_flags_and_env_and_the_non_loopback_warning(monkeypatch):
    from lmcache_cartridge.api.launch import is_loopback
    from lmcache_cartridge.api.settings import API_KEY_ENV, gateway_api_keys

    monkeypatch.setenv(API_KEY_ENV, "env-key-0123456789, other-key-0123456789,")
    assert gateway_api_keys(["flag-key-0123456789"]) == ("flag-key-0123456789", "env-key-0123456789",
                                                         "other-key-0123456789")
    with pytest.raises(ValueError, match="at least 16"):
        gateway_api_keys(["short"])
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")


def test_gateway_on_a_public_address_without_keys_warns(tmp_path, model_dir):
    """The real command: bound to 0.0.0.0 with no key it says so on stderr (and still serves, so
    nothing that works today stops); on loopback it does not."""
    import subprocess
    import sys
    import time

    from lmcache_cartridge.tools.vllm_process import free_port

    import httpx

    def start(host, port):
        env = {k: v for k, v in __import__("os").environ.items() if k != "LMCACHE_CARTRIDGE_API_KEYS"}
        return subprocess.Popen(
            [sys.executable, "-m", "lmcache_cartridge.tools.cli", "gateway", "--upstream", "http://127.0.0.1:9",
             "--model", model_dir, "--registry", str(tmp_path / f"{host}.db"), "--host", host,
             "--port", str(port)], stderr=subprocess.PIPE, text=True, env=env)

    for host, warns in (("0.0.0.0", True), ("127.0.0.1", False)):
        port = free_port()
        p = start(host, port)
        try:  # until it serves (a loaded machine starts it slowly): the warning comes before
            deadline = time.time() + 120
            while p.poll() is None and time.time() < deadline:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except httpx.HTTPError:
                    time.sleep(0.5)
            assert p.poll() is None, p.stderr.read()
        finally:
            p.terminate()
            err = p.communicate(timeout=30)[1]
        assert ("WARNING: the gateway listens on 0.0.0.0" in err) == warns, err


def test_a_client_named_cartridge_cannot_take_over_a_registered_id(tmp_path, settings, model_dir, recording_upstream):
    """A packed directory whose manifest claims an id the operator registered from elsewhere would
    replace the id (labels kept) for every later request: it is answered 409 and the entry stays.
    The same directory named again, and the operator's own re-registration, still work."""
    import dataclasses

    url, _ = recording_upstream
    app = create_app(dataclasses.replace(settings, upstream=url))
    reg = Registry(settings.registry)
    allowed = settings.local_roots[0]
    _cart(allowed / "doc", "doc", list(range(1, 65)), model_dir, seed=1)
    reg.register(allowed / "doc", labels=["handbook"])
    _cart(allowed / "evil", "doc", list(range(101, 165)), model_dir, seed=2)  # claims "doc"
    r = _call(app, "POST", "/v1/completions", json={"prompt": [5], "max_tokens": 1,
                                                    "cartridges": [{"id": str(allowed / "evil"), "source": "local"}]})
    assert r.status_code == 409 and "already registered from another origin" in r.json()["error"]["message"], r.text
    assert reg.get("doc").path == str((allowed / "doc").resolve())
    r = _call(app, "POST", "/v1/completions", json={"prompt": [5], "max_tokens": 1, "cartridges": [{"id": "handbook"}]})
    assert r.status_code == 200, r.text
    r = _call(app, "POST", "/v1/completions", json={"prompt": [5], "max_tokens": 1,
                                                    "cartridges": [{"id": str(allowed / "doc"), "source": "local"}]})
    assert r.status_code == 200, r.text
    assert reg.register(allowed / "evil").path == str((allowed / "evil").resolve())  # the operator may


def test_force_redownload_is_bounded_per_cartridge(tmp_path, settings, model_dir, recording_upstream):
    """Each honoured force_redownload bumps the cartridge's epoch (every instance drops and
    refetches it): at most one per interval per cartridge, then 429 with Retry-After; the epoch
    moves once. Interval 0 disables it (403)."""
    import dataclasses

    url, _ = recording_upstream
    app = create_app(dataclasses.replace(settings, upstream=url, force_redownload_interval=3600))
    reg = Registry(settings.registry)
    allowed = settings.local_roots[0]
    _cart(allowed / "doc", "doc", list(range(1, 65)), model_dir)
    reg.register(allowed / "doc")
    body = {"prompt": [5], "max_tokens": 1, "cartridges": [{"id": "doc", "force_redownload": True}]}
    statuses = [_call(app, "POST", "/v1/completions", json=body) for _ in range(5)]
    assert [r.status_code for r in statuses] == [200, 429, 429, 429, 429], [r.text for r in statuses]
    assert 3000 < int(statuses[1].headers["Retry-After"]) <= 3600
    assert reg.get("doc").epoch == 1
    reg.label("doc", add=["handbook"])  # another spelling of the same cartridge shares its limit
    r = _call(
        app, "POST", "/v1/completions", json={**body, "cartridges": [{"id": "handbook", "force_redownload": True}]}
    )
    assert r.status_code == 429 and reg.get("doc").epoch == 1, r.text
    # a trained cartridge a client named by path stays the client's (within the cache budget) when forced
    _trained(allowed / "tr", "tr", model_dir)
    tr = {"prompt": [5], "max_tokens": 1, "cartridges": [{"id": str(allowed / "tr"), "source": "local"}]}
    assert _call(app, "POST", "/v1/completions", json=tr).status_code == 200
    assert reg.get("tr").client
    tr["cartridges"] = [{"id": "tr", "force_redownload": True}]
    assert _call(app, "POST", "/v1/completions", json=tr).status_code == 200
    assert reg.get("tr").client and reg.get("tr").epoch == 1
    body["cartridges"][0]["force_redownload"] = False
    assert _call(app, "POST", "/v1/completions", json=body).status_code == 200  # plain use goes on
    off = create_app(dataclasses.replace(settings, upstream=url, force_redownload_interval=0))
    body["cartridges"][0]["force_redownload"] = True
    r = _call(off, "POST", "/v1/completions", json=body)
    assert r.status_code == 403 and "disabled" in r.text


def test_s3_objects_over_the_limit_are_refused_and_refused_objects_leave_the_cache(
        tmp_path, settings, moto_server, s3_proxy):
    """An object over s3.max_object_bytes: 413 after one HEAD, nothing downloaded (a PEFT-style
    prefix too, from its listing). An object that downloads but is refused (not a cartridge) is
    deleted from the cache dir's objects/: refused bytes do not stay on disk."""
    from dataclasses import replace

    c = s3_client(moto_server)
    c.create_bucket(Bucket="gw-unit")
    big = tmp_path / "big.pt"
    torch.save({"token_ids": list(range(3, 43))}, big)
    size = big.stat().st_size
    c.upload_file(str(big), "gw-unit", "ok/big.pt")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        c.put_object(Bucket="gw-unit", Key=f"ok/adapter/{name}", Body=b"x" * (size // 2 + 10))
    limited = replace(settings, s3={"endpoint_url": s3_proxy.endpoint_url, "max_object_bytes": str(size - 1)})
    r = Resolver(limited, Registry(settings.registry))
    s3_proxy.reset()
    with pytest.raises(RequestError) as e:
        r.resolve(spec("s3://gw-unit/ok/big.pt"))
    assert e.value.status == 413 and "max_object_bytes" in str(e.value)
    assert s3_proxy.count("HEAD") == 1 and s3_proxy.count("GET") == 0
    with pytest.raises(RequestError) as e:
        r.resolve(spec("s3://gw-unit/ok/adapter/"))
    assert e.value.status == 413 and s3_proxy.count("GET", r"/adapter_") == 0
    # under the limit, downloaded, then refused by the converter: gone from objects/
    c.put_object(Bucket="gw-unit", Key="ok/junk.pt", Body=b"not a torch file at all")
    r = Resolver(replace(settings, s3={"endpoint_url": s3_proxy.endpoint_url}), Registry(settings.registry))
    with pytest.raises(RequestError) as e:
        r.resolve(spec("s3://gw-unit/ok/junk.pt"))
    assert e.value.status == 400
    objects = settings.cache_dir / "objects"
    assert not objects.exists() or not any(objects.rglob("junk.pt")), list(objects.rglob("*"))


def test_tenants_see_only_their_cartridges(tmp_path, settings, model_dir, recording_upstream):
    """Two tenants from a --tenants file: each key names only its tenant's ids, labels, local
    roots and S3 prefixes; another tenant's id answers exactly as a missing one (404, the same
    words), and a label both carry resolves within each tenant's view instead of listing the
    other's ids. The operator's key sees everything (and the label is ambiguous there)."""
    import dataclasses

    from lmcache_cartridge.api.settings import load_tenants

    url, seen = recording_upstream
    root = settings.local_roots[0]
    for t in ("acme", "globex"):
        (root / t).mkdir()
    (tmp_path / "tenants.yaml").write_text(f"""
tenants:
  - name: acme
    keys: [acme-key-0123456789]
    ids: ["acme-*"]
    local: [{root / 'acme'}]
    s3: [gw-unit/acme]
  - name: globex
    keys: [globex-key-0123456789]
    ids: ["globex-*"]
    local: [{root / 'globex'}]
""")
    tenants = load_tenants(tmp_path / "tenants.yaml")
    app = create_app(dataclasses.replace(settings, upstream=url, api_keys=("operator-key-0123456789",),
                                         tenants=tenants))
    reg = Registry(settings.registry)
    for t, seed in (("acme", 1), ("globex", 2)):
        _cart(root / t / "doc", f"{t}-doc", list(range(seed * 100, seed * 100 + 64)), model_dir, seed=seed)
        reg.register(root / t / "doc", labels=["handbook"])

    def ask(key, cart):
        return _call(app, "POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                     json={"prompt": [5], "max_tokens": 1, "cartridges": [cart]})

    acme, globex, op = "acme-key-0123456789", "globex-key-0123456789", "operator-key-0123456789"
    r = ask(acme, {"id": "handbook"})
    assert r.status_code == 200, r.text
    assert seen[-1][1]["prompt"][:64] == list(range(100, 164))  # acme's document
    r = ask(globex, {"id": "handbook"})
    assert r.status_code == 200 and seen[-1][1]["prompt"][:64] == list(range(200, 264))
    hidden, missing = ask(acme, {"id": "globex-doc"}), ask(acme, {"id": "globex-nothing"})
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json()["error"]["message"].replace("globex-doc", "X") == \
        missing.json()["error"]["message"].replace("globex-nothing", "X")
    assert ask(acme, {"id": "acme-doc"}).status_code == 200
    assert ask(acme, {"id": str(root / "globex" / "doc"), "source": "local"}).status_code == 403
    assert ask(acme, {"id": str(root / "acme" / "doc"), "source": "local"}).status_code == 200
    assert ask(globex, {"id": "s3://gw-unit/acme/x.pt"}).status_code == 403  # not globex's prefix
    r = ask(op, {"id": "handbook"})
    assert r.status_code == 404 and "names 2 cartridges" in r.json()["error"]["message"]
    assert ask(op, {"id": "globex-doc"}).status_code == 200
    with pytest.raises(ValueError, match="share a key"):
        (tmp_path / "bad.yaml").write_text("tenants:\n- {name: a, keys: [k-0123456789abcdef]}\n"
                                           "- {name: b, keys: [k-0123456789abcdef]}\n")
        load_tenants(tmp_path / "bad.yaml")


def test_a_tenants_scope_covers_its_files_and_the_ids_it_registers(tmp_path, settings, model_dir, recording_upstream):
    """A tenant's local root is its own, not only the gateway's: a path under it resolves, and
    every file of a cartridge directory must lie under it (a symlink into another tenant's root
    is refused before it is read). A cartridge a tenant names by path registers only ids the
    tenant may name: a manifest claiming another tenant's id is 403 and registers nothing."""
    import dataclasses
    import shutil

    from lmcache_cartridge.api.settings import Tenant

    url, seen = recording_upstream
    acme_root, globex_root = tmp_path / "acme-only", settings.local_roots[0] / "globex"
    acme_root.mkdir(), globex_root.mkdir()
    tenants = (Tenant("acme", keys=("acme-key-0123456789",), ids=("acme-*",), local_roots=(acme_root,)),
               Tenant("globex", keys=("globex-key-0123456789",), ids=("globex-*",), local_roots=(globex_root,)))
    app = create_app(dataclasses.replace(settings, upstream=url, tenants=tenants))
    reg = Registry(settings.registry)

    def ask(path):
        return _call(app, "POST", "/v1/completions", headers={"Authorization": "Bearer acme-key-0123456789"},
                     json={"prompt": [5], "max_tokens": 1, "cartridges": [{"id": str(path), "source": "local"}]})

    _cart(acme_root / "doc", "acme-doc", list(range(1, 65)), model_dir)
    r = ask(acme_root / "doc")
    assert r.status_code == 200, r.text  # outside the gateway's --allow-local, inside acme's own root
    assert seen[-1][1]["prompt"][:64] == list(range(1, 65))

    _cart(globex_root / "doc", "globex-doc", list(range(100, 164)), model_dir, seed=2)
    shutil.copytree(acme_root / "doc", acme_root / "linked")
    victim = next(p for p in sorted((globex_root / "doc").rglob("*")) if p.is_file() and p.suffix != ".json")
    mine = acme_root / "linked" / victim.relative_to(globex_root / "doc")
    mine.unlink()
    mine.symlink_to(victim)
    r = ask(acme_root / "linked")
    assert r.status_code == 403 and "outside the directories" in r.json()["error"]["message"], r.text

    _cart(acme_root / "squat", "globex-report", list(range(200, 264)), model_dir, seed=3)
    r = ask(acme_root / "squat")
    assert r.status_code == 403 and "outside the ids this key may name" in r.json()["error"]["message"], r.text
    assert reg.get("globex-report") is None


def test_conversions_stay_within_the_cache_budget(tmp_path, settings, model_dir):
    """Every input a client names is converted into packed/ (and S3 ones downloaded into
    objects/): beyond `max_cache_bytes` the least recently used goes, with its registry entry and
    the composites made from it; the operator's registrations and what a resolution uses stay.
    Before the budget, packed/ grew with every new input for good."""
    import dataclasses

    def seed000(name, seed, token_ids=None):
        kv = random_kv(2, CHUNK, 2, 64, seed=seed)
        obj = {"kv_cache": {f"layer_{i}": kv[:, i].permute(0, 2, 1, 3).contiguous() for i in range(2)}}
        if token_ids is not None:
            obj["token_ids"] = token_ids
        torch.save(obj, tmp_path / "allowed" / f"{name}.pt")
        return spec(str(tmp_path / "allowed" / f"{name}.pt"), source="local")

    one = 2 * 2 * CHUNK * 2 * 64 * 2  # a converted cartridge's payload: K and V, 2 layers, 2 heads, bf16
    reg = Registry(settings.registry)
    r = Resolver(dataclasses.replace(settings, max_cache_bytes=int(2.5 * one)), reg)
    a, b, c = (r.resolve(seed000(n, i, list(range(10 + i, 10 + i + CHUNK)))) for i, n in enumerate("abc"))
    packed = settings.cache_dir / "packed"
    assert reg.get(a.entry.id) is None and not Path(a.entry.path).exists()  # the least recently used
    assert Path(b.entry.path).is_dir() and Path(c.entry.path).is_dir() and len(list(packed.iterdir())) == 2
    conversions = r.stats["conversions"]
    again = r.resolve(seed000("a", 0, list(range(10, 10 + CHUNK))))  # named again: converted again
    assert r.stats["conversions"] == conversions + 1 and reg.get(again.entry.id) is not None
    assert reg.get(b.entry.id) is None and reg.get(c.entry.id) is not None
    # the operator's registration of c's bytes is never evicted; composites go with their parts
    reg.register(c.entry.path)
    t1, t2 = r.resolve(seed000("t1", 7)), r.resolve(seed000("t2", 8))
    assert t1.kind == t2.kind == "trained" and reg.get(c.entry.id) is not None and not reg.get(c.entry.id).client
    comp = r.plan([t1, t2]).wanted[0]
    assert reg.get(comp.id) is not None
    r.resolve(seed000("d", 9, list(range(900, 900 + CHUNK))))
    assert reg.get(t1.entry.id) is None and reg.get(comp.id) is None  # t1 went, and the composite with it
    assert reg.get(c.entry.id) is not None and Path(c.entry.path).is_dir()


def test_conversions_and_composites_of_an_older_version_are_made_again(tmp_path, settings, model_dir):
    """A trained manifest without `vocab` (as an older version wrote them) does not load: its
    placeholder ids cannot be checked. The gateway's own conversions and composites of such
    manifests are made again, not refused for good."""
    from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME

    def seed000(name, seed):
        kv = random_kv(2, CHUNK, 2, 64, seed=seed)
        torch.save({"kv_cache": {f"layer_{i}": kv[:, i].permute(0, 2, 1, 3).contiguous() for i in range(2)}},
                   tmp_path / "allowed" / f"{name}.pt")
        return spec(str(tmp_path / "allowed" / f"{name}.pt"), source="local")

    r = Resolver(settings, Registry(settings.registry))
    t1, t2 = r.resolve(seed000("t1", 1)), r.resolve(seed000("t2", 2))
    comp = r.plan([t1, t2]).wanted[0]
    for d in (t1.entry.path, comp.path):  # as an older version wrote them
        m = json.loads((Path(d) / MANIFEST_NAME).read_text())
        m.pop("vocab"), m.pop("segments", None)
        (Path(d) / MANIFEST_NAME).write_text(json.dumps(m))
    r2 = Resolver(settings, Registry(settings.registry))  # a gateway started after the upgrade
    again = r2.resolve(seed000("t1", 1))
    assert again.entry.id == t1.entry.id and Manifest.load(again.entry.path).vocab is not None
    assert r2.plan([again, r2.resolve(seed000("t2", 2))]).wanted[0].id == comp.id
    assert Manifest.load(comp.path).segments == [["trained", CHUNK], ["trained", CHUNK]]


def test_openai_chat_requests_pass_whole(tmp_path, settings, model_dir, recording_upstream):
    """A chat request without cartridges reaches vLLM's chat endpoint whole (tools, tool_choice,
    response_format, content parts: vLLM parses tool calls); with cartridges, text content parts
    are read as vLLM reads them (joined with newlines), response_format passes, and the fields
    only vLLM's chat endpoint can honour answer 400 instead of being dropped."""
    import dataclasses

    url, seen = recording_upstream
    app = create_app(dataclasses.replace(settings, upstream=url))
    params = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "lookup", "description": "find a fact", "parameters": params}}]
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    body = {"model": model_dir, "messages": [
                {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Where is it?"},
                                             {"type": "text", "text": "Say."}]}],
            "tools": tools, "tool_choice": "auto", "parallel_tool_calls": False, "response_format": fmt,
            "max_tokens": 4, "seed": 7, "logit_bias": {"5": -1}}
    r = _call(app, "POST", "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    headers, got = seen[-1]
    assert headers[":path"] == "/v1/chat/completions" and got == body

    _cart(tmp_path / "allowed" / "doc", "doc", list(range(1, 65)), model_dir)
    carts = [{"id": str(tmp_path / "allowed" / "doc"), "source": "local"}]
    as_parts = {"messages": body["messages"], "cartridges": carts, "max_tokens": 4, "response_format": fmt}
    r = _call(app, "POST", "/v1/chat/completions", json=as_parts)
    assert r.status_code == 200, r.text
    headers, parts_sent = seen[-1]
    assert headers[":path"] == "/v1/completions" and parts_sent["response_format"] == fmt
    as_text = {**as_parts, "messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Where is it?\nSay."}]}
    assert _call(app, "POST", "/v1/chat/completions", json=as_text).status_code == 200
    assert seen[-1][1]["prompt"] == parts_sent["prompt"]
    n = len(seen)
    for field in ("tools", "tool_choice", "parallel_tool_calls"):
        r = _call(app, "POST", "/v1/chat/completions", json={**as_text, field: body[field]})
        assert r.status_code == 400 and repr(field) in r.json()["error"]["message"], r.text
    image = {**as_text, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert _call(app, "POST", "/v1/chat/completions", json=image).status_code == 400
    assert len(seen) == n


def test_every_shape_vllm_accepts_passes_whole_without_cartridges(tmp_path, settings, model_dir, recording_upstream):
    """Without cartridges the gateway is a pass-through: a tool-calling conversation (an assistant
    turn with `content: null` and `tool_calls`, a `tool` turn), image parts, a message without
    `content`, and batched completion prompts reach vLLM's own endpoint byte for byte. With
    cartridges (the prompt becomes token ids of text) the shapes it cannot render answer 400 with
    the reason, and nothing goes upstream."""
    import dataclasses

    url, seen = recording_upstream
    app = create_app(dataclasses.replace(settings, upstream=url))
    tool_chat = {"model": model_dir, "max_tokens": 4, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]}
    image_chat = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}
    no_content = {"messages": [{"role": "assistant", "tool_calls": []}, {"role": "user", "content": "hi"}]}
    for body in (tool_chat, image_chat, no_content):
        r = _call(app, "POST", "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        headers, got = seen[-1]
        assert headers[":path"] == "/v1/chat/completions"
        assert got == {**body, "model": settings.model}
    for prompt in (["one", "two"], [[5, 6], [7]], "plain", [5, 6]):
        r = _call(app, "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "echo": False})
        assert r.status_code == 200, r.text
        headers, got = seen[-1]
        assert headers[":path"] == "/v1/completions" and headers["X-Session-ID"].startswith("req:")
        assert got == {"prompt": prompt, "max_tokens": 1, "echo": False, "model": settings.model}

    _cart(tmp_path / "allowed" / "doc", "doc", list(range(1, 65)), model_dir)
    carts = [{"id": str(tmp_path / "allowed" / "doc"), "source": "local"}]
    n = len(seen)
    for body, needle in ((tool_chat, "'assistant' message without text content"),
                         (image_chat, "'image_url' content parts"),
                         ({"prompt": [[5], [6]]}, "not a batch of 2")):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = _call(app, "POST", path, json={**body, "cartridges": carts})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        assert "cannot be combined with cartridges" in r.json()["error"]["message"]
    assert len(seen) == n


def test_gateway_metrics_count_requests_by_status_and_time_the_waits(tmp_path, settings, model_dir, recording_upstream):
    """/metrics (Prometheus text): requests by endpoint and status, the wait for an instance to
    serve a request's cartridges, upstream latency. Before, the gateway had no /metrics."""
    import dataclasses

    from prometheus_client.parser import text_string_to_metric_families

    url, seen = recording_upstream
    app = create_app(dataclasses.replace(settings, upstream=url))
    _cart(tmp_path / "allowed" / "doc", "doc", list(range(1, 65)), model_dir)
    ok = {"prompt": [5, 6], "max_tokens": 1,
          "cartridges": [{"id": str(tmp_path / "allowed" / "doc"), "source": "local"}]}
    assert _call(app, "POST", "/v1/completions", json=ok).status_code == 200
    assert _call(app, "POST", "/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 200
    assert _call(app, "POST", "/v1/completions", json={"prompt": 5}).status_code == 400
    assert (
        _call(app, "POST", "/v1/completions", json={"prompt": [5], "cartridges": [{"id": "nope"}]}).status_code == 404
    )
    # three 503s told apart: a cartridge no instance serves yet, a failed trained load, the upstream's own
    from lmcache_cartridge.lmcache.serving import NotServed

    def not_served(*a, **k):
        raise NotServed(503, "no instance serves it yet", retry_after=1)

    from lmcache_cartridge.api import gateway as gw
    real_wait = gw.wait_served
    gw.wait_served = not_served
    try:
        _trained(tmp_path / "allowed" / "tr", "tr", model_dir)
        tr = {"prompt": [5], "max_tokens": 1,
              "cartridges": [{"id": str(tmp_path / "allowed" / "tr"), "source": "local"}]}
        assert _call(app, "POST", "/v1/completions", json=tr).status_code == 503
    finally:
        gw.wait_served = real_wait
    for i in range(3):  # many client paths, one bounded series
        assert _call(app, "POST", f"/v1/made-up-{i}", json={}).status_code in (404, 405)
    r = _call(app, "GET", "/metrics")
    assert r.status_code == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(r.text) for s in f.samples}

    def requests(status, reason, endpoint="/v1/completions"):
        return samples.get(("lmcache_cartridge_gateway_requests_total",
                            (("endpoint", endpoint), ("reason", reason), ("status", status))))

    assert (requests("200", "ok"), requests("400", "invalid"), requests("404", "not_found"),
            requests("503", "not_served")) == (2.0, 1.0, 1.0, 1.0)
    assert requests("404", "other", "other") == 3.0
    assert not any(k[0] == "lmcache_cartridge_gateway_requests_total" and ("endpoint", "/v1/made-up-0") in k[1]
                   for k in samples)
    # the served one and the trained one that no instance served
    assert samples[("lmcache_cartridge_gateway_ready_wait_seconds_count", ())] == 2.0
    assert samples[("lmcache_cartridge_gateway_upstream_seconds_count", (("endpoint", "/v1/completions"),))] == 2.0


@pytest.mark.parametrize("period", [0, -1, float("nan")])
def test_a_catalog_period_that_would_spin_is_refused_by_the_gateway_as_by_the_plugin(settings, period):
    """`catalog_period` 0, negative or NaN would list the catalog in a busy loop: the gateway
    refuses it when it is built, with the setting named, as the plugin's settings do."""
    import dataclasses

    from lmcache_cartridge.errors import CartridgeError
    from lmcache_cartridge.lmcache.catalog_sync import start_catalog_sync

    with pytest.raises(ValueError, match="catalog_period must be a positive number of seconds"):
        create_app(dataclasses.replace(settings, catalog_uri="s3://gw-unit/catalog/", catalog_period=period))
    plugin = type("S", (), {"catalog_uri": "s3://gw-unit/catalog/", "catalog_period": period, "name": "cartridge",
                            "registry": settings.registry, "s3": {}, "cache_dir": settings.cache_dir,
                            "catalog_allow_uris": ()})
    with pytest.raises(CartridgeError, match="storage_plugin.cartridge.catalog_.*positive"):
        start_catalog_sync(plugin)


def test_the_gateway_starts_and_stops_its_catalog_sync_with_the_app(settings):
    """The app's lifespan owns the catalog sync: started when the app starts, stopped when it stops."""
    import dataclasses

    from fastapi.testclient import TestClient

    app = create_app(dataclasses.replace(settings, catalog_uri="s3://gw-unit/catalog/", catalog_period=3600,
                                         catalog_allow_uris=("s3://gw-other/carts",)))
    sync = app.state.catalog_sync
    assert not sync.running
    # built as the plugin's is (`lmcache.catalog_sync`), from the gateway's own settings
    assert (sync.catalog_uri, sync.period, sync.chunk_size, sync.cache_dir, sync.allow_uris) == (
        "s3://gw-unit/catalog", 3600.0, settings.chunk_size, Path(settings.cache_dir),
        ("s3://gw-unit/", "s3://gw-other/carts/"))
    with TestClient(app) as c:
        assert c.get("/health").json() == {"gateway": "ok"}
        assert sync.running
    assert not sync.running


def test_keep_alive_ends_on_the_side_that_cannot_race(tmp_path, settings):
    """A server closes an idle connection after its keep-alive (vLLM's and uvicorn's: 5 s); a client
    that reuses it at that moment gets it closed without an answer (the gateway answered 502 for a
    request vLLM never saw). So the gateway drops an idle upstream connection before vLLM's
    keep-alive (a request after a longer pause opens a new one), and keeps a client's idle
    connection past the 5 s of an httpx client's pool (a client keeping it longer reuses it)."""
    import dataclasses
    import time

    from lmcache_cartridge.api.gateway import UPSTREAM_KEEPALIVE_S
    from lmcache_cartridge.testing.launch import GatewayThread

    ports = []

    def answer(request, body):
        ports.append(request.client_address[1])  # the gateway's end of the connection
        return 200, {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                     "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}

    upstream = JsonUpstream(answer, keep_alive=True)  # as vLLM's server
    vllm_keep_alive = 5  # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE default
    assert UPSTREAM_KEEPALIVE_S < vllm_keep_alive
    try:
        with GatewayThread(dataclasses.replace(settings, upstream=upstream.url)) as gw, \
                 httpx.Client(base_url=gw.url, timeout=30, limits=httpx.Limits(keepalive_expiry=60)) as client:
            def ask() -> int:
                """One request; the client's local port (the same port: the same connection)."""
                r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                assert r.status_code == 200, r.text
                return r.extensions["network_stream"].get_extra_info("client_addr")[1]

            first = ask()
            time.sleep((UPSTREAM_KEEPALIVE_S + vllm_keep_alive) / 2)  # past the gateway's, within vLLM's
            ask()
            assert ports[1] != ports[0], "the gateway reused an upstream connection vLLM may be closing"
            time.sleep(vllm_keep_alive + 1)  # past an httpx client's pool and uvicorn's default
            assert ask() == first, "the gateway closed a client's idle connection as the client's pool kept it"
    finally:
        upstream.stop()

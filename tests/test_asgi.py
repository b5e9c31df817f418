"""The error bodies the gateway answers itself, standalone and inside vLLM's server (one builder,
`api.asgi`, one `type` rule: `invalid_request_error` for 4xx, `server_error` for 5xx), and the
body the middleware reads being handed on to vLLM whole. No vLLM here: the middleware wraps a
recording ASGI app."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from lmcache_cartridge.api.asgi import BodyTooLarge, error_body, read_body, replay
from lmcache_cartridge.api.gateway import create_app
from test_gateway import _call, model_dir, settings  # noqa: F401 (fixtures)


def test_the_error_body_and_its_type_rule():
    assert error_body(404, "no cartridge") == {"error": {"message": "no cartridge", "type": "invalid_request_error",
                                                         "code": 404}}
    for status in (500, 501, 502, 503):
        assert error_body(status, "m")["error"]["type"] == "server_error"


def test_the_standalone_gateways_bodies(settings):
    app = create_app(dataclasses.replace(settings, api_keys=("k1-0123456789abcdef",)))
    key = {"Authorization": "Bearer k1-0123456789abcdef"}
    r = _call(app, "GET", "/v1/cartridges")
    assert (r.status_code, r.json(), r.headers["www-authenticate"]) == (401, {"error": {
        "message": "a valid API key is required: send 'Authorization: Bearer <key>'", "type": "invalid_request_error",
        "code": 401}}, "Bearer")
    r = _call(app, "POST", "/v1/completions", content=b"x" * 30000, headers=key)
    assert (r.status_code, r.json()) == (413, {"error": {"message": "request body over 20000 bytes",
                                                         "type": "invalid_request_error", "code": 413}})
    r = _call(app, "POST", "/v1/completions", json={"prompt": "x", "cartridges": [{"id": "ghost"}]}, headers=key)
    assert (r.status_code, r.json()) == (404, {"error": {"message": "no cartridge with id or label 'ghost'",
                                                         "type": "invalid_request_error", "code": 404}})
    r = _call(app, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=key)
    assert (r.status_code, r.json()) == (502, {"error": {
        "message": "upstream http://127.0.0.1:9 unreachable: ConnectError", "type": "server_error", "code": 502}})


@pytest.fixture
def middleware(tmp_path, monkeypatch):
    """CartridgeMiddleware around an app that records what reaches it; its gateway cannot be
    built here (no LMCache config), so requests with `cartridges` answer 501."""
    from lmcache_cartridge.api.middleware import CartridgeMiddleware

    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(tmp_path / "missing.yaml"))
    got = []

    async def inner(scope, receive, send):
        msg = await receive()
        got.append((scope["path"], msg))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"vllm's own"})

    return CartridgeMiddleware(inner), got


def test_the_middlewares_bodies_and_the_body_it_hands_on(middleware):
    mw, got = middleware

    def call(method, path, **kw):
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://vllm") as c:
                return await c.request(method, path, **kw)
        return asyncio.run(go())

    r = call("POST", "/v1/completions", json={"prompt": "x", "cartridges": [{"id": "doc"}]})
    assert r.status_code == 501 and r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == 501
    assert r.json()["error"]["message"].startswith("this server cannot serve 'cartridges': "), r.text
    assert "missing.yaml" not in r.text, r.text  # the operator's file: in the log, not the answer
    r = call("GET", "/v1/cartridges")
    assert r.status_code == 501 and r.json()["error"]["type"] == "server_error", r.text
    r = call("POST", "/v1/responses", json={"input": "x", "cartridges": []})
    assert (r.status_code, r.json()) == (400, {"error": {
        "message": "'cartridges' is served on /v1/completions and /v1/chat/completions only, not on /v1/responses",
        "type": "invalid_request_error", "code": 400}})
    assert got == []
    parts = [b'{"prompt": "x", ', b'"kv_transfer_params": {"lmcache.skip_save": true}, ', b'"max_tokens": 1}']

    async def chunks():
        for p in parts:
            yield p

    r = call("POST", "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.text == "vllm's own"
    assert got == [("/v1/completions", {"type": "http.request", "body": b"".join(parts), "more_body": False})]


def test_read_body_stops_past_its_limit_and_replay_hands_it_on_once():
    msgs = [{"type": "http.request", "body": b"ab", "more_body": True},
            {"type": "http.request", "body": b"cd", "more_body": False}, {"type": "http.disconnect"}]

    async def go(limit):
        it = iter(msgs)

        async def receive():
            return next(it)
        body = await read_body(receive, limit)
        again = replay(body, receive)
        return body, await again(), await again()

    body, first, then = asyncio.run(go(4))
    assert body == b"abcd" and first == {"type": "http.request", "body": b"abcd", "more_body": False}
    assert then == {"type": "http.disconnect"}  # the client's own message after the body
    with pytest.raises(BodyTooLarge):
        asyncio.run(go(3))

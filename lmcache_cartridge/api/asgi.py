"""What the standalone gateway (`api.gateway`) and the gateway inside vLLM (`api.middleware`)
share at the ASGI level: the OpenAI error body, and reading a request body whole then handing it
on to the app that answers it.

Runs in the gateway's process (either kind); owns nothing.
"""

from __future__ import annotations

from typing import Any

CLIENT_ERROR = "invalid_request_error"  # `type` of every 4xx the gateway answers itself
SERVER_ERROR = "server_error"           # `type` of every 5xx it answers itself (OpenAI's own)


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error shape, so the SDK raises its usual exception for `status`: `type` by the
    status's class, `code` the HTTP status, `message` what to change."""
    return {"error": {"message": message, "type": CLIENT_ERROR if status < 500 else SERVER_ERROR, "code": status}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None):
    """`error_body` as a JSON response (an ASGI app too: `await error_response(...)(scope, receive, send)`)."""
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


class BodyTooLarge(Exception):
    """A request body grew past the limit `read_body` was given (it stops reading there)."""


async def read_body(receive, limit: int | None = None) -> bytes | None:
    """A request's whole body from ASGI `receive`; None if the client went away first.
    BodyTooLarge as soon as more than `limit` bytes have arrived (the rest is never read)."""
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunks.append(msg.get("body", b""))
        size += len(chunks[-1])
        if limit is not None and size > limit:
            raise BodyTooLarge(f"request body over {limit} bytes")
        if not msg.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive):
    """An ASGI `receive` for the app after us: `body` whole, once, then the client's own
    messages (its disconnect, as servers expect after the body)."""
    sent = False

    async def receive_again():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive_again

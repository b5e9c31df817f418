"""A loopback HTTP server standing in for vLLM or the router in front of the gateway: each
request goes to `answer(request, body)` (the handler, with `command`, `path`, `headers` and
`client_address`; the JSON body or None), which returns (status, JSON object) to send back.
`keep_alive`: HTTP/1.1 connections kept open, as vLLM's server keeps them; off by default, one
connection per request (tests that call the gateway app from a new event loop each time cannot
reuse a connection opened in the last one)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

Answer = Callable[[BaseHTTPRequestHandler, Any], tuple[int, Any]]


class JsonUpstream:
    def __init__(self, answer: Answer, *, keep_alive: bool = False) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def _serve(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                status, obj = answer(self, json.loads(self.rfile.read(n)) if n else None)
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _serve

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "JsonUpstream":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

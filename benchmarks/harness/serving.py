"""The TTFT benchmarks' measured code path, shared by `ttft.py`, `first_hit.py`,
`stalled_origin.py` and `tests/test_bench_ttft.py`: the arms and their model, the documents and
suffixes, making cartridges, starting a server per arm (`make_server`), sending a burst
(`measure_burst`: TTFT = seconds from sending the request to the first streamed token) and
running one arm's cells (`run_arm`, raw TTFT lists). `benchmarks/ttft.py`'s docstring says what
each arm measures. Runs in the benchmark's process; the servers it starts are its children.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from harness.stats import summary
from lmcache_cartridge.tools.testmodel import BuildParams, ensure_model, marker

CHUNK = 256
SUFFIX_LEN = 8


@dataclass(frozen=True)
class MpSetup:
    """How an LMCache-MP arm's servers run: vLLM's connector (`cartridge`: CartridgeMPConnector;
    `lmcache`: LMCache's own LMCacheMPConnector), the `lmcache server`'s `--l2-prefetch-policy`
    and the connector's `lmcache.mp.mp_transfer_mode`. Everything else of the server's command
    line is `tools.lmcache_server.server_command`, the same for every MP arm."""
    connector: str = "cartridge"
    prefetch_policy: str = "default"  # LMCache's; `mp-server` runs `retain` (the cartridge_mp_retain arm)
    transfer_mode: str = "engine_driven"
    shm: bool = True  # the server's L1 in shared memory (`--shm-name`), as `mp-server` runs it
    prefault_l1: bool = True  # the adapter's `prefault_l1`: L1 faulted in at start, as `mp-server` runs it
    preload: bool = False  # the adapter's `preload: ["*"]`: each cartridge loaded into L1 once served

    def describe(self) -> str:
        who = ("vLLM on CartridgeMPConnector" if self.connector == "cartridge"
               else "vLLM on LMCache's own LMCacheMPConnector")
        transfer = {"engine_driven": "engine-driven transfer",
                    "lmcache_driven": "LMCache-driven transfer (shared memory)"}[self.transfer_mode]
        if self.transfer_mode == "engine_driven":
            transfer += " from L1 in shared memory" if self.shm else " pickled over the socket (no --shm-name)"
        l1 = "" if self.prefault_l1 else ", L1 pages allocated on first write (`prefault_l1: false`)"
        l1 += ", `preload: [\"*\"]`" if self.preload else ""
        return (f"lmcache server (cartridge L2 adapter, `--l2-prefetch-policy {self.prefetch_policy}`{l1}) + "
                f"{who}, {transfer}, prefix caching off")


# The LMCache multiprocess-mode arms: (e) and its variants serve the cartridge through the L2
# adapter; `mp_l1` is the anchor MP users have without cartridges (vLLM's own KV stored into the
# server's L1 by a first request, read back by the measured ones).
MP_ARMS = {
    "cartridge_mp": MpSetup(),
    "cartridge_mp_retain": MpSetup(prefetch_policy="retain"),
    "cartridge_mp_shm": MpSetup(transfer_mode="lmcache_driven"),
    "cartridge_mp_pickle": MpSetup(shm=False),
    "cartridge_mp_lazy_l1": MpSetup(prefetch_policy="retain", prefault_l1=False),
    "cartridge_mp_preload": MpSetup(prefetch_policy="retain", preload=True),
    "mp_l1": MpSetup(connector="lmcache"),
    "mp_l1_pickle": MpSetup(connector="lmcache", shm=False),
}
CARTRIDGE_MP_ARMS = ("cartridge_mp", "cartridge_mp_retain", "cartridge_mp_shm", "cartridge_mp_pickle",
                     "cartridge_mp_lazy_l1", "cartridge_mp_preload")
ANCHOR_ARMS = ("mp_l1", "mp_l1_pickle")
PRELOAD_ARMS = frozenset(a for a, mp in MP_ARMS.items() if mp.preload)
ARMS = ("full_prefill", "cartridge", "prefix_cache", "cartridge_cached", *MP_ARMS)
VARIANTS = {"full_prefill": ("cold",), "cartridge": ("first", "repeat"), "prefix_cache": ("warm",),
            "cartridge_cached": ("repeat",), **{a: ("first", "repeat") for a in CARTRIDGE_MP_ARMS},
            **{a: ("repeat",) for a in ANCHOR_ARMS}}
CARTRIDGE_ARMS = ("cartridge", "cartridge_cached", *CARTRIDGE_MP_ARMS)
# Arms whose every request must take the whole document from the KV connector.
EXTERNAL_ARMS = ("cartridge", *MP_ARMS)
# Arms whose requests each carry a fresh `cache_salt`: vLLM's prefix cache never serves them
# (their server may have prefix caching on); the others rely on it. cartridge_cached's requests
# carry the cartridge's own salt (`arm_salt`): they share vLLM's cache with each other, not with
# the plain prompt of the prefix-cache arm, as a trained cartridge is served.
SALTED_ARMS = frozenset({"full_prefill", "cartridge"})


def arm_salt(arm: str, length: int) -> bool | str:
    if arm in SALTED_ARMS:
        return True
    return f"cartridge-{length}" if arm == "cartridge_cached" else False
LABELS = {
    ("full_prefill", "cold"): "(a) full prefill",
    ("cartridge", "first"): "(b) cartridge, first hit (plugin)",
    ("cartridge", "repeat"): "(b) cartridge, repeat hit (LMCache CPU copy)",
    ("prefix_cache", "warm"): "(c) vLLM prefix-cache hit",
    ("cartridge_cached", "repeat"): "(d) cartridge, repeat hit from vLLM's prefix cache",
    ("cartridge_mp", "first"): "(e) LMCache MP mode, first hit (L2 adapter)",
    ("cartridge_mp", "repeat"): "(e) LMCache MP mode, repeat hit",
    ("cartridge_mp_retain", "first"): "(e) LMCache MP mode, retain prefetch policy, first hit (L2 adapter)",
    ("cartridge_mp_retain", "repeat"): "(e) LMCache MP mode, retain prefetch policy, repeat hit (L1)",
    ("cartridge_mp_shm", "first"): "(e) LMCache MP mode, LMCache-driven transfer, first hit (L2 adapter)",
    ("cartridge_mp_shm", "repeat"): "(e) LMCache MP mode, LMCache-driven transfer, repeat hit",
    ("cartridge_mp_pickle", "first"): "(e) LMCache MP mode, L1 not in shared memory, first hit (L2 adapter)",
    ("cartridge_mp_pickle", "repeat"): "(e) LMCache MP mode, L1 not in shared memory, repeat hit",
    **{(a, "cold"): f"(e) {a}: the first load of each length into the server's L1 (the warm-up, 1 request)"
       for a in CARTRIDGE_MP_ARMS},
    ("cartridge_mp_lazy_l1", "first"): "(e) LMCache MP mode, retain, L1 not faulted in, first hit (L2 adapter)",
    ("cartridge_mp_lazy_l1", "repeat"): "(e) LMCache MP mode, retain, L1 not faulted in, repeat hit (L1)",
    ("cartridge_mp_preload", "first"): "(e) LMCache MP mode, retain, preloaded: first hit (L1)",
    ("cartridge_mp_preload", "repeat"): "(e) LMCache MP mode, retain, preloaded: repeat hit (L1)",
    ("mp_l1", "repeat"): "(f) LMCache MP mode without a cartridge: vLLM's own KV, repeat hit (L1)",
    ("mp_l1_pickle", "repeat"): "(f) LMCache MP mode without a cartridge, L1 not in shared memory: repeat hit (L1)",
}


# --- model ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """A locally built benchmark model: its directory name under the models dir and its build
    (`tools.testmodel.BuildParams`, the one description of a test model's geometry)."""
    name: str
    params: BuildParams

    def ensure(self, root: Path | None = None) -> Path:
        return ensure_model(self.params, root, self.name)

    def describe(self) -> dict[str, Any]:
        p = self.params
        h, i, L = p.hidden_size, p.intermediate_size, p.num_layers
        kv = p.num_kv_heads * p.attn_head_dim
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
        return {"name": self.name, **marker(p), "head_dim": p.attn_head_dim,
                "params_non_embedding": per_layer * L + h,
                "params_total": per_layer * L + h + 2 * p.vocab_size * h,
                "kv_bytes_per_token_bf16": 2 * L * kv * 2}


# Llama-3.2-1B's per-layer attention geometry scaled down to what 2 CPU cores prefill in seconds:
# head_dim 128, GQA 8 query / 2 KV heads, SwiGLU 2816 (~2.75 x hidden), 8 layers: ~90M non-embedding
# parameters, 8 KiB of bf16 KV per token (a 16K-token cartridge is 128 MiB).
BENCH_MODEL = ModelSpec("bench-llama-h1024-l8-kv2", BuildParams(
    hidden_size=1024, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=2816, vocab_size=8192,
    max_position_embeddings=32768, seed=0))


def model_info(model_dir: Path) -> dict[str, Any]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv = cfg.get("num_key_value_heads", heads)
    return {"model_dir": str(model_dir), "hidden_size": cfg["hidden_size"],
            "num_layers": cfg["num_hidden_layers"], "num_heads": heads, "num_kv_heads": kv,
            "head_dim": head_dim, "intermediate_size": cfg.get("intermediate_size"),
            "vocab_size": cfg["vocab_size"], "max_position_embeddings": cfg["max_position_embeddings"],
            "kv_bytes_per_token_bf16": 2 * cfg["num_hidden_layers"] * kv * head_dim * 2}


# --- prompts ----------------------------------------------------------------------------------
def document_ids(tokenizer, length: int, seed: int) -> list[int]:
    """`length` tokens of deterministic filler text, BOS first; distinct per seed, so documents of
    different lengths share no chunk (no cross-length hits in LMCache or the prefix cache)."""
    from lmcache_cartridge.tools.testmodel import extra_text

    n = max(32, length // 8)
    while True:
        ids = list(tokenizer(extra_text(n, seed=seed))["input_ids"])
        if len(ids) >= length:
            return [int(t) for t in ids[:length]]
        n *= 2


def suffix_ids(key: tuple, vocab_size: int, avoid: frozenset[int], n: int = SUFFIX_LEN) -> list[int]:
    """The request's own suffix: deterministic in `key` (same across arms, so first tokens can be
    compared), different for every request of a run."""
    rng = random.Random(repr(key))
    out = []
    while len(out) < n:
        t = rng.randrange(vocab_size)
        if t not in avoid:
            out.append(t)
    return out


# --- HTTP -------------------------------------------------------------------------------------
@dataclass
class Shot:
    ttft: float
    token: Optional[int]
    key: tuple


def _token_of(choice: dict) -> Optional[int]:
    lp = choice.get("logprobs") or {}
    toks = lp.get("tokens") or []
    if toks and isinstance(toks[0], str) and toks[0].startswith("token_id:"):
        return int(toks[0].split(":", 1)[1])
    return None


async def _one(client, url: str, body: dict) -> tuple[float, Optional[int]]:
    t0 = time.perf_counter()
    first, token = None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if first is None and choices:
                first = time.perf_counter() - t0
                token = _token_of(choices[0])
    return (first if first is not None else float("nan")), token


def request_body(model: str, prompt: list[int], skip_save: bool, salted: bool | str = False,
                 cartridge_tokens: int = 0) -> dict:
    """`salted`: True for a fresh random `cache_salt` (vLLM's per-request prefix-cache
    isolation), so vLLM's prefix cache cannot serve this request whatever the server's setting; a
    string for that salt (a cartridge's own: its requests share vLLM's cache with each other only).
    `cartridge_tokens`: the prompt's leading cartridge tokens (whole chunks), sent as the gateway
    sends them (`vllm.readiness.CARTRIDGE_TOKENS_PARAM`)."""
    from lmcache_cartridge.vllm.readiness import CARTRIDGE_TOKENS_PARAM

    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "logprobs": 1, "return_tokens_as_token_ids": True}
    params = {"lmcache.skip_save": True} if skip_save else {}
    if cartridge_tokens:
        params[CARTRIDGE_TOKENS_PARAM] = cartridge_tokens
    if params:
        body["kv_transfer_params"] = params
    if salted:
        body["cache_salt"] = salted if isinstance(salted, str) else os.urandom(8).hex()
    return body


def cartridge_tokens(arm: str, length: int) -> int:
    """What the gateway would tell the instance of a cartridge arm's requests: their first
    `length` tokens (whole chunks) are the cartridge's."""
    return (length // CHUNK) * CHUNK if arm in CARTRIDGE_ARMS else 0


def measure_burst(url: str, model: str, prompts: Sequence[list[int]], *, skip_save: bool,
                  timeout: float = 1800, salted: bool | str = False,
                  cartridge_tokens: int = 0) -> list[tuple[float, Optional[int]]]:
    """Send all prompts at once; (TTFT seconds, first token id) per prompt, in order."""
    import httpx

    async def main():
        limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            return await asyncio.gather(*[_one(client, url, request_body(model, p, skip_save, salted, cartridge_tokens))
                                          for p in prompts])

    return list(asyncio.run(main()))


# --- one arm ----------------------------------------------------------------------------------
@dataclass
class Plan:
    lengths: list[int]
    concurrencies: list[int]
    samples: int = 16              # TTFTs per cell: ceil(samples / c) bursts
    max_burst_s: float = 300.0     # skip a cell whose one burst is estimated longer than this
    cell_budget_s: float = 240.0   # no further bursts once a cell has run this long
    vocab_size: int = 1024
    avoid: frozenset = frozenset({0, 1, 2, 3})
    timeout_s: float = 1800.0
    # Per-request stage times (`STAGES`) for the c=1 cells of these (arm, variant)s: e.g.
    # {("cartridge", "first"), ("cartridge", "repeat"), ("prefix_cache", "warm")} (`--breakdown`).
    breakdown: frozenset = frozenset()


# What a request's time is spent on, from the servers' own histograms (`/metrics`): vLLM's
# (recorded as each request finishes) and LMCache's worker-side ones (its stats logger publishes
# them every LMCACHE_STATS_INTERVAL_S: a breakdown cell waits that long before and after).
STAGES = {
    "ttft": "vllm:time_to_first_token_seconds",
    "prefill": "vllm:request_prefill_time_seconds",  # scheduled -> first token: includes the KV load
    "queue": "vllm:request_queue_time_seconds",
    "sched_lookup": "lmcache_cartridge_scheduler_lookup_seconds",  # per lookup, inside prefill (`lookup_metrics`)
    "lmcache_lookup": "lmcache:time_to_lookup",  # worker side, per lookup
    "lmcache_retrieve": "lmcache:time_to_retrieve",  # the whole retrieve a load waits on
    "lmcache_tokens": "lmcache:retrieve_process_tokens_time",  # hashing the tokens, finding objects
    "lmcache_copy": "lmcache:retrieve_to_gpu_time",  # the copy into vLLM's KV cache
    "plugin_read": "lmcache_cartridge_read_seconds",  # the plugin's chunk reads: one per chunk it serves
}
# In LMCache's MP mode, from the `lmcache server`: the cartridge adapter's own stage totals (its
# serving-state record, `store.metrics.Metrics.stage`; per request: the total over the cell's
# requests) and the server's transfer to the worker (prepare to commit of each retrieve, from
# the "Retrieved N tokens in S seconds" line LMCache logs for it).
MP_STAGES = {
    "mp_lookup": "the adapter's lookups (index, layout, lock)",
    "mp_load": "the adapter's loads (read, verify, encode into L1)",
    "mp_encode": "of which encoding vLLM-CPU rows",
    "mp_transfer": "the server's retrieve to the worker",
}
# The cells `--breakdown` times: (arm, variant), at c=1.
BREAKDOWN_CELLS = frozenset({("cartridge", "first"), ("cartridge", "repeat"), ("prefix_cache", "warm"),
                             ("cartridge_mp", "first"), ("cartridge_mp", "repeat"),
                             ("cartridge_mp_retain", "repeat"), ("mp_l1", "repeat")})
LMCACHE_STATS_INTERVAL_S = 10.0  # lmcache 0.5.6: LMCacheEngineBuilder's LMCacheStatsLogger(log_interval=10)


def stage_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each `STAGES` histogram on this server now, over all label sets."""
    from lmcache_cartridge.testing.fleet import metric_samples

    names = {v: k for k, v in STAGES.items()}
    acc = {k: [0.0, 0.0] for k in STAGES}
    for smp in metric_samples(url):
        base, _, suffix = smp.name.rpartition("_")
        if base in names and suffix in ("sum", "count"):
            acc[names[base]][0 if suffix == "sum" else 1] += smp.value
    return {k: (v[0], v[1]) for k, v in acc.items()}


def mp_stage_sums(server) -> dict[str, tuple[float, float]]:
    """(seconds, events) of each `MP_STAGES` stage on an MP server (`testing.launch.MpVllmServer`)
    so far; {} for other servers."""
    import re

    if not hasattr(server, "lmcache_server"):
        return {}
    acc = {k: [0.0, 0.0] for k in MP_STAGES}
    for st in server.plugin_states():  # the adapter's record (the server's process group)
        for k, v in st.stages.items():
            if f"mp_{k}" in acc:
                acc[f"mp_{k}"][0] += v.get("seconds", 0.0)
                acc[f"mp_{k}"][1] += v.get("count", 0.0)
    for m in re.finditer(r"Retrieved \d+ tokens in ([0-9.]+) seconds", server.lmcache_server.log_text()):
        acc["mp_transfer"][0] += float(m.group(1))
        acc["mp_transfer"][1] += 1
    return {k: (v[0], v[1]) for k, v in acc.items()}


def stage_means(after: dict, before: dict) -> dict[str, dict[str, float]]:
    """Per stage: events between two `stage_sums` and their mean in ms (stages with none left out)."""
    out = {}
    for k, (s1, n1) in after.items():
        s0, n0 = before.get(k, (0.0, 0.0))
        if n1 > n0:
            out[k] = {"n": n1 - n0, "mean_ms": round((s1 - s0) / (n1 - n0) * 1e3, 3)}
    return out


@dataclass
class Cell:
    arm: str
    variant: str
    length: int
    concurrency: int
    shots: list[Shot] = field(default_factory=list)
    ext_tokens: float = 0.0          # vLLM external-KV counter delta over the cell
    expected_ext: Optional[float] = None
    pc_hit_tokens: float = 0.0       # tokens from vLLM's prefix cache, delta (checked for arm (d))
    expected_pc_hits: Optional[float] = None
    skipped: Optional[str] = None
    wall_s: float = 0.0
    stages: Optional[dict] = None    # `stage_means` over the cell, where the plan asks for them

    @property
    def ttfts(self) -> list[float]:
        return [s.ttft for s in self.shots]

    def summary(self) -> dict[str, Any]:
        d = {"arm": self.arm, "variant": self.variant, "label": LABELS[(self.arm, self.variant)],
             "length": self.length, "concurrency": self.concurrency, "n": len(self.shots),
             "skipped": self.skipped, "wall_s": round(self.wall_s, 3),
             "ext_tokens": self.ext_tokens, "expected_ext_tokens": self.expected_ext,
             "pc_hit_tokens": self.pc_hit_tokens, "expected_pc_hit_tokens": self.expected_pc_hits,
             "ttft_s": [round(t, 6) for t in self.ttfts],
             "first_tokens": [s.token for s in self.shots],
             "keys": [list(s.key) for s in self.shots], "stages": self.stages}
        if self.shots:
            t = summary(self.ttfts)
            d.update(p50_s=t["p50"], p95_s=t["p95"], p99_s=t["p99"], mean_s=t["mean"], min_s=t["min"], max_s=t["max"])
        d["ext_ok"] = ((self.expected_ext is None or self.ext_tokens == self.expected_ext)
                       and (self.expected_pc_hits is None or self.pc_hit_tokens == self.expected_pc_hits))
        return d


def _kv_sources(server) -> tuple[float, float]:
    """(prompt tokens from the KV connector, from vLLM's own prefix cache) so far: vLLM's
    counters, one `/metrics` read; NaN if it cannot be read."""
    try:
        c = server.counters()
        return c["external_tokens"], c["cached_tokens"]
    except Exception:
        return float("nan"), float("nan")


def run_cell(server, arm: str, variant: str, doc: list[int], concurrency: int, plan: Plan, *,
             skip_save: bool, t_ref: Optional[float] = None, expect_ext_per_request: Optional[int] = None,
             expect_pc_hits_per_request: Optional[int] = None,
             before_burst: Optional[Callable[[], None]] = None, log: Callable[[str], None] = print) -> Cell:
    """ceil(samples / c) bursts of `concurrency` requests `doc + own suffix` (fewer if the cell's
    time budget runs out; none, with the reason, if one burst is estimated over max_burst_s)."""
    L = len(doc)
    cell = Cell(arm, variant, L, concurrency)
    if t_ref is not None and concurrency * t_ref > plan.max_burst_s:
        cell.skipped = (f"one burst estimated {concurrency * t_ref:.0f}s (c x {t_ref:.1f}s) > "
                        f"max_burst_s {plan.max_burst_s:.0f}")
        log(f"  {arm}/{variant} L={L} c={concurrency}: skipped, {cell.skipped}")
        return cell
    n_bursts = max(1, math.ceil(plan.samples / concurrency))
    staged = concurrency == 1 and (arm, variant) in plan.breakdown
    if staged:
        time.sleep(LMCACHE_STATS_INTERVAL_S + 1)  # what LMCache measured before this cell is published
        stages0 = {**stage_sums(server.url), **mp_stage_sums(server)}
    (ext0, pc0), t0 = _kv_sources(server), time.perf_counter()
    burst_s = 0.0
    for b in range(n_bursts):
        if b and (time.perf_counter() - t0) + burst_s > plan.cell_budget_s:
            log(f"  {arm}/{variant} L={L} c={concurrency}: cell budget reached after {b} bursts")
            break
        if before_burst is not None:
            before_burst()
        keys = [(L, concurrency, b, i) for i in range(concurrency)]
        prompts = [doc + suffix_ids(k, plan.vocab_size, plan.avoid) for k in keys]
        tb = time.perf_counter()
        for k, (ttft, tok) in zip(keys, measure_burst(server.url, server.model, prompts,
                                                      skip_save=skip_save, timeout=plan.timeout_s,
                                                      salted=arm_salt(arm, L),
                                                      cartridge_tokens=cartridge_tokens(arm, L))):
            cell.shots.append(Shot(ttft, tok, k))
        burst_s = time.perf_counter() - tb
    cell.wall_s = time.perf_counter() - t0
    if staged:
        time.sleep(LMCACHE_STATS_INTERVAL_S + 1)  # ... and what it measured during it
        stages1 = {**stage_sums(server.url), **mp_stage_sums(server)}
        cell.stages = stage_means(stages1, stages0)
        for k in MP_STAGES:  # per request, whatever the server's batching: the cell's total / requests
            if k in cell.stages and cell.shots:
                cell.stages[k]["mean_ms"] = round((stages1[k][0] - stages0[k][0]) / len(cell.shots) * 1e3, 3)
        log(f"  {arm}/{variant} L={L}: stages (mean ms) "
            + ", ".join(f"{k} {v['mean_ms']:.2f}" for k, v in cell.stages.items()))
    ext1, pc1 = _kv_sources(server)
    cell.ext_tokens, cell.pc_hit_tokens = ext1 - ext0, pc1 - pc0
    if expect_ext_per_request is not None:
        cell.expected_ext = float(expect_ext_per_request * len(cell.shots))
    if expect_pc_hits_per_request is not None:
        cell.expected_pc_hits = float(expect_pc_hits_per_request * len(cell.shots))
    s = cell.summary()
    log(f"  {arm}/{variant} L={L} c={concurrency}: n={s['n']} p50 {s['p50_s'] * 1e3:.1f} ms "
        f"p95 {s['p95_s'] * 1e3:.1f} ms ext {cell.ext_tokens:.0f} prefix-cache hits {cell.pc_hit_tokens:.0f}"
        + ("" if s["ext_ok"] else f" (EXPECTED ext {cell.expected_ext}, hits {cell.expected_pc_hits})"))
    return cell


def _register(server, registry, path: Path, *, preloaded: bool = False) -> str:
    """Register and wait until the server's plugins serve it (their serving-state records); with
    `preloaded`, also until the adapter has preloaded it (one more `preload` stage event)."""
    before = server.stage_count("preload") if preloaded else 0
    e = registry.register(path)
    server.wait_served([e], timeout=60)
    deadline = time.monotonic() + 120
    while preloaded and server.stage_count("preload") == before:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{e.id}: not preloaded after 120 s")
        time.sleep(0.1)
    return e.id


def _remove(server, registry, cid: str) -> None:
    if registry.remove(cid):
        server.wait_not_served(cid, timeout=60)


def run_arm(arm: str, server, docs: dict[int, list[int]], plan: Plan, *, skip_save: bool = False,
            registry=None, cartridges: Optional[dict[int, Path]] = None,
            log: Callable[[str], None] = print) -> list[Cell]:
    """Run one arm on a started, healthy server; return its cells (raw TTFTs in `cell.shots`).

    full_prefill / prefix_cache: `server` is plain vLLM (or, for full_prefill with
    `skip_save=True`, the LMCache server with nothing registered); their cells expect no external
    KV tokens at all.
    cartridge / cartridge_cached / the cartridge MP arms: `registry` is the server's Registry,
    `cartridges` maps each length to its packed cartridge directory; each is registered for its
    length only and removed afterwards. cartridge's and the MP arms' cells expect the document
    from external KV on every request; cartridge_cached's (server with prefix caching on) none,
    and the document from vLLM's prefix cache, which the unsalted warm-up (loaded through the
    connector) filled.
    mp_l1: an MP server (`make_server("mp_l1")`) with nothing registered: the warm-up computes the
    document and LMCache stores it into the server's L1; the cells start once a probe request
    takes the whole document from LMCache (the store is asynchronous, `wait_stored`).
    """
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}")
    cells: list[Cell] = []
    lengths = sorted(docs)
    for li, L in enumerate(lengths):
        doc = docs[L]
        cid = None
        if arm in CARTRIDGE_ARMS:
            cid = _register(server, registry, cartridges[L], preloaded=arm in PRELOAD_ARMS)
        try:
            # Warm-up at this length (not measured): the prefix-cache arm's "sent once to warm",
            # the cartridge's first use, one-time allocations; its TTFT sizes the cells.
            warm = measure_burst(server.url, server.model,
                                 [doc + suffix_ids(("warm", L), plan.vocab_size, plan.avoid)],
                                 skip_save=skip_save, timeout=plan.timeout_s, salted=arm_salt(arm, L),
                                 cartridge_tokens=cartridge_tokens(arm, L))
            t_ref = warm[0][0]
            log(f"  {arm} L={L}: warm-up TTFT {t_ref * 1e3:.1f} ms")
            if arm in CARTRIDGE_MP_ARMS:  # its first load into L1 pages this length did not use before
                cells.append(Cell(arm, "cold", L, 1, shots=[Shot(t_ref, warm[0][1], ("warm", L))]))
            if arm in ANCHOR_ARMS:
                wait_stored(server, doc, plan, log=log)
            too_long = arm == "full_prefill" and t_ref > plan.max_burst_s
            for variant in VARIANTS[arm]:
                before = None
                if arm in ("cartridge", *CARTRIDGE_MP_ARMS) and variant == "first":
                    def before(cid=cid, path=cartridges[L]):
                        _remove(server, registry, cid)
                        _register(server, registry, path, preloaded=arm in PRELOAD_ARMS)
                expect = (L // CHUNK) * CHUNK if arm in EXTERNAL_ARMS else 0
                expect_hits = (L // CHUNK) * CHUNK if arm == "cartridge_cached" else None
                ref = t_ref
                for c in plan.concurrencies:
                    if too_long:
                        cells.append(Cell(arm, variant, L, c, skipped=(
                            f"one request took {t_ref:.0f}s > max_burst_s {plan.max_burst_s:.0f}")))
                        continue
                    cell = run_cell(server, arm, variant, doc, c, plan, skip_save=skip_save,
                                    t_ref=ref if arm == "full_prefill" else None,
                                    expect_ext_per_request=expect,
                                    expect_pc_hits_per_request=expect_hits, before_burst=before, log=log)
                    if c == 1 and cell.shots:
                        ref = cell.summary()["p50_s"]
                    cells.append(cell)
        finally:
            if cid is not None:
                _remove(server, registry, cid)
        if too_long:
            for L2 in lengths[li + 1:]:
                for variant in VARIANTS[arm]:
                    for c in plan.concurrencies:
                        cells.append(Cell(arm, variant, L2, c, skipped=(
                            f"L={L} already took {t_ref:.0f}s per request > max_burst_s")))
            break
    return cells


def wait_stored(server, doc: list[int], plan: Plan, timeout: float = 60.0,
                log: Callable[[str], None] = print) -> int:
    """Until an (unmeasured) probe request `doc + its own suffix` takes every whole chunk of `doc`
    from the KV connector (vLLM's counter): what a store by an earlier request left in LMCache is
    complete. Returns the probes sent."""
    want = (len(doc) // CHUNK) * CHUNK
    deadline = time.perf_counter() + timeout
    for n in range(1, 10_000):
        ext0 = _kv_sources(server)[0]
        measure_burst(server.url, server.model,
                      [doc + suffix_ids(("stored", len(doc), n), plan.vocab_size, plan.avoid)],
                      skip_save=False, timeout=plan.timeout_s)
        got = _kv_sources(server)[0] - ext0
        if got == want:
            log(f"  L={len(doc)}: stored, probe {n} took {got:.0f} tokens from LMCache")
            return n
        if time.perf_counter() > deadline:
            raise TimeoutError(f"the document's {want} tokens not served from LMCache {timeout:.0f}s after it was "
                               f"computed (last probe: {got} tokens)")
        time.sleep(0.5)
    raise AssertionError("not reached")


# --- cartridges -------------------------------------------------------------------------------
def compute_kv_chunked(model, token_ids: list[int], step: int = 2048):
    """First-k KV `[2, L, T, H, D]` of `token_ids` with HF transformers, `step` tokens per forward
    pass into a DynamicCache (bounded attention memory at 16K tokens); one pass when it fits, which
    is exactly `create.compute_prefix_kv`."""
    import torch
    from transformers import DynamicCache

    from lmcache_cartridge.cartridge.model_kv import cache_to_kv, compute_prefix_kv

    if len(token_ids) <= step:
        return compute_prefix_kv(model, token_ids).cpu()  # a CUDA model (--device) computes on the GPU
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for s in range(0, len(token_ids), step):
            model.model(input_ids=ids[:, s:s + step], past_key_values=cache, use_cache=True)
    return cache_to_kv(cache).cpu()


def _cartridge_name(kind: str, length: int, doc: list[int], model_name: str) -> str:
    digest = hashlib.sha256((model_name + json.dumps(doc)).encode()).hexdigest()[:12]
    return f"ttft-{kind}{length}-{digest}"


def _cartridge_dir(out_dir: Path, kind: str, length: int, doc: list[int], model_name: str) -> Optional[Path]:
    """Where a benchmark cartridge of `doc` goes; None when one built for the same tokens is already there
    (anything else there is removed)."""
    from lmcache_cartridge.cartridge.manifest import Manifest

    d = Path(out_dir) / _cartridge_name(kind, length, doc, model_name)
    try:
        if Manifest.load(d).token_ids == doc:
            return None
    except Exception:
        shutil.rmtree(d, ignore_errors=True)
    return d


def make_cartridges(model_dir: Path, docs: dict[int, list[int]], out_dir: Path, *, model_name: str,
                    device: str = "cpu", log: Callable[[str], None] = print) -> dict[int, Path]:
    """A packed first-k cartridge per document (reused when already built for the same tokens)."""
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.cartridge.packed import pack_kv

    out: dict[int, Path] = {}
    model = None
    for L, doc in sorted(docs.items()):
        d = _cartridge_dir(out_dir, "", L, doc, model_name)
        if d is None:
            out[L] = Path(out_dir) / _cartridge_name("", L, doc, model_name)
            continue
        if model is None:
            model, _ = load_model(model_dir)
            model = model.to(device)
        t = time.perf_counter()
        kv = compute_kv_chunked(model, doc)
        pack_kv(kv, d, cartridge_id=d.name, model=model_name, kind="first_k", token_ids=doc,
                chunk_size=CHUNK, provenance={"method": "first_k", "benchmark": "ttft"})
        log(f"cartridge {d.name}: {L} tokens, {kv.nbytes / 2**20:.0f} MiB, {time.perf_counter() - t:.1f}s")
        out[L] = d
    return out


def make_random_cartridges(model_dir: Path, docs: dict[int, list[int]], out_dir: Path, *, model_name: str,
                           device: str = "cpu", log: Callable[[str], None] = print) -> dict[int, Path]:
    """A packed first-k cartridge per document with random KV of the model's geometry: for a
    model served with random weights (`--shape`), where no other engine can compute its KV. What
    the arms time (reads, copies, the paged cache) does not depend on the values; answers are
    then not compared with a reference."""
    import torch

    from lmcache_cartridge.cartridge.packed import pack_kv

    info = model_info(model_dir)
    out: dict[int, Path] = {}
    for L, doc in sorted(docs.items()):
        d = _cartridge_dir(out_dir, "random-", L, doc, model_name)
        if d is None:
            out[L] = Path(out_dir) / _cartridge_name("random-", L, doc, model_name)
            continue
        t = time.perf_counter()
        g = torch.Generator(device=device).manual_seed(L)
        kv = torch.randn(2, info["num_layers"], L, info["num_kv_heads"], info["head_dim"], generator=g,
                         device=device, dtype=torch.bfloat16).cpu()
        pack_kv(kv, d, cartridge_id=d.name, model=model_name, kind="first_k", token_ids=doc,
                chunk_size=CHUNK, provenance={"method": "random", "benchmark": "ttft"})
        log(f"cartridge {d.name}: {L} tokens, random KV, {kv.nbytes / 2**20:.0f} MiB, {time.perf_counter() - t:.1f}s")
        out[L] = d
    return out


def hf_reference_tokens(model_dir: Path, cartridges: dict[int, Path], keys_by_length: dict[int, set],
                        plan: Plan, log: Callable[[str], None] = print) -> dict[tuple, int]:
    """Greedy first token HF transformers computes for `document + suffix` given the cartridge's
    own packed KV as `past_key_values` (positions offset by the document): exactly what arm (b)
    must reproduce. This separates "is injection right" (b vs this) from "how close is HF's KV to
    vLLM's own prefill" (a vs b), which on a random model with peaked attention can differ on
    near-ties."""
    import torch

    from lmcache_cartridge.cartridge.model_kv import kv_to_cache, load_model
    from lmcache_cartridge.cartridge.packed import PackedCartridge

    model, _ = load_model(model_dir)
    out: dict[tuple, int] = {}
    for L, keys in sorted(keys_by_length.items()):
        with PackedCartridge(cartridges[L]) as pc:
            cache = kv_to_cache(pc.load_kv(), model.config)
        t = time.perf_counter()
        for key in sorted(keys, key=repr):  # cells keys (L, c, burst, i) and warm-ups ("warm", L)
            suffix = torch.tensor([suffix_ids(key, plan.vocab_size, plan.avoid)])
            with torch.inference_mode():
                logits = model(input_ids=suffix, past_key_values=cache, use_cache=True).logits[0, -1]
            cache.crop(L)
            out[key] = int(logits.float().argmax())
        log(f"HF reference L={L}: {len(keys)} suffixes in {time.perf_counter() - t:.1f}s")
    return out


# --- servers ----------------------------------------------------------------------------------
@dataclass
class ServerConfig:
    threads_bind: str = "1"
    max_model_len: int = 2048
    kv_cache_gb: int = 1
    lmcache_cpu_gb: float = 1
    device: bool = False
    extra_args: tuple[str, ...] = ()  # appended to every vLLM command line (`--server-arg`)


def make_server(kind: str, root: Path, model_dir: Path, cfg: ServerConfig):
    """Start (not wait for) one server. kind: `plain` (prefix caching off), `prefix` (plain, prefix
    caching on), `lmcache` (LMCache + plugin + CartridgeConnector, prefix caching on: arms that
    must not be served by it salt their requests, see SALTED_ARMS) or an `MP_ARMS` name (an
    `lmcache server` with the cartridge adapter and vLLM on the arm's MP connector, prefix caching
    off; `mp` is `cartridge_mp`). Returns (server, registry or None)."""
    from lmcache_cartridge.testing.launch import MpVllmServer, VllmServer, lmcache_config
    from lmcache_cartridge.store.registry import Registry

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    lmc, registry = None, None
    if kind == "lmcache":
        registry = Registry(root / "registry.db")
        lmc = lmcache_config(root / "registry.db", chunk_size=CHUNK, cpu_gb=cfg.lmcache_cpu_gb,
                             refresh=0.2, cache_dir=root / "plugin-cache")
    elif kind == "mp":
        kind = "cartridge_mp"
    elif kind not in ("plain", "prefix", *MP_ARMS):
        raise ValueError(kind)
    extra: tuple[str, ...] = ()
    threads = cfg.threads_bind
    if cfg.device:
        threads = "auto"  # VLLM_CPU_* variables are ignored on CUDA
        extra = ("--gpu-memory-utilization", "0.85")
    extra = (*extra, *cfg.extra_args)
    if kind in MP_ARMS:
        mp = MP_ARMS[kind]
        registry = Registry(root / "registry.db")
        server = MpVllmServer(root, str(model_dir), registry=registry.path, cache_dir=root / "plugin-cache",
                              chunk_size=CHUNK, l1_size_gb=cfg.lmcache_cpu_gb, max_model_len=cfg.max_model_len,
                              threads_bind=threads, kv_cache_gb=cfg.kv_cache_gb, extra_args=extra,
                              transfer_mode=mp.transfer_mode, prefetch_policy=mp.prefetch_policy,
                              connector=mp.connector, shm=mp.shm,
                              adapter_extra={**({} if mp.prefault_l1 else {"prefault_l1": False}),
                                             **({"preload": ["*"]} if mp.preload else {})} or None,
                              server_env={"LMCACHE_LOG_LEVEL": "INFO"})  # its per-retrieve line: `mp_transfer`
        return server, registry
    server = VllmServer(root, str(model_dir), lmcache=lmc, prefix_caching=(kind in ("prefix", "lmcache")),
                        max_model_len=cfg.max_model_len, threads_bind=threads,
                        kv_cache_gb=cfg.kv_cache_gb, extra_args=extra)
    return server, registry


def warm_server(server, plan: Plan, skip_save: bool) -> None:
    """One short request after start-up (lazy initialisation), never measured."""
    measure_burst(server.url, server.model, [[1] + suffix_ids(("server-warm",), plan.vocab_size,
                                                              plan.avoid, 64)], skip_save=skip_save)


def log_checks(server) -> dict[str, Any]:
    text = server.log_text()
    return {"kv_load_failed": text.count("KV load failed"), "tracebacks": text.count("Traceback"),
            "cpu_layout_verified": "vLLM CPU KV layout verified" in text,
            "no_cpu_connector": "No supported cpu connector" in text}

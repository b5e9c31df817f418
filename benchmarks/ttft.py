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

The measured code path is `harness.serving`: `run_arm(...)` runs one arm and returns its cells (raw TTFT
lists); `measure_burst(...)` sends one burst. `tests/test_bench_ttft.py` runs it at tiny sizes.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import GiB, ROOT, Arm, Result, machine_info, parse_ints, write_result
from harness.serving import (
    ARMS, BENCH_MODEL, BREAKDOWN_CELLS, CARTRIDGE_ARMS, CHUNK, Cell, LABELS, MP_ARMS, MP_STAGES, Plan, STAGES,
    SUFFIX_LEN, ServerConfig, document_ids, hf_reference_tokens, log_checks, make_cartridges,
    make_random_cartridges, make_server, model_info, run_arm, warm_server,
)

from lmcache_cartridge.tools.testmodel import SHAPES, ensure_shape_model

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
    cfg = result["config"]
    out = _intro_markdown(result)
    for c in cfg["concurrency"]:
        out += _concurrency_markdown(by, cfg["lengths"], c)
    if any(c["arm"] in MP_ARMS for c in cells):
        out += mp_markdown(by, cfg)
    out += _agreement_markdown(result, by)
    out += _breakdown_markdown(cells)
    out += _left_out_markdown(result, cells)
    out.append(seed_markdown())
    return "\n".join(out)


def _intro_markdown(result: dict) -> list[str]:
    """Title, machine, model, the request and the arms."""
    m, mach = result["model"], result["machine"]
    cfg = result["config"]
    return [f"# vLLM TTFT: full prefill vs cartridge (LMCache + plugin) vs prefix-cache hit"
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


def _concurrency_markdown(by: dict, lengths: list[int], c: int) -> list[str]:
    """The in-process arms (and the MP cartridge's) at concurrency `c`, with their ratios."""
    out = [f"## Concurrency {c}", "",
           "| doc tokens | (a) full prefill | (b) cartridge first hit | (b) cartridge repeat hit "
           "| (c) prefix-cache hit | (d) cartridge via prefix cache | (e) MP first hit | (e) MP repeat hit "
           "| a / b-repeat | b-repeat / c | b-first / b-repeat | d / c | e-repeat / b-repeat "
           "| e-first / b-first |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for L in lengths:
        a = by.get(("full_prefill", "cold", L, c))
        bf = by.get(("cartridge", "first", L, c))
        br = by.get(("cartridge", "repeat", L, c))
        pc = by.get(("prefix_cache", "warm", L, c))
        d = by.get(("cartridge_cached", "repeat", L, c))
        ef = by.get(("cartridge_mp", "first", L, c))
        er = by.get(("cartridge_mp", "repeat", L, c))
        out.append(f"| {L:,} | {_fmt(a)} | {_fmt(bf)} | {_fmt(br)} | {_fmt(pc)} | {_fmt(d)} | {_fmt(ef)} | "
                   f"{_fmt(er)} | {_ratio(a, br, 1)} | {_ratio(br, pc)} | {_ratio(bf, br)} | {_ratio(d, pc)} | "
                   f"{_ratio(er, br)} | {_ratio(ef, bf)} |")
    out.append("")
    return out


def _agreement_markdown(result: dict, by: dict) -> list[str]:
    """Greedy first tokens equal to arm (a)'s, and to HF transformers' given the cartridge's KV."""
    out = []
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
    for x in result["cells"]:
        if x.get("hf_tokens"):
            a = hf.setdefault(x["label"], [0, 0])
            a[0] += sum(t == u for t, u in zip(x["first_tokens"], x["hf_tokens"]))
            a[1] += len(x["hf_tokens"])
    if hf:
        out += ["Greedy first token equal to HF transformers' given the cartridge's own KV as "
                "`past_key_values` (the independent reference for what injection must produce): "
                + "; ".join(f"{k}: {v[0]}/{v[1]}" for k, v in hf.items()) + ".", ""]
    return out


def _breakdown_markdown(cells: list[dict]) -> list[str]:
    """`--breakdown`'s per-stage means of the cells that have them."""
    staged = [x for x in cells if x.get("stages")]
    if not staged:
        return []
    cols = [k for k in (*STAGES, *MP_STAGES) if any(k in x["stages"] for x in staged)]
    out = ["## Where a request's time goes (`--breakdown`, c=1)", "",
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
    return out


def _left_out_markdown(result: dict, cells: list[dict]) -> list[str]:
    """Skipped cells, lengths not run, and the servers' start-up times."""
    out = []
    skipped = [c for c in cells if c.get("skipped")]
    if skipped:
        out += ["Skipped cells:", ""]
        out += [f"- {c['label']}, L={c['length']}, c={c['concurrency']}: {c['skipped']}" for c in skipped]
        out.append("")
    if result.get("capped"):
        out += [f"Lengths not run: {result['capped']}", ""]
    out += ["Server start-up to healthy: " + ", ".join(
        f"{k} {v['startup_s']:.0f}s" for k, v in result["servers"].items() if v.get("startup_s")) + ".", ""]
    return out


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
def as_result(result: dict, args: argparse.Namespace) -> Result:
    """The run as the harness's result: one arm per measured cell (arm, variant, length, concurrency)."""
    arms = [Arm.from_samples(f"{c['arm']}/{c['variant']}/{c['length']}/c{c['concurrency']}", c["ttft_s"],
                             ext_ok=c["ext_ok"], skipped=c["skipped"])
            for c in result["cells"]]
    return Result(benchmark="ttft", machine=result["machine"], parameters=vars(args), arms=arms,
                  details={k: v for k, v in result.items() if k != "machine"})


def parser() -> argparse.ArgumentParser:
    """The command line (`--help`)."""
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
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)

    if args.device:
        import torch
        if not torch.cuda.is_available():
            ap.error("--device needs a CUDA GPU with vllm (not vllm-cpu) and LMCache's CUDA ops")
    return TtftRun(args, ap).run()


class TtftRun:
    """One run, phase by phase: the options, the model and the lengths it allows, the server
    settings and the plan (constructor); then `run`: the cartridges, each arm on its server (every
    arm's cells saved as they come), the HF reference, the report."""

    def __init__(self, args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
        self.args, self.ap = args, ap
        self.lengths = args.lengths or ([256, 1024] if args.quick else [256, 512, 1024, 2048, 4096, 8192, 16384])
        self.concs = args.concurrency or ([1, 4] if args.quick else [1, 4, 16])
        self.samples = args.samples or (4 if args.quick else 16)
        self.baseline = args.baseline or ("lmcache" if args.quick else "plain")
        self.arms = [a for a in args.arms.split(",") if a]
        if any(a not in ARMS for a in self.arms):
            ap.error(f"--arms: choose from {ARMS}")
        self.out = args.out or (ROOT / "benchmarks" / "results" / ("quick" if args.quick else ""))
        self.work = (args.work or (ROOT / ".cache" / "bench-ttft")).resolve()  # servers run with other working dirs
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.t_start = time.perf_counter()
        machine = machine_info(args.device)
        if args.shape and args.model_dir:
            ap.error("--shape and --model-dir: choose one")
        self.model_dir = (args.model_dir.resolve() if args.model_dir else ensure_shape_model(args.shape)
                          if args.shape else BENCH_MODEL.ensure())
        self.server_args = tuple(args.server_arg) + (("--load-format", "dummy") if args.shape else ())
        self.minfo = model_info(self.model_dir)
        self.log(f"model {self.model_dir}: {self.minfo}")
        self.cap_lengths()
        self.scfg = self.server_config()
        self.make_plan()
        self.result = self.new_result(machine)
        self.cartridges: dict[int, Path] = {}

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t_start:7.1f}s] {msg}", flush=True)

    def cap_lengths(self) -> None:
        """Caps: whole chunks; the model's positions and --max-model-len."""
        self.capped = []
        limit = self.minfo["max_position_embeddings"]
        if self.args.max_model_len:
            limit = min(limit, self.args.max_model_len)
        keep = []
        for L in self.lengths:
            if L % CHUNK or L < CHUNK:
                self.capped.append(f"{L} (not a multiple of {CHUNK})")
            elif L + SUFFIX_LEN > limit:
                self.capped.append(f"{L} (> max_model_len/max_position_embeddings {limit} with the suffix)")
            else:
                keep.append(L)
        self.lengths = sorted(set(keep))
        if not self.lengths:
            self.ap.error(f"no length left: {self.capped}")

    def server_config(self) -> ServerConfig:
        """max_model_len, vLLM's KV cache and LMCache's CPU tier (or L1) for the longest burst."""
        args, lengths, concs = self.args, self.lengths, self.concs
        self.max_model_len = args.max_model_len or min(self.minfo["max_position_embeddings"],
                                                       math.ceil((max(lengths) + SUFFIX_LEN + 1) / CHUNK) * CHUNK)
        kvb = self.minfo["kv_bytes_per_token_bf16"]
        need = max(concs) * (max(lengths) + SUFFIX_LEN + 128) * kvb
        self.kv_gb = max(1, min(args.kv_cache_gb_max, math.ceil(need * 1.25 / GiB)))
        self.lmc_gb = args.lmcache_gb or max(1, min(args.kv_cache_gb_max,
                                                    math.ceil(max(concs) * max(lengths) * kvb * 1.25 / GiB)))
        return ServerConfig(threads_bind=args.threads_bind, max_model_len=self.max_model_len, kv_cache_gb=self.kv_gb,
                            lmcache_cpu_gb=self.lmc_gb, device=args.device, extra_args=self.server_args)

    def make_plan(self) -> None:
        """The cells' plan and each length's document."""
        from transformers import AutoTokenizer

        args = self.args
        tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        vocab = min(self.minfo["vocab_size"], len(tok))  # a shape's embedding is larger than its local tokenizer
        avoid = frozenset(int(i) for i in tok.all_special_ids) | frozenset(range(4))
        self.plan = Plan(self.lengths, self.concs, samples=self.samples, max_burst_s=args.max_burst_s,
                         cell_budget_s=args.cell_budget_s, vocab_size=vocab, avoid=avoid,
                         breakdown=BREAKDOWN_CELLS if args.breakdown else frozenset())
        self.docs = {L: document_ids(tok, L, seed=100_000 + L) for L in self.lengths}

    def new_result(self, machine: dict) -> dict[str, Any]:
        args = self.args
        arms_used = {
            "full_prefill": ("plain vLLM, no KV connector, prefix caching off" if self.baseline == "plain" else
                             "the arm-(b) server (LMCache + plugin + connector) before any cartridge is "
                             "registered, prefix caching off, `lmcache.skip_save`"),
        }
        return {
            "started": self.started, "machine": machine, "model": self.minfo,
            "model_spec": (BENCH_MODEL.describe() if not (args.model_dir or args.shape)
                           else {"shape": args.shape, "weights": "random (vLLM --load-format dummy)"} if args.shape
                           else None),
            "config": {"quick": args.quick, "device": args.device, "lengths": self.lengths, "concurrency": self.concs,
                       "samples": self.samples, "baseline": self.baseline,
                       "threads_bind": None if args.device else args.threads_bind,
                       "max_model_len": self.max_model_len, "kv_cache_gb": self.kv_gb, "lmcache_cpu_gb": self.lmc_gb,
                       "max_burst_s": args.max_burst_s, "cell_budget_s": args.cell_budget_s,
                       "suffix_len": SUFFIX_LEN, "chunk_size": CHUNK, "server_args": list(self.server_args),
                       "prefix_on_lmcache": args.prefix_on_lmcache, "argv": sys.argv[1:]},
            "arms_used": arms_used, "capped": self.capped, "servers": {}, "cells": [], "cartridges": {},
        }

    def save(self, **kw: Any) -> None:
        self.result["machine"]["loadavg_end"] = os.getloadavg()
        self.result["elapsed_s"] = round(time.perf_counter() - self.t_start, 1)
        write_result(as_result(self.result, self.args), self.out, "ttft", **kw)

    def run(self) -> int:
        self.make_cartridges()
        try:
            self.run_arms()
            self.add_hf_reference()
        finally:
            self.save(markdown_file=False)
        self.save(body=markdown(self.result), plot=lambda _r, path: plot(self.result, path))
        bad = [c for c in self.result["cells"] if not c["ext_ok"]]
        self.log(f"wrote {self.out / 'ttft.json'}, ttft.md, ttft.png in {time.perf_counter() - self.t_start:.0f}s"
                 + (f"; {len(bad)} cells with unexpected external-KV counts" if bad else ""))
        return 1 if bad else 0

    def make_cartridges(self) -> None:
        """The cartridges of the documents, when an arm serves them."""
        if set(CARTRIDGE_ARMS) & set(self.arms):
            args = self.args
            t = time.perf_counter()
            make = make_random_cartridges if args.shape else make_cartridges
            self.cartridges = make(self.model_dir, self.docs, self.work / "cartridges", model_name=str(self.model_dir),
                                   device="cuda" if args.device else "cpu", log=self.log)
            self.result["cartridges"] = {str(L): str(p) for L, p in self.cartridges.items()}
            self.result["cartridge_build_s"] = round(time.perf_counter() - t, 1)

    # -- the arms ------------------------------------------------------------------------------------
    def serve(self, kind: str, name: str):
        """A healthy, warmed server of `kind` (recorded under `name`) and its registry."""
        root = self.work / "servers" / name
        shutil.rmtree(root, ignore_errors=True)
        server, registry = make_server(kind, root, self.model_dir, self.scfg)
        self.log(f"starting {name} server ({kind}): log {server.log_path}")
        try:
            server.wait_healthy(timeout=600)
        except BaseException:
            server.stop()
            raise
        self.log(f"{name} server healthy after {server.startup_s:.0f}s")
        servers = self.result["servers"]
        servers[name] = {"kind": kind, "startup_s": server.startup_s,
                         "log": str(server.log_path), "command": server.command}
        if getattr(server, "lmcache_server", None) is not None:
            servers[name]["lmcache_server_command"] = server.lmcache_server.command
        warm_server(server, self.plan, skip_save=(kind == "lmcache"))
        return server, registry

    def record(self, name: str, server, cells: list[Cell]) -> None:
        self.result["servers"][name]["log_checks"] = log_checks(server)
        self.result["cells"] += [c.summary() for c in cells]
        self.save()

    def arm(self, name: str, arm: str, server, **kw: Any) -> None:
        """Run `arm` on `server` (recorded under the server's `name`)."""
        self.record(name, server, run_arm(arm, server, self.docs, self.plan, log=self.log, **kw))

    def run_arms(self) -> None:
        """Each arm on its server, one server at a time."""
        arms = self.arms
        if "full_prefill" in arms and self.baseline == "plain":
            server, _ = self.serve("plain", "full_prefill")
            try:
                self.arm("full_prefill", "full_prefill", server)
            finally:
                server.stop()
        prefix_here = "prefix_cache" in arms and self.args.prefix_on_lmcache
        if ({"cartridge", "cartridge_cached"} & set(arms) or prefix_here
                or ("full_prefill" in arms and self.baseline == "lmcache")):
            self.lmcache_arms(prefix_here)
        for arm in (a for a in MP_ARMS if a in arms):
            self.result["arms_used"][arm] = MP_ARMS[arm].describe()
            server, registry = self.serve(arm, arm)
            try:
                self.arm(arm, arm, server, registry=registry, cartridges=self.cartridges)
            finally:
                server.stop()
        if "prefix_cache" in arms and not prefix_here:
            self.result["arms_used"]["prefix_cache"] = "plain vLLM, prefix caching on, document sent once before"
            server, _ = self.serve("prefix", "prefix_cache")
            try:
                self.arm("prefix_cache", "prefix_cache", server)
            finally:
                server.stop()

    def lmcache_arms(self, prefix_here: bool) -> None:
        """The arms on the in-process LMCache server (arm (b)'s): (a) with `--baseline lmcache`,
        (b), (d), and (c) with `--prefix-on-lmcache`."""
        arms, cartridges = self.arms, self.cartridges
        server, registry = self.serve("lmcache", "cartridge")
        try:
            if "full_prefill" in arms and self.baseline == "lmcache":
                self.arm("cartridge", "full_prefill", server, skip_save=True)
            if "cartridge" in arms:
                self.arm("cartridge", "cartridge", server, skip_save=True, registry=registry, cartridges=cartridges)
            if "cartridge_cached" in arms:
                self.arm("cartridge", "cartridge_cached", server, skip_save=True, registry=registry,
                         cartridges=cartridges)
            if prefix_here:  # after the cartridges are removed; no store, so LMCache holds nothing of it
                self.result["arms_used"]["prefix_cache"] = (
                    "the arm-(b) server, nothing registered, `lmcache.skip_save`: "
                    "vLLM's prefix cache, the document sent once before")
                self.arm("cartridge", "prefix_cache", server, skip_save=True)
        finally:
            server.stop()

    def add_hf_reference(self) -> None:
        """Each cell's greedy first tokens from HF transformers given the cartridge's KV."""
        keys: dict[int, set] = {}
        for c in self.result["cells"]:
            for k in c.get("keys", []):
                keys.setdefault(c["length"], set()).add(tuple(k))
        if not self.cartridges or not keys or self.args.shape:  # random weights: no HF model to ask
            return
        t = time.perf_counter()
        ref = hf_reference_tokens(self.model_dir, self.cartridges, keys, self.plan, log=self.log)
        self.result["hf_reference_s"] = round(time.perf_counter() - t, 1)
        for c in self.result["cells"]:
            c["hf_tokens"] = [ref.get(tuple(k)) for k in c.get("keys", [])]


if __name__ == "__main__":
    sys.exit(main())

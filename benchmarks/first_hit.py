"""A cartridge's first hit against its repeat hit, by how its chunks are verified, side by side.

    PYTHONPATH=. flock /tmp/heavy.lock .venv/bin/python benchmarks/first_hit.py \\
        [--lengths 8192,16384] [--samples 4] [--rounds 2] [--out DIR] [--work DIR]

One vLLM + LMCache + cartridge-plugin server (`ttft.make_server("lmcache", ...)`, the TTFT model
and documents of `benchmarks/ttft.py`), concurrency 1. Per length, two cartridges of the same KV
(same payload file, hard-linked; same content hash and tokens), differing only in the manifest:

- `sha256`: no per-chunk BLAKE3 (what a manifest without per-chunk digests looks like: such a
  manifest is read exactly as it was written, `tests/test_chunk_digests.py`), so a first
  read verifies each chunk's sha256 (the verification a first hit does for such a manifest);
- `blake3`: the manifest `pack_kv` writes now; a first read verifies each chunk's BLAKE3.

Each round runs `ttft.run_arm("cartridge", ...)` once per variant, the order alternating between
rounds: register, warm up, `--samples` first hits (each right after removal and re-registration:
the plugin reads the page-cache-warm packed file and verifies it), `--samples` repeat hits (from
LMCache's CPU copy), remove. Reported: p50 over all rounds of first and repeat hits, and their
ratio (the target: first <= 1.3x repeat at 8K and 16K).

The server imports `lmcache_cartridge` from wherever `PYTHONPATH` (else the installed package)
points: run it from the checkout being measured with `PYTHONPATH=.`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
import harness.serving as ttft
from harness import GiB, ROOT, Arm, Result, machine_info, parse_ints, percentile, write_result

VARIANTS = ("sha256", "blake3")


def make_variants(src: Path, work: Path, length: int) -> dict[str, Path]:
    """Both manifests over one payload (a hard link: one file, one page-cache copy)."""
    from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME, PAYLOAD_NAME, Manifest
    from lmcache_cartridge.cartridge.packed import PackedCartridge, pack_kv

    out = {}
    b3 = work / f"fh-{length}-blake3"
    m = Manifest.load(src)
    if not b3.exists() or Manifest.load(b3).content_hash != m.content_hash:
        p = PackedCartridge(src)
        pack_kv(p.load_kv(), b3, cartridge_id=b3.name, model=m.model, kind=m.kind, token_ids=m.token_ids,
                chunk_size=m.chunk_size, provenance=m.provenance, overwrite=True)
    out["blake3"] = b3
    nb = Manifest.load(b3)
    assert all(c.blake3 for c in nb.chunks) and nb.content_hash == m.content_hash
    sha = work / f"fh-{length}-sha256"
    shutil.rmtree(sha, ignore_errors=True)
    sha.mkdir(parents=True)
    os.link(b3 / PAYLOAD_NAME, sha / PAYLOAD_NAME)
    d = json.loads(nb.to_json())
    d["cartridge_id"] = sha.name
    for c in d["chunks"]:
        del c["blake3"]
    (sha / MANIFEST_NAME).write_text(json.dumps(d, indent=1), encoding="utf-8")
    assert all(c.blake3 is None for c in Manifest.load(sha).chunks)
    out["sha256"] = sha
    return out


def as_result(result: dict, machine: dict, a, lengths: list[int]) -> Result:
    """One arm per document length, digest and variant (first or repeat hit), TTFT in seconds."""
    arms = [Arm.from_samples(f"{L}/{v}/{var}", [x for c in result["cells"] if c["length"] == L
                                                and c["digest"] == v and c["variant"] == var for x in c["ttft_s"]])
            for L in lengths for v in VARIANTS for var in ("first", "repeat")]
    return Result(benchmark="first_hit", machine=machine, parameters=vars(a), arms=arms, details=result)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=parse_ints, default=[8192, 16384])
    ap.add_argument("--samples", type=int, default=4, help="first (and repeat) hits per variant per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads-bind", default="1")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "first_hit")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-first-hit")
    a = ap.parse_args(argv)
    a.out, a.work = a.out.resolve(), a.work.resolve()  # the server runs in its own directory
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    machine = machine_info(False)
    model_dir = ttft.BENCH_MODEL.ensure()
    minfo = ttft.model_info(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    lengths = sorted(a.lengths)
    docs = {L: ttft.document_ids(tok, L, seed=100_000 + L) for L in lengths}  # as ttft.py
    avoid = frozenset(int(i) for i in tok.all_special_ids) | frozenset(range(4))
    plan = ttft.Plan(lengths, [1], samples=a.samples, vocab_size=minfo["vocab_size"], avoid=avoid)
    base = ttft.make_cartridges(model_dir, docs, a.work / "cartridges", model_name=str(model_dir), log=log)
    carts = {v: {} for v in VARIANTS}
    for L, src in base.items():
        for v, p in make_variants(src, a.work, L).items():
            carts[v][L] = p
    kvb = minfo["kv_bytes_per_token_bf16"]
    max_len = math.ceil((max(lengths) + ttft.SUFFIX_LEN + 1) / ttft.CHUNK) * ttft.CHUNK
    gb = max(1, math.ceil((max(lengths) + ttft.SUFFIX_LEN + 128) * kvb * 1.25 / GiB))
    scfg = ttft.ServerConfig(threads_bind=a.threads_bind, max_model_len=max_len, kv_cache_gb=gb,
                             lmcache_cpu_gb=gb, device=False)
    root = a.work / "server"
    shutil.rmtree(root, ignore_errors=True)
    server, registry = ttft.make_server("lmcache", root, model_dir, scfg)
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "model": minfo,
              "pythonpath": os.environ.get("PYTHONPATH"), "cells": []}
    try:
        server.wait_healthy(timeout=900)
        log(f"server healthy after {server.startup_s:.0f}s")
        ttft.warm_server(server, plan, skip_save=True)
        for r in range(a.rounds):
            for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                log(f"round {r}: {v}")
                for c in ttft.run_arm("cartridge", server, docs, plan, skip_save=True, registry=registry,
                                      cartridges=carts[v], log=log):
                    result["cells"].append({**c.summary(), "digest": v, "round": r})
        result["log_checks"] = ttft.log_checks(server)
    finally:
        server.stop()
        machine["loadavg_end"] = os.getloadavg()
        result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        write_result(as_result(result, machine, a, lengths), a.out, "first_hit", markdown_file=False)

    rows = ["| doc tokens | verified by | first hit p50 (ms) | repeat hit p50 (ms) | first / repeat | n |",
            "|---:|---|---:|---:|---:|---:|"]
    bad = [c for c in result["cells"] if not c["ext_ok"]]
    summary = {}
    for L in lengths:
        for v in VARIANTS:
            t = {var: [x for c in result["cells"] if c["length"] == L and c["digest"] == v
                       and c["variant"] == var for x in c["ttft_s"]] for var in ("first", "repeat")}
            f, rp = percentile(t["first"], 50) * 1e3, percentile(t["repeat"], 50) * 1e3
            summary[f"{L}/{v}"] = {"first_p50_ms": f, "repeat_p50_ms": rp, "ratio": f / rp, "n": len(t["first"])}
            rows.append(f"| {L:,} | {v} | {f:.1f} | {rp:.1f} | {f / rp:.2f}x | {len(t['first'])} |")
    result["summary"] = summary
    md = [f"# First hit vs repeat hit by chunk digest ({result['started']})", "",
          f"`{' '.join(['benchmarks/first_hit.py', *sys.argv[1:]])}`; load average at end "
          f"{', '.join(f'{x:.2f}' for x in machine['loadavg_end'])}; "
          f"{a.rounds} rounds x {a.samples} samples per variant, c=1, variants alternating.", "", *rows, ""]
    if bad:
        md.append(f"{len(bad)} cells with unexpected external-KV counts (see JSON).")
    write_result(as_result(result, machine, a, lengths), a.out, "first_hit", body="\n".join(md))
    print("\n".join(md))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

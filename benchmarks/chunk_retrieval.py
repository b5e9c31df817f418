"""Chunk retrieval microbenchmark: our tiers vs the raw limits vs LMCache's built-in backends.

    .venv/bin/python benchmarks/chunk_retrieval.py [--quick] [--out DIR] [--shapes a,b]

What is measured (one 256-token chunk of synthetic random bf16 KV per chunk, real model shapes):

- ours: `CartridgeStoragePlugin.batched_get_blocking(keys)` of a real LMCacheEngine whose
  StorageManager loaded the plugin from YAML, so every chunk lands in LocalCPUBackend allocator
  memory. Tiers: `ours-cpu` (plugin CPU tier warm), `ours-disk-warm` (local packed origin,
  cpu_budget_gb 0, page cache warm), `ours-disk-cold` (same, kv.bin pages dropped with
  POSIX_FADV_DONTNEED before every batch), `ours-s3` (S3 origin on a loopback moto server,
  cpu_budget_gb 0 and disk_budget_gb 0 so every read is a ranged GET).
- limits, into buffers allocated from the same LocalCPUBackend: `limit-memcpy` (torch copy of the
  same bytes), `limit-read-warm`/`limit-read-cold` (os.preadv of the same kv.bin ranges),
  `limit-boto3` (plain boto3 ranged GET of the same object range, readinto, sequential).
- LMCache 0.5.6 built-ins serving the same chunks (same keys, same bytes, stored through the
  backend's own put then LocalCPUBackend cleared): `lmc-localdisk-warm/-cold` (LocalDiskBackend),
  `lmc-fs-warm/-cold` (RemoteBackend + fs connector, remote_url fs://localhost:0/abs/path),
  `lmc-s3` (RemoteBackend + awscrt S3 connector, virtual-hosted `s3://bucket.host:port`, run in a
  child process in a private mount namespace with a bind-mounted /etc/hosts).
- lookup: `plugin.batched_contains(keys)` for a 16K-token prompt (64 keys), us per key.

Timing: each sample is one `fetch(batch)` call (allocation included, release excluded). Per-chunk
latency = call time / batch size (amortised); p50/p99 over samples; throughput = bytes / call
time, reported at the median call (GB = 1e9 bytes). The first batch of every arm is checked
byte-for-byte against the packed chunk. moto runs in its own process (`harness.s3.moto_process`;
`--moto-thread` puts it in this process's threads, where it takes the GIL from the client it
serves, for a comparison). On 2 cores it still competes for CPU: S3 numbers measure moto
as much as the client; compare ours with `limit-boto3` taken against the same server in the same
run.

S3 layout note: moto answers a ranged GET by copying the whole object and slicing it, so one
ranged GET from a many-chunk kv.bin costs O(object) on moto (not on real S3). The S3 arms
therefore use one-chunk cartridges (one kv.bin object per chunk), the same object-per-chunk
layout LMCache's S3 connector uses.

Every arm is a small class with `fetch(indices) -> list[MemoryObj]` and `release(objs)`, so
`tests/test_bench_chunk_retrieval.py` checks their bytes at tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import ROOT, Arm, Result, machine_info, write_result
from harness.s3 import s3_client
from harness.tiers import (
    Boto3Limit, Dataset, GiB, LMCacheArm, LMCacheHost, MemcpyLimit, MemmoveLimit, OursArm, PluginHost,
    ReadLimit, S3_BUCKET, S3_VHOST, SHAPES, Shape, alloc_gb_for, build_dataset, measure_lookup, run_arm,
    set_dummy_aws_env, start_moto, upload_s3,
)


def lmc_s3_child_main(spec_path: str) -> None:
    """Entry point of the child: build the S3-connector engine, store, measure, write JSON."""
    spec = json.loads(Path(spec_path).read_text())
    set_dummy_aws_env()
    shape = SHAPES[spec["shape"]] if spec["shape"] in SHAPES else Shape(**spec["shape_def"])
    ds = Dataset(shape, spec["n"], Path(spec["local_dir"]), spec["token_ids"], spec["n_s3"],
                 [Path(p) for p in spec["s3_dirs"]], spec["s3_token_ids"])
    result: dict[str, Any] = {"arm": "lmc-s3", "kind": "lmcache", "tier": "s3", "results": []}
    try:
        host = LMCacheHost(ds, Path(spec["workdir"]), "s3", spec["alloc_gb"], s3_url=spec["s3_url"])
        arm = LMCacheArm(host, None)
        reps = {int(k): v for k, v in spec["reps"].items()}
        result = run_arm(arm, spec["batches"], lambda b: reps[b], shape.chunk_bytes,
                         lambda s: print(s, flush=True), check=True, warm=spec.get("warm", True))
    except Exception as e:
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    Path(spec["out"]).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # never wait on RemoteBackend teardown


def run_lmc_s3(ds: Dataset, workdir: Path, moto_port: int, batches, reps: dict[int, int],
               alloc_gb: float, timeout: float = 600.0, warm: bool = True) -> dict:
    """Run the LMCache S3-connector arm in `unshare --mount` with a bind-mounted hosts file."""
    na = {"arm": "lmc-s3", "kind": "lmcache", "tier": "s3", "results": []}
    if shutil.which("unshare") is None:
        return {**na, "error": "n/a: `unshare` not found (needed to resolve the virtual host)"}
    hosts = workdir / "hosts-lmc-s3"
    vhost = f"{S3_BUCKET}.{S3_VHOST}"
    hosts.write_text(Path("/etc/hosts").read_text() + f"\n127.0.0.1 {vhost}\n")
    out = workdir / f"lmc-s3-{ds.shape.name}.json"
    out.unlink(missing_ok=True)
    spec = {"shape": ds.shape.name, "shape_def": asdict(ds.shape), "n": ds.n,
            "local_dir": str(ds.local_dir), "token_ids": ds.token_ids, "n_s3": ds.n_s3,
            "s3_dirs": [str(p) for p in ds.s3_dirs], "s3_token_ids": ds.s3_token_ids,
            "workdir": str(workdir), "alloc_gb": alloc_gb, "s3_url": f"s3://{vhost}:{moto_port}",
            "batches": list(batches), "reps": {str(k): v for k, v in reps.items()},
            "out": str(out), "warm": warm}
    spec_path = workdir / f"lmc-s3-{ds.shape.name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    inner = (f"mount --bind {hosts} /etc/hosts && exec {sys.executable} {Path(__file__).resolve()} "
             f"--child-lmc-s3 {spec_path}")
    try:
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
                           capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return {**na, "error": f"n/a: child timed out after {timeout:.0f}s"}
    if p.returncode != 0 or not out.exists():
        tail = (p.stderr or p.stdout or "")[-800:]
        return {**na, "error": f"n/a: child exited {p.returncode}: {tail.strip()}"}
    res = json.loads(out.read_text())
    res["log"] = p.stdout[-2000:]
    return res


# --- the run ------------------------------------------------------------------------------------
@dataclass
class Plan:
    shapes: list[str]
    local_cap_bytes: int          # max bytes of chunks per shape (local arms, one batch at most)
    s3_cap_bytes: int
    batches: list[int]
    reps: dict[int, int]
    lookup_iters: int


def plan_for(quick: bool, shapes: Optional[list[str]]) -> Plan:
    if quick:
        return Plan(shapes or ["tiny", "llama3.1-8b"], 256 << 20, 128 << 20, [1, 8, 64],
                    {1: 8, 8: 3, 64: 2}, 200)
    return Plan(shapes or ["tiny", "qwen2.5-7b", "llama3.1-8b", "llama2-7b-mha"], 2 * GiB, 512 << 20,
                [1, 8, 64], {1: 24, 8: 8, 64: 4}, 2000)


def batches_for(n: int, batches: list[int]) -> list[int]:
    out = [b for b in batches if b <= n]
    if n not in out and n < max(batches):
        out.append(n)  # the memory cap: the largest batch that fits
    return sorted(set(out))


def run_shape(shape: Shape, plan: Plan, workdir: Path, moto_url: str, moto_port: int, log) -> dict:
    n = max(1, min(64, plan.local_cap_bytes // shape.chunk_bytes))
    n_s3 = max(1, min(64, plan.s3_cap_bytes // shape.chunk_bytes))
    batches = batches_for(n, plan.batches)
    s3_batches = batches_for(n_s3, plan.batches)
    reps = lambda b: plan.reps.get(b, max(2, plan.reps[min(plan.reps, key=lambda k: abs(k - b))]))  # noqa: E731
    log(f"== {shape.name}: {shape.chunk_bytes / (1 << 20):.2f} MiB/chunk, {n} local chunks "
        f"(batches {batches}), {n_s3} S3 chunks (batches {s3_batches})")
    t0 = time.time()
    ds = build_dataset(shape, n, n_s3, workdir, seed=len(shape.name))
    upload_s3(ds, moto_url)
    log(f"   data packed and uploaded in {time.time() - t0:.1f}s")
    alloc = alloc_gb_for(shape, n)
    arms: list[dict] = []
    cb = shape.chunk_bytes

    # ours: CPU tier (budget holds every chunk), then the limits on the same allocator
    host = PluginHost(ds, workdir, name=f"{shape.name}-ours-cpu", cpu_gb=(n * cb * 1.1) / GiB + 0.01,
                      disk_gb=0, alloc_gb=alloc)
    try:
        arms.append(run_arm(OursArm(host, "cpu"), batches, reps, cb, log))
        mc = MemcpyLimit(ds, host.allocator)
        arms.append(run_arm(mc, batches, reps, cb, log, warm=False))
        mc.close()
        mm = MemmoveLimit(ds, host.allocator)
        arms.append(run_arm(mm, batches, reps, cb, log, warm=False))
        mm.close()
        for cold in (False, True):
            rl = ReadLimit(ds, host.allocator, cold)
            arms.append(run_arm(rl, batches, reps, cb, log, warm=not cold))
            rl.close()
        bl = Boto3Limit(ds, host.allocator, moto_url)
        arms.append(run_arm(bl, s3_batches, reps, cb, log))
    finally:
        host.close()
    # ours: disk (local origin, CPU tier off)
    host = PluginHost(ds, workdir, name=f"{shape.name}-ours-disk", cpu_gb=0, disk_gb=0, alloc_gb=alloc)
    try:
        arms.append(run_arm(OursArm(host, "disk-warm"), batches, reps, cb, log))
        arms.append(run_arm(OursArm(host, "disk-cold"), batches, reps, cb, log, warm=False))
    finally:
        host.close()
    # ours: S3 origin, CPU and disk tiers off
    host = PluginHost(ds, workdir, name=f"{shape.name}-ours-s3", cpu_gb=0, disk_gb=0, alloc_gb=alloc,
                      s3_endpoint=moto_url)
    try:
        arms.append(run_arm(OursArm(host, "s3"), s3_batches, reps, cb, log))
    finally:
        host.close()
    # LMCache built-ins
    for kind in ("localdisk", "fs"):
        try:
            t1 = time.time()
            lh = LMCacheHost(ds, workdir, kind, alloc)
            log(f"   lmc-{kind}: stored {lh.n} chunks in {time.time() - t1:.1f}s")
        except Exception as e:
            arms.append({"arm": f"lmc-{kind}-warm", "kind": "lmcache", "tier": "disk-warm", "results": [],
                         "error": f"n/a: {type(e).__name__}: {e}"})
            continue
        try:
            arms.append(run_arm(LMCacheArm(lh, False), batches, reps, cb, log))
            arms.append(run_arm(LMCacheArm(lh, True), batches, reps, cb, log, warm=False))
        finally:
            if not lh.close():
                log(f"   lmc-{kind}: engine teardown hung (left behind, bounded at 20s)")
            shutil.rmtree(lh.dir, ignore_errors=True)
    res = run_lmc_s3(ds, workdir, moto_port, s3_batches, {b: reps(b) for b in s3_batches}, alloc)
    for line in (res.pop("log", "") or "").splitlines():
        log("  " + line)
    if res.get("error"):
        log(f"    lmc-s3: {res['error']}")
    arms.append(res)
    # free the disk space of this shape
    for d in [ds.local_dir, *ds.s3_dirs]:
        shutil.rmtree(d, ignore_errors=True)
    return {"shape": asdict(shape), "chunk_bytes": cb, "n_local": n, "n_s3": n_s3, "batches": batches,
            "s3_batches": s3_batches, "arms": arms}


def run_lookup(workdir: Path, iters: int, log) -> dict:
    shape = SHAPES["tiny"]
    ds = build_dataset(shape, 64, 0, workdir, seed=99)
    host = PluginHost(ds, workdir, name="lookup", cpu_gb=0.05, disk_gb=0, alloc_gb=0.05)
    try:
        res = measure_lookup(host.plugin, ds.token_ids, iters)
    finally:
        host.close()
    log(f"== lookup: {res['keys']} keys ({res['tokens']} tokens): "
        f"{res['no_pin']['us_per_key_median']:.2f} us/key, pinned {res['pin']['us_per_key_median']:.2f} us/key")
    shutil.rmtree(ds.local_dir, ignore_errors=True)
    return res


# --- reporting ----------------------------------------------------------------------------------
LIMIT_FOR = {"cpu": "limit-memcpy", "disk-warm": "limit-read-warm", "disk-cold": "limit-read-cold",
             "s3": "limit-boto3"}
# limit-memmove (libc memmove) is reported in the all-arms table: on this 2-core VM torch's
# 2-thread copy_ is ~6x slower than a single memmove, so it is the truer floor.
LMC_FOR = {"cpu": None, "disk-warm": "lmc-localdisk-warm", "disk-cold": "lmc-localdisk-cold",
           "s3": "lmc-s3"}
TARGET = {"cpu": (0.9, None), "disk-warm": (0.8, 1.0), "disk-cold": (None, None), "s3": (0.9, 1.0)}


def _result(arms, name, batch):
    for a in arms:
        if a["arm"] == name:
            for r in a.get("results", []):
                if r["batch"] == batch:
                    return r
            return {"error": a.get("error")} if a.get("error") else None
    return None


def as_result(report: dict, args: argparse.Namespace) -> Result:
    """The run as the harness's result: one arm per shape, tier arm and batch (per-chunk ms)."""
    arms = [Arm(name=f"{s['shape']['name']}/{a['arm']}/b{r['batch']}", count=r["reps"], p50=r["p50_ms"],
                p95=r.get("p95_ms"), p99=r["p99_ms"], unit="ms", errors=int(bool(a.get("error"))),
                figures={"gbps": r["gbps"], "tier": a.get("tier")})
            for s in report["shapes"] for a in s["arms"] for r in a.get("results", [])]
    return Result(benchmark="chunk_retrieval", machine=report["machine"], parameters=vars(args), arms=arms,
                  details={k: v for k, v in report.items() if k != "machine"})


def markdown(report: dict) -> str:
    moto_note = next((n for n in report.get("notes", []) if n.startswith("moto runs")), "moto")
    lines = ["# Chunk retrieval benchmark", "",
             f"mode: {report['mode']}; machine: {report['machine'].get('cpu', '?')}, "
             f"{report['machine'].get('nproc')} cpus, {report['machine'].get('mem_total_gib')} GiB; "
             f"torch {report['machine'].get('torch')} ({report['machine'].get('torch_threads')} threads); "
             f"elapsed {report['elapsed_s']:.0f}s", "",
             "Per-chunk latency = batch call time / batch (amortised), p50 (p99) over samples; GB/s at the "
             "median call. x-limit = ours/limit throughput, x-LMCache = ours/LMCache built-in. "
             f"S3 is a moto server on loopback ({moto_note}); "
             "S3 arms use one object per chunk.", ""]
    lines += ["| shape | tier | batch | ours ms/chunk p50 (p99) | ours GB/s | limit | limit GB/s | x-limit | "
              "LMCache | LMCache GB/s | x-LMCache |",
              "|---|---|---:|---:|---:|---|---:|---:|---|---:|---:|"]
    for s in report["shapes"]:
        arms = s["arms"]
        for tier in ("cpu", "disk-warm", "disk-cold", "s3"):
            bs = s["s3_batches"] if tier == "s3" else s["batches"]
            for b in bs:
                ours = _result(arms, f"ours-{tier}", b)
                if ours is None:
                    continue
                lim_name, lmc_name = LIMIT_FOR[tier], LMC_FOR[tier]
                lim = _result(arms, lim_name, b)
                lmc = _result(arms, lmc_name, b) if lmc_name else None

                def g(r):
                    if r is None:
                        return "-"
                    if "gbps" not in r:
                        return (r.get("error") or "n/a")[:60]
                    return f"{r['gbps']:.2f}"

                def ratio(a, r):
                    if a is None or r is None or "gbps" not in a or "gbps" not in r:
                        return "-"
                    return f"{a['gbps'] / r['gbps']:.2f}"

                if "gbps" not in ours:
                    lines.append(f"| {s['shape']['name']} | {tier} | {b} | {ours.get('error')} | | | | | | | |")
                    continue
                lines.append(
                    f"| {s['shape']['name']} | {tier} | {b} | {ours['p50_ms']:.3f} ({ours['p99_ms']:.3f}) | "
                    f"{ours['gbps']:.2f} | {lim_name} | {g(lim)} | {ratio(ours, lim)} | "
                    f"{lmc_name or '-'} | {g(lmc)} | {ratio(ours, lmc)} |")
    cols = sorted({r["batch"] for s in report["shapes"] for a in s["arms"] for r in a.get("results", [])})
    lines += ["", "All arms (GB/s by batch; '-' = batch not run for that arm):", "",
              "| shape | arm | " + " | ".join(f"b={b}" for b in cols) + " |",
              "|---|---|" + "---:|" * len(cols)]
    for s in report["shapes"]:
        for a in s["arms"]:
            cells = []
            for b in cols:
                r = _result(s["arms"], a["arm"], b)
                cells.append("-" if r is None else (f"{r['gbps']:.2f}" if "gbps" in r else "n/a"))
            err = f" ({a['error'][:120]})" if a.get("error") else ""
            lines.append(f"| {s['shape']['name']} | {a['arm']}{err} | " + " | ".join(cells) + " |")
    lk = report.get("lookup")
    if lk:
        lines += ["", f"Lookup: `batched_contains` over {lk['keys']} keys ({lk['tokens']}-token prompt): "
                  f"{lk['no_pin']['us_per_key_median']:.2f} us/key (pin=True: {lk['pin']['us_per_key_median']:.2f} "
                  f"us/key); LMCache's own key hashing of the prompt: "
                  f"{lk['lmcache_key_hashing_ms_for_prompt']:.1f} ms."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = report["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 5), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        names = [a["arm"] for a in s["arms"] if a.get("results")]
        all_b = sorted({r["batch"] for a in s["arms"] for r in a.get("results", [])})
        width = 0.8 / max(1, len(all_b))
        for j, b in enumerate(all_b):
            vals = []
            for nm in names:
                r = _result(s["arms"], nm, b)
                vals.append(r["gbps"] if r and "gbps" in r else 0.0)
            ax.bar(np.arange(len(names)) + j * width, vals, width, label=f"batch {b}")
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2)
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("GB/s")
        ax.set_title(f"{s['shape']['name']} ({s['chunk_bytes'] / (1 << 20):.2f} MiB/chunk)")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer/smaller shapes and repetitions (< 2 min)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--shapes", default=None, help=f"comma list of {','.join(SHAPES)}")
    ap.add_argument("--workdir", default=None, help="scratch dir for packed data (default: a temp dir)")
    ap.add_argument("--child-lmc-s3", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--moto-thread", action="store_true",
                    help="run moto in this process's threads, taking the GIL from the client, instead of "
                         "its own process")
    args = ap.parse_args(argv)
    if args.child_lmc_s3:
        lmc_s3_child_main(args.child_lmc_s3)
        return 0
    import logging

    logging.getLogger("lmcache").setLevel(logging.WARNING)
    set_dummy_aws_env()
    plan = plan_for(args.quick, args.shapes.split(",") if args.shapes else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir) if args.workdir else \
        Path(tempfile.mkdtemp(prefix="chunk-bench-", dir=os.environ.get("TMPDIR", "/tmp")))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("LMCACHE_CARTRIDGE_HOME", str(workdir / "home"))
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    stop_moto, moto_url, moto_port = start_moto(in_process=args.moto_thread)
    s3_client(moto_url).create_bucket(Bucket=S3_BUCKET)
    report: dict[str, Any] = {"mode": "quick" if args.quick else "full",
                              "machine": {**machine_info(), "torch_threads": torch.get_num_threads()},
                              "plan": {**asdict(plan), "reps": {str(k): v for k, v in plan.reps.items()}},
                              "notes": [
                                  "per-chunk latency = batch call time / batch size; p50/p99 over samples",
                                  "GB = 1e9 bytes; throughput at the median call",
                                  "local arms: batch capped so a batch is <= local_cap_bytes; "
                                  "S3 arms: <= s3_cap_bytes (moto speed and memory)",
                                  ("moto runs in this process's threads (GIL shared with the client)"
                                   if args.moto_thread
                                   else "moto runs in its own process (shares the 2 cores, not the GIL)"),
                                  "S3 arms use one object per chunk (moto copies the whole object per ranged GET)",
                                  "ours-s3 runs with cpu_budget_gb 0 and disk_budget_gb 0 (every read is a GET)",
                              ], "shapes": []}
    try:
        report["lookup"] = run_lookup(workdir, plan.lookup_iters, log)
        for name in plan.shapes:
            report["shapes"].append(run_shape(SHAPES[name], plan, workdir, moto_url, moto_port, log))
            report["elapsed_s"] = time.time() - t_start
            write_result(as_result(report, args), out, "chunk_retrieval", markdown_file=False)
    finally:
        report["elapsed_s"] = time.time() - t_start
        result = as_result(report, args)
        if not report["shapes"]:
            write_result(result, out, "chunk_retrieval", markdown_file=False)
        else:
            try:
                write_result(result, out, "chunk_retrieval", body=markdown(report),
                             plot=lambda _r, path: plot(report, path))
            except Exception as e:
                write_result(result, out, "chunk_retrieval", body=markdown(report))
                log(f"plot failed: {e}")
        stop_moto()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    log(f"wrote {out / 'chunk_retrieval.json'}, .md, .png")
    print((out / "chunk_retrieval.md").read_text())
    sys.stdout.flush()
    os._exit(0)  # engines' background threads (and any hung RemoteBackend) must not keep us alive


if __name__ == "__main__":
    sys.exit(main())

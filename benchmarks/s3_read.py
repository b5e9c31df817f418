"""The plugin's S3 chunk read against a bare boto3 GET of the same bytes, taking turns chunk by chunk.

`chunk_retrieval.py` runs its arms one after the other, so on this shared 2-core machine a slow
minute lands on one arm; here the two alternate every chunk, in one process, against one moto
server in its own process, so both see the same machine. Same parallelism (one read at a time),
same destination (LMCache allocator memory), same bytes:

- `ours`: `Residency.read_into(..., network=True)` through the real plugin in a real LMCacheEngine
  (CPU and disk tiers off, so every read goes to S3): ranged GET, BLAKE3 + NaN/Inf check,
  conversion of the packed `by_head` bytes into LMCache's `KV_2LTD`.
- `boto3`: `get_object` with the same Range, `readinto` the same kind of buffer; no check.

    .venv/bin/python benchmarks/s3_read.py [--shapes tiny,llama3.1-8b] [--rounds 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
import harness.tiers as cr
from harness import Arm, Result, machine_info, percentile, write_result
from harness.s3 import s3_client

CHUNKS = {"tiny": 16, "llama3.1-8b": 4, "qwen2.5-7b": 4, "llama2-7b-mha": 2}


def run(shape_name: str, rounds: int, url: str, workdir: Path) -> tuple[dict, list[Arm]]:
    shape, n = cr.SHAPES[shape_name], CHUNKS[shape_name]
    ds = cr.build_dataset(shape, n, n, workdir)
    cr.upload_s3(ds, url)
    host = cr.PluginHost(ds, workdir, name=f"{shape_name}-s3", cpu_gb=0, disk_gb=0,
                         alloc_gb=cr.alloc_gb_for(shape, n), s3_endpoint=url)
    arms = {"ours": cr.OursArm(host, "s3"), "boto3": cr.Boto3Limit(ds, host.allocator, url)}
    ms: dict[str, list[float]] = {k: [] for k in arms}
    try:
        for r in range(rounds + 1):  # round 0 warms connections and allocator pages
            for i in range(n):
                for name, arm in arms.items():
                    t0 = time.perf_counter()
                    objs = arm.fetch([i])
                    dt = time.perf_counter() - t0
                    if not torch.equal(cr.obj_bytes(objs[0]), arm.expected(i)):
                        raise AssertionError(f"{name}: chunk {i} bytes differ")
                    arm.release(objs)
                    if r:
                        ms[name].append(dt * 1e3)
    finally:
        host.close()
    p50 = {k: percentile(v, 50) for k, v in ms.items()}
    row = {"shape": shape_name, "chunk_bytes": shape.chunk_bytes, "reads_per_arm": len(ms["ours"]),
           "p50_ms": p50, "ours_vs_boto3": p50["boto3"] / p50["ours"]}
    return row, [Arm.from_samples(f"{shape_name}/{k}", v, unit="ms") for k, v in ms.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tiny,llama3.1-8b")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="write the results here (OUT.json, OUT.md)")
    args = ap.parse_args(argv)
    cr.set_dummy_aws_env()
    workdir = Path(tempfile.mkdtemp(prefix="s3-read-"))
    os.environ.setdefault("LMCACHE_CARTRIDGE_HOME", str(workdir / "home"))
    stop, url, _port = cr.start_moto(in_process=False)
    try:
        s3_client(url).create_bucket(Bucket=cr.S3_BUCKET)
        runs = [run(s, args.rounds, url, workdir) for s in args.shapes.split(",")]
    finally:
        stop()
    results = [row for row, _ in runs]
    table = ["| chunk | reads per arm | ours p50 ms | boto3 p50 ms | ours / boto3 (throughput) |",
             "|---|---:|---:|---:|---:|"]
    table += [f"| {r['shape']} ({r['chunk_bytes'] >> 10} KiB) | {r['reads_per_arm']} | {r['p50_ms']['ours']:.2f} | "
              f"{r['p50_ms']['boto3']:.2f} | {r['ours_vs_boto3']:.2f}x |" for r in results]
    print("\n".join(table))
    if args.out:
        write_result(Result(benchmark="s3_read", machine=machine_info(), parameters=vars(args),
                            arms=[a for _, arms in runs for a in arms], details={"results": results}),
                     args.out.parent, args.out.stem, body="# S3 reads: ours and boto3\n\n" + "\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())

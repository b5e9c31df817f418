"""What one tensor-parallel rank reads of a cartridge, per chunk, on Llama-3.1-8B's chunk
shape (32 layers, 8 KV heads, head_dim 128, 256 tokens, bf16: 32 MiB per chunk).

    .venv/bin/python benchmarks/tp_read.py [--chunks 4] [--out benchmarks/results]

For tp in 1, 2, 4, 8 and each payload layout, rank 0 (every rank reads the same amount) reads
every chunk through the plugin's residency path (`Residency.read_into` with the rank's
`RankView`; the CPU tier keeps each chunk and is emptied after each read, so every read goes to
the origin), from a local packed cartridge
(page cache warm) and from S3 (a moto server in its own process on loopback). Reported per rank
and chunk: the bytes the origin returned (counted by the origin itself, `bytes_read`; for S3
also the ranged GETs' bytes), their share of the chunk, and the time per chunk including
verification and the conversion to LMCache's layout. `by_head` is format 2 (what `pack` writes);
`2ltd` is format 1, where a rank must read the whole chunk and keep its columns.

Runs in its own process; `make bench` runs it after the chunk-retrieval benchmark.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import ROOT, Arm, Result, machine_info, summary, write_result
from harness.s3 import DUMMY_ENV, moto_process, s3_client, upload_dir

LAYERS, HEADS, HEAD_DIM, CHUNK = 32, 8, 128, 256
BUCKET = "tp-read"


def measure(handle, n_chunks: int, reps: int) -> dict:
    from lmcache_cartridge.store.metrics import Metrics
    from lmcache_cartridge.store.residency import MemoryTier, Residency

    # The CPU tier keeps what is read, as when serving; it is emptied after each read (untimed) so
    # every read goes to the origin. `out` is allocated and touched once, as LMCache's buffers are.
    res = Residency(MemoryTier("cpu", 1 << 30), None, Metrics(), prefetch=False)
    try:
        times = []
        before = handle.origin.bytes_read
        outs = [torch.zeros(handle.view.engine_shape(i), dtype=torch.bfloat16) for i in range(n_chunks)]
        for _ in range(reps):
            for i in range(n_chunks):
                t0 = time.perf_counter()
                res.read_into(handle, i, outs[i])
                times.append(time.perf_counter() - t0)
                res.cpu.discard(handle.content_hash)
        per_chunk = (handle.origin.bytes_read - before) / (reps * n_chunks)
    finally:
        res.close()
    ms = summary(1e3 * t for t in times)
    return {"bytes_per_chunk": int(per_chunk), "n": ms["count"],
            **{f"ms_per_chunk_{q}": ms[q] for q in ("p50", "p95", "p99")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)

    from lmcache_cartridge.cartridge.manifest import LAYOUT_2LTD, LAYOUT_BY_HEAD
    from lmcache_cartridge.cartridge.packed import PackedCartridge, pack_kv
    from lmcache_cartridge.cartridge.tp import RankView
    from lmcache_cartridge.store.origins import LocalOrigin, S3ChunkOrigin
    from lmcache_cartridge.store.residency import Handle
    from lmcache_cartridge.store.s3 import S3Settings

    os.environ.update(DUMMY_ENV)
    work = Path(tempfile.mkdtemp(prefix="tp-read-", dir=os.environ.get("TMPDIR", "/tmp")))
    moto, url = moto_process()
    rows = []
    try:
        g = torch.Generator().manual_seed(0)
        kv = torch.empty(2, LAYERS, args.chunks * CHUNK, HEADS, HEAD_DIM, dtype=torch.bfloat16).uniform_(
            -2, 2, generator=g
        )
        client = s3_client(url)
        client.create_bucket(Bucket=BUCKET)
        for layout in (LAYOUT_BY_HEAD, LAYOUT_2LTD):
            d = work / layout
            pack_kv(kv, d, cartridge_id=f"tp-{layout}", model="llama3.1-8b-shape", kind="first_k",
                    token_ids=list(range(args.chunks * CHUNK)), chunk_size=CHUNK, layout=layout)
            upload_dir(client, BUCKET, layout, d)
        del kv
        for layout in (LAYOUT_BY_HEAD, LAYOUT_2LTD):
            m = PackedCartridge(work / layout).manifest
            chunk_bytes = m.chunks[0].nbytes
            for tp in (1, 2, 4, 8):
                view = RankView.of(m, tp, 0)
                row = {"layout": layout, "tp": tp, "heads_per_rank": view.heads[1] - view.heads[0],
                       "chunk_bytes": chunk_bytes}
                local = LocalOrigin(work / layout)
                row["local"] = measure(Handle(m, local, view=view), args.chunks, args.reps)
                local.close()
                s3 = S3ChunkOrigin(f"s3://{BUCKET}/{layout}", S3Settings(endpoint_url=url))
                row["s3"] = measure(Handle(m, s3, view=view), args.chunks, 1)
                s3.close()
                row["share"] = row["local"]["bytes_per_chunk"] / chunk_bytes
                rows.append(row)
                print(f"{layout:8s} tp={tp}: {row['local']['bytes_per_chunk'] / 2**20:6.1f} MiB/chunk per rank "
                      f"({row['share']:.3f} of the chunk); local {row['local']['ms_per_chunk_p50']:.1f} ms, "
                      f"S3 {row['s3']['ms_per_chunk_p50']:.1f} ms per chunk", flush=True)
    finally:
        moto.kill()
        shutil.rmtree(work, ignore_errors=True)
    report = {"shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "chunk_tokens": CHUNK},
              "chunks": args.chunks, "reps": args.reps, "rows": rows}
    lines = ["# Per-rank read volume (Llama-3.1-8B chunk shape, 32 MiB per chunk)", "",
             "`benchmarks/tp_read.py`: rank 0's first reads through `Residency.read_into` (into the CPU tier), bytes "
             "counted by the origin; time per chunk includes verification and the conversion to LMCache's "
             "layout. S3: moto in its own process on loopback.", "",
             "| layout | tp | heads/rank | MiB read per rank per chunk | share of chunk | local ms/chunk | "
             "S3 MiB per rank per chunk | S3 ms/chunk |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['tp']} | {r['heads_per_rank']} | {r['local']['bytes_per_chunk'] / 2**20:.1f} | "
            f"{r['share']:.3f} | {r['local']['ms_per_chunk_p50']:.1f} | {r['s3']['bytes_per_chunk'] / 2**20:.1f} | "
            f"{r['s3']['ms_per_chunk_p50']:.1f} |"
        )
    arms = [Arm(name=f"{r['layout']}/tp{r['tp']}/{where}", count=r[where]["n"], p50=r[where]["ms_per_chunk_p50"],
                p95=r[where]["ms_per_chunk_p95"], p99=r[where]["ms_per_chunk_p99"], unit="ms",
                figures={"bytes_per_chunk": r[where]["bytes_per_chunk"]})
            for r in rows for where in ("local", "s3")]
    write_result(Result(benchmark="tp_read", machine=machine_info(), parameters=vars(args), arms=arms, details=report),
                 args.out, "tp_read", body="\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

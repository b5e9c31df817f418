"""Why a cartridge injected for 16 concurrent requests is slower than 16 prefix-cache hits: vLLM's
CPU attention over 16 private copies of a document's KV against 16 requests sharing one copy.

`make bench-ttft`'s arm (b) salts every request, so each of the 16 requests of a burst gets its own
vLLM blocks and the connector fills each with the same cartridge; arm (c) (and (d), a cartridge in
a deployment) serves all 16 from one set of prefix-cache blocks. A py-spy profile of the worker
at c=16 (`benchmarks/results/ttft-c16-profile/`) put most of (b)'s excess in attention, not in the
load. This isolates that: vLLM's own attention op (`cpu_attention_with_kv_cache`, as
`CPUAttentionBackendImpl.forward` calls it) on the TTFT model's shapes (8 query / 2 KV heads,
head_dim 128, block 128, bf16, 8 layers), `--requests` requests of `--queries` new tokens each
after `--context` cached tokens, whose block tables point either at the same context blocks
(`shared`) or at private copies of them (`distinct`): same values (the outputs are checked equal
bit for bit), same kernel, the two taking turns.

    .venv/bin/python benchmarks/attention_footprint.py [--context 8192] [--requests 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import Arm, Result, machine_info, percentile, write_result


def run(context: int, requests: int, queries: int, layers: int, reps: int, isa: str) -> dict:
    import vllm._custom_ops as ops

    dt, bs, kv_heads, q_heads, d = torch.bfloat16, 128, 2, 8, 128
    tokens = context + queries
    nblk = (tokens + bs - 1) // bs
    nb = requests * nblk
    g = torch.Generator().manual_seed(0)
    ctx_blocks = context // bs  # whole blocks of context; the rest (and the new tokens) are private
    caches = [torch.randn(nb, kv_heads, bs, 2 * d, generator=g).to(dt) for _ in range(layers)]
    for c in caches:  # every request's private copy of the context holds the same values
        for r in range(1, requests):
            c[r * nblk:r * nblk + ctx_blocks] = c[:ctx_blocks]
    q = torch.randn(requests * queries, q_heads, d, generator=g).to(dt)
    out = torch.empty_like(q)
    qsl = torch.arange(0, requests * queries + 1, queries, dtype=torch.int32)
    seq = torch.full((requests,), tokens, dtype=torch.int32)
    tables = {
        "shared": torch.tensor([list(range(ctx_blocks)) + list(range(r * nblk + ctx_blocks, (r + 1) * nblk))
                                for r in range(requests)], dtype=torch.int32),
        "distinct": torch.tensor([list(range(r * nblk, (r + 1) * nblk)) for r in range(requests)], dtype=torch.int32),
    }
    md = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=requests, num_heads=q_heads, num_kv_heads=kv_heads, head_dim=d, seq_lens=seq, dtype=dt,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)

    def once(table: torch.Tensor) -> float:
        out.zero_()
        t0 = time.perf_counter()
        for c in caches:
            kc, vc = c.view(nb, kv_heads, 2 * bs, d).chunk(2, dim=2)
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=seq,
                scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
                softcap=0.0, scheduler_metadata=md, s_aux=None)
        return (time.perf_counter() - t0) * 1e3

    ms: dict[str, list[float]] = {k: [] for k in tables}
    outs = {}
    for r in range(reps + 2):  # two warm-up rounds
        for k, t in tables.items():
            dt_ms = once(t)
            if r >= 2:
                ms[k].append(dt_ms)
            outs[k] = out.clone()  # the last layer's output
    if not torch.equal(outs["shared"], outs["distinct"]):
        raise AssertionError("shared and distinct block tables gave different attention outputs")
    p50 = {k: percentile(v, 50) for k, v in ms.items()}
    kv_layer_mib = context * kv_heads * d * 2 * 2 / 2 ** 20
    return {"context": context, "requests": requests, "queries": queries, "layers": layers, "isa": isa,
            "kv_per_layer_mib": {"shared": kv_layer_mib, "distinct": kv_layer_mib * requests},
            "p50_ms": p50, "distinct_over_shared": p50["distinct"] / p50["shared"], "outputs_equal": True,
            "ms": ms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--requests", default="1,4,16", help="comma list")
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads (the TTFT runs bind one core)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--isa", default="vec")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [run(args.context, int(r), args.queries, args.layers, args.reps, args.isa) for r in args.requests.split(",")]
    table = ["| requests | KV read per layer: shared / distinct | shared ms | distinct ms | distinct / shared |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        kv = r["kv_per_layer_mib"]
        p50 = r["p50_ms"]
        table.append(f"| {r['requests']} | {kv['shared']:.0f} / {kv['distinct']:.0f} MiB | "
                     f"{p50['shared']:.1f} | {p50['distinct']:.1f} | {r['distinct_over_shared']:.2f}x |")
    print("\n".join(table))
    if args.out:
        arms = [Arm.from_samples(f"{r['requests']} requests/{k}", v, unit="ms")
                for r in rows for k, v in r["ms"].items()]
        write_result(Result(benchmark="attention_footprint", machine=machine_info(), parameters=vars(args), arms=arms,
                            details={"threads": args.threads, "rows": rows}), args.out.parent, args.out.stem,
                     body="# Attention over shared and distinct KV blocks\n\n" + "\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

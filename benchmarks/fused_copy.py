"""The GPU injection hot path: a request's LMCache chunks -> vLLM's fused K|V paged cache (vLLM >=
0.26 on CUDA), measured against the bus.

    python benchmarks/fused_copy.py [--device cuda|cpu] [--shapes llama-3.1-8b,llama-3.2-1b]
                                    [--tokens 4096,16384,32768] [--reps 5] [--profile]

Same bytes (a request of `--tokens` tokens in 256-token `KV_2LTD` chunks, in pinned host memory
on CUDA as LMCache's local CPU backend holds them), same destination (one
`[blocks, block_size, kv_heads, 2 * head_dim]` tensor per layer, the blocks shuffled as a block
table hands them out), one run, these arms:

- `batched`: `fused_kv.load_chunks`, what `FusedKVGPUConnector.batched_to_gpu` runs for a
  request: the chunks joined on the device in groups, one interleave of K and V for all layers
  and one scatter per layer per group;
- `per_chunk`: `fused_kv.load_chunk` once per chunk, what LMCache's own `batched_to_gpu` loop
  makes of the same connector (a copy, a check of the slots and a scatter per layer per chunk);
- `lmcache_split` (CUDA, where LMCache's compiled `cuda_ops` load): LMCache's own
  `VLLMPagedMemGPUConnectorV2.batched_to_gpu` into vLLM's older split K/V layout, the copy
  LMCache ships for the same chunks;
- `pinned_copy` (the limit): one `copy_` of a pinned host tensor of the same size to the
  device; `pageable_copy` the same from ordinary memory (what a failed pin silently gives);
  on the CPU `memcpy` (`copy_` of the same bytes) is the limit.

The arms take turns in every repetition (median of `--reps`), after one warm-up each. Every arm's
cache is checked against the chunks' KV at sampled slots, so a fast wrong copy cannot pass.
Results: `benchmarks/results/fused_copy[-DEVICE].json` and `.md` (`--out` to change); `--profile`
adds where one call of each copy arm spends its time (torch.profiler's operators) to both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import ROOT, Arm, Result, machine_info, percentile, write_result

CHUNK, BLOCK = 256, 16
# Llama's published geometries (config.json of meta-llama/Llama-3.1-8B and Llama-3.2-1B), and the
# small model the other benchmarks use: (layers, kv_heads, head_dim)
SHAPES = {"llama-3.1-8b": (32, 8, 128), "llama-3.2-1b": (16, 8, 64), "bench": (8, 2, 128)}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def request(shape: str, tokens: int, device, seed: int = 0) -> dict[str, Any]:
    """The chunks (host, pinned on CUDA), the fused cache layers, the split cache layers and the
    slot mapping of one request."""
    import torch

    L, H, D = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(seed)
    chunks = []
    for s in range(0, tokens, CHUNK):  # random bits made on the device (fast), held where LMCache holds them
        bits = torch.randint(-2**15, 2**15, (2, L, min(CHUNK, tokens - s), H * D), generator=g, device=device,
                             dtype=torch.int16)
        host = torch.empty(bits.shape, dtype=torch.int16, pin_memory=device.type == "cuda")
        chunks.append(host.copy_(bits).view(torch.bfloat16))
    g = torch.Generator().manual_seed(seed)
    blocks = tokens // BLOCK + 8
    order = torch.randperm(blocks, generator=g)[: -(-tokens // BLOCK)]
    slots = (order.repeat_interleave(BLOCK) * BLOCK + torch.arange(BLOCK).repeat(len(order)))[:tokens]
    return {"L": L, "H": H, "D": D, "chunks": chunks, "slots": slots.to(device),
            "fused": [torch.zeros(blocks, BLOCK, H, 2 * D, dtype=torch.bfloat16, device=device) for _ in range(L)],
            "starts": list(range(0, tokens, CHUNK)), "ends": [min(s + CHUNK, tokens) for s in range(0, tokens, CHUNK)]}


def check_fused(req: dict[str, Any], samples: int = 64) -> None:
    """The fused cache holds each sampled token's K then V per head where vLLM reads them."""
    import torch

    H, D = req["H"], req["D"]
    n = len(req["slots"])
    for t in torch.linspace(0, n - 1, samples).long().tolist():
        c = req["chunks"][t // CHUNK][:, :, t % CHUNK]
        s = int(req["slots"][t])
        for layer in (0, req["L"] - 1):
            row = req["fused"][layer][s // BLOCK, s % BLOCK].cpu()
            want = torch.cat([c[0, layer].view(H, D), c[1, layer].view(H, D)], dim=-1)
            if not torch.equal(row.view(torch.int16), want.view(torch.int16)):
                raise AssertionError(f"token {t} layer {layer}: the fused cache does not hold the chunk's KV")


def arms(req: dict[str, Any], device) -> dict[str, Callable[[], None]]:
    import torch

    from lmcache_cartridge.vllm.fused_kv import FUSED_NHD, load_chunk, load_chunks

    total = sum(c.numel() for c in req["chunks"])
    host = torch.cat([c.reshape(-1) for c in req["chunks"]])  # pageable
    dst = torch.empty(total, dtype=torch.bfloat16, device=device)
    out: dict[str, Callable[[], None]] = {}
    if device.type == "cuda":
        pinned = torch.empty(total, dtype=torch.bfloat16, pin_memory=True).copy_(host)
        out["pinned_copy"] = lambda: dst.copy_(pinned, non_blocking=True)
        out["pageable_copy"] = lambda: dst.copy_(host)
    else:
        out["memcpy"] = lambda: dst.copy_(host)

    def per_chunk():
        for c, s, e in zip(req["chunks"], req["starts"], req["ends"]):
            load_chunk(c, req["fused"], req["slots"], s, e, FUSED_NHD)

    out["per_chunk"] = per_chunk
    out["batched"] = lambda: load_chunks(req["chunks"], req["starts"], req["ends"], req["fused"], req["slots"],
                                         FUSED_NHD)
    if device.type == "cuda":
        try:
            out["lmcache_split"] = lmcache_split_arm(req, device)
        except Exception as e:  # LMCache's compiled ops missing or another API: the arm is reported absent
            print(f"lmcache_split arm unavailable: {type(e).__name__}: {e}", flush=True)
    return out


def lmcache_split_arm(req: dict[str, Any], device) -> Callable[[], None]:
    """LMCache's own in-process CUDA connector loading the same chunks into vLLM's split
    `[2, blocks, block_size, heads, head_dim]` layers (its compiled multi-layer kernel)."""
    import torch
    import lmcache.cuda_ops  # noqa: F401  (the compiled kernel, or this arm is absent)

    import lmcache.v1.memory_management as mm
    from lmcache_cartridge.lmcache_compat import VLLMPagedMemGPUConnectorV2

    L, H, D = req["L"], req["H"], req["D"]
    conn = VLLMPagedMemGPUConnectorV2(hidden_dim_size=H * D, num_layers=L, use_gpu=False)
    blocks = req["fused"][0].shape[0]
    split = [torch.zeros(2, blocks, BLOCK, H, D, dtype=torch.bfloat16, device=device) for _ in range(L)]
    objs = []
    for c in req["chunks"]:
        raw = c.view(torch.uint8).reshape(-1)
        md = mm.MemoryObjMetadata(shape=c.shape, dtype=c.dtype, address=0, phy_size=raw.numel(), ref_count=1,
                                  fmt=mm.MemoryFormat.KV_2LTD)
        objs.append(mm.TensorMemoryObj(raw, md, None))

    def run():
        conn.batched_to_gpu(objs, req["starts"], req["ends"], kvcaches=split, slot_mapping=req["slots"])

    run()
    _sync(device)
    t = len(req["slots"]) - 1
    s = int(req["slots"][t])
    got = split[L - 1][1, s // BLOCK, s % BLOCK].cpu().reshape(-1)
    if not torch.equal(got.view(torch.int16), req["chunks"][t // CHUNK][1, L - 1, t % CHUNK].view(torch.int16)):
        raise AssertionError("LMCache's split copy does not hold the chunk's V where vLLM reads it")
    return run


def measure(fns: dict[str, Callable[[], None]], device, reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: allocator, kernels, caches
        fn()
    _sync(device)
    for _ in range(reps):
        for name, fn in fns.items():
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t)
    return times


def profile(fns: dict[str, Callable[[], None]], device, rows: int = 6) -> dict[str, list[dict[str, Any]]]:
    """Where the time of one call of each arm goes, from torch.profiler: per operator its own time
    on the device (on the CPU for a CPU run), its share of the arm's and its calls, the `rows`
    largest. Operators only, as the profiler's table totals them: a kernel's time is its operator's."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out = {}
    for name in ("per_chunk", "batched"):
        with tprofile(activities=acts) as prof:
            fns[name]()
            _sync(device)
        ops = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU and getattr(e, attr) > 0]
        total = sum(getattr(e, attr) for e in ops) or 1.0
        out[name] = [{"op": e.key, "self_ms": round(getattr(e, attr) / 1e3, 3),
                      "share": round(getattr(e, attr) / total, 3), "calls": e.count}
                     for e in sorted(ops, key=lambda e: getattr(e, attr), reverse=True)[:rows]]
    return out


def run(device_name: str, shapes: list[str], token_counts: list[int], reps: int,
        with_profile: bool = False) -> dict[str, Any]:
    import torch

    device = torch.device(device_name)
    cells, prof = [], None
    for shape in shapes:
        for tokens in token_counts:
            req = request(shape, tokens, device)
            fns = arms(req, device)
            for name in ("per_chunk", "batched"):  # each arm's cache checked before it is timed
                for t in req["fused"]:
                    t.zero_()
                fns[name]()
                _sync(device)
                check_fused(req)
            times = measure(fns, device, reps)
            nbytes = sum(c.nbytes for c in req["chunks"])
            med = {k: percentile(v, 50) for k, v in times.items()}
            limit = med.get("pinned_copy", med.get("memcpy"))
            cell = {"shape": shape, "tokens": tokens, "chunks": len(req["chunks"]), "bytes": nbytes,
                    "ms": {k: round(v * 1e3, 3) for k, v in med.items()},
                    **{f"ms_p{q}": {k: round(percentile(v, q) * 1e3, 3) for k, v in times.items()} for q in (95, 99)},
                    "gb_s": {k: round(nbytes / v / 1e9, 2) for k, v in med.items()},
                    "of_limit": {k: round(limit / v, 3) for k, v in med.items()},
                    "per_chunk_overhead_ms": {k: round((v - limit) / len(req["chunks"]) * 1e3, 4)
                                              for k, v in med.items()}}
            print(json.dumps(cell), flush=True)
            cells.append(cell)
            if with_profile and shape == shapes[0] and tokens == max(token_counts):
                prof = {"shape": shape, "tokens": tokens, "time": "CUDA" if device.type == "cuda" else "cpu",
                        "arms": profile(fns, device)}
            del req, fns
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"machine": machine_info(device.type == "cuda"), "argv": sys.argv[1:], "chunk": CHUNK,
            "block_size": BLOCK, "reps": reps, "torch_threads": torch.get_num_threads(), "cells": cells,
            **({"profile": prof} if prof else {})}


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    arms = [a for a in ("pinned_copy", "memcpy", "pageable_copy", "lmcache_split", "per_chunk", "batched")
            if any(a in c["ms"] for c in result["cells"])]
    lines = ["# Fused K|V load: a request's chunks into vLLM's paged cache",
             "", f"`python benchmarks/fused_copy.py {' '.join(result['argv'])}`", "",
             f"Machine: {m.get('gpu') or m.get('cpu')}; torch {m.get('torch')}, LMCache {m.get('lmcache')}; "
             f"median of {result['reps']}, 256-token chunks, block size {result['block_size']}.", "",
             "| shape | tokens | MiB | " + " | ".join(f"{a} ms" for a in arms) + " | batched GB/s | batched / limit |",
             "|---|---|---|" + "---|" * len(arms) + "---|---|"]
    for c in result["cells"]:
        ms = " | ".join(str(c["ms"].get(a, "")) for a in arms)
        lines.append(f"| {c['shape']} | {c['tokens']} | {c['bytes'] / 2**20:.0f} | {ms} | "
                     f"{c['gb_s']['batched']} | {c['of_limit']['batched']} |")
    return "\n".join(lines + _profile_markdown(result.get("profile"))) + "\n"


def _profile_markdown(prof: dict[str, Any] | None) -> list[str]:
    """`--profile`'s table: each arm's largest operators in one call of the largest cell."""
    if not prof:
        return []
    lines = ["", f"## Where one call's time goes ({prof['shape']}, {prof['tokens']} tokens; torch.profiler, "
                 f"operators' own {prof['time']} time)", "", "| arm | operator | ms | share | calls |",
             "|---|---|---:|---:|---:|"]
    for arm, ops in prof["arms"].items():
        lines += [f"| {arm} | `{o['op']}` | {o['self_ms']} | {o['share'] * 100:.1f}% | {o['calls']} |" for o in ops]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    ap.add_argument("--shapes", default="llama-3.1-8b,llama-3.2-1b", help="of " + ",".join(SHAPES))
    ap.add_argument("--tokens", default="4096,16384,32768")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true",
                    help="where one call's time goes in the first shape's largest cell (torch.profiler), in the result")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = args.out or ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    result = run(device, args.shapes.split(","), [int(t) for t in args.tokens.split(",")], args.reps, args.profile)
    stem = "fused_copy" + ("" if device == "cuda" else "-cpu")
    arms = [Arm(name=f"{c['shape']}/{c['tokens']}/{a}", count=result["reps"], p50=ms, p95=c["ms_p95"][a],
                p99=c["ms_p99"][a], unit="ms", figures={"gb_s": c["gb_s"][a]})
            for c in result["cells"] for a, ms in c["ms"].items()]
    write_result(Result(benchmark="fused_copy", machine=result["machine"], parameters=vars(args), arms=arms,
                        details={k: v for k, v in result.items() if k != "machine"}), out, stem, body=markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

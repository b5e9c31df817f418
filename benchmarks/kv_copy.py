"""The injection hot path on vLLM's CPU backend: LMCache chunks -> vLLM's paged KV cache.

    .venv/bin/python benchmarks/kv_copy.py [--tokens 8192] [--layers 8] [--kv-heads 2]
                                           [--head-dim 128] [--block-size 128] [--threads 1]

Same bytes (a cartridge of `--tokens` tokens in 256-token `KV_2LTD` chunks), same destination
(vLLM-CPU's per-layer `[blocks, kv_heads, block_size, 2*head_dim]` caches), one run, these arms:

- `ours-blocks`: `CpuPagedKVConnector.batched_to_gpu` on memory objects that hold vLLM's own
  blocks (`cpu_kv.EngineBlocks`, what LMCache's CPU cache holds in vLLM's worker once a chunk
  was served or stored): whole-block copies (`cart_kv_blocks`);
- `encode`: the conversion of the same `KV_2LTD` chunks into such objects (what the plugin does
  once per chunk on a first hit of a chunk its CPU tier holds, or of a remote cartridge's);
- `encode-packed`: the same conversion read in place from the chunks' packed by-head payload
  (`packed.payload_view`: what a local cartridge's file holds; the plugin's first hit of a local
  chunk), one pass where converting to `KV_2LTD` first would be two;
- `ours`: the same connector on `KV_2LTD` objects (LMCache's layout, what it loads where engine
  blocks are off), with the native tiled-transpose kernel (`lmcache_cartridge/vllm/csrc/kv_copy.c`;
  absent if it cannot be built);
- `ours-sse2`: the same kernel held to SSE2 (`native.simd("sse2")`), on CPUs where it picks
  AVX-512: what a CPU without AVX-512 runs, and what AVX-512 gains ("amx"'s K tiles use it);
- `ours-torch`: the same connector on its pure-torch fallback (`LMCACHE_CARTRIDGE_NATIVE=0`);
- `vllm-op`: vLLM's own C++ writer `cpu_attn_reshape_and_cache` (what vLLM uses to store the KV
  it computes), one call per chunk and layer: the best a kernel written for this layout does;
- `transpose`: only the K transposes the layout needs (`[tokens, H*D] -> [H*D, tokens]`);
- `memcpy`: a plain copy of the same number of bytes (the limit without the layout).

The arms take turns in every repetition (best of `--reps` each), so a load spike on a shared
machine hits them alike. Torch runs with `--threads` intra-op threads (vLLM's worker in the TTFT
benchmark has one core). `--isa` picks the layout (default: what vLLM picks here; "amx" is copied
by the same kernel, `ours-torch` loads it through vLLM's writer). `run(...)` is importable;
`tests/test_bench_kv_copy.py` checks at tiny sizes that `ours`, `ours-torch` and `vllm-op` leave
byte-identical caches.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import ROOT, Arm, Result, machine_info, write_result

CHUNK = 256


class _Obj:
    """The part of LMCache's MemoryObj the connector reads."""

    def __init__(self, t: torch.Tensor) -> None:
        from lmcache.v1.memory_management import MemoryFormat

        self.tensor = t
        self.metadata = SimpleNamespace(fmt=MemoryFormat.KV_2LTD)


def _best_interleaved(arms, reps: int) -> dict[str, float]:
    """Best time per arm, the arms taking turns in every repetition: on a shared machine a load
    spike then hits all arms alike instead of skewing the one that happened to run during it."""
    for _, fn in arms:
        fn()  # warm-up (layout probe, page faults)
    best = {name: float("inf") for name, _ in arms}
    for _ in range(reps):
        for name, fn in arms:
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def run(tokens: int = 8192, layers: int = 8, kv_heads: int = 2, head_dim: int = 128,
        block_size: int = 128, reps: int = 10, seed: int = 0, isa: str | None = None) -> dict[str, Any]:
    """Time every arm; return {arm: seconds, ...} plus the caches `ours*` and `vllm-op` wrote."""
    import vllm._custom_ops as ops

    from lmcache_cartridge.cartridge.packed import to_chunk_layout
    from lmcache_cartridge.testing.cpu_engine import private_engine_blocks
    from lmcache_cartridge.vllm import cpu_kv, native
    from lmcache_cartridge.vllm.cpu_kv import CpuPagedKVConnector, current_attn_isa

    if tokens % CHUNK or CHUNK % block_size:
        raise ValueError(f"tokens must be whole {CHUNK}-token chunks of whole {block_size}-token blocks")
    dt = torch.bfloat16
    isa = isa or current_attn_isa(dt, block_size, head_dim)
    nb = tokens // block_size + 2
    g = torch.Generator().manual_seed(seed)
    chunks = [torch.randn(2, layers, CHUNK, kv_heads * head_dim, generator=g).to(dt)
              for _ in range(tokens // CHUNK)]
    objs = [_Obj(c) for c in chunks]
    slots = torch.arange(block_size, block_size + tokens)  # block 0 left alone, like vLLM's null block
    starts = list(range(0, tokens, CHUNK))
    ends = [s + CHUNK for s in starts]

    def caches():
        return [torch.zeros(nb, kv_heads, block_size, 2 * head_dim, dtype=dt) for _ in range(layers)]

    ours_caches, sse2_caches, torch_caches, op_caches = caches(), caches(), caches(), caches()
    blocks_caches = caches()
    real_isa = cpu_kv.current_attn_isa
    cpu_kv.current_attn_isa = lambda *a, **kw: isa  # the layout under test (vLLM's pick by default)
    try:
        conn = CpuPagedKVConnector(layers, kv_heads, head_dim, dt)
        conn.check_layout(ours_caches)
        conn_torch = CpuPagedKVConnector(layers, kv_heads, head_dim, dt)
        conn_torch.use_native = False
        conn_torch.check_layout(torch_caches)
        conn_blocks = CpuPagedKVConnector(layers, kv_heads, head_dim, dt)
        engine_blocks = private_engine_blocks(conn_blocks, blocks_caches)
    finally:
        cpu_kv.current_attn_isa = real_isa
    block_objs = [_Obj(torch.empty_like(c)) for c in chunks]

    def load(c, dst):
        c.batched_to_gpu(objs, starts, ends, kvcaches=dst, slot_mapping=slots, req_id="bench")
        if c.failed_loads:
            raise RuntimeError(f"connector refused the load: {c.take_failed_loads()}")

    def ours():
        load(conn, ours_caches)

    def encode():
        for o, c in zip(block_objs, chunks):
            engine_blocks.encode(o.tensor, c)

    # The same chunks as a packed file holds them (`packed.to_chunk_layout`: heads first,
    # `[H, 2, L, t, D]`), encoded from where they lie, read as `packed.payload_view` reads them.
    packed = [to_chunk_layout(c.view(2, layers, CHUNK, kv_heads, head_dim), 0, CHUNK) for c in chunks]
    packed_objs = [_Obj(torch.empty_like(c)) for c in chunks]

    def encode_packed():
        for o, p in zip(packed_objs, packed):
            engine_blocks.encode(o.tensor, p.permute(1, 2, 3, 0, 4))

    def ours_blocks():
        conn_blocks.batched_to_gpu(block_objs, starts, ends, kvcaches=blocks_caches, slot_mapping=slots,
                                   req_id="bench")
        if conn_blocks.failed_loads:
            raise RuntimeError(f"connector refused the load: {conn_blocks.take_failed_loads()}")

    def ours_sse2():
        native.simd("sse2")
        try:
            load(conn, sse2_caches)
        finally:
            native.simd("avx512")  # back to the CPU's best

    def ours_torch():
        load(conn_torch, torch_caches)

    def vllm_op():
        for c, (s, e) in enumerate(zip(starts, ends)):
            sl = slots[s:e]
            for layer, cache in enumerate(op_caches):
                kc, vc = cache.view(nb, kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
                ops.cpu_attn_reshape_and_cache(chunks[c][0, layer].view(CHUNK, kv_heads, head_dim),
                                               chunks[c][1, layer].view(CHUNK, kv_heads, head_dim),
                                               kc, vc, sl, isa)

    scratch = torch.empty(kv_heads * head_dim, CHUNK, dtype=dt)

    def transpose():
        for c in chunks:
            for layer in range(layers):
                scratch.copy_(c[0, layer].t())

    flat_src = torch.cat([c.reshape(-1) for c in chunks])
    flat_dst = torch.empty_like(flat_src)

    def memcpy():
        flat_dst.copy_(flat_src)

    nbytes = flat_src.numel() * flat_src.element_size()
    out: dict[str, Any] = {"tokens": tokens, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                           "block_size": block_size, "isa": isa, "bytes": nbytes,
                           "threads": torch.get_num_threads(), "native": native.kernel() is not None,
                           "simd": native.simd(),
                           "native_unavailable": native.unavailable_reason(), "arms": {}}
    encode()  # the objects the block arm loads
    arms = [("ours-blocks", ours_blocks), ("encode", encode), ("encode-packed", encode_packed), ("ours", ours),
            ("ours-torch", ours_torch),
            ("vllm-op", vllm_op), ("transpose", transpose), ("memcpy", memcpy)]
    if native.simd() == "avx512":
        arms.insert(1, ("ours-sse2", ours_sse2))
    for name, s in _best_interleaved(arms, reps).items():
        out["arms"][name] = {"seconds": s, "gbps": nbytes / s / 1e9}
    out["caches"] = {"ours-blocks": blocks_caches, "ours": ours_caches, "ours-torch": torch_caches,
                     "vllm-op": op_caches}
    out["objects"] = {"encode": [o.tensor for o in block_objs], "encode-packed": [o.tensor for o in packed_objs]}
    out["engine_block_copies"] = conn_blocks.stats["engine_block_copies"]
    if "ours-sse2" in out["arms"]:
        out["caches"]["ours-sse2"] = sse2_caches
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--isa", default=None, help="layout to inject into (default: vLLM's pick here)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_copy.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    r = run(a.tokens, a.layers, a.kv_heads, a.head_dim, a.block_size, a.reps, isa=a.isa)
    ref = r["caches"]["vllm-op"]
    same = all(torch.equal(x.view(torch.uint16), y.view(torch.uint16))
               for name, written in r["caches"].items() if name != "vllm-op" for x, y in zip(written, ref))
    objs = r.pop("objects")
    same = same and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                        for x, y in zip(objs["encode"], objs["encode-packed"]))
    r.pop("caches")
    r["ours_equals_vllm_op"] = same
    r["ours_over_memcpy"] = r["arms"]["memcpy"]["seconds"] / r["arms"]["ours"]["seconds"]
    r["ours_blocks_over_memcpy"] = r["arms"]["memcpy"]["seconds"] / r["arms"]["ours-blocks"]["seconds"]
    print(f"{a.tokens} tokens ({r['bytes'] / 2**20:.0f} MiB) into vLLM-CPU paged KV "
          f"(ISA {r['isa']}, {r['threads']} thread(s), native kernel: "
          f"{r['simd'] or r['native_unavailable']}); every arm's bytes == vllm-op's: {same}")
    for name, x in r["arms"].items():
        print(f"  {name:13s} {x['seconds'] * 1e3:8.2f} ms  {x['gbps']:6.2f} GB/s  "
              f"({r['arms']['memcpy']['seconds'] / x['seconds']:.2f}x memcpy speed)")
    arms = [Arm(name=name, count=a.reps, figures={"best_seconds": x["seconds"], "gbps": x["gbps"]})
            for name, x in r["arms"].items()]  # best of `reps`: the copy's cost without the shared machine's noise
    write_result(Result(benchmark="kv_copy", machine=machine_info(), parameters=vars(a), arms=arms, details=r),
                 a.out.parent, a.out.stem, markdown_file=False)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

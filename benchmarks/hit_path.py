"""A cartridge's first and repeat hit inside LMCache's real engine, without vLLM: where a first
hit's time goes, and how its chunk reads use the worker's cores.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/hit_path.py [--lengths 8192,16384]
        [--samples 8] [--cores 1 | --cores 0,1] [--breakdown] [--out DIR]

What runs: in this process, one `LMCacheEngine` (LMCache's CPU cache + the cartridge plugin, as
`configs/` set them up) with `CpuPagedKVConnector` over vLLM-CPU-shaped caches of the TTFT
model's geometry (`benchmarks/ttft.py`: 8 layers, 2 KV heads of 128, bf16, 8 KiB per token,
blocks of 128 tokens), engine blocks declared as the vLLM connector declares them. A retrieve is
what vLLM's `start_load_kv` asks of LMCache for a request whose document is the cartridge.

The process runs as vLLM runs a worker bound to `--cores` (re-executed with the environment
`OMPProcessManager.configure_omp_envs` and `platforms/cpu.py` give it: torch's libgomp preloaded,
`GOMP_CPU_AFFINITY`): the main thread on the first core, one OpenMP thread per core. `--cores 1` is
the TTFT runs' `VLLM_CPU_OMP_THREADS_BIND=1`.

Arms, taking turns within each sample (each first hit on a new engine, so a new plugin whose
chunks nobody has read; the packed file stays in the page cache, as in the TTFT runs):
- `first`: the plugin as configured by default (prefetch on: once a retrieve's reads are done,
  the rest of the cartridge is warmed in the background);
- `first, prefetch off`;
- `first, engine cores only`: prefetch off, `reader_cores: engine` (the others read on the
  worker's cores and the ones its binding leaves free, `store/threads.py`: with `--cores 1`,
  the worker's core and core 0; with `--cores 0,1` there are none left);
- `repeat`: the same retrieve again, served from LMCache's CPU cache.

To compare code, copy this script (and `lmcache_cartridge/vllm/worker_env.py`, if that checkout
predates it) into the other checkout: it imports the package of the checkout it runs in. Run the
two in turns (the README's before/after table: a281430 against d5cac96, twice).

`--breakdown` profiles one more first hit (prefetch off, the reads on the retrieving thread)
and prints where its time went, by function (`HIT_PATH_CALLERS=name` adds who called `name`).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import ROOT, Arm, Result, machine_info, parse_ints, percentile, write_result

LAYERS, KV_HEADS, HEAD_DIM, BLOCK, CHUNK = 8, 2, 128, 128, 256
ARMS = ("first", "first, prefetch off", "first, engine cores only", "repeat")
FIRST_ARMS = ARMS[:3]


class Engine:
    """One LMCacheEngine with the cartridge plugin and the CPU connector, engine blocks declared
    (`testing.cpu_engine`, as the engine-block tests build it)."""

    def __init__(self, work: Path, registry: Path, *, prefetch: bool = True, reader_cores: str = "auto") -> None:
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        from lmcache_cartridge.testing.cpu_engine import CpuBlocksEngine
        from lmcache_cartridge.testing.launch import lmcache_config

        cfg = LMCacheEngineConfig.from_dict(lmcache_config(
            registry, chunk_size=CHUNK, cpu_gb=2.0, cache_dir=work / "cache",
            extra={"storage_plugin.cartridge.prefetch": prefetch,
                   "storage_plugin.cartridge.reader_cores": reader_cores}))
        md = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0,
                             local_worker_id=0, kv_dtype=torch.bfloat16,
                             kv_shape=(LAYERS, 2, CHUNK, KV_HEADS, HEAD_DIM), chunk_size=CHUNK)
        self.eng = CpuBlocksEngine(cfg, md, name="hit-path")
        self.conn, self.plugin = self.eng.conn, self.eng.plugin

    def caches(self, tokens: int):
        import torch

        blocks = tokens // BLOCK + 2
        caches = [torch.ones(blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
        if self.eng.declare_blocks(caches) is None:
            raise SystemExit(f"engine blocks not declared: {self.eng.why_not}")
        return caches

    def retrieve(self, tokens: list[int], caches) -> float:
        import torch

        t0 = time.perf_counter()
        got = self.eng.retrieve(tokens, caches, torch.arange(len(tokens)))
        dt = time.perf_counter() - t0
        if got != len(tokens) - len(tokens) % CHUNK or self.conn.failed_loads:
            raise SystemExit(f"retrieve served {got} of {len(tokens)} tokens: {self.conn.failed_loads}")
        return dt * 1e3

    def close(self) -> None:
        self.eng.close()


class _OnThisThread:
    """The plugin's reader pool replaced for `--breakdown`: reads run on the retrieving thread."""

    map = staticmethod(lambda f, jobs: list(map(f, jobs)))

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        return None


def run_length(work: Path, length: int, samples: int, breakdown: bool) -> dict:
    import torch

    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registry import Registry

    g = torch.Generator().manual_seed(length)
    kv = torch.randn(2, LAYERS, length, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    d = work / f"doc-{length}"
    ids = [1000 + (i * 7919) % 30000 for i in range(length)]
    pack_kv(kv, d, cartridge_id=d.name, model="bench", kind="first_k", token_ids=ids, chunk_size=CHUNK,
            overwrite=True)
    reg = Registry(work / f"reg-{length}.db")
    reg.register(d)
    tokens = ids + [5, 6, 7, 8, 9, 10, 11, 12]
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    for s in range(samples + 1):  # sample 0 warms up (page cache, allocators, kernel build)
        for arm in FIRST_ARMS[s % 3:] + FIRST_ARMS[:s % 3]:  # each arm first in turn
            e = Engine(work, reg.path, prefetch=arm == "first",
                       reader_cores="engine" if arm == "first, engine cores only" else "auto")
            try:
                first = e.retrieve(tokens, e.caches(len(tokens)))
                repeat = e.retrieve(tokens, e.caches(len(tokens)))
            finally:
                e.close()
            if s:
                times[arm].append(first)
                times["repeat"].append(repeat)
    out = {"length": length, "samples": samples, "ms": times,
           "p50": {a: percentile(v, 50) for a, v in times.items()}}
    if breakdown:
        e = Engine(work, reg.path, prefetch=False)
        try:
            e.plugin._readers = _OnThisThread()
            caches = e.caches(len(tokens))
            prof = cProfile.Profile()
            prof.enable()
            total = e.retrieve(tokens, caches)
            prof.disable()
        finally:
            e.close()
        print(f"\n--- breakdown of one first hit, {length} tokens, {total:.1f} ms (reads on this thread)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(16)
        if os.environ.get("HIT_PATH_CALLERS"):
            pstats.Stats(prof).print_callers(os.environ["HIT_PATH_CALLERS"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=parse_ints, default=[8192, 16384])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--cores", type=parse_ints, default=[1], help="the vLLM worker's cores (default 1)")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "hit_path")
    args = ap.parse_args()
    if os.environ.get("GOMP_CPU_AFFINITY") != " ".join(map(str, args.cores)):
        from lmcache_cartridge.vllm.worker_env import vllm_worker_env

        raise SystemExit(subprocess.call([sys.executable, *sys.argv], env=vllm_worker_env(args.cores)))
    import torch

    torch.mm(torch.ones(256, 256), torch.ones(256, 256))  # the OpenMP team, bound as in vLLM's worker
    info = {**machine_info(), "worker_cores": args.cores, "main_thread": sorted(os.sched_getaffinity(0))}
    rows = []
    with tempfile.TemporaryDirectory(prefix="hit-path-") as tmp:
        for length in args.lengths:
            r = run_length(Path(tmp), length, args.samples, args.breakdown)
            rows.append(r)
            p = r["p50"]
            print(f"{length} tokens, p50 ms: " + ", ".join(f"{a} {p[a]:.1f}" for a in ARMS), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"hit_path-cores{'_'.join(map(str, args.cores))}"
    lines = [f"Worker cores {args.cores} (main thread on {info['main_thread']}), "
             f"p50 ms over {args.samples} samples:", "",
             "| doc tokens | " + " | ".join(ARMS) + " | first / prefetch off | first / repeat |",
             "|---:|" + "---:|" * (len(ARMS) + 2)]
    for r in rows:
        p = r["p50"]
        lines.append(f"| {r['length']:,} | " + " | ".join(f"{p[a]:.1f}" for a in ARMS)
                     + f" | {p['first'] / p['first, prefetch off']:.2f}x | {p['first'] / p['repeat']:.2f}x |")
    arms = [Arm.from_samples(f"{r['length']}/{a}", r["ms"][a], unit="ms") for r in rows for a in ARMS]
    write_result(Result(benchmark="hit_path", machine=info, parameters=vars(args), arms=arms, details={"rows": rows}),
                 args.out, name, body="\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""First-read verification speed: what a cartridge chunk's first hit pays to prove its bytes.

    .venv/bin/python benchmarks/integrity.py [--mib 32] [--reps 5]

One buffer (random bf16, the size of one chunk: 32 MiB is a 256-token chunk of Llama-3.1-8B,
2 MiB one of the TTFT benchmark's model), one thread unless named, best of `--reps`, in one run:

- `sha256`: hashlib's sha256 (the chunk's identity; what reads verify for a manifest without
  per-chunk BLAKE3 digests);
- `blake2b`: hashlib's blake2b (a per-chunk digest a manifest could store instead);
- `blake3`: the `blake3` package, one thread (what reads verify now, `integrity.chunk_digest`);
- `blake3-2threads`: the same with `max_threads=2` (not used: vLLM's worker thread is bound to
  one core, where BLAKE3's own threads would compete with it);
- `xxh3_64`: the `xxhash` package if installed (not a cryptographic hash: only against accidents);
- `isfinite`: `torch.isfinite(t).all()`, the plain NaN/Inf scan;
- `finite-bits`: `integrity._all_finite`, the scan `check_chunk` does (two max reductions over the bits);
- `memcpy`: a plain copy of the same bytes, the yardstick (`benchmarks/kv_copy.py` measures the
  injection copy against the same thing);
- `check-sha256`, `check-blake3`: `integrity.check_chunk` as a first read runs it (digest, then
  the NaN/Inf scan) for a chunk whose manifest has no BLAKE3 (packed before) and one that has;
- `read+check-sha256`, `read+check-blake3`: the whole first read of a local origin, `pread` from
  the page-cache-warm payload into the buffer and then `check_chunk` (`Residency._read_below_cpu`).

Nothing here changes what is verified; it measures the options for it.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import torch

import harness  # noqa: F401  (first: the benchmarks' preamble: path, environment)
from harness import ROOT, Arm, Result, machine_info, write_result


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run(mib: int = 32, reps: int = 5) -> dict:
    import os
    import tempfile

    from lmcache_cartridge.cartridge.integrity import _all_finite, blake3_hex, check_chunk
    from lmcache_cartridge.cartridge.manifest import ChunkInfo

    torch.set_num_threads(1)
    n = mib * 2**20
    t = torch.randn(n // 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    buf = memoryview(t.view(torch.uint8).numpy())
    dst = torch.empty_like(t)
    legacy = ChunkInfo(0, 0, n, 1, hashlib.sha256(buf).hexdigest())
    current = ChunkInfo(0, 0, n, 1, legacy.sha256, blake3_hex(buf))
    payload = tempfile.NamedTemporaryFile(prefix="integrity-", suffix=".bin")
    payload.write(buf)
    payload.flush()
    fd = os.open(payload.name, os.O_RDONLY)
    into = memoryview(dst.view(torch.uint8).numpy())

    def read_check(info):
        os.preadv(fd, [into], 0)
        check_chunk(info, into, "bench", torch.bfloat16)

    arms = {
        "sha256": lambda: hashlib.sha256(buf).digest(),
        "blake2b": lambda: hashlib.blake2b(buf).digest(),
        "isfinite": lambda: bool(torch.isfinite(t).all()),
        "finite-bits": lambda: _all_finite(buf, torch.bfloat16),
        "memcpy": lambda: dst.copy_(t),
    }
    try:
        import blake3

        arms["blake3"] = lambda: blake3.blake3(buf, max_threads=1).digest()
        arms["blake3-2threads"] = lambda: blake3.blake3(buf, max_threads=2).digest()
    except ImportError:
        pass
    try:
        import xxhash

        arms["xxh3_64"] = lambda: xxhash.xxh3_64(buf).digest()
    except ImportError:
        pass
    arms["check-sha256"] = lambda: check_chunk(legacy, buf, "bench", torch.bfloat16)
    arms["check-blake3"] = lambda: check_chunk(current, buf, "bench", torch.bfloat16)
    arms["read+check-sha256"] = lambda: read_check(legacy)
    arms["read+check-blake3"] = lambda: read_check(current)
    out = {"bytes": n, "threads": 1, "arms": {}}
    try:
        for name, fn in arms.items():
            s = _best(fn, reps)
            out["arms"][name] = {"seconds": s, "gbps": n / s / 1e9}
    finally:
        os.close(fd)
        payload.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_copy-integrity.json")
    a = ap.parse_args(argv)
    r = run(a.mib, a.reps)
    print(f"{a.mib} MiB, 1 thread")
    for name, x in r["arms"].items():
        print(f"  {name:18s} {x['seconds'] * 1e3:8.2f} ms  {x['gbps']:6.2f} GB/s")
    arms = [Arm(name=name, count=a.reps, figures={"best_seconds": x["seconds"], "gbps": x["gbps"]})
            for name, x in r["arms"].items()]  # best of `reps`: the copy's cost without the shared machine's noise
    write_result(Result(benchmark="integrity", machine=machine_info(), parameters=vars(a), arms=arms, details=r),
                 a.out.parent, a.out.stem, markdown_file=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

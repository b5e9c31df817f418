"""The CPU KV connector against vLLM-CPU's own KV writer op, and the vLLM connector's fallbacks.

The reference for the layout is vLLM itself: `torch.ops._C.cpu_attn_reshape_and_cache` (what
vLLM's CPU attention calls to write K/V into the paged cache). Whatever it writes, the connector
must read back as the same K/V, and what the connector writes must be byte-identical to it.
Every such test runs for each ISA whose writer executes on this machine ("vec", "vec16", and
"amx", whose writer is checked in a subprocess first) and for both copy paths of the
transposed-K layouts (the native kernel and the pure-torch fallback).
"""

from __future__ import annotations

import functools
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

vllm_ops = pytest.importorskip("vllm._custom_ops")

# after the skip: these import vLLM
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmc_helpers import helpers_take_pieces  # noqa: E402
from lmcache_cartridge.vllm import cpu_kv, cpu_layout, native  # noqa: E402
from lmcache_cartridge.vllm.cpu_kv import CpuPagedKVConnector, UnverifiedKVLayout, slot_runs  # noqa: E402

L, H, D, BS, NB = 2, 2, 64, 128, 16
DT = torch.bfloat16
ISAS = ["vec", "vec16", "amx"]

_WRITER_SNIPPET = """
import sys, torch, vllm._custom_ops as ops
c = torch.zeros(2, 2, 32, 128, dtype=torch.bfloat16)
kc, vc = c.view(2, 2, 64, 64).chunk(2, dim=2)
x = torch.randn(40, 2, 64).to(torch.bfloat16)
ops.cpu_attn_reshape_and_cache(x, x, kc, vc, torch.arange(40), sys.argv[1])
print("written", int((c != 0).sum()))
"""


@functools.lru_cache(maxsize=None)
def writer_in_subprocess(isa: str) -> tuple[int, str]:
    """Run vLLM's writer for `isa` in a child process (an ISA this CPU lacks could kill it)."""
    p = subprocess.run([sys.executable, "-c", _WRITER_SNIPPET, isa], capture_output=True, text=True,
                       timeout=300)
    return p.returncode, (p.stdout + p.stderr).strip().splitlines()[-1] if (p.stdout + p.stderr).strip() else ""


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    """Makes the connector believe vLLM picked this ISA; the reference is written with it."""
    name = request.param
    if name != cpu_kv.current_attn_isa(DT, BS, D):
        rc, last = writer_in_subprocess(name)
        if rc != 0:
            pytest.skip(f"vLLM's '{name}' writer does not run on this machine: rc {rc}: {last}")
    monkeypatch.setattr(cpu_kv, "current_attn_isa", lambda *a, **kw: name)
    return name


@pytest.fixture(params=["native", "native-sse2", "torch"])
def path(request):
    """The native kernel at the best SIMD level this CPU has ("avx512" where it can), the same kernel
    held to SSE2 (what CPUs without AVX-512 run), and the pure-torch fallback."""
    if request.param.startswith("native") and native.kernel() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    if request.param == "native-sse2":
        native.simd("sse2")
        yield "native"
        native.simd("avx512")  # back to the CPU's best
    else:
        yield request.param


def connector(path: str, *args) -> CpuPagedKVConnector:
    conn = CpuPagedKVConnector(*(args or (L, H, D, DT)))
    conn.use_native = path == "native"
    return conn


def test_simd_level_follows_the_cpu_and_can_be_lowered():
    if native.kernel() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    has_avx512 = "avx512f" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else None
    best = native.simd()
    if has_avx512 is not None and platform.machine() == "x86_64":
        assert best == ("avx512" if has_avx512 else "sse2")
    assert native.simd("sse2") == "sse2"
    assert native.simd("avx512") == best  # never above what the CPU has


class Obj:
    """Enough of a MemoryObj for the connector: `.tensor` and `.metadata.fmt`."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.metadata = SimpleNamespace(fmt=MemoryFormat.KV_2LTD)


def vllm_written(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, isa: str) -> list[torch.Tensor]:
    """Per-layer caches written by vLLM's own op. k, v: [L, T, H, D]."""
    caches = []
    for layer in range(L):
        c = torch.zeros(NB, H, BS, 2 * D, dtype=DT)
        kc, vc = c.view(NB, H, 2 * BS, D).chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(k[layer].contiguous(), v[layer].contiguous(), kc, vc,
                                            slots, isa)
        caches.append(c)
    return caches


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    t = 600
    k = torch.randn(L, t, H, D, generator=g).to(DT)
    v = torch.randn(L, t, H, D, generator=g).to(DT)
    blocks = [7, 2, 11, 0, 5]  # a scattered block table
    slots = torch.tensor([blocks[i // BS] * BS + i % BS for i in range(t)])
    return k, v, slots


def lmc(k, v, a, b):
    return torch.stack([k[:, a:b], v[:, a:b]]).flatten(-2).contiguous()  # [2, L, n, H*D]


def test_probe_learns_each_layout_from_vllms_writer(isa):
    for bs, heads, hd, dt in [(BS, H, D, DT), (64, 4, 128, DT), (32, 2, 64, torch.float16),
                              (128, 1, 128, torch.float32)]:
        assert cpu_kv.probe_layout(bs, heads, hd, dt, isa) is None, (bs, heads, hd, dt)
    lay = cpu_layout.derive_layout(isa, BS, H, D, DT)
    # vec and vec16 store K transposed (vLLM's cpu_attn_vec*.hpp); amx packs tiles.
    assert lay.kind == (cpu_layout.AMX_TILES if isa == "amx" else cpu_layout.K_TRANSPOSED)


def test_vec16_head_dims_are_what_vllm_picks_vec16_for():
    """head_dim 80 (a multiple of 16, not 32) is where vLLM picks "vec16" on any x86 CPU."""
    assert cpu_kv.current_attn_isa(DT, BS, 80) == "vec16"
    lay = cpu_layout.derive_layout("vec16", BS, 2, 80, DT)
    assert lay.kind == cpu_layout.K_TRANSPOSED


def test_amx_writer_runs_in_a_subprocess_or_is_refused():
    """vLLM's "amx" writer only packs bytes (no AMX instruction), so it runs on any x86 build;
    where it cannot run, the layout must be refused, never guessed."""
    rc, last = writer_in_subprocess("amx")
    if rc == 0:
        assert last.startswith("written ")
    else:
        with pytest.raises(UnverifiedKVLayout):
            cpu_layout.derive_layout("amx", 32, 2, 64, DT)


def test_a_writer_that_does_not_exist_is_refused():
    assert "could not learn" in cpu_kv.probe_layout(BS, H, D, DT, "no-such-isa")


def test_a_writer_that_is_not_a_permutation_is_refused(monkeypatch):
    """A writer that drops or changes values (e.g. a quantizing one) cannot be served."""
    real = cpu_layout._write

    def lossy(isa, k, v, cache, slots):
        real("vec", k, v, cache, slots)
        cache.view(-1)[::7] = 0

    monkeypatch.setattr(cpu_layout, "_write", lossy)
    with pytest.raises(UnverifiedKVLayout, match="unwritten"):
        cpu_layout.derive_layout("lossy-test", BS, H, D, DT)

    def scaled(isa, k, v, cache, slots):
        real("vec", k * 2, v, cache, slots)

    monkeypatch.setattr(cpu_layout, "_write", scaled)
    with pytest.raises(UnverifiedKVLayout):
        cpu_layout.derive_layout("scaled-test", BS, H, D, DT)


def test_native_kernel_builds_where_a_compiler_exists():
    if not shutil.which("cc") and not shutil.which("gcc"):
        pytest.skip("no C compiler")
    assert native.kernel() is not None, native.unavailable_reason()


def check_against_writer(path: str, isa: str, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """Load `[L, t, heads, hd]` K/V at `slots` (8 blocks of 128) through the connector and compare
    the caches with vLLM's `isa` writer's, byte for byte; store them back and compare the object."""
    heads, hd, dt = k.shape[2], k.shape[3], k.dtype
    ref = []
    for layer in range(L):
        c = torch.zeros(8, heads, 128, 2 * hd, dtype=dt)
        kc, vc = c.view(8, heads, 256, hd).chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(k[layer].contiguous(), v[layer].contiguous(), kc, vc, slots, isa)
        ref.append(c)
    conn = connector(path, L, heads, hd, dt)
    mine = [torch.zeros_like(c) for c in ref]
    obj = torch.stack([k, v]).flatten(-2).contiguous()
    t = slots.numel()
    conn.batched_to_gpu([Obj(obj)], [0], [t], kvcaches=mine, slot_mapping=slots, req_id="r")
    assert not conn.failed_loads
    for r, m in zip(ref, mine):
        assert torch.equal(r.view(torch.uint8), m.view(torch.uint8)), (isa, slots[0])
    out = Obj(torch.empty_like(obj))
    conn.batched_from_gpu([out], [0], [t], kvcaches=ref, slot_mapping=slots)
    assert torch.equal(out.tensor.view(torch.uint8), obj.view(torch.uint8)), (isa, slots[0])
    return conn


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hd", [64, 80, 128])
def test_native_and_torch_paths_write_vllms_bytes_for_each_dtype_and_head_dim(path, dt, hd):
    """Odd run lengths (tails of the 8x8/4x4 tiles), mid-block starts, scattered blocks."""
    g = torch.Generator().manual_seed(hd)
    t, heads = 301, 2
    k = torch.randn(L, t, heads, hd, generator=g).to(dt)
    v = torch.randn(L, t, heads, hd, generator=g).to(dt)
    blocks = [3, 1, 6, 4]
    slots = torch.tensor([blocks[(i + 37) // 128] * 128 + (i + 37) % 128 for i in range(t)])
    conn = check_against_writer(path, cpu_kv.current_attn_isa(dt, 128, hd), k, v, slots)
    assert (conn.stats["native_copies"] > 0) == (path == "native")


@pytest.mark.parametrize("hd", [80, 128])
def test_amx_tiles_at_other_head_dims_match_vllms_writer(path, hd, monkeypatch):
    """"amx"'s K tiles go 16 pair columns at a time on AVX-512 and finish the rest on SSE2: head_dim
    128 is whole 16-column blocks, 80 leaves 8 columns for SSE2; whole tiles and V pairs from block
    starts, partial ones from the odd offset."""
    rc, last = writer_in_subprocess("amx")
    if rc != 0:
        pytest.skip(f"vLLM's 'amx' writer does not run on this machine: rc {rc}: {last}")
    monkeypatch.setattr(cpu_kv, "current_attn_isa", lambda *a, **kw: "amx")
    g = torch.Generator().manual_seed(hd)
    t, heads = 301, 2
    k = torch.randn(L, t, heads, hd, generator=g).to(DT)
    v = torch.randn(L, t, heads, hd, generator=g).to(DT)
    for first in (0, 37):
        slots = torch.tensor([[3, 1, 6, 4][(i + first) // 128] * 128 + (i + first) % 128 for i in range(t)])
        check_against_writer(path, "amx", k, v, slots)


@pytest.mark.parametrize("start", [0, 100, 37])  # chunk aligned to a block / mid-block / at an odd offset
def test_reads_what_vllm_wrote_and_writes_what_vllm_writes(data, start, isa, path):
    k, v, slots = data
    slots = slots.clone()
    if start:  # shift the whole sequence so chunks start mid-block
        slots = slots + start
        slots = slots[slots < NB * BS]
        k, v = k[:, :len(slots)], v[:, :len(slots)]
    t = len(slots)
    ref = vllm_written(k, v, slots, isa)
    conn = connector(path)
    mine = [torch.zeros_like(c) for c in ref]
    for a in range(0, t, 256):
        b = min(t, a + 256)
        out = Obj(torch.empty(2, L, b - a, H * D, dtype=DT))
        conn.batched_from_gpu([out], [a], [b], kvcaches=ref, slot_mapping=slots)
        assert torch.equal(out.tensor, lmc(k, v, a, b)), a
        conn.batched_to_gpu([Obj(lmc(k, v, a, b))], [a], [b], kvcaches=mine, slot_mapping=slots, req_id="r")
    assert not conn.failed_loads
    for r, m in zip(ref, mine):
        assert torch.equal(r.view(torch.int16), m.view(torch.int16))
    assert conn.stats["scatter_tokens"] == 0  # copied by runs, not per slot
    assert (conn.stats["native_copies"] > 0) == (path == "native")
    if isa == "amx" and path == "torch":  # loads by vLLM's own writer, stores through the proven maps
        assert conn.stats["writer_copies"] > 0 and conn.stats["gather_copies"] > 0
    else:
        assert conn.stats["block_copies" if start == 0 else "partial_copies"] > 0


def runs_sharing_blocks(data, start: int, seed: int):
    """(k, v, slots): 512 consecutive slots from `start` (odd: runs share blocks at both ends)
    and then scattered free ones (runs of a token or two in blocks of their own)."""
    k, v, slots = data
    slots = (slots + start)[: 512]
    fragmented = torch.randperm(NB * BS, generator=torch.Generator().manual_seed(seed))[:88]
    slots = torch.cat([slots, fragmented[~torch.isin(fragmented, slots)]])
    return k[:, :len(slots)], v[:, :len(slots)], slots


@pytest.mark.parametrize("start", [0, 37])
def test_native_copy_split_over_threads_writes_what_vllm_writes(data, isa, start, monkeypatch):
    """Layers x runs split over 2 OpenMP threads (torch's runtime): runs that share a block (the
    odd start, fragmented slots) are written by different threads; bytes must still be vLLM's."""
    if native.kernel() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    if not native.openmp():
        pytest.skip("the kernel was built without OpenMP here")
    k, v, slots = runs_sharing_blocks(data, start, seed=2)
    ref = vllm_written(k, v, slots, isa)
    monkeypatch.setattr(CpuPagedKVConnector, "PARALLEL_MIN_BYTES", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        conn = connector("native")
        mine = [torch.zeros_like(c) for c in ref]
        obj = lmc(k, v, 0, len(slots))
        conn.batched_to_gpu([Obj(obj)], [0], [len(slots)], kvcaches=mine, slot_mapping=slots, req_id="r")
        out = Obj(torch.empty_like(obj))
        conn.batched_from_gpu([out], [0], [len(slots)], kvcaches=ref, slot_mapping=slots)
    finally:
        torch.set_num_threads(threads)
    assert not conn.failed_loads
    assert conn.stats["native_threads_max"] == 2
    for r, m in zip(ref, mine):
        assert torch.equal(r.view(torch.int16), m.view(torch.int16))
    assert torch.equal(out.tensor.view(torch.int16), obj.view(torch.int16))


@pytest.mark.parametrize("start", [0, 37])
def test_native_copy_in_pieces_beside_a_helper_thread_writes_what_vllm_writes(data, isa, start, monkeypatch):
    """With a helper thread (in vLLM's worker: one per core its binding leaves free), a copy is
    cut into pieces of runs that it and the calling thread take in turn; runs that share a block
    may land on different threads. Bytes must be vLLM's every time, loads and stores (each with
    a piece copied by the helper)."""
    from lmcache_cartridge.store import threads

    if native.kernel() is None:
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    k, v, slots = runs_sharing_blocks(data, start, seed=3)
    ref = vllm_written(k, v, slots, isa)
    monkeypatch.setattr(CpuPagedKVConnector, "PARALLEL_MIN_BYTES", 1024)  # this copy: 16 pieces
    helpers_take_pieces(monkeypatch)
    conn = connector("native")
    conn._helper_pool = (threads.pool(1, "cartridge-copy"), 1)  # what `_helpers` makes where a core is spare
    obj = lmc(k, v, 0, len(slots))
    try:
        for _ in range(3):
            mine = [torch.zeros_like(c) for c in ref]
            before = conn.stats["helper_pieces"]
            conn.batched_to_gpu([Obj(obj)], [0], [len(slots)], kvcaches=mine, slot_mapping=slots, req_id="r")
            assert not conn.failed_loads and conn.stats["helper_pieces"] > before
            for r, m in zip(ref, mine):
                assert torch.equal(r.view(torch.int16), m.view(torch.int16))
            out = Obj(torch.full_like(obj, -7.0))  # not the bytes of an earlier store
            before = conn.stats["helper_pieces"]
            conn.batched_from_gpu([out], [0], [len(slots)], kvcaches=ref, slot_mapping=slots)
            assert conn.stats["helper_pieces"] > before
            assert torch.equal(out.tensor.view(torch.int16), obj.view(torch.int16))
    finally:
        conn.close()


def test_the_kernel_runs_on_torchs_openmp_runtime_and_on_one_thread_beside_another(data, tmp_path, monkeypatch):
    """Here the kernel's libgomp is torch's (one thread pool, the one vLLM binds). Where a torch
    wheel bundles its runtime under another soname the kernel would get a second, unbound pool:
    it copies on one thread there. A real second runtime stands in for that torch: a copy of the
    system's libgomp, loaded from its own path."""
    import ctypes.util

    if native.kernel() is None or not native.kernel().cart_kv_openmp():
        pytest.skip("the kernel was built without OpenMP here")
    assert native.same_openmp_runtime(native.kernel(), native.torch_library()) and native.openmp()
    gomp = ctypes.util.find_library("gomp")
    found = [p for p in (Path("/usr/lib/x86_64-linux-gnu") / (gomp or ""), Path("/usr/lib64") / (gomp or ""))
             if gomp and p.is_file()]
    if not found:
        pytest.skip("no system libgomp to load as a second runtime")
    other = tmp_path / "libgomp-other.so.1"
    other.write_bytes(found[0].read_bytes())
    assert not native.same_openmp_runtime(native.kernel(), other)
    monkeypatch.setattr(native, "torch_library", lambda: other)
    monkeypatch.setattr(native, "_shared_runtime", None)
    monkeypatch.setattr(CpuPagedKVConnector, "PARALLEL_MIN_BYTES", 0)
    assert not native.openmp()
    k, v, slots = data
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        conn = connector("native")
        mine = [torch.zeros(NB, H, BS, 2 * D, dtype=DT) for _ in range(L)]
        conn.batched_to_gpu([Obj(lmc(k, v, 0, 512))], [0], [512], kvcaches=mine, slot_mapping=slots[:512], req_id="r")
    finally:
        torch.set_num_threads(threads)
    assert conn.stats["native_copies"] > 0 and conn.stats["native_threads_max"] == 1


def test_never_overwrites_tokens_vllm_already_has(data, isa, path):
    k, v, slots = data
    caches = [torch.full((NB, H, BS, 2 * D), 7.0, dtype=DT) for _ in range(L)]
    conn = connector(path)
    conn.batched_to_gpu([Obj(lmc(k, v, 0, 256))], [0], [256], kvcaches=caches, slot_mapping=slots,
                        vllm_cached_tokens=130, req_id="r")
    out = Obj(torch.empty(2, L, 256, H * D, dtype=DT))
    conn.batched_from_gpu([out], [0], [256], kvcaches=caches, slot_mapping=slots)
    assert (out.tensor[:, :, :130] == 7).all()
    assert torch.equal(out.tensor[:, :, 130:], lmc(k, v, 130, 256))


def test_fragmented_slots_match_vllm(data, isa, path):
    k, v, _ = data
    slots = torch.randperm(NB * BS, generator=torch.Generator().manual_seed(1))[:256]
    ref = vllm_written(k[:, :256], v[:, :256], slots, isa)
    conn = connector(path)
    out = Obj(torch.empty(2, L, 256, H * D, dtype=DT))
    conn.batched_from_gpu([out], [0], [256], kvcaches=ref, slot_mapping=slots)
    assert torch.equal(out.tensor, lmc(k, v, 0, 256))
    mine = [torch.zeros_like(c) for c in ref]
    conn.batched_to_gpu([out], [0], [256], kvcaches=mine, slot_mapping=slots, req_id="r")
    assert all(torch.equal(a, b) for a, b in zip(ref, mine))
    if path == "native":  # single-token runs of the native kernel
        assert conn.stats["native_copies"] >= 256
    elif isa != "amx":  # per-slot: a torch scatter
        assert conn.stats["scatter_tokens"] >= 256


def test_slot_runs_agree_with_a_per_slot_walk_on_random_mappings():
    import random

    def walk(s, bs):
        out, i = [], 0
        while i < len(s):
            if s[i] < 0:
                i += 1
                continue
            j = i + 1
            while j < len(s) and s[j] >= 0 and s[j] == s[j - 1] + 1 and s[j] % bs:
                j += 1
            out.append((i, j, s[i] // bs, s[i] % bs))
            i = j
        return out

    rng = random.Random(0)
    for _ in range(2000):
        bs, s = rng.choice([4, 8, 128]), []
        for _ in range(rng.randint(0, 40)):
            r = rng.random()
            s.append(-1 if r < 0.2 else s[-1] + 1 if s and s[-1] >= 0 and r < 0.8 else rng.randint(0, 300))
        for dt in (torch.long, torch.int32):
            assert slot_runs(torch.tensor(s, dtype=dt), bs) == walk(s, bs), (s, bs)
    for _ in range(2000):  # consecutive slots (the fast path): any start, any length
        bs, first, n = rng.choice([4, 16, 128]), rng.randint(0, 500), rng.randint(1, 300)
        s = list(range(first, first + n))
        assert slot_runs(torch.tensor(s), bs) == walk(s, bs), (first, n, bs)
    for _ in range(1000):  # several memory objects end to end (one retrieve): runs end where each does
        bs, pieces = rng.choice([4, 16, 128]), []
        nxt = rng.randint(0, 300)
        for _ in range(rng.randint(1, 5)):
            n = rng.randint(1, 60)
            if rng.random() < 0.3:  # a fragmented piece
                pieces.append([rng.randint(0, 300) if rng.random() < 0.8 else -1 for _ in range(n)])
            else:
                pieces.append(list(range(nxt, nxt + n)))
            nxt = (pieces[-1][-1] + 1) if pieces[-1][-1] >= 0 else rng.randint(0, 300)
        bounds = np.cumsum([0] + [len(p) for p in pieces])
        got = [tuple(int(x) for x in r) for r in
               cpu_kv.run_array(torch.tensor(sum(pieces, [])), bs, breaks=bounds[1:-1])]
        want = [(a + int(b0), e + int(b0), blk, off) for p, b0 in zip(pieces, bounds) for a, e, blk, off in walk(p, bs)]
        assert got == want, (pieces, bs)


def test_slots_past_the_cache_are_a_failed_load_not_a_wild_write(data, path):
    k, v, _ = data
    caches = [torch.zeros(NB, H, BS, 2 * D, dtype=DT) for _ in range(L)]
    slots = torch.arange(NB * BS - 128, NB * BS + 128)  # the second block is past the end
    conn = connector(path)
    conn.batched_to_gpu([Obj(lmc(k, v, 0, 256))], [0], [256], kvcaches=caches, slot_mapping=slots, req_id="r")
    assert "r" in conn.failed_loads


def test_slot_runs_split_at_block_edges_and_gaps():
    s = torch.tensor([126, 127, 128, 129, 5, 6, -1, -1, 300])
    assert slot_runs(s, 128) == [(0, 2, 0, 126), (2, 4, 1, 0), (4, 6, 0, 5), (8, 9, 2, 44)]


def test_unverified_isa_is_refused_without_raising_into_lmcache(data, monkeypatch):
    k, v, slots = data
    monkeypatch.setattr(cpu_kv, "current_attn_isa", lambda *a, **kw: "no-such-isa")  # no writer for it
    conn = CpuPagedKVConnector(L, H, D, DT)
    caches = [torch.zeros(NB, H, BS, 2 * D, dtype=DT) for _ in range(L)]
    assert not conn.refused
    conn.batched_to_gpu([Obj(lmc(k, v, 0, 256))], [0], [256], kvcaches=caches, slot_mapping=slots, req_id="r1")
    assert conn.refused  # CartridgeConnector then starts no store (LMCache would leak its buffers)
    assert "r1" in conn.failed_loads and "no-such-isa" in conn.failed_loads["r1"]
    assert all(not c.any() for c in caches)  # nothing written
    assert conn.take_failed_loads() and not conn.failed_loads
    with pytest.raises(UnverifiedKVLayout):  # a store is refused loudly (nothing stored)
        conn.batched_from_gpu([Obj(torch.empty(2, L, 256, H * D, dtype=DT))], [0], [256],
                              kvcaches=caches, slot_mapping=slots)


def test_mismatched_cache_shape_is_refused(data):
    k, v, slots = data
    conn = CpuPagedKVConnector(L, 4, D // 2, DT)  # same hidden size, other head split
    caches = [torch.zeros(NB, H, BS, 2 * D, dtype=DT) for _ in range(L)]
    with pytest.raises(UnverifiedKVLayout, match="KV heads"):
        conn.check_layout(caches)


def test_hook_builds_cpu_connector_for_vllm_only(monkeypatch):
    import lmcache
    from lmcache.utils import EngineType

    from lmcache_cartridge.lmcache_compat import gpu_connector_module

    from lmcache_cartridge.vllm.connector import install_cpu_connector_hook

    from lmc_helpers import make_config, make_metadata

    if lmcache.torch_device_type != "cpu":
        pytest.skip("LMCache is not on its CPU device type here")
    gc = gpu_connector_module()
    monkeypatch.setattr(gc, "CreateGPUConnector", gc.CreateGPUConnector)  # restored after the test
    assert install_cpu_connector_hook()
    assert install_cpu_connector_hook()  # idempotent
    assert getattr(gc.CreateGPUConnector, "_cartridge_cpu_hook", False)
    md = make_metadata(model_name="m", num_layers=L, num_kv_heads=H, head_dim=D)
    conn = gc.CreateGPUConnector(make_config(), md, EngineType.VLLM)
    assert isinstance(conn, CpuPagedKVConnector) and conn.get_shape(5) == torch.Size([2, L, 5, H * D])
    assert conn.copy_cores == "auto"  # no cartridge plugin in this config: the default
    # with the plugin, its `reader_cores` decides where the copies may also run
    plugin = {"storage_plugins": ["cartridge"], "extra_config": {
        "storage_plugin.cartridge.module_path": "lmcache_cartridge.plugin",
        "storage_plugin.cartridge.class_name": "CartridgeStoragePlugin",
        "storage_plugin.cartridge.reader_cores": "engine"}}
    assert gc.CreateGPUConnector(make_config(**plugin), md, EngineType.VLLM).copy_cores == "engine"
    mock = gc.CreateGPUConnector(make_config(), md, EngineType.MOCK)
    assert not isinstance(mock, CpuPagedKVConnector)


def test_connector_turns_load_failures_into_failed_blocks(monkeypatch):
    """start_load_kv raising, or the CPU connector refusing a load, never escapes: the blocks the
    request was to load are reported, so vLLM recomputes them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

    from lmcache_cartridge.vllm.connector import CartridgeConnector

    c = object.__new__(CartridgeConnector)  # no engine: exercise the fallback logic only
    c._failed_blocks, c._block_size = set(), 16
    import threading

    c._failed_lock = threading.Lock()
    cpu = CpuPagedKVConnector(L, H, D, DT)
    unpinned = []
    c._lmcache_engine = SimpleNamespace(lmcache_engine=SimpleNamespace(gpu_connector=cpu,
                                                                        lookup_unpin=unpinned.append),
                                        get_block_ids_with_load_errors=lambda: {99})

    def req(rid, slots, lo, hi):
        return SimpleNamespace(req_id=rid, slot_mapping=torch.tensor(slots),
                               load_spec=SimpleNamespace(can_load=True, vllm_cached_tokens=lo,
                                                         lmcache_cached_tokens=hi))

    reqs = [req("a", list(range(32, 32 + 64)), 16, 48), req("b", list(range(160, 224)), 0, 32)]
    monkeypatch.setattr(CartridgeConnector, "_get_connector_metadata",
                        lambda self: SimpleNamespace(requests=reqs), raising=False)

    def boom(self, forward_context, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(LMCacheConnectorV1, "start_load_kv", boom)
    c.start_load_kv(None)  # must not raise
    assert c.get_block_ids_with_load_errors() == {99, 3, 4, 10, 11}  # a: slots 48..79, b: 160..191
    assert c.get_block_ids_with_load_errors() == {99}  # ours were consumed

    monkeypatch.setattr(LMCacheConnectorV1, "start_load_kv", lambda self, fc, **kw: None)
    cpu.failed_loads["b"] = "UnverifiedKVLayout: test"
    c.start_load_kv(None)
    assert c.get_block_ids_with_load_errors() == {99, 10, 11}

    # Once vLLM's layout is refused, no LMCache store starts (it would leak LMCache's buffers), but
    # the lookup pins that LMCache's wait_for_save releases are still released.
    def store(self):
        raise AssertionError("a store was started on a refused layout")

    monkeypatch.setattr(LMCacheConnectorV1, "wait_for_save", store)
    cpu._checked[("sig",)] = "ISA 'amx' not verified"
    assert cpu.refused
    unpinned.clear()
    c.wait_for_save()
    assert unpinned == ["a", "b"]

"""The chunk-retrieval tiers, shared by `chunk_retrieval.py`, `s3_read.py` and
`tests/test_bench_chunk_retrieval.py`: the KV shapes, the dataset of packed chunks, and one small
class per arm (ours through the plugin, LMCache's own backends, and the limits: memcpy, read(2),
boto3) with `fetch(indices) -> list[MemoryObj]` and `release(objs)`, timed by `measure`; moto for
the S3 tier. Runs in the benchmark's process (LMCache engines, files, a moto child).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from harness.s3 import DUMMY_ENV, moto_process, moto_thread, s3_client, upload_dir
from harness.stats import percentile

CHUNK = 256
MODEL = "bench-model"
GiB = 1 << 30
S3_BUCKET = "lmc-bench"              # our cartridges (path-style) and LMCache's S3 connector
S3_VHOST = "s3bench.test"            # virtual host suffix resolved in the child's namespace
DUMMY_AWS = {**DUMMY_ENV, "AWS_CONFIG_FILE": "/nonexistent/aws-config-bench",
             "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-config-bench"}


# --- shapes -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def hidden(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.layers * CHUNK * self.hidden * 2  # K+V, bf16

    @property
    def lmc_shape(self) -> torch.Size:
        return torch.Size([2, self.layers, CHUNK, self.hidden])


SHAPES = {
    "llama3.1-8b": Shape("llama3.1-8b", 32, 8, 128),     # 32 MiB / chunk
    "qwen2.5-7b": Shape("qwen2.5-7b", 28, 4, 128),       # 14 MiB / chunk
    "llama2-7b-mha": Shape("llama2-7b-mha", 32, 32, 128),  # 128 MiB / chunk
    "tiny": Shape("tiny", 2, 2, 64),                     # 256 KiB / chunk
}


def set_dummy_aws_env() -> None:
    for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(k, None)
    os.environ.update(DUMMY_AWS)


# --- data ---------------------------------------------------------------------------------------
@dataclass
class Dataset:
    """One shape's chunks on disk: a local multi-chunk cartridge and one-chunk S3 cartridges."""

    shape: Shape
    n: int                       # chunks in the local cartridge
    local_dir: Path
    token_ids: list[int]
    n_s3: int = 0
    s3_dirs: list[Path] = field(default_factory=list)
    s3_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def payload(self) -> Path:
        return self.local_dir / "kv.bin"

    def chunk_offset(self, i: int) -> int:
        return i * self.shape.chunk_bytes

    def raw(self, i: int) -> torch.Tensor:
        """The packed chunk's payload bytes, read straight from kv.bin (uint8, flat): what the raw
        limits copy (`by_head` layout: heads outermost)."""
        out = torch.empty(self.shape.chunk_bytes, dtype=torch.uint8)
        with open(self.payload, "rb", buffering=0) as f:
            f.seek(self.chunk_offset(i))
            assert f.readinto(memoryview(out.numpy())) == out.numel()
        return out

    def raw_s3(self, i: int) -> torch.Tensor:
        return self.raw(i)  # the one-chunk cartridges hold chunk i of the same KV

    def expected(self, i: int) -> torch.Tensor:
        """Chunk `i` as LMCache's `KV_2LTD` (uint8, flat): what a retrieve must deliver."""
        from lmcache_cartridge.cartridge.packed import PackedCartridge

        with PackedCartridge(self.local_dir) as p:
            return p.read_chunk(i).reshape(-1).view(torch.uint8)

    def expected_s3(self, i: int) -> torch.Tensor:
        return self.expected(i)


def random_kv(shape: Shape, n_chunks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.empty(2, shape.layers, n_chunks * CHUNK, shape.kv_heads, shape.head_dim, dtype=torch.bfloat16)
    kv.uniform_(-2.0, 2.0, generator=g)
    return kv


def build_dataset(shape: Shape, n: int, n_s3: int, workdir: Path, seed: int = 0) -> Dataset:
    """Pack `n` chunks as one first-k cartridge, and the first `n_s3` as one-chunk cartridges."""
    from lmcache_cartridge.cartridge.packed import pack_kv

    base = 1000 + 100_000 * (seed % 50)
    kv = random_kv(shape, n, seed)
    tokens = list(range(base, base + n * CHUNK))
    local = workdir / f"{shape.name}-local"
    pack_kv(kv, local, cartridge_id=f"bench-{shape.name}", model=MODEL, kind="first_k",
            token_ids=tokens, chunk_size=CHUNK, overwrite=True)
    ds = Dataset(shape, n, local, tokens, n_s3)
    for i in range(n_s3):
        d = workdir / f"{shape.name}-s3src-{i}"
        # distinct first tokens: each one-chunk cartridge has its own key
        toks = [base + 7_000_000 + i] + tokens[i * CHUNK + 1:(i + 1) * CHUNK]
        pack_kv(kv[:, :, i * CHUNK:(i + 1) * CHUNK], d, cartridge_id=f"bench-{shape.name}-c{i}",
                model=MODEL, kind="first_k", token_ids=toks, chunk_size=CHUNK, overwrite=True)
        ds.s3_dirs.append(d)
        ds.s3_token_ids.append(toks)
    del kv
    return ds


def obj_bytes(obj) -> torch.Tensor:
    """A MemoryObj's payload as a flat uint8 view."""
    return obj.tensor.reshape(-1).view(torch.uint8)


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_tree(root: Path) -> None:
    for p in Path(root).rglob("*"):
        if p.is_file():
            drop_page_cache(p)


# --- LMCache engines ----------------------------------------------------------------------------
def metadata_for(shape: Shape):
    from lmcache_cartridge.testing.dense_engine import make_metadata

    return make_metadata(model_name=MODEL, num_layers=shape.layers, num_kv_heads=shape.kv_heads,
                         head_dim=shape.head_dim, chunk_size=CHUNK)


def alloc_gb_for(shape: Shape, max_batch: int) -> float:
    """LocalCPUBackend size: the largest batch plus slack (GB as LMCache counts it: GiB)."""
    return round((max_batch * shape.chunk_bytes * 1.15 + 64 * (1 << 20)) / GiB, 3)


def load_config(d: dict):
    import yaml
    from lmcache.v1.config import LMCacheEngineConfig

    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="lmc-bench-")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(d, f)
    try:
        return LMCacheEngineConfig.from_file(path)
    finally:
        os.unlink(path)


def base_config(alloc_gb: float) -> dict:
    return {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": alloc_gb,
            "pre_caching_hash_algorithm": "sha256_cbor", "blocking_timeout_secs": 120}


def close_engine(eng, timeout: float = 20.0) -> bool:
    """LMCacheEngineBuilder.destroy can hang closing a RemoteBackend: bound it."""
    t = threading.Thread(target=eng.close, daemon=True, name="lmc-destroy")
    t.start()
    t.join(timeout)
    return not t.is_alive()


def new_engine(cfg: dict, shape: Shape):
    from lmcache_cartridge.testing.dense_engine import Engine

    return Engine(load_config(cfg), metadata_for(shape), num_slots=1)


# --- arms ---------------------------------------------------------------------------------------
class Arm:
    """fetch(indices) returns MemoryObjs (allocator memory) holding chunk i's bytes, in order."""

    name = "arm"
    kind = "ours"        # ours | limit | lmcache
    tier = ""            # cpu | disk-warm | disk-cold | s3
    n = 0                # chunks this arm can serve (indices 0..n-1)
    expected: Callable[[int], torch.Tensor]

    def before_batch(self, indices: Sequence[int]) -> None:
        return None

    def fetch(self, indices: Sequence[int]) -> list:
        raise NotImplementedError

    @staticmethod
    def release(objs) -> None:
        for o in objs:
            if o is not None:
                o.ref_count_down()

    def prepare(self) -> None:
        """Untimed warm-up: one pass over every chunk."""
        for i in range(self.n):
            self.release(self.fetch([i]))


class PluginHost:
    """A real LMCacheEngine whose StorageManager loads our plugin from YAML."""

    def __init__(self, ds: Dataset, workdir: Path, *, name: str, cpu_gb: float, disk_gb: float,
                 alloc_gb: float, s3_endpoint: str | None = None) -> None:
        from lmcache_cartridge.store.registry import Registry

        self.ds, self.workdir = ds, workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        reg_path = self.workdir / "registry.db"
        self.registry = Registry(reg_path)
        p = "storage_plugin.cartridge."
        extra = {p + "module_path": "lmcache_cartridge.plugin",
                 p + "class_name": "CartridgeStoragePlugin",
                 p + "registry": str(reg_path), p + "refresh_seconds": 3600.0,
                 p + "cache_dir": str(self.workdir / "cache"), p + "prefetch": False,
                 p + "cpu_budget_gb": cpu_gb, p + "disk_budget_gb": disk_gb}
        if s3_endpoint:
            extra[p + "s3.endpoint_url"] = s3_endpoint
            extra[p + "s3.region"] = "us-east-1"
            self._register_s3(s3_endpoint)
        else:
            self.registry.register(ds.local_dir)
        cfg = base_config(alloc_gb)
        cfg.update({"storage_plugins": ["cartridge"], "store_location": "LocalCPUBackend",
                    "extra_config": extra})
        self.eng = new_engine(cfg, ds.shape)
        self.plugin = self.eng.backend("cartridge")
        if self.plugin is None:
            raise RuntimeError("LMCache did not load the cartridge plugin (see its log)")
        self.plugin.refresh()
        self.allocator = self.eng.backend("LocalCPUBackend")
        if s3_endpoint:
            self.keys = [self.plugin.mapper.keys(t)[0] for t in ds.s3_token_ids]
        else:
            self.keys = self.plugin.mapper.keys(ds.token_ids)
        if s3_endpoint:  # lookups promise only local chunks: S3 ones are all served, none local
            assert all(k in self.plugin._state.index for k in self.keys), self.plugin.summary()
        else:
            assert self.plugin.batched_contains(self.keys) == len(self.keys), self.plugin.summary()

    def _register_s3(self, endpoint: str) -> None:
        from lmcache_cartridge.store.registration import register_s3
        from lmcache_cartridge.store.s3 import S3Settings

        settings = S3Settings(endpoint_url=endpoint, region="us-east-1")
        for i in range(self.ds.n_s3):
            register_s3(self.registry, f"s3://{S3_BUCKET}/{self.ds.shape.name}/c{i}",
                        self.workdir / "cache", settings, chunk_size=CHUNK)

    def close(self) -> None:
        close_engine(self.eng)
        self.registry.close()


class OursArm(Arm):
    kind = "ours"

    def __init__(self, host: PluginHost, tier: str) -> None:
        self.host, self.tier = host, tier
        self.name = f"ours-{tier}"
        self.n = len(host.keys)
        self.expected = host.ds.expected_s3 if tier == "s3" else host.ds.expected

    def before_batch(self, indices):
        if self.tier == "disk-cold":
            drop_page_cache(self.host.ds.payload)

    def fetch(self, indices):
        if self.tier == "s3":
            # The retrieve never reads S3 (a remote chunk not yet local is a lookup miss and is
            # downloaded in the background): time that download read, chunk by chunk, into
            # LMCache-allocated buffers as the retrieve would fill them.
            plugin, objs = self.host.plugin, []
            try:
                for i in indices:
                    sv, idx = plugin._state.index[self.host.keys[i]]
                    obj = plugin._allocate(sv, idx)
                    if obj is None:
                        raise RuntimeError(f"{self.name}: LocalCPUBackend allocator full")
                    objs.append(obj)
                    plugin.residency.read_into(sv.handle, idx, obj.tensor, network=True)
            except BaseException:
                self.release(objs)
                raise
            return objs
        objs = self.host.plugin.batched_get_blocking([self.host.keys[i] for i in indices])
        if any(o is None for o in objs):
            self.release(objs)
            raise RuntimeError(f"{self.name}: plugin returned a miss")
        return objs


def _alloc(allocator, shape: Shape):
    from lmcache.v1.memory_management import MemoryFormat

    obj = allocator.allocate(shape.lmc_shape, torch.bfloat16, MemoryFormat.KV_2LTD)
    if obj is None:
        raise RuntimeError("LocalCPUBackend allocator full")
    return obj


class MemcpyLimit(Arm):
    kind, tier, name = "limit", "cpu", "limit-memcpy"

    def __init__(self, ds: Dataset, allocator) -> None:
        self.ds, self.allocator, self.n = ds, allocator, ds.n
        self.expected = ds.expected
        self.src = [ds.expected(i) for i in range(ds.n)]  # resident bytes, like the CPU tier (engine layout)

    def fetch(self, indices):
        out = []
        for i in indices:
            obj = _alloc(self.allocator, self.ds.shape)
            obj_bytes(obj).copy_(self.src[i])
            out.append(obj)
        return out

    def close(self) -> None:
        self.src = []


class MemmoveLimit(MemcpyLimit):
    """Same bytes, same allocator, one libc memmove per chunk (no torch intra-op threads)."""

    name = "limit-memmove"

    def fetch(self, indices):
        import ctypes

        out = []
        for i in indices:
            obj = _alloc(self.allocator, self.ds.shape)
            ctypes.memmove(obj_bytes(obj).data_ptr(), self.src[i].data_ptr(), self.src[i].numel())
            out.append(obj)
        return out


class ReadLimit(Arm):
    kind = "limit"

    def __init__(self, ds: Dataset, allocator, cold: bool) -> None:
        self.ds, self.allocator, self.cold, self.n = ds, allocator, cold, ds.n
        self.tier = "disk-cold" if cold else "disk-warm"
        self.name = f"limit-read-{'cold' if cold else 'warm'}"
        self.expected = ds.raw  # the payload's bytes as they lie: no layout conversion
        self.fd = os.open(ds.payload, os.O_RDONLY)

    def before_batch(self, indices):
        if self.cold:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def fetch(self, indices):
        out = []
        nbytes = self.ds.shape.chunk_bytes
        for i in indices:
            obj = _alloc(self.allocator, self.ds.shape)
            buf = memoryview(obj_bytes(obj).numpy())
            off, done = self.ds.chunk_offset(i), 0
            while done < nbytes:
                n = os.preadv(self.fd, [buf[done:]], off + done)
                if n <= 0:
                    raise OSError("short read")
                done += n
            out.append(obj)
        return out

    def close(self) -> None:
        os.close(self.fd)


class Boto3Limit(Arm):
    kind, tier, name = "limit", "s3", "limit-boto3"

    def __init__(self, ds: Dataset, allocator, endpoint: str) -> None:
        self.ds, self.allocator, self.n = ds, allocator, ds.n_s3
        self.expected = ds.raw_s3  # the payload's bytes as they lie: no layout conversion
        self.client = s3_client(endpoint)

    def fetch(self, indices):
        out = []
        n = self.ds.shape.chunk_bytes
        for i in indices:
            obj = _alloc(self.allocator, self.ds.shape)
            buf = memoryview(obj_bytes(obj).numpy())
            r = self.client.get_object(Bucket=S3_BUCKET, Key=f"{self.ds.shape.name}/c{i}/kv.bin",
                                       Range=f"bytes=0-{n - 1}")
            body, pos = r["Body"], 0
            while pos < n:
                got = body.readinto(buf[pos:])
                if not got:
                    raise OSError("short body")
                pos += got
            body.close()
            out.append(obj)
        return out


class LMCacheHost:
    """An LMCacheEngine with one built-in backend, loaded with the dataset's chunks."""

    def __init__(self, ds: Dataset, workdir: Path, kind: str, alloc_gb: float,
                 s3_url: str | None = None) -> None:
        from lmcache_cartridge.cartridge.keys import ChunkKeyMapper

        self.ds, self.kind = ds, kind
        self.dir = workdir / f"lmc-{kind}"
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        cfg = base_config(alloc_gb)
        extra: dict[str, Any] = {}
        n = ds.n_s3 if kind == "s3" else ds.n
        if kind == "localdisk":
            cfg.update({"local_disk": str(self.dir), "max_local_disk_size":
                        round(n * ds.shape.chunk_bytes * 1.2 / GiB + 0.01, 3)})
            self.backend_name = "LocalDiskBackend"
        elif kind == "fs":
            cfg.update({"remote_url": f"fs://localhost:0{self.dir}", "remote_serde": "naive"})
            self.backend_name = "RemoteBackend"
        elif kind == "s3":
            cfg.update({"remote_url": s3_url, "remote_serde": "naive"})
            extra.update({"s3_region": "us-east-1", "disable_tls": True, "s3_prefer_http2": False,
                          "aws_access_key_id": "testing", "aws_secret_access_key": "testing"})
            self.backend_name = "RemoteBackend"
        else:
            raise ValueError(kind)
        if extra:
            cfg["extra_config"] = extra
        self.eng = new_engine(cfg, ds.shape)
        self.backend = self.eng.backend(self.backend_name)
        if self.backend is None:
            raise RuntimeError(f"LMCache built no {self.backend_name}: "
                               f"{list(self.eng.storage_manager.storage_backends)}")
        self.allocator = self.eng.backend("LocalCPUBackend")
        mapper = ChunkKeyMapper(self.eng.engine.config, self.eng.engine.metadata)
        if kind == "s3":
            self.keys = [mapper.keys(t)[0] for t in ds.s3_token_ids]
        else:
            self.keys = mapper.keys(ds.token_ids)
        self.n = len(self.keys)
        self._store()

    def _store(self, timeout: float = 600.0) -> None:
        """Put every chunk through the backend's own put path, wait, then empty LocalCPUBackend."""
        group = 8
        for start in range(0, self.n, group):
            idx = list(range(start, min(self.n, start + group)))
            objs = []
            for i in idx:
                obj = _alloc(self.allocator, self.ds.shape)
                obj_bytes(obj).copy_(self.ds.expected(i))
                objs.append(obj)
            self.backend.batched_submit_put_task([self.keys[i] for i in idx], objs)
            deadline = time.time() + timeout
            while not all(self._stored(self.keys[i]) for i in idx):
                if time.time() > deadline:
                    raise RuntimeError(f"lmc-{self.kind}: store did not finish")
                time.sleep(0.01)
            for o in objs:
                o.ref_count_down()
        time.sleep(0.05)
        self.allocator.clear()

    def _stored(self, key) -> bool:
        if self.kind == "localdisk":
            return self.backend.contains(key) and not self.backend.exists_in_put_tasks(key)
        if self.kind == "fs":
            return self.backend.contains(key) and not self.backend.exists_in_put_tasks(key)
        return self.backend.contains(key) and not self.backend.exists_in_put_tasks(key)

    def close(self) -> bool:
        return close_engine(self.eng)


class LMCacheArm(Arm):
    kind = "lmcache"

    def __init__(self, host: LMCacheHost, cold: bool | None) -> None:
        self.host, self.cold, self.n = host, cold, host.n
        if host.kind == "s3":
            self.tier, self.name = "s3", "lmc-s3"
            self.expected = host.ds.expected_s3
        else:
            self.tier = "disk-cold" if cold else "disk-warm"
            self.name = f"lmc-{host.kind}-{'cold' if cold else 'warm'}"
            self.expected = host.ds.expected

    def before_batch(self, indices):
        if self.cold:
            drop_tree(self.host.dir)

    def fetch(self, indices):
        objs = self.host.backend.batched_get_blocking([self.host.keys[i] for i in indices])
        if any(o is None for o in objs):
            self.release(objs)
            raise RuntimeError(f"{self.name}: backend returned a miss")
        return objs


# --- measuring ----------------------------------------------------------------------------------
def batch_indices(n: int, batch: int, rep: int) -> list[int]:
    return [(rep * batch + j) % n for j in range(batch)]


def verify(arm: Arm, indices, objs) -> None:
    for i, o in zip(indices, objs):
        if not torch.equal(obj_bytes(o), arm.expected(i)):
            raise AssertionError(f"{arm.name}: chunk {i} bytes differ from the packed chunk")


def measure(arm: Arm, batch: int, reps: int, chunk_bytes: int, check: bool = True) -> dict:
    times = []
    for r in range(reps):
        idx = batch_indices(arm.n, batch, r)
        arm.before_batch(idx)
        t0 = time.perf_counter()
        objs = arm.fetch(idx)
        dt = time.perf_counter() - t0
        try:
            if check and r == 0:
                verify(arm, idx, objs)
        finally:
            arm.release(objs)
        times.append(dt)
    per_chunk_ms = [1e3 * t / batch for t in times]
    med = percentile(times, 50)
    return {"batch": batch, "reps": reps, "chunk_bytes": chunk_bytes,
            "p50_ms": percentile(per_chunk_ms, 50), "p95_ms": percentile(per_chunk_ms, 95),
            "p99_ms": percentile(per_chunk_ms, 99), "min_ms": min(per_chunk_ms),
            "gbps": batch * chunk_bytes / med / 1e9,
            "gbps_best": batch * chunk_bytes / min(times) / 1e9,
            "verified": bool(check)}


def run_arm(arm: Arm, batches, reps_for, chunk_bytes, log, check=True, warm=True) -> dict:
    out = {"arm": arm.name, "kind": arm.kind, "tier": arm.tier, "results": []}
    try:
        if warm:
            arm.prepare()
        for b in batches:
            if b > arm.n:
                continue
            res = measure(arm, b, reps_for(b), chunk_bytes, check)
            out["results"].append(res)
            log(f"    {arm.name:22s} batch {b:3d}: p50 {res['p50_ms']:9.3f} ms/chunk  "
                f"p99 {res['p99_ms']:9.3f}  {res['gbps']:7.2f} GB/s")
    except Exception as e:  # keep the rest of the run
        out["error"] = f"{type(e).__name__}: {e}"
        log(f"    {arm.name}: ERROR {out['error']}")
    return out


# --- lookup -------------------------------------------------------------------------------------
def measure_lookup(plugin, token_ids: Sequence[int], iters: int) -> dict:
    keys = plugin.mapper.keys(token_ids)
    n = len(keys)
    t0 = time.perf_counter()
    plugin.mapper.keys(token_ids)
    t_keys = time.perf_counter() - t0
    assert plugin.batched_contains(keys) == n
    res = {}
    for pin in (False, True):
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(iters):
                plugin.batched_contains(keys, pin=pin)
            dt = time.perf_counter() - t0
            best.append(dt / iters / n * 1e6)
            if pin:
                for k in keys:
                    for _ in range(iters):
                        plugin.unpin(k)
        res["pin" if pin else "no_pin"] = {"us_per_key_median": percentile(best, 50),
                                           "us_per_key_min": float(min(best))}
    return {"keys": n, "tokens": len(token_ids), "iters": iters, **res,
            "lmcache_key_hashing_ms_for_prompt": t_keys * 1e3}


# --- LMCache S3 connector: child process in a private mount namespace --------------------------
# --- moto ---------------------------------------------------------------------------------------
def start_moto(in_process: bool = False):
    """(stop, endpoint URL, port): moto in its own process (default), or in this one's threads."""
    if not in_process:
        proc, url = moto_process()
        return proc.kill, url, int(url.rsplit(":", 1)[1])
    stack = contextlib.ExitStack()
    url = stack.enter_context(moto_thread())
    return stack.close, url, int(url.rsplit(":", 1)[1])


def upload_s3(ds: Dataset, endpoint: str) -> None:
    client = s3_client(endpoint)
    for i, d in enumerate(ds.s3_dirs):
        upload_dir(client, S3_BUCKET, f"{ds.shape.name}/c{i}", d)

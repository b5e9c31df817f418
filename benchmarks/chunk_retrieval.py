"""Chunk retrieval microbenchmark: our tiers vs the raw limits vs LMCache's built-in backends.

    .venv/bin/python benchmarks/chunk_retrieval.py [--quick] [--out DIR] [--shapes a,b]

What is measured (one 256-token chunk of synthetic random bf16 KV per chunk, real model shapes):

- ours: `CartridgeStoragePlugin.batched_get_blocking(keys)` of a real LMCacheEngine whose
  StorageManager loaded the plugin from YAML, so every chunk lands in LocalCPUBackend allocator
  memory. Tiers: `ours-cpu` (plugin CPU tier warm), `ours-disk-warm` (local packed origin,
  cpu_budget_gb 0, page cache warm), `ours-disk-cold` (same, kv.bin pages dropped with
  POSIX_FADV_DONTNEED before every batch), `ours-s3` (S3 origin on a loopback moto server,
  cpu_budget_gb 0 and disk_budget_gb 0 so every read is a ranged GET).
- limits, into buffers allocated from the same LocalCPUBackend: `limit-memcpy` (torch copy of the
  same bytes), `limit-read-warm`/`limit-read-cold` (os.preadv of the same kv.bin ranges),
  `limit-boto3` (plain boto3 ranged GET of the same object range, readinto, sequential).
- LMCache 0.5.6 built-ins serving the same chunks (same keys, same bytes, stored through the
  backend's own put then LocalCPUBackend cleared): `lmc-localdisk-warm/-cold` (LocalDiskBackend),
  `lmc-fs-warm/-cold` (RemoteBackend + fs connector, remote_url fs://localhost:0/abs/path),
  `lmc-s3` (RemoteBackend + awscrt S3 connector, virtual-hosted `s3://bucket.host:port`, run in a
  child process in a private mount namespace with a bind-mounted /etc/hosts).
- lookup: `plugin.batched_contains(keys)` for a 16K-token prompt (64 keys), us per key.

Timing: each sample is one `fetch(batch)` call (allocation included, release excluded). Per-chunk
latency = call time / batch size (amortised); p50/p99 over samples; throughput = bytes / call
time, reported at the median call (GB = 1e9 bytes). The first batch of every arm is checked
byte-for-byte against the packed chunk. moto runs in its own process (`_common.moto_process`;
`--moto-thread` puts it in this process's threads, as runs before 2026-11-23 did, where it took
the GIL from the client it served). On 2 cores it still competes for CPU: S3 numbers measure moto
as much as the client; compare ours with `limit-boto3` taken against the same server in the same
run.

S3 layout note: moto answers a ranged GET by copying the whole object and slicing it, so one
ranged GET from a many-chunk kv.bin costs O(object) on moto (not on real S3). The S3 arms
therefore use one-chunk cartridges (one kv.bin object per chunk), the same object-per-chunk
layout LMCache's S3 connector uses.

Every arm is a small class with `fetch(indices) -> list[MemoryObj]` and `release(objs)`, so
`tests/test_bench_chunk_retrieval.py` checks their bytes at tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # before lmcache is imported
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import numpy as np  # noqa: E402
import torch  # noqa: E402

CHUNK = 256
MODEL = "bench-model"
GiB = 1 << 30
S3_BUCKET = "lmc-bench"              # our cartridges (path-style) and LMCache's S3 connector
S3_VHOST = "s3bench.test"            # virtual host suffix resolved in the child's namespace
DUMMY_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
             "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_EC2_METADATA_DISABLED": "true",
             "AWS_CONFIG_FILE": "/nonexistent/aws-config-bench",
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
    from lmc_helpers import make_metadata

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
    from lmc_helpers import Engine

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
        from s3_server import s3_client

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
    t = np.array(times)
    per_chunk = t / batch
    med = float(np.median(t))
    return {"batch": batch, "reps": reps, "chunk_bytes": chunk_bytes,
            "p50_ms": float(np.percentile(per_chunk, 50) * 1e3),
            "p99_ms": float(np.percentile(per_chunk, 99) * 1e3),
            "min_ms": float(per_chunk.min() * 1e3),
            "gbps": batch * chunk_bytes / med / 1e9,
            "gbps_best": batch * chunk_bytes / float(t.min()) / 1e9,
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
        res["pin" if pin else "no_pin"] = {"us_per_key_median": float(np.median(best)),
                                           "us_per_key_min": float(min(best))}
    return {"keys": n, "tokens": len(token_ids), "iters": iters, **res,
            "lmcache_key_hashing_ms_for_prompt": t_keys * 1e3}


# --- LMCache S3 connector: child process in a private mount namespace --------------------------
def lmc_s3_child_main(spec_path: str) -> None:
    """Entry point of the child: build the S3-connector engine, store, measure, write JSON."""
    spec = json.loads(Path(spec_path).read_text())
    set_dummy_aws_env()
    shape = SHAPES[spec["shape"]] if spec["shape"] in SHAPES else Shape(**spec["shape_def"])
    ds = Dataset(shape, spec["n"], Path(spec["local_dir"]), spec["token_ids"], spec["n_s3"],
                 [Path(p) for p in spec["s3_dirs"]], spec["s3_token_ids"])
    result: dict[str, Any] = {"arm": "lmc-s3", "kind": "lmcache", "tier": "s3", "results": []}
    try:
        host = LMCacheHost(ds, Path(spec["workdir"]), "s3", spec["alloc_gb"], s3_url=spec["s3_url"])
        arm = LMCacheArm(host, None)
        reps = {int(k): v for k, v in spec["reps"].items()}
        result = run_arm(arm, spec["batches"], lambda b: reps[b], shape.chunk_bytes,
                         lambda s: print(s, flush=True), check=True, warm=spec.get("warm", True))
    except Exception as e:
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    Path(spec["out"]).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # never wait on RemoteBackend teardown


def run_lmc_s3(ds: Dataset, workdir: Path, moto_port: int, batches, reps: dict[int, int],
               alloc_gb: float, timeout: float = 600.0, warm: bool = True) -> dict:
    """Run the LMCache S3-connector arm in `unshare --mount` with a bind-mounted hosts file."""
    na = {"arm": "lmc-s3", "kind": "lmcache", "tier": "s3", "results": []}
    if shutil.which("unshare") is None:
        return {**na, "error": "n/a: `unshare` not found (needed to resolve the virtual host)"}
    hosts = workdir / "hosts-lmc-s3"
    vhost = f"{S3_BUCKET}.{S3_VHOST}"
    hosts.write_text(Path("/etc/hosts").read_text() + f"\n127.0.0.1 {vhost}\n")
    out = workdir / f"lmc-s3-{ds.shape.name}.json"
    out.unlink(missing_ok=True)
    spec = {"shape": ds.shape.name, "shape_def": asdict(ds.shape), "n": ds.n,
            "local_dir": str(ds.local_dir), "token_ids": ds.token_ids, "n_s3": ds.n_s3,
            "s3_dirs": [str(p) for p in ds.s3_dirs], "s3_token_ids": ds.s3_token_ids,
            "workdir": str(workdir), "alloc_gb": alloc_gb, "s3_url": f"s3://{vhost}:{moto_port}",
            "batches": list(batches), "reps": {str(k): v for k, v in reps.items()},
            "out": str(out), "warm": warm}
    spec_path = workdir / f"lmc-s3-{ds.shape.name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    inner = (f"mount --bind {hosts} /etc/hosts && exec {sys.executable} {Path(__file__).resolve()} "
             f"--child-lmc-s3 {spec_path}")
    try:
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
                           capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return {**na, "error": f"n/a: child timed out after {timeout:.0f}s"}
    if p.returncode != 0 or not out.exists():
        tail = (p.stderr or p.stdout or "")[-800:]
        return {**na, "error": f"n/a: child exited {p.returncode}: {tail.strip()}"}
    res = json.loads(out.read_text())
    res["log"] = p.stdout[-2000:]
    return res


# --- moto ---------------------------------------------------------------------------------------
def start_moto(in_process: bool = False):
    """(stop, endpoint URL, port): moto in its own process (default), or in this one's threads."""
    if not in_process:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import _common

        proc, url = _common.moto_process()
        return proc.kill, url, int(url.rsplit(":", 1)[1])
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server.stop, f"http://{host}:{port}", int(port)


def upload_s3(ds: Dataset, endpoint: str) -> None:
    from s3_server import s3_client, upload_dir

    client = s3_client(endpoint)
    for i, d in enumerate(ds.s3_dirs):
        upload_dir(client, S3_BUCKET, f"{ds.shape.name}/c{i}", d)


# --- the run ------------------------------------------------------------------------------------
@dataclass
class Plan:
    shapes: list[str]
    local_cap_bytes: int          # max bytes of chunks per shape (local arms, one batch at most)
    s3_cap_bytes: int
    batches: list[int]
    reps: dict[int, int]
    lookup_iters: int


def plan_for(quick: bool, shapes: Optional[list[str]]) -> Plan:
    if quick:
        return Plan(shapes or ["tiny", "llama3.1-8b"], 256 << 20, 128 << 20, [1, 8, 64],
                    {1: 8, 8: 3, 64: 2}, 200)
    return Plan(shapes or ["tiny", "qwen2.5-7b", "llama3.1-8b", "llama2-7b-mha"], 2 * GiB, 512 << 20,
                [1, 8, 64], {1: 24, 8: 8, 64: 4}, 2000)


def batches_for(n: int, batches: list[int]) -> list[int]:
    out = [b for b in batches if b <= n]
    if n not in out and n < max(batches):
        out.append(n)  # the memory cap: the largest batch that fits
    return sorted(set(out))


def machine_info() -> dict:
    info = {"python": sys.version.split()[0], "platform": platform.platform(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    try:
        import lmcache

        info["lmcache"] = getattr(lmcache, "__version__", "0.5.6")
    except Exception:
        pass
    try:
        info["mem_total_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1)
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except Exception:
        pass
    return info


def run_shape(shape: Shape, plan: Plan, workdir: Path, moto_url: str, moto_port: int, log) -> dict:
    n = max(1, min(64, plan.local_cap_bytes // shape.chunk_bytes))
    n_s3 = max(1, min(64, plan.s3_cap_bytes // shape.chunk_bytes))
    batches = batches_for(n, plan.batches)
    s3_batches = batches_for(n_s3, plan.batches)
    reps = lambda b: plan.reps.get(b, max(2, plan.reps[min(plan.reps, key=lambda k: abs(k - b))]))  # noqa: E731
    log(f"== {shape.name}: {shape.chunk_bytes / (1 << 20):.2f} MiB/chunk, {n} local chunks "
        f"(batches {batches}), {n_s3} S3 chunks (batches {s3_batches})")
    t0 = time.time()
    ds = build_dataset(shape, n, n_s3, workdir, seed=len(shape.name))
    upload_s3(ds, moto_url)
    log(f"   data packed and uploaded in {time.time() - t0:.1f}s")
    alloc = alloc_gb_for(shape, n)
    arms: list[dict] = []
    cb = shape.chunk_bytes

    # ours: CPU tier (budget holds every chunk), then the limits on the same allocator
    host = PluginHost(ds, workdir, name=f"{shape.name}-ours-cpu", cpu_gb=(n * cb * 1.1) / GiB + 0.01,
                      disk_gb=0, alloc_gb=alloc)
    try:
        arms.append(run_arm(OursArm(host, "cpu"), batches, reps, cb, log))
        mc = MemcpyLimit(ds, host.allocator)
        arms.append(run_arm(mc, batches, reps, cb, log, warm=False))
        mc.close()
        mm = MemmoveLimit(ds, host.allocator)
        arms.append(run_arm(mm, batches, reps, cb, log, warm=False))
        mm.close()
        for cold in (False, True):
            rl = ReadLimit(ds, host.allocator, cold)
            arms.append(run_arm(rl, batches, reps, cb, log, warm=not cold))
            rl.close()
        bl = Boto3Limit(ds, host.allocator, moto_url)
        arms.append(run_arm(bl, s3_batches, reps, cb, log))
    finally:
        host.close()
    # ours: disk (local origin, CPU tier off)
    host = PluginHost(ds, workdir, name=f"{shape.name}-ours-disk", cpu_gb=0, disk_gb=0, alloc_gb=alloc)
    try:
        arms.append(run_arm(OursArm(host, "disk-warm"), batches, reps, cb, log))
        arms.append(run_arm(OursArm(host, "disk-cold"), batches, reps, cb, log, warm=False))
    finally:
        host.close()
    # ours: S3 origin, CPU and disk tiers off
    host = PluginHost(ds, workdir, name=f"{shape.name}-ours-s3", cpu_gb=0, disk_gb=0, alloc_gb=alloc,
                      s3_endpoint=moto_url)
    try:
        arms.append(run_arm(OursArm(host, "s3"), s3_batches, reps, cb, log))
    finally:
        host.close()
    # LMCache built-ins
    for kind in ("localdisk", "fs"):
        try:
            t1 = time.time()
            lh = LMCacheHost(ds, workdir, kind, alloc)
            log(f"   lmc-{kind}: stored {lh.n} chunks in {time.time() - t1:.1f}s")
        except Exception as e:
            arms.append({"arm": f"lmc-{kind}-warm", "kind": "lmcache", "tier": "disk-warm", "results": [],
                         "error": f"n/a: {type(e).__name__}: {e}"})
            continue
        try:
            arms.append(run_arm(LMCacheArm(lh, False), batches, reps, cb, log))
            arms.append(run_arm(LMCacheArm(lh, True), batches, reps, cb, log, warm=False))
        finally:
            if not lh.close():
                log(f"   lmc-{kind}: engine teardown hung (left behind, bounded at 20s)")
            shutil.rmtree(lh.dir, ignore_errors=True)
    res = run_lmc_s3(ds, workdir, moto_port, s3_batches, {b: reps(b) for b in s3_batches}, alloc)
    for line in (res.pop("log", "") or "").splitlines():
        log("  " + line)
    if res.get("error"):
        log(f"    lmc-s3: {res['error']}")
    arms.append(res)
    # free the disk space of this shape
    for d in [ds.local_dir, *ds.s3_dirs]:
        shutil.rmtree(d, ignore_errors=True)
    return {"shape": asdict(shape), "chunk_bytes": cb, "n_local": n, "n_s3": n_s3, "batches": batches,
            "s3_batches": s3_batches, "arms": arms}


def run_lookup(workdir: Path, iters: int, log) -> dict:
    shape = SHAPES["tiny"]
    ds = build_dataset(shape, 64, 0, workdir, seed=99)
    host = PluginHost(ds, workdir, name="lookup", cpu_gb=0.05, disk_gb=0, alloc_gb=0.05)
    try:
        res = measure_lookup(host.plugin, ds.token_ids, iters)
    finally:
        host.close()
    log(f"== lookup: {res['keys']} keys ({res['tokens']} tokens): "
        f"{res['no_pin']['us_per_key_median']:.2f} us/key, pinned {res['pin']['us_per_key_median']:.2f} us/key")
    shutil.rmtree(ds.local_dir, ignore_errors=True)
    return res


# --- reporting ----------------------------------------------------------------------------------
LIMIT_FOR = {"cpu": "limit-memcpy", "disk-warm": "limit-read-warm", "disk-cold": "limit-read-cold",
             "s3": "limit-boto3"}
# limit-memmove (libc memmove) is reported in the all-arms table: on this 2-core VM torch's
# 2-thread copy_ is ~6x slower than a single memmove, so it is the truer floor.
LMC_FOR = {"cpu": None, "disk-warm": "lmc-localdisk-warm", "disk-cold": "lmc-localdisk-cold",
           "s3": "lmc-s3"}
TARGET = {"cpu": (0.9, None), "disk-warm": (0.8, 1.0), "disk-cold": (None, None), "s3": (0.9, 1.0)}


def _result(arms, name, batch):
    for a in arms:
        if a["arm"] == name:
            for r in a.get("results", []):
                if r["batch"] == batch:
                    return r
            return {"error": a.get("error")} if a.get("error") else None
    return None


def markdown(report: dict) -> str:
    moto_note = next((n for n in report.get("notes", []) if n.startswith("moto runs")), "moto")
    lines = ["# Chunk retrieval benchmark", "",
             f"mode: {report['mode']}; machine: {report['machine'].get('cpu', '?')}, "
             f"{report['machine']['cpus']} cpus, {report['machine'].get('mem_total_gib')} GiB; "
             f"torch {report['machine']['torch']} ({report['machine']['torch_threads']} threads); "
             f"elapsed {report['elapsed_s']:.0f}s", "",
             "Per-chunk latency = batch call time / batch (amortised), p50 (p99) over samples; GB/s at the "
             "median call. x-limit = ours/limit throughput, x-LMCache = ours/LMCache built-in. "
             f"S3 is a moto server on loopback ({moto_note}); "
             "S3 arms use one object per chunk.", ""]
    lines += ["| shape | tier | batch | ours ms/chunk p50 (p99) | ours GB/s | limit | limit GB/s | x-limit | "
              "LMCache | LMCache GB/s | x-LMCache |",
              "|---|---|---:|---:|---:|---|---:|---:|---|---:|---:|"]
    for s in report["shapes"]:
        arms = s["arms"]
        for tier in ("cpu", "disk-warm", "disk-cold", "s3"):
            bs = s["s3_batches"] if tier == "s3" else s["batches"]
            for b in bs:
                ours = _result(arms, f"ours-{tier}", b)
                if ours is None:
                    continue
                lim_name, lmc_name = LIMIT_FOR[tier], LMC_FOR[tier]
                lim = _result(arms, lim_name, b)
                lmc = _result(arms, lmc_name, b) if lmc_name else None

                def g(r):
                    if r is None:
                        return "-"
                    if "gbps" not in r:
                        return (r.get("error") or "n/a")[:60]
                    return f"{r['gbps']:.2f}"

                def ratio(a, r):
                    if a is None or r is None or "gbps" not in a or "gbps" not in r:
                        return "-"
                    return f"{a['gbps'] / r['gbps']:.2f}"

                if "gbps" not in ours:
                    lines.append(f"| {s['shape']['name']} | {tier} | {b} | {ours.get('error')} | | | | | | | |")
                    continue
                lines.append(
                    f"| {s['shape']['name']} | {tier} | {b} | {ours['p50_ms']:.3f} ({ours['p99_ms']:.3f}) | "
                    f"{ours['gbps']:.2f} | {lim_name} | {g(lim)} | {ratio(ours, lim)} | "
                    f"{lmc_name or '-'} | {g(lmc)} | {ratio(ours, lmc)} |")
    cols = sorted({r["batch"] for s in report["shapes"] for a in s["arms"] for r in a.get("results", [])})
    lines += ["", "All arms (GB/s by batch; '-' = batch not run for that arm):", "",
              "| shape | arm | " + " | ".join(f"b={b}" for b in cols) + " |",
              "|---|---|" + "---:|" * len(cols)]
    for s in report["shapes"]:
        for a in s["arms"]:
            cells = []
            for b in cols:
                r = _result(s["arms"], a["arm"], b)
                cells.append("-" if r is None else (f"{r['gbps']:.2f}" if "gbps" in r else "n/a"))
            err = f" ({a['error'][:120]})" if a.get("error") else ""
            lines.append(f"| {s['shape']['name']} | {a['arm']}{err} | " + " | ".join(cells) + " |")
    lk = report.get("lookup")
    if lk:
        lines += ["", f"Lookup: `batched_contains` over {lk['keys']} keys ({lk['tokens']}-token prompt): "
                  f"{lk['no_pin']['us_per_key_median']:.2f} us/key (pin=True: {lk['pin']['us_per_key_median']:.2f} "
                  f"us/key); LMCache's own key hashing of the prompt: "
                  f"{lk['lmcache_key_hashing_ms_for_prompt']:.1f} ms."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = report["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 5), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        names = [a["arm"] for a in s["arms"] if a.get("results")]
        all_b = sorted({r["batch"] for a in s["arms"] for r in a.get("results", [])})
        width = 0.8 / max(1, len(all_b))
        for j, b in enumerate(all_b):
            vals = []
            for nm in names:
                r = _result(s["arms"], nm, b)
                vals.append(r["gbps"] if r and "gbps" in r else 0.0)
            ax.bar(np.arange(len(names)) + j * width, vals, width, label=f"batch {b}")
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2)
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("GB/s")
        ax.set_title(f"{s['shape']['name']} ({s['chunk_bytes'] / (1 << 20):.2f} MiB/chunk)")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer/smaller shapes and repetitions (< 2 min)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--shapes", default=None, help=f"comma list of {','.join(SHAPES)}")
    ap.add_argument("--workdir", default=None, help="scratch dir for packed data (default: a temp dir)")
    ap.add_argument("--child-lmc-s3", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--moto-thread", action="store_true",
                    help="run moto in this process's threads (the old setup) instead of its own process")
    args = ap.parse_args(argv)
    if args.child_lmc_s3:
        lmc_s3_child_main(args.child_lmc_s3)
        return 0
    import logging

    logging.getLogger("lmcache").setLevel(logging.WARNING)
    set_dummy_aws_env()
    plan = plan_for(args.quick, args.shapes.split(",") if args.shapes else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir) if args.workdir else \
        Path(tempfile.mkdtemp(prefix="chunk-bench-", dir=os.environ.get("TMPDIR", "/tmp")))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("LMCACHE_CARTRIDGE_HOME", str(workdir / "home"))
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    stop_moto, moto_url, moto_port = start_moto(in_process=args.moto_thread)
    from s3_server import s3_client

    s3_client(moto_url).create_bucket(Bucket=S3_BUCKET)
    report: dict[str, Any] = {"mode": "quick" if args.quick else "full", "machine": machine_info(),
                              "plan": {**asdict(plan), "reps": {str(k): v for k, v in plan.reps.items()}},
                              "notes": [
                                  "per-chunk latency = batch call time / batch size; p50/p99 over samples",
                                  "GB = 1e9 bytes; throughput at the median call",
                                  "local arms: batch capped so a batch is <= local_cap_bytes; "
                                  "S3 arms: <= s3_cap_bytes (moto speed and memory)",
                                  ("moto runs in this process's threads (GIL shared with the client)"
                                   if args.moto_thread
                                   else "moto runs in its own process (shares the 2 cores, not the GIL)"),
                                  "S3 arms use one object per chunk (moto copies the whole object per ranged GET)",
                                  "ours-s3 runs with cpu_budget_gb 0 and disk_budget_gb 0 (every read is a GET)",
                              ], "shapes": []}
    try:
        report["lookup"] = run_lookup(workdir, plan.lookup_iters, log)
        for name in plan.shapes:
            report["shapes"].append(run_shape(SHAPES[name], plan, workdir, moto_url, moto_port, log))
            report["elapsed_s"] = time.time() - t_start
            (out / "chunk_retrieval.json").write_text(json.dumps(report, indent=1))
    finally:
        report["elapsed_s"] = time.time() - t_start
        (out / "chunk_retrieval.json").write_text(json.dumps(report, indent=1))
        if report["shapes"]:
            (out / "chunk_retrieval.md").write_text(markdown(report))
            try:
                plot(report, out / "chunk_retrieval.png")
            except Exception as e:
                log(f"plot failed: {e}")
        stop_moto()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    log(f"wrote {out / 'chunk_retrieval.json'}, .md, .png")
    print((out / "chunk_retrieval.md").read_text())
    sys.stdout.flush()
    os._exit(0)  # engines' background threads (and any hung RemoteBackend) must not keep us alive


if __name__ == "__main__":
    sys.exit(main())

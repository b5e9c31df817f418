"""A prefix's KV computed by the serving engine itself: vLLM prefills the tokens and LMCache's own
store path writes the KV out; we read it back in the project's canonical layout.

Why: a first-k cartridge stands for its document, so served it must give the answer vLLM gives
the plain prompt. KV computed by another implementation (HF transformers, eager bf16) differs in
rounding from vLLM's kernels, and on a real model as on the peaked test model that flips greedy
tokens (seen: a different answer on SmolLM2, and |dlogprob| 0.72 on AVX2 machines). The engine's
own KV, stored by LMCache and loaded back by LMCache, is the bytes a plain prefill leaves in the
paged cache, so the cartridge answers exactly as the prompt does on that machine and engine
build (the KV is computed where the cartridge will be served: run `create` there).

How: a private vLLM server (`tools.vllm_process.VllmProcess`: the same command line the demo, tests
and benchmarks use) with `CartridgeConnector` and LMCache configured with its CPU cache and
LMCache's `LocalDiskBackend` under a private directory (`save_unfull_chunk` on, so the last,
partial chunk is stored too). One completion of the tokens with `max_tokens=1`, tagged with a
fresh LMCache request tag (`lmcache.tag.*`, part of LMCache's keys); LMCache stores
each chunk as a `KV_2LTD` object (`[2, L, t, H*D]`: with a disk backend the CPU glue never
declares engine blocks, `vllm.connector.why_not_engine_blocks`), and `LocalDiskBackend` writes
its raw bytes to `<key>.pt`. Chunks are matched to files by the tag and LMCache's own chunk hashes
(`cartridge.keys.ChunkKeyMapper`, the same `ChunkedTokenDatabase` the engine ran), every file's
size is checked against the geometry, and the chunks are concatenated.

Runs offline in the caller's process (the `create` command, tests, the demo); the server is a
child process group it owns and stops; the disk directory is the caller's `work_dir`.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import torch

from lmcache_cartridge.tools.vllm_process import START_TIMEOUT_S

from lmcache_cartridge.errors import CartridgeFormatError

CHUNK = 256
HASH = "sha256_cbor"
TAG = "lmcache_cartridge_make"  # LMCache request tag (part of its keys) of the maker's requests
_requests = itertools.count()
logger = logging.getLogger(__name__)


class EngineKVMaker:
    """One private vLLM server that computes prefixes' KV for one model; reuse it for several
    cartridges (start-up is most of the cost). Use as a context manager."""

    def __init__(self, model_dir: str | Path, work_dir: str | Path, *, max_model_len: int | None = None,
                 threads_bind: str = "0-1", kv_cache_gb: int = 1, disk_gb: float = 4.0) -> None:
        self.model_dir = str(Path(model_dir).resolve())  # the server runs in another directory
        self.work = Path(work_dir).resolve()
        self.disk = self.work / "lmcache-disk"
        self.config: dict[str, Any] = {
            "chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 1,
            "local_disk": f"file://{self.disk}/", "max_local_disk_size": disk_gb,
            "save_unfull_chunk": True, "pre_caching_hash_algorithm": HASH,
        }
        self.max_model_len = max_model_len  # None: fitted to the first prefix (at least 2048)
        self.threads_bind, self.kv_cache_gb = threads_bind, kv_cache_gb
        self.server = None  # started by `start` or the first `prefix_kv`
        self.relaunches = 0  # servers replaced after they exited (`start`)
        self._geometry = None
        self._mapper = None

    def __enter__(self) -> "EngineKVMaker":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def launch(self) -> "EngineKVMaker":
        """Start the private server (once) without waiting for it: callers with other servers to
        start let them all come up together."""
        if self.server is None:
            from lmcache_cartridge.tools.vllm_process import VllmProcess, side_server_gpu_args

            self.disk.mkdir(parents=True, exist_ok=True)
            self.max_model_len = self.max_model_len or 2048
            self.server = VllmProcess(self.work / "vllm", self.model_dir, lmcache=self.config,
                                     max_model_len=self.max_model_len, threads_bind=self.threads_bind,
                                     kv_cache_gb=self.kv_cache_gb,
                                     extra_args=side_server_gpu_args(self.kv_cache_gb))
        return self

    def start(self, timeout: float = START_TIMEOUT_S) -> "EngineKVMaker":
        """Start the private server (once) and wait until it is healthy.

        A server that has exited (crashed after serving, or failed while starting) is replaced by
        a new one, once per call: the maker is long-lived (a test session's, a `create` run's
        several cartridges), and a dead server kept would fail every later prefix with the first
        failure's message (one failed engine start would fail every later user of the maker). A
        second failure in a row is raised, with the log's first error."""
        try:  # a server already dead raises here at once, as one that dies while starting does
            self.launch().server.wait_healthy(timeout=timeout)
        except RuntimeError:  # it exited (a timeout is a TimeoutError: not retried)
            self._replace_dead_server()
            self.launch().server.wait_healthy(timeout=timeout)
        return self

    def _replace_dead_server(self) -> None:
        old = self.server
        logger.warning("the KV maker's vLLM server exited with %s (log %s); starting a new one. "
                       "Its log's first error:\n%s", old.proc.returncode, old.log_path, old.failure_report(40, 10))
        self.relaunches += 1
        self.stop()

    def stop(self) -> None:
        """Stop the server; a later `prefix_kv` starts a new one."""
        if self.server is not None:
            self.server.stop()
            self.server = None

    def describe(self) -> dict[str, Any]:
        """What computed the KV, for a cartridge's provenance (the version as the server reports it)."""
        from lmcache_cartridge.vllm.cpu_kv import current_attn_isa

        version = None
        if self.server is not None:
            try:
                with urllib.request.urlopen(self.server.url + "/version", timeout=10) as r:
                    version = json.load(r).get("version")
            except (OSError, ValueError):  # recorded as unknown (None): provenance, not a check
                pass
        out = {"engine": "vllm", "vllm_version": version, "dtype": "bfloat16",
               "device": "cuda" if torch.cuda.is_available() else "cpu"}
        if out["device"] == "cpu":
            g = self._geo()
            out["cpu_attn_isa"] = current_attn_isa(torch.bfloat16, 128, g.head_dim)
        return out

    def _geo(self):
        if self._geometry is None:
            from transformers import AutoConfig

            from lmcache_cartridge.cartridge.model_kv import kv_geometry

            self._geometry = kv_geometry(AutoConfig.from_pretrained(self.model_dir))
        return self._geometry

    def _chunk_ranges(self, token_ids: Sequence[int]) -> list[tuple[int, int, str]]:
        """(start, end, chunk hash hex) of every chunk LMCache stores for `token_ids`."""
        if self._mapper is None:
            from lmcache.v1.config import LMCacheEngineConfig
            from lmcache.v1.metadata import LMCacheMetadata

            from lmcache_cartridge.cartridge.keys import ChunkKeyMapper, vllm_seeds_every_hash_randomly
            from lmcache_cartridge.tools.vllm_process import SHARED_HASH_SEED

            if vllm_seeds_every_hash_randomly():
                # the server's seed (`server_environment`): vLLM reads it when LMCache's token
                # database initialises NONE_HASH, just below; without it the keys are random here
                os.environ.setdefault("PYTHONHASHSEED", SHARED_HASH_SEED)

            g = self._geo()
            config = LMCacheEngineConfig.from_dict({k: self.config[k] for k in (
                "chunk_size", "save_unfull_chunk", "pre_caching_hash_algorithm")})
            metadata = LMCacheMetadata(
                model_name=self.model_dir, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                kv_dtype=torch.bfloat16, chunk_size=CHUNK,
                kv_shape=(g.num_layers, 2, CHUNK, g.num_kv_heads, g.head_dim))
            self._mapper = ChunkKeyMapper(config, metadata)
        return [(s, e, k.chunk_hash_hex) for s, e, k in self._mapper.chunk_ranges(list(token_ids))]

    def _files_by_hash(self, tag: str) -> dict[str, Path]:
        """LocalDiskBackend's files of the request tagged `tag`, by chunk hash."""
        from lmcache.utils import CacheEngineKey

        out = {}
        for p in self.disk.rglob("*.pt"):
            try:
                key = CacheEngineKey.from_string(p.name[:-3])
            except (ValueError, IndexError):
                continue
            if (TAG, tag) in (key.tags or ()):
                out[key.chunk_hash_hex] = p
        return out

    def prefix_kv(self, token_ids: Sequence[int], *, timeout: float = 600) -> torch.Tensor:
        """`[2, L, T, H, D]` bf16: the KV vLLM computed for `token_ids` (T of them), read back
        from LMCache's disk store. Raises CartridgeFormatError when vLLM refuses the prompt or
        LMCache does not store every chunk in `timeout`."""
        ids = [int(t) for t in token_ids]
        if len(ids) < 2:
            raise CartridgeFormatError("a cartridge needs at least two tokens")
        if self.server is None and self.max_model_len is None:
            self.max_model_len = max(2048, -(-(len(ids) + 1) // 256) * 256)
        self.start()  # launched by `launch` (or not yet): wait until it is healthy
        if len(ids) >= self.max_model_len:
            raise CartridgeFormatError(f"{len(ids)} tokens do not fit the KV maker's max_model_len "
                                       f"{self.max_model_len}")
        # A tag of its own: LMCache's keys then differ from every earlier request's, so no chunk
        # is a hit (a hit is not stored again) and every chunk of this prefix is written anew.
        tag = f"{os.getpid()}-{next(_requests)}"
        body = {"model": self.model_dir, "prompt": ids, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {f"lmcache.tag.{TAG}": tag}}
        req = urllib.request.Request(self.server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                json.load(r)
        except urllib.error.HTTPError as e:
            raise CartridgeFormatError(f"vLLM refused the prefix: HTTP {e.code}: {e.read()[:300]!r}") from e
        g = self._geo()
        ranges = self._chunk_ranges(ids)
        if not ranges or ranges[-1][1] != len(ids):
            raise CartridgeFormatError("LMCache's chunking does not cover the prefix (save_unfull_chunk off?)")
        deadline = time.time() + timeout
        parts = []
        for start, end, h in ranges:
            want = 2 * g.num_layers * (end - start) * g.num_kv_heads * g.head_dim * 2  # bf16
            while True:
                path = self._files_by_hash(tag).get(h)
                if path is not None and path.stat().st_size == want:
                    break
                if path is not None and path.stat().st_size > want:
                    raise CartridgeFormatError(f"{path}: {path.stat().st_size} bytes, expected {want}: "
                                               "not a KV_2LTD chunk of this model")
                if time.time() > deadline or not self.server.alive():
                    raise CartridgeFormatError(
                        f"LMCache did not store tokens [{start}, {end}) in {timeout:.0f}s "
                        f"(server log {self.server.log_path}):\n{self.server.log_tail(20)}")
                time.sleep(0.05)
            flat = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.bfloat16)
            parts.append(flat.view(2, g.num_layers, end - start, g.num_kv_heads, g.head_dim))
        return torch.cat(parts, dim=2).contiguous()

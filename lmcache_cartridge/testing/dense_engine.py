"""Helpers that build LMCache's real engine on CPU for tests and benchmarks (no mocks of LMCache);
`tests/lmc_helpers.py` re-exports them for the tests.

`DenseKVConnector` is a real `GPUConnectorInterface` for a plain CPU KV buffer
`[2, L, num_slots, H*D]` addressed by `slot_mapping`: the simplest KV cache a serving engine
could have, so store/retrieve exercise LMCache's own code end to end.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from lmcache_cartridge.lmcache_compat import GPUConnectorInterface

_ids = itertools.count()


class DenseKVConnector(GPUConnectorInterface):
    def __init__(self, num_layers: int, hidden_dim: int) -> None:
        self.num_layers, self.hidden_dim = num_layers, hidden_dim

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim])

    def from_gpu(self, memory_obj, start, end, **kw):
        memory_obj.tensor.copy_(kw["kvcaches"][:, :, kw["slot_mapping"][start:end], :])

    def to_gpu(self, memory_obj, start, end, **kw):
        kw["kvcaches"][:, :, kw["slot_mapping"][start:end], :] = memory_obj.tensor

    def batched_from_gpu(self, memory_objs, starts, ends, **kw):
        for m, s, e in zip(memory_objs, starts, ends):
            self.from_gpu(m, s, e, **kw)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kw):
        for m, s, e in zip(memory_objs, starts, ends):
            self.to_gpu(m, s, e, **kw)


def make_metadata(*, model_name: str, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype = torch.bfloat16, chunk_size: int = 256,
                  world_size: int = 1, worker_id: int = 0, role: str | None = None):
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=model_name, world_size=world_size, local_world_size=world_size,
        worker_id=worker_id, local_worker_id=worker_id, kv_dtype=dtype,
        kv_shape=(num_layers, 2, chunk_size, num_kv_heads, head_dim), role=role,
        chunk_size=chunk_size,
    )


def make_config(**overrides: Any):
    from lmcache.v1.config import LMCacheEngineConfig

    base = {"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 0.5,
            "pre_caching_hash_algorithm": "sha256_cbor"}
    base.update(overrides)
    return LMCacheEngineConfig.from_dict(base)


class Engine:
    """A real LMCacheEngine with a dense CPU KV buffer; use as a context manager."""

    def __init__(self, config, metadata, num_slots: int = 4096) -> None:
        from lmcache_cartridge.lmcache_compat import LMCacheEngineBuilder

        self.instance_id = f"test-{next(_ids)}"
        L, H, D = metadata.kv_shape[0], metadata.kv_shape[3], metadata.kv_shape[4]
        self.kv = torch.zeros(2, L, num_slots, H * D, dtype=metadata.kv_dtype)
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.instance_id, config, metadata, DenseKVConnector(L, H * D), None, None)
        self.engine.post_init()

    @property
    def storage_manager(self):
        return self.engine.storage_manager

    def backend(self, name: str):
        return self.storage_manager.storage_backends.get(name)

    def store(self, token_ids, kv_2lthd_flat: torch.Tensor) -> None:
        n = len(token_ids)
        self.kv[:, :, :n] = kv_2lthd_flat
        self.engine.store(list(token_ids), kvcaches=self.kv, slot_mapping=torch.arange(n))

    def retrieve(self, token_ids, request_configs: dict | None = None) -> tuple[int, torch.Tensor]:
        """Retrieve into a fresh zeroed buffer; return (#tokens retrieved, buffer[:, :, :n])."""
        n = len(token_ids)
        self.kv.zero_()
        mask = self.engine.retrieve(list(token_ids), kvcaches=self.kv, slot_mapping=torch.arange(n),
                                    request_configs=request_configs)
        return int(mask.sum()), self.kv[:, :, :n].clone()

    def clear_local_cpu(self) -> None:
        cpu = self.backend("LocalCPUBackend")
        if cpu is not None:
            cpu.clear()

    def close(self) -> None:
        from lmcache_cartridge.lmcache_compat import LMCacheEngineBuilder

        LMCacheEngineBuilder.destroy(self.instance_id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def helpers_take_pieces(monkeypatch) -> None:
    """Make every split copy of `CpuPagedKVConnector` give its helper threads a piece: the calling
    thread's first piece waits (up to a second) until a helper has taken one. Which thread takes
    which piece is otherwise timing, and a test of bytes written by helpers must not depend on it."""
    import threading

    from lmcache_cartridge.vllm.cpu_kv import CpuPagedKVConnector

    run_rows = CpuPagedKVConnector._run_rows

    def gated_run_rows(self, copy, rows, nbytes):
        caller, helper_took, first = threading.get_ident(), threading.Event(), []

        def gated(part, team):
            if threading.get_ident() != caller:
                helper_took.set()
            elif not first and part.shape[0] < rows.shape[0]:  # a piece: the copy was split
                first.append(True)
                helper_took.wait(1.0)
            return copy(part, team)

        return run_rows(self, gated, rows, nbytes)

    monkeypatch.setattr(CpuPagedKVConnector, "_run_rows", gated_run_rows)

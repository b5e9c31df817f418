"""LMCache's real engine serving into vLLM-CPU-shaped caches, in this process, without vLLM: the
engine-block tests' and `benchmarks/hit_path.py`'s one way to build it.

What it is: an `LMCacheEngine` built by LMCache's own builder from the caller's config (the
cartridge plugin among its storage plugins) with `CpuPagedKVConnector`, the connector the vLLM
glue gives LMCache on vLLM's CPU backend. Its engine blocks are declared the way the glue
declares them once vLLM has registered its caches (`vllm.connector`): check the caches' layout,
ask `why_not_engine_blocks`, declare. A retrieve is what vLLM's `start_load_kv` asks of LMCache.

Where it runs: in the caller's thread; it owns its engine (one LMCacheEngineBuilder instance id
per object) until `close`.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch

from lmcache_cartridge.vllm.cpu_kv import CpuPagedKVConnector, EngineBlocks

_ids = itertools.count()


def private_engine_blocks(conn: CpuPagedKVConnector, caches: list[torch.Tensor]) -> Optional[EngineBlocks]:
    """`conn`'s engine-blocks encoder for caches like `caches` (their layout verified), kept on
    `conn` but not declared process-wide (`memory_layout`): for benchmarks and tests that encode
    memory objects themselves, beside connectors that must stay `KV_2LTD`. None as
    `declare_engine_blocks` says."""
    conn.check_layout(caches)
    blocks = conn.declare_engine_blocks()
    conn.withdraw_engine_blocks()
    conn.engine_blocks = blocks
    return blocks


class CpuBlocksEngine:
    """One LMCacheEngine with `CpuPagedKVConnector`; blocks declared by `declare_blocks`."""

    def __init__(self, config, metadata, *, native: Optional[bool] = None, name: str = "cpu-blocks") -> None:
        from lmcache_cartridge.lmcache_compat import LMCacheEngineBuilder

        self.conn = CpuPagedKVConnector.from_metadata(metadata, config=config)  # as the vLLM glue's hook builds it
        if native is not None:  # None: the connector's own choice (the native kernel where built)
            self.conn.use_native = native
        self.id = f"{name}-{next(_ids)}"
        self.engine = LMCacheEngineBuilder.get_or_create(self.id, config, metadata, self.conn, None, None)
        self.engine.post_init()
        self.plugin = self.engine.storage_manager.storage_backends.get("cartridge")
        self.why_not: Optional[str] = None  # why engine blocks were not declared, once asked

    def declare_blocks(self, caches: list[torch.Tensor]) -> Optional[EngineBlocks]:
        """As the vLLM glue does at `register_kv_caches`: verify the caches' layout, then declare
        engine blocks unless `why_not_engine_blocks` says LMCache's configuration cannot hold
        them (the reason is kept in `why_not`). Once declared, later calls return them."""
        if self.conn.engine_blocks is not None:
            return self.conn.engine_blocks
        from lmcache_cartridge.vllm.connector import why_not_engine_blocks  # vLLM's side

        self.conn.check_layout(caches)
        self.why_not = why_not_engine_blocks(self.engine)
        return self.conn.declare_engine_blocks() if self.why_not is None else None

    def retrieve(self, tokens: list[int], caches: list[torch.Tensor], slots: torch.Tensor) -> int:
        """Load what LMCache has for `tokens` into `caches` at `slots`; the tokens served."""
        mask = self.engine.retrieve(list(tokens), kvcaches=caches, slot_mapping=slots)
        return int(mask.sum())

    def close(self) -> None:
        from lmcache_cartridge.lmcache_compat import LMCacheEngineBuilder

        self.conn.withdraw_engine_blocks()
        self.conn.close()
        LMCacheEngineBuilder.destroy(self.id)

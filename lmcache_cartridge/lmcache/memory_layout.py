"""What the bytes of this process's LMCache memory objects look like: the one place that says it.

LMCache's memory objects for vLLM are `KV_2LTD` (`[2, num_layers, num_tokens, heads * head_dim]`),
and by default that is what they hold. A serving connector may declare an *engine layout*
instead: then a memory object whose chunk it `holds` (e.g. a chunk of whole vLLM-CPU blocks)
carries the engine's own paged bytes for those blocks, under the same shape, dtype and
`MemoryFormat`, so that a hit is a plain block copy instead of a layout conversion. Only the
connector that declared it reads or writes such objects (`vllm.cpu_kv.CpuPagedKVConnector`, which
declares it only when every LMCache backend of the process keeps its bytes inside the process,
so no other reader ever sees them).

Who uses it: the cartridge plugin, on the worker's reader threads, asks `encoder_for` before it
fills a memory object and encodes the chunk's portable bytes through it (its `KV_2LTD` form, or a
local file's packed payload where it lies); the plugin's own tiers (CPU, disk, S3) keep the
portable bytes. Who owns it: the connector that declared the encoder
(one per process: one LMCache engine per vLLM worker).
"""

from __future__ import annotations

import threading
from typing import Optional, Protocol

import torch

__all__ = ["ChunkEncoder", "declare", "encoder_for", "withdraw"]


class ChunkEncoder(Protocol):
    """An engine layout for the memory objects of the chunks it `holds`."""

    name: str  # for logs, e.g. "vLLM-CPU 'vec' blocks of 32 tokens"

    def holds(self, num_tokens: int) -> bool:
        """True if a memory object of `num_tokens` tokens holds the engine layout."""

    def encode(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`src`, a chunk's bytes in `KV_2LTD` (contiguous, any dtype), or its values as a
        `[2, L, t, H, D]` view in any strides with head_dim contiguous (a packed payload read in
        place, `RankView.engine_view`) -> `dst`, the memory object's tensor (same number of bytes),
        in the engine layout. Synchronous: `src` is the caller's (often a reused buffer) and only
        valid during the call. Argument order as `copy_into`'s: an encoder stands in for that copy."""


_lock = threading.Lock()
_current: Optional[ChunkEncoder] = None


def declare(encoder: ChunkEncoder) -> None:
    """Called by the connector once it has verified vLLM's KV caches (worker side)."""
    global _current
    with _lock:
        _current = encoder


def withdraw(encoder: ChunkEncoder) -> None:
    """Undo `declare` (connector shutdown); objects are `KV_2LTD` again."""
    global _current
    with _lock:
        if _current is encoder:
            _current = None


def encoder_for(num_tokens: int) -> Optional[ChunkEncoder]:
    """The encoder a memory object of `num_tokens` tokens must be filled through, or None for
    `KV_2LTD`."""
    enc = _current
    return enc if enc is not None and enc.holds(num_tokens) else None

"""Which KV heads a tensor-parallel rank holds (the one place that knows vLLM's head split), and
what that rank reads of a packed cartridge (`RankView`).

Runs in every plugin instance (one per engine rank) and in tests/benchmarks; owns no data."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_cartridge.cartridge.manifest import LAYOUT_2LTD, LAYOUT_BY_HEAD, Manifest, Span
from lmcache_cartridge.errors import IncompatibleCartridgeError


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """Return `[start, end)` of the KV heads that `rank` holds under tensor parallelism.

    Mirrors vLLM's `QKVParallelLinear`: with at least as many KV heads as ranks, each rank holds
    `num_kv_heads // tp_size` consecutive heads; with fewer, heads are replicated and rank `r`
    holds head `r // (tp_size // num_kv_heads)`.
    """
    if tp_size <= 0 or not 0 <= rank < tp_size:
        raise IncompatibleCartridgeError(f"rank {rank} is outside tensor-parallel size {tp_size}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise IncompatibleCartridgeError(
                f"{num_kv_heads} KV heads cannot be split over tensor-parallel size {tp_size}"
            )
        per_rank = num_kv_heads // tp_size
        return rank * per_rank, (rank + 1) * per_rank
    if tp_size % num_kv_heads:
        raise IncompatibleCartridgeError(
            f"tensor-parallel size {tp_size} is not a multiple of {num_kv_heads} KV heads"
        )
    head = rank // (tp_size // num_kv_heads)
    return head, head + 1


def hidden_slice(num_kv_heads: int, head_dim: int, tp_size: int, rank: int) -> slice:
    """Columns of `KV_2LTD`'s head-major hidden dim (`heads * head_dim`) that `rank` holds."""
    start, end = kv_head_range(num_kv_heads, tp_size, rank)
    return slice(start * head_dim, end * head_dim)


@dataclass(frozen=True)
class RankView:
    """What one rank reads of a cartridge and how it becomes LMCache's layout for that rank.

    Made by the plugin for each cartridge it serves (one per engine rank), used by `residency`:
    the raw bytes of chunk `i` are `span(i)` (only this rank's heads for a `by_head` payload, one
    contiguous range), they are cached on disk under the cartridge's key and `heads_suffix`
    (shared by every process on the host that reads the same heads), and `to_engine` turns them
    into the rank's `KV_2LTD` chunk, which the CPU tier keeps (so a repeat hit is a plain copy);
    `engine_view` reads them as those values in place, for an encoder that converts them once
    (`residency.read_into`).
    """

    manifest: Manifest
    heads: tuple[int, int]

    @classmethod
    def of(cls, manifest: Manifest, world_size: int = 1, rank: int = 0) -> "RankView":
        return cls(manifest, kv_head_range(manifest.num_kv_heads, world_size, rank))

    @property
    def all_heads(self) -> bool:
        return self.heads == (0, self.manifest.num_kv_heads)

    @property
    def identity(self) -> bool:
        """Raw bytes are already the rank's `KV_2LTD` chunk: read straight into the output.
        (A single head is the same bytes in both layouts.)"""
        m = self.manifest
        return self.all_heads and (m.layout == LAYOUT_2LTD or m.num_kv_heads == 1) or \
            (m.layout == LAYOUT_BY_HEAD and self.heads[1] - self.heads[0] == 1)

    @property
    def heads_suffix(self) -> str:
        """What the disk cache appends to a cartridge's key for this rank's raw bytes: nothing for
        whole chunks, the head range when the rank reads only some heads (`Handle.chunk_id`)."""
        if self.all_heads or self.manifest.layout == LAYOUT_2LTD:
            return ""
        return f".h{self.heads[0]}-{self.heads[1]}"

    def span(self, index: int) -> Span:
        return self.manifest.span(index, self.heads)

    def engine_shape(self, index: int) -> tuple[int, int, int, int]:
        m = self.manifest
        return (2, m.num_layers, m.chunks[index].num_tokens, (self.heads[1] - self.heads[0]) * m.head_dim)

    def engine_nbytes(self, index: int) -> int:
        m = self.manifest
        return m.head_nbytes(m.chunks[index].num_tokens) * (self.heads[1] - self.heads[0])

    def to_engine(self, index: int, raw: torch.Tensor, out: torch.Tensor) -> None:
        from lmcache_cartridge.cartridge.packed import payload_to_engine

        payload_to_engine(self.manifest, self.manifest.chunks[index].num_tokens, self.heads, raw, out)

    def engine_view(self, index: int, raw: torch.Tensor) -> torch.Tensor:
        """The rank's `KV_2LTD` values of chunk `index` as a `[2, L, t, heads, D]` view of its raw
        bytes (`span`), copied nowhere: what an engine-layout encoder reads in place."""
        from lmcache_cartridge.cartridge.packed import payload_view

        return payload_view(self.manifest, self.manifest.chunks[index].num_tokens, self.heads, raw)

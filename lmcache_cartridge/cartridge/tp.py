"""Which KV heads a tensor-parallel rank holds: the one place that knows vLLM's head split."""

from __future__ import annotations

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

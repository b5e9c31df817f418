"""Does a cartridge fit the engine that would serve it? One place for every compatibility rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_cartridge.errors import IncompatibleCartridgeError
from lmcache_cartridge.cartridge.manifest import Manifest
from lmcache_cartridge.cartridge.tp import hidden_slice


@dataclass(frozen=True)
class EngineShape:
    """What one LMCache engine (one rank) expects of a chunk, read from its config and metadata."""

    model_names: tuple[str, ...]
    num_layers: int
    kv_heads_per_rank: int
    head_dim: int
    dtype: torch.dtype
    chunk_size: int
    world_size: int
    rank: int
    use_mla: bool = False

    @classmethod
    def from_lmcache(cls, config, metadata, extra_model_names: tuple[str, ...] = ()) -> "EngineShape":
        layers, _, _, heads, dim = metadata.kv_shape
        names = [metadata.model_name]
        if getattr(metadata, "served_model_name", None):
            names.append(metadata.served_model_name)
        return cls(
            model_names=tuple(dict.fromkeys([*names, *extra_model_names])),
            num_layers=int(layers), kv_heads_per_rank=int(heads), head_dim=int(dim),
            dtype=metadata.kv_dtype, chunk_size=int(config.chunk_size),
            world_size=int(metadata.world_size), rank=int(metadata.worker_id),
            use_mla=bool(metadata.use_mla),
        )


def rank_slice(m: Manifest, shape: EngineShape) -> slice:
    """Columns of a chunk's hidden dim this rank serves (all of them when world_size is 1)."""
    return hidden_slice(m.num_kv_heads, m.head_dim, shape.world_size, shape.rank)


def mismatch(m: Manifest, shape: EngineShape) -> str | None:
    """Why `m` cannot be served by this engine, in words a user can act on; None if it can."""
    if shape.use_mla:
        return "MLA models are not supported by cartridges yet"
    if m.model not in shape.model_names:
        return f"made for model {m.model!r}, engine serves {shape.model_names[0]!r}"
    if m.num_layers != shape.num_layers:
        return (f"{m.num_layers} layers, engine rank has {shape.num_layers} "
                "(pipeline parallelism is not supported)")
    if m.head_dim != shape.head_dim:
        return f"head_dim {m.head_dim}, engine has {shape.head_dim}"
    if m.torch_dtype != shape.dtype:
        return f"dtype {m.dtype}, engine KV dtype is {str(shape.dtype).removeprefix('torch.')}"
    if m.chunk_size != shape.chunk_size:
        return (f"packed with chunk_size {m.chunk_size}, engine uses {shape.chunk_size}; "
                f"re-register with `lmcache-cartridge register --chunk-size {shape.chunk_size}`")
    try:
        cols = rank_slice(m, shape)
    except IncompatibleCartridgeError as e:
        return f"{m.num_kv_heads} KV heads: {e}"
    if (cols.stop - cols.start) != shape.kv_heads_per_rank * shape.head_dim:
        return (f"{m.num_kv_heads} KV heads split over {shape.world_size} ranks gives "
                f"{(cols.stop - cols.start) // m.head_dim} per rank, engine has {shape.kv_heads_per_rank}")
    return None

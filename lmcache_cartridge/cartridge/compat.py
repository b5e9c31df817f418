"""Does a cartridge fit the engine that would serve it? One place for every compatibility rule.

Pure functions over a manifest and what is known of the engine. The plugin (inside each vLLM
worker) knows the whole shape from LMCache's metadata; the gateway, `doctor` and S3 registration
know only the model names and chunk size: they build an `EngineShape.partial(...)` and the same
`mismatch` checks what they know, so all four refuse with the same words.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_cartridge.errors import IncompatibleCartridgeError
from lmcache_cartridge.cartridge.manifest import Manifest
from lmcache_cartridge.cartridge.tp import hidden_slice


@dataclass(frozen=True)
class EngineShape:
    """What one LMCache engine (one rank) expects of a chunk, read from its config and metadata."""

    model_names: tuple[str, ...] | None   # None: not known here, not checked
    num_layers: int | None
    kv_heads_per_rank: int | None
    head_dim: int | None
    dtype: torch.dtype | None
    chunk_size: int | None
    world_size: int = 1
    rank: int = 0
    use_mla: bool = False

    @classmethod
    def partial(cls, *, model_names=None, chunk_size: int | None = None) -> "EngineShape":
        """What a process outside the engine knows (gateway, CLI): names it serves and chunk size."""
        names = tuple(dict.fromkeys(n for n in (model_names or ()) if n)) or None
        return cls(model_names=names, num_layers=None, kv_heads_per_rank=None, head_dim=None,
                   dtype=None, chunk_size=chunk_size)

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
    if shape.model_names is not None and m.model not in shape.model_names:
        also = f" (or {', '.join(map(repr, shape.model_names[1:]))})" if len(shape.model_names) > 1 else ""
        return (f"made for model {m.model!r}, engine serves {shape.model_names[0]!r}{also}. The name must be "
                f"vLLM's --model string exactly: re-pack with --model {shape.model_names[0]!r}, or, if it is "
                f"the same weights under another name, add {m.model!r} to the plugin's accept_models")
    if shape.chunk_size is not None and m.chunk_size != shape.chunk_size:
        return (f"packed with chunk_size {m.chunk_size}, engine uses {shape.chunk_size}; "
                f"re-register with --chunk-size {shape.chunk_size} (`lmcache-cartridge register PATH "
                f"--chunk-size {shape.chunk_size}` re-chunks a local copy; re-pack an S3 one)")
    if shape.num_layers is None:  # a partial shape: nothing more is known outside the engine
        return None
    if m.num_layers != shape.num_layers:
        return (f"{m.num_layers} layers, engine rank has {shape.num_layers} "
                "(pipeline parallelism is not supported)")
    if m.head_dim != shape.head_dim:
        return f"head_dim {m.head_dim}, engine has {shape.head_dim}"
    if m.torch_dtype != shape.dtype:
        return f"dtype {m.dtype}, engine KV dtype is {str(shape.dtype).removeprefix('torch.')}"
    try:
        cols = rank_slice(m, shape)
    except IncompatibleCartridgeError as e:
        return f"{m.num_kv_heads} KV heads: {e}"
    if (cols.stop - cols.start) != shape.kv_heads_per_rank * shape.head_dim:
        return (f"{m.num_kv_heads} KV heads split over {shape.world_size} ranks gives "
                f"{(cols.stop - cols.start) // m.head_dim} per rank, engine has {shape.kv_heads_per_rank}")
    return None

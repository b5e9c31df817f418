"""What the bytes of an LMCache multiprocess-mode (MP) memory object are, per engine: the one place
that says it for MP, as `lmcache.memory_layout` does for the in-process mode.

In MP mode the `lmcache server` keeps one object per (chunk, kv rank) and vLLM's worker copies
whole blocks between its KV cache and those objects. The server registers the object's shape
(`MemoryLayoutDesc`) and gives it to an L2 adapter at lookup; the shape says which bytes it holds:

* `[2, L, T, H*D]`: `KV_2LTD` (vLLM on GPU, split K/V): the cartridge's own chunk bytes.
* `[L, T, H*2D]` of a GPU engine whose cache is fused K|V (vLLM >= 0.26 on CUDA: FLASH_ATTN,
  TRITON_ATTN; LMCache-driven transfer): `FUSED_ROWS`, token-major rows, per head K then V, plain
  values (LMCache's fused gather copies each token's `[H, 2D]` cache row as it is).
* `[L, T, H*2D]` (engine-driven transfer) or `[1, L, T, H*2D]` (LMCache-driven) of vLLM-CPU: its own
  paged block bytes. vLLM-CPU's per-layer cache is `[blocks, H, BS, 2D]`; LMCache's gather
  (`_transfer_per_layer_fused`) writes `obj[l, j*BS + o, h*2D:(h+1)*2D] = cache_l[j, h, o, :]`, so
  the object viewed `[L, nb, BS, H, 2D]` is the cache's blocks `[L, nb, H, BS, 2D]` with the (H, BS)
  axes swapped. Inside a (block, head) the bytes are the ISA's (`cpu_layout`): K transposed for
  vec/vec16, AMX tiles for amx, learned from vLLM's writer op, never written down here.

Where it runs: inside the `lmcache server` process, on the MP adapter's reader thread
(`lmcache.mp_adapter`), once per loaded chunk. It owns the per-geometry encoders it made; how
vLLM-CPU rows are written is vLLM knowledge, declared by the server module
(`vllm.mp_server` -> `vllm.mp_rows`), as the in-process connector declares engine blocks.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from lmcache_cartridge.errors import CartridgeError

KV_2LTD = "kv_2ltd"
CPU_ROWS = "vllm_cpu_rows"
FUSED_ROWS = "gpu_fused_rows"


@dataclass(frozen=True)
class ObjectLayout:
    """How one MP object of a chunk is filled: its kind and, for CPU rows, the block geometry."""

    kind: str
    num_layers: int
    num_tokens: int
    heads: int          # KV heads of the rank this object is for
    head_dim: int
    dtype: torch.dtype
    block_size: int = 0  # CPU rows only


def classify(shape, dtype: torch.dtype, *, num_layers: int, num_tokens: int, heads: int, head_dim: int,
             block_size: "int | Callable[[], int | None] | None",
             gpu: "bool | Callable[[], bool]" = False) -> ObjectLayout:
    """The layout an MP object of `shape`/`dtype` holds for a chunk of this geometry (this rank's
    `heads`), or `CartridgeError` saying why the chunk cannot fill it. `block_size` is the vLLM-CPU
    engine's block size (from the server's registration of it), None where unknown, or a callable
    asked only for vLLM-CPU rows; `gpu` (or a callable asked only for rows): the engine of this
    key is a GPU one, whose rows are plain fused K|V values."""
    shape = tuple(int(x) for x in shape)
    if shape == (2, num_layers, num_tokens, heads * head_dim):
        return ObjectLayout(KV_2LTD, num_layers, num_tokens, heads, head_dim, dtype)
    rows = shape[1:] if len(shape) == 4 and shape[0] == 1 else shape
    if rows == (num_layers, num_tokens, heads * 2 * head_dim):
        if gpu() if callable(gpu) else gpu:
            return ObjectLayout(FUSED_ROWS, num_layers, num_tokens, heads, head_dim, dtype)
        if callable(block_size):
            block_size = block_size()
        if not block_size:
            raise CartridgeError("vLLM-CPU rows without a known block size (no engine-driven registration "
                                 "for this model and world size)")
        if num_tokens % block_size:
            raise CartridgeError(f"a chunk of {num_tokens} tokens is not whole blocks of {block_size}")
        return ObjectLayout(CPU_ROWS, num_layers, num_tokens, heads, head_dim, dtype, int(block_size))
    raise CartridgeError(f"object shape {list(shape)} fits neither KV_2LTD [2, {num_layers}, {num_tokens}, "
                         f"{heads * head_dim}] nor vLLM-CPU rows [{num_layers}, {num_tokens}, "
                         f"{heads * 2 * head_dim}] for this chunk")


Encode = Callable[[torch.Tensor, torch.Tensor], None]

_encoders: dict[ObjectLayout, Encode] = {}
_rows_factory: Optional[Callable[[ObjectLayout], Encode]] = None
_rows_warm: Optional[Callable[[], None]] = None
_warm_started = False
_lock = threading.Lock()


def declare_rows_encoder(factory: Callable[[ObjectLayout], Encode],
                         warm: Optional[Callable[[], None]] = None) -> None:
    """Called once in the server process by the server module (`vllm.mp_server`): how vLLM-CPU
    rows are written (`vllm.mp_rows.CpuRowsEncoder`, learned from vLLM's writer op), and `warm`,
    what the first encoder needs that can be done ahead (`warm_rows`)."""
    global _rows_factory, _rows_warm
    with _lock:
        _rows_factory, _rows_warm = factory, warm


def warm_rows() -> None:
    """Do ahead, on a thread of its own and once per process, what the first vLLM-CPU rows
    encoder needs: importing vLLM's CPU attention takes seconds in a fresh server, and done by
    the first load it held the adapter's only reader thread, so every lookup and load of every
    request waited behind it (a trained request's past its readiness deadline). Called by the
    adapter's watcher when a vLLM-CPU engine has registered with the server."""
    global _warm_started
    with _lock:
        if _rows_warm is None or _warm_started:
            return
        _warm_started = True
        warm = _rows_warm
    threading.Thread(target=warm, name="cartridge-rows-warm", daemon=True).start()


def encoder_for(lay: ObjectLayout) -> Optional[Encode]:
    """The `encode(dst, src)` a chunk is read into an object of `lay` through, None for `KV_2LTD`
    (the chunk's bytes as they are). Made once per geometry (learning the layout takes a few ms).
    `CartridgeError` for vLLM-CPU rows when no rows encoder was declared in this process."""
    if lay.kind == KV_2LTD:
        return None
    if lay.kind == FUSED_ROWS:
        return functools.partial(encode_fused_rows, lay)
    with _lock:
        enc = _encoders.get(lay)
        if enc is None:
            if _rows_factory is None:
                raise CartridgeError("no vLLM-CPU rows encoder in this process (the server module "
                                     "lmcache_cartridge.vllm.mp_server declares it)")
            enc = _encoders[lay] = _rows_factory(lay)
    return enc


def copy_kv_2ltd(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Write a chunk into an MP object of `KV_2LTD` as it is: `src` is the chunk's bytes (a flat
    buffer) or a `[2, L, T, H, D]` view of its values (`RankView.engine_view`, a rank's heads).
    The adapter's loads write every object through an encode, this one included, rather than
    reading into the object: an object is then written only while its load is wanted
    (`lmcache.mp_reader`)."""
    from lmcache_cartridge.cartridge.buffers import copy_into

    if src.is_contiguous():
        copy_into(dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8))
    else:
        dst.view(src.dtype).view(src.shape).copy_(src)


def encode_fused_rows(lay: ObjectLayout, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Write a chunk into an MP object of a GPU engine's fused K|V rows (`FUSED_ROWS`):
    `dst[l, t, h*2D:(h+1)*2D] = [K[l, t, h], V[l, t, h]]`. `src`: the chunk in `KV_2LTD` (any
    tensor with its bytes) or a `[2, L, T, H, D]` view of its values (`RankView.engine_view`);
    `dst`: the object's tensor (`[L, T, H*2D]` or `[1, L, T, H*2D]`, contiguous). Copied by numpy on
    the calling thread (the adapter's reader), as the vLLM-CPU rows are."""
    L, T, H, D = lay.num_layers, lay.num_tokens, lay.heads, lay.head_dim
    if not dst.is_contiguous() or dst.numel() != L * T * H * 2 * D:
        raise CartridgeError(f"MP object {list(dst.shape)} is not {L}x{T}x{H * 2 * D} contiguous values")
    word = WORDS[lay.dtype.itemsize]
    kv = src if src.dim() == 5 else src.reshape(-1).view(torch.uint8).view(lay.dtype).view(2, L, T, H, D)
    out = dst.view(word).view(L, T, H, 2 * D)
    np.copyto(out[..., :D].numpy(), kv[0].view(word).numpy())
    np.copyto(out[..., D:].numpy(), kv[1].view(word).numpy())


# Same-size integer words for copies that move bytes (numpy has no bfloat16).
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

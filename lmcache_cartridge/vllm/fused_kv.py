"""vLLM's fused K|V paged cache (vLLM >= 0.26 on CUDA) read and written correctly for LMCache's
in-process engine.

The layout: vLLM's FLASH_ATTN and TRITON_ATTN backends (vLLM 0.26 onward) give each layer ONE
tensor, logical `(num_blocks, num_kv_heads, block_size, 2 * head_size)`, physical
`(num_blocks, block_size, num_kv_heads, 2 * head_size)` with the NHD cache layout (vLLM's
default) or `(num_blocks, num_kv_heads, block_size, 2 * head_size)` with HND; K is the first
`head_size` values of each head's row, V the second (`kv_cache.transpose(1, 2).split(head_size,
dim=-1)` in vLLM's FlashAttentionImpl). LMCache calls these `NL_X_NB_BS_NH_CS` and
`NL_X_NB_NH_BS_CS` and detects them correctly.

The defect this module works around (LMCache 0.5.6, in-process `VLLMPagedMemGPUConnectorV2`,
seen on an H200 with LMCache's compiled `cuda_ops`): its memory objects stay `KV_2LTD`
`[2, layers, tokens, heads * head_size]` (from the model's metadata), while its copy kernel
treats a fused format as one plane (`k_or_v_size = 1`) of `heads * head_size` values per token at
a token stride of that same width, so it reads and writes half of each row at the wrong offsets
and never fills V. LMCache's own KV stored and reloaded then answers differently, and a
cartridge's KV lands in the wrong places. LMCache's multiprocess kernels handle the fused formats.

What runs where: `FusedKVGPUConnector` is the connector LMCache's factory built (the CUDA hook in
`vllm.connector` changes only its class), in the vLLM worker process; for a fused format its
`to_gpu` / `from_gpu` copy with the torch functions below (one gather or scatter per layer on the
cache's device), for every other format they are LMCache's own. The functions are device-agnostic
and tested on CPU tensors against vLLM's split.
"""

from __future__ import annotations

import torch

# LMCache's EngineKVFormat names of the fused K|V formats, and how each orders (block, token, head)
FUSED_NHD = "NL_X_NB_BS_NH_CS"  # physical [num_blocks, block_size, heads, 2 * head_size]
FUSED_HND = "NL_X_NB_NH_BS_CS"  # physical [num_blocks, heads, block_size, 2 * head_size]
FUSED_FORMATS = (FUSED_NHD, FUSED_HND)


def token_view(layer: torch.Tensor, fmt: str) -> torch.Tensor:
    """One layer's fused cache as a `[num_blocks, block_size, heads, 2 * head_size]` view (no
    copy): indexing it by (block, offset) reaches a token's row in either layout."""
    if layer.dim() != 4:
        raise ValueError(f"a fused K|V cache layer is 4-D, got shape {tuple(layer.shape)}")
    if fmt == FUSED_NHD:
        return layer
    if fmt == FUSED_HND:
        return layer.permute(0, 2, 1, 3)
    raise ValueError(f"not a fused K|V format: {fmt}")


def _check_layers(values_per_token: int, dtype: torch.dtype, layers: list[torch.Tensor], fmt: str) -> None:
    """Every layer read as `fmt` holds `values_per_token` per token (heads x (K + V)) of a dtype of
    the same width, checked before anything is written."""
    for layer in layers:
        view = token_view(layer, fmt)
        heads, width = view.shape[2], view.shape[3]
        if width % 2 or heads * (width // 2) != values_per_token:
            raise ValueError(f"KV of {values_per_token} values per token per layer does not fit a {fmt} "
                             f"layer read as {heads} heads of {width // 2} (K) + {width // 2} (V): "
                             "the cache is in another layout")
        if layer.dtype.itemsize != dtype.itemsize:
            raise ValueError(f"KV of {dtype} does not fit a cache of {layer.dtype}")


def _same_bits(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as `dtype` without converting values (a copy moves bits, as LMCache's kernels do)."""
    return t if t.dtype == dtype else t.view(dtype)


def _where(view: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = view.shape[1]
    return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size


def _valid(slots: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots on `device` and, where some are negative (no block: LMCache's kernels skip
    those tokens), the mask of the others; None when all are valid."""
    slots = slots.to(device=device, dtype=torch.long)
    keep = slots >= 0
    return (slots, None) if bool(keep.all()) else (slots[keep], keep)


def load_fused(kv: torch.Tensor, layers: list[torch.Tensor], slots: torch.Tensor, fmt: str) -> None:
    """Write `kv` (LMCache's `KV_2LTD` `[2, L, T, heads * head_size]`, any device) into the
    fused cache `layers` (L tensors) at the T token `slots` (vLLM slot ids: block * block_size +
    offset; a negative one is skipped). Nothing else of the cache is touched."""
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[1] != len(layers) or kv.shape[2] != len(slots):
        raise ValueError(f"KV {tuple(kv.shape)} does not fit {len(layers)} layers and {len(slots)} slots")
    _check_layers(kv.shape[3], kv.dtype, layers, fmt)
    if not layers or not len(slots):
        return
    device = layers[0].device
    kv = _same_bits(kv.to(device=device, non_blocking=True), layers[0].dtype)  # one copy, not one per layer
    slots, keep = _valid(slots, device)
    if keep is not None:
        kv = kv[:, :, keep]
    for i, layer in enumerate(layers):
        view = token_view(layer, fmt)
        heads, d = view.shape[2], view.shape[3] // 2
        rows = torch.cat([kv[0, i].reshape(-1, heads, d), kv[1, i].reshape(-1, heads, d)], dim=-1)
        b, o = _where(view, slots)
        view[b, o] = rows


def load_chunk(chunk: torch.Tensor, layers: list[torch.Tensor], slot_mapping: torch.Tensor, start: int,
               end: int, fmt: str, vllm_cached_tokens: int = 0) -> None:
    """What `FusedKVGPUConnector.to_gpu` writes for one memory object: `chunk` (`KV_2LTD`) holds
    the request's tokens [start, end), `slot_mapping` is the whole request's; vLLM's own cached
    prefix (`vllm_cached_tokens`) stays as vLLM wrote it, as LMCache's kernel leaves it."""
    skip = min(end - start, max(0, int(vllm_cached_tokens) - start))
    load_fused(chunk[:, :, skip:end - start], layers, slot_mapping[start + skip:end], fmt)


def store_fused(layers: list[torch.Tensor], slots: torch.Tensor, fmt: str, out: torch.Tensor) -> None:
    """Read the T token `slots` of the fused cache `layers` into `out` (`KV_2LTD`
    `[2, L, T, heads * head_size]`, any device; the rows of negative slots are left as they are)."""
    if out.dim() != 4 or out.shape[0] != 2 or out.shape[1] != len(layers) or out.shape[2] != len(slots):
        raise ValueError(f"buffer {tuple(out.shape)} does not fit {len(layers)} layers and {len(slots)} slots")
    _check_layers(out.shape[3], out.dtype, layers, fmt)
    if not layers or not len(slots):
        return
    slots, keep = _valid(slots, layers[0].device)
    dst = _same_bits(out, layers[0].dtype)
    for i, layer in enumerate(layers):
        view = token_view(layer, fmt)
        d = view.shape[3] // 2
        b, o = _where(view, slots)
        rows = view[b, o]  # [T, H, 2D], a copy
        k, v = rows[..., :d].reshape(len(slots), -1), rows[..., d:].reshape(len(slots), -1)
        if keep is None:
            dst[0, i].copy_(k)
            dst[1, i].copy_(v)
        else:
            dst[0, i][keep.to(dst.device)] = k.to(dst.device)
            dst[1, i][keep.to(dst.device)] = v.to(dst.device)


def cuda_connector_finding(config) -> tuple[str, str]:
    """`doctor`'s finding on a CUDA machine for the LMCache config `config`: (level, message).
    Only LMCache's default in-process connector gets this module's copies; its V3 and layerwise
    connectors copy vLLM's fused cache with LMCache's own kernels."""
    other = [name for name in ("use_gpu_connector_v3", "use_layerwise") if getattr(config, name, False)]
    if other:
        return ("FAIL", f"{' and '.join(other)}: LMCache's own copy then moves vLLM's fused K|V cache "
                        "(vLLM >= 0.26), which LMCache 0.5.6 misaddresses; CartridgeConnector corrects only "
                        "its default connector: turn them off, or serve in LMCache's multiprocess mode")
    return ("OK", "CUDA: vLLM's fused K|V cache (vLLM >= 0.26) is copied by CartridgeConnector "
                  "(kv_connector CartridgeConnector; LMCache's own LMCacheConnectorV1 misaddresses it)")


def fused_format_name(fmt) -> str | None:
    """The name of LMCache's EngineKVFormat `fmt` if it is one of the fused K|V formats handled
    here, else None."""
    name = getattr(fmt, "name", str(fmt).rsplit(".", 1)[-1])
    return name if name in FUSED_FORMATS else None


def connector_class():
    """`FusedKVGPUConnector`, defined on first use (it subclasses LMCache's CUDA connector)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _define()
    return _CLASS


_CLASS = None


def _define():
    from lmcache_cartridge.lmcache.compat import VLLMPagedMemGPUConnectorV2
    from lmcache.v1.memory_management import MemoryFormat

    class FusedKVGPUConnector(VLLMPagedMemGPUConnectorV2):
        """LMCache's `VLLMPagedMemGPUConnectorV2` whose copies of a fused K|V cache are this
        module's (see the module docstring); every other format is LMCache's own copy."""

        def _fused(self, kwargs) -> str | None:
            self.initialize_kvcaches_ptr(**kwargs)
            if self.kvcaches is None:
                raise ValueError("kvcaches should be provided in kwargs or initialized beforehand.")
            self._initialize_pointers(self.kvcaches)  # detects the format (once per device)
            return None if self.use_mla else fused_format_name(self.engine_kv_format)

        def to_gpu(self, memory_obj, start: int, end: int, **kwargs):
            fmt = self._fused(kwargs)
            if fmt is None:
                return super().to_gpu(memory_obj, start, end, **kwargs)
            if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
                raise ValueError("The memory object should be in KV_2LTD format in order to be "
                                 "processed by VLLMPagedMemGPUConnector")
            if "slot_mapping" not in kwargs:
                raise ValueError("'slot_mapping' should be provided in kwargs.")
            load_chunk(memory_obj.tensor, list(self.kvcaches), kwargs["slot_mapping"], start, end, fmt,
                       kwargs.get("vllm_cached_tokens", 0))

        def from_gpu(self, memory_obj, start: int, end: int, **kwargs):
            fmt = self._fused(kwargs)
            if fmt is None:
                return super().from_gpu(memory_obj, start, end, **kwargs)
            if "slot_mapping" not in kwargs:
                raise ValueError("'slot_mapping' should be provided in kwargs.")
            slots = kwargs["slot_mapping"][start:end]
            # the side stream reads what vLLM's forward wrote on the current stream: after it
            self.store_stream.wait_stream(torch.cuda.current_stream(self.kvcaches[0].device))
            n = end - start
            with torch.cuda.stream(self.store_stream):
                gb = self.gpu_buffer  # LMCache's preallocated chunk buffer where it made one
                if (gb is not None and gb.shape[:2] == memory_obj.tensor.shape[:2] and gb.shape[2] >= n
                        and gb.shape[3] == memory_obj.tensor.shape[3] and gb.dtype == memory_obj.tensor.dtype):
                    buf = gb[:, :, :n]
                else:
                    buf = torch.empty(memory_obj.tensor.shape, dtype=memory_obj.tensor.dtype,
                                      device=self.kvcaches[0].device)
                store_fused(list(self.kvcaches), slots, fmt, buf)
                memory_obj.tensor.copy_(buf, non_blocking=True)
            self.store_stream.synchronize()

    return FusedKVGPUConnector

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
`batched_to_gpu` (a request's chunks: `load_chunks`, one copy and one scatter per layer per
group of chunks), `to_gpu` and `from_gpu` copy with the torch functions below, for every other
format they are LMCache's own. The functions are device-agnostic
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


def _whole_blocks(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For host `slots`: the positions that start a whole block written in order (slots b*bs,
    b*bs+1, ..., b*bs+bs-1 at consecutive positions) and those blocks' ids. One pass over the
    slots (each window is checked once)."""
    n = len(slots)
    if n < block_size:
        return slots.new_empty(0), slots.new_empty(0)
    cand = torch.nonzero((slots[: n - block_size + 1] % block_size) == 0).flatten()
    cand = cand[slots[cand] >= 0]
    if not len(cand):
        return cand, cand
    windows = slots[cand.unsqueeze(1) + torch.arange(block_size)]
    whole = cand[(windows == slots[cand].unsqueeze(1) + torch.arange(block_size)).all(dim=1)]
    return whole, torch.div(slots[whole], block_size, rounding_mode="floor")


def load_fused(kv: torch.Tensor, layers: list[torch.Tensor], slots: torch.Tensor, fmt: str) -> None:
    """Write `kv` (LMCache's `KV_2LTD` `[2, L, T, heads * head_size]`, any device) into the
    fused cache `layers` (L tensors) at the T token `slots` (vLLM slot ids: block * block_size +
    offset; a negative one is skipped). Nothing else of the cache is touched.

    The work is one host-to-device copy, one interleave of K and V for every layer at once, and
    per layer one copy of the whole blocks (`index_copy_` of block-sized rows, as the cache holds
    them) plus one scatter of the tokens of partial blocks: the layers are separate allocations,
    so no copy can span them. The slots are read on the host once (one synchronisation)."""
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[1] != len(layers) or kv.shape[2] != len(slots):
        raise ValueError(f"KV {tuple(kv.shape)} does not fit {len(layers)} layers and {len(slots)} slots")
    _check_layers(kv.shape[3], kv.dtype, layers, fmt)
    if not layers or not len(slots):
        return
    device = layers[0].device
    kv = _same_bits(kv.to(device=device, non_blocking=True), layers[0].dtype)  # one copy, not one per layer
    host = slots.to(device="cpu", dtype=torch.long)
    view0 = token_view(layers[0], fmt)
    heads, bs, d = view0.shape[2], view0.shape[1], view0.shape[3] // 2
    n, nl = kv.shape[2], len(layers)
    # [L, T, heads, 2D]: each head's K then its V, as the cache row holds them
    rows = torch.cat([kv[0].reshape(nl, n, heads, d), kv[1].reshape(nl, n, heads, d)], dim=-1)
    starts, blocks = _whole_blocks(host, bs)
    rest = torch.ones(n, dtype=torch.bool)
    if len(starts):
        rest[(starts.unsqueeze(1) + torch.arange(bs)).flatten()] = False
        if torch.equal(starts, torch.arange(0, len(starts) * bs, bs)):
            full = rows[:, : len(starts) * bs]  # the whole blocks lead, in order: a view
        else:
            full = rows[:, (starts.unsqueeze(1) + torch.arange(bs)).flatten().to(device)]
        full = full.reshape(nl, len(starts), bs, heads, 2 * d)
        if fmt == FUSED_HND:
            full = full.transpose(2, 3)  # a block of the HND cache is [heads, block_size, 2D]
        blocks = blocks.to(device=device, non_blocking=True)
    rest &= host >= 0  # a token without a block (negative slot) is skipped, as LMCache's kernels do
    idx = torch.nonzero(rest).flatten()
    if len(idx):
        b, o = _where(view0, host[idx].to(device=device, non_blocking=True))
        part = rows[:, idx.to(device=device, non_blocking=True)]
    for i, layer in enumerate(layers):
        if len(starts):
            layer.index_copy_(0, blocks, full[i])
        if len(idx):
            token_view(layer, fmt)[b, o] = part[i]


def load_chunk(chunk: torch.Tensor, layers: list[torch.Tensor], slot_mapping: torch.Tensor, start: int,
               end: int, fmt: str, vllm_cached_tokens: int = 0) -> None:
    """What `FusedKVGPUConnector.to_gpu` writes for one memory object: `chunk` (`KV_2LTD`) holds
    the request's tokens [start, end), `slot_mapping` is the whole request's; vLLM's own cached
    prefix (`vllm_cached_tokens`) stays as vLLM wrote it, as LMCache's kernel leaves it."""
    skip = min(end - start, max(0, int(vllm_cached_tokens) - start))
    load_fused(chunk[:, :, skip:end - start], layers, slot_mapping[start + skip:end], fmt)


# A request's chunks are moved in groups of about this many bytes: one copy and one scatter per
# layer per group, while the device memory a load borrows beside vLLM's cache stays bounded.
LOAD_GROUP_BYTES = 256 * 2**20


def load_chunks(chunks: list[torch.Tensor], starts: list[int], ends: list[int], layers: list[torch.Tensor],
                slot_mapping: torch.Tensor, fmt: str, vllm_cached_tokens: int = 0,
                group_bytes: int = LOAD_GROUP_BYTES) -> None:
    """What `FusedKVGPUConnector.batched_to_gpu` writes for one request: every memory object's
    `chunk` (`KV_2LTD`, tokens [start, end) of the request) at once, as `load_chunk` writes each.
    The chunks are joined on the cache's device in groups of about `group_bytes`, so the fixed
    cost of a copy (kernel launches, one check of the slots) is paid per group, not per layer per
    chunk."""
    if not (len(chunks) == len(starts) == len(ends)):
        raise ValueError(f"{len(chunks)} chunks for {len(starts)} starts and {len(ends)} ends")
    cached = int(vllm_cached_tokens)
    device = layers[0].device if layers else None
    group: list[torch.Tensor] = []
    ranges: list[tuple[int, int]] = []
    size = 0

    def flush() -> None:
        nonlocal group, ranges, size
        if group:
            kv = group[0] if len(group) == 1 else torch.cat(group, dim=2)
            slots = torch.cat([slot_mapping[a:b] for a, b in ranges]) if len(ranges) > 1 else \
                slot_mapping[ranges[0][0]:ranges[0][1]]
            load_fused(kv, layers, slots, fmt)
        group, ranges, size = [], [], 0

    for chunk, start, end in zip(chunks, starts, ends):
        skip = min(end - start, max(0, cached - start))
        if skip == end - start:
            continue
        part = chunk[:, :, skip:end - start]
        if group and (part.shape[:2] != group[0].shape[:2] or part.shape[3] != group[0].shape[3]
                      or part.dtype != group[0].dtype):
            raise ValueError(f"chunk {tuple(part.shape)} {part.dtype} does not match the request's first "
                             f"{tuple(group[0].shape)} {group[0].dtype}")
        group.append(part.to(device=device, non_blocking=True) if device is not None else part)
        ranges.append((start + skip, end))
        size += part.nbytes
        if size >= group_bytes:
            flush()
    flush()


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


_PAGEABLE_WARNED = False


def _warn_if_pageable(memory_objs) -> None:
    """Log once when LMCache hands over chunks in pageable host memory: their copies to the GPU
    then go through a staging buffer synchronously, at a fraction of the bus's speed (a pin that
    failed falls back to this silently)."""
    global _PAGEABLE_WARNED
    if _PAGEABLE_WARNED or not memory_objs:
        return
    t = memory_objs[0].tensor
    if t.device.type == "cpu" and not t.is_pinned():
        _PAGEABLE_WARNED = True
        import logging

        logging.getLogger(__name__).warning(
            "lmcache_cartridge: LMCache's chunks are in pageable host memory: copies to the GPU are "
            "synchronous; check that LMCache's local CPU backend could pin its buffer")


def connector_class():
    """`FusedKVGPUConnector`, defined on first use (it subclasses LMCache's CUDA connector)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _define()
    return _CLASS


_CLASS = None


def _define():
    from lmcache_cartridge.lmcache_compat import VLLMPagedMemGPUConnectorV2
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

        def batched_to_gpu(self, memory_objs, starts, ends, **kwargs):
            """A request's chunks in one batched load (`load_chunks`), where LMCache's own loops
            `to_gpu` over them (a copy and a sync per chunk, a scatter per layer per chunk)."""
            fmt = self._fused(kwargs)
            if fmt is None:
                return super().batched_to_gpu(memory_objs, starts, ends, **kwargs)
            if any(m.metadata.fmt != MemoryFormat.KV_2LTD for m in memory_objs):
                raise ValueError("The memory object should be in KV_2LTD format in order to be "
                                 "processed by VLLMPagedMemGPUConnector")
            if "slot_mapping" not in kwargs:
                raise ValueError("'slot_mapping' should be provided in kwargs.")
            _warn_if_pageable(memory_objs)
            with torch.cuda.stream(self.load_stream):
                load_chunks([m.tensor for m in memory_objs], list(starts), list(ends), list(self.kvcaches),
                            kwargs["slot_mapping"], fmt, kwargs.get("vllm_cached_tokens", 0))
            self.load_stream.synchronize()

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

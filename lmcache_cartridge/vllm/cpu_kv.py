"""LMCache's connector for vLLM's CPU paged KV cache (LMCache has none for CPU).

It copies between vLLM-CPU's per-layer paged KV tensors and LMCache `KV_2LTD` memory objects
(`[2, num_layers, num_tokens, num_kv_heads * head_dim]`, K = 0, V = 1, head-major hidden dim).

The layout is not written down here: `cpu_layout.derive_layout` learns it from vLLM's own writer
op (`cpu_attn_reshape_and_cache(..., isa)`) for the ISA vLLM picks (`_get_attn_isa`), proves it
byte for byte, and refuses (`UnverifiedKVLayout`, callers recompute) when it cannot. Per layer
the tensor is `[num_blocks, num_kv_heads, 2, block_size * head_dim]` (K region, V region per
(block, head): cpu_attn.py's `.view(nb, H, 2 * bs, D).chunk(2, dim=2)`); a slot `s` lives at
block `s // block_size`, offset `s % block_size`. Three kinds of region interior:

* `K_TRANSPOSED` ("vec", "vec16"; vLLM's `cpu_attn_vec*.hpp`: "Write Key as column-major"):
  K `[head_dim, block_size]`, V `[block_size, head_dim]`. Copied by the native tiled-transpose
  kernel (`native.py`, `csrc/kv_copy.c`) when it is built, else by pure torch: whole blocks in
  one copy per layer and K/V, partial blocks by runs of consecutive slots, a fragmented slot
  mapping by a per-slot scatter. Both are checked against vLLM's writer in the tests.
* `AMX_TILES` ("amx", 16-bit caches): K in 16-token tiles of transposed element pairs, V with
  token pairs interleaved. Copied by the same native kernel; without it, as `PERMUTED`.
* `PERMUTED` (any other proven map): loads call vLLM's writer op itself (exact by
  construction); stores gather through the proven position maps.

Engine blocks (`EngineBlocks`, declared by the vLLM connector where no LMCache backend takes
bytes out of the process): a memory object of whole blocks then holds vLLM's own per-layer block
bytes instead of `KV_2LTD`, so loads and stores of it are whole-block copies (`cart_kv_blocks`);
the cartridge plugin fills such objects through `EngineBlocks.encode`, which reads the object as
a little paged cache of its own blocks and fills it with the copy above. Objects of other lengths
stay `KV_2LTD`.

Where it runs: inside each vLLM worker process, on the thread that runs the model, called by
LMCache's engine (`batched_to_gpu` on retrieve, `batched_from_gpu` on store) between forward
passes; a large native copy also on helper threads on the cores vLLM's binding leaves free
(`_run_rows`), which that thread waits for. Who owns what: vLLM owns the paged KV tensors (we
write only the slots LMCache hands us); LMCache owns the memory objects (we read or fill them,
never free them); this module owns only the per-cache-shape result of the layout check, a reused
scratch buffer, the helper threads (stopped at shutdown) and the engine-blocks declaration it
made (withdrawn at shutdown).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch
from lmcache_cartridge.lmcache_compat import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from lmcache_cartridge import settings_reference as ref
from lmcache_cartridge.lmcache import memory_layout
from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.lmcache.settings import PREFIX, cores_setting, find_plugin_name
from lmcache_cartridge.store import threads
from lmcache_cartridge.vllm import native
from lmcache_cartridge.vllm.cpu_layout import (AMX_TILES, K_TRANSPOSED, PagedLayout, UnverifiedKVLayout,
                                               derive_layout)

logger = logging.getLogger("lmcache_cartridge.vllm.cpu_kv")

# The layouts the native kernel implements, with csrc/kv_copy.c's LAYOUT_* code for each.
_NATIVE_LAYOUT = {K_TRANSPOSED: 0, AMX_TILES: 1}

__all__ = ["CpuPagedKVConnector", "UnverifiedKVLayout", "current_attn_isa", "probe_layout", "slot_runs"]


def current_attn_isa(dtype: torch.dtype, block_size: int, head_size: int,
                     kv_cache_dtype: str = "auto") -> str:
    """The attention ISA vLLM-CPU picks for these parameters (vLLM's own `_get_attn_isa`)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)


def _block_views(layer: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a `K_TRANSPOSED` layout: (K `[blocks, heads, head_dim, block_size]`,
    V `[blocks, heads, block_size, head_dim]`) views of one layer's cache."""
    nb, h, bs, two_d = layer.shape
    regions = layer.view(nb, h, 2, bs * head_dim)
    k = regions[:, :, 0].unflatten(-1, (head_dim, bs))
    v = regions[:, :, 1].unflatten(-1, (bs, head_dim))
    return k, v


def probe_layout(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 isa: str) -> Optional[str]:
    """None if vLLM's writer for `isa` has a layout this connector serves, else why not."""
    try:
        derive_layout(isa, block_size, num_kv_heads, head_dim, dtype)
        return None
    except UnverifiedKVLayout as e:
        return str(e)


def run_array(slots: torch.Tensor, block_size: int, breaks: np.ndarray | None = None) -> np.ndarray:
    """Split a slot mapping into runs of consecutive slots inside one block: an int64 array
    `[runs, 4]` of `(token_start, token_end, block, offset)`. Negative slots (tokens vLLM
    already has) are left out; runs also end before each token index in `breaks` (where one
    memory object ends and the next begins). numpy, not torch: on a 256-slot chunk torch's
    per-op overhead cost more than the copy of a small chunk."""
    s = slots.numpy().astype(np.int64, copy=False) if slots.dtype != torch.int64 else slots.numpy()
    n = s.shape[0]
    if n == 0:
        return np.zeros((0, 4), dtype=np.int64)
    first, last = int(s[0]), int(s[-1])
    if first >= 0 and last - first == n - 1 and (n == 1 or bool((np.diff(s) == 1).all())):
        # The usual case (a fresh request's slots are consecutive): cut at block edges (and breaks).
        cuts = np.arange((-first) % block_size, n, block_size, dtype=np.int64)
        if breaks is not None and len(breaks):
            cuts = np.union1d(cuts, breaks)
        starts = np.union1d([0], cuts)
        ends = np.append(starts[1:], n)
        first_slots = first + starts
        return np.stack([starts, ends, first_slots // block_size, first_slots % block_size], axis=1)
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    if n > 1:
        valid = s >= 0
        np.not_equal(s[1:], s[:-1] + 1, out=brk[1:])
        brk[1:] |= (s[1:] % block_size == 0) | (valid[1:] != valid[:-1])
    if breaks is not None and len(breaks):
        brk[breaks] = True
    starts = np.flatnonzero(brk)
    starts = starts[s[starts] >= 0] if (s < 0).any() else starts
    ends = np.empty_like(starts)
    if starts.size:
        # a run ends where the next break is (a skipped stretch ends it too)
        all_starts = np.flatnonzero(brk)
        nxt = np.searchsorted(all_starts, starts, side="right")
        ends[:] = np.where(nxt < all_starts.size, all_starts[np.minimum(nxt, all_starts.size - 1)], n)
    first = s[starts]
    return np.stack([starts, ends, first // block_size, first % block_size], axis=1).astype(np.int64)


def slot_runs(slots: torch.Tensor, block_size: int) -> list[tuple[int, int, int, int]]:
    """`run_array` as a list of tuples."""
    return [tuple(int(x) for x in r) for r in run_array(slots, block_size)]


def whole_blocks(slots: torch.Tensor, block_size: int) -> Optional[np.ndarray]:
    """If the slot mapping of a chunk is whole vLLM blocks (each `block_size` stretch either one
    block's slots in order or all < 0, tokens vLLM already holds): the block of each stretch, -1
    for skipped ones. Else None."""
    s = slots.numpy().astype(np.int64, copy=False)
    if s.shape[0] == 0 or s.shape[0] % block_size:
        return None
    s2 = s.reshape(-1, block_size)
    first = s2[:, 0]
    skipped = (s2 < 0).all(axis=1)
    whole = (first % block_size == 0) & (s2 == first[:, None] + np.arange(block_size)).all(axis=1)
    if not (skipped | whole).all():
        return None
    return np.where(skipped, -1, first // block_size)


class _Plan(NamedTuple):
    """One memory object's part of a load or store, as the worker sees it."""

    layout: PagedLayout
    kvcaches: list
    slots: torch.Tensor  # slot per token of the object; < 0: not copied (vLLM holds it)
    obj: torch.Tensor  # `[2, L, n, H, D]` view of the object's bytes read as `KV_2LTD`
    blocks: Optional[np.ndarray]  # an engine-blocks object copied block by block: cache block per block
    staged: bool = False  # `obj` is a `KV_2LTD` copy of an engine-blocks object (slots not whole blocks)


class EngineBlocks:
    """`memory_layout.ChunkEncoder`: memory objects of whole vLLM blocks hold vLLM-CPU's paged
    bytes for those blocks, per layer `[blocks, heads, 2, block_size * head_dim]` (the cache's own
    per-layer layout, block after block), so a hit is a copy of whole blocks (`cart_kv_blocks`)
    and a store too. Chunks of other lengths stay `KV_2LTD`.

    Declared by `CpuPagedKVConnector.declare_engine_blocks` (worker side, once vLLM's caches are
    verified); `encode` runs on the plugin's reader threads, one thread per chunk."""

    def __init__(self, conn: "CpuPagedKVConnector", layout: PagedLayout, block_size: int) -> None:
        self.conn, self.layout, self.block_size = conn, layout, block_size
        self.name = f"vLLM-CPU '{layout.isa}' blocks of {block_size} tokens"

    def holds(self, num_tokens: int) -> bool:
        return num_tokens > 0 and num_tokens % self.block_size == 0

    def encode(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.conn.convert(dst, src, to_blocks=True)


def _reader_cores_setting(config) -> str:
    """The cartridge plugin's `reader_cores` in this LMCache config, for this connector,
    which LMCache builds from the same config (`vllm.connector`, in each worker):
    `auto` where the config has no cartridge plugin (plain LMCache KV) or a setting the plugin
    refuses (it then says so itself, as it fails to start)."""
    # Here, not at the top: the plugin pulls in LMCache's storage backends (seconds), which MP
    # mode's workers (`mp_rows`: the connector without an LMCache config) never load.
    from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin

    try:
        name = find_plugin_name(config, CartridgeStoragePlugin)
        extra = getattr(config, "extra_config", None) or {}
        return cores_setting(extra.get(f"{PREFIX}.{name}.reader_cores", "auto"))
    except (CartridgeError, ValueError):
        return "auto"


class CpuPagedKVConnector(GPUConnectorInterface):
    """LMCache connector between vLLM-CPU paged KV (proven layouts only) and `KV_2LTD` objects.

    kwargs used (as LMCache's vLLM adapter passes them to `VLLMPagedMemGPUConnectorV2`):
    `kvcaches` (list of per-layer tensors), `slot_mapping` (whole-sequence slot mapping),
    `vllm_cached_tokens` (tokens vLLM already holds: never overwritten), `req_id`.

    Loads never raise into LMCache (a raise there leaks LMCache's memory objects): a failed
    load is logged and recorded in `failed_loads` (req_id -> reason); the vLLM connector turns
    that into failed blocks, which vLLM recomputes. Stores raise (nothing is stored).
    """

    # A chunk split into more runs than this fraction of its tokens goes per-slot in one scatter.
    SCATTER_RUN_FRACTION = 0.125
    # Native copies of at least this many bytes are split over torch's intra-op threads (in vLLM's
    # worker: the cores VLLM_CPU_OMP_THREADS_BIND gave it), and into pieces of at least this many
    # bytes for helper threads (`_run_rows`); below it a thread team costs more than it saves. The
    # environment variable lowers it (the end-to-end tests split every copy).
    PARALLEL_MIN_BYTES = int(os.environ.get(ref.PARALLEL_MIN_BYTES.name) or ref.PARALLEL_MIN_BYTES.default)
    # "0": memory objects stay KV_2LTD even where engine blocks could be declared.
    ENGINE_BLOCKS = os.environ.get(ref.ENGINE_BLOCKS.name, ref.ENGINE_BLOCKS.default) != "0"

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 kv_cache_dtype: str = "auto", copy_cores: str = "auto") -> None:
        """`copy_cores`: a `reader_cores` setting (`store.threads.helper_cores`), where copies into
        and out of vLLM's caches also run beside the worker's thread. Raises ValueError on a
        setting the plugin would refuse."""
        copy_cores = cores_setting(copy_cores)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.hidden_dim_size = num_kv_heads * head_dim
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self._checked: dict[tuple, Optional[str]] = {}
        self._layouts: dict[tuple, PagedLayout] = {}
        self._lock = threading.Lock()
        # Scratch for K transposes; _copy runs under _copy_lock (LMCache may call from 2 threads).
        self._scratch_buf: dict[torch.dtype, torch.Tensor] = {}
        self._copy_lock = threading.Lock()
        self.failed_loads: dict[str, str] = {}
        self.stats = {"block_copies": 0, "partial_copies": 0, "scatter_tokens": 0, "native_copies": 0,
                      "writer_copies": 0, "gather_copies": 0, "load_failures": 0, "native_threads_max": 0,
                      "engine_block_copies": 0, "engine_block_conversions": 0, "helper_pieces": 0}
        self.engine_blocks: Optional[EngineBlocks] = None
        # False: never use the native kernel (benchmarks and tests compare both paths).
        self.use_native = True
        self._ptr_cache: Optional[tuple] = None
        self.copy_cores = copy_cores
        self._helper_pool: Optional[tuple] = None  # () once asked and there is no helper core

    @classmethod
    def from_metadata(cls, metadata, kv_cache_dtype: str = "auto", config=None) -> "CpuPagedKVConnector":
        """As LMCache would build its GPU connector: from its engine metadata and config (the
        cartridge plugin's `reader_cores` there sets `copy_cores`; `lmcache.settings`)."""
        if metadata.use_mla:
            raise UnverifiedKVLayout("MLA KV caches are not supported by the CPU connector")
        num_layers, _, _, num_kv_heads, head_dim = metadata.kv_shape
        return cls(int(num_layers), int(num_kv_heads), int(head_dim), metadata.kv_dtype, kv_cache_dtype,
                   copy_cores=_reader_cores_setting(config) if config is not None else "auto")

    # --- layout ---------------------------------------------------------------------------
    @property
    def refused(self) -> bool:
        """True once vLLM's KV caches were checked and refused: nothing can be loaded or stored."""
        return any(self._checked.values())

    def check_layout(self, kvcaches) -> PagedLayout:
        """The proven layout of `kvcaches`, or `UnverifiedKVLayout`."""
        if isinstance(kvcaches, dict):
            kvcaches = list(kvcaches.values())
        if len(kvcaches) != self.num_layers:
            raise UnverifiedKVLayout(f"{len(kvcaches)} KV cache tensors for {self.num_layers} layers")
        first = kvcaches[0]
        sig = (tuple(first.shape), first.dtype, first.device.type, len(kvcaches))
        problem = self._checked.get(sig, "unchecked")
        if problem == "unchecked":
            problem = self._check(kvcaches, sig)
            self._checked[sig] = problem
            if problem:
                logger.error("lmcache_cartridge cpu_kv: refusing vLLM CPU KV layout: %s; "
                             "LMCache hits will be recomputed", problem)
            else:
                lay = self._layouts[sig]
                logger.info("lmcache_cartridge cpu_kv: vLLM CPU KV layout verified against vLLM's '%s' "
                            "writer (%s): %s; native copy kernel: %s", lay.isa, lay.kind, sig,
                            "loaded" if lay.kind in _NATIVE_LAYOUT and native.kernel() is not None
                            else (native.unavailable_reason() or "not used"))
        if problem:
            raise UnverifiedKVLayout(problem)
        return self._layouts[sig]

    def _check(self, kvcaches, sig: tuple) -> Optional[str]:
        first = kvcaches[0]
        if first.device.type != "cpu":
            return f"KV cache on {first.device}, this connector is for vLLM's CPU backend"
        if first.dim() != 4:
            return (f"per-layer KV tensor has shape {tuple(first.shape)}, "
                    "expected [blocks, heads, block_size, 2*head_dim]")
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
        try:
            self._layouts[sig] = derive_layout(isa, bs, h, self.head_dim, first.dtype)
        except UnverifiedKVLayout as e:
            return f"vLLM CPU attention ISA '{isa}': {e}"
        return None

    # --- GPUConnectorInterface ------------------------------------------------------------
    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])

    def _plan(self, memory_obj: MemoryObj, start: int, end: int, kwargs: dict[str, Any], *, load: bool) -> _Plan:
        kvcaches = kwargs.get("kvcaches")
        if kvcaches is None:
            raise ValueError("'kvcaches' should be provided in kwargs")
        if "slot_mapping" not in kwargs:
            raise ValueError("'slot_mapping' should be provided in kwargs")
        if isinstance(kvcaches, dict):
            kvcaches = list(kvcaches.values())
        layout = self.check_layout(kvcaches)
        assert memory_obj.tensor is not None
        if load and memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"memory object format {memory_obj.metadata.fmt}, expected KV_2LTD")
        n = end - start
        t = memory_obj.tensor
        if tuple(t.shape[:2]) != (2, self.num_layers) or t.shape[2] < n or t.shape[3] != self.hidden_dim_size:
            raise ValueError(f"memory object of shape {tuple(t.shape)} for {n} tokens, "
                             f"expected {tuple(self.get_shape(n))}")
        slots = kwargs["slot_mapping"][start:end].to("cpu")
        # Every path, checked once: vLLM's own writer op (the PERMUTED path, and "amx" without the
        # native kernel) does not bound-check a slot and writes past the cache (seen: SIGSEGV).
        capacity = kvcaches[0].shape[0] * kvcaches[0].shape[2]
        if slots.numel() and int(slots.max()) >= capacity:
            raise ValueError(f"slot {int(slots.max())} is past the paged cache's {capacity} slots")
        if load:
            # Never overwrite tokens vLLM already computed (same rule as VLLMPagedMemGPUConnectorV2).
            vllm_cached = int(kwargs.get("vllm_cached_tokens", 0) or 0)
            skip = min(n, max(0, vllm_cached - start))
            if skip:
                slots = slots.clone()
                slots[:skip] = -1
        obj = t[:, :, :n].unflatten(-1, (self.num_kv_heads, self.head_dim))
        eb = self.engine_blocks
        if eb is None or not eb.holds(t.shape[2]):
            return _Plan(layout, kvcaches, slots, obj, None)
        if t.shape[2] != n or eb.layout is not layout:
            raise ValueError(f"an engine-blocks memory object of {t.shape[2]} tokens for {n} tokens "
                             f"or another KV layout")
        blocks = whole_blocks(slots, kvcaches[0].shape[2])
        if blocks is not None:
            return _Plan(layout, kvcaches, slots, obj, blocks)
        # Not whole blocks (never in vLLM's own use; kept correct): go through KV_2LTD.
        tmp = torch.empty(t.shape, dtype=t.dtype)
        if load:
            self.convert(t, tmp, to_blocks=False)
        return _Plan(layout, kvcaches, slots, tmp.unflatten(-1, (self.num_kv_heads, self.head_dim)), None, staged=True)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs):
        self._load([self._plan(memory_obj, start, end, kwargs, load=True)])

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs):
        plan = self._plan(memory_obj, start, end, kwargs, load=False)
        if (plan.slots < 0).any():
            raise ValueError("cannot store tokens without a slot (slot_mapping < 0)")
        if plan.blocks is not None:
            self._move_blocks([plan], to_cache=False)
        else:
            self._copy(plan.layout, plan.kvcaches, plan.slots, plan.obj, to_cache=False)
            if plan.staged:
                self.convert(memory_obj.tensor, plan.obj, to_blocks=True)
        memory_obj.metadata.fmt = MemoryFormat.KV_2LTD

    # --- engine blocks ---------------------------------------------------------------------
    def declare_engine_blocks(self) -> Optional[EngineBlocks]:
        """Memory objects of whole blocks hold vLLM's paged bytes from now on (`EngineBlocks`).
        The caller (the vLLM connector, worker side, after `check_layout`) has made sure no
        LMCache backend takes these bytes out of the process. Returns the encoder, or None when
        there is no single verified layout or `ENGINE_BLOCKS` is off."""
        if not self.ENGINE_BLOCKS or len(self._layouts) != 1 or self.refused:
            return None
        (sig, layout), = self._layouts.items()
        self.engine_blocks = EngineBlocks(self, layout, sig[0][2])
        memory_layout.declare(self.engine_blocks)
        logger.info("lmcache_cartridge cpu_kv: LMCache memory objects of whole blocks hold %s "
                    "(hits and stores are block copies)", self.engine_blocks.name)
        return self.engine_blocks

    def withdraw_engine_blocks(self) -> None:
        if self.engine_blocks is not None:
            memory_layout.withdraw(self.engine_blocks)
            self.engine_blocks = None

    def convert(self, blocks_t: torch.Tensor, flat: torch.Tensor, *, to_blocks: bool) -> None:
        """Between an engine-blocks object's bytes (`blocks_t`) and the same chunk in `KV_2LTD`
        (`flat`, any tensor with its bytes): the object read as a little paged cache of its own
        blocks, filled (or read) through the same copy as vLLM's caches, slots 0..n-1. Runs on the
        caller's thread alone (the plugin's readers run several at once).

        With `to_blocks`, `flat` may instead be a `[2, L, n, H, D]` view of the chunk's values in
        any strides (head_dim contiguous), e.g. a packed by-head payload read in place
        (`RankView.engine_view`): the kernel reads it where it lies, one pass instead of a copy
        into `KV_2LTD` and then this one. Without the kernel such a view is copied to `KV_2LTD`
        first (the torch paths take token-major objects)."""
        L, H, D = self.num_layers, self.num_kv_heads, self.head_dim
        eb = self.engine_blocks
        nbytes = blocks_t.numel() * blocks_t.element_size()
        if eb is None or flat.numel() * flat.element_size() != nbytes:
            raise ValueError("engine-blocks conversion without a declared layout or of mismatched sizes")
        layout, bs = eb.layout, eb.block_size
        n = nbytes // (2 * L * H * D * self.dtype.itemsize)
        caches = list(blocks_t.reshape(-1).view(torch.uint8).view(self.dtype).view(L, n // bs, H, bs, 2 * D).unbind(0))
        if flat.dim() == 5:
            if not to_blocks or flat.dtype != self.dtype or tuple(flat.shape) != (2, L, n, H, D) or flat.stride(4) != 1:
                raise ValueError(f"engine-blocks conversion from a {tuple(flat.shape)} {flat.dtype} view with strides "
                                 f"{flat.stride()}: expected [2, {L}, {n}, {H}, {D}] {self.dtype}, head_dim contiguous")
            obj = flat
        else:
            obj = flat.reshape(-1).view(torch.uint8).view(self.dtype).view(2, L, n, H, D)
        lib = native.kernel() if self.use_native and layout.kind in _NATIVE_LAYOUT else None
        if lib is not None:
            # Block j holds tokens j*bs..: the kernel's rows written directly (the general slot
            # walk cost ~0.1 ms of Python per chunk, a third of a 2 MiB chunk's conversion).
            meta = self._row_meta(obj)
            rows = np.zeros((n // bs, 9), dtype=np.int64)
            rows[:, :4] = meta[:4]
            rows[:, 4] = np.arange(0, n, bs)
            rows[:, 5] = rows[:, 4] + bs
            rows[:, 6] = np.arange(n // bs)
            rows[:, 8] = meta[4]
            self._copy_native(lib, layout, caches, rows, to_cache=to_blocks, conversion=True)
        else:
            self._copy(layout, caches, torch.arange(n, dtype=torch.int64), obj.contiguous(), to_cache=to_blocks,
                       conversion=True)
        self.stats["engine_block_conversions"] += 1

    def _move_blocks(self, plans: list[_Plan], *, to_cache: bool) -> None:
        """Engine-blocks objects <-> vLLM's caches, whole blocks: one kernel call for all of them."""
        kvcaches = plans[0].kvcaches
        nb, h, bs, two_d = kvcaches[0].shape
        block_bytes = h * bs * two_d * kvcaches[0].element_size()
        ids = np.concatenate([p.blocks for p in plans])
        if int(ids.max()) >= nb:
            raise ValueError(f"slot mapping points past vLLM's {nb} KV blocks")
        lib = native.kernel() if self.use_native else None
        if lib is not None:
            rows = np.empty((ids.shape[0], 3), dtype=np.int64)
            at = 0
            for p in plans:
                k = p.blocks.shape[0]
                base = p.obj.data_ptr()
                rows[at:at + k, 0] = base + np.arange(k, dtype=np.int64) * block_bytes
                rows[at:at + k, 1] = k * block_bytes  # one layer of this object
                at += k
            rows[:, 2] = ids
            pointers = self._layer_pointers(kvcaches)
            rc = self._run_rows(lambda part, team: lib.cart_kv_blocks(
                1 if to_cache else 0, pointers, len(kvcaches), block_bytes, part.ctypes.data, part.shape[0], team),
                rows, int((ids >= 0).sum()) * block_bytes * len(kvcaches))
            if rc != 0:
                raise RuntimeError(f"native block copy failed (rc {rc})")
        else:
            with torch.inference_mode():
                for p in plans:
                    k = p.blocks.shape[0]
                    keep = torch.from_numpy(np.flatnonzero(p.blocks >= 0))
                    idx = torch.from_numpy(p.blocks[p.blocks >= 0])
                    objl = p.obj.reshape(-1).view(torch.uint8).view(self.dtype).view(len(kvcaches), k, -1)
                    for layer_idx, layer in enumerate(kvcaches):
                        cache = layer.view(nb, -1)
                        if to_cache:
                            cache.index_copy_(0, idx, objl[layer_idx].index_select(0, keep))
                        else:
                            objl[layer_idx].index_copy_(0, keep, cache.index_select(0, idx))
        self.stats["engine_block_copies"] += int((ids >= 0).sum())

    def _copy(self, layout: PagedLayout, kvcaches, slots: torch.Tensor, obj: torch.Tensor, *,
              to_cache: bool, conversion: bool = False) -> None:
        """obj: `[2, L, n, H, D]` view of the memory object. `conversion`: `kvcaches` are an
        engine-blocks object's (`convert`): one thread, not counted as copies into vLLM."""
        bs = kvcaches[0].shape[2]
        lib = native.kernel() if self.use_native and layout.kind in _NATIVE_LAYOUT else None
        if lib is not None:
            self._copy_native(lib, layout, kvcaches, self._native_rows([(slots, obj)], bs), to_cache=to_cache,
                              conversion=conversion)
            return
        if layout.kind != K_TRANSPOSED:
            self._copy_permuted(layout, kvcaches, slots, obj, to_cache=to_cache)
            return
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

    @staticmethod
    def _row_meta(obj: torch.Tensor) -> tuple[int, int, int, int, int]:
        """A `[2, L, n, H, D]` view's part of the kernel's run rows: `(base, kv_stride,
        layer_stride, tok_stride, head_stride)`, strides in elements."""
        return obj.data_ptr(), obj.stride(0), obj.stride(1), obj.stride(2), obj.stride(3)

    def _native_rows(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], bs: int) -> np.ndarray:
        """The kernel's run rows `(obj, kv_stride, layer_stride, tok_stride, start, end, block,
        offset, head_stride)` for `(slots, obj view [2, L, n, H, D])` pieces, e.g. every chunk of
        one retrieve. One `run_array` over their slots laid end to end (runs break where a piece
        ends), each run then tagged with its piece's base address and strides: done piece by piece
        this was ~45 us of Python per 256-token chunk, a sixth of its copy."""
        for _, obj in pieces:
            if obj.stride(4) != 1 or obj.dtype != self.dtype:
                raise ValueError(f"memory object view has strides {obj.stride()} / dtype {obj.dtype}, "
                                 f"expected {self.dtype} rows of contiguous head_dim")
        bounds = np.cumsum([0] + [sl.numel() for sl, _ in pieces])
        slots = pieces[0][0] if len(pieces) == 1 else torch.cat([sl for sl, _ in pieces])
        runs = run_array(slots, bs, breaks=bounds[1:-1])
        piece = np.searchsorted(bounds, runs[:, 0], side="right") - 1
        meta = np.array([self._row_meta(o) for _, o in pieces], dtype=np.int64)[piece]
        rows = np.empty((runs.shape[0], 9), dtype=np.int64)
        rows[:, :4] = meta[:, :4]
        rows[:, 4:6] = runs[:, :2] - bounds[piece][:, None]
        rows[:, 6:8] = runs[:, 2:]
        rows[:, 8] = meta[:, 4]
        return rows

    def _copy_native(self, lib, layout: PagedLayout, kvcaches, rows: np.ndarray, *, to_cache: bool,
                     conversion: bool = False) -> None:
        """All layers and runs (of one or several memory objects) in one kernel call."""
        rows = np.ascontiguousarray(rows)
        if rows.shape[0] == 0:
            return
        nb, h, bs, two_d = kvcaches[0].shape
        if int(rows[:, 6].max()) >= nb or int(rows[:, 6].min()) < 0:
            # torch indexing would raise here; C would write out of bounds
            raise ValueError(f"slot mapping points past vLLM's {nb} KV blocks")
        elem = kvcaches[0].element_size()
        nbytes = int((rows[:, 5] - rows[:, 4]).sum()) * 2 * len(kvcaches) * h * self.head_dim * elem
        pointers = (ctypes.c_void_p * len(kvcaches))(*[c.data_ptr() for c in kvcaches]) if conversion \
            else self._layer_pointers(kvcaches)

        def copy(part: np.ndarray, team: int) -> int:
            return lib.cart_kv_copy(_NATIVE_LAYOUT[layout.kind], 1 if to_cache else 0, elem, pointers,
                                    len(kvcaches), h, self.head_dim, bs, part.ctypes.data, part.shape[0], team)

        rc = copy(rows, 1) if conversion else self._run_rows(copy, rows, nbytes)
        if rc != 0:
            raise RuntimeError(f"native KV copy failed (rc {rc}, element size {elem})")
        if conversion:
            return
        full = int(((rows[:, 7] == 0) & (rows[:, 5] - rows[:, 4] == bs)).sum())
        self.stats["native_copies"] += rows.shape[0]
        self.stats["block_copies"] += full
        self.stats["partial_copies"] += rows.shape[0] - full

    def _run_rows(self, copy: Callable[[np.ndarray, int], int], rows: np.ndarray, nbytes: int) -> int:
        """Worker thread, inside a load or store LMCache waits on: `copy(rows_part, team)` (one
        native kernel call on `team` OpenMP threads) over every row of `rows`, the return codes
        or-ed. With helper cores (`_helpers`) and a copy of at least two pieces per taker (pieces
        of at least `PARALLEL_MIN_BYTES`, at most 16), the rows are cut into pieces of equal row
        counts that this thread (on its OpenMP team) and one helper thread per helper core take
        in turn until none is left: a helper that is slow to start (its core is shared with
        vLLM's engine-core process) leaves its pieces to this thread, and one that has not
        started when the pieces are gone is cancelled. Pieces are whole rows, as the kernel's own
        OpenMP split is: no two write one byte. Returns only once no helper is still copying,
        also when something raised."""
        team = self._threads(nbytes)
        helpers = self._helpers() if nbytes >= self.PARALLEL_MIN_BYTES else None
        n = int(min(rows.shape[0], 16, nbytes // max(self.PARALLEL_MIN_BYTES, 1)))
        if helpers is None or n < 2 * (team + helpers[1]):
            return copy(rows, team)
        pool, n_helpers = helpers
        bounds = np.linspace(0, rows.shape[0], n + 1).astype(np.int64)
        take = itertools.count().__next__  # atomic under the GIL: each piece is taken once
        failed: list[BaseException] = []  # this thread's copy raised: helpers take no more pieces

        def work(t: int) -> tuple[int, int]:
            rc, done = 0, 0
            while not failed and (i := take()) < n:
                rc |= copy(rows[bounds[i]:bounds[i + 1]], t)  # ctypes releases the GIL meanwhile
                done += 1
            return rc, done

        helped = []
        try:
            for _ in range(n_helpers):  # one thread each: no OpenMP team
                helped.append(pool.submit(work, 1))
        except RuntimeError:  # the pool is shut down (interpreter exit): this thread copies alone
            pass
        try:
            rc, _ = work(team)
        except BaseException as e:
            failed.append(e)
            raise
        finally:  # the rows point into LMCache's objects and vLLM's blocks: no helper outlives this
            started = [f for f in helped if not f.cancel()]
            wait(started)
        for f in started:
            h_rc, done = f.result()
            rc |= h_rc
            self.stats["helper_pieces"] += done
        return rc

    def _helpers(self) -> Optional[tuple[ThreadPoolExecutor, int]]:
        """The helper threads and how many (one per core of `store.threads.helper_cores` for
        `self.copy_cores`), made at the first copy large enough to split (vLLM binds the worker
        before it serves); None where there is no helper core."""
        if self._helper_pool is None:
            with self._lock:
                if self._helper_pool is None:
                    cores = threads.helper_cores(self.copy_cores)
                    if cores:
                        logger.info("lmcache_cartridge: copies into and out of vLLM's KV cache also run on "
                                    "cores %s beside the worker's (reader_cores: %s)", cores, self.copy_cores)
                    self._helper_pool = (threads.pool(len(cores), "cartridge-copy", cores=lambda: cores, spread=True),
                                         len(cores)) if cores else ()
        return self._helper_pool or None

    def close(self) -> None:
        """Worker side, at shutdown (the vLLM connector's): stop the helper threads."""
        with self._lock:
            helpers, self._helper_pool = self._helper_pool, ()  # (): later copies run on the worker
        if helpers:
            helpers[0].shutdown(wait=False, cancel_futures=True)

    def _threads(self, nbytes: int) -> int:
        """Threads for a native copy of `nbytes` into or out of vLLM's caches (worker thread):
        torch's intra-op threads for copies of at least `PARALLEL_MIN_BYTES`, where the kernel
        shares torch's OpenMP runtime. A new high is logged once."""
        threads = torch.get_num_threads() if nbytes >= self.PARALLEL_MIN_BYTES and native.openmp() else 1
        if threads > max(self.stats["native_threads_max"], 1):
            logger.info("lmcache_cartridge: native KV copy split over %d threads (OpenMP: %s)", threads,
                        native.openmp())
        self.stats["native_threads_max"] = max(self.stats["native_threads_max"], threads)
        return threads

    def _layer_pointers(self, kvcaches):
        """ctypes array of the layers' data pointers, kept while vLLM's tensors stay the same."""
        key = (len(kvcaches), kvcaches[0].data_ptr(), kvcaches[-1].data_ptr())
        cached = self._ptr_cache  # one read: another thread may replace it
        if cached is None or cached[0] != key:
            cached = self._ptr_cache = (key, (ctypes.c_void_p * len(kvcaches))(*[c.data_ptr() for c in kvcaches]))
        return cached[1]

    def _copy_permuted(self, layout: PagedLayout, kvcaches, slots: torch.Tensor, obj: torch.Tensor, *,
                       to_cache: bool) -> None:
        """A layout neither the native kernel nor the torch transpose copies (`PERMUTED`, or
        `AMX_TILES` without the kernel): loads go through vLLM's own writer op
        (it skips slots < 0, like vLLM); stores gather through the layout's proven maps."""
        nb, h, bs, two_d = kvcaches[0].shape
        with torch.inference_mode():
            if to_cache:
                import vllm._custom_ops as ops

                sl = slots.to(torch.long)
                for layer_idx, layer in enumerate(kvcaches):
                    kc, vc = layer.view(nb, h, 2 * bs, self.head_dim).chunk(2, dim=2)
                    ops.cpu_attn_reshape_and_cache(obj[0, layer_idx], obj[1, layer_idx], kc, vc, sl, layout.isa)
                self.stats["writer_copies"] += len(kvcaches)
                return
            s = slots.to(torch.long)
            b, o = s // bs, s % bs
            k_idx = layout.flat_index(b, o, h, 0).reshape(-1)
            v_idx = layout.flat_index(b, o, h, 1).reshape(-1)
            for layer_idx, layer in enumerate(kvcaches):
                flat = layer.view(-1)
                obj[0, layer_idx].copy_(flat.index_select(0, k_idx).view(obj.shape[2:]))
                obj[1, layer_idx].copy_(flat.index_select(0, v_idx).view(obj.shape[2:]))
            self.stats["gather_copies"] += len(kvcaches)

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
            self._load([self._plan(m, s, e, kwargs, load=True)
                        for m, s, e in zip(memory_objs, starts, ends, strict=True)])
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

    def _load(self, plans: list[_Plan]) -> None:
        """One retrieve's objects into vLLM's caches: engine-blocks objects in one block copy, the
        rest in one kernel call when the native kernel serves the layout."""
        whole = [p for p in plans if p.blocks is not None]
        if whole:
            self._move_blocks(whole, to_cache=True)
        plans = [p for p in plans if p.blocks is None]
        if not plans:
            return
        lib = native.kernel() if self.use_native else None
        if (lib is not None and plans[0].layout.kind in _NATIVE_LAYOUT
                and all(p.layout is plans[0].layout for p in plans)):
            kvcaches = plans[0].kvcaches
            self._copy_native(lib, plans[0].layout, kvcaches,
                              self._native_rows([(p.slots, p.obj) for p in plans], kvcaches[0].shape[2]), to_cache=True)
        else:
            for p in plans:
                self._copy(p.layout, p.kvcaches, p.slots, p.obj, to_cache=True)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(m, s, e, **kwargs)

    def take_failed_loads(self) -> dict[str, str]:
        with self._lock:
            out, self.failed_loads = self.failed_loads, {}
        return out

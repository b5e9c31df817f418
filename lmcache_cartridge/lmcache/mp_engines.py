"""What an `lmcache server` knows of the vLLM engines registered with it, read for the MP adapter.

The L2 adapter (`lmcache.mp_adapter`) needs three facts about the engines attached to its server
that LMCache keeps but does not hand to L2 adapters (and one it reports: its L1's size and
eviction watermark, `l1_room`): which (model, world size) engines are
registered (their layout descriptors), whether an engine of a (model, world size) is a GPU one
(its MP objects hold plain K|V rows) or a vLLM-CPU one, and a vLLM-CPU engine's block size (its
MP objects hold its own block bytes: `lmcache.mp_layout`). They are read here from the server
context and transfer modules the server module hands the adapter (`CartridgeL2Adapter.attach`,
run by `vllm.mp_server`), asked each time and never kept: an engine may leave, or register again
with another block size.

Where it runs: in the `lmcache server` process, on whichever adapter thread asks (the adapter's
reader thread for a lookup or load, its watcher thread for residency, preload and the published
record). Reads only; each read takes the lock LMCache guards that state with, or none where
LMCache's own accessor does (`context_entries_snapshot`, `report_status`). Owns nothing.
"""

from __future__ import annotations

from typing import Any

from lmcache_cartridge.errors import CartridgeError

# The server's transfer modules that know its engines' contexts (engine-driven: vLLM-CPU block
# sizes in `report_status`; LMCache-driven: each registered cache context)
TRANSFER_MODULES = ("EngineDrivenTransferModule", "LMCacheDrivenTransferModule")


def kv_world_and_rank(kv_rank: int) -> tuple[int, int]:
    """(world size, global rank) packed into an MP key's `kv_rank` (LMCache's `ComputeKVRank`)."""
    return (kv_rank >> 24) & 0xFF, (kv_rank >> 16) & 0xFF


class ServerEngines:
    """The engines registered with one `lmcache server`: empty until the server module attaches
    (`context`: the server context, `modules`: its server modules, of which the transfer modules
    are kept)."""

    def __init__(self, context: Any = None, modules=()) -> None:
        self.context = context
        self.transfer_modules = [m for m in modules if type(m).__name__ in TRANSFER_MODULES]

    def engines(self) -> set[tuple[str, int]]:
        """(model, world size) of the vLLM engines registered with the server now: its layout
        registry's keys (lmcache 0.5.6 has no public listing of them)."""
        registry = getattr(self.context, "layout_desc_registry", None)
        entries, lock = getattr(registry, "_registry", None), getattr(registry, "_lock", None)
        if not isinstance(entries, dict) or lock is None:
            return set()
        with lock:
            return {(str(model), int(world)) for model, world in entries if model}

    def l1_room(self) -> tuple[int, float] | None:
        """(L1 capacity in bytes, the eviction's trigger watermark) of the server, from its storage
        manager's `report_status` (its first L1); None where the server does not say."""
        sm = getattr(self.context, "storage_manager", None)
        try:
            status = sm.report_status()
            capacity = sum(int(v) for v in status["l1_capacity_bytes_by_backend"].values())
            watermark = min(float(c["trigger_watermark"]) for c in status["l1_eviction_controllers"].values())
        except Exception:  # noqa: BLE001 - another LMCache's status, or none: no figure to warn by
            return None
        return (capacity, watermark) if capacity > 0 else None

    def models(self) -> set[str]:
        """The model names of the vLLM engines registered with the server now."""
        return {model for model, _world in self.engines()}

    def gpu(self, model: str, world: int) -> bool:
        """Whether the engine of (model, world) registered with the server is a GPU one (its fused
        rows are plain K|V values, `mp_layout.FUSED_ROWS`): an LMCache-driven context that is not
        LMCache's CPU one (engine-driven contexts are all non-CUDA). A GPU and a vLLM-CPU engine
        of the same (model, world) would read the same rows differently: refused."""
        from lmcache.v1.platform.devices.cpu.cache_context import CPUCacheContext

        gpu = False
        for mod in self.transfer_modules:
            if hasattr(mod, "context_entries_snapshot"):
                gpu = gpu or any(not isinstance(e.cache_context, CPUCacheContext)
                                 for e in mod.context_entries_snapshot().values()
                                 if e.model_name == model and int(e.world_size) == world)
        if gpu and self.block_size(model, world) is not None:
            raise CartridgeError(f"a GPU engine and a vLLM-CPU engine of {model!r} (world {world}) are both "
                                 "registered: their MP objects hold different bytes")
        return gpu

    def block_size(self, model: str, world: int) -> int | None:
        """The block size the server's registration of a vLLM-CPU engine of (model, world) declares
        now (engine-driven contexts report it, LMCache-driven CPU contexts hold it); None when no
        such engine is registered, or two of them declare different block sizes (the rows would be
        ambiguous)."""
        for mod in self.transfer_modules:
            if hasattr(mod, "context_entries_snapshot"):  # LMCache-driven: the shared-memory cache context
                found = [e.cache_context.block_size for e in mod.context_entries_snapshot().values()
                         if e.model_name == model and int(e.world_size) == world
                         and hasattr(e.cache_context, "block_size")]
            else:
                meta = mod.report_status().get("non_cuda_context_meta", {})
                found = [v["block_size"] for v in meta.values()
                         if v.get("model_name") == model and int(v.get("world_size", 0)) == world]
            if len(set(found)) == 1:
                return int(found[0])
            if found:
                return None
        return None

    def vllm_cpu_attached(self) -> bool:
        """Whether a vLLM-CPU engine is registered now (one with a block size)."""
        return any(self.block_size(model, world) is not None for model, world in self.engines())

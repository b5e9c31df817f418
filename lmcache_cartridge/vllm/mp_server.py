"""The `lmcache server` module that puts cartridges into LMCache's multiprocess mode:
`--server-module '{"module_path": "lmcache_cartridge.vllm.mp_server"}'` beside the cartridge L2
adapter (`lmcache.mp_adapter`; `lmcache-cartridge mp-server` passes both).

The server calls it once, after its L2 adapters and built-in modules exist: LMCache 0.5.6 calls
`build_server_modules`, 0.5.7 builds `CartridgeServerModule` (its `DiscoverableModule` contract). It declares how
vLLM-CPU rows are written (`vllm.mp_rows`: vLLM knowledge, hence this stage; the adapter has
what their first encoder imports done ahead once a vLLM-CPU engine registers) and hands every
cartridge adapter the server's context: its token hasher and chunk size (the keys), its storage
manager (purges of L1), its engine-driven transfer module (vLLM-CPU block sizes) and the endpoint
it binds (published in the adapter's serving-state record). With the adapter's `prefault_l1` on
it starts faulting in the server's L1 arena (`lmcache.l1_prefault`). It adds no module of its own.
"""

from __future__ import annotations

import logging

from lmcache_cartridge.lmcache.l1_prefault import prefault_l1
from lmcache_cartridge.lmcache.mp_adapter import CartridgeL2Adapter, server_endpoint
from lmcache_cartridge.lmcache.mp_layout import declare_rows_encoder
from lmcache_cartridge.vllm.mp_rows import rows_encoder, warm_rows_encoder

logger = logging.getLogger("lmcache_cartridge.mp_server")


def attach_adapters(server_context, modules, mp_config) -> None:
    """What the server module does, on either LMCache release: the rows encoder declared, every
    cartridge adapter attached to the server's context, L1 prefaulted where asked."""
    from lmcache_cartridge import ensure_log_handler

    ensure_log_handler()  # the server configures only LMCache's loggers: ours would say nothing
    declare_rows_encoder(rows_encoder, warm=warm_rows_encoder)
    found = []
    sm = server_context.storage_manager
    for _desc, adapter in sm.l2_adapters():
        if isinstance(adapter, CartridgeL2Adapter):
            adapter.attach(server_context, modules, server_endpoint(mp_config))
            found.append(adapter)
    if not found:
        logger.warning("lmcache_cartridge server module: no cartridge L2 adapter configured (--l2-adapter)")
        return
    if found[0].settings.prefault_l1:
        prefault_l1(sm)
    if hasattr(server_context, "add_chunk_size_bind_listener"):  # LMCache 0.5.7
        configured = server_context.chunk_size
        server_context.add_chunk_size_bind_listener(lambda size: _chunk_size_bound(configured, size))


def _chunk_size_bound(configured: int, size: int) -> None:
    """LMCache 0.5.7 may raise the server's chunk size to a multiple of a registering model's
    block size. Cartridges are made for one chunk size (`--chunk-size`, the YAML's `chunk_size`):
    at another every key misses, so say how to fix it."""
    if size != configured:
        logger.error("lmcache_cartridge: LMCache set this server's chunk size to %d (configured %d) for a vLLM's "
                     "block size: cartridges made with chunk size %d are not served. Use a chunk_size that is a "
                     "multiple of vLLM's block size", size, configured, configured)


def build_server_modules(bctx):
    """LMCache 0.5.6's server-module factory (called once, after the built-in modules); adds none."""
    attach_adapters(bctx.server_context, bctx.modules, bctx.mp_config)
    return ()


try:  # LMCache 0.5.7: a server module is a `DiscoverableModule` class
    from lmcache.v1.multiprocess.engine_module import DiscoverableModule
except ImportError:  # 0.5.6: `build_server_modules` above
    DiscoverableModule = None

if DiscoverableModule is not None:
    class CartridgeServerModule(DiscoverableModule):
        """LMCache 0.5.7's form of `build_server_modules`: built after the built-in modules
        (`deferred`: the transfer modules exist), adds no module of its own (`create` -> None)."""

        module_name = "lmcache_cartridge"
        deferred = True

        @classmethod
        def create(cls, build_ctx):
            attach_adapters(build_ctx.engine_context, build_ctx.built, build_ctx.mp_config)
            return None

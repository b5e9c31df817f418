"""A cartridge published to the S3 catalog is served by a real LMCache engine on a host that only
runs the catalog sync (started the way the plugin starts it: `start_catalog_sync` with the
plugin's own settings from the YAML); unpublishing it stops the serving. Moto on loopback."""

import time

import torch
import yaml

from conftest import random_kv
from lmc_helpers import Engine, make_metadata
from s3_server import s3_client
from test_plugin import CHUNK, D, H, L, MODEL, flat, load_config, write_yaml
from lmcache_cartridge.cartridge.packed import pack_kv
from lmcache_cartridge.lmcache.catalog_sync import start_catalog_sync
from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
from lmcache_cartridge.lmcache.settings import PluginSettings
from lmcache_cartridge.store.catalog import publish, unpublish
from lmcache_cartridge.store.s3 import S3Settings

BUCKET = "fleet-serving"
CATALOG = f"s3://{BUCKET}/catalog"


def _wait(pred, timeout=30.0):
    deadline = time.time() + timeout
    while not pred() and time.time() < deadline:
        time.sleep(0.05)
    return pred()


def test_published_cartridge_is_served_bit_exact_then_unpublished(tmp_path, moto_server, s3_proxy):
    s3_client(moto_server).create_bucket(Bucket=BUCKET)
    kv = random_kv(L, 2 * CHUNK, H, D, seed=5)
    m = pack_kv(kv, tmp_path / "src", cartridge_id="cat-doc", model=MODEL, kind="first_k",
                token_ids=list(range(70, 70 + 2 * CHUNK)), chunk_size=CHUNK)
    cfg_path = write_yaml(tmp_path, tmp_path / "host" / "reg.db")
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["extra_config"].update({"storage_plugin.cartridge.s3.endpoint_url": s3_proxy.endpoint_url,
                                "storage_plugin.cartridge.catalog_uri": CATALOG,
                                "storage_plugin.cartridge.catalog_period": 0.2})
    cfg_path.write_text(yaml.safe_dump(cfg))
    config = load_config(cfg_path)
    md = make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK)
    settings = S3Settings(endpoint_url=s3_proxy.endpoint_url)
    with Engine(config, md) as eng:
        sync = start_catalog_sync(PluginSettings.from_config(config, CartridgeStoragePlugin), config.chunk_size)
        try:
            publish(tmp_path / "src", CATALOG, settings)
            assert _wait(lambda: eng.engine.lookup(m.token_ids + [1]) == 2 * CHUNK)
            eng.clear_local_cpu()
            n, got = eng.retrieve(m.token_ids + [1])
            assert n == 2 * CHUNK and torch.equal(got[:, :, :n], flat(kv))
            assert s3_proxy.count("GET", r"/kv\.bin$") >= 1  # the bytes came from the catalog
            unpublish("cat-doc", CATALOG, settings)
            assert _wait(lambda: eng.engine.lookup(m.token_ids + [1]) == 0)
        finally:
            sync.stop()

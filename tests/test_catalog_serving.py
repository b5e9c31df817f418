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


def test_gateway_syncs_the_catalog_into_its_own_registry(tmp_path, moto_server, s3_proxy):
    """A gateway started with the plugin's YAML (`catalog_uri` set) keeps its own registry in step
    with the S3 catalog: no disk shared with the servers (a fleet's gateways on other hosts).
    Run as a user runs it: `lmcache-cartridge gateway --config ...` in its own process."""
    import subprocess
    import sys

    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    s3_client(moto_server).create_bucket(Bucket=BUCKET)
    kv = random_kv(L, CHUNK, H, D, seed=6)
    pack_kv(kv, tmp_path / "src", cartridge_id="gw-doc", model=MODEL, kind="first_k",
            token_ids=list(range(90, 90 + CHUNK)), chunk_size=CHUNK)
    reg_path = tmp_path / "gateway-host" / "reg.db"
    cfg_path = write_yaml(tmp_path, reg_path)
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["extra_config"].update({"storage_plugin.cartridge.s3.endpoint_url": s3_proxy.endpoint_url,
                                "storage_plugin.cartridge.catalog_uri": CATALOG,
                                "storage_plugin.cartridge.catalog_period": 0.2})
    cfg_path.write_text(yaml.safe_dump(cfg))
    model = str(ensure_test_model())
    gw = subprocess.Popen([sys.executable, "-m", "lmcache_cartridge.tools.cli", "gateway", "--config", str(cfg_path),
                           "--upstream", "http://127.0.0.1:9", "--model", model, "--port", "0"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        settings = S3Settings(endpoint_url=s3_proxy.endpoint_url)
        publish(tmp_path / "src", CATALOG, settings)
        has = lambda: reg_path.exists() and Registry(reg_path).get("gw-doc") is not None  # noqa: E731
        assert _wait(has, timeout=60), gw.stderr.read1().decode() if gw.poll() is not None else "not synced"
        unpublish("gw-doc", CATALOG, settings)
        assert _wait(lambda: not has(), timeout=60)
        assert gw.poll() is None  # still serving
    finally:
        gw.terminate()
        gw.wait(10)

"""The deployment files configure what the code expects (no Docker or Kubernetes here): the
production-stack values' LMCACHE_* variables, loaded by LMCache's own config loader, give a
config the plugin accepts and that agrees with configs/lmcache-cartridge.yaml; the vLLM flag names
the real connector; the Dockerfile's import check names modules that exist."""

import importlib
import json
import re
from pathlib import Path

import yaml

from lmcache_cartridge.cartridge.keys import hash_config_problem
from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
from lmcache_cartridge.lmcache.settings import PluginSettings
from lmcache_cartridge.store.s3 import S3Settings, parse_s3_uri

ROOT = Path(__file__).resolve().parent.parent
VALUES = ROOT / "deploy" / "helm" / "values-cartridges.yaml"


def model_spec():
    return yaml.safe_load(VALUES.read_text())["servingEngineSpec"]["modelSpec"][0]


def test_values_env_loads_through_lmcache_into_a_config_the_plugin_accepts(monkeypatch):
    from lmcache.v1.config import LMCacheEngineConfig

    for k in [k for k in __import__("os").environ if k.startswith("LMCACHE_")]:
        monkeypatch.delenv(k)
    env = {e["name"]: e["value"] for e in model_spec()["env"] if "value" in e}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    config = LMCacheEngineConfig.from_env()
    settings = PluginSettings.from_config(config, CartridgeStoragePlugin)
    assert settings.name == "cartridge" and hash_config_problem(config.pre_caching_hash_algorithm) is None
    parse_s3_uri(settings.catalog_uri)
    assert settings.catalog_period > 0
    S3Settings.from_mapping(settings.s3)
    reference = LMCacheEngineConfig.from_file(str(ROOT / "configs" / "lmcache-cartridge.yaml"))
    for field in ("chunk_size", "local_cpu", "storage_plugins", "store_location", "pre_caching_hash_algorithm"):
        assert getattr(config, field) == getattr(reference, field), field
    for key in ("module_path", "class_name"):
        k = f"storage_plugin.cartridge.{key}"
        assert config.extra_config[k] == reference.extra_config[k]
    assert any(e["name"] == "LMCACHE_CARTRIDGE_INSTANCE" for e in model_spec()["env"])
    # one home: the server's registry and cache dir are the CLI's defaults in the same container
    from lmcache_cartridge.paths import default_cache_dir, default_registry_path

    assert env["LMCACHE_CARTRIDGE_HOME"] in docker_env()["LMCACHE_CARTRIDGE_HOME"]
    assert (settings.registry, settings.cache_dir) == (default_registry_path(), default_cache_dir())
    assert str(settings.registry).startswith(env["LMCACHE_CARTRIDGE_HOME"])


def docker_env() -> dict[str, str]:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    block = re.search(r"^ENV (.+?)(?=^\S|\Z)", text, re.S | re.M).group(1)
    return dict(re.findall(r"(\w+)=(\S+)", block))


def test_replicas_share_no_single_node_volume_and_the_image_has_the_configs():
    """Three replicas and one ReadWriteOnce claim (the chart makes one per modelSpec) cannot
    run on three nodes; the image ships configs/ (the LMCache YAML the README starts from)."""
    spec = model_spec()
    assert not (spec.get("replicaCount", 1) > 1 and spec.get("pvcStorage")
                and "ReadWriteMany" not in (spec.get("pvcAccessMode") or []))
    assert re.search(r"^COPY configs ", (ROOT / "deploy" / "Dockerfile").read_text(), re.M)


def test_values_start_vllm_with_the_cartridge_connector():
    args = model_spec()["vllmConfig"]["extraArgs"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    cls = getattr(importlib.import_module(kv["kv_connector_module_path"]), kv["kv_connector"])
    assert cls.__name__ == "CartridgeConnector" and kv["kv_role"] == "kv_both"
    assert model_spec()["vllmConfig"]["prometheusMultiprocDir"]


def test_dockerfile_import_check_names_real_modules():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    mods = re.search(r'python3 -c "import ([^"]+)"', text).group(1).split(", ")
    assert "lmcache_cartridge.plugin" in mods
    for m in mods:
        importlib.import_module(m)

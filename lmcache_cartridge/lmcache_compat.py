"""Where LMCache keeps the names this package uses that moved between its releases: the one module
that knows LMCache's layout.

LMCache 0.5.7 moved its in-process engine (the code vLLM's `LMCacheConnectorV1` runs: the cache
engine, token database, GPU connectors, the vLLM adapter) from `lmcache.v1` / `lmcache.integration`
to `lmcache.inprocess.*`, with no import shims left behind. Everything else this package uses
(the storage plugin interface, configs, memory objects, the multiprocess server and its L2
adapter interface) stayed where it was and is imported from LMCache directly. Every name below is
imported through here (`from lmcache_cartridge.lmcache_compat import LMCacheEngineBuilder`), and
no other module of the package, its tests or its benchmarks imports a module in `MOVED_MODULES`
(tests/test_lmcache_compat.py holds them to that).

Resolution is lazy (a name is imported on first use, as the import it replaces was) and looks at
the installed LMCache once: the first layout of `LAYOUTS` whose probe module exists. Where none
does, `LMCacheLayoutError` names the installed release and the supported ones.

Runs wherever LMCache is imported: vLLM's processes, `lmcache server`, the CLI, tests.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType

from lmcache_cartridge.errors import CartridgeError

SUPPORTED = "0.5.6 and 0.5.7 (0.5.7rc2)"


class LMCacheLayoutError(CartridgeError, ImportError):
    """The installed LMCache keeps its in-process engine where no supported release does."""


@dataclass(frozen=True)
class Layout:
    """One release's layout: `release` names it, `inprocess` is the package its in-process engine
    lives under (`lmcache.v1.cache_engine` in 0.5.6 is `lmcache.inprocess.v1.cache_engine` in 0.5.7)."""

    release: str
    inprocess: str

    @property
    def probe(self) -> str:
        """The module whose presence tells this layout apart (found without importing it)."""
        return f"{self.inprocess}.v1.cache_engine"

    def module(self, suffix: str) -> str:
        return f"{self.inprocess}.{suffix}"


# Newest first: 0.5.7 also ships `lmcache.v1` (the shared code), never `lmcache.v1.cache_engine`.
LAYOUTS = (Layout("0.5.7", "lmcache.inprocess"), Layout("0.5.6", "lmcache"))

# Our name -> (module under the layout's in-process package, attribute). A name not listed here
# did not move: import it from LMCache itself.
MOVED: dict[str, tuple[str, str]] = {
    "ChunkedTokenDatabase": ("v1.token_database", "ChunkedTokenDatabase"),
    "LMCacheEngineBuilder": ("v1.cache_engine", "LMCacheEngineBuilder"),
    "GPUConnectorInterface": ("v1.gpu_connector.gpu_connectors", "GPUConnectorInterface"),
    "VLLMPagedMemGPUConnectorV2": ("v1.gpu_connector.gpu_connectors", "VLLMPagedMemGPUConnectorV2"),
    "LMCacheConnectorV1Impl": ("integration.vllm.vllm_v1_adapter", "LMCacheConnectorV1Impl"),
    "LoadSpec": ("integration.vllm.vllm_v1_adapter", "LoadSpec"),
}
# The module whose `CreateGPUConnector` LMCache's vLLM service factory resolves at call time (the
# CPU and CUDA connector hooks replace that function there).
GPU_CONNECTOR_MODULE = "v1.gpu_connector"
# Modules of the in-process engine (0.5.6 spelling) that no module but this one may import.
MOVED_MODULES = frozenset({"lmcache.v1.token_database", "lmcache.v1.cache_engine", "lmcache.v1.gpu_connector",
                           "lmcache.v1.gpu_connector.gpu_connectors", "lmcache.v1.manager",
                           "lmcache.v1.lookup_client", "lmcache.v1.cache_controller",
                           "lmcache.integration.vllm.vllm_v1_adapter",
                           "lmcache.integration.vllm.vllm_service_factory"})


def lmcache_version() -> str:
    try:
        return metadata.version("lmcache")
    except metadata.PackageNotFoundError:
        return "not installed"


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


@functools.lru_cache(maxsize=None)
def layout() -> Layout:
    """The installed LMCache's layout (looked up once per process)."""
    for lay in LAYOUTS:
        if _exists(lay.probe):
            return lay
    raise LMCacheLayoutError(
        f"LMCache {lmcache_version()} keeps its in-process engine in neither "
        f"{' nor '.join(lay.probe for lay in LAYOUTS)}: lmcache_cartridge supports LMCache {SUPPORTED}. "
        "Install one of them (pip install 'lmcache==0.5.6').")


def describe() -> str:
    """One line: the installed release and where its in-process engine was found."""
    lay = layout()
    return f"LMCache {lmcache_version()}: {lay.release} layout, in-process engine under {lay.inprocess}.v1"


def gpu_connector_module() -> ModuleType:
    """LMCache's in-process GPU connector package (where `CreateGPUConnector` lives)."""
    return importlib.import_module(layout().module(GPU_CONNECTOR_MODULE))


def where(name: str) -> str:
    """`module:attribute` a moved name resolves to here."""
    suffix, attr = MOVED[name]
    return f"{layout().module(suffix)}:{attr}"


def moved_module(name: str) -> ModuleType:
    """The module a moved name lives in here (its source, for a test that reads LMCache's own)."""
    return importlib.import_module(where(name).split(":")[0])


def resolve(name: str):
    suffix, attr = MOVED[name]
    module = layout().module(suffix)
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise LMCacheLayoutError(f"LMCache {lmcache_version()} ({layout().release} layout) has no {module}.{attr} "
                                 f"({type(e).__name__}: {e}); lmcache_cartridge supports LMCache {SUPPORTED}") from e


def __getattr__(name: str):  # PEP 562: `from lmcache_cartridge.lmcache_compat import LoadSpec`
    if name in MOVED:
        value = resolve(name)
        globals()[name] = value  # resolved once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Start a host's catalog sync from the plugin's settings (`storage_plugin.<name>.catalog_*`).

Where it runs: inside the serving process, called once by the plugin's constructor; the sync
itself is a daemon thread (`store.catalog.CatalogSync`) writing the same SQLite registry the
plugin watches, so a published cartridge reaches the plugin through its ordinary registry
refresh. Several plugin instances on one host (TP ranks, the scheduler-side plugin) may all call
this: an `flock` under the cache dir lets one of them sync at a time, the others skip.

    extra_config:
      storage_plugin.cartridge.catalog_uri: s3://bucket/catalog/
      storage_plugin.cartridge.catalog_period: 30      # seconds (default 30)
      storage_plugin.cartridge.s3.endpoint_url: ...    # the same S3 settings chunk reads use
"""

from __future__ import annotations

import logging

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.lmcache.settings import PluginSettings
from lmcache_cartridge.store.catalog import CatalogSync
from lmcache_cartridge.store.registry import Registry
from lmcache_cartridge.store.s3 import S3Settings

logger = logging.getLogger("lmcache_cartridge.plugin")

def start_catalog_sync(settings: PluginSettings, chunk_size: int | None = None) -> CatalogSync | None:
    """A started `CatalogSync` when `catalog_uri` is set, else None. Bad settings raise
    `CartridgeError` (the plugin logs it); S3 trouble later is logged by the sync, never raised."""
    uri = settings.catalog_uri
    if not uri:
        return None
    try:
        period = float(settings.catalog_period)
        sync = CatalogSync(Registry(settings.registry), str(uri), S3Settings.from_mapping(settings.s3), period,
                           cache_dir=settings.cache_dir, chunk_size=chunk_size,
                           allow_uris=tuple(settings.catalog_allow_uris))
    except ValueError as e:
        raise CartridgeError(f"storage_plugin.{settings.name}.catalog_*: {e}") from e
    logger.info("lmcache_cartridge: syncing catalog %s into %s every %gs", sync.catalog_uri,
                settings.registry, period)
    return sync.start()

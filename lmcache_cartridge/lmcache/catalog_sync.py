"""Build a host's catalog sync from its settings (`catalog_uri`, `catalog_period`,
`catalog_allow_uris`, `registry`, `s3`, `cache_dir`: the plugin's `storage_plugin.<name>.catalog_*`
or the gateway's same-named flags), and start the plugin's.

Where it runs: inside the serving process or the gateway's. `catalog_sync` builds the one
`store.catalog.CatalogSync` either uses: the plugin's constructor starts it through
`start_catalog_sync`; the gateway's app (`api.gateway.create_app`) builds it once and its
lifespan starts and stops it. The sync itself is a daemon thread writing the same SQLite
registry the plugin watches, so a published cartridge reaches the plugin through its ordinary
registry refresh. Several plugin instances on one host (TP ranks, the scheduler-side plugin) may
all start one: an `flock` under the cache dir lets one of them sync at a time, the others skip.

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


def catalog_sync(settings, chunk_size: int | None = None) -> CatalogSync | None:
    """The `CatalogSync` for `settings` (the plugin's `PluginSettings` or the gateway's
    `GatewaySettings`: the fields this module's docstring names), not started; None when no
    `catalog_uri` is set. A setting it cannot use (a period that would spin, a URI that is not
    s3://) raises ValueError naming it."""
    uri = settings.catalog_uri
    if not uri:
        return None
    return CatalogSync(Registry(settings.registry), str(uri), S3Settings.from_mapping(settings.s3),
                       float(settings.catalog_period), cache_dir=settings.cache_dir, chunk_size=chunk_size,
                       allow_uris=tuple(settings.catalog_allow_uris))


def start_catalog_sync(settings: PluginSettings, chunk_size: int | None = None) -> CatalogSync | None:
    """A started `catalog_sync` when `catalog_uri` is set, else None. Bad settings raise
    `CartridgeError` (the plugin logs it); S3 trouble later is logged by the sync, never raised."""
    try:
        sync = catalog_sync(settings, chunk_size)
    except ValueError as e:
        raise CartridgeError(f"storage_plugin.{settings.name}.catalog_*: {e}") from e
    if sync is None:
        return None
    logger.info("lmcache_cartridge: syncing catalog %s into %s every %gs", sync.catalog_uri,
                settings.registry, sync.period)
    return sync.start()

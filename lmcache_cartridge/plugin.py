"""The entry point users name in LMCache's YAML (`module_path: lmcache_cartridge.plugin`).

A stable re-export: the plugin itself lives in `lmcache_cartridge.lmcache.plugin`.
"""

from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin

__all__ = ["CartridgeStoragePlugin"]

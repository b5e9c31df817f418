"""The entry point users name in vLLM's `--kv-transfer-config`
(`"kv_connector_module_path": "lmcache_cartridge.connector"`).

A stable re-export: the connector itself lives in `lmcache_cartridge.vllm.connector`.
"""

from lmcache_cartridge.vllm.connector import CartridgeConnector

__all__ = ["CartridgeConnector"]

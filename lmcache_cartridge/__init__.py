"""lmcache_cartridge: serve KV cache cartridges to vLLM through LMCache's storage-plugin path."""

__version__ = "0.1.0"

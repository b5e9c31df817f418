"""Stage 2, where a cartridge's bytes live: the registry that indexes them, the origins they come
from (local directory, S3), and the tiers that keep them close (CPU, disk cache) with counters.

Imports only `cartridge`; used by the LMCache plugin, the gateway and the CLI.
"""

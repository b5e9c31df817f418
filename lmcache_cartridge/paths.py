"""Where lmcache_cartridge keeps files on this machine: the one place that reads the env for it
and the one place that names every default path.

Runs in every process (CLI, gateway, the plugin inside vLLM); owns nothing, only computes paths.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_HOME = "LMCACHE_CARTRIDGE_HOME"


def cache_root() -> Path:
    """Root of everything we cache (test models, downloads, registry by default).

    `$LMCACHE_CARTRIDGE_HOME` if set, else `~/.cache/lmcache_cartridge`.
    """
    env = os.environ.get(ENV_HOME)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lmcache_cartridge"


def default_registry_path() -> Path:
    """The SQLite registry used when no config or flag names one."""
    return cache_root() / "registry.db"


def default_cache_dir() -> Path:
    """The plugin's cache dir (disk tier, S3 manifests, published serving state) by default.

    One per host (per user): every plugin instance on the host, each TP rank and each server,
    resolves the same directory and shares its disk tier (`store.disk_cache`: one index, one
    budget). It must be on a local filesystem; set `cache_dir` (or `$LMCACHE_CARTRIDGE_HOME`)
    to the same path for instances running under different users or containers."""
    return cache_root() / "cache"


def default_packed_dir() -> Path:
    """Where re-chunked copies made at registration go by default."""
    return cache_root() / "packed"


def vllm_cache_dir() -> Path:
    """VLLM_CACHE_ROOT of the vLLM servers we start (demo, `create`'s KV maker, tests,
    benchmarks), unless the environment sets one: vLLM keys its torch.compile artifacts by its
    config and source hashes and saves them atomically, so servers of one model share them and
    every start after the first skips the ~25 s compile."""
    env = os.environ.get("VLLM_CACHE_ROOT")
    return Path(env).expanduser() if env else cache_root() / "vllm"


def models_dir() -> Path:
    return cache_root() / "models"

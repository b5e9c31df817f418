"""Where lmcache_cartridge keeps files on this machine: the one place that reads the env for it."""

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


def models_dir() -> Path:
    return cache_root() / "models"

"""Where lmcache_cartridge keeps files on this machine: the one place that reads the env for it
and the one place that names every default path.

Runs in every process (CLI, gateway, the plugin inside vLLM); owns nothing, only computes paths.
"""

from __future__ import annotations

import os
from pathlib import Path

from lmcache_cartridge.settings_reference import HOME

ENV_HOME = HOME.name


def cache_root() -> Path:
    """Root of everything we cache (test models, downloads, registry by default).

    `$LMCACHE_CARTRIDGE_HOME` if set, else `~/.cache/lmcache_cartridge`.
    """
    return Path(os.environ.get(ENV_HOME) or HOME.default).expanduser()


def default_registry_path() -> Path:
    """The SQLite registry used when no config or flag names one."""
    return cache_root() / "registry.db"


def default_cache_dir() -> Path:
    """The plugin's cache dir (disk tier, S3 manifests, published serving state) by default.

    One per host and user: every plugin instance on the host, each TP rank and each server,
    resolves the same directory and shares its disk tier (`store.disk_cache`: one index, one
    budget). It must be on a local filesystem, and private (`private_dir`): its files are served
    as KV after one check per process, so nobody else may write there. Set `cache_dir` (or
    `$LMCACHE_CARTRIDGE_HOME`) to the same path for containers running as the same user."""
    return cache_root() / "cache"


def private_dir(path: Path) -> Path:
    """`path`, created 0700 if missing, once it is certain that only this user can write there:
    a directory (not a symlink) owned by this user, without group or other write permission.
    Where it runs: the plugin and the gateway at start, for the cache dir. Why: a disk-cache
    chunk is verified on its first read in a process and trusted after; another local user who
    could swap a file, or plant a symlink where a temp or state file is written, would choose the
    KV served (or what we overwrite). Raises PermissionError saying how to fix it."""
    import stat

    path = Path(path)
    if not path.exists() and not path.is_symlink():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} must be a directory, not a symlink or file: the cache dir is served from")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise PermissionError(f"{path} is owned by uid {st.st_uid}, not this user ({os.geteuid()}): the cache dir "
                              f"must be private (chown it, or set cache_dir to a directory of your own)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): the cache "
                              f"dir must be private (chmod go-w {path})")
    return path


def default_packed_dir() -> Path:
    """Where re-chunked copies made at registration go by default."""
    return cache_root() / "packed"


def vllm_cache_dir() -> Path:
    """VLLM_CACHE_ROOT of the vLLM servers we start (demo, `create`'s KV maker, tests,
    benchmarks), unless the environment sets one."""
    env = os.environ.get("VLLM_CACHE_ROOT")
    return Path(env).expanduser() if env else cache_root() / "vllm"


def inductor_cache_dir() -> Path:
    """TORCHINDUCTOR_CACHE_DIR of the vLLM servers we start, unless the environment sets one:
    torch's default lives under the temp dir, and each of our servers has a private one (vLLM's
    IPC sockets), so without this every start compiled the model again (~25 s on the tiny test
    model, minutes on a real one). Inductor keys its entries by graph, inputs and code, and
    writes them atomically: servers of one model share them."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(env).expanduser() if env else vllm_cache_dir() / "inductor"


def models_dir() -> Path:
    return cache_root() / "models"

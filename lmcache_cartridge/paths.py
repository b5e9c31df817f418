"""Where lmcache_cartridge keeps files on this machine: the one place that reads the env for it
and the one place that names every default path.

Runs in every process (CLI, gateway, the plugin inside vLLM); owns nothing, only computes paths.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO, Iterator

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
    chunk is verified on its first read in a process and trusted after while its file looks
    unchanged (`disk_cache._signature`); another local user who could swap a file, or plant a
    symlink where a temp or state file is written, would choose the KV served (or what we
    overwrite). Raises PermissionError saying how to fix it."""
    import stat

    path = Path(path)
    if not path.exists() and not path.is_symlink():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:  # another process made it first: checked below like any other
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
    writes them atomically: servers of one model share them. Importing vLLM writes torch's
    default into this process's environment: that value is torch's, not a choice of the user's."""
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env and env != _torch_default_inductor_dir():
        return Path(env).expanduser()
    return vllm_cache_dir() / "inductor"


def _torch_default_inductor_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch: no default to tell apart
        return None
    return default_cache_dir()


def models_dir() -> Path:
    return cache_root() / "models"


# --- atomic writes ------------------------------------------------------------------------------
# Every file or directory the package publishes for another process (or a later run) to read is
# written here: into a temp name of its own beside the target (two writers never share one),
# flushed to disk, renamed into place with one `os.replace`/`os.rename`, and the directory synced
# so the rename itself survives a crash. A reader sees the old content or the new, never half.
# Temp names start with "." and end with ".tmp" (files) or hold ".tmp-" (directories).
def fsync_dir(path: str | os.PathLike) -> None:
    """Sync a directory's entries (a rename in it) to disk, where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory: the rename is still atomic
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_open(path: str | os.PathLike, *, mode: int = 0o644, durable: bool = True) -> Iterator[BinaryIO]:
    """A binary file to write whose bytes become `path` whole when the block ends without an
    exception (mode `mode`); on an exception `path` is untouched and the temp file removed.
    `durable=False` skips the syncs, for records rewritten every few seconds that mean nothing
    after a crash (still atomic). For writers that stream (`torch.save(obj, f)`); `atomic_write`
    for bytes at hand."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, data: bytes | str, *, mode: int = 0o644, durable: bool = True) -> Path:
    """Replace `path` with `data` (str: UTF-8) atomically and durably (`atomic_open`)."""
    with atomic_open(path, mode=mode, durable=durable) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


@contextmanager
def atomic_dir(path: str | os.PathLike, *, replace: bool = False, mode: int = 0o755) -> Iterator[Path]:
    """A new empty directory beside `path` to fill; when the block ends without an exception its
    files are synced and it becomes `path` whole (mode `mode`). Where `path` already exists:
    `replace` moves the old one aside and removes it after the new one is in place; otherwise
    the new one is discarded and the existing one kept (another writer made it first: for
    content-addressed directories, the same content). On an exception nothing changes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        for f in sorted(tmp.rglob("*")):
            if f.is_file() and not f.is_symlink():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        for d in (*sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True), tmp):
            fsync_dir(d)
        os.chmod(tmp, mode)
        if replace and path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.rename(path, old / path.name)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, path)
            except OSError:
                if not path.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # made meanwhile by another writer: theirs stays
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def opened_beneath(path: Path, root: Path) -> Iterator[tuple[Path, Path]]:
    """The regular file `path` (already resolved, under `root`) opened once, walking from `root`
    one component at a time without following a symlink (`O_NOFOLLOW`), so that what was checked
    is what is read: a name flipped to a symlink after the check fails to open (`OSError`)
    instead of reading another file. Yields `/proc/self/fd/` paths to the open file and to its
    open directory: opening them reaches those very inodes, whatever their names now point at.
    A FIFO or device is refused (opened without blocking, then checked)."""
    import stat

    parts = path.relative_to(root).parts
    if not parts:
        raise IsADirectoryError(f"{path} is the allowed directory itself, not a file in it")
    fds = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            fds.append(os.open(part, flags, dir_fd=fds[-1]))
        if not stat.S_ISREG(os.fstat(fds[-1]).st_mode):
            raise IsADirectoryError(f"{path} is not a regular file")
        os.set_blocking(fds[-1], True)
        yield Path(f"/proc/self/fd/{fds[-1]}"), Path(f"/proc/self/fd/{fds[-2]}")
    finally:
        for fd in fds:
            os.close(fd)

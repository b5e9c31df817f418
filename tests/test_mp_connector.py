"""`CartridgeMPConnector`'s scheduler side, fast: the readiness rule over LMCache's MP lookup
(`LMCacheMPConnector.get_num_new_matched_tokens` itself, over a stand-in for its scheduler adapter,
the one piece that talks to the server), and the notices of a failed asynchronous load. The
real-server proofs: `test_mp_trained_e2e.py`.
"""

from __future__ import annotations

import pytest

from lmcache_cartridge.vllm.load_failure import NO_RECOMPUTE_PARAM
from lmcache_cartridge.vllm.readiness import RELOOKUP_INTERVAL_S, TRAINED_TOKENS_PARAM, ReadinessGate

CHUNK = 256
TRAINED = 2 * CHUNK


class FakeSchedulerAdapter:
    """LMCache's `LMCacheMPSchedulerAdapter` as the connector's lookup uses it: `answers` are what
    the server's lookup returns, one per submitted lookup (None: still running)."""

    lmcache_tokens_per_chunk = CHUNK

    def __init__(self, answers: list[int | None]) -> None:
        self.answers = answers
        self.pending: dict[str, int | None] = {}
        self.submitted = 0
        self.freed: list[tuple[str, int, int]] = []
        self.cleaned: list[str] = []

    # LMCache 0.5.6 passes `token_ids`, 0.5.7 `packed_token_ids` and a chunk-aligned `start`
    def maybe_submit_lookup_request(self, rid, token_ids=None, cache_salt="", request_configs=None,
                                    reserve_last_token=False, packed_token_ids=None, start=0):
        if rid in self.pending:
            return False
        self.submitted += 1
        self.pending[rid] = self.answers.pop(0)
        return True

    def check_lookup_result(self, rid):
        return self.pending.get(rid, 0)

    def cleanup_lookup_result(self, rid):
        self.cleaned.append(rid)
        self.pending.pop(rid, None)

    def free_lookup_locks(self, token_ids=None, start=0, end=0, request_id="", cache_salt="", request_configs=None,
                          packed_token_ids=None, extra_ranges=()):
        assert (token_ids is None) != (packed_token_ids is None), "LMCache's own keyword for its release"
        self.freed.append((request_id, start, end))

    def end_session(self, rid):
        pass


class FakeWorkerAdapter:
    """LMCache's worker adapter as `get_finished` uses it: nothing of its own finished."""

    def get_finished(self, finished_req_ids):
        return set(finished_req_ids), set()

    def get_block_ids_with_load_errors(self):
        return set()


def _request(rid: str, prompt: int = TRAINED + 40):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = {NO_RECOMPUTE_PARAM: True, TRAINED_TOKENS_PARAM: TRAINED}
    return Request(rid, list(range(prompt)), SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}),
                   None)


@pytest.fixture
def make(monkeypatch):
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnectorStats

    from lmcache_cartridge.vllm.mp_connector import CartridgeMPConnector

    def build(answers, now):
        c = CartridgeMPConnector.__new__(CartridgeMPConnector)  # no server: the scheduler's lookup path only
        c._gate = ReadinessGate(5.0, clock=lambda: now[0])
        c._lookups = None
        c._composer = None
        c._short, c._doomed, c._recv_pending, c._two_notices = {}, set(), set(), {}
        c._failed_blocks, c._failed_recv = set(), set()
        c._can_store, c._report_request_errors = True, False
        c._group_tokens_per_block = [16]
        c.worker_adapter = FakeWorkerAdapter()
        c.scheduler_adapter = FakeSchedulerAdapter(answers)
        c.request_trackers = {}
        c.lazy_offload = False
        c._connector_stats = LMCacheMPConnectorStats()
        c._hit_alignment_tokens = 16
        c._reserve_last_token_for_lookup = False
        return c

    return build


def test_a_short_lookup_is_released_and_asked_again_until_the_cartridge_is_there(make):
    now = [0.0]
    c = make([CHUNK, TRAINED], now)
    req = _request("r1")
    assert c.get_num_new_matched_tokens(req, 0) == (None, False)      # half of it on the server: waits
    tracker = c._get_request_tracker("r1")
    assert c.scheduler_adapter.freed == [("r1", 0, CHUNK)]            # the short hit's locks freed ...
    assert c.scheduler_adapter.cleaned == ["r1"] and tracker.num_lmcache_hit_tokens == 0  # ... and forgotten
    assert c.get_num_new_matched_tokens(req, 0) == (None, False)      # held: no new lookup before the interval
    assert c.scheduler_adapter.submitted == 1
    now[0] += RELOOKUP_INTERVAL_S
    assert c.get_num_new_matched_tokens(req, 0) == (TRAINED, True)    # asked again: all of it, loaded async
    assert c.scheduler_adapter.submitted == 2 and tracker.num_lmcache_hit_tokens == TRAINED


def test_a_running_lookup_is_left_alone_and_the_deadline_fails_the_load_on_the_worker(make, monkeypatch):
    from lmcache.integration.vllm import lmcache_mp_connector as lmc
    from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPConnectorMetadata, LMCacheMPRequestMetadata
    from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

    now = [0.0]
    c = make([None], now)
    req = _request("r2")
    assert c.get_num_new_matched_tokens(req, 0) == (None, False)
    assert c.scheduler_adapter.cleaned == [] and c.scheduler_adapter.freed == []  # still running: untouched
    now[0] += 6.0
    # out of time: the cartridge's tokens promised as an asynchronous hit whose load must fail
    assert c.get_num_new_matched_tokens(req, 0) == (TRAINED, True)
    t = c._get_request_tracker("r2")
    assert t.num_lmcache_hit_tokens == t.num_stored_tokens == TRAINED and "r2" in c._doomed

    # LMCache plans the retrieves of the step (a stand-in: its planning needs a scheduler output);
    # the promised one never reaches the server: the worker reports its blocks, past the 16 tokens
    # (one block) vLLM already holds, as failed, and the request as received
    import dataclasses

    # the op's tokens: `token_ids` (LMCache 0.5.6) or packed `token_bytes` (0.5.7)
    no_tokens = {"token_ids": []} if "token_ids" in {f.name for f in dataclasses.fields(LoadStoreOp)} \
        else {"token_bytes": b""}

    def planned(self, scheduler_output):
        md = LMCacheMPConnectorMetadata()
        for rid, blocks in (("r2", [[7, 8, 9]]), ("ok", [[3]])):
            md.add_request_metadata(LMCacheMPRequestMetadata(rid, "RETRIEVE", LoadStoreOp(
                **no_tokens, block_ids=blocks, start=0, end=48, skip_first_n_tokens=16 if rid == "r2" else 0)))
        return md

    monkeypatch.setattr(lmc.LMCacheMPConnector, "build_connector_meta", planned)
    md = c.build_connector_meta(None)
    assert [m.request_id for m in md.requests] == ["ok"] and md.cartridge_failed_loads == {"r2": [8, 9]}
    assert c._recv_pending == {"r2", "ok"} and not c._doomed
    monkeypatch.setattr(lmc.LMCacheMPConnector, "start_load_kv", lambda self, fc, **kw: None)
    c.bind_connector_metadata(md)
    c.start_load_kv(None)
    assert c.get_block_ids_with_load_errors() == {8, 9} and c.get_block_ids_with_load_errors() == set()
    assert c.get_finished(set()) == (set(), {"r2"}) and c.get_finished(set()) == (set(), set())


def test_prefix_cache_covering_the_cartridge_is_ready_without_a_lookup_result(make):
    now = [0.0]
    c = make([None], now)
    now[0] += 6.0
    # the lookup has not finished, but vLLM's own prefix cache holds the whole cartridge: ready
    assert c.get_num_new_matched_tokens(_request("r3"), TRAINED) == (None, True)
    assert not c._doomed


@pytest.mark.parametrize("steps", [
    [("recv",), ("send",)],            # receive first, then the send frees it
    [("send",), ("recv",)],            # send first, then the receive frees it
    [("recv", "send")],                # both in one step: the send frees it
])
def test_a_request_finished_while_loading_reaches_vllm_as_exactly_one_notice(make, steps):
    from vllm.v1.outputs import KVConnectorOutput

    c = make([], [0.0])
    c.lazy_offload = False
    c._kv_cache_events = []
    c._recv_pending = {"bad"}                       # its retrieve went out
    req = _request("bad")
    c._get_or_create_request_tracker(req)
    assert c.request_finished(req, [])[0] is True   # failed by the policy (or aborted): LMCache delays its free
    seen = []
    for step in steps:
        out = KVConnectorOutput(finished_recving={"bad", "other"} if "recv" in step else {"other"},
                                finished_sending={"bad", "other"} if "send" in step else set())
        c.update_connector_output(out)
        assert "other" in out.finished_recving  # other requests' notices untouched
        seen += [k for k, ids in (("recv", out.finished_recving), ("send", out.finished_sending)) if "bad" in ids]
    assert len(seen) == 1 and c._two_notices == {}


def test_one_notice_is_expected_when_the_receive_is_in_or_the_free_not_delayed(make):
    from vllm.v1.outputs import KVConnectorOutput

    c = make([], [0.0])
    c.lazy_offload = False
    c._kv_cache_events = []
    for rid, pending, can_store in (("received", False, True), ("consumer", True, False)):
        c._can_store = can_store
        c._recv_pending = {rid} if pending else set()
        req = _request(rid)
        c._get_or_create_request_tracker(req)
        c.request_finished(req, [])
        out = KVConnectorOutput(finished_recving={rid}, finished_sending=set())
        c.update_connector_output(out)
        assert out.finished_recving == {rid} and c._two_notices == {}  # passed through: vLLM frees it


def _server_record(cache_dir, registry, endpoint: str, instance: str):
    """A live `lmcache server` adapter's serving-state record (this process's), as the adapter
    publishes it."""
    import os
    import socket
    import time

    from lmcache_cartridge.store.serving_state import ServingState, process_start, publish

    now = time.time()
    publish(cache_dir, ServingState(instance=instance, host=socket.gethostname(), pid=os.getpid(),
                                    pid_start=process_start(os.getpid()), started=now, updated=now,
                                    refresh_seconds=60.0, role="mp-server", model="m", models=("m",), rank=0,
                                    world_size=1, registry=str(registry), endpoint=endpoint))


def test_composites_are_built_into_the_registry_of_the_attached_servers_adapter(tmp_path, caplog):
    """MP mode: the composite a request's recipe names is built by `HostComposer` into the registry
    that the record of the adapter at vLLM's endpoint names (not another server's), with its
    directory under that adapter's cache dir. Before that record exists: nothing built, the reason
    logged once, and a later request naming the same recipe builds it."""
    import logging
    import time

    from vllm import SamplingParams
    from vllm.v1.request import Request

    from lmcache_cartridge.cartridge.packed import VocabInfo, pack_kv
    from lmcache_cartridge.store.composite import recipe
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.vllm.composites import COMPOSE_PARAM, HostComposer
    from lmcache_cartridge.vllm.mp_connector import ServerRegistry
    from test_vllm_e2e import _trained_kv

    cache, ours, other = tmp_path / "cache", Registry(tmp_path / "ours.db"), Registry(tmp_path / "other.db")
    parts = []
    for name, seed in (("a", 1), ("b", 2)):
        pack_kv(_trained_kv(seed), tmp_path / name, cartridge_id=name, model="m", kind="trained",
                vocab=VocabInfo(1000, (0, 1, 2, 3)), chunk_size=CHUNK)
        parts.append(ours.register(tmp_path / name))
        other.register(tmp_path / name)
    wire = recipe(parts, 0)

    def ask(rid: str) -> None:
        params = {COMPOSE_PARAM: [wire], NO_RECOMPUTE_PARAM: True, TRAINED_TOKENS_PARAM: 2 * CHUNK}
        composer.submit(Request(rid, list(range(2 * CHUNK + 8)),
                                SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None))
        deadline = time.time() + 10
        while composer._pending and time.time() < deadline:
            time.sleep(0.01)
        assert composer._pending == 0

    composer = HostComposer(ServerRegistry(["tcp://127.0.0.1:5555"], cache))
    with caplog.at_level(logging.INFO, logger="lmcache_cartridge"):
        ask("r1")
        ask("r2")
        assert composer.built == 0
        missing = [r for r in caplog.records if "are not built here" in r.getMessage()]
        assert len(missing) == 1 and "tcp://127.0.0.1:5555" in missing[0].getMessage()

        _server_record(cache, other.path, "tcp://127.0.0.1:5556", "another-server")  # another endpoint: not ours
        _server_record(cache, ours.path, "tcp://127.0.0.1:5555", "our-server")
        ask("r3")
    assert composer.built == 1
    built = [e for e in ours.list() if e.id.startswith("composite-")]
    assert len(built) == 1 and built[0].num_tokens == 2 * CHUNK
    assert built[0].path.startswith(str(cache / "composites"))
    assert not [e for e in other.list() if e.id.startswith("composite-")]
    assert any("are built into" in r.getMessage() and str(ours.path) in r.getMessage() for r in caplog.records)


class TimingOutStores:
    """LMCache's worker adapter as `wait_for_save` drives it, against a server that died: the first
    store is submitted, the second's slot reservation times out (LMCache's own exception)."""

    def __init__(self, lazy: bool) -> None:
        self.lazy_offload = lazy
        self.store_futures: dict[str, object] = {}
        self._completed_store_requests: dict[str, int] = {}
        self._failed_store_requests: set[str] = set()

    def create_recorded_event(self):
        return None

    def batched_submit_store_requests(self, request_ids, ops, event, cache_salts=None, request_configs_list=None):
        from lmcache.v1.mp_observability.errors import LMCacheTimeoutError

        for rid in request_ids:
            if self.store_futures:
                raise LMCacheTimeoutError(f"PREPARE_STORE timed out for {rid} after 30.0s")
            self.store_futures[rid] = object()


@pytest.mark.parametrize("lazy", [False, True])
def test_a_store_the_dead_server_never_answers_drops_the_steps_stores_and_the_step_goes_on(make, lazy):
    """LMCache's timeout leaving `wait_for_save` would fail vLLM's step and stop its engine core
    for good: the stores not submitted are dropped as LMCache drops a store while the server is
    unhealthy (with lazy offload: reported complete, so their blocks are freed)."""
    from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPConnectorMetadata, LMCacheMPRequestMetadata

    c = make([], [0.0])
    c.dispatcher = None
    c.worker_adapter = adapter = TimingOutStores(lazy)
    meta = LMCacheMPConnectorMetadata()
    for rid in ("a", "b", "c"):
        meta.add_request_metadata(LMCacheMPRequestMetadata(rid, "STORE", op=None))
    meta.add_request_metadata(LMCacheMPRequestMetadata("r", "RETRIEVE", op=None))
    c._connector_metadata = meta
    c.wait_for_save()  # does not raise
    assert set(adapter.store_futures) == {"a"}
    assert adapter._completed_store_requests == ({"b": 1, "c": 1} if lazy else {})
    assert adapter._failed_store_requests == ({"b", "c"} if lazy else set())


def test_calls_to_the_server_are_bounded_below_vllms_step_timeout_unless_set():
    from types import SimpleNamespace

    from lmcache_cartridge.vllm.mp_connector import bound_server_calls

    for given, want in ((None, 30.0), ({"lmcache.mp.port": 5555}, 30.0), ({"lmcache.mp.mq_timeout": 120}, 120)):
        ktc = SimpleNamespace(kv_connector_extra_config=given)
        bound_server_calls(ktc)
        assert ktc.kv_connector_extra_config["lmcache.mp.mq_timeout"] == want

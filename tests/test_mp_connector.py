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

    def maybe_submit_lookup_request(self, rid, token_ids, cache_salt="", request_configs=None,
                                    reserve_last_token=False):
        if rid not in self.pending:
            self.submitted += 1
            self.pending[rid] = self.answers.pop(0)

    def check_lookup_result(self, rid):
        return self.pending.get(rid, 0)

    def cleanup_lookup_result(self, rid):
        self.cleaned.append(rid)
        self.pending.pop(rid, None)

    def free_lookup_locks(self, token_ids, start, end, request_id, cache_salt="", request_configs=None):
        self.freed.append((request_id, start, end))


def _request(rid: str, prompt: int = TRAINED + 40):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = {NO_RECOMPUTE_PARAM: True, TRAINED_TOKENS_PARAM: TRAINED}
    return Request(rid, list(range(prompt)), SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}),
                   None)


@pytest.fixture
def make(monkeypatch):
    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector

    from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnectorStats

    from lmcache_cartridge.vllm.mp_connector import CartridgeMPConnector

    def build(answers, now):
        c = CartridgeMPConnector.__new__(CartridgeMPConnector)  # no server: the scheduler's lookup path only
        c._gate = ReadinessGate(5.0, clock=lambda: now[0])
        c._lookups = None
        c._short, c._failed_async = {}, {}
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


def test_a_running_lookup_is_left_alone_and_the_deadline_promises_the_tokens(make):
    now = [0.0]
    c = make([None], now)
    req = _request("r2")
    assert c.get_num_new_matched_tokens(req, 0) == (None, False)
    assert c.scheduler_adapter.cleaned == [] and c.scheduler_adapter.freed == []  # still running: untouched
    now[0] += 6.0
    # out of time: the cartridge's tokens promised as an asynchronous hit whose load must fail
    assert c.get_num_new_matched_tokens(req, 0) == (TRAINED, True)
    t = c._get_request_tracker("r2")
    assert t.num_lmcache_hit_tokens == t.num_stored_tokens == TRAINED


@pytest.mark.parametrize("steps", [
    [("recv",), ("send",)],            # receive first, then the send frees it
    [("send",), ("recv",)],            # send first, then the receive frees it
    [("recv", "send")],                # both in one step: the send frees it
])
def test_a_failed_async_load_reaches_vllm_as_exactly_one_notice(make, steps):
    from vllm.v1.outputs import KVConnectorOutput

    c = make([], [0.0])
    c.lazy_offload = False
    c._kv_cache_events = []
    c.note_failed_async_loads({"bad"})
    seen = []
    for step in steps:
        out = KVConnectorOutput(finished_recving={"bad", "other"} if "recv" in step else {"other"},
                                finished_sending={"bad", "other"} if "send" in step else set())
        c.update_connector_output(out)
        assert "other" in out.finished_recving  # other requests' notices untouched
        seen += [k for k, ids in (("recv", out.finished_recving), ("send", out.finished_sending)) if "bad" in ids]
    assert len(seen) == 1 and c._failed_async == {}

"""The connector's answer to vLLM's scheduler, timed by outcome (`vllm.lookup_metrics`), fast.

`CartridgeConnector.get_num_new_matched_tokens` with its real readiness gate and composer over a
stand-in for LMCache's connector implementation (the one thing LMCache does there: answer a
lookup, or raise): the answer reaches vLLM unchanged and each call is counted under the outcome
the connector knows (a promise and an error are not read off the answer). A metric that fails
never reaches the scheduler. The real-server proofs: `test_metrics_e2e.py` (one hit per request)
and `test_ready_on_instance_e2e.py` (waits, then a hit).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
from prometheus_client import REGISTRY

from lmcache_cartridge.vllm.lookup_metrics import NAME, OUTCOMES, LookupTimer

TRAINED = 64
_instances = itertools.count()


class FakeLMCacheImpl:
    """LMCache's `LMCacheConnectorV1Impl` as the connector uses it on the scheduler side."""

    def __init__(self) -> None:
        self.answer: int | Exception = 0
        self.load_specs: dict = {}
        self.lookup_client = self
        self.cleared: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def clear_lookup_status(self, rid: str) -> None:
        self.cleared.append(rid)


def _request(rid: str, marked: bool, prompt: int = 96):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from lmcache_cartridge.vllm.load_failure import NO_RECOMPUTE_PARAM
    from lmcache_cartridge.vllm.readiness import TRAINED_TOKENS_PARAM

    params = {NO_RECOMPUTE_PARAM: True, TRAINED_TOKENS_PARAM: TRAINED} if marked else {}
    return Request(rid, list(range(prompt)), SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}),
                   None)


@pytest.fixture
def connector():
    from lmcache_cartridge.connector import CartridgeConnector
    from lmcache_cartridge.vllm.composites import HostComposer
    from lmcache_cartridge.vllm.readiness import ReadinessGate

    now = [0.0]
    c = CartridgeConnector.__new__(CartridgeConnector)  # no LMCache engine: only the scheduler's lookup path
    c._gate = ReadinessGate(5.0, clock=lambda: now[0])
    c._composer = HostComposer(lambda: None)
    c._lmcache_engine = FakeLMCacheImpl()
    c._lookups = LookupTimer(instance=f"unit-{os.getpid()}-{next(_instances)}")
    c.now = now
    return c


def counts(c) -> dict[str, float]:
    return {o: REGISTRY.get_sample_value(NAME + "_count", {"outcome": o, "cartridge_instance": c._lookups.instance})
            for o in OUTCOMES}


def test_each_answer_reaches_vllm_unchanged_and_is_counted_by_outcome(connector):
    c, impl = connector, connector._lmcache_engine
    assert counts(c) == dict.fromkeys(OUTCOMES, 0.0)  # declared at zero
    plain, marked = _request("plain", False), _request("marked", True)

    impl.answer = 32
    assert c.get_num_new_matched_tokens(plain, 0) == (32, False)
    impl.answer = 0
    assert c.get_num_new_matched_tokens(plain, 0) == (0, False)
    assert c.get_num_new_matched_tokens(marked, 0) == (None, False)  # the trained cartridge is not here yet
    c.now[0] += 5.0  # the wait ran out: its tokens promised as a hit whose load must fail
    assert c.get_num_new_matched_tokens(marked, 0) == (TRAINED, False)
    assert impl.load_specs["marked"].lmcache_cached_tokens == TRAINED
    assert counts(c) == {"hit": 1, "miss": 1, "wait": 1, "promised": 1, "error": 0}
    assert REGISTRY.get_sample_value(NAME + "_sum", {"outcome": "hit", "cartridge_instance": c._lookups.instance}) > 0


def test_a_lookup_that_raises_is_an_error_whether_the_request_recomputes_or_waits(connector):
    c, impl = connector, connector._lmcache_engine
    impl.answer = RuntimeError("LMCache's lookup server is gone")
    assert c.get_num_new_matched_tokens(_request("plain", False), 0) == (0, False)  # recomputes
    assert c.get_num_new_matched_tokens(_request("marked", True), 0) == (None, False)  # waits, never recomputed
    assert counts(c) == {"hit": 0, "miss": 0, "wait": 0, "promised": 0, "error": 2}


def test_a_failing_metric_never_reaches_the_scheduler(connector):
    class Broken:
        def observe(self, seconds):
            raise OSError("the metrics directory is gone")

    c = connector
    c._lookups._series["hit"] = Broken()
    c._lmcache_engine.answer = 16
    assert c.get_num_new_matched_tokens(_request("plain", False), 0) == (16, False)
    assert c.get_num_new_matched_tokens(_request("plain2", False), 0) == (16, False)  # metrics off from then on
    assert c._lookups._series == {}


def test_a_metrics_directory_that_does_not_exist_turns_the_metric_off_not_the_connector(tmp_path):
    """prometheus_client's multiprocess mode writes to `PROMETHEUS_MULTIPROC_DIR`: if it names no
    directory, creating the series raises; the scheduler-role connector must still start."""
    code = ("from lmcache_cartridge.vllm.lookup_metrics import LookupTimer\n"
            "t = LookupTimer(); t.observe(0.001, 'hit'); print('series', len(t._series))\n")
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "missing"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "series 0" in out.stdout and "scheduler lookup metrics are off" in out.stderr

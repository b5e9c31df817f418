"""The per-request KV load failure policy (`lmcache_cartridge.vllm.load_failure`) inside vLLM's
REAL `Scheduler` (no engine, no model run): two requests whose external KV was scheduled in one
step, one carrying a trained cartridge (the gateway's `NO_RECOMPUTE_PARAM`) and one not, both
with a block reported as failed to load, as a worker's connector reports it
(`KVConnectorOutput.invalid_block_ids`). The trained one must be finished with an error and its
failed blocks must leave vLLM's prefix cache; the other must be rescheduled (recomputed).

The connector below is the smallest scheduler-side connector that makes vLLM schedule external
tokens (a lookup that hits the first `EXTERNAL` tokens); the end-to-end path with LMCache and a
load failure caused for real is tests/test_load_failure_e2e.py.
"""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

from lmcache_cartridge.vllm import load_failure
from lmcache_cartridge.vllm.load_failure import NO_RECOMPUTE_PARAM, must_not_recompute

BS = 16
EXTERNAL = 4 * BS  # tokens the lookup hits
PROMPT = 6 * BS


class HitConnector(KVConnectorBase_V1):
    """Scheduler side only: every request's first EXTERNAL tokens are an external hit."""

    must_not_recompute = staticmethod(must_not_recompute)  # as CartridgeConnector answers it

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return max(0, EXTERNAL - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


def _scheduler(connector: str = "HitConnector"):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from lmcache_cartridge.tools.testmodel import ensure_test_model

    assert load_failure.install_scheduler_policy() is None  # what CartridgeConnector does first
    model = ModelConfig(model=str(ensure_test_model()), dtype="bfloat16", seed=0, max_model_len=1024)
    config = VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024,
                                         is_encoder_decoder=False),
        model_config=model, device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(block_size=BS, cache_dtype="auto", enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_connector_module_path=__name__,
                                            kv_role="kv_both", kv_load_failure_policy="recompute"))
    config.cache_config.num_gpu_blocks = 64
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(config, kv_config, StructuredOutputManager(config), block_size=BS, log_stats=False)


def _request(name: str, first: int, trained: bool):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    extra = {"kv_transfer_params": {NO_RECOMPUTE_PARAM: True, "lmcache.skip_save": True}} if trained else None
    return Request(name, list(range(first, first + PROMPT)), SamplingParams(max_tokens=4, extra_args=extra), None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def _fail_one_block(sched, req, index: int):
    """Schedule `req` alone and report its `index`-th block's external KV as failed to load, as a
    worker's connector reports it; vLLM's outputs for that step."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    sched.add_request(req)
    out = sched.schedule()
    bad = sched.kv_cache_manager.get_block_ids(req.request_id)[0][index]
    runner = ModelRunnerOutput(req_ids=[req.request_id], req_id_to_index={req.request_id: 0},
                               sampled_token_ids=[[7]],
                               kv_connector_output=KVConnectorOutput(invalid_block_ids={bad}))
    return sched.update_from_output(out, runner)


def test_trained_load_failure_fails_its_request_and_leaves_the_prefix_cache_others_recompute():
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import FinishReason, RequestStatus

    sched = _scheduler()
    first_k, trained = _request("first-k", 10, False), _request("trained", 300, True)
    for r in (first_k, trained):
        sched.add_request(r)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"first-k": PROMPT - EXTERNAL, "trained": PROMPT - EXTERNAL}
    blocks = {r.request_id: sched.kv_cache_manager.get_block_ids(r.request_id)[0] for r in (first_k, trained)}
    # the second block of each request's external KV failed to load (the first loaded fine)
    invalid = {blocks["first-k"][1], blocks["trained"][1]}
    runner = ModelRunnerOutput(req_ids=["first-k", "trained"], req_id_to_index={"first-k": 0, "trained": 1},
                               sampled_token_ids=[[7], [7]],
                               kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid))
    outputs = [o for group in sched.update_from_output(out, runner).values() for o in group.outputs]

    # trained: finished with an error in this very step, nothing generated
    assert trained.status == RequestStatus.FINISHED_ERROR
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outputs] == [("trained", FinishReason.ERROR, [])]
    # first-k: rescheduled from its first failed block (vLLM's recompute), its sample discarded
    assert first_k.status == RequestStatus.RUNNING and first_k.num_computed_tokens == BS
    assert list(first_k.output_token_ids) == []

    # vLLM's prefix cache kept the trained request's block that loaded, nothing from the failed one on
    again = _request("trained-again", 300, True)
    hit = sched.kv_cache_manager.get_computed_blocks(again)[1]
    assert hit == BS


def test_vllm_033s_error_dict_gets_the_failed_trained_request():
    """vLLM 0.33 keeps the scheduler's per-request errors in a dict (request id -> error) where 0.32
    had a set: the policy must add the failed trained request there too (None: vLLM's plain error)
    and vLLM's drain must finish it with an error. Read off 0.33's scheduler.py (docs/deployment.md,
    Versions); here the 0.32 Scheduler holds the 0.33 shape."""
    from vllm.v1.request import RequestStatus

    sched = _scheduler()
    sched.grammar_compile_error_reqs = {}
    trained = _request("trained", 300, True)
    _fail_one_block(sched, trained, 1)
    assert trained.status == RequestStatus.FINISHED_ERROR


def test_without_a_marker_every_request_recomputes():
    """A request the gateway did not mark (first-k, plain prompts) keeps vLLM's recompute."""
    from vllm.v1.request import RequestStatus

    sched = _scheduler()
    req = _request("plain", 600, False)
    assert not any(g.outputs for g in _fail_one_block(sched, req, 0).values())
    assert req.status == RequestStatus.RUNNING and req.num_computed_tokens == 0


def test_unknown_vllm_is_refused_and_the_connector_stays_on_fail(monkeypatch):
    """Fail safe: on a vLLM the policy was not read against nothing is replaced, and the connector
    leaves vLLM's default "fail" (every failed load fails its request) instead of "recompute"."""
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler

    from lmcache_cartridge.vllm.load_failure import configure_load_failure_policy

    assert load_failure._structure_problem(Scheduler) is None

    class Rewritten(Scheduler):
        def update_from_output(self, scheduler_output, model_runner_output):
            return {}

    assert "no longer drains" in load_failure._structure_problem(Rewritten)
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    assert "0.99.0" in load_failure._structure_problem(Scheduler)

    from vllm.config import KVTransferConfig

    monkeypatch.setattr(load_failure, "install_scheduler_policy", lambda: "vLLM 0.99.0")
    for configured in ("fail", "recompute"):  # even a configured "recompute" becomes "fail"
        ktc = KVTransferConfig(kv_connector="CartridgeConnector", kv_role="kv_both", kv_load_failure_policy=configured)
        configure_load_failure_policy(ktc)
        assert ktc.kv_load_failure_policy == "fail"
    monkeypatch.setattr(load_failure, "install_scheduler_policy", lambda: None)
    configure_load_failure_policy(ktc)
    assert ktc.kv_load_failure_policy == "recompute"
    # a hybrid model (several KV cache groups): failures come per request, which the per-request
    # policy does not see, so a trained one would be recomputed: "fail" for all
    from types import SimpleNamespace

    configure_load_failure_policy(ktc, SimpleNamespace(kv_cache_groups=[object(), object()]))
    assert ktc.kv_load_failure_policy == "fail"
    configure_load_failure_policy(ktc, SimpleNamespace(kv_cache_groups=[object()]))
    assert ktc.kv_load_failure_policy == "recompute"


@pytest.mark.parametrize("params, expected", [
    ({NO_RECOMPUTE_PARAM: True, "lmcache.skip_save": True}, True),
    ({"lmcache.skip_save": True}, False),
    (None, False),
])
def test_marker_is_read_from_vllms_request(params, expected):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": params} if params is not None else None
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=1, extra_args=extra), None)
    assert must_not_recompute(req) is expected


class GateConnector(HitConnector):
    """`HitConnector`'s hit while `resident`, else a miss, answered through the readiness gate
    exactly as `CartridgeConnector` does (`ReadinessGate.match`; the promise reports the needed
    tokens as an external hit, as `CartridgeConnector._promise_trained` does for LMCache)."""

    resident = False
    pending = 0  # lookups that answer None first (still running, as LMCache MP's do), then the hit
    gate = None
    lookups = 0
    relookups = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        def lookup():
            GateConnector.lookups += 1
            if GateConnector.pending:
                GateConnector.pending -= 1
                return None, False
            return (max(0, EXTERNAL - num_computed_tokens) if GateConnector.resident else 0), False

        def relookup():
            GateConnector.relookups += 1

        return GateConnector.gate.match(request, num_computed_tokens, lookup, relookup,
                                        promise=lambda need: (need - num_computed_tokens, False))


def test_a_waiting_trained_request_is_skipped_by_vllms_scheduler_then_served_or_failed():
    """vLLM 0.32's contract for None ("ask again later"), in its real Scheduler, with the gate
    `CartridgeConnector` answers through: a trained request (the gateway's TRAINED_TOKENS_PARAM =
    EXTERNAL) is not scheduled while its cartridge is not here and the unmarked one is meanwhile;
    LMCache is asked again at most every RELOOKUP_INTERVAL_S; once resident it is scheduled with
    its KV as external hit. Another one whose cartridge never comes is scheduled, past the
    deadline, with the cartridge's tokens as an external hit; their load fails (as LMCache reports
    it) and the per-request policy finishes it with an error: never recomputed."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import FinishReason, RequestStatus

    from lmcache_cartridge.vllm.readiness import RELOOKUP_INTERVAL_S, TRAINED_TOKENS_PARAM, ReadinessGate

    now = [0.0]
    GateConnector.gate, GateConnector.resident = ReadinessGate(5.0, clock=lambda: now[0]), False
    GateConnector.lookups = GateConnector.relookups = 0
    sched = _scheduler(connector="GateConnector")
    plain, trained = _request("plain", 10, False), _request("trained", 300, True)
    trained.kv_transfer_params[TRAINED_TOKENS_PARAM] = EXTERNAL
    for r in (trained, plain):
        sched.add_request(r)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"plain": PROMPT}                # the trained one waits
    assert trained.status == RequestStatus.WAITING and GateConnector.gate.waiting() == 1
    assert (GateConnector.lookups, GateConnector.relookups) == (2, 1)
    for _ in range(3):                                                   # re-asked each step...
        assert "trained" not in sched.schedule().num_scheduled_tokens
    assert GateConnector.lookups == 2                                    # ...LMCache not asked again yet
    now[0] += RELOOKUP_INTERVAL_S
    GateConnector.resident = True
    out = sched.schedule()
    assert out.num_scheduled_tokens["trained"] == PROMPT - EXTERNAL      # its first EXTERNAL tokens loaded
    assert GateConnector.gate.waiting() == 0

    late = _request("late", 600, True)
    late.kv_transfer_params[TRAINED_TOKENS_PARAM] = EXTERNAL
    GateConnector.resident = False
    sched.add_request(late)
    assert "late" not in sched.schedule().num_scheduled_tokens
    now[0] += 5.0                                                        # the deadline passed
    out = sched.schedule()
    assert out.num_scheduled_tokens["late"] == PROMPT - EXTERNAL         # promised: its load must happen
    bad = sched.kv_cache_manager.get_block_ids("late")[0][0]
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                               sampled_token_ids=[[7] for _ in ids],
                               kv_connector_output=KVConnectorOutput(invalid_block_ids={bad}))
    outputs = [o for g in sched.update_from_output(out, runner).values() for o in g.outputs]
    assert late.status == RequestStatus.FINISHED_ERROR
    assert [(o.request_id, o.finish_reason) for o in outputs if o.request_id == "late"] == [
        ("late", FinishReason.ERROR)
    ]
    assert GateConnector.gate.waiting() == 0


def test_a_first_k_request_waits_briefly_for_its_cartridge_then_is_computed():
    """The soft rule, in vLLM's real Scheduler: a request whose first EXTERNAL tokens are first-k
    cartridge tokens (the gateway's CARTRIDGE_TOKENS_PARAM) and which LMCache finds short (in MP
    mode: another request's load of the same chunks in flight) is not scheduled for up to
    `first_k_wait_s`, LMCache asked again every RELOOKUP_INTERVAL_S; found then, it is scheduled
    with its KV. One whose KV never comes is scheduled after the wait and computed (no error);
    a request without the parameter is never held."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request, RequestStatus

    from lmcache_cartridge.vllm.readiness import CARTRIDGE_TOKENS_PARAM, RELOOKUP_INTERVAL_S, ReadinessGate

    def first_k(name: str, first: int) -> Request:
        extra = {"kv_transfer_params": {CARTRIDGE_TOKENS_PARAM: EXTERNAL}}
        return Request(name, list(range(first, first + PROMPT)), SamplingParams(max_tokens=4, extra_args=extra),
                       None, block_hasher=get_request_block_hasher(BS, sha256))

    now = [0.0]
    GateConnector.gate, GateConnector.resident = ReadinessGate(30.0, clock=lambda: now[0], first_k_wait_s=2.0), False
    GateConnector.lookups = GateConnector.relookups = 0
    sched = _scheduler(connector="GateConnector")
    plain, soon = _request("plain", 10, False), first_k("soon", 300)
    for r in (soon, plain):
        sched.add_request(r)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"plain": PROMPT}                # held; the plain one is not
    assert soon.status == RequestStatus.WAITING and GateConnector.gate.waiting() == 1
    now[0] += RELOOKUP_INTERVAL_S
    GateConnector.resident = True                                        # the other load landed
    out = sched.schedule()
    assert out.num_scheduled_tokens["soon"] == PROMPT - EXTERNAL         # loaded, not recomputed
    assert GateConnector.gate.waiting() == 0

    never = first_k("never", 600)
    GateConnector.resident = False
    sched.add_request(never)
    for _ in range(3):
        assert "never" not in sched.schedule().num_scheduled_tokens
        now[0] += RELOOKUP_INTERVAL_S
    now[0] += 2.0                                                        # the wait is over
    out = sched.schedule()
    assert out.num_scheduled_tokens["never"] == PROMPT                   # computed, as without cartridges
    assert never.status == RequestStatus.RUNNING and GateConnector.gate.waiting() == 0

    # a lookup still running (None, LMCache MP's asynchronous lookup) is asked again every step:
    # the request is scheduled on the step its result arrives, not a relookup interval later
    GateConnector.resident, GateConnector.pending = True, 2
    polled = first_k("polled", 1200)
    sched.add_request(polled)
    steps = 0
    while "polled" not in (out := sched.schedule()).num_scheduled_tokens:
        steps += 1
        assert steps < 3, "a pending lookup was held"
    assert out.num_scheduled_tokens["polled"] == PROMPT - EXTERNAL and GateConnector.pending == 0

    off = first_k("off", 900)                                            # first_k_wait_s 0: not held
    GateConnector.gate = ReadinessGate(30.0, clock=lambda: now[0], first_k_wait_s=0.0)
    GateConnector.resident = False
    sched.add_request(off)
    assert sched.schedule().num_scheduled_tokens["off"] == PROMPT


@pytest.mark.parametrize("trained, prompt, need", [(64, 96, 64), (96, 96, 95), (128, 96, 95), (0, 96, 0)])
def test_required_tokens_leave_vllm_the_last_prompt_token(trained, prompt, need):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from lmcache_cartridge.vllm.readiness import TRAINED_TOKENS_PARAM, required_tokens

    params = {NO_RECOMPUTE_PARAM: True, TRAINED_TOKENS_PARAM: trained}
    req = Request(
        "r", list(range(prompt)), SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None
    )
    assert required_tokens(req) == need
    unmarked = Request("u", list(range(prompt)), SamplingParams(
        max_tokens=1, extra_args={"kv_transfer_params": {TRAINED_TOKENS_PARAM: trained}}), None)
    assert required_tokens(unmarked) == 0

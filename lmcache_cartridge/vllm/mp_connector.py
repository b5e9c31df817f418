"""`CartridgeMPConnector`: LMCache's `LMCacheMPConnector` (vLLM attached to an `lmcache server`,
LMCache's multiprocess mode) with the rules a trained cartridge needs, which the in-process
`CartridgeConnector` applies the same way.

Load it with:
    --kv-transfer-config '{"kv_connector": "CartridgeMPConnector",
                           "kv_connector_module_path": "lmcache_cartridge.vllm.mp_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                                         "lmcache.mp.port": 5555, ...}}'
(`lmcache-cartridge mp-server --print` prints both commands). The server runs the cartridge L2
adapter (`lmcache.mp_adapter`), which serves the chunks.

Why a subclass: with the stock connector a trained cartridge would be answered wrongly twice over.
Its first lookup usually misses (the adapter starts the download and answers what is local now),
and a miss is scheduled as ordinary prefill of the cartridge's placeholder token ids; and after a
failed asynchronous load `LMCacheMPConnector` bypasses LMCache and recomputes the prompt. Neither
may happen to a trained cartridge: an error is better than a wrong answer.

Where it runs / who owns what: vLLM builds one instance per role. The scheduler-role instance
(EngineCore process, inside `Scheduler.__init__`) owns the readiness deadlines of waiting
requests (`readiness.ReadinessGate`), the lookup histogram (`lookup_metrics`) and the choice of
vLLM's `kv_load_failure_policy`; LMCache's scheduler adapter owns the lookups and their server
locks. The worker-role instance is `LMCacheMPConnector` unchanged (the server copies the KV). The
connector holds no KV and no cartridge file.

Scheduler side, per request marked by the gateway as carrying a trained cartridge
(`load_failure.NO_RECOMPUTE_PARAM` + `readiness.TRAINED_TOKENS_PARAM`; unmarked requests are
LMCache's answer as is):
* ready: vLLM's prefix-cache hit + LMCache's hit covers the cartridge -> LMCache's answer;
* waiting (bounded by `cartridge.ready_timeout_s`): None, so vLLM skips the request this step and
  schedules the others. A lookup still running on the server stays as it is; one that finished
  short is released (its server read locks freed, LMCache's cached result dropped) and asked
  again at most every `readiness.RELOOKUP_INTERVAL_S`, by which time the adapter's download may
  have landed;
* out of time: the cartridge's tokens are promised as an external hit that LMCache must load; the
  server cannot retrieve chunks it does not hold, the worker reports the blocks as failed loads,
  and the per-request policy (`load_failure`, installed here as in-process) finishes the request
  with an error (HTTP 500, the gateway's 503 + Retry-After) before LMCache's bypass could
  recompute it. First-k and plain requests keep "recompute" (exact prefill).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from lmcache_cartridge import ensure_log_handler
from lmcache_cartridge import settings_reference as ref
from lmcache_cartridge.vllm.load_failure import configure_load_failure_policy, must_not_recompute
from lmcache_cartridge.vllm.lookup_metrics import LookupTimer
from lmcache_cartridge.vllm.readiness import ReadinessGate, gated_answer, trained_length

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("lmcache_cartridge.mp_connector")
ensure_log_handler()


class CartridgeMPConnector(LMCacheMPConnector):
    """`LMCacheMPConnector` + the trained-cartridge readiness rule and load-failure policy."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        ktc = vllm_config.kv_transfer_config
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        scheduler = role == KVConnectorRole.SCHEDULER
        self._gate = ReadinessGate(float(extra.get(ref.READY_TIMEOUT.name, ref.READY_TIMEOUT.default)))
        self._lookups = LookupTimer() if scheduler else None
        # request id -> LMCache hit (tokens) of a lookup that finished short while the request waits
        self._short: dict[str, int] = {}
        # request id -> whether one of its two notices was dropped (`note_failed_async_loads`)
        self._failed_async: dict[str, bool] = {}
        if scheduler and ktc is not None \
                and not extra.get(ref.KEEP_LOAD_FAILURE_POLICY.name, ref.KEEP_LOAD_FAILURE_POLICY.default):
            configure_load_failure_policy(ktc)
        super().__init__(vllm_config, role, kv_cache_config)
        logger.info("lmcache_cartridge: CartridgeMPConnector ready (role %s)", role.name)

    def must_not_recompute(self, request) -> bool:
        """Scheduler side, asked by the per-request policy (`load_failure`) for each request with a
        failed KV load: True fails the request instead of recomputing it."""
        return must_not_recompute(request)

    # --- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Scheduler side (EngineCore process, inside `Scheduler.schedule`, each step for each
        waiting request it reaches): LMCache's lookup through the readiness rule, timed."""
        rid = str(request.request_id)
        return gated_answer(self._gate, self._lookups, request, num_computed_tokens,
                            lookup=lambda: self._lookup(request, num_computed_tokens),
                            relookup=lambda: self._relookup(rid),
                            promise=lambda need: self._promise_trained(request, num_computed_tokens, need))

    def _lookup(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        answer = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if answer[0] is not None and trained_length(request):
            # finished: remember the hit it locked on the server, in case it is short and released
            # (a miss leaves the tracker's hit at 0)
            tracker = self._get_request_tracker(request.request_id)
            self._short[str(request.request_id)] = int(tracker.num_lmcache_hit_tokens)
        return answer

    def _relookup(self, rid: str) -> None:
        """Forget a finished short lookup so that the next call submits a new one: free the read
        locks the server took for its hit, drop LMCache's cached result and the tracker's hit. A
        lookup still running is left alone (its result comes next)."""
        hit = self._short.pop(rid, None)
        if hit is None:
            return
        tracker = self._get_request_tracker(rid)
        if hit > 0:
            self.scheduler_adapter.free_lookup_locks(token_ids=tracker.get_token_ids(), start=0, end=hit,
                                                     request_id=rid, cache_salt=tracker.cache_salt,
                                                     request_configs=tracker.request_configs)
        self.scheduler_adapter.cleanup_lookup_result(rid)
        tracker.num_lmcache_hit_tokens = tracker.num_stored_tokens = 0

    def _promise_trained(self, request, num_computed_tokens: int, need: int) -> tuple[int, bool]:
        """The wait is over and the trained cartridge is not (all) on the server: report its `need`
        tokens as an asynchronous external hit. `update_state_after_alloc` then plans a retrieve
        of them; the server holds no such chunks, the retrieve fails, the worker reports the
        blocks and the per-request policy fails the request (had the chunks arrived meanwhile,
        the load just succeeds). The tracker is set as LMCache's own lookup sets it for a hit of
        that length (a prompt that is exactly the cartridge: the full prompt, last token computed)."""
        rid = str(request.request_id)
        self._short.pop(rid, None)
        total = int(request.num_tokens)
        promised = total if need == total - 1 and trained_length(request) >= total else need
        tracker = self._get_request_tracker(request.request_id)
        tracker.num_lmcache_hit_tokens = tracker.num_stored_tokens = promised
        return need - num_computed_tokens, True

    def note_failed_async_loads(self, request_ids: set[str]) -> None:
        """Scheduler side, from the per-request policy (`load_failure`) in `update_from_output`,
        for requests it fails while their asynchronous load is still to be reported received.
        vLLM frees such a request on whichever notice comes first, the receive or (LMCache
        delays every finished request's free until its send is reported) the send, and asserts
        on the second: the engine would die. `update_connector_output` lets only the second one
        through."""
        for rid in request_ids:
            self._failed_async.setdefault(str(rid), False)
        while len(self._failed_async) > 4096:  # notices that never came (a worker lost): oldest go
            self._failed_async.pop(next(iter(self._failed_async)))

    def update_connector_output(self, connector_output) -> None:
        """Scheduler side, at the start of vLLM's handling of the workers' transfer notices:
        for a request failed during its asynchronous load, the first of its receive / send
        notices is dropped, the other frees it (both in one step: the send frees it)."""
        if self._failed_async:
            recv = set(connector_output.finished_recving or ())
            send = set(connector_output.finished_sending or ())
            for rid, seen_one in list(self._failed_async.items()):
                r, s = rid in recv, rid in send
                if not (r or s):
                    continue
                if r and s:  # both in one step: the receive is dropped, the send frees it
                    recv.discard(rid)
                    del self._failed_async[rid]
                elif seen_one:  # the second notice frees it
                    del self._failed_async[rid]
                else:  # the first notice is dropped
                    recv.discard(rid)
                    send.discard(rid)
                    self._failed_async[rid] = True
            if connector_output.finished_recving is not None:
                connector_output.finished_recving = recv
            if connector_output.finished_sending is not None:
                connector_output.finished_sending = send
        super().update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        """Scheduler side: a request ended (also one aborted while it waited): drop its deadline."""
        self._gate.forget(request.request_id)
        self._short.pop(str(request.request_id), None)
        return super().request_finished(request, block_ids)

"""Per-request KV load failure policy: a failed load of a trained cartridge fails its request,
every other failed load is recomputed.

Why: vLLM 0.32 decides what a KV load failure does once per scheduler
(`kv_transfer_config.kv_load_failure_policy`): "recompute" reschedules the failed blocks from the
request's tokens, "fail" finishes the request with an error (the OpenAI server answers HTTP 500)
and evicts the failed blocks, and every block after them, from vLLM's prefix cache. For a first-k
cartridge a recompute is ordinary prefill (correct). A trained cartridge's tokens are placeholder
ids that mean nothing to the model: recomputing them is a wrong answer, and with prefix caching
on vLLM would then keep that placeholder KV in its prefix cache under the cartridge's block
hashes, so later requests would hit it too.

How a request is known to be trained: the gateway (`api.gateway`) sets `NO_RECOMPUTE_PARAM` in
the `kv_transfer_params` it forwards for every request that carries a trained cartridge; vLLM
keeps them on its `Request` (`request.kv_transfer_params`). LMCache ignores keys that do not
start with "lmcache.", so the marker changes no LMCache key.

Where it runs: `install_scheduler_policy` is called by the scheduler-role `CartridgeConnector`
while vLLM's `Scheduler.__init__` builds it (the EngineCore process), before the scheduler reads
`kv_load_failure_policy`. It replaces one method of vLLM's `Scheduler` class,
`_handle_invalid_blocks` (called from `update_from_output` with the block ids the workers'
connectors reported through `get_block_ids_with_load_errors`); the replacement acts only on
schedulers whose connector is a `CartridgeConnector` and whose policy is "recompute", and then:
* requests marked `NO_RECOMPUTE_PARAM` with an invalid block get vLLM's own "fail" treatment
  (num_computed_tokens cut at the first failed block, that block and all after it evicted from
  the prefix cache, finished with FINISHED_ERROR in this same `update_from_output`: the id goes
  into the scheduler's set of per-request errors that `update_from_output` drains right after);
* all other requests get vLLM's own "recompute" treatment, unchanged.
Both use vLLM's `_update_requests_with_invalid_blocks`, so the scan is vLLM's.

Failing safe: the replacement is installed only on the vLLM versions it was read against and
only if `update_from_output` still drains the error set after calling `_handle_invalid_blocks`
(checked on vLLM's source). Otherwise nothing is replaced, and the connector leaves vLLM's
default policy "fail" in place: every failed load fails its request (first-k ones too) rather
than a trained one being recomputed.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any, Callable

from lmcache_cartridge.versions import VLLM_SERIES

logger = logging.getLogger("lmcache_cartridge.load_failure")

# kv_transfer_params key (any truthy value): this request's KV must never be recomputed from its
# tokens (it carries a trained cartridge), so a failed load fails the request.
NO_RECOMPUTE_PARAM = "lmcache_cartridge.no_recompute"

# vLLM versions whose Scheduler this module was read against (update_from_output,
# _handle_invalid_blocks, _update_requests_with_invalid_blocks, the per-request error sets).
TESTED_VLLM = VLLM_SERIES  # from the one version table
# The set update_from_output turns into FINISHED_ERROR outputs after _handle_invalid_blocks.
_ERROR_SET = "grammar_compile_error_reqs"

_lock = threading.Lock()


def must_not_recompute(request: Any) -> bool:
    """Whether a vLLM `Request` carries KV that its tokens cannot reproduce (a trained cartridge)."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and bool(params.get(NO_RECOMPUTE_PARAM))


def _structure_problem(scheduler_cls) -> str | None:
    """Why `scheduler_cls` is not the Scheduler this module was written for (None: it is)."""
    import vllm

    version = str(getattr(vllm, "__version__", ""))
    if not version.startswith(TESTED_VLLM):
        return f"vLLM {version} (read against {', '.join(v + 'x' for v in TESTED_VLLM)})"
    for name in ("_handle_invalid_blocks", "_update_requests_with_invalid_blocks", "update_from_output"):
        if not callable(getattr(scheduler_cls, name, None)):
            return f"Scheduler.{name} is missing"
    try:
        src = inspect.getsource(scheduler_cls.update_from_output)
        upd = inspect.signature(scheduler_cls._update_requests_with_invalid_blocks)
    except (OSError, TypeError, ValueError) as e:
        return f"cannot read vLLM's Scheduler: {e}"
    call = src.find("self._handle_invalid_blocks(")
    # 0.32: a set drained by `error_req_ids = set(self.X)`; 0.33: a dict id -> RequestError,
    # drained by `request_errors = self.X` (then `error_req_ids = set(request_errors)`).
    drain = max(src.find(f"error_req_ids = set(self.{_ERROR_SET})"), src.find(f"request_errors = self.{_ERROR_SET}"))
    if call < 0 or drain < 0 or drain < call:
        return "Scheduler.update_from_output no longer drains its per-request errors after _handle_invalid_blocks"
    if list(upd.parameters)[:5] != ["self", "requests", "invalid_block_ids", "num_scheduled_tokens", "evict_blocks"]:
        return f"Scheduler._update_requests_with_invalid_blocks{upd} has changed"
    return None


def _make_handler(original: Callable) -> Callable:
    from vllm.v1.request import RequestStatus

    def _handle_invalid_blocks(self, invalid_block_ids: set[int], num_scheduled_tokens: dict[str, int]) -> set[str]:
        judge = getattr(self.connector, "must_not_recompute", None)
        if judge is None or not self.recompute_kv_load_failures or len(self.kv_cache_config.kv_cache_groups) > 1:
            return original(self, invalid_block_ids, num_scheduled_tokens)  # vLLM's, unchanged
        holding = [r for r in self.kv_holding_waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        running = list(self.running)
        strict_h, strict_r = [r for r in holding if judge(r)], [r for r in running if judge(r)]
        if not strict_h and not strict_r:
            return original(self, invalid_block_ids, num_scheduled_tokens)

        # Trained: vLLM's "fail" (cut, evict the failed blocks and all after them, error out).
        upd = self._update_requests_with_invalid_blocks
        failed_h, tok_h, _ = upd(strict_h, invalid_block_ids, num_scheduled_tokens, evict_blocks=False)
        failed_r, tok_r, evict = upd(strict_r, invalid_block_ids, num_scheduled_tokens, evict_blocks=True)
        if evict:
            self.kv_cache_manager.evict_blocks(evict)
        failed = failed_h | failed_r
        if failed:
            errors = getattr(self, _ERROR_SET)
            if isinstance(errors, dict):  # vLLM 0.33: id -> RequestError (None: vLLM's plain error, as 0.32)
                errors.update(dict.fromkeys(failed))
            else:
                errors.update(failed)
            logger.error("lmcache_cartridge: failing %d request(s) whose trained-cartridge KV failed to load "
                         "(%d tokens; never recomputed from placeholder tokens; %d blocks evicted from the "
                         "prefix cache): %s", len(failed), tok_h + tok_r, len(evict), sorted(failed))

        # Everything else: vLLM's "recompute", as in its own _handle_invalid_blocks.
        ids = {r.request_id for r in strict_h} | {r.request_id for r in strict_r}
        rec_h, n_h, _ = upd([r for r in holding if r.request_id not in ids], invalid_block_ids,
                            num_scheduled_tokens, evict_blocks=False)
        rec_r, n_r, _ = upd([r for r in running if r.request_id not in ids], invalid_block_ids,
                            num_scheduled_tokens, evict_blocks=True)
        if rec_h or rec_r:
            logger.warning("Recovered from KV load failure: %d request(s) rescheduled (%d tokens affected).",
                           len(rec_h) + len(rec_r), n_h + n_r)
        self.failed_recving_kv_req_ids |= rec_h
        return failed | rec_r  # skipped by update_from_output's main loop (their sample is void)

    _handle_invalid_blocks._cartridge_policy = True  # type: ignore[attr-defined]
    _handle_invalid_blocks.__wrapped__ = original  # type: ignore[attr-defined]
    _handle_invalid_blocks.__doc__ = (original.__doc__ or "") + "\n(lmcache_cartridge: per-request policy, see " \
        "lmcache_cartridge.vllm.load_failure)"
    return _handle_invalid_blocks


def install_scheduler_policy() -> str | None:
    """Install the per-request policy on vLLM's `Scheduler` (idempotent, process-wide).

    Returns None when it is installed, else why not (then nothing was changed)."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except Exception as e:  # noqa: BLE001 - no vLLM scheduler here: nothing to do
        return f"vLLM's scheduler cannot be imported: {e}"
    with _lock:
        current = Scheduler._handle_invalid_blocks
        if getattr(current, "_cartridge_policy", False):
            return None
        why = _structure_problem(Scheduler)
        if why:
            return why
        Scheduler._handle_invalid_blocks = _make_handler(current)
    return None


def configure_load_failure_policy(ktc, kv_cache_config=None) -> None:
    """Scheduler role, called by both connectors (in-process and MP) inside vLLM's
    `Scheduler.__init__`, before it reads the policy: the per-request policy first, then vLLM's
    `kv_load_failure_policy` "recompute" for the requests it does not fail ("fail" for all when
    the per-request policy cannot be installed, or cannot see the failures: with several KV cache
    groups, a hybrid model, failed loads are reported per request, not per block, and vLLM's
    `_handle_failed_recving` would recompute a trained one). Nothing with
    `cartridge.keep_load_failure_policy` in kv_connector_extra_config."""
    from lmcache_cartridge.settings_reference import KEEP_LOAD_FAILURE_POLICY

    if ktc is None:
        return
    extra = getattr(ktc, "kv_connector_extra_config", None) or {}
    if extra.get(KEEP_LOAD_FAILURE_POLICY.name, KEEP_LOAD_FAILURE_POLICY.default):
        return  # the operator keeps vLLM's policy as configured, without the per-request one
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and len(groups) > 1:
        why = f"{len(groups)} KV cache groups: failed loads are reported per request"
    else:
        try:
            why = install_scheduler_policy()
        except Exception as e:  # noqa: BLE001 - never stop the engine over it: stay on "fail"
            why = f"{type(e).__name__}: {e}"
    before = getattr(ktc, "kv_load_failure_policy", None)
    policy = "fail" if why is not None else "recompute"
    try:
        ktc.kv_load_failure_policy = policy
    except Exception as e:  # frozen config: vLLM's policy stays as it is, say so
        logger.warning("lmcache_cartridge: could not set kv_load_failure_policy=%s (%s); it stays %r%s",
                       policy, e, before, "" if why is None or before == "fail" else
                       ": a trained cartridge's failed KV load would be recomputed from placeholder tokens")
        return
    if why is not None:
        logger.warning("lmcache_cartridge: per-request KV load failure policy not installed (%s); "
                       "kv_load_failure_policy %r -> 'fail': every failed KV load fails its request", why, before)
    else:
        logger.info("lmcache_cartridge: kv_load_failure_policy %r -> 'recompute' except for trained "
                    "cartridges: a failed KV load is recomputed, or fails its request if it carries a "
                    "trained cartridge", before)

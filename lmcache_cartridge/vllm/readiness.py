"""Readiness on the instance: a request carrying a trained cartridge is scheduled only once this
instance can load the cartridge's KV; it waits (bounded), else it fails. Never recomputed.

Why here: behind vllm-router the gateway cannot see which instance serves a request, so its own
wait (`lmcache.serving.wait_served`, per-instance state files on the gateway's host) cannot
promise the chosen instance holds the cartridge. A trained request whose LMCache lookup MISSES
on that instance would be scheduled as ordinary prefill of its placeholder token ids: a wrong
answer with HTTP 200. Only the instance's own scheduler knows, at lookup time, what it holds.

What the gateway sends (`api.gateway`, in `kv_transfer_params`; vLLM keeps them on its
`Request`): `load_failure.NO_RECOMPUTE_PARAM` (the request carries a trained cartridge) and
`TRAINED_TOKENS_PARAM` = N, the trained cartridge's (or composite's) length in tokens: the
prompt's first N tokens are placeholders whose KV must come from the cartridge.

Where it runs: the scheduler-role `CartridgeConnector.get_num_new_matched_tokens` (the
EngineCore process, inside vLLM's `Scheduler.schedule`, once per step for each waiting request
it reaches) answers through `ReadinessGate.match`, after LMCache's lookup:
* covered (vLLM's own prefix-cache hit + LMCache's hit) reaches the first N tokens (N - 1 when
  the prompt is exactly the cartridge: vLLM computes the last token itself) -> "ready": LMCache's
  answer as is;
* else, before the deadline (`cartridge.ready_timeout_s` in kv_connector_extra_config, default
  `DEFAULT_READY_TIMEOUT_S`, counted from the first lookup) -> "wait": the connector answers
  None, which vLLM 0.32 defines as "not determined yet, ask again later": the scheduler skips
  this request for this step (`skip_request`) and goes on with the others, and asks again next
  step. The plugin already fetches what a lookup missed (trained cartridges are fetched at
  registration and kept resident), so a later lookup hits;
* else -> "fail": the connector reports the N tokens as external hits and makes LMCache's load
  spec promise them; the worker's retrieve then gets fewer tokens than promised (the chunks are
  not here), LMCache reports the blocks as failed (`get_block_ids_with_load_errors`) and the
  per-request policy (`load_failure`) finishes the request with an error (vLLM's HTTP 500, the
  gateway's 503 + Retry-After). Were the chunks resident by then, the load simply succeeds. So
  a marked request is never scheduled with its placeholder tokens to compute.

First-k cartridges (and cartridge tokens after a trained cartridge's) get a short, soft wait: the
gateway sends `CARTRIDGE_TOKENS_PARAM` = the prompt's cartridge tokens LMCache can serve (whole
chunks). While LMCache finds fewer, for at most `cartridge.first_k_wait_s`, the request waits
as above; then it gets LMCache's answer, and vLLM computes the rest (exact, only slower). Why: in
LMCache's multiprocess mode requests arriving together for a cartridge's chunks race; LMCache
0.5.6 loads them for the first and finds none for a request whose lookup passed L1 before that
load landed and whose own load then finds the key resident (its L1 reservation refused): without
the wait that request recomputes the whole document (seconds) where a lookup 0.25 s later is an
L1 hit. Requests without either parameter are LMCache's answer as is.

A repeated lookup re-pins (worker side, `release_pins_on_relookup`): each lookup the gate repeats
reaches the worker's LMCache lookup server, whose `LMCacheEngine.lookup(pin=True)` records the new
pins over the old ones under the same request id without releasing them, so every repeat would
leak one set of pins (LMCache's CPU cache until its pin timeout, the plugin's CPU tier and disk
holds until its lease). The worker-role connector makes the engine release them first.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from typing import Any, Callable

from lmcache_cartridge.settings_reference import FIRST_K_WAIT, READY_TIMEOUT
from lmcache_cartridge.vllm.load_failure import must_not_recompute

logger = logging.getLogger("lmcache_cartridge.readiness")

# kv_transfer_params key (int): how many leading prompt tokens are a trained cartridge's
# placeholders, whose KV must be loaded, never computed. Set by the gateway with NO_RECOMPUTE_PARAM.
TRAINED_TOKENS_PARAM = "lmcache_cartridge.trained_tokens"
# kv_transfer_params key (int): how many leading prompt tokens are cartridge tokens LMCache can
# serve (whole chunks). Set by the gateway on every request with cartridges; a soft target.
CARTRIDGE_TOKENS_PARAM = "lmcache_cartridge.cartridge_tokens"
# kv_connector_extra_config key: seconds a marked request may wait on this instance for its
# trained cartridge's KV before it fails.
READY_TIMEOUT_KEY = READY_TIMEOUT.name
DEFAULT_READY_TIMEOUT_S = float(READY_TIMEOUT.default)
DEFAULT_FIRST_K_WAIT_S = float(FIRST_K_WAIT.default)
# While a request waits, LMCache's lookup (which also restarts a failed download in the plugin)
# is repeated at most this often. vLLM re-asks every engine step, and while only waiting requests
# are left its engine loop steps without pause: in between, the connector answers None at once.
RELOOKUP_INTERVAL_S = 0.25

READY, WAIT, FAIL = "ready", "wait", "fail"


def trained_length(request: Any) -> int:
    """`TRAINED_TOKENS_PARAM` of a request marked `NO_RECOMPUTE_PARAM` (0: unmarked or absent)."""
    if not must_not_recompute(request):
        return 0
    try:
        return max(0, int(request.kv_transfer_params.get(TRAINED_TOKENS_PARAM) or 0))
    except (TypeError, ValueError):
        return 0


def required_tokens(request: Any) -> int:
    """How many leading tokens of `request` must be loaded before it may be scheduled (0: no rule).

    The prompt may be exactly the cartridge: vLLM always computes the last prompt token itself."""
    n = trained_length(request)
    total = int(getattr(request, "num_tokens", 0) or 0)
    if n <= 0 or total <= 0:
        return 0
    return min(n, total - 1)


def cartridge_tokens(request: Any) -> int:
    """How many leading tokens of `request` LMCache should find in cartridges (0: not said): its
    `CARTRIDGE_TOKENS_PARAM`, at most the prompt less its last token (vLLM computes that one)."""
    try:
        n = max(0, int((getattr(request, "kv_transfer_params", None) or {}).get(CARTRIDGE_TOKENS_PARAM) or 0))
    except (TypeError, ValueError, AttributeError):
        return 0
    total = int(getattr(request, "num_tokens", 0) or 0)
    return min(n, total - 1) if n > 0 and total > 0 else 0


def promised_hit(request: Any, need: int) -> int:
    """The LMCache hit (tokens) a promise of `need` tokens stands for: the cartridge's length, or,
    when the prompt is exactly the cartridge (`need` = the prompt less its last token), the whole
    prompt: LMCache's full-prompt hit, whose last token vLLM computes. Both connectors set it."""
    total = int(request.num_tokens)
    return total if need == total - 1 and trained_length(request) >= total else need


class ReadinessGate:
    """Per-request wait deadlines for marked requests (scheduler side, one per connector).

    Thread-safe; the scheduler calls it from its own thread only, but the cost is nil."""

    def __init__(self, timeout_s: float = DEFAULT_READY_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic, first_k_wait_s: float = DEFAULT_FIRST_K_WAIT_S) -> None:
        self.timeout_s = max(0.0, float(timeout_s))
        self.first_k_wait_s = max(0.0, float(first_k_wait_s))
        self._clock = clock
        self._since: dict[str, float] = {}
        self._looked: dict[str, float] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_extra(cls, extra: dict) -> "ReadinessGate":
        """The gate with the connector's `cartridge.ready_timeout_s` (kv_connector_extra_config)."""
        return cls(float(extra.get(READY_TIMEOUT_KEY, DEFAULT_READY_TIMEOUT_S)),
                   first_k_wait_s=float(extra.get(FIRST_K_WAIT.name, DEFAULT_FIRST_K_WAIT_S)))

    def wanted(self, request: Any) -> int:
        """The soft target: cartridge tokens LMCache should find (0: no soft wait here)."""
        return cartridge_tokens(request) if self.first_k_wait_s > 0 else 0

    def target(self, request: Any) -> int:
        """Leading tokens the gate waits for LMCache to cover (0: the request is not gated)."""
        return max(required_tokens(request), self.wanted(request))

    def _limit(self, request: Any) -> float:
        return self.timeout_s if required_tokens(request) else self.first_k_wait_s

    def match(self, request: Any, num_computed_tokens: int, lookup: Callable[[], tuple[int | None, bool]],
              relookup: Callable[[], None], promise: Callable[[int], tuple[int, bool]]) -> tuple[int | None, bool]:
        """The answer to vLLM's `get_num_new_matched_tokens` for `request`, given LMCache's
        `lookup` (its answer), `relookup` (forget LMCache's cached lookup result so the next
        `lookup` asks again) and `promise` (report `need` tokens as an external hit whose load
        must happen; returns the answer). Requests with no target: `lookup()` as is."""
        if not self.target(request):
            return lookup()
        if self.hold(request):
            return None, False
        try:
            ext, load_async = lookup()
        except Exception:  # noqa: BLE001 - a marked request is never recomputed: it waits
            if not required_tokens(request):
                raise
            logger.exception("lmcache_cartridge: lookup for request %s raised; it waits for its trained "
                             "cartridge", getattr(request, "request_id", "?"))
            ext, load_async = None, False
        verdict, need = self.decide(request, num_computed_tokens, ext)
        if verdict == READY:
            return ext, load_async
        if verdict == FAIL:
            logger.error("lmcache_cartridge: request %s waited %.1f s and its trained cartridge's KV is still "
                         "not here (%d + %s of %d tokens); failing it (never recomputed from placeholder tokens)",
                         request.request_id, self.timeout_s, num_computed_tokens, ext, need)
            return promise(need)
        # A lookup still running (None) is asked for again next step, as LMCache's own connector
        # polls it; only a finished short one is released and asked anew, at most every
        # RELOOKUP_INTERVAL_S (holding a pending one would add that interval to every request).
        if ext is not None and self.relookup_due(request.request_id):
            relookup()
        return None, False

    def decide(self, request: Any, num_computed_tokens: int, num_external_tokens: int | None) -> tuple[str, int]:
        """(verdict, required tokens) for `request` after a lookup: READY, WAIT or FAIL. A trained
        cartridge's tokens not covered by `cartridge.ready_timeout_s` fail; cartridge tokens only
        wanted (`wanted`) are waited for `cartridge.first_k_wait_s`, then READY with what there is."""
        need = required_tokens(request)
        want = max(need, self.wanted(request))
        rid = str(request.request_id)

        def covers(n: int) -> bool:
            return num_computed_tokens >= n or (num_external_tokens is not None
                                                and num_computed_tokens + num_external_tokens >= n)
        if not want or covers(want):
            self.forget(rid)
            return READY, need
        now = self._clock()
        with self._lock:
            since = self._since.setdefault(rid, now)
        if need and not covers(need):
            if now - since < self.timeout_s:
                return WAIT, need
            self.forget(rid)
            return FAIL, need
        if now - since < self.first_k_wait_s:
            return WAIT, need
        self.forget(rid)
        logger.info("lmcache_cartridge: request %s: LMCache found %s of its %d cartridge tokens after %.1f s; "
                    "the rest is computed", rid, num_external_tokens, want - num_computed_tokens, now - since)
        return READY, need

    def hold(self, request: Any) -> bool:
        """True: `request` already waits, its deadline has not passed and its next lookup is not
        due yet, so the answer is None again without asking LMCache."""
        rid = str(request.request_id)
        now = self._clock()
        with self._lock:
            since, looked = self._since.get(rid), self._looked.get(rid)
        return since is not None and looked is not None and now - since < self._limit(request) \
            and now - looked < RELOOKUP_INTERVAL_S

    def relookup_due(self, request_id: str) -> bool:
        """Whether a waiting request's lookup should be asked again (True at most every
        `RELOOKUP_INTERVAL_S`); else the cached result answers."""
        now = self._clock()
        with self._lock:
            if now - self._looked.get(str(request_id), float("-inf")) < RELOOKUP_INTERVAL_S:
                return False
            self._looked[str(request_id)] = now
            return True

    def waiting(self) -> int:
        with self._lock:
            return len(self._since)

    def forget(self, request_id: str) -> None:
        """The request was scheduled, failed or finished: drop its deadline."""
        with self._lock:
            self._since.pop(str(request_id), None)
            self._looked.pop(str(request_id), None)


def gated_answer(gate: ReadinessGate, timer: Any, request: Any, num_computed_tokens: int,
                 lookup: Callable[[], tuple[int | None, bool]], relookup: Callable[[], None],
                 promise: Callable[[int], tuple[int, bool]]) -> tuple[int | None, bool]:
    """Scheduler side, the whole of `get_num_new_matched_tokens` for both connectors (in-process
    `CartridgeConnector`, MP `CartridgeMPConnector`): LMCache's `lookup` through `gate`, timed by
    outcome on `timer` (`lookup_metrics.LookupTimer`, or None), and never an exception into vLLM's
    scheduler: a lookup that raises recomputes an unmarked request (0 tokens) and makes a marked
    one wait (a trained cartridge is never recomputed)."""
    from lmcache_cartridge.vllm.lookup_metrics import outcome_of

    t0 = time.perf_counter()
    raised, promised = [], []

    def looked():
        try:
            return lookup()
        except Exception:
            raised.append(True)  # the gate lets a marked request wait on it: still an error
            raise

    def promising(need: int):
        promised.append(need)
        return promise(need)

    rid = getattr(request, "request_id", "?")
    try:
        answer = gate.match(request, num_computed_tokens, lookup=looked, relookup=relookup, promise=promising)
        outcome = "error" if raised else "promised" if promised else outcome_of(answer)
    except Exception:
        outcome = "error"
        if required_tokens(request):  # never stop the engine; never recompute a trained cartridge
            logger.exception("lmcache_cartridge: readiness check for request %s raised; it waits", rid)
            answer = (None, False)
        else:
            logger.exception("lmcache_cartridge: lookup for request %s raised; recomputing it", rid)
            answer = (0, False)
    if timer is not None:
        timer.observe(time.perf_counter() - t0, outcome)
    return answer


def release_pins_on_relookup(engine: Any) -> bool:
    """Make `engine` (an `LMCacheEngine`) release the pins an id already holds before a pinned
    lookup under that id pins again. Idempotent; False when there is no engine to wrap.

    Where it runs: installed once per worker by the worker-role connector (and on any process's
    engine the connector sees); the wrapped `lookup` runs on LMCache's lookup-server thread. Safe
    because a request is looked up again only while it is not scheduled (it waits at the gate, or
    was preempted and its load already ran): no retrieve of it is in flight that needs these pins.
    """
    lookup = getattr(engine, "lookup", None)
    if lookup is None or not hasattr(engine, "lookup_pins"):
        return False
    if getattr(lookup, "_cartridge_relookup", False):
        return True
    signature = inspect.signature(lookup)

    @functools.wraps(lookup)
    def relookup(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        lookup_id = bound.get("lookup_id")
        if bound.get("pin") and lookup_id is not None and lookup_id in engine.lookup_pins:
            engine.lookup_unpin(lookup_id)  # `in`: lookup_pins is a defaultdict, never index it here
        return lookup(*args, **kwargs)

    relookup._cartridge_relookup = True  # type: ignore[attr-defined]
    engine.lookup = relookup  # the instance's attribute: the lookup server calls engine.lookup
    return True

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
requests (`readiness.ReadinessGate`), the lookup histogram (`lookup_metrics`), the choice of
vLLM's `kv_load_failure_policy`, the composer's build thread (`composites`) and, with KV events
on, the announcer's thread (`kv_events`);
LMCache's scheduler adapter owns the lookups and their server locks. The worker-role instance is
`LMCacheMPConnector` plus the scheduler's failed loads and, once its KV caches are registered, one
thread that maps the server's shared-memory L1 pages into the worker (`lmcache.l1_prefault`), so a
cartridge's first load is not slowed by the worker's page faults. The connector holds no KV and
no cartridge file.

A server that dies (both sides): `lmcache.mp.mq_timeout` defaults to 30 s here (`bound_server_calls`;
LMCache's 300 s is vLLM's own step timeout, past which vLLM stops its engine core for good), and a
store the server never answers is dropped on the worker (`wait_for_save`), so the step goes on:
plain and first-k requests are computed, trained ones wait and fail (the readiness rule) until
LMCache's heartbeat sees the server back and re-registers the KV caches.

Scheduler side, per request marked by the gateway as carrying a trained cartridge
(`load_failure.NO_RECOMPUTE_PARAM` + `readiness.TRAINED_TOKENS_PARAM`; unmarked requests are
LMCache's answer as is):
* ready: vLLM's prefix-cache hit + LMCache's hit covers the cartridge -> LMCache's answer;
* waiting (bounded by `cartridge.ready_timeout_s`): None, so vLLM skips the request this step and
  schedules the others. A lookup still running on the server stays as it is; one that finished
  short is released (its server read locks freed, LMCache's cached result dropped) and asked
  again at most every `readiness.RELOOKUP_INTERVAL_S`, by which time the adapter's download may
  have landed;
* out of time: the cartridge's tokens are promised as an asynchronous external hit whose load
  the worker reports failed without asking the server (`build_connector_meta` moves the retrieve
  to `cartridge_failed_loads`: a server retrieve would release read locks the request never
  took), and the per-request policy (`load_failure`, installed here as in-process) finishes the
  request with an error (HTTP 500, the gateway's 503 + Retry-After) before LMCache's bypass could
  recompute it. First-k and plain requests keep "recompute" (exact prefill).
* a request finished while its load is outstanding (failed so, or aborted) would reach vLLM's
  scheduler with two notices, its receive and LMCache's delayed send: `update_connector_output`
  lets one through (vLLM asserted on the second and the engine died).

KV events (scheduler side, `kv_events`): with vLLM's `--kv-events-config`, the cartridges the
attached server's adapter can load without the network are announced as the in-process connector
announces its plugin's ("STORAGE": the server's disk cache or a local file), so a KV-aware router
sends their requests here before vLLM has ever loaded them. The adapter's serving-state record is
found under `cartridge.cache_dir` (the adapter's `cache_dir`, default the host's) by the endpoint
it binds, matched against `lmcache.mp.host` / `lmcache.mp.port` (or a single
`lmcache.mp.server_urls`); with several servers nothing is announced. LMCache's own events (what
the server's L1 stores) pass through unchanged, first.

Composites (scheduler side, `composites`): a request naming composites a gateway registered in
its own registry (`composites.COMPOSE_PARAM`; a gateway on another host) gets them built by the
same `HostComposer` as in-process, into the registry the attached server's adapter follows: the
one its serving-state record names, found as the KV events find it (`ServerRegistry`). The
adapter serves the composite on its next refresh; meanwhile the readiness rule holds the request.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from lmcache_cartridge import ensure_log_handler
from lmcache_cartridge import settings_reference as ref
from lmcache_cartridge.vllm.load_failure import configure_load_failure_policy, must_not_recompute
from lmcache_cartridge.vllm.lookup_metrics import LookupTimer
from lmcache_cartridge.vllm.readiness import ReadinessGate, gated_answer, promised_hit

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("lmcache_cartridge.mp_connector")
ensure_log_handler()


def mp_server_urls(extra: dict) -> list[str]:
    """The LMCache server URLs the connector attaches to, read as `LMCacheMPConnector` reads them:
    `lmcache.mp.server_urls` (a list or comma-separated), else `lmcache.mp.host`:`lmcache.mp.port`."""
    urls = extra.get("lmcache.mp.server_urls")
    if urls:
        return [u.strip() for u in (urls if isinstance(urls, list) else str(urls).split(",")) if u.strip()]
    return [f"{extra.get('lmcache.mp.host', 'tcp://localhost')}:{extra.get('lmcache.mp.port', 5555)}"]


def bound_server_calls(ktc) -> None:
    """Both sides, before LMCache's connector reads its settings: `lmcache.mp.mq_timeout` defaults
    to `MQ_TIMEOUT` (30 s) instead of LMCache's 300 s, unless set. A store's slot reservation
    waits that long on a server that died; at 300 s it outlasts vLLM's own step timeout (also 300 s),
    and vLLM then stops its engine core for good, though the server comes back."""
    from lmcache_cartridge.lmcache.settings import MQ_TIMEOUT

    extra = getattr(ktc, "kv_connector_extra_config", None)
    if extra is None:
        extra = ktc.kv_connector_extra_config = {}
    extra.setdefault(MQ_TIMEOUT.name, MQ_TIMEOUT.default)


def skip_save(request_configs: dict | None) -> bool:
    """Whether a request's LMCache configs set `lmcache.skip_save`, read as in-process LMCache
    reads it (`vllm_v1_adapter`: any truthy value skips the save)."""
    return bool((request_configs or {}).get("lmcache.skip_save", False))


def mp_cache_dir(extra: dict) -> Path:
    """Where the attached server's adapter publishes its serving-state record (its `cache_dir`):
    `cartridge.cache_dir`, default the host's."""
    from lmcache_cartridge.paths import default_cache_dir

    return Path(extra.get(ref.MP_CACHE_DIR.name) or default_cache_dir()).expanduser()


class ServerRegistry:
    """`HostComposer`'s settings in MP mode: the registry the attached `lmcache server`'s adapter
    follows, and its cache dir for the composite directories. Read from the adapter's
    serving-state record (under `cartridge.cache_dir`, the one whose endpoint is the server vLLM
    attaches to, as `kv_events.mp_server_at` picks it) rather than configured again here: a
    composite built anywhere else would never be served by that adapter. Called on the
    composer's build thread (it reads files and may resolve host names), again at every build:
    a restarted server's record counts. No usable record: `composites.NoRegistryHere`, the
    reason logged once (each time it changes)."""

    def __init__(self, urls: list[str], cache_dir: Path) -> None:
        from lmcache_cartridge.vllm.kv_events import mp_server_at

        self._urls, self._cache_dir = urls, cache_dir
        self._select = mp_server_at(urls[0]) if len(urls) == 1 else None
        self._said = ""  # what was last logged (a reason, or the registry used): build thread only

    def __call__(self):
        import socket
        from types import SimpleNamespace

        from lmcache_cartridge.store.serving_state import read_states
        from lmcache_cartridge.vllm.composites import NoRegistryHere

        state, why = None, ""
        if self._select is None:
            why = (f"{len(self._urls)} LMCache servers (lmcache.mp.server_urls): each would need the "
                   "composite; a gateway sharing their registry must make it")
        else:
            mine = [s for s in read_states(self._cache_dir) if self._select(s)]
            if not mine:
                why = (f"no cartridge adapter's record for the LMCache server at {self._urls[0]} under "
                       f"{self._cache_dir} ({ref.MP_CACHE_DIR.name} names the adapter's cache_dir)")
            else:
                state = max(mine, key=lambda s: s.started)
                if state.host != socket.gethostname():
                    why = (f"the LMCache server at {self._urls[0]} runs on {state.host}: its registry "
                           f"{state.registry} is not this machine's")
        if why:
            if why != self._said:
                self._said = why
                logger.error("lmcache_cartridge: composites named by requests are not built here (such a "
                             "request waits, then fails): %s", why)
            raise NoRegistryHere(why)
        if state.registry != self._said:
            self._said = state.registry
            logger.info("lmcache_cartridge: composites named by requests are built into %s, the registry of "
                        "the LMCache server at %s", state.registry, self._urls[0])
        return SimpleNamespace(registry=Path(state.registry), cache_dir=self._cache_dir)


class CartridgeMPConnector(LMCacheMPConnector):
    """`LMCacheMPConnector` + the trained-cartridge readiness rule and load-failure policy."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        ktc = vllm_config.kv_transfer_config
        bound_server_calls(ktc)
        extra = dict(ktc.kv_connector_extra_config)
        scheduler = role == KVConnectorRole.SCHEDULER
        self._gate = ReadinessGate.from_extra(extra)
        self._lookups = LookupTimer() if scheduler else None
        # scheduler side, by request id: the LMCache hit (tokens) of a lookup that finished short
        # while the request waits; requests promised at their deadline (their load is failed on
        # the worker, the server is not asked); requests whose retrieve was sent and not yet
        # reported received; finished requests with two notices to come (True: one was dropped)
        self._short: dict[str, int] = {}
        self._doomed: set[str] = set()
        self._recv_pending: set[str] = set()
        self._two_notices: dict[str, bool] = {}
        # worker side: what the scheduler failed this step (blocks, request ids), until vLLM asks
        self._failed_blocks: set[int] = set()
        self._failed_recv: set[str] = set()
        if scheduler:
            configure_load_failure_policy(ktc, kv_cache_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self._announcer = self._residency_announcer(vllm_config, kv_cache_config, extra) if scheduler else None
        self._composer = None
        if scheduler:
            from lmcache_cartridge.vllm.composites import HostComposer

            self._composer = HostComposer(ServerRegistry(mp_server_urls(extra), mp_cache_dir(extra)))
        logger.info("lmcache_cartridge: CartridgeMPConnector ready (role %s)", role.name)

    @staticmethod
    def _residency_announcer(vllm_config: "VllmConfig", kv_cache_config, extra: dict):
        """Scheduler side, with vLLM's KV events on: the announcer of the attached server's
        resident cartridges (`kv_events`), publishing through the publisher vLLM creates right
        after this constructor; None when events are off or cannot be announced soundly."""
        kec = getattr(vllm_config, "kv_events_config", None)
        if kec is None or not kec.enable_kv_cache_events:
            return None
        from lmcache_cartridge.vllm import kv_events

        urls = mp_server_urls(extra)
        why_not = kv_events.why_no_announcements(vllm_config, kv_cache_config)
        if why_not is None and len(urls) != 1:
            why_not = (f"{len(urls)} LMCache servers (lmcache.mp.server_urls): a cartridge is local on none "
                       "of them alone")
        if why_not:
            logger.info("lmcache_cartridge: resident cartridges are not announced as KV events: %s", why_not)
            return None
        from types import SimpleNamespace

        cache_dir = mp_cache_dir(extra)
        announcer = kv_events.ResidencyAnnouncer(
            lambda: SimpleNamespace(cache_dir=cache_dir), int(vllm_config.cache_config.block_size or 0),
            str(vllm_config.cache_config.prefix_caching_hash_algo),
            period_s=float(extra.get(ref.KV_EVENTS_PERIOD.name, ref.KV_EVENTS_PERIOD.default)),
            reannounce_s=float(extra.get(ref.KV_EVENTS_REANNOUNCE.name, ref.KV_EVENTS_REANNOUNCE.default)),
            select=kv_events.mp_server_at(urls[0]))
        kv_events.capture_publisher(announcer.use_publisher)
        logger.info("lmcache_cartridge: announcing the cartridges of the LMCache server at %s (records under %s) "
                    "as KV events", urls[0], cache_dir)
        return announcer

    def take_events(self):
        """Scheduler side (once per scheduler step when vLLM publishes KV events): LMCache's
        events, then the attached server's resident cartridges (`kv_events`), computed off this
        thread."""
        from lmcache_cartridge.vllm.kv_events import take_safely

        yield from super().take_events()
        yield from take_safely(self._announcer)

    def shutdown(self):
        """Both sides, when vLLM shuts the connector down: stop announcing, then LMCache's."""
        if getattr(self, "_announcer", None) is not None:
            self._announcer.stop()
        return super().shutdown()

    def must_not_recompute(self, request) -> bool:
        """Scheduler side, asked by the per-request policy (`load_failure`) for each request with a
        failed KV load: True fails the request instead of recomputing it."""
        return must_not_recompute(request)

    # --- scheduler side -------------------------------------------------------------------
    def _get_or_create_request_tracker(self, request):
        """Scheduler side: LMCache's tracker, with `lmcache.skip_save` honoured. In-process LMCache
        stores nothing of a request that sets it; `LMCacheMPConnector` reads only
        `lmcache.max_offload_tokens` and would store the request's KV in the server (for a
        trained cartridge's prompt: KV computed from placeholder tokens, under keys other
        requests share). Here skip_save means `max_offload_tokens: 0` unless that is set too."""
        tracker = super()._get_or_create_request_tracker(request)
        if tracker.max_offload_tokens is None and skip_save(tracker.request_configs):
            tracker.max_offload_tokens = 0
        return tracker

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Scheduler side (EngineCore process, inside `Scheduler.schedule`, each step for each
        waiting request it reaches): the composites it names built for the server (off this
        thread), then LMCache's lookup through the readiness rule, timed."""
        rid = str(request.request_id)
        if self._composer is not None:
            try:
                self._composer.submit(request)
            except Exception:  # noqa: BLE001 - the readiness rule decides what a missing composite means
                logger.exception("lmcache_cartridge: composing for request %s failed", rid)
        return gated_answer(self._gate, self._lookups, request, num_computed_tokens,
                            lookup=lambda: self._lookup(request, num_computed_tokens),
                            relookup=lambda: self._relookup(rid),
                            promise=lambda need: self._promise_trained(request, num_computed_tokens, need))

    def _lookup(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        answer = super().get_num_new_matched_tokens(request, num_computed_tokens)
        rid = str(request.request_id)
        target = self._gate.target(request)
        if answer[0] is not None and target:
            if num_computed_tokens + answer[0] < target:
                # finished short: remember the hit it locked on the server, to release it
                # (a miss leaves the tracker's hit at 0)
                self._short[rid] = int(self._get_request_tracker(request.request_id).num_lmcache_hit_tokens)
            else:
                self._short.pop(rid, None)
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
            self._free_lookup_locks(tracker, rid, hit)
        self.scheduler_adapter.cleanup_lookup_result(rid)
        tracker.num_lmcache_hit_tokens = tracker.num_stored_tokens = 0

    def _free_lookup_locks(self, tracker, rid: str, hit: int) -> None:
        """Release the read locks a finished lookup of `hit` tokens took on the server. LMCache
        0.5.7 keys by packed token ids and locks only from the lookup's start (chunks vLLM's prefix
        cache covered are touched, not locked), plus ranges its abandoned lookups left locked;
        0.5.6 keys by token ids and locks from 0."""
        common = {"end": hit, "request_id": rid, "cache_salt": tracker.cache_salt,
                  "request_configs": tracker.request_configs}
        if hasattr(tracker, "packed_token_ids"):  # LMCache 0.5.7
            extra, tracker.pending_free_ranges = tuple(tracker.pending_free_ranges), []
            self.scheduler_adapter.free_lookup_locks(packed_token_ids=tracker.packed_token_ids(),
                                                     start=min(tracker.apc_covered_tokens, hit),
                                                     extra_ranges=extra, **common)
        else:
            self.scheduler_adapter.free_lookup_locks(token_ids=tracker.get_token_ids(), start=0, **common)

    def _promise_trained(self, request, num_computed_tokens: int, need: int) -> tuple[int, bool]:
        """The wait is over and the trained cartridge is not (all) on the server: report its `need`
        tokens as an asynchronous external hit, whose load fails. LMCache plans the retrieve
        (`update_state_after_alloc`, `build_connector_meta`) as for a hit of that length, but this
        connector takes it out of the step's metadata and has the worker report its blocks as a
        failed load, without asking the server (whose retrieve would release read locks this
        request never took, other requests' locks on the same chunks); the per-request policy
        then fails the request. A prompt that is exactly the cartridge: the full prompt is the
        hit, its last token computed, as LMCache's own lookup reports it."""
        rid = str(request.request_id)
        if need <= num_computed_tokens:  # vLLM's own prefix cache holds it now: nothing to load
            return 0, False
        self._short.pop(rid, None)
        promised = promised_hit(request, need)
        tracker = self._get_request_tracker(request.request_id)
        tracker.num_lmcache_hit_tokens = tracker.num_stored_tokens = promised
        tracker.num_vllm_hit_tokens = num_computed_tokens // self._hit_alignment_tokens * self._hit_alignment_tokens
        self._doomed.add(rid)
        return need - num_computed_tokens, True

    def build_connector_meta(self, scheduler_output):
        """Scheduler side, once per step: LMCache's metadata, with each promised request's retrieve
        moved to `cartridge_failed_loads` (request id -> the vLLM blocks it was to fill, past
        those vLLM already holds), which the worker reports as failed without a server call."""
        metadata = super().build_connector_meta(scheduler_output)
        failed: dict[str, list[int]] = {}
        kept = []
        for m in metadata.requests:
            rid = str(m.request_id)
            if m.direction != "RETRIEVE":
                kept.append(m)
                continue
            self._recv_pending.add(rid)
            if rid in self._doomed:
                self._doomed.discard(rid)
                per_block = max(1, int(self._group_tokens_per_block[0] or 1))
                failed[rid] = m.op.flat_block_ids[m.op.skip_first_n_tokens // per_block:]
            else:
                kept.append(m)
        metadata.requests = kept
        metadata.cartridge_failed_loads = failed
        return metadata

    def update_connector_output(self, connector_output) -> None:
        """Scheduler side, at the start of vLLM's handling of the workers' transfer notices. A
        request finished while its load was outstanding (failed by the policy, or aborted) gets
        two notices: its receive, and its send (LMCache delays every finished request's free
        until the send is reported). vLLM frees the request on the first and asserts on the
        second (the engine dies), and a send reported while the retrieve still writes would
        free blocks being written: the first of the two is dropped here, the other frees it
        (both in one step: the send)."""
        recv = set(connector_output.finished_recving or ())
        send = set(connector_output.finished_sending or ())
        for rid, dropped_one in list(self._two_notices.items()):
            r, s = rid in recv, rid in send
            if r and s:
                recv.discard(rid)
                del self._two_notices[rid]
            elif (r or s) and dropped_one:
                del self._two_notices[rid]
            elif r or s:
                recv.discard(rid)
                send.discard(rid)
                self._two_notices[rid] = True
        self._recv_pending -= set(connector_output.finished_recving or ())
        if connector_output.finished_recving is not None:
            connector_output.finished_recving = recv
        if connector_output.finished_sending is not None:
            connector_output.finished_sending = send
        super().update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        """Scheduler side: a request ended (also one aborted while it waited or loaded): drop its
        deadline; expect two notices when its receive is outstanding and LMCache delays its free."""
        rid = str(request.request_id)
        self._gate.forget(rid)
        self._short.pop(rid, None)
        self._doomed.discard(rid)
        delay, params = super().request_finished(request, block_ids)
        if rid in self._recv_pending:
            self._recv_pending.discard(rid)
            if delay:
                self._two_notices[rid] = False
                while len(self._two_notices) > 4096:  # notices that never came (a worker lost): oldest go
                    self._two_notices.pop(next(iter(self._two_notices)))
        return delay, params

    # --- worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        """Worker side, once: LMCache's registration (which maps the server's L1 where it is in
        shared memory), then this worker's mapping of its pages set up in the background."""
        super().register_kv_caches(kv_caches)
        from lmcache_cartridge.lmcache.l1_prefault import map_l1_pages

        map_l1_pages()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Worker side, before the forward pass: the scheduler's failed loads are recorded (their
        blocks reported by `get_block_ids_with_load_errors`, their requests as received by
        `get_finished`), then LMCache's retrieves."""
        failed = getattr(self._get_connector_metadata(), "cartridge_failed_loads", None) or {}
        for rid, blocks in failed.items():
            self._failed_blocks.update(int(b) for b in blocks)
            self._failed_recv.add(rid)
        if failed:
            logger.error("lmcache_cartridge: trained-cartridge KV not loaded for requests %s (not on the LMCache "
                         "server by the deadline): %d blocks reported failed", sorted(failed),
                         len(self._failed_blocks))
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_save(self):
        """Worker side, as the forward pass ends: LMCache's stores of this step. A store the server
        does not answer within `lmcache.mp.mq_timeout` (it died, and LMCache's heartbeat has not
        yet marked it unhealthy) raises in LMCache; uncaught, it would fail vLLM's step and stop
        the engine. The step's stores not yet submitted are dropped as LMCache drops a store while
        the server is unhealthy (with lazy offload, reported complete so their blocks are freed);
        their KV is simply not cached."""
        try:
            super().wait_for_save()
        except TimeoutError as e:
            dropped = self._drop_unsubmitted_stores()
            logger.error("lmcache_cartridge: the LMCache server did not answer a store (%s); this step's "
                         "stores for requests %s are dropped, the requests go on", e, sorted(dropped))

    def _drop_unsubmitted_stores(self) -> set[str]:
        adapter = self.worker_adapter
        dropped = {str(m.request_id) for m in self._get_connector_metadata().requests
                   if m.direction == "STORE" and m.request_id not in adapter.store_futures}
        if getattr(adapter, "lazy_offload", False):  # LMCache frees a lazy store's blocks on its receipt
            for rid in dropped:
                adapter._completed_store_requests[rid] = 1
                adapter._failed_store_requests.add(rid)
        return dropped

    def get_block_ids_with_load_errors(self) -> set[int]:
        theirs = set(super().get_block_ids_with_load_errors())
        ours, self._failed_blocks = self._failed_blocks, set()
        return theirs | ours

    def get_finished(self, finished_req_ids: set[str]):
        sending, recving = super().get_finished(finished_req_ids)
        if self._failed_recv:
            recving = set(recving or ()) | self._failed_recv
            self._failed_recv = set()
        return sending, recving

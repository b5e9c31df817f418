"""`CartridgeConnector`: vLLM's `LMCacheConnectorV1`, made usable on vLLM's CPU backend and
made unable to kill the engine.

Load it with:
    --kv-transfer-config '{"kv_connector":"CartridgeConnector",
                           "kv_connector_module_path":"lmcache_cartridge.connector",
                           "kv_role":"kv_both"}'
and LMCache's config as usual (`LMCACHE_CONFIG_FILE`, with the cartridge storage plugin).

Where it runs / who owns what: vLLM builds one instance per role, the scheduler role in the
EngineCore process (inside `Scheduler.__init__`) and the worker role with each worker (one per TP
rank; with a single rank vLLM may run it in the EngineCore process too). The scheduler instance
owns the readiness deadlines of waiting requests and sets vLLM's `kv_load_failure_policy`; a
worker instance owns the block ids of its failed loads until vLLM collects them
(`get_block_ids_with_load_errors`). The CPU hook patches LMCache's connector factory once per
process. vLLM owns the paged KV cache, LMCache (the superclass and the engine it builds) the KV it
stores and loads; the connector holds neither, nor any cartridge file (the storage plugin reads
those).

LMCache releases: LMCache 0.5.7 moved the in-process engine vLLM's `LMCacheConnectorV1` imports
(`lmcache.inprocess`); this class keeps vLLM's methods and builds LMCache's engine adapter from
where the installed release keeps it (`_init_lmcache_connector`, `lmcache_compat`), on 0.5.6 and
0.5.7 alike.

On CUDA LMCache builds its own GPU connector; the CUDA hook (`install_cuda_connector_hook`)
gives it `fused_kv`'s copies for vLLM's fused K|V caches (vLLM >= 0.26), which LMCache 0.5.6's
in-process connector misaddresses. On other non-CPU platforms it is exactly `LMCacheConnectorV1`.
On vLLM's CPU backend LMCache has no connector ("No supported cpu connector
found") and would run degraded (every request recomputed after a lookup timeout). The hook:
LMCache's vLLM service factory resolves `CreateGPUConnector` in its in-process GPU connector package
(`lmcache.v1.gpu_connector`; `lmcache.inprocess.v1.gpu_connector` from LMCache 0.5.7) at call
time (`VllmServiceFactory.get_or_create_lmcache_engine`, worker role), so before LMCache starts
we wrap that one function: for `EngineType.VLLM` on LMCache's "cpu" device type it returns our
`cpu_kv.CpuPagedKVConnector`; every other case goes to LMCache's original. Nothing else in
LMCache or vLLM is replaced.

Failure handling (a connector exception in a vLLM worker would otherwise kill the engine):
* scheduler `get_num_new_matched_tokens` raising -> 0 external tokens (recompute), logged;
* worker `start_load_kv` raising, the CPU connector refusing/failing a load, or a chunk that
  cannot be read after its lookup hit (LMCache then retrieves fewer tokens than it promised) ->
  the request's blocks that were to be loaded are reported by `get_block_ids_with_load_errors`,
  and the scheduler decides per request (`load_failure`): a request carrying a trained cartridge
  (the gateway marks it, `load_failure.NO_RECOMPUTE_PARAM`) is failed with an error and its
  failed blocks are evicted from vLLM's prefix cache (recomputing placeholder tokens would be a
  wrong answer); every other request recomputes the blocks (for first-k cartridges exactly
  prefill). So the scheduler-role connector installs that per-request policy and then sets
  vLLM's `kv_load_failure_policy` (default "fail") to "recompute". If the policy cannot be
  installed (a vLLM it was not read against) it sets "fail": every failed load fails its
  request, first-k ones too, rather than a trained one being recomputed.
  `kv_connector_extra_config.cartridge.keep_load_failure_policy: true` leaves vLLM's policy as
  configured (and no per-request policy);
* save paths raising -> logged, nothing stored for that step.

Readiness (scheduler side, `readiness`): a request the gateway marked as carrying a trained
cartridge (`NO_RECOMPUTE_PARAM` + `readiness.TRAINED_TOKENS_PARAM`) is scheduled only once this
instance can load the cartridge's tokens: until then `get_num_new_matched_tokens` answers None
(vLLM skips it this step and asks again; other requests are scheduled), at most
`cartridge.ready_timeout_s` (kv_connector_extra_config, default 30 s), then its tokens are
promised as an external hit whose load fails, and the per-request policy above fails it. A lookup
that raises for such a request also makes it wait (never 0 tokens, which would recompute it).

KV events (scheduler side, `kv_events`): with vLLM's `--kv-events-config`, cartridges resident
in the plugin's memory tier or disk cache are announced like vLLM's own blocks ("CPU" / "STORAGE"),
so a KV-aware router sends their requests here before vLLM has ever loaded them.

Composites (scheduler side, `composites`): a request naming composites the gateway registered on
its own host (`composites.COMPOSE_PARAM`) gets them built in this host's registry, off the
scheduler's thread; the readiness rule holds the request until the plugin serves them.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

from lmcache_cartridge import ensure_log_handler
from lmcache_cartridge import settings_reference as ref
from lmcache_cartridge.vllm.load_failure import configure_load_failure_policy
from lmcache_cartridge.vllm.lookup_metrics import LookupTimer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("lmcache_cartridge.connector")

# How long the connector's shutdown waits for LMCache's own (its services, then its engine; LMCache
# bounds each step by 5-15 s). Past it the storage manager's event loop is stopped, whose thread is
# not a daemon: left running, it keeps the process from ever exiting.
LMCACHE_SHUTDOWN_S = 30.0
ensure_log_handler()

_hook_lock = threading.Lock()


def _on_cpu_backend(vllm_config: "VllmConfig") -> bool:
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return True
    except Exception as e:  # no platform to ask: the device the config names decides
        logger.debug("lmcache_cartridge: vLLM's current platform unknown (%s: %s)", type(e).__name__, e)
    return str(getattr(vllm_config.device_config, "device", "")).startswith("cpu")


def _wrap_connector_factory(device_type: str, marker: str, wrap) -> bool:
    """Replace LMCache's `CreateGPUConnector` by `wrap(original)`, once per `marker`, where LMCache
    runs on `device_type`; False (nothing changed) elsewhere. LMCache's vLLM service factory
    resolves the function at call time, so it takes the wrapper."""
    import lmcache

    from lmcache_cartridge.lmcache_compat import gpu_connector_module

    gc = gpu_connector_module()

    if getattr(lmcache, "torch_device_type", None) != device_type:
        return False
    with _hook_lock:
        original = gc.CreateGPUConnector
        if getattr(original, marker, False):
            return True
        wrapper = wrap(original)
        setattr(wrapper, marker, True)
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        gc.CreateGPUConnector = wrapper
    return True


def install_cpu_connector_hook(kv_cache_dtype: str = "auto") -> bool:
    """Make LMCache build `CpuPagedKVConnector` for vLLM on its "cpu" device type. Idempotent.

    Returns True if the hook is (now) installed, False if LMCache is not on a CPU device type
    (then nothing is changed).
    """
    import lmcache

    def wrap(original):
        def CreateGPUConnector(config, metadata, engine, layout_hints=None):  # noqa: N802
            from lmcache.utils import EngineType

            from lmcache_cartridge.vllm.cpu_kv import CpuPagedKVConnector

            if engine == EngineType.VLLM and getattr(lmcache, "torch_device_type", None) == "cpu":
                if config.use_layerwise or config.enable_blending:
                    raise RuntimeError(
                        "lmcache_cartridge CPU connector supports neither use_layerwise nor "
                        "enable_blending; turn them off to use LMCache on vLLM's CPU backend")
                logger.info("lmcache_cartridge: LMCache on vLLM's CPU backend uses CpuPagedKVConnector")
                return CpuPagedKVConnector.from_metadata(metadata, kv_cache_dtype=kv_cache_dtype, config=config)
            return original(config, metadata, engine, layout_hints=layout_hints)
        return CreateGPUConnector

    return _wrap_connector_factory("cpu", "_cartridge_cpu_hook", wrap)


def install_cuda_connector_hook() -> bool:
    """Make the CUDA connector LMCache builds for vLLM copy vLLM's fused K|V caches correctly
    (`fused_kv`: LMCache 0.5.6's own copy of them misaddresses every row). Idempotent.

    LMCache's factory still decides everything; an instance of exactly its
    `VLLMPagedMemGPUConnectorV2` gets the class `fused_kv.FusedKVGPUConnector`, which keeps its
    state and copies every other layout as before. Returns True if the hook is (now) installed,
    False if LMCache is not on CUDA (then nothing is changed)."""
    def wrap(original):
        def CreateGPUConnector(config, metadata, engine, layout_hints=None):  # noqa: N802
            from lmcache.utils import EngineType

            from lmcache_cartridge.lmcache_compat import VLLMPagedMemGPUConnectorV2

            from lmcache_cartridge.vllm import fused_kv

            conn = original(config, metadata, engine, layout_hints=layout_hints)
            if type(conn) is VLLMPagedMemGPUConnectorV2:
                conn.__class__ = fused_kv.connector_class()
                logger.info("lmcache_cartridge: LMCache's CUDA connector copies fused K|V caches with "
                            "fused_kv.FusedKVGPUConnector")
            elif engine == EngineType.VLLM:
                logger.warning("lmcache_cartridge: LMCache built %s (V3 or layerwise): it copies vLLM's fused "
                               "K|V cache (vLLM >= 0.26) with LMCache 0.5.6's own kernels, which misaddress it",
                               type(conn).__name__)
            return conn
        return CreateGPUConnector

    return _wrap_connector_factory("cuda", "_cartridge_cuda_hook", wrap)


def why_not_engine_blocks(lmcache_engine) -> str | None:
    """None if memory objects of this LMCache engine may hold vLLM's own block bytes
    (`cpu_kv.EngineBlocks`: a hit is a block copy, not a layout conversion), else why not. Only
    if every backend keeps its bytes in this process: LMCache's CPU cache and read-only cartridge
    plugins. A disk, remote or peer backend would hand those bytes to a reader (another process,
    a later run, another CPU) that expects `KV_2LTD`."""
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin

    backends = getattr(getattr(lmcache_engine, "storage_manager", None), "storage_backends", None)
    if backends is None:
        return "LMCache built no storage manager on this rank"
    others = [n for n, b in backends.items() if not isinstance(b, (LocalCPUBackend, CartridgeStoragePlugin))]
    return f"LMCache backends {others} may keep KV outside this process" if others else None


class CartridgeConnector(LMCacheConnectorV1):
    """`LMCacheConnectorV1` + a CPU KV connector for vLLM-CPU + recompute instead of crashing."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig" = None) -> None:
        self._cpu_backend = False
        self._failed_blocks: set[int] = set()
        self._failed_lock = threading.Lock()
        self._block_size = int(vllm_config.cache_config.block_size or 0)
        ktc = vllm_config.kv_transfer_config
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        from lmcache_cartridge.vllm.readiness import ReadinessGate

        self._gate = ReadinessGate.from_extra(extra)
        from lmcache_cartridge.vllm.composites import HostComposer

        self._composer = HostComposer(self._plugin_settings)
        self._announcer = None
        kec = getattr(vllm_config, "kv_events_config", None)
        events_on = role == KVConnectorRole.SCHEDULER and kec is not None and kec.enable_kv_cache_events
        why_not = self._why_no_announcements(vllm_config, kv_cache_config) if events_on else None
        if why_not:
            logger.info("lmcache_cartridge: resident cartridges are not announced as KV events: %s", why_not)
        elif events_on:
            from lmcache_cartridge.vllm import kv_events

            self._announcer = kv_events.ResidencyAnnouncer(
                self._plugin_settings, self._block_size, str(vllm_config.cache_config.prefix_caching_hash_algo),
                period_s=float(extra.get(ref.KV_EVENTS_PERIOD.name, ref.KV_EVENTS_PERIOD.default)),
                reannounce_s=float(extra.get(ref.KV_EVENTS_REANNOUNCE.name, ref.KV_EVENTS_REANNOUNCE.default)))
            # vLLM creates its publisher right after this constructor returns: publish through it
            # from our thread, so an idle instance announces too (see kv_events).
            kv_events.capture_publisher(self._announcer.use_publisher)
        self._lookups = LookupTimer() if role == KVConnectorRole.SCHEDULER else None
        if role == KVConnectorRole.SCHEDULER:
            configure_load_failure_policy(ktc, kv_cache_config)
        if _on_cpu_backend(vllm_config):
            try:
                self._cpu_backend = install_cpu_connector_hook(str(vllm_config.cache_config.cache_dtype))
            except Exception:
                logger.exception("lmcache_cartridge: could not install the CPU KV connector; "
                                 "LMCache will run without one (recompute)")
        else:
            install_cuda_connector_hook()
        self._init_lmcache_connector(vllm_config, role, kv_cache_config)
        self._release_pins_on_relookup()
        logger.info("lmcache_cartridge: CartridgeConnector ready (role %s, cpu backend %s)",
                    role.name, self._cpu_backend)

    def _init_lmcache_connector(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config) -> None:
        """vLLM's `LMCacheConnectorV1.__init__` (0.32), with LMCache's `LMCacheConnectorV1Impl` taken
        from where the installed LMCache keeps it (`lmcache_compat`). vLLM's own imports it from
        `lmcache.integration.vllm.vllm_v1_adapter`, which LMCache 0.5.7 moved under
        `lmcache.inprocess`; LMCache's `LMCacheConnectorV1Dynamic` wraps the moved one but lacks the
        KV-event and metadata-binding methods of vLLM's class, which this class keeps on both
        releases. vLLM's other path (`use_native`: its vendored copy of LMCache's adapter) imports
        `lmcache.config`, which no supported LMCache has."""
        from lmcache_cartridge.lmcache_compat import LMCacheConnectorV1Impl

        ktc = vllm_config.kv_transfer_config
        if ktc is not None and ktc.get_from_extra_config("use_native", False):
            logger.warning("lmcache_cartridge: kv_connector_extra_config.use_native is ignored: vLLM's vendored "
                           "LMCache adapter imports modules no supported LMCache has")
        KVConnectorBase_V1.__init__(self, vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._lmcache_engine = LMCacheConnectorV1Impl(vllm_config, role, self)
        self._kv_cache_events = None

    def _release_pins_on_relookup(self) -> None:
        """In the process whose LMCache engine answers lookups (each worker; also the scheduler
        with LMCache's bypass lookup), right after LMCache built it: a lookup the readiness gate
        repeats releases the request's earlier pins instead of leaking them
        (`readiness.release_pins_on_relookup`). The scheduler process has no engine otherwise."""
        from lmcache_cartridge.vllm.readiness import release_pins_on_relookup

        try:
            release_pins_on_relookup(self._lmc_engine())
        except Exception:  # noqa: BLE001 - a leak until the pin lease, never a dead engine
            logger.exception("lmcache_cartridge: could not make repeated lookups release their pins")

    @staticmethod
    def _why_no_announcements(vllm_config: "VllmConfig", kv_cache_config) -> str | None:
        """Why resident cartridges cannot be announced as vLLM hashes blocks (`kv_events`), or None."""
        from lmcache_cartridge.vllm.kv_events import why_no_announcements

        return why_no_announcements(vllm_config, kv_cache_config)

    def shutdown(self):
        """Both sides, when vLLM shuts the connector down (the scheduler after closing its event
        publisher; a worker when it exits, also after a failed engine start): stop announcing,
        then LMCache's shutdown (`_shutdown_lmcache`)."""
        if self._announcer is not None:
            self._announcer.stop()
        conn = self._cpu_kv()
        if conn is not None:
            conn.withdraw_engine_blocks()
            conn.close()
        out = super().shutdown()
        self._shutdown_lmcache()
        return out

    def _shutdown_lmcache(self) -> None:
        """Both sides: LMCache's own shutdown (its services, its engine, the storage plugin's
        close), at most `LMCACHE_SHUTDOWN_S`. vLLM's `LMCacheConnectorV1` does not pass shutdown
        on (vLLM 0.32 keeps the base class's no-op; vllm-project/vllm#36852), so LMCache's
        storage manager kept its event loop thread, which is not a daemon, running for ever: a
        worker whose engine core failed to start never exited, nor did vLLM's API server, which
        waits for it. Where vLLM's class does pass it on, `super().shutdown()` has done this
        already."""
        impl = getattr(self, "_lmcache_engine", None)
        if impl is None or not hasattr(impl, "shutdown") or lmcache_connector_shuts_lmcache_down():
            return
        t = threading.Thread(target=impl.shutdown, name="cartridge-lmcache-shutdown", daemon=True)
        t.start()
        t.join(LMCACHE_SHUTDOWN_S)
        if not t.is_alive():
            return
        logger.error("lmcache_cartridge: LMCache's shutdown did not finish in %.0f s; stopping its storage "
                     "manager's event loop so that the process can exit", LMCACHE_SHUTDOWN_S)
        loop = getattr(getattr(self._lmc_engine(), "storage_manager", None), "loop", None)
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)

    def must_not_recompute(self, request) -> bool:
        """Scheduler side, asked by the per-request policy (`load_failure`) for each request with a
        failed KV load: True fails the request instead of recomputing it."""
        from lmcache_cartridge.vllm.load_failure import must_not_recompute

        return must_not_recompute(request)

    # --- helpers --------------------------------------------------------------------------
    def _plugin_settings(self):
        """The cartridge plugin's settings from LMCache's config (None: no cartridge plugin)."""
        from lmcache_cartridge.errors import CartridgeError
        from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
        from lmcache_cartridge.lmcache.settings import PluginSettings

        try:
            return PluginSettings.from_config(self._impl().config, CartridgeStoragePlugin)
        except CartridgeError as e:
            logger.warning("lmcache_cartridge: no cartridge plugin settings here (composites are not "
                           "built, resident cartridges not announced): %s", e)
            return None

    def _impl(self):
        return self._lmcache_engine  # LMCacheConnectorV1Impl

    def _lmc_engine(self):
        try:
            return self._impl().lmcache_engine
        except Exception:
            return None

    def _cpu_kv(self):
        from lmcache_cartridge.vllm.cpu_kv import CpuPagedKVConnector

        eng = self._lmc_engine()
        conn = getattr(eng, "gpu_connector", None)
        return conn if isinstance(conn, CpuPagedKVConnector) else None

    def _load_blocks(self, req) -> set[int]:
        """vLLM block ids a request's LMCache load was to fill."""
        spec = getattr(req, "load_spec", None)
        if spec is None or not spec.can_load or req.slot_mapping is None or not self._block_size:
            return set()
        lo, hi = int(spec.vllm_cached_tokens), int(spec.lmcache_cached_tokens)
        slots = req.slot_mapping[lo:hi].to("cpu").long()
        slots = slots[slots >= 0]
        return {int(b) for b in (slots // self._block_size).unique().tolist()}

    def _fail_requests(self, req_ids: set[str] | None, why: str) -> None:
        """Report the load blocks of `req_ids` (None: every loading request this step) as failed."""
        try:
            metadata = self._get_connector_metadata()
            requests = list(getattr(metadata, "requests", []))
        except Exception:
            requests = []
        blocks: set[int] = set()
        names = []
        for req in requests:
            if req_ids is not None and str(req.req_id) not in req_ids:
                continue
            b = self._load_blocks(req)
            if b:
                blocks |= b
                names.append(str(req.req_id))
                eng = self._lmc_engine()
                if eng is not None:
                    try:
                        eng.lookup_unpin(req.req_id)
                    except Exception as e:  # the failure is reported below either way
                        logger.warning("lmcache_cartridge: unpinning the lookup of request %s failed: %s: %s",
                                       req.req_id, type(e).__name__, e)
        if blocks:
            with self._failed_lock:
                self._failed_blocks |= blocks
            logger.error("lmcache_cartridge: KV load failed for requests %s (%s): %d blocks reported to "
                         "the scheduler (recomputed, or the request failed if it carries a trained "
                         "cartridge)", names, why, len(blocks))

    # --- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]):
        super().register_kv_caches(kv_caches)
        conn = self._cpu_kv()
        if conn is not None:
            from lmcache_cartridge.vllm.cpu_kv import UnverifiedKVLayout

            try:
                conn.check_layout(list(kv_caches.values()))
                self._declare_engine_blocks(conn)
            except UnverifiedKVLayout as e:
                logger.error("lmcache_cartridge: LMCache hits will be recomputed on this engine: %s", e)
            except Exception:
                logger.exception("lmcache_cartridge: checking vLLM's CPU KV layout failed")

    def _declare_engine_blocks(self, conn) -> None:
        """Worker side, in `register_kv_caches` once the CPU layout is verified (LMCache has just
        built its storage manager): let memory objects hold vLLM's own blocks where that is safe."""
        why = why_not_engine_blocks(self._lmc_engine())
        if why is None and conn.declare_engine_blocks() is None:
            why = f"turned off ({ref.ENGINE_BLOCKS.name}=0)" if not conn.ENGINE_BLOCKS else "no single layout"
        if why is not None:
            logger.info("lmcache_cartridge: LMCache memory objects stay KV_2LTD: %s", why)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        try:
            super().start_load_kv(forward_context, **kwargs)
        except Exception as e:
            logger.exception("lmcache_cartridge: start_load_kv raised; recomputing this step's loads")
            self._fail_requests(None, f"{type(e).__name__}: {e}")
        conn = self._cpu_kv()
        if conn is not None:
            failed = conn.take_failed_loads()
            if failed:
                self._fail_requests(set(failed), "; ".join(sorted(set(failed.values())))[:500])

    def wait_for_layer_load(self, layer_name: str) -> None:
        try:
            super().wait_for_layer_load(layer_name)
        except Exception as e:
            logger.exception("lmcache_cartridge: wait_for_layer_load raised")
            self._fail_requests(None, f"{type(e).__name__}: {e}")

    def _store_refused(self) -> bool:
        """On a refused CPU layout LMCache would allocate memory objects for a store that then
        raises, and never free them: do not start such a store at all."""
        conn = self._cpu_kv()
        return conn is not None and conn.refused

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        if self._store_refused():
            return
        try:
            super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        except Exception:
            logger.exception("lmcache_cartridge: save_kv_layer raised; KV of this step not saved")

    def wait_for_save(self):
        if self._store_refused():
            # LMCache's wait_for_save also releases each request's lookup pins: keep that part.
            try:
                eng = self._lmc_engine()
                for request in getattr(self._get_connector_metadata(), "requests", []):
                    eng.lookup_unpin(request.req_id)
            except Exception:
                logger.exception("lmcache_cartridge: releasing lookup pins failed")
            return
        try:
            super().wait_for_save()
        except Exception:
            logger.exception("lmcache_cartridge: wait_for_save raised; KV of this step not saved")

    def get_block_ids_with_load_errors(self) -> set[int]:
        try:
            theirs = set(super().get_block_ids_with_load_errors())
        except Exception:
            logger.exception("lmcache_cartridge: get_block_ids_with_load_errors raised")
            theirs = set()
        with self._failed_lock:
            ours, self._failed_blocks = self._failed_blocks, set()
        return theirs | ours

    # --- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Scheduler side (EngineCore process, inside `Scheduler.schedule`, each step for each
        waiting request it reaches). LMCache's lookup, then the readiness rule for requests with
        a trained cartridge (`readiness`): wait (None: vLLM asks again next step and schedules the
        others meanwhile) until the cartridge's KV can be loaded, bounded; then fail, never
        schedule it to be recomputed. Each answer is timed by outcome (`lookup_metrics`: why that
        time is worth a metric)."""
        from lmcache_cartridge.vllm.readiness import gated_answer

        rid = getattr(request, "request_id", "?")
        try:
            self._composer.submit(request)  # a composite the gateway made elsewhere: build it here
        except Exception:  # noqa: BLE001 - the readiness rule decides what a missing composite means
            logger.exception("lmcache_cartridge: composing for request %s failed", rid)
        return gated_answer(
            self._gate, self._lookups, request, num_computed_tokens,
            lookup=lambda: super(CartridgeConnector, self).get_num_new_matched_tokens(request, num_computed_tokens),
            relookup=lambda: self._impl().lookup_client.clear_lookup_status(rid),
            promise=lambda need: self._promise_trained(request, num_computed_tokens, need))

    def _promise_trained(self, request, num_computed_tokens: int, need: int):
        """The wait is over and the trained cartridge is still not (all) here: schedule its
        `need` tokens as an external hit whose load LMCache must perform. Its retrieve gets fewer
        tokens than promised, LMCache reports the blocks failed and `load_failure` fails the
        request (if the chunks arrived meanwhile, the load just succeeds). LMCache's load spec is
        set as its own lookup would have set it for a hit of that length
        (`update_state_after_alloc` checks that arithmetic)."""
        from lmcache_cartridge.lmcache_compat import LoadSpec
        from lmcache_cartridge.vllm.readiness import promised_hit

        self._impl().load_specs[request.request_id] = LoadSpec(
            vllm_cached_tokens=num_computed_tokens, lmcache_cached_tokens=promised_hit(request, need),
            can_load=False)
        return need - num_computed_tokens, False

    def take_events(self):
        """Scheduler side (EngineCore process, once per scheduler step when vLLM publishes KV
        events; vLLM publishes what this yields with its block pool's events): LMCache's events,
        then the cartridges resident in the plugin's tiers (`kv_events`), computed off this thread."""
        from lmcache_cartridge.vllm.kv_events import take_safely

        yield from super().take_events()
        yield from take_safely(self._announcer)

    def request_finished(self, request, block_ids):
        """Scheduler side: a request ended (also one aborted while it waited): drop its deadline."""
        self._gate.forget(request.request_id)
        return super().request_finished(request, block_ids)


def lmcache_connector_shuts_lmcache_down() -> bool:
    """Whether vLLM's `LMCacheConnectorV1` passes `shutdown` on to LMCache (a class of its own, not
    the base class's no-op)."""
    return LMCacheConnectorV1.shutdown is not KVConnectorBase_V1.shutdown

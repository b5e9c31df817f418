"""Composites built on the instance's own host, from the recipe the gateway sends.

Why: a composite (several cartridges served together, or a trained run after computed tokens,
`store.composite`) is registered by the gateway in its host's registry. Behind vllm-router the
instance may be on another host with its own registry (synced from the S3 catalog), which has
the parts but not the composite: its chunk keys would miss, and the readiness rule would fail the
request. So the gateway sends each composite's recipe in `kv_transfer_params[COMPOSE_PARAM]`, and
the instance builds the same composite (same id: a function of the parts' bytes and the context
ids) in its own registry. The plugin picks it up on its next registry refresh; meanwhile the
readiness rule holds the request (it carries `readiness.TRAINED_TOKENS_PARAM`).

Where it runs: the scheduler-role `CartridgeConnector.get_num_new_matched_tokens` (EngineCore
process) calls `HostComposer.submit` for each waiting request it asks about; in LMCache's
multiprocess mode `CartridgeMPConnector` (`vllm.mp_connector`) does the same, building into the
registry the attached `lmcache server`'s adapter follows (it serves the composite on its next
refresh, as the plugin does). Building (a registry read, a small directory write, a registry
write) runs on one background thread, never in the scheduler's step; each recipe is built once
per process. It owns that thread and the set of recipes done; the registry and the composite
directories belong to the host (`store.registry`).

Limits: only the gateway sets COMPOSE_PARAM (the gateway and the middleware refuse it from
clients, `api.requests.check_client_kv_params`), and this side bounds what any request can make
it do anyway: at most `MAX_RECIPES_PER_REQUEST` recipes of at most `MAX_PARTS_PER_RECIPE` parts
per request (more: none is built), at most `MAX_PENDING_BUILDS` queued builds (more: skipped,
a later request retries), and the recipes remembered as done are the `MAX_RECIPES_REMEMBERED`
most recently asked (LRU, each kept as a digest, not its prompt).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger("lmcache_cartridge.composites")

# kv_transfer_params key: a list of `store.composite.recipe` dicts, one per composite in the prompt.
COMPOSE_PARAM = "lmcache_cartridge.composites"

# Limits (see the module docstring). A gateway's request names one recipe per trained run after
# other cartridges or context: a handful (at most its --max-cartridges), each of a few parts.
MAX_RECIPES_PER_REQUEST = 16
MAX_PARTS_PER_RECIPE = 64
MAX_RECIPES_REMEMBERED = 1024   # recipes built (or being built) by this process: LRU
MAX_PENDING_BUILDS = 64         # recipes queued for the build thread
MAX_REQUESTS_REMEMBERED = 4096  # request ids already looked at: oldest dropped


class NoRegistryHere(Exception):
    """Raised by a `HostComposer`'s settings function when there is no registry to build into now
    but there may be later (MP mode: the attached server's record is not found), having said why:
    nothing is built and the recipe is not remembered, so a later request naming it tries again."""


def recipes_of(request: Any) -> list[dict]:
    params = getattr(request, "kv_transfer_params", None) or {}
    wire = params.get(COMPOSE_PARAM) if isinstance(params, dict) else None
    return [w for w in wire if isinstance(w, dict)] if isinstance(wire, list) else []


class HostComposer:
    """Builds the composites requests name, in this host's registry, once each (scheduler side).

    `settings` returns the settings to build with (`registry` path, `cache_dir` for the composite
    directories: the plugin's, or in MP mode the attached server adapter's), asked at each build;
    None (no cartridge plugin configured) turns this off, `NoRegistryHere` skips the build."""

    def __init__(self, settings: Callable[[], Any]) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, None] = OrderedDict()  # recipe digests done or queued (LRU)
        self._asked: dict[str, None] = {}  # request ids already looked at (bounded, oldest dropped)
        self._pending = 0  # builds queued or running
        self._warned_at = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._registry = None
        self.built = 0

    def submit(self, request: Any) -> None:
        wires = recipes_of(request)
        if not wires:
            return
        rid = str(getattr(request, "request_id", ""))
        with self._lock:  # vLLM asks each step while a request waits: look at it once
            if rid in self._asked:
                return
            self._asked[rid] = None
            if len(self._asked) > MAX_REQUESTS_REMEMBERED:
                self._asked.pop(next(iter(self._asked)))
        if len(wires) > MAX_RECIPES_PER_REQUEST or any(
                not isinstance(w.get("parts"), list) or len(w["parts"]) > MAX_PARTS_PER_RECIPE for w in wires):
            logger.error("lmcache_cartridge: request %s names %d composite recipes (at most %d, each of at most %d "
                         "parts): none is built", rid[:80], len(wires), MAX_RECIPES_PER_REQUEST, MAX_PARTS_PER_RECIPE)
            return
        prompt = list(getattr(request, "prompt_token_ids", None) or [])
        todo = []
        with self._lock:
            for w in wires:
                try:
                    start = max(0, int(w.get("start", 0) or 0))
                except (TypeError, ValueError):
                    start = 0  # malformed: ensure_composite says why
                key = hashlib.sha256(json.dumps([w, prompt[:start]], sort_keys=True, default=str).encode()).hexdigest()
                if key in self._seen:
                    self._seen.move_to_end(key)
                    continue
                if self._pending >= MAX_PENDING_BUILDS:
                    self._asked.pop(rid, None)  # looked at again on vLLM's next ask
                    now = time.monotonic()
                    if now - self._warned_at > 10:
                        self._warned_at = now
                        logger.warning("lmcache_cartridge: %d composite builds queued (at most %d): more wait",
                                       self._pending, MAX_PENDING_BUILDS)
                    break
                self._seen[key] = None
                while len(self._seen) > MAX_RECIPES_REMEMBERED:
                    self._seen.popitem(last=False)
                self._pending += 1
                todo.append((key, w))
            if todo and self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="cartridge-compose")
        for key, w in todo:
            self._pool.submit(self._build, key, w, prompt)

    def _build(self, key: str, wire: dict, prompt: list[int]) -> None:
        from lmcache_cartridge.errors import CartridgeError
        from lmcache_cartridge.store.composite import ensure_composite
        from lmcache_cartridge.store.registry import Registry

        try:
            s = self._settings()
            if s is None:
                return
            if self._registry is None or self._registry.path != Path(s.registry):
                if self._registry is not None:  # MP mode: a restarted server follows another registry
                    self._registry.close()
                self._registry = Registry(s.registry)
            entry = ensure_composite(self._registry, wire, prompt, s.cache_dir)
            self.built += 1
            logger.info("lmcache_cartridge: composite %s of %s is registered on this host", entry.id,
                        [p[0] for p in wire.get("parts", [])])
        except NoRegistryHere:
            with self._lock:
                self._seen.pop(key, None)  # the settings function said why; a later request retries
        except CartridgeError as e:
            logger.error("lmcache_cartridge: cannot build composite here: %s", e)
            with self._lock:
                self._seen.pop(key, None)  # a part may arrive later (catalog sync): a later request retries
        except Exception:  # noqa: BLE001 - never in the scheduler's way
            logger.exception("lmcache_cartridge: building a composite failed")
            with self._lock:
                self._seen.pop(key, None)
        finally:
            with self._lock:
                self._pending -= 1

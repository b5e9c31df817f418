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
process) calls `HostComposer.submit` for each waiting request it asks about. Building (a registry
read, a small directory write, a registry write) runs on one background thread, never in the
scheduler's step; each recipe is built once per process. It owns that thread and the set of
recipes done; the registry and the composite directories belong to the host (`store.registry`).
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

logger = logging.getLogger("lmcache_cartridge.composites")

# kv_transfer_params key: a list of `store.composite.recipe` dicts, one per composite in the prompt.
COMPOSE_PARAM = "lmcache_cartridge.composites"


def recipes_of(request: Any) -> list[dict]:
    params = getattr(request, "kv_transfer_params", None) or {}
    wire = params.get(COMPOSE_PARAM) if isinstance(params, dict) else None
    return [w for w in wire if isinstance(w, dict)] if isinstance(wire, list) else []


class HostComposer:
    """Builds the composites requests name, in this host's registry, once each (scheduler side).

    `settings` returns the plugin's settings (registry path, cache dir) when first needed; None
    there (no cartridge plugin configured) turns this off."""

    def __init__(self, settings: Callable[[], Any]) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._asked: dict[str, None] = {}  # request ids already looked at (bounded, oldest dropped)
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
            if len(self._asked) > 4096:
                self._asked.pop(next(iter(self._asked)))
        prompt = list(getattr(request, "prompt_token_ids", None) or [])
        todo = []
        with self._lock:
            for w in wires:
                key = json.dumps([w, prompt[:int(w.get("start", 0) or 0)]], sort_keys=True, default=str)
                if key not in self._seen:
                    self._seen.add(key)
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
            if self._registry is None:
                self._registry = Registry(s.registry)
            entry = ensure_composite(self._registry, wire, prompt, s.cache_dir)
            self.built += 1
            logger.info("lmcache_cartridge: composite %s of %s is registered on this host", entry.id,
                        [p[0] for p in wire.get("parts", [])])
        except CartridgeError as e:
            logger.error("lmcache_cartridge: cannot build composite here: %s", e)
            with self._lock:
                self._seen.discard(key)  # a part may arrive later (catalog sync): a later request retries
        except Exception:  # noqa: BLE001 - never in the scheduler's way
            logger.exception("lmcache_cartridge: building a composite failed")
            with self._lock:
                self._seen.discard(key)

"""The key a router in front of several vLLM instances uses to keep a cartridge on one instance.

Why: with `vllm-router --policy consistent_hash`, requests that carry the same session key land
on the same instance, so a cartridge's KV stays warm in one place instead of being fetched by
every instance. vllm-router 0.1.17 takes the key from the `X-Session-ID` header only (body fields
are ignored on /v1/completions, measured in benchmarks/router_probe.py), and sends every request
without a key to the same instance, so requests without cartridges get a random key of their own.

Runs in the gateway process, once per request; owns nothing.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence

SESSION_HEADER = "X-Session-ID"


def session_key(cartridge_ids: Sequence[str]) -> str:
    """`cart:<ids in request order>` (ids are [A-Za-z0-9._-], header-safe), or a fresh
    `req:<uuid>` that spreads requests without cartridges over the instances."""
    if cartridge_ids:
        return "cart:" + ",".join(cartridge_ids)
    return "req:" + uuid.uuid4().hex


def route_id(registered_id: str | None, token_ids: Sequence[int]) -> str:
    """A cartridge's part of the session key: its registry id, or for a token-only cartridge
    (nothing registered) `tok-<digest of its ids>`, so the instance that computed and cached its
    tokens (vLLM's and LMCache's prefix caches) gets its next request too."""
    if registered_id is not None:
        return registered_id
    return "tok-" + hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:24]

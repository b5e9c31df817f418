"""The key a router in front of several vLLM instances uses to keep a cartridge on one instance.

Why: with `vllm-router --policy consistent_hash`, requests that carry the same session key land
on the same instance, so a cartridge's KV stays warm in one place instead of being fetched by
every instance. vllm-router 0.1.17 takes the key from the `X-Session-ID` header only (body fields
are ignored on /v1/completions, measured in benchmarks/router_probe.py), and sends every request
without a key to the same instance, so requests without cartridges get a random key of their own.

Runs in the gateway process, once per request; owns nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

SESSION_HEADER = "X-Session-ID"


def session_key(cartridge_ids: Sequence[str]) -> str:
    """`cart:<ids in request order>` (ids are [A-Za-z0-9._-], header-safe), or a fresh
    `req:<uuid>` that spreads requests without cartridges over the instances."""
    if cartridge_ids:
        return "cart:" + ",".join(cartridge_ids)
    return "req:" + uuid.uuid4().hex

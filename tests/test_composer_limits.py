"""What requests can make an instance's scheduler register as composites is bounded
(`vllm.composites.HostComposer`). The gateway and the middleware refuse COMPOSE_PARAM from
clients; whatever reaches the connector anyway builds at most MAX_RECIPES_PER_REQUEST recipes of
at most MAX_PARTS_PER_RECIPE parts per request, queues at most MAX_PENDING_BUILDS builds, and
remembers the MAX_RECIPES_REMEMBERED most recent recipes as digests (not their prompts). No
engine: the composer's building is stood in for by a settings function it calls first."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from lmcache_cartridge.vllm import composites
from lmcache_cartridge.vllm.composites import COMPOSE_PARAM, HostComposer


def recipe(i: int, parts: int = 2) -> dict:
    return {"parts": [[f"c{i}-{p}", f"{p:064x}"] for p in range(parts)], "start": 4}


def request(rid: str, *recipes: dict, prompt_len: int = 8) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(prompt_len)),
                           kv_transfer_params={COMPOSE_PARAM: list(recipes)})


def settled(composer: HostComposer, timeout: float = 60) -> None:  # a poll
    deadline = time.time() + timeout
    while composer._pending and time.time() < deadline:
        time.sleep(0.01)
    assert composer._pending == 0


def test_a_request_naming_too_many_recipes_or_parts_builds_none():
    calls = []
    composer = HostComposer(lambda: calls.append(1))  # None: nothing built, but each build asks once
    many = [recipe(i) for i in range(composites.MAX_RECIPES_PER_REQUEST + 1)]
    composer.submit(request("r1", *many))
    composer.submit(request("r2", recipe(0, parts=composites.MAX_PARTS_PER_RECIPE + 1)))
    composer.submit(request("r3", {"parts": "not a list", "start": 0}))
    assert composer._pool is None and not composer._seen and not calls
    composer.submit(request("r4", *many[:composites.MAX_RECIPES_PER_REQUEST]))  # at the limit: built
    settled(composer)
    assert len(calls) == composites.MAX_RECIPES_PER_REQUEST


def test_the_recipes_a_process_remembers_are_bounded_most_recent_kept(monkeypatch):
    monkeypatch.setattr(composites, "MAX_RECIPES_REMEMBERED", 16)
    monkeypatch.setattr(composites, "MAX_REQUESTS_REMEMBERED", 32)
    calls = []
    composer = HostComposer(lambda: calls.append(1))
    for i in range(100):
        composer.submit(request(f"r{i}", recipe(i), prompt_len=100_000))
        if i == 90:
            settled(composer)
            composer.submit(request("again-0", recipe(76), prompt_len=100_000))  # used again: most recent
    settled(composer)
    assert len(calls) == 100  # each distinct recipe built once
    assert len(composer._seen) == 16 and len(composer._asked) <= 32
    assert all(len(k) == 64 for k in composer._seen)  # digests: a long prompt is not kept
    composer.submit(request("again-1", recipe(76), prompt_len=100_000))
    composer.submit(request("again-2", recipe(99), prompt_len=100_000))
    settled(composer)
    assert len(calls) == 100  # still remembered: not built again
    composer.submit(request("again-3", recipe(0), prompt_len=100_000))  # forgotten long ago: built again
    settled(composer)
    assert len(calls) == 101


def test_queued_builds_are_bounded_and_a_request_over_it_is_looked_at_again(monkeypatch):
    monkeypatch.setattr(composites, "MAX_PENDING_BUILDS", 4)
    gate, calls = threading.Event(), []

    def slow():
        gate.wait(10)
        calls.append(1)

    composer = HostComposer(slow)
    for i in range(10):
        composer.submit(request(f"r{i}", recipe(i)))
    assert composer._pending == 4 and len(composer._seen) == 4
    assert "r9" not in composer._asked  # vLLM's next ask about it gets another try
    gate.set()
    settled(composer)
    composer.submit(request("r9", recipe(9)))
    settled(composer)
    assert len(calls) == 5


@pytest.mark.parametrize("name", ["MAX_RECIPES_PER_REQUEST", "MAX_PARTS_PER_RECIPE", "MAX_RECIPES_REMEMBERED",
                                  "MAX_PENDING_BUILDS", "MAX_REQUESTS_REMEMBERED"])
def test_limits_are_positive_constants(name):
    assert isinstance(getattr(composites, name), int) and getattr(composites, name) > 0

"""What the running plugins serve, as they publish it: read by the gateway before it forwards.

Why: the gateway registers a cartridge and the plugins inside vLLM pick it up on their next
registry poll (`refresh_seconds`). A request forwarded before that misses in LMCache, so vLLM
recomputes the cartridge's tokens: harmless for a first-k cartridge, a wrong answer for a trained
one (its placeholder ids mean nothing to the model). So the gateway waits until every live plugin
instance of its model serves the exact bytes (content hash and epoch) it resolved, and answers
503 otherwise. Lookups hit only on chunks readable without the network (a remote chunk not yet
downloaded is a miss), so for a trained cartridge "serves" also means "resident": every chunk in
a local tier. Nobody has to ask for the download: the plugins start it as soon as a trained
cartridge is registered and keep it resident; the gateway only waits (bounded) and answers 503
Retry-After.

Which instances count: those publishing for the same registry, alive (see
`store.serving_state`), and, when the caller names its model, serving that model. Several
servers of different models may share one registry: an instance of another model refuses the
cartridge ("made for model ...") and never serves it, and must not turn a request for this
model into a 400 or a 503.

Where it runs: the gateway process (in a worker thread), the test harness and the benchmarks
(`testing.launch`). Data: the serving-state records of `store.serving_state`; this module only
reads them.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lmcache_cartridge.store.serving_state import ServingState, process_alive, read_states, same_path


@dataclass(frozen=True)
class Wanted:
    """A cartridge as the gateway resolved it."""

    id: str
    content_hash: str
    epoch: int
    kind: str = "first_k"  # "trained" cartridges must be resident before a request may go on


class NotServed(Exception):
    """A cartridge the engine does not (yet) serve: `status` is the HTTP answer to give."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after  # seconds, sent as HTTP Retry-After with a 503


def _matching(states, registry, models, select) -> list[ServingState]:
    return [s for s in states
            if (registry is None or same_path(s.registry, registry))
            and (models is None or s.serves_model(models)) and (select is None or select(s))]


def _silent(s: ServingState, host: str) -> bool:
    """Stale although its process runs on this host: an instance whose watcher is busy (opening a
    cartridge's origin, a slow disk), not one that is gone. Its last word still holds: forwarding
    as if no plugin ran would let vLLM recompute a trained cartridge's placeholders. (Another
    host's stale record cannot be told from a dead host's: not counted.)"""
    return s.host == host and not s.alive() and process_alive(s.pid, s.pid_start)


def live_instances(cache_dir: Path, registry: Path | None = None, models=None,
                   select: Callable[[ServingState], bool] | None = None) -> list[ServingState]:
    """Records of the live plugin instances under `cache_dir` that serve `registry` (any, if None),
    one of `models` (any, if None) and pass `select`."""
    return _matching(read_states(cache_dir), registry, models, select)


def counted_instances(cache_dir: Path, registry: Path | None = None, models=None,
                      select: Callable[[ServingState], bool] | None = None) -> list[ServingState]:
    """What the gateway judges by: the live instances (as `live_instances`) and the silent ones
    (`_silent`), from one read of the records."""
    host = socket.gethostname()
    return _matching([s for s in read_states(cache_dir, include_dead=True) if s.alive() or _silent(s, host)],
                     registry, models, select)


def _missing(states: list[ServingState], wanted: list[Wanted]) -> list[tuple[Wanted, int, str | None, bool]]:
    """(cartridge, instances not ready for it, a reason one of them gave, whether every such
    instance serves it and only residency is lacking) for each one lacking.

    Ready: the instance serves the exact bytes; for a trained cartridge also has every chunk
    resident (readable without the network), since a lookup miss would recompute placeholders.
    """
    out = []
    for w in wanted:
        lacking, why, only_residency = 0, None, True
        for s in states:
            got = s.cartridges.get(w.id)
            if got is None or (got.content_hash, got.epoch) != (w.content_hash, w.epoch):
                lacking += 1
                only_residency = False
                why = why or s.skipped.get(w.id)
            elif w.kind == "trained" and not got.all_resident:
                lacking += 1
        if lacking:
            out.append((w, lacking, why, only_residency))
    return out


def wait_served(cache_dir: Path, registry: Path | None, wanted: list[Wanted], timeout: float, *,
                models=None, select: Callable[[ServingState], bool] | None = None) -> list[ServingState]:
    """Return once every live plugin instance (of `registry`, serving one of `models`, passing
    `select`: see `live_instances`) serves every wanted cartridge: the records of those instances
    (what the caller may go on to read, e.g. whether they run in an `lmcache server`). Returns []
    when no instance publishes anything (no plugin: nothing to wait for). An instance of this
    host whose record went stale while its process runs is busy, not gone: its last record
    counts (`counted_instances`). Raises `NotServed` when an instance refused a cartridge (400,
    its reason), or on timeout (503), also when instances of other models publish but none of
    `models` does.
    `models` is matched against each instance's names (`ServingState.models`)."""
    deadline = time.monotonic() + timeout
    while True:
        states = counted_instances(cache_dir, registry, models, select)
        if not states:
            others = live_instances(cache_dir, registry, None, select) if models is not None else []
            if not others:
                return []
            # Engines of other models serve this registry, none of ours does (yet): forwarding
            # now could recompute a trained cartridge's placeholders.
            if time.monotonic() >= deadline:
                raise NotServed(503, f"no live engine instance of model {next(iter(models))!r} publishes its "
                                     f"serving state (instances on this registry serve "
                                     f"{sorted({s.model for s in others})}; waited {timeout:.0f}s); retry shortly",
                                retry_after=max(1.0, 3 * others[0].refresh_seconds))
            time.sleep(0.05)
            continue
        missing = _missing(states, wanted)
        if not missing:
            return states
        for w, _, why, _ in missing:
            if why:
                raise NotServed(400, f"cartridge {w.id!r} cannot be served by this engine: {why}")
        if time.monotonic() >= deadline:
            w, lacking, _, only_residency = missing[0]
            what = ("do not have its chunks local yet (downloading)" if only_residency
                    else "do not serve it yet")
            raise NotServed(503, f"cartridge {w.id!r} is registered but {lacking} of {len(states)} engine "
                                 f"instance(s) {what} (waited {timeout:.0f}s); retry shortly",
                            retry_after=max(1.0, 3 * states[0].refresh_seconds))
        time.sleep(0.05)

"""What the running plugins serve, as they publish it: read by the gateway before it forwards.

Why: the gateway registers a cartridge and the plugins inside vLLM pick it up on their next
registry poll (`refresh_seconds`). A request forwarded before that misses in LMCache, so vLLM
recomputes the cartridge's tokens: harmless for a first-k cartridge, a wrong answer for a trained
one (its placeholder ids mean nothing to the model). So the gateway waits until every live plugin
instance serves the exact bytes (content hash and epoch) it resolved, and answers 503 otherwise.
Lookups hit only on chunks readable without the network (a remote chunk not yet downloaded is a
miss), so for a trained cartridge "serves" also means "resident": every chunk in a local tier.
Nobody has to ask for the download: the plugins start it as soon as a trained cartridge is
registered and keep it resident; the gateway only waits (bounded) and answers 503 Retry-After.

Where it runs: the gateway process (in a worker thread). Data: the JSON snapshots each plugin
instance writes under `<cache_dir>/stats/` (see `CartridgeStoragePlugin.dump_stats`); this
module only reads them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path


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


def live_instances(stats_dir: Path, registry: Path, now: float | None = None) -> list[dict]:
    """Snapshots of plugin instances that use `registry` and wrote recently (a stopped server's
    file goes stale after a few of its refresh periods)."""
    now = time.time() if now is None else now
    want = str(Path(registry).resolve())
    out = []
    for f in Path(stats_dir).glob("*.json"):
        try:
            snap = json.loads(f.read_text())
        except (OSError, ValueError):
            continue  # being replaced, or not ours
        if not isinstance(snap, dict) or "served" not in snap:
            continue
        try:
            same = str(Path(snap.get("registry", "")).resolve()) == want
        except (OSError, ValueError):
            same = False
        stale_after = 3 * float(snap.get("refresh_seconds") or 1.0) + 2.0
        if same and now - float(snap.get("time") or 0) <= stale_after:
            out.append(snap)
    return out


def _missing(snaps: list[dict], wanted: list[Wanted]) -> list[tuple[Wanted, int, str | None, bool]]:
    """(cartridge, instances not ready for it, a reason one of them gave, whether every such
    instance serves it and only residency is lacking) for each one lacking.

    Ready: the instance serves the exact bytes; for a trained cartridge also has every chunk
    resident (readable without the network), since a lookup miss would recompute placeholders.
    A snapshot without a "resident" list (an older plugin) never counts a trained one resident.
    """
    out = []
    for w in wanted:
        lacking, why, only_residency = 0, None, True
        for snap in snaps:
            got = snap["served"].get(w.id)
            if got is None or list(got) != [w.content_hash, w.epoch]:
                lacking += 1
                only_residency = False
                why = why or (snap.get("skipped") or {}).get(w.id)
            elif w.kind == "trained" and w.id not in (snap.get("resident") or ()):
                lacking += 1
        if lacking:
            out.append((w, lacking, why, only_residency))
    return out


def wait_served(stats_dir: Path, registry: Path, wanted: list[Wanted], timeout: float) -> bool:
    """Return once every live plugin instance serves every wanted cartridge. Returns False when no
    live instance publishes anything (no plugin on this registry: nothing to wait for). Raises
    `NotServed` when an instance refused a cartridge (400, its reason) or on timeout (503)."""
    deadline = time.monotonic() + timeout
    while True:
        snaps = live_instances(stats_dir, registry)
        if not snaps:
            return False
        missing = _missing(snaps, wanted)
        if not missing:
            return True
        for w, _, why, _ in missing:
            if why:
                raise NotServed(400, f"cartridge {w.id!r} cannot be served by this engine: {why}")
        if time.monotonic() >= deadline:
            w, lacking, _, only_residency = missing[0]
            what = ("do not have its chunks local yet (downloading)" if only_residency
                    else "do not serve it yet")
            raise NotServed(503, f"cartridge {w.id!r} is registered but {lacking} of {len(snaps)} engine "
                                 f"instance(s) {what} (waited {timeout:.0f}s); retry shortly",
                            retry_after=max(1.0, 3 * float(snaps[0].get("refresh_seconds") or 1.0)))
        time.sleep(0.05)

"""The one reader that sums the per-tier counters of the plugin instances that are running.

Each plugin instance publishes its `Metrics` snapshot in its serving-state record (see
`store.serving_state`); `lmcache-cartridge stats` and the soak benchmark add up the records of
live instances here, so both count the same way and neither counts a server that has stopped
(its record stays on disk until the next instance prunes it, but its process is gone). Runs in
whatever process reads (the CLI, a benchmark); this module only reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from lmcache_cartridge.store.metrics import TierStats
from lmcache_cartridge.store.serving_state import ServingState, read_states, state_dir

# The summable counters of a tier: TierStats' integer fields (its latency histogram is not summed).
COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(TierStats) if f.name != "latency_buckets")


@dataclass
class TierTotals:
    """Counters summed over the live instances publishing under one cache dir."""

    stats_dir: Path                                     # where the records are (for messages)
    instances: list[str] = field(default_factory=list)  # ids of the instances summed
    states: list[ServingState] = field(default_factory=list)
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)

    def minus(self, before: "TierTotals") -> dict[str, dict[str, int]]:
        """Per-tier growth since `before` (a tier absent before counts from zero)."""
        return {tier: {k: v - before.tiers.get(tier, {}).get(k, 0) for k, v in t.items()}
                for tier, t in self.tiers.items()}

    def to_json(self) -> dict:
        return {"sources": list(self.instances), "tiers": self.tiers}


def sum_tier_stats(cache_dir: str | Path) -> TierTotals:
    """Sum the tier counters of every live instance publishing under `cache_dir`."""
    totals = TierTotals(state_dir(cache_dir))
    for s in read_states(cache_dir):
        totals.instances.append(s.instance)
        totals.states.append(s)
        for tier, counts in s.tiers.items():
            if not isinstance(counts, dict):
                continue
            t = totals.tiers.setdefault(tier, dict.fromkeys(COUNTERS, 0))
            for k in COUNTERS:
                t[k] += int(counts.get(k, 0))
    return totals

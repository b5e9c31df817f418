"""The one reader that sums the per-tier counters plugin instances publish.

Each plugin instance writes a JSON snapshot of its `Metrics` under `<cache_dir>/stats/` (see
`metrics.Metrics.dump`); `lmcache-cartridge stats` and the soak benchmark read them all and add
them up here, so both count the same way. Runs in whatever process reads (the CLI, a benchmark);
the files belong to the plugin instances that write them, this module only reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from lmcache_cartridge.store.metrics import TierStats

# The summable counters of a tier: TierStats' integer fields (its latency histogram is not summed).
COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(TierStats) if f.name != "latency_buckets")


@dataclass
class TierTotals:
    """Counters summed over every readable snapshot in one stats directory."""

    stats_dir: Path
    instances: list[str] = field(default_factory=list)  # snapshot file names that were summed
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)

    def minus(self, before: "TierTotals") -> dict[str, dict[str, int]]:
        """Per-tier growth since `before` (a tier absent before counts from zero)."""
        return {tier: {k: v - before.tiers.get(tier, {}).get(k, 0) for k, v in t.items()}
                for tier, t in self.tiers.items()}

    def to_json(self) -> dict:
        return {"sources": list(self.instances), "tiers": self.tiers}


def sum_tier_stats(stats_dir: str | Path) -> TierTotals:
    """Sum every instance's tier counters under `stats_dir`. A file that is not a snapshot (or
    cannot be read) is skipped: snapshots are replaced atomically, but the folder is shared."""
    totals = TierTotals(Path(stats_dir))
    files = sorted(totals.stats_dir.glob("*.json")) if totals.stats_dir.is_dir() else []
    for f in files:
        try:
            snap = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        tiers = snap.get("tiers") if isinstance(snap, dict) else None
        if not isinstance(tiers, dict):
            continue
        totals.instances.append(f.name)
        for tier, s in tiers.items():
            t = totals.tiers.setdefault(tier, dict.fromkeys(COUNTERS, 0))
            for k in COUNTERS:
                t[k] += int(s.get(k, 0))
    return totals

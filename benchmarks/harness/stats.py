"""The benchmarks' one percentile and the latency summary every arm reports. Pure functions; run
in the benchmark's process."""

from __future__ import annotations

from typing import Iterable

import numpy as np


def percentile(values: Iterable[float], q: float) -> float | None:
    """The `q`-th percentile (`q` in percent, 0..100) of `values`, or None when there are none.

    Convention: linear interpolation between the two closest ranks (Hyndman and Fan's type 7,
    numpy's default `method="linear"`, a spreadsheet's PERCENTILE.INC): with the n values sorted
    as x[0..n-1], the rank is h = (n - 1) * q / 100 and the answer x[floor h] + (h - floor h) *
    (x[floor h + 1] - x[floor h]). So the 50th of [1, 2, 3, 4] is 2.5, the 95th of 1..100 is
    95.05, and the 0th and 100th are the min and the max.
    """
    xs = np.asarray(list(values), dtype=float)
    if xs.size == 0:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside 0..100 (it is in percent: 95, not 0.95)")
    return float(np.percentile(xs, q, method="linear"))


def summary(values: Iterable[float]) -> dict[str, float | int | None]:
    """count, p50, p95, p99, min, max and mean of `values` (None for each figure when empty)."""
    xs = [float(v) for v in values]
    return {"count": len(xs), "p50": percentile(xs, 50), "p95": percentile(xs, 95), "p99": percentile(xs, 99),
            "min": min(xs) if xs else None, "max": max(xs) if xs else None,
            "mean": float(np.mean(xs)) if xs else None}

"""The one result schema of benchmarks/ and its one writer: JSON (the record), markdown (what the
docs cite) and, when asked and matplotlib is installed, a plot. Runs in the benchmark's process.

A `Result` holds the command line (`argv`), the machine (`machine_info()`, with the git
revision), the run's `parameters`, its `arms` (one per thing compared, each with a count, errors
and p50/p95/p99 where it measured latencies, plus its other `figures`) and the script's own
`details` (tables and rows its markdown is built from). Logs and profiler dumps are not results.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from harness.stats import summary

SCHEMA = 1


def _plain(obj: Any) -> Any:
    """`obj` as JSON gives it back (tuples as lists, paths and other objects as strings)."""
    return json.loads(json.dumps(obj, default=str))


@dataclass
class Arm:
    """One arm: `count` measurements, `errors` failed ones, latency percentiles in `unit` (None
    where the arm measured no latency) and any other `figures` it reports."""

    name: str
    count: int
    errors: int = 0
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    unit: str = "s"
    figures: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_samples(cls, name: str, samples: Iterable[float], *, unit: str = "s", errors: int = 0,
                     **figures: Any) -> "Arm":
        """An arm from its raw latencies, through the one percentile."""
        s = summary(samples)
        return cls(name=name, count=int(s["count"]), errors=errors, p50=s["p50"], p95=s["p95"], p99=s["p99"],
                   unit=unit, figures=_plain(figures))


@dataclass
class Result:
    """One run of one benchmark; `write_result` writes it, `read_result` reads it back equal."""

    benchmark: str
    machine: dict[str, Any]
    parameters: dict[str, Any] = field(default_factory=dict)
    arms: list[Arm] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    schema: int = SCHEMA

    def __post_init__(self) -> None:
        self.machine, self.parameters, self.details = (_plain(self.machine), _plain(self.parameters),
                                                       _plain(self.details))
        self.argv = [str(a) for a in self.argv]

    def to_dict(self) -> dict[str, Any]:
        return _plain(asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Result":
        if d.get("schema") != SCHEMA or "benchmark" not in d:
            raise ValueError(f"not a benchmark result of schema {SCHEMA} (keys {sorted(d)[:8]}): "
                             "an older result file; read it with load_payload")
        return cls(**{**d, "arms": [Arm(**a) for a in d.get("arms", [])]})


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def markdown(result: Result, body: str = "") -> str:
    """The script's own `body` (or a title when it has none), then the part every result's
    markdown ends with: command, machine with git revision, parameters, and the arms' counts and
    percentiles."""
    m = result.machine
    lines = [body.rstrip("\n") if body else f"# {result.benchmark}", "", "## Run", "",
             f"`{' '.join(result.argv)}`", "",
             f"Machine: {m.get('cpu', m.get('platform', '?'))}, {m.get('nproc', '?')} CPUs, "
             f"{m.get('mem_total_gib', '?')} GiB; git {m.get('git', 'unknown')}.", ""]
    if result.parameters:
        lines += ["Parameters: " + ", ".join(f"{k}={_fmt(v)}" for k, v in result.parameters.items()), ""]
    timed = [a for a in result.arms if a.p50 is not None]
    if timed:
        lines += ["| arm | count | errors | p50 | p95 | p99 | unit |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {a.name} | {a.count} | {a.errors} | {_fmt(a.p50)} | {_fmt(a.p95)} | {_fmt(a.p99)} | {a.unit} |"
                  for a in timed]
        lines.append("")
    return "\n".join(lines)


def plot_arms(result: Result, path: Path) -> None:
    """p50/p95/p99 per arm as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in result.arms if a.p50 is not None]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(arms) + 2), 3.5))
    for q, w in (("p50", -0.27), ("p95", 0.0), ("p99", 0.27)):
        ax.bar([j + w for j in range(len(arms))], [getattr(a, q) for a in arms], width=0.27, label=q)
    ax.set_xticks(range(len(arms)), [a.name for a in arms], rotation=20, ha="right")
    ax.set_ylabel(arms[0].unit if arms else "")
    ax.set_title(result.benchmark)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _matplotlib_present() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_result(result: Result, out_dir: Path | str, stem: str | None = None, *, body: str = "",
                 plot: bool | Callable[[Result, Path], None] = False, markdown_file: bool = True) -> list[Path]:
    """`<stem>.json` (the whole record), `<stem>.md` (header plus `body`) and, with `plot` (True:
    `plot_arms`; or a function of (result, path)) and matplotlib installed, `<stem>.png`.
    Returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = stem or result.benchmark
    written = [out / f"{stem}.json"]
    written[0].write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    if markdown_file:
        written.append(out / f"{stem}.md")
        written[-1].write_text(markdown(result, body))
    if plot and _matplotlib_present():
        written.append(out / f"{stem}.png")
        (plot_arms if plot is True else plot)(result, written[-1])
    return written


def read_result(path: Path | str) -> Result:
    """A result `write_result` wrote (ValueError on an older file: see `load_payload`)."""
    return Result.from_dict(json.loads(Path(path).read_text()))


def load_payload(path: Path | str) -> dict[str, Any]:
    """The script's own record from a result file of either shape: a result's `details` (with its
    `machine`), or an older file as it was written."""
    d = json.loads(Path(path).read_text())
    if isinstance(d, dict) and d.get("schema") == SCHEMA and "benchmark" in d:
        return {"machine": d["machine"], **d["details"]}
    return d

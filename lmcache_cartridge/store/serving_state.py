"""The serving-state record: what one plugin instance serves, published for other processes.

Every plugin instance (each TP rank of a vLLM server, the scheduler-side instance when LMCache
runs one, each server on a host) owns one versioned JSON record under
`<cache_dir>/serving/<instance>.json`: who it is (instance id, host, pid, start time, model
names, rank / world size, registry; an `lmcache server`'s also the endpoint vLLM attaches to),
what it serves (each cartridge's content hash, epoch, kind and residency: "all" or the list of
chunks readable without the network), what it refused and why, and its per-tier counters. A field
added within a version is optional (`endpoint`): older records read as without it, and older
readers ignore it. Readers are the gateway (`lmcache.serving.wait_served`: forward a
request only once every instance of its model serves the cartridge), `lmcache-cartridge
stats` / `doctor` (`store.tier_totals`, the CLI), the test harness and the benchmarks
(`testing.launch.VllmServer.wait_served`): none of them reads log lines.

One writer (`publish`, called by the plugin from whatever thread changed its state; atomic: a
private temp file, then `os.replace`, so a reader sees the old or the new record, never half of
one) and one reader (`read_states`). A record counts only while its process lives: on the same
host the pid must exist, not be a zombie and have the start time recorded (a reused pid is
another process); on any host the record must have been rewritten within a few refresh periods
(the plugin rewrites it every period), which also retires a closed instance of a process that
lives on and covers records from other hosts, whose pids mean nothing here. A dead process's
record is deleted by the next instance that starts publishing in the same directory.

Lives in `store` (not `lmcache`) because `store.tier_totals` and the CLI read it; it imports
nothing from LMCache.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Union

from lmcache_cartridge.paths import atomic_write

VERSION = 1
STATE_DIR = "serving"
ALL = "all"  # residency of a cartridge whose every servable chunk is local
TMP_MAX_AGE_S = 60.0  # a temp file older than this was left by a writer that died mid-write

Residency = Union[str, tuple[int, ...]]  # ALL, or the indices of the local chunks


def state_dir(cache_dir: str | Path) -> Path:
    """Where the records of the instances using `cache_dir` live (one place names it)."""
    return Path(cache_dir) / STATE_DIR


@dataclass(frozen=True)
class CartridgeState:
    """One cartridge as an instance serves it."""

    content_hash: str
    epoch: int
    kind: str          # first_k / trained
    chunks: int        # servable chunks (what LMCache can look up)
    resident: Residency = ()  # ALL, or indices of chunks readable here without the network
    in_memory: tuple[int, ...] = ()  # indices of chunks in the plugin's CPU tier (vs the disk)

    @property
    def all_resident(self) -> bool:
        return self.resident == ALL or len(self.resident) >= self.chunks


@dataclass(frozen=True)
class ServingState:
    """One plugin instance's published state (`version` VERSION)."""

    instance: str             # unique per plugin instance: "<plugin>-rank<r>-pid<pid>-<random>"
    host: str
    pid: int
    pid_start: int | None     # the process's start time in clock ticks since boot (/proc), None if unknown
    started: float            # time.time() when the instance started publishing
    updated: float            # time.time() of this write
    refresh_seconds: float    # the instance rewrites its record at least this often
    role: str                 # "worker" (retrieves) or "scheduler" (lookups only)
    model: str                # the engine's model name (vLLM --model)
    models: tuple[str, ...]   # every name whose cartridges it serves (served name, accept_models)
    rank: int
    world_size: int
    registry: str             # resolved path of the registry it serves
    healthy: bool = True
    problem: str | None = None
    cartridges: dict[str, CartridgeState] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)   # id -> why it is not served
    tiers: dict[str, dict[str, Any]] = field(default_factory=dict)  # store.metrics snapshot
    metrics_instance: str = ""  # the `instance` label of its prometheus counters
    endpoint: str = ""        # an `lmcache server`'s request endpoint as it binds it ("tcp://host:port"); "" in-process
    stages: dict[str, dict[str, float]] = field(default_factory=dict)  # store.metrics snapshot: time per stage
    version: int = VERSION

    # --- liveness -------------------------------------------------------------------------------
    @property
    def stale_after(self) -> float:
        return 3 * max(self.refresh_seconds, 0.0) + 2.0

    def alive(self, now: float | None = None) -> bool:
        """Whether the instance still runs: fresh, and on this host its process exists."""
        now = time.time() if now is None else now
        if now - self.updated > self.stale_after:
            return False
        return self.host != socket.gethostname() or process_alive(self.pid, self.pid_start)

    def serves_model(self, names) -> bool:
        """Whether this instance serves any of `names` (the gateway's model and its aliases)."""
        return any(n in self.models for n in names if n)

    # --- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        d["models"] = list(self.models)
        for c in d["cartridges"].values():
            if c["resident"] != ALL:
                c["resident"] = list(c["resident"])
            c["in_memory"] = list(c["in_memory"])
        return d

    @classmethod
    def from_json(cls, d: Any) -> "ServingState":
        """Parse a record; ValueError if it is not one of this version."""
        if not isinstance(d, dict) or d.get("version") != VERSION:
            raise ValueError(f"not a version {VERSION} serving-state record")
        try:
            carts = {}
            for cid, c in dict(d.get("cartridges") or {}).items():
                res = c.get("resident", ())
                carts[str(cid)] = CartridgeState(str(c["content_hash"]), int(c["epoch"]), str(c["kind"]),
                                                 int(c["chunks"]), ALL if res == ALL else tuple(int(i) for i in res),
                                                 tuple(int(i) for i in c.get("in_memory", ())))
            return cls(
                instance=str(d["instance"]), host=str(d["host"]), pid=int(d["pid"]),
                pid_start=None if d.get("pid_start") is None else int(d["pid_start"]),
                started=float(d["started"]), updated=float(d["updated"]),
                refresh_seconds=float(d["refresh_seconds"]), role=str(d["role"]), model=str(d["model"]),
                models=tuple(str(m) for m in d["models"]), rank=int(d["rank"]), world_size=int(d["world_size"]),
                registry=str(d["registry"]), healthy=bool(d.get("healthy", True)), problem=d.get("problem"),
                cartridges=carts, skipped={str(k): str(v) for k, v in dict(d.get("skipped") or {}).items()},
                tiers=dict(d.get("tiers") or {}), metrics_instance=str(d.get("metrics_instance") or ""),
                endpoint=str(d.get("endpoint") or ""),
                stages={str(k): {str(f): float(x) for f, x in dict(v).items()}
                        for k, v in dict(d.get("stages") or {}).items()},
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed serving-state record: {type(e).__name__}: {e}") from None


# --- processes ------------------------------------------------------------------------------------
def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of `pid` from /proc, None when unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])  # fields after the name: state is 3rd of stat, starttime 22nd
    except (OSError, IndexError, ValueError):
        return None


def process_start(pid: int) -> int | None:
    """The start time of `pid` (clock ticks since boot), to tell a reused pid apart."""
    st = _proc_stat(pid)
    return None if st is None else st[1]


def process_alive(pid: int, start: int | None = None) -> bool:
    """Whether process `pid` of this host runs (not a zombie) and, if `start` is given, is the
    process that started then (not a later one that reused the pid)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    st = _proc_stat(pid)
    if st is None:
        return True  # no /proc: existence is all we can tell
    state, started = st
    return state not in ("Z", "X") and (start is None or started == start)


def descendants(pid: int) -> set[int]:
    """The processes below `pid` on this host (children, their children, ...), from /proc;
    empty where there is no /proc."""
    parents: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for name in entries:
        if not name.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(name))
    out, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


# --- the one writer ---------------------------------------------------------------------------------
def publish(cache_dir: str | Path, state: ServingState) -> Path:
    """Write `state` as `<state_dir>/<instance>.json`, atomically. Concurrent calls (the plugin's
    watcher thread and a download callback) each use their own temp file."""
    # 0644: a gateway or CLI of another user reads it; not synced to disk: rewritten every
    # period, and worth nothing once its process is gone
    return atomic_write(state_dir(cache_dir) / f"{state.instance}.json", json.dumps(state.to_json()), mode=0o644,
                        durable=False)


def unpublish(cache_dir: str | Path, instance: str) -> None:
    with contextlib.suppress(OSError):
        (state_dir(cache_dir) / f"{instance}.json").unlink()


def prune(cache_dir: str | Path, now: float | None = None) -> int:
    """Delete the records of this host's dead processes and temp files writers left behind; a
    record that is only stale (its process lives, or it is another host's) stays. Returns how
    many files went. Called by a starting instance: records do not pile up across restarts."""
    directory = state_dir(cache_dir)
    if not directory.is_dir():
        return 0
    now = time.time() if now is None else now
    host, gone = socket.gethostname(), 0
    for f in directory.iterdir():
        try:
            if f.name.endswith(".tmp"):
                if now - f.stat().st_mtime > TMP_MAX_AGE_S:
                    f.unlink()
                    gone += 1
                continue
            if f.suffix != ".json":
                continue
            s = ServingState.from_json(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue  # unreadable, being replaced, not ours, or another version's: leave it
        if s.host == host and not process_alive(s.pid, s.pid_start):
            with contextlib.suppress(OSError):
                f.unlink()
                gone += 1
    return gone


# --- the one reader -----------------------------------------------------------------------------------
def read_states(cache_dir: str | Path, *, now: float | None = None, include_dead: bool = False) -> list[ServingState]:
    """Records of the instances using `cache_dir`, live ones only unless `include_dead`, sorted by
    instance id. Files that are not records of this version are skipped (the folder is shared)."""
    directory = state_dir(cache_dir)
    if not directory.is_dir():
        return []
    now = time.time() if now is None else now
    out = []
    for f in sorted(directory.glob("*.json")):
        try:
            s = ServingState.from_json(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
        if include_dead or s.alive(now):
            out.append(s)
    return sorted(out, key=lambda s: s.instance)


def same_path(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, ValueError):
        return False

"""A record of every server the tests, the demo and the benchmarks start (vLLM, `lmcache
server`, vllm-router): which kind, for which model and test, and how many seconds until it
answered. `make test` sets `LMCACHE_CARTRIDGE_TEST_REPORT`; the suite's conftest prints the
summary and writes it beside the junit XML (`summary`). Without the variable nothing is written.

Runs in whichever process starts the server (pytest's, or a demo or benchmark it runs as a
child process: the variable is inherited and every process appends a line of its own).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

from lmcache_cartridge.settings_reference import TEST_REPORT

ENV = TEST_REPORT.name
FILE = "starts.jsonl"


def _path() -> Path | None:
    d = os.environ.get(ENV)
    return Path(d) / FILE if d else None


def record(kind: str, model: str, seconds: float | None, *, ok: bool = True, mode: str = "") -> None:
    """Append one start: `kind` ("vllm", "lmcache-server", "vllm-router"), `model` (a path: its
    last part is kept), seconds from launch to ready (None: it never got there), `mode` (how it
    was started, e.g. "compiled" or "eager"). One `write` of one line on an O_APPEND file: lines
    from concurrent processes do not interleave."""
    path = _path()
    if path is None:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    line = json.dumps({"kind": kind, "model": Path(model).name if model else "", "mode": mode,
                       "seconds": None if seconds is None else round(seconds, 1), "ok": ok,
                       "test": test, "pid": os.getpid(), "at": round(time.time(), 1)}) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]


def summary(records: list[dict]) -> str:
    """A markdown table: starts and their seconds by kind, model and mode, then by test module."""
    if not records:
        return "no server starts recorded\n"
    by_kind: dict[tuple, list[float]] = defaultdict(list)
    by_module: dict[str, list[float]] = defaultdict(list)
    failed = [r for r in records if not r["ok"]]
    for r in records:
        s = r["seconds"] or 0.0
        by_kind[(r["kind"], r["model"], r["mode"])].append(s)
        by_module[r["test"].split("::")[0] or "(outside a test)"].append(s)
    total = sum(r["seconds"] or 0.0 for r in records)
    out = [f"{len(records)} server starts, {total:.0f} s from launch to ready in all"
           f"{f', {len(failed)} failed' if failed else ''}", "",
           "| kind | model | mode | starts | seconds (sum) | seconds (each, min-max) |", "|---|---|---|---|---|---|"]
    for (kind, model, mode), secs in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        out.append(f"| {kind} | {model} | {mode} | {len(secs)} | {sum(secs):.0f} | {min(secs):.0f}-{max(secs):.0f} |")
    out += ["", "| test module | starts | seconds (sum) |", "|---|---|---|"]
    for mod, secs in sorted(by_module.items(), key=lambda kv: -sum(kv[1])):
        out.append(f"| {mod} | {len(secs)} | {sum(secs):.0f} |")
    if failed:
        out += ["", "Failed starts:"] + [f"- {r['kind']} {r['model']} in {r['test']}" for r in failed]
    return "\n".join(out) + "\n"

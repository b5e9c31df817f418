"""README, docs/ and the benchmarks' READMEs (the results folders' included) speak to users: what
a figure means and the machine and command it came from, never how a run went (time limits of a
borrowed machine, runs resumed or paused, the lock files of the machines the project is built on,
its own history). A short list of words that only such narration uses is kept out."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "device" / "README.md",
                *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks" / "results").rglob("README.md")])

# (pattern, what to write instead)
BANNED = [
    (r"heavy\.lock|flock /tmp", "a command users copy runs as is: no lock file of the build machines"),
    (r"\bthe box\b", "name the machine (GPU, CPU, cores)"),
    (r"\bthe seed's\b|\bseed 000\b", "name what the figure is (a reference, a specification)"),
    (r"\bsittings?\b|\bresumed from where\b", "give the figure and its command, not how the run went"),
    (r"\bdevice time\b|\b(?:gpu|minute) lease\b|\btime ran out\b|\bran out\b", "say what was measured, not the "
                                                                                "machine's time limits"),
    (r"\bpaused\b|\bSIGSTOP\b|\bwhile the (?:clean-clone )?suite ran\b", "say what ran beside the measurement"),
    (r"\bworkplace\b", "name the machine"),
    (r"\bissue #?\d+\b|\bcommit [0-9a-f]{7,40}\b", "no issue numbers or commit ids"),
]


def offences(text: str) -> list[tuple[int, str, str]]:
    """(line number, the words, the fix) for every banned phrase in `text`."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, fix in BANNED:
            m = re.search(pattern, line, re.I)
            if m:
                out.append((n, m.group(0), fix))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_speak_to_users(page):
    found = offences(page.read_text())
    assert not found, "\n".join(f"{page.relative_to(ROOT)}:{n}: {w!r}: {fix}" for n, w, fix in found)


def test_each_banned_phrase_is_caught():
    """Lines of the kind the list is for are found (the check is really looking)."""
    for line in ("flock /tmp/heavy.lock .venv/bin/python benchmarks/hit_path.py", "The box has Python 3.12",
                 "the seed's figures are lower", "resumed across three sittings", "in the device time left",
                 "a 29-minute pause (SIGSTOP while the clean-clone suite ran)", "fixed in issue 68"):
        assert offences(line), line
    assert not offences("The cache dir's lock is a shared `flock` on the file; pin_lease_seconds: 120")


SOURCES = sorted(p for d in ("lmcache_cartridge", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py")
                 if p != Path(__file__).resolve())


def test_code_says_why_not_when():
    """Comments and docstrings say why, not when: no issue numbers or commit ids in the code (the
    git log keeps history)."""
    pattern = re.compile(r"\bissue #?\d+\b|\bcommit [0-9a-f]{7,40}\b|\bsince issue\b", re.I)
    found = [f"{p.relative_to(ROOT)}:{n}: {m.group(0)!r}" for p in SOURCES
             for n, line in enumerate(p.read_text().splitlines(), 1) if (m := pattern.search(line))]
    assert not found, "\n".join(found)


# (pattern, what to write instead): words that only narrate how the code came to be
NARRATION = [
    (r"\bused to\b", "say what the code does and why, not what it did"),
    (r"\b20\d\d-\d\d-\d\d\b", "no dates: say what holds (a version, a measurement), not when it was seen"),
    (r"\bcall (?:\d+|N)\b", "name the step, not its place in a session"),
    (r"\bseed[- ]000\b", "name what is meant (the request shape, the format)"),
    (r"\bold code\b|\bbefore the fix\b", "say what would go wrong without it, not what the code did"),
]


def narration(text: str) -> list[tuple[int, str, str]]:
    """(line number, the words, the fix) for every narrating phrase in `text`."""
    return [(n, m.group(0), fix) for n, line in enumerate(text.splitlines(), 1)
            for pattern, fix in NARRATION if (m := re.search(pattern, line, re.I))]


def test_code_comments_do_not_narrate():
    """The package's, the benchmarks' and the tests' comments and docstrings say why, not when or
    how the code came to be."""
    found = [f"{p.relative_to(ROOT)}:{n}: {w!r}: {fix}" for p in SOURCES
             for n, w, fix in narration(p.read_text())]
    assert not found, "\n".join(found)


def test_each_narrating_phrase_is_caught():
    for line in ("# it used to raise here", "vLLM 0.33 (read 2026-11-25)", "retried since call 3",
                 "the seed-000 request shape", "old code answered 400", "the walk before the fix never ended"):
        assert narration(line), line
    assert not narration("# the digest used for reads; the `seed000` format alias; callers retry")

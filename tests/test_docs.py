"""The documentation a user follows: the mkdocs site builds with no broken link or anchor between
its pages (`--strict`), the README stays a first-time user's page (under 300 lines, every
relative link and anchor resolving), and every `lmcache-cartridge` command the README and the
user guide show is one the CLI accepts."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from lmcache_cartridge.tools.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def test_the_site_builds_strict(tmp_path):
    """mkdocs' strict build fails on a page missing from the nav, a link to a missing page and a
    link to a missing anchor (`validation` in mkdocs.yml)."""
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "request-api" / "index.html").is_file()


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slugify(h.strip(), "-") for h in re.findall(r"^#+\s+(.+)$", text, re.M)}


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) < 300
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(l.startswith("docs/") for l in links)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        assert target.exists(), f"README links to {link}: no such file"
        if anchor:
            assert anchor in _anchors(target), f"README links to {link}: no such heading"


def _cli_lines(text: str) -> list[str]:
    """`lmcache-cartridge ...` commands in fenced shell blocks, continuation lines joined."""
    out = []
    for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip().rstrip("&").strip()
            if line.startswith("lmcache-cartridge ") and not re.search(r"\[-|\||\.\.\.", line):
                out.append(line)  # a concrete command, not a synopsis (`[--opt]`, `a | b`)
    return out


@pytest.mark.parametrize("page", ["README.md", "docs/user-guide.md", "docs/deployment.md", "docs/request-api.md"])
def test_shown_commands_parse(page, capsys):
    lines = _cli_lines((ROOT / page).read_text())
    if page == "README.md":
        assert len(lines) >= 8
    parser = build_parser()
    for line in lines:
        argv = shlex.split(line.replace("$M", "/models/m"))[1:]
        try:
            parser.parse_args(argv)
        except SystemExit as e:  # argparse's way of refusing
            pytest.fail(f"{page}: `{line}` is refused by the CLI: {capsys.readouterr().err.strip()}")

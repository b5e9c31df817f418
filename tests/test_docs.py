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
    # the pictures are on the site: the data path and every benchmark plot, shown where cited
    assert (tmp_path / "site" / "img" / "data-path.svg").read_bytes() == (ROOT / "docs/img/data-path.svg").read_bytes()
    for png in sorted((ROOT / "benchmarks" / "results").rglob("*.png")):
        rel = png.relative_to(ROOT / "benchmarks" / "results")
        built = tmp_path / "site" / "img" / "benchmarks" / rel
        assert built.read_bytes() == png.read_bytes(), rel
        assert f'src="../img/benchmarks/{rel}"' in (tmp_path / "site" / "benchmarks" / "index.html").read_text(), rel


def test_pictures_are_shown_where_they_are_cited():
    """The data path (client -> gateway -> vLLM -> connector -> LMCache -> plugin -> tiers) is a
    picture on the home and design pages; each benchmark plot under benchmarks/results is linked
    into the site (docs/img/benchmarks/, a link to the file itself: one copy) and shown on the
    benchmarks page, which cites its run."""
    import xml.etree.ElementTree as ET

    svg = ET.parse(ROOT / "docs" / "img" / "data-path.svg").getroot()
    text = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text") if t.text]
    order = ["Client", "Gateway", "vLLM", "Connector", "LMCache", "Storage plugin"]
    assert [t for t in text if t in order] == order
    assert {"CPU tier", "disk cache", "origin"} <= set(text)
    for page in ("index.md", "design.md"):
        page_text = (ROOT / "docs" / page).read_text()
        assert "![The data path" in page_text and "(img/data-path.svg)" in page_text
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    pngs = sorted((ROOT / "benchmarks" / "results").rglob("*.png"))
    assert len(pngs) >= 7
    for png in pngs:
        rel = png.relative_to(ROOT / "benchmarks" / "results")
        link = ROOT / "docs" / "img" / "benchmarks" / rel
        assert link.is_symlink() and link.resolve() == png.resolve(), rel
        assert re.search(rf"!\[[^\]]+\]\(img/benchmarks/{re.escape(str(rel))}\)", bench), rel


RESULTS = ROOT / "benchmarks" / "results"
RESULT_SUFFIXES = (".json", ".md", ".png")


def not_results(root: Path) -> list[str]:
    """Files under `root` that are not a result: anything but JSON, markdown and png."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.suffix not in RESULT_SUFFIXES)


def test_results_are_what_the_docs_cite():
    """benchmarks/results holds what the docs cite and nothing else: each run's JSON (the record),
    its markdown (what the docs quote, with the command and the machine) and its plot. Logs, log
    tails, test outputs and profiler dumps stay where the run wrote them; a line or a figure the
    docs rest on is quoted in the markdown."""
    found = not_results(RESULTS)
    assert not found, ("not a result (quote what the docs need in the folder's markdown, then delete): "
                       + ", ".join(found))


def test_the_results_check_sees_a_log(tmp_path):
    (tmp_path / "run").mkdir()
    for name in ("run/ttft.json", "run/ttft.md", "run/ttft.png", "run/server_log_tail.txt", "run/metrics.jsonl"):
        (tmp_path / name).write_text("x")
    assert not_results(tmp_path) == ["run/metrics.jsonl", "run/server_log_tail.txt"]


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slugify(h.strip(), "-") for h in re.findall(r"^#+\s+(.+)$", text, re.M)}


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) < 300
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(link.startswith("docs/") for link in links)
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
        except SystemExit as e:  # argparse's way of refusing (or, status 0, of answering --version)
            if e.code == 0:
                continue
            pytest.fail(f"{page}: `{line}` is refused by the CLI: {capsys.readouterr().err.strip()}")


def test_request_api_examples_are_what_the_gateway_answers(tmp_path):
    """docs/request-api.md's error body is the gateway's answer to that request, sent by the
    OpenAI SDK as the page shows (its api_key as the Bearer key): the SDK raises NotFoundError with
    that body, AuthenticationError on a wrong key; /health is the documented body."""
    import asyncio
    import json

    import httpx
    import openai

    from lmcache_cartridge.api.gateway import GatewaySettings, create_app
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    page = (ROOT / "docs" / "request-api.md").read_text()
    documented = json.loads(re.search(r'```json\n(\{"error".*?\})\n```', page, re.S).group(1))
    missing = re.search(r"'([\w-]+)'", documented["error"]["message"]).group(1)
    model = str(ensure_test_model(tmp_path / "models"))
    key = "doc-key-0123456789abcdef"
    app = create_app(GatewaySettings(upstream="http://127.0.0.1:9", model=model, tokenizer=model,
                                     registry=tmp_path / "reg.db", cache_dir=tmp_path / "cache", api_keys=(key,)))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            def client(api_key):
                return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=api_key, http_client=http, max_retries=0)

            ask = dict(model=model, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                       extra_body={"cartridges": [{"id": missing}]})
            with pytest.raises(openai.NotFoundError) as found:
                await client(key).chat.completions.create(**ask)
            with pytest.raises(openai.AuthenticationError):
                await client("wrong-key-0123456789abcdef").chat.completions.create(**ask)
            return found.value, (await http.get("/health"))

    err, health = asyncio.run(go())
    assert err.status_code == 404 and err.response.json() == documented
    assert health.status_code == 200
    assert f"`GET /health`: 200 `{health.text.replace(':', ': ')}`" in page.replace("\n  ", " ")

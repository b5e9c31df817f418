import os
from pathlib import Path
pytest_plugins = ["s3_server", "server_pool"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def rehash_manifest(m: dict) -> dict:
    """`m` (a manifest.json as a dict) with the content hash its chunk digests give, as a packer
    elsewhere writes it after changing them (the hash is derived, so a forged file carries it)."""
    from lmcache_cartridge.cartridge.manifest import ChunkInfo, derive_content_hash, dtype_from_name

    m["content_hash"] = derive_content_hash(
        [2, m["num_layers"], m["num_tokens"], m["num_kv_heads"], m["head_dim"]], dtype_from_name(m["dtype"]),
        m["chunk_size"], [ChunkInfo(**c) for c in m["chunks"]])
    return m


def random_kv(layers=2, tokens=40, heads=2, dim=8, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, layers, tokens, heads, dim, generator=g).to(dtype)


@pytest.fixture
def kv_factory():
    return random_kv


# --- the suite's own report: where its time goes (`make test` sets the report directory) -------
_durations: dict[str, float] = {}


def pytest_configure(config):
    from lmcache_cartridge.tools.starts import ENV, FILE

    d = os.environ.get(ENV)
    if d and not hasattr(config, "workerinput"):
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / FILE).unlink(missing_ok=True)  # this run's starts only


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    _durations[module] = _durations.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    from lmcache_cartridge.tools.starts import ENV, FILE, read, summary

    d = os.environ.get(ENV)
    if not d:
        return
    total = sum(_durations.values())
    rows = ["| test module | seconds | share |", "|---|---|---|"]
    rows += [f"| {m} | {s:.0f} | {s / total:.0%} |" for m, s in sorted(_durations.items(), key=lambda kv: -kv[1])
             if total]
    text = (f"# Where the time went\n\n{len(_durations)} modules, {total / 60:.1f} min in tests "
            f"(setup, call and teardown)\n\n" + "\n".join(rows) + "\n\n## Server starts\n\n"
            + summary(read(Path(d) / FILE)))
    (Path(d) / "summary.md").write_text(text)
    terminalreporter.write_sep("=", "server starts")
    terminalreporter.write_line(summary(read(Path(d) / FILE)))
    terminalreporter.write_line(f"per-module table: {Path(d) / 'summary.md'}; junit XML beside it")

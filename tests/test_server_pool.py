"""The test suite's own machinery (tests/server_pool.py): the xdist grouping `make test` relies on,
and what a pooled server does when it cannot start or dies.

- pytest-xdist's `--dist loadgroup` runs a group whole on one worker (pytest 9.2's node ids
  silently broke it: every group was spread over both workers, and each worker started its own
  copy of every pooled server);
- a pooled server whose vLLM cannot start fails the module that wants it with vLLM's own first
  error, after one more try, and every later module at once without another start;
- a pooled server that died is replaced once; dead again, the pool reports its exit instead of
  starting a third.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import server_pool
from server_pool import Context, Pool, PoolStartError, Spec

MODULE = "tests/test_server_pool.py"


def test_loadgroup_keeps_a_group_on_one_worker(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(textwrap.dedent("""
            import os
            import pytest

            @pytest.mark.xdist_group("one")
            @pytest.mark.parametrize("i", range(4))
            def test_grouped(i, tmp_path_factory):
                with open(os.environ["WORKERS_FILE"], "a") as f:
                    f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
        """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                          "-q", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "WORKERS_FILE": str(tmp_path / "workers")})
    assert out.returncode == 0, out.stdout + out.stderr
    workers = (tmp_path / "workers").read_text().split()
    assert len(workers) == 8 and len(set(workers)) == 1, workers  # group "one" whole on one worker


def test_a_pooled_servers_users_get_the_time_to_start_it(tmp_path):
    """pytest-timeout counts setup, where the first of a pooled server's users starts it: those
    users get one server start on top of the run's limit; a test that sets its own limit, or
    uses no pooled server, keeps it."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["server_pool"]\n')
    (tmp_path / "test_limits.py").write_text(textwrap.dedent("""
        import pytest

        from lmcache_cartridge.tools.vllm_process import START_TIMEOUT_S

        def limit(request):
            mark = request.node.get_closest_marker("timeout")
            return None if mark is None else mark.args[0]

        @pytest.mark.servers("tiny")
        def test_pooled(request):
            assert limit(request) == 900 + START_TIMEOUT_S

        @pytest.mark.servers("tiny")
        @pytest.mark.timeout(5000)
        def test_own_limit(request):
            assert limit(request) == 5000

        def test_no_server(request):
            assert limit(request) is None
    """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--timeout", "900",
                          str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    assert out.returncode == 0 and "3 passed" in out.stdout, out.stdout + out.stderr


class _Request:
    """What `Context` asks of a fixture request: nothing here needs S3."""

    def getfixturevalue(self, name):
        raise AssertionError(f"this spec needs no fixture ({name})")


def _pool(tmp_path, monkeypatch, spec: Spec) -> Pool:
    monkeypatch.setitem(server_pool.SPECS, "under-test", lambda ctx: spec)
    return Pool(tmp_path / "pool", Context(_Request()), {"under-test": {MODULE}})


def test_a_pooled_server_that_cannot_start_fails_with_vllms_own_error(tmp_path, monkeypatch):
    pool = _pool(tmp_path, monkeypatch, Spec(model=str(tmp_path / "no-such-model")))
    try:
        with pytest.raises(PoolStartError) as e:
            pool.server("under-test", MODULE)
        assert pool.starts["under-test"] == 2  # tried once more
        assert "did not start, twice" in str(e.value) and "no-such-model" in str(e.value), str(e.value)
        with pytest.raises(PoolStartError) as again:
            pool.server("under-test", MODULE)
        assert pool.starts["under-test"] == 2 and str(again.value) == str(e.value)  # no third start
    finally:
        pool.close()


def test_an_undeclared_use_is_refused(tmp_path, monkeypatch):
    pool = _pool(tmp_path, monkeypatch, Spec(model=str(tmp_path / "no-such-model")))
    with pytest.raises(pytest.UsageError, match="without declaring it"):
        pool.server("under-test", "tests/test_other.py")
    assert pool.starts["under-test"] == 0


@pytest.mark.slow
@pytest.mark.long  # two more server starts, for the harness's own fault
@pytest.mark.servers("tiny")  # its model and xdist group; the server under test is its own
def test_a_pooled_server_that_died_is_replaced_once(tmp_path, monkeypatch):
    # What is tested is the pool, not vLLM's arithmetic: vLLM's CPU CI mode (no warm-up run)
    # starts in about half the time, and nothing here compares answers.
    pool = _pool(tmp_path, monkeypatch, Spec(extra_env={"VLLM_CPU_CI_ENV": "1"}))
    try:
        first = pool.server("under-test", MODULE)
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=30)
        second = pool.server("under-test", MODULE)
        assert second is not first and second.alive() and pool.replaced["under-test"] == 1
        assert second.complete([1, 2, 3, 4], max_tokens=2)["tokens"]
        os.killpg(second.proc.pid, signal.SIGKILL)
        second.proc.wait(timeout=30)
        with pytest.raises(PoolStartError, match="exited again"):
            pool.server("under-test", MODULE)
        assert pool.starts["under-test"] == 2
    finally:
        pool.close()


def test_the_pool_declares_every_module_it_serves():
    """Every `servers(...)` name a module declares is a pooled spec or a maker the pool knows."""
    names = set()
    for path in Path(__file__).parent.glob("test_*.py"):
        for args in re.findall(r"pytest\.mark\.servers\(([^)]*)\)", path.read_text()):
            names |= set(re.findall(r'"([^"]+)"', args))
    assert names, "no module declares a pooled server"
    makers = {n[len("maker:"):] for n in names if n.startswith("maker:")}
    servers = {n for n in names if not n.startswith("maker:")}
    assert servers <= set(server_pool.SPECS), servers - set(server_pool.SPECS)
    assert makers <= set(server_pool.MAKERS), makers - set(server_pool.MAKERS)


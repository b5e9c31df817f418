"""Servers shared by the end-to-end modules: one vLLM server per configuration (with its registry
and cache dir) and one KV maker per model, for the whole session, each started on first use and
stopped after the last module that declared it.

A module declares what it uses, so the pool knows when a server is no longer needed and the
session can run its users one after another:

    pytestmark = [pytest.mark.slow, pytest.mark.servers("tiny", "maker:tiny")]

and takes the server from a fixture (`tiny_server`, `tiny_prefix_server`) or a maker from
`engine_kv(model_dir)`. The configurations are `SPECS`: each is the union of the settings of
the modules that share it (a setting one module needs and the others do not notice), so a test
that needs a setting no spec has keeps a server of its own.

What a pooled server guarantees each module (so a module's result does not depend on what ran
before it): at the module's start vLLM's prefix cache is empty and `server.module_mark` is the
log's end (`server.module_log()`: its own lines only); at its end every cartridge it registered
is removed and no longer served. Counters are the server's: tests count deltas. A server that
died is replaced once per configuration; one that cannot start fails every module that wants it
with the log's first error (`VllmProcess.failure_report`).

Ordering: modules are run grouped by the first server they declare (collection order kept
otherwise). Under `pytest -n 2 --dist loadgroup` (`make test`) the slow tests form xdist groups
(`xdist_group`: the tiny model's pool, each other pooled server's users, each module with servers
of its own), each run whole by one worker; xdist hands the groups, largest first, and the fast
tests to whichever worker is free.

Runs in the test process (each xdist worker has its own pool).
"""

from __future__ import annotations

import logging
import shutil
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from e2e_server import Server

from lmcache_cartridge.tools.vllm_process import START_TIMEOUT_S

logger = logging.getLogger(__name__)
MARKER = "servers"
TINY = {"tiny", "tiny-prefix", "maker:tiny"}  # the tiny test model's: one xdist group (`xdist_group`)
_POOL: "Pool | None" = None  # the session's, once the fixture made it (the teardown hook needs it)


@dataclass(frozen=True)
class Spec:
    """One pooled server's configuration (see `Server` and `VllmProcess` for each field)."""

    model: str = "tiny"                 # "tiny" (tools.testmodel.ensure_test_model()) or a model directory
    prefix_caching: bool = False
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    kv_extra: dict[str, Any] = field(default_factory=dict)
    plugin_extra: dict[str, Any] = field(default_factory=dict)
    max_model_len: int = 2048


class Context:
    """What a spec may need from the session, made only when a spec asks for it."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        self._proxy = None

    def moto(self) -> str:
        return self._request.getfixturevalue("moto_server")

    def s3_proxy(self):
        """A counting, fault-injecting proxy in front of moto for the session (`server_s3_proxy`):
        a server's S3 endpoint is fixed at its start, so the proxy lives as long as the pool."""
        return self._request.getfixturevalue("server_s3_proxy")


def _s3_env() -> dict[str, str]:
    from s3_server import DUMMY_ENV

    return {**DUMMY_ENV, "AWS_CONFIG_FILE": "/nonexistent/aws-config-for-tests",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-config-for-tests"}


def _tiny(ctx: Context) -> Spec:
    """Prefix caching off: every prompt token is computed or comes from LMCache, and vLLM's
    external-KV counter says which (test_vllm_e2e, test_train_e2e, test_compose_e2e,
    test_input_formats_e2e, test_metrics_e2e). The plugin reads S3 from moto directly."""
    return Spec(extra_env={"VLLM_SERVER_DEV_MODE": "1", "LMCACHE_CARTRIDGE_INSTANCE": "pool-tiny", **_s3_env()},
                plugin_extra={"s3.endpoint_url": ctx.moto()})


# long enough that what runs beside a waiting request (a plain request, a local cartridge's load)
# finishes first on a slow machine; a test that waits for a request to fail waits this long
TINY_PREFIX_READY_TIMEOUT_S = 15


def _tiny_prefix(ctx: Context) -> Spec:
    """Prefix caching on, as deployments run (test_gateway_e2e, test_load_failure_e2e,
    test_ready_on_instance_e2e, test_bench_ttft's cartridge arms): greedy short answers by default
    (the request spec's usage examples send no temperature), a short readiness wait, and the plugin's S3 reads
    through the session's fault proxy with one attempt (a fault is seen at once)."""
    from lmcache_cartridge.vllm.readiness import READY_TIMEOUT_KEY

    return Spec(prefix_caching=True,
                extra_args=("--override-generation-config", '{"temperature": 0, "max_new_tokens": 16}'),
                extra_env={"VLLM_SERVER_DEV_MODE": "1", "LMCACHE_CARTRIDGE_INSTANCE": "pool-tiny-prefix",
                           **_s3_env()},
                kv_extra={READY_TIMEOUT_KEY: TINY_PREFIX_READY_TIMEOUT_S},
                plugin_extra={"s3.endpoint_url": ctx.s3_proxy().endpoint_url, "s3.max_attempts": "1"})


SPECS: dict[str, Callable[[Context], Spec]] = {"tiny": _tiny, "tiny-prefix": _tiny_prefix}


def _model_dir(model: str) -> Path:
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    return ensure_test_model() if model == "tiny" else Path(model)


class PoolStartError(RuntimeError):
    """A pooled server that could not start (twice): every module that wants it gets this."""


class Pool:
    """The session's servers and makers (see the module docstring)."""

    def __init__(self, root: Path, ctx: Context, users: dict[str, set[str]]) -> None:
        self.root, self.ctx = root, ctx
        self.users = users                      # server name -> modules that declared it, not done yet
        self.servers: dict[str, Server] = {}
        self.makers: dict[str, Any] = {}        # model dir -> tools.engine_kv.EngineKVMaker
        self.failed: dict[str, str] = {}        # server name -> why it could not start
        self.replaced: dict[str, int] = defaultdict(int)
        self.starts: dict[str, int] = defaultdict(int)
        self.module_entries: dict[str, set[str]] = {}  # server name -> registry ids before the module

    # --- servers -----------------------------------------------------------------------------
    def server(self, name: str, module: str) -> Server:
        """The pooled server `name` for `module`, started (or replaced, once) as needed; the first
        call of a module begins its lease (empty prefix cache, log mark, registry snapshot)."""
        if module not in self.users.get(name, ()):
            raise pytest.UsageError(f"{module} uses pooled server {name!r} without declaring it: add "
                                    f"pytest.mark.{MARKER}({name!r}) to its pytestmark")
        if name in self.failed:
            raise PoolStartError(self.failed[name])
        srv = self.servers.get(name)
        if srv is not None and not srv.alive():
            report = srv.failure_report(40, 10)
            if self.replaced[name] >= 1:
                self.failed[name] = (f"pooled server {name!r} exited again ({srv.proc.returncode}); "
                                     f"its log's first error:\n{report}")
                raise PoolStartError(self.failed[name])
            logger.warning("pooled server %r exited with %s; starting a new one. Its log's first error:\n%s",
                           name, srv.proc.returncode, report)
            self.replaced[name] += 1
            self._stop(name)
            srv = None
        if srv is None:
            srv = self._start(name)
        return srv

    def _start(self, name: str) -> Server:
        spec = SPECS[name](self.ctx)
        last = ""
        for attempt in (1, 2):  # a failed start is tried once more before every user fails
            self.starts[name] += 1
            root = self.root / f"{name}-{self.starts[name]}"
            if root.exists():
                shutil.rmtree(root)
            srv = Server(root, _model_dir(spec.model), cache_dir=root / "cache", plugin_extra=spec.plugin_extra,
                         prefix_caching=spec.prefix_caching, extra_args=spec.extra_args,
                         extra_env=spec.extra_env, kv_extra=spec.kv_extra or None,
                         max_model_len=spec.max_model_len)
            try:
                srv.wait_healthy()
            except (RuntimeError, TimeoutError) as e:
                last = str(e)
                srv.stop()
                logger.warning("pooled server %r did not start (attempt %d):\n%s", name, attempt, last)
                continue
            with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
                srv.metrics_at_start = r.read().decode()  # before any request (test_metrics_e2e)
            self.servers[name] = srv
            return srv
        self.failed[name] = f"pooled server {name!r} did not start, twice; the last time:\n{last}"
        raise PoolStartError(self.failed[name])

    def begin_module(self, name: str, srv: Server) -> None:
        """A module's lease begins: vLLM's prefix cache emptied (a prompt another module sent is
        not a hit here), the log marked, the registry's ids noted (removed again at its end)."""
        if srv.prefix_caching:
            srv.reset_prefix_cache()
        srv.module_mark = srv.log_mark()
        self.module_entries[name] = {e.id for e in srv.registry.list()}

    def end_module(self, name: str) -> None:
        """A module's lease ends: what it registered is removed, and waited on until no plugin
        instance serves it."""
        srv, before = self.servers.get(name), self.module_entries.pop(name, None)
        if srv is None or before is None or not srv.alive():
            return
        for e in srv.registry.list():
            if e.id not in before:
                srv.registry.remove(e.id)
                srv.wait_not_served(e.id)

    def _stop(self, name: str) -> None:
        srv = self.servers.pop(name, None)
        if srv is not None:
            srv.stop()

    # --- makers ------------------------------------------------------------------------------
    def maker(self, model_dir) -> Any:
        """The KV maker (`tools.engine_kv.EngineKVMaker`: vLLM computing KV as `create` does) of
        `model_dir`, started on its first use; it replaces a dead server itself."""
        from lmcache_cartridge.tools.engine_kv import EngineKVMaker

        key = str(Path(model_dir).resolve())
        if key not in self.makers:
            self.makers[key] = EngineKVMaker(model_dir, self.root / f"kv-maker-{len(self.makers)}")
        return self.makers[key]

    # --- lifecycle ---------------------------------------------------------------------------
    def module_done(self, module: str) -> None:
        """`module` finished: end its leases; stop every server and maker no later module declared."""
        for name, users in self.users.items():
            if module in users:
                users.discard(module)
                if name in self.servers:
                    try:
                        self.end_module(name)
                    except Exception:  # noqa: BLE001 - the next module's lease still begins clean
                        logger.exception("pooled server %r: could not remove what %s registered", name, module)
        for name, users in self.users.items():
            if users:
                continue
            if name.startswith("maker:"):
                m = self.makers and self.makers.get(str(_maker_dir(name[len("maker:"):]).resolve()))
                if m is not None:
                    m.stop()  # a later undeclared use starts it again
            else:
                self._stop(name)

    def close(self) -> None:
        for name in list(self.servers):
            self._stop(name)
        for m in self.makers.values():
            m.stop()


def _hd80_dir() -> Path:
    from test_vllm_e2e_vec16 import model_dir

    return model_dir()


def _real_dir() -> Path:
    from lmcache_cartridge.tools.realmodel import ensure_real_model

    return ensure_real_model()


def _tiny_dir() -> Path:
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    return ensure_test_model()


MAKERS: dict[str, Callable[[], Path]] = {"tiny": _tiny_dir, "hd80": _hd80_dir, "real": _real_dir}


def _maker_dir(model: str) -> Path:
    """The model directory a `maker:<model>` declaration names."""
    return MAKERS[model]()


def declared(item: pytest.Item) -> tuple[str, ...]:
    """The servers an item's module declared (`pytest.mark.servers(...)`), in order."""
    names: list[str] = []
    for mark in item.iter_markers(MARKER):
        names += [n for n in mark.args if n not in names]
    return tuple(names)


# --- pytest hooks and fixtures ---------------------------------------------------------------------
def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARKER}(*names): pooled servers the module uses (tests/server_pool.py)")


def xdist_group(item: pytest.Item) -> str | None:
    """The xdist group of a slow item, so that a pooled server's users all run on one worker (its
    pool) and the slow work is cut into many groups that xdist hands to whichever worker is free:
    the tiny test model's servers and maker in one group (`TINY`); any other pooled server in a
    group named by it (the real model's maker; the head_dim-80 model's); a module that starts only
    servers of its own in a group of its own. Fast items have none: xdist spreads them."""
    if item.get_closest_marker("slow") is None:
        return None
    names = declared(item)
    if set(names) & TINY:
        return "servers-tiny"
    if names:
        return "servers-" + names[0].replace(":", "-")
    return "module-" + Path(item.nodeid.split("::")[0]).stem


def time_limit(item: pytest.Item, base: float | None) -> float | None:
    """The time limit (pytest-timeout's, which counts setup) of an item that declares pooled
    servers: `base` plus one server start, which the first of a server's users pays in its setup
    (up to `START_TIMEOUT_S`) and is not the test's own time. None where the item keeps its limit:
    it declares no server, sets its own, or the run has none."""
    if not base or not declared(item) or item.get_closest_marker("timeout") is not None:
        return None
    return base + START_TIMEOUT_S


@pytest.hookimpl(tryfirst=True)  # before xdist turns the groups into node ids (--dist loadgroup)
def pytest_collection_modifyitems(session, config, items):
    """Modules grouped by the first server they declare (stable otherwise), so a server's users
    run one after another; slow items in their xdist group; a pooled server's users with the time
    to start it (`time_limit`)."""
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::")[0], i)

    def key(indexed):
        i, item = indexed
        module = item.nodeid.split("::")[0]
        names = declared(item)
        group = names[0] if names else ""
        return (group != "", group, first_seen[module], i)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]
    groups: dict[str, set[str]] = defaultdict(set)
    base = config.getoption("timeout", None)
    for item in items:
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        limit = time_limit(item, base)
        if limit is not None:
            item.add_marker(pytest.mark.timeout(limit))
        for name in declared(item):
            groups[name].add(group)
    split = {name: sorted(map(str, g)) for name, g in groups.items() if len(g) > 1}
    if split:  # each worker has its own pool: a server's users on two workers would start it twice
        raise pytest.UsageError(f"pooled servers declared across xdist groups: {split}")


def _users(items) -> dict[str, set[str]]:
    users: dict[str, set[str]] = defaultdict(set)
    for item in items:
        for name in declared(item):
            users[name].add(item.nodeid.split("::")[0])
    return dict(users)


@pytest.fixture(scope="session")
def server_pool(request, tmp_path_factory):
    global _POOL
    for name in _users(request.session.items):
        if not name.startswith("maker:") and name not in SPECS:
            raise pytest.UsageError(f"a module declares pooled server {name!r}; the pool has {sorted(SPECS)}")
    pool = Pool(tmp_path_factory.mktemp("pool"), Context(request), _users(request.session.items))
    _POOL = pool
    try:
        yield pool
    finally:
        _POOL = None
        pool.close()


@pytest.fixture(scope="session")
def server_s3_proxy(moto_server):
    """The S3 proxy pooled servers talk to (faults injected by a module are its own to clear)."""
    from s3_server import S3Proxy

    with S3Proxy(moto_server) as proxy:
        yield proxy


def _pooled(request, name: str) -> Server:
    pool: Pool = request.getfixturevalue("server_pool")
    module = request.node.nodeid.split("::")[0]
    srv = pool.server(name, module)
    pool.begin_module(name, srv)
    return srv


@pytest.fixture(scope="module")
def tiny_server(request) -> Server:
    """The pooled tiny-model server with prefix caching off (`SPECS["tiny"]`)."""
    return _pooled(request, "tiny")


@pytest.fixture(scope="module")
def tiny_prefix_server(request) -> Server:
    """The pooled tiny-model server with prefix caching on (`SPECS["tiny-prefix"]`)."""
    return _pooled(request, "tiny-prefix")


@pytest.fixture(scope="session")
def engine_kv(server_pool):
    """`engine_kv(model_dir)`: the pool's `EngineKVMaker` for that model (vLLM computing KV through
    LMCache's store path, what `create` uses by default), started on its first use (again after a
    `stop`), stopped after the last module that declared `maker:<model>`."""
    return server_pool.maker


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (its module fixtures finalized): end its leases, stop what no
    later module needs."""
    yield
    module = item.nodeid.split("::")[0]
    if _POOL is not None and (nextitem is None or nextitem.nodeid.split("::")[0] != module):
        _POOL.module_done(module)

"""S3 on loopback as pytest fixtures, over `lmcache_cartridge.testing.s3` (the one source of the
moto server and the counting, fault-injecting proxy, which the benchmarks use too).

Use from a test module with `from s3_server import moto_server, s3_proxy  # noqa: F401`.

- `moto_server` (session): a real S3 HTTP endpoint on 127.0.0.1, with dummy credentials in the
  environment for the session (restored afterwards) and every other credential source off.
- `s3_proxy` (function): a fresh `S3Proxy` forwarding to it for one test.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from lmcache_cartridge.testing.s3 import (  # noqa: F401  (re-exported for the tests)
    DUMMY_ENV,
    Fault,
    Record,
    S3Proxy,
    moto_thread,
    s3_client,
    upload_dir,
)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1; yields its endpoint URL. Dummy credentials meanwhile."""
    with moto_thread() as url:
        yield url


@pytest.fixture
def s3_proxy(moto_server: str) -> Iterator[S3Proxy]:
    """A fresh counting/fault-injecting proxy in front of `moto_server` for one test."""
    with S3Proxy(moto_server) as proxy:
        yield proxy

"""S3 on loopback for the benchmarks: the moto server and the counting proxy the tests use, from
their one source (`lmcache_cartridge.testing.s3`, which `tests/s3_server.py` wraps as fixtures)."""

from lmcache_cartridge.testing.s3 import (  # noqa: F401  (re-exported)
    DUMMY_ENV,
    Fault,
    S3Proxy,
    isolated_aws_env,
    moto_process,
    moto_thread,
    s3_client,
    upload_dir,
)

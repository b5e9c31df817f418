"""LMCache's real engine on CPU for the tests: `lmcache_cartridge.testing.dense_engine`, the one
source the benchmarks use too."""

from lmcache_cartridge.testing.dense_engine import (  # noqa: F401  (re-exported for the tests)
    DenseKVConnector,
    Engine,
    helpers_take_pieces,
    make_config,
    make_metadata,
)

"""The suite's two tiers: `make test` (the gate CI runs) deselects the items marked `long`, and
`make test-long` runs only those (docs/testing.md says which and why).

A whole test is marked `pytest.mark.long`; one parameter of a parametrized test (a fixture's
parameter included) `pytest.mark.long_when(name=value, ...)`, which this plugin turns into
`long` on the items whose parameters have those values, before `-m` selects by marker.

Runs in pytest's collection (every xdist worker collects the same items)."""

from __future__ import annotations

import pytest

_MISSING = object()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        for m in item.iter_markers("long_when"):
            if all(params.get(k, _MISSING) == v for k, v in m.kwargs.items()):
                item.add_marker(pytest.mark.long)

"""benchmarks/attention_footprint.py at a tiny size: what it compares is what it says (no timing
is asserted). Shared and private block tables must give vLLM's attention the same values."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm._custom_ops")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import attention_footprint  # noqa: E402


def test_shared_and_distinct_tables_attend_over_the_same_values():
    row = attention_footprint.run(context=384, requests=3, queries=4, layers=1, reps=1, isa="vec")
    assert row["outputs_equal"] and row["kv_per_layer_mib"]["distinct"] == 3 * row["kv_per_layer_mib"]["shared"]
    assert set(row["p50_ms"]) == {"shared", "distinct"}

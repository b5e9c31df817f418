"""benchmarks/harness: the one percentile's convention on small known inputs, and a result written
to JSON reads back equal (machine, arms and details included)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import Arm, Result, load_payload, machine_info, percentile, read_result, write_result  # noqa: E402


@pytest.mark.parametrize("values, q, want", [
    ([1, 2, 3, 4], 50, 2.5),          # between the two middle ranks
    ([3, 1, 2], 50, 2.0),             # sorted first
    (list(range(1, 101)), 95, 95.05),  # rank 0.95 * 99 = 94.05: 95 + 0.05 * 1
    (list(range(1, 101)), 99, 99.01),
    ([10, 20], 0, 10.0), ([10, 20], 100, 20.0), ([10, 20], 25, 12.5),
    ([7.0], 99, 7.0),
])
def test_percentile_interpolates_linearly_between_closest_ranks(values, q, want):
    assert percentile(values, q) == pytest.approx(want)


def test_percentile_of_nothing_is_none_and_q_is_in_percent():
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="in percent"):
        percentile([1, 2], 0.95 * 1000)


def test_arm_from_samples_uses_the_one_percentile():
    a = Arm.from_samples("x", [4, 1, 3, 2], errors=1, gib=1.5)
    assert (a.count, a.errors, a.p50, a.p95) == (4, 1, 2.5, pytest.approx(3.85))
    assert a.figures == {"gib": 1.5}


def test_result_round_trips_through_json(tmp_path):
    r = Result(benchmark="demo", argv=["benchmarks/demo.py", "--n", "3"], machine=machine_info(),
               parameters={"n": 3, "model": Path("/m")},
               arms=[Arm.from_samples("cold", [0.3, 0.1, 0.2]), Arm(name="count-only", count=5, p50=None)],
               details={"rows": [{"a": (1, 2)}]})
    paths = write_result(r, tmp_path, body="## rows\n")
    assert [p.name for p in paths] == ["demo.json", "demo.md"]
    back = read_result(tmp_path / "demo.json")
    assert back == r
    assert back.machine["git"] and back.parameters["model"] == "/m" and back.details["rows"][0]["a"] == [1, 2]
    md = (tmp_path / "demo.md").read_text()
    assert md.startswith("## rows\n") and "| cold | 3 | 0 | 0.2 |" in md and back.machine["git"] in md


def test_older_result_files_read_as_they_were(tmp_path):
    old = {"meta": {"smoke": True}, "arms": {"a": []}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_payload(tmp_path / "old.json") == old
    with pytest.raises(ValueError, match="older result file"):
        read_result(tmp_path / "old.json")
    r = Result(benchmark="new", machine={"cpu": "x"}, details={"meta": {"smoke": False}})
    write_result(r, tmp_path, markdown_file=False)
    assert load_payload(tmp_path / "new.json") == {"machine": {"cpu": "x"}, "meta": {"smoke": False}}


def test_the_bench_model_is_described_as_the_results_cite_it():
    """The TTFT benchmark's model is the package's `BuildParams` (one description of a test
    model); its record keeps every field the committed results carry, with the same values."""
    from harness.serving import BENCH_MODEL

    from lmcache_cartridge.tools.testmodel import BuildParams

    assert isinstance(BENCH_MODEL.params, BuildParams)
    cited = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/ttft.json").read_text())["model_spec"]
    described = BENCH_MODEL.describe()
    assert {k: described.get(k) for k in cited} == cited


def test_cpu_of_names_the_model_and_the_isa_flags_that_pick_vllms_kernels():
    from harness.machine import cpu_of

    text = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n"
            "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n\n"
            "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu amx_tile\n")
    assert cpu_of(text) == {"cpu": "Intel(R) Xeon(R) Processor",
                            "cpu_flags": ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"]}
    assert cpu_of("flags\t: fpu sse2 avx2\n") == {"cpu_flags": ["avx2"]}  # AVX2 only: no AVX-512 kernels
    assert cpu_of("") == {}

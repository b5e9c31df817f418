"""`benchmarks/fleet.py: compare`, the check behind "answers = single-instance reference".

The kv_aware arm sends first-k requests without `return_tokens_as_token_ids` (vllm-router 0.1.17
credits no KV to requests carrying it), so its answers are token strings, which different token
ids can share: equal strings must also agree in every logprob, else a wrong KV that happens to
decode alike would pass as equal.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fleet  # noqa: E402

REF = {"tokens": ["a", "b"], "logprobs": [-1.0, -2.0], "top": [{"a": -1.0, "c": -1.5}, {"b": -2.0, "d": -3.0}]}


def test_equal_strings_within_noise_are_equal():
    got = dict(REF, logprobs=[-1.03, -2.05])
    c = fleet.compare(got, REF)
    assert c["equal"] and c["by_strings"] and abs(c["max_dlogprob"] - 0.05) < 1e-9


def test_equal_strings_with_moved_logprobs_are_not_equal():
    c = fleet.compare(dict(REF, logprobs=[-1.0, -2.0 - 2 * fleet.STRING_MATCH_LOGPROB_TOL]), REF)
    assert not c["equal"] and c["same_strings_max_dlogprob"] == 2 * fleet.STRING_MATCH_LOGPROB_TOL


def test_divergent_strings_report_the_reference_margin():
    c = fleet.compare({"tokens": ["a", "d"], "logprobs": [-1.0, -3.0]}, REF)
    assert not c["equal"] and c["diverges_at"] == 1 and c["ref_top2_margin_at_divergence"] == 1.0


def test_token_ids_compare_by_ids_alone():
    ref = {"tokens": [5, 6], "logprobs": [-1.0, -2.0], "top": [{}, {"token_id:7": -2.5}]}
    assert fleet.compare({"tokens": [5, 6], "logprobs": [-1.0, -2.2]}, ref)["equal"]
    c = fleet.compare({"tokens": [5, 7], "logprobs": [-1.0, -2.5]}, ref)
    assert not c["equal"] and c["ref_top2_margin_at_divergence"] == 0.5

"""benchmarks/fused_copy.py on CPU tensors at a tiny size, and the production shapes the GPU
benchmarks serve with random weights: correctness only (no timing is asserted)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fused_copy  # noqa: E402

from lmcache_cartridge.tools.testmodel import SHAPES, ensure_shape_model  # noqa: E402


def test_both_loads_are_checked_and_measured_against_a_plain_copy(monkeypatch):
    monkeypatch.setitem(fused_copy.SHAPES, "tiny", (2, 2, 8))
    r = fused_copy.run("cpu", ["tiny"], [600], reps=1)
    (cell,) = r["cells"]
    assert cell["chunks"] == 3 and cell["bytes"] == 2 * 2 * 600 * 16 * 2
    assert set(cell["ms"]) == {"memcpy", "per_chunk", "batched"}
    assert all(v > 0 for v in cell["ms"].values())
    assert "| tiny | 600 |" in fused_copy.markdown(r)


def test_the_profile_is_part_of_the_result_not_a_file_beside_it(monkeypatch, tmp_path):
    """`--profile` puts each copy arm's largest operators into the result and its markdown; the
    results folder gets the result's JSON and markdown only."""
    monkeypatch.setitem(fused_copy.SHAPES, "tiny", (2, 2, 8))
    assert fused_copy.main(["--device", "cpu", "--shapes", "tiny", "--tokens", "300,600", "--reps", "1",
                            "--profile", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused_copy-cpu.json", "fused_copy-cpu.md"]
    prof = json.loads((tmp_path / "fused_copy-cpu.json").read_text())["details"]["profile"]
    assert (prof["shape"], prof["tokens"], prof["time"]) == ("tiny", 600, "cpu")
    for arm in ("per_chunk", "batched"):
        ops = prof["arms"][arm]
        assert ops and all(o["self_ms"] >= 0 and 0 <= o["share"] <= 1 and o["calls"] >= 1 for o in ops)
        assert [o["self_ms"] for o in ops] == sorted((o["self_ms"] for o in ops), reverse=True)
    assert "## Where one call's time goes (tiny, 600 tokens" in (tmp_path / "fused_copy-cpu.md").read_text()


def test_a_load_that_misplaces_a_token_fails_the_check(monkeypatch):
    monkeypatch.setitem(fused_copy.SHAPES, "tiny", (2, 2, 8))
    import torch

    req = fused_copy.request("tiny", 300, torch.device("cpu"))
    fused_copy.arms(req, torch.device("cpu"))["batched"]()
    fused_copy.check_fused(req)
    s = int(req["slots"][299])
    req["fused"][1][s // fused_copy.BLOCK, s % fused_copy.BLOCK, 0, 0] += 1
    with pytest.raises(AssertionError, match="token 299 layer 1"):
        fused_copy.check_fused(req)


@pytest.mark.parametrize("shape,kv_kib", [("llama-3.1-8b", 128), ("llama-3.2-1b", 32)])
def test_a_shape_model_is_the_published_geometry_with_a_local_tokenizer(tmp_path, shape, kv_kib):
    from transformers import AutoConfig, AutoTokenizer

    d = ensure_shape_model(shape, tmp_path)
    cfg = AutoConfig.from_pretrained(d)
    geo = SHAPES[shape]
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size, cfg.vocab_size) == \
        (geo["num_layers"], geo["num_kv_heads"], geo["head_dim"], geo["hidden_size"], 128256)
    # bf16 K and V per layer per KV head: what a cartridge of this model holds per token
    assert 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 == kv_kib * 1024
    assert not list(d.glob("*.safetensors"))  # no weights: vLLM's --load-format dummy makes them
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) < cfg.vocab_size
    assert ensure_shape_model(shape, tmp_path) == d  # cached
    assert json.loads((d / "build_params.json").read_text())["shape"] == shape

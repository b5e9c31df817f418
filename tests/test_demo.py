"""`make demo` (lmcache_cartridge/testing/demo.py) on models other than the default tiny Llama.

* A Llama whose config has an explicit `head_dim` (32, where hidden_size / num_heads is 64): the
  demo's steps up to LMCache's own lookup, no vLLM. With a head_dim computed as hidden / heads
  the plugin refuses the cartridge (wrong KV shape) and the lookup finds nothing.
* The tiny Qwen2 (no BOS, attention biases, tied embeddings, ChatML), end to end on a real vLLM
  server (slow): LMCache serves every full chunk, the answer with the cartridge equals vLLM's own
  prefill of the same tokens and HF transformers' greedy answer given the cartridge's KV as
  `past_key_values`, and the terminal shows the demo's steps, not LMCache's log lines (those are
  in the files the demo names).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmcache_cartridge.testing import demo
from lmcache_cartridge.tools.testmodel import ensure_test_model


def _no_library_chatter(out: str) -> None:
    assert "LMCache INFO" not in out and "LMCache WARNING" not in out, out[-3000:]


def test_demo_steps_on_a_llama_with_explicit_head_dim(tmp_path, capfd):
    model_dir = ensure_test_model(tmp_path / "models", name="hd32", head_dim=32, num_heads=4, hidden_size=256)
    assert json.loads((model_dir / "config.json").read_text())["head_dim"] == 32
    lines: list[str] = []
    r = demo.run_demo(model_dir, tmp_path / "demo", serve=False, say=lines.append)
    out, err = capfd.readouterr()
    assert r.ok, (r.failure, "\n".join(lines), err[-2000:])
    assert r.bos and r.cartridge_tokens == demo.MAX_TOKENS == r.servable_tokens == r.lookup_hit
    _no_library_chatter(out + err + "\n".join(lines))
    log = Path(r.logs["lmcache_engine"]).read_text()
    assert "LMCache" in log  # its lines went to the file the demo names
    assert "demo OK" in lines[-1]


def _hf_greedy(model_dir: Path, packed: Path, question: list[int], n: int, eos: int) -> list[int]:
    """HF transformers' greedy continuation with the packed cartridge's KV as past_key_values."""
    from lmcache_cartridge.cartridge.model_kv import kv_to_cache, load_model
    from lmcache_cartridge.cartridge.packed import PackedCartridge

    model, _ = load_model(model_dir)
    with PackedCartridge(packed) as p:
        past = kv_to_cache(p.load_kv(), model.config)
    ids, out = list(question), []
    with torch.inference_mode():
        for _ in range(n):
            res = model(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True)
            past, nxt = res.past_key_values, int(res.logits[0, -1].argmax())
            if nxt == eos:
                break
            out.append(nxt)
            ids = [nxt]
    return out


@pytest.mark.slow
def test_demo_serves_a_qwen2_cartridge_end_to_end(tmp_path, capfd):
    from transformers import AutoTokenizer

    lines: list[str] = []
    r = demo.run_demo(None, tmp_path / "demo", family="qwen2", serve=True, say=lines.append)
    out, err = capfd.readouterr()
    server_log = Path(r.logs["vllm_server"])
    detail = "\n".join(lines) + "\n" + (server_log.read_text()[-3000:] if server_log.exists() else "")
    assert r.ok, (r.failure, detail)
    assert not r.bos and r.servable_tokens == demo.MAX_TOKENS == r.lookup_hit
    # each of the three "with" requests (and the first use) took every full chunk from LMCache
    assert r.external_tokens >= 3 * r.servable_tokens, detail
    assert r.answer_with == r.answer_without and r.answer_with
    model_dir = Path(r.model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    question = tok(demo.QUESTION, add_special_tokens=False)["input_ids"]
    ref = _hf_greedy(model_dir, Path(r.work) / "lighthouse", question, demo.ANSWER_TOKENS, tok.eos_token_id)
    assert r.answer_with == tok.decode(ref, skip_special_tokens=True), (r.answer_with, ref)
    _no_library_chatter(out + err + "\n".join(lines))
    assert "plugin 'cartridge' ready: 1 cartridges" in server_log.read_text()

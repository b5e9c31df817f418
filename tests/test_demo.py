"""`make demo` (lmcache_cartridge/testing/demo.py) on models other than the default tiny Llama.

* A Llama whose config has an explicit `head_dim` (32, where hidden_size / num_heads is 64): the
  demo's steps up to LMCache's own lookup, no vLLM. With a head_dim computed as hidden / heads
  the plugin refuses the cartridge (wrong KV shape) and the lookup finds nothing.
* The tiny Qwen2 (no BOS, attention biases, tied embeddings, ChatML), end to end on a real vLLM
  server (slow), in both of LMCache's modes: in vLLM's process, and as an `lmcache server` with
  the cartridge adapter that vLLM attaches to (MP). LMCache serves every full chunk (in MP mode
  vLLM counts them as loaded from the server, and nothing for the requests without the
  cartridge), the answer with the cartridge equals vLLM's own prefill of the same tokens and HF
  transformers' greedy answer given the cartridge's KV as `past_key_values`, the terminal shows
  the demo's steps, not LMCache's log lines (those are in the files the demo names), and no
  server process is left.
* The MP server's printed command (`lmcache-cartridge mp-server ...`) is checked against the one
  that ran: a server started otherwise stops the demo.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmcache_cartridge.testing import demo
from lmcache_cartridge.tools.testmodel import ensure_test_model

CONNECTORS = {"inproc": "CartridgeConnector", "mp": "CartridgeMPConnector"}


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


def _processes_under(root: Path) -> list[str]:
    """Live processes working in `root` (the demo starts its servers there): pid and command."""
    left = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if proc.joinpath("cwd").resolve().is_relative_to(root.resolve()):
                cmdline = proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ")
                left.append(f"{proc.name}: {cmdline[:200]!r}")
        except OSError:  # gone, a zombie, or not ours to read
            continue
    return left


def test_mp_server_command_is_the_one_that_ran(tmp_path):
    from types import SimpleNamespace

    from lmcache_cartridge.tools.lmcache_server import adapter_params, runnable, server_command

    loaded = demo.write_serve_yaml(tmp_path)
    ran = runnable(server_command(5601, 5602, adapter_params(loaded), chunk_size=int(loaded.chunk_size),
                                  l1_size_gb=demo.MP_L1_GB))
    server = SimpleNamespace(lmcache_server=SimpleNamespace(port=5601, http_port=5602, command=ran))
    assert demo.mp_server_command(tmp_path, server) == [
        "lmcache-cartridge", "mp-server", "--config", str(demo.serve_yaml(tmp_path)), "--port", "5601",
        "--http-port", "5602", "--l1-size-gb", str(demo.MP_L1_GB)]
    other = SimpleNamespace(lmcache_server=SimpleNamespace(port=5601, http_port=5602, command=[
        *ran[:-4], "--l2-adapter", ran[-3].replace("serve-registry.db", "other.db"), *ran[-2:]]))
    with pytest.raises(RuntimeError, match="not the demo's server"):
        demo.mp_server_command(tmp_path, other)


@pytest.mark.slow
# MP mode on a Llama test model and SmolLM2 in the gate: test_mp_trained_e2e, test_mp_e2e
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.long) if m == "mp" else m for m in demo.MODES])
def test_demo_serves_a_qwen2_cartridge_end_to_end(mode, tmp_path, capfd):
    from transformers import AutoTokenizer

    lines: list[str] = []
    r = demo.run_demo(None, tmp_path / "demo", family="qwen2", serve=True, mode=mode, say=lines.append)
    out, err = capfd.readouterr()
    server_log = Path(r.logs["vllm_server"])
    detail = "\n".join(lines) + "\n" + (server_log.read_text()[-3000:] if server_log.exists() else "")
    assert r.ok, (r.failure, detail)
    assert r.mode == mode and not r.bos and r.servable_tokens == demo.MAX_TOKENS
    vllm_command = " ".join(r.commands["vllm"])
    assert CONNECTORS[mode] in vllm_command and all(c not in vllm_command for c in CONNECTORS.values()
                                                     if c != CONNECTORS[mode])
    # each of the three "with" requests (and the first use) took every full chunk from LMCache
    # (in MP mode from the lmcache server: vLLM holds no LMCache of its own), the requests
    # without the cartridge none
    assert r.external_tokens >= 3 * r.servable_tokens and r.external_baseline == 0, detail
    assert r.answer_with == r.answer_without and r.answer_with
    model_dir = Path(r.model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    question = tok(demo.QUESTION, add_special_tokens=False)["input_ids"]
    ref = _hf_greedy(model_dir, Path(r.work) / "lighthouse", question, demo.ANSWER_TOKENS, tok.eos_token_id)
    assert r.answer_with == tok.decode(ref, skip_special_tokens=True), (r.answer_with, ref)
    _no_library_chatter(out + err + "\n".join(lines))
    if mode == "mp":
        assert r.lookup_hit == -1 and any("skipped in MP mode" in line for line in lines)
        assert r.commands["mp-server"][:2] == ["lmcache-cartridge", "mp-server"]
        assert any(line.startswith("$ lmcache-cartridge mp-server --config ") for line in lines)
        assert Path(r.logs["lmcache_server"]).is_file() and "lmcache_engine" not in r.logs
    else:
        assert r.lookup_hit == demo.MAX_TOKENS and "mp-server" not in r.commands
        assert "plugin 'cartridge' ready: 1 cartridges" in server_log.read_text()
    assert not _processes_under(tmp_path), _processes_under(tmp_path)

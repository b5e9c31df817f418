"""`train --init attention`: the start KV is the whole document's, each layer and KV head keeping
its most attended positions, keys moved to the cartridge's own positions.

The oracles are HF transformers' own: the attention weights a plain eager forward returns
(`output_attentions=True`, one pass), the keys before RoPE as the model's `k_proj` writes them,
and HF's `apply_rotary_pos_emb` at the cartridge's positions.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.tools.selfstudy import init as I
from lmcache_cartridge.tools.selfstudy.config import LoopConfig, SynthConfig, TrainConfig
from lmcache_cartridge.tools.selfstudy.loop import build_student
from lmcache_cartridge.tools.selfstudy.run import export_kv, load_for_training, train_cartridge


@pytest.fixture(scope="module")
def text() -> str:
    from lmcache_cartridge.tools.testmodel import document_text

    return document_text()


def hf_oracle(model, ids: torch.Tensor, tokens: int, first: int = 1) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (kept positions [kvh, tokens], keys [kvh, tokens, hd], values [kvh, tokens, hd])
    from one eager forward with HF's attention weights, pre-RoPE keys and rotary code."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg, n = model.config, ids.shape[1]
    kvh, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    raw = {}
    hooks = [layer.self_attn.k_proj.register_forward_hook(lambda m, a, o, i=i: raw.__setitem__(i, o[0]))
             for i, layer in enumerate(model.model.layers)]
    previous = cfg._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
        for h in hooks:
            h.remove()
    at = torch.arange(tokens)[None]
    cos, sin = model.model.rotary_emb(ids.float(), at)
    result = []
    for i, (weights, layer) in enumerate(zip(out.attentions, out.past_key_values.layers)):
        score = weights[0].sum(1).view(kvh, group, n).sum(1)           # [kvh, keys]
        score[:, :first] = float("inf")
        keep = score.topk(tokens, dim=1).indices.sort(dim=1).values
        pre = raw[i].view(n, kvh, -1).transpose(0, 1)                  # [kvh, n, hd] before RoPE
        # k_norm-free families (Llama, Qwen2): RoPE applies to k_proj's output directly
        gathered = pre.gather(1, keep[..., None].expand(-1, -1, pre.shape[-1]))
        _, keys = apply_rotary_pos_emb(gathered[None], gathered[None], cos, sin)
        values = layer.values[0].gather(1, keep[..., None].expand(-1, -1, pre.shape[-1]))
        result.append((keep, keys[0], values))
    return result


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_attention_start_is_the_most_attended_kv_moved_to_the_cartridges_positions(family, text, monkeypatch):
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    model, tok = load_for_training(ensure_test_model(family=family), torch.device("cpu"), torch.float32)
    ids = I.document_ids(tok, text)[:, :300]
    tokens = 64
    monkeypatch.setattr(I, "PREFILL_CHUNK", 37)  # chunk boundaries inside the document
    before = model.config._attn_implementation
    got = I.attention_kv(model, ids, tokens)
    assert model.config._attn_implementation == before  # eager only while ranking
    want = hf_oracle(model, ids, tokens)
    beyond = 0
    for (keys, values), (keep, want_keys, want_values) in zip(got, want):
        assert keys.shape == values.shape == (1, model.config.num_key_value_heads, tokens, keys.shape[-1])
        torch.testing.assert_close(values[0], want_values, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(keys[0], want_keys, atol=1e-4, rtol=1e-4)
        assert (keep[:, 0] == 0).all()
        beyond += int((keep >= tokens).sum())
    assert beyond > 0, "every layer kept only the first-k positions: not a whole-document start"

    # the first 24 kept whatever their rank, the rest ranked as before
    for (keys, values), (keep, want_keys, want_values) in zip(I.attention_kv(model, ids, tokens, first=24),
                                                             hf_oracle(model, ids, tokens, first=24)):
        assert (keep[:, :24] == torch.arange(24)).all() and (keep[:, 24:] >= 24).all()
        torch.testing.assert_close(values[0], want_values, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(keys[0], want_keys, atol=1e-4, rtol=1e-4)

    # all positions kept, or the first `tokens`: the document's first-k KV, keys unmoved
    with torch.no_grad():
        cache = model(input_ids=ids[:, :tokens], use_cache=True).past_key_values
    for start in (I.attention_kv(model, ids[:, :tokens], tokens), I.attention_kv(model, ids, tokens, first=tokens)):
        for (k, v), layer in zip(start, cache.layers):
            torch.testing.assert_close(k, layer.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(v, layer.values, atol=1e-5, rtol=1e-4)

    with pytest.raises(CartridgeError, match="fewer than the cartridge's 64"):
        I.attention_kv(model, ids[:, :50], tokens)


def test_train_init_attention_starts_there_and_is_its_own_run(text, tmp_path):
    """`--init attention` reaches the student (its start is `attention_kv`'s KV, not first-k's),
    is recorded in provenance, is its own run (a first-k checkpoint is not resumed by it), and
    an unknown init is refused before any work."""
    from lmcache_cartridge.tools.testmodel import ensure_test_model
    from lmcache_cartridge.tools.train import add_train_arguments, config_from_args

    model_dir = ensure_test_model()
    doc = tmp_path / "doc.txt"
    doc.write_text(text)
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    start = export_kv(build_student(model, tok, text, 256, 1, init="attention"))
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    first_k = export_kv(build_student(model, tok, text, 256, 1))
    model, tok = load_for_training(model_dir, torch.device("cpu"), torch.float32)
    kv = I.attention_kv(model, I.document_ids(tok, text), 256)
    want = torch.stack([torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)]) for k, v in kv], dim=1)
    torch.testing.assert_close(start, want)               # [2, L, T, H, D], PEFT's layout
    assert not torch.allclose(start, first_k)
    torch.testing.assert_close(start[:, :, 0], first_k[:, :, 0])  # the sink is the same token

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args(["--model-dir", str(model_dir), "--text", str(doc), "-o", str(tmp_path / "c"),
                              "--init", "attention", "--init-first", "64"])
    assert (config_from_args(args).init, config_from_args(args).init_first) == ("attention", 64)
    cfg = TrainConfig(model_dir=model_dir, text_path=doc, output=tmp_path / "out", tokens=256, conversations=4,
                      heldout=1, synth=SynthConfig(window_min=128, window_max=256, question_tokens=8, answer_tokens=8),
                      loop=LoopConfig(steps=1, batch_size=2, lr=2e-2, eval_every=100, save_every=1), device="cpu",
                      progress=False, synth_backend="hf", kv_dtype="float32")
    attention = replace(cfg, init="attention")
    assert len({cfg.fingerprint(text), attention.fingerprint(text),
                replace(attention, init_first=128).fingerprint(text)}) == 3
    train_cartridge(cfg)
    with pytest.raises(CartridgeError, match="other settings"):
        train_cartridge(replace(cfg, init="attention", overwrite=True, loop=replace(cfg.loop, steps=2)))
    (cfg.work / "checkpoint.pt").unlink()
    trained = replace(cfg, init="attention", overwrite=True)
    train_cartridge(trained)
    provenance = json.loads((trained.output / "manifest.json").read_text())["provenance"]
    assert provenance["init"] == "attention" and provenance["init_first"] == 1
    with pytest.raises(CartridgeError, match="--init 'middle'"):
        train_cartridge(replace(cfg, init="middle", overwrite=True))
    for first in (0, 257):
        with pytest.raises(CartridgeError, match=f"--init-first {first}: give 1"):
            train_cartridge(replace(trained, init_first=first))

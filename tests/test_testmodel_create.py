"""The tiny test model (testmodel.py) and first-k cartridge creation (create.py).

The KV tests check the canonical layout against the model itself: a prefix KV fed back as
`past_key_values` must reproduce a full forward pass, and a mangled layout must not.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from lmcache_cartridge.tools.create import CreatedCartridge, create_first_k, sample_chunks
from lmcache_cartridge.cartridge.model_kv import compute_prefix_kv, kv_geometry, kv_to_cache, load_model
from lmcache_cartridge.errors import CartridgeFormatError
from lmcache_cartridge.tools.testmodel import (MARKER_NAME, PEAK_LM_HEAD_SCALE, PEAK_Q_K_SCALE, QWEN_CHAT_TEMPLATE,
                                               BuildParams, build_tokenizer, document_text, ensure_test_model,
                                               llama_config, qwen2_config)

DEFAULTS = BuildParams(
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=512,
    vocab_size=1024,
    max_position_embeddings=8192,
    seed=0,
)
# Same architecture, short context: for the "document too long" checks.
SHORT_CTX = dict(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128,
                 vocab_size=512, max_position_embeddings=128)


@pytest.fixture(scope="session")
def models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def model_dir(models_root):
    return ensure_test_model(models_root)


@pytest.fixture(scope="session")
def loaded(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="session")
def doc_ids(loaded):
    return loaded[1](document_text())["input_ids"]


@pytest.fixture(scope="session")
def qwen_dir(models_root):
    return ensure_test_model(models_root, family="qwen2")


@pytest.fixture(scope="session")
def qwen(qwen_dir):
    return load_model(qwen_dir)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def family_loaded(request):
    """(model, tokenizer, document ids as the tokenizer encodes it) of each family."""
    model, tok = request.getfixturevalue("loaded" if request.param == "llama" else "qwen")
    return model, tok, tok(document_text())["input_ids"]


def logits(model, ids, past=None):
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=past is not None)
    return out.logits[0].float()


# --- the test model ------------------------------------------------------------------------------


def test_build_is_complete_and_cached(models_root, model_dir):
    assert model_dir == models_root / "tiny-llama"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (model_dir / f).is_file(), f
    marker = model_dir / MARKER_NAME
    assert json.loads(marker.read_text())["seed"] == 0
    before = marker.stat().st_mtime_ns
    assert ensure_test_model(models_root) == model_dir
    assert marker.stat().st_mtime_ns == before
    # Temp build dirs are cleaned up; only the installed model remains.
    assert sorted(p.name for p in models_root.iterdir()) == ["tiny-llama"]


def test_other_params_replace_the_cached_model(tmp_path):
    first = ensure_test_model(tmp_path, name="m", **SHORT_CTX, seed=0)
    weights = (first / "model.safetensors").read_bytes()
    second = ensure_test_model(tmp_path, name="m", **SHORT_CTX, seed=1)
    assert second == first
    assert json.loads((second / MARKER_NAME).read_text())["seed"] == 1
    assert (second / "model.safetensors").read_bytes() != weights
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_bad_params_are_refused(tmp_path):
    with pytest.raises(ValueError, match="divisible"):
        ensure_test_model(tmp_path, hidden_size=250)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ensure_test_model(tmp_path, num_kv_heads=3)


def test_config_matches_params(loaded):
    cfg = loaded[0].config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (256, 2, 4)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (2, 64, 1024)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.tie_word_embeddings) == (1, 2, False)
    assert loaded[0].dtype == torch.bfloat16


def test_tokenizer(loaded):
    tok = loaded[1]
    assert len(tok) == DEFAULTS.vocab_size
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    text = "The keeper wound the clock."
    with_bos = tok(text)["input_ids"]
    without = tok(text, add_special_tokens=False)["input_ids"]
    assert with_bos[0] == 1 and with_bos[1:] == without and 1 not in without
    assert tok.decode(without) == text
    assert max(with_bos) < DEFAULTS.vocab_size
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<s>[user]: Hi\n[assistant]:"


def test_tokenizer_training_is_deterministic(loaded):
    a, b = build_tokenizer(DEFAULTS.vocab_size), build_tokenizer(DEFAULTS.vocab_size)
    assert a.get_vocab() == b.get_vocab() == loaded[1].get_vocab()
    # A vocab the document alone cannot fill falls back to generated filler text.
    assert len(build_tokenizer(2048)) == 2048


def test_attention_and_lm_head_are_peaked(loaded):
    model, tok = loaded
    torch.manual_seed(DEFAULTS.seed)
    fresh = LlamaForCausalLM(llama_config(DEFAULTS)).float().requires_grad_(False)
    ratio = (model.lm_head.weight.float().norm() / fresh.lm_head.weight.norm()).item()
    assert ratio == pytest.approx(PEAK_LM_HEAD_SCALE, rel=1e-3)
    for ours, theirs in zip(model.model.layers, fresh.model.layers):
        for proj in ("q_proj", "k_proj"):
            w = getattr(ours.self_attn, proj).weight.float()
            w0 = getattr(theirs.self_attn, proj).weight
            assert (w.norm() / w0.norm()).item() == pytest.approx(PEAK_Q_K_SCALE, rel=1e-3)
        assert torch.equal(ours.self_attn.v_proj.weight, theirs.self_attn.v_proj.weight.bfloat16())

    # Measured: median top1-top2 gap ~1.0 peaked vs ~0.05 unscaled on this prompt.
    ids = tok("The keeper climbed the tower and lit the lamp")["input_ids"]
    top = logits(model, ids).topk(2, dim=-1).values
    top0 = logits(fresh.bfloat16(), ids).topk(2, dim=-1).values
    gap, gap0 = (top[:, 0] - top[:, 1]).median(), (top0[:, 0] - top0[:, 1]).median()
    assert gap > 0.5
    assert gap > 5 * gap0


# --- canonical KV ----------------------------------------------------------------------------


def test_kv_layout_and_rope(loaded):
    model, _ = loaded
    kv = compute_prefix_kv(model, [1, 500, 500])
    assert kv.shape == (2, 2, 3, 2, 64) and kv.dtype == torch.bfloat16
    # Layer 0 sees only the embedding: V of a repeated token is identical at both positions,
    # while K differs (RoPE already applied, as HF caches it).
    assert torch.equal(kv[1, 0, 1], kv[1, 0, 2])
    assert not torch.allclose(kv[0, 0, 1], kv[0, 0, 2], atol=1e-2)


@pytest.mark.parametrize("n", [1, 37, 400])
def test_prefix_kv_reproduces_full_forward(family_loaded, n):
    model, _, doc_ids = family_loaded
    ids = doc_ids[:500]
    full = logits(model, ids)
    kv = compute_prefix_kv(model, ids[:n])
    assert kv.shape[2] == n
    rest = logits(model, ids[n:], past=kv_to_cache(kv, model.config))
    # Eager CPU attention runs the same bf16 ops either way; we measured exact equality. Allow
    # 2 bf16 ulps at the largest logit (~2^-7 relative) in case kernels split work differently.
    atol = 2 * full.abs().max().item() * 2.0**-8
    torch.testing.assert_close(rest, full[n:], atol=atol, rtol=0)
    assert torch.equal(rest.argmax(-1), full[n:].argmax(-1))


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(lambda kv: kv[:, :, :, [1, 0]], id="kv-heads-swapped"),
        pytest.param(lambda kv: kv.flip(0), id="k-and-v-swapped"),
        pytest.param(lambda kv: kv.flip(1), id="layers-swapped"),
    ],
)
def test_mangled_kv_changes_the_output(family_loaded, mangle):
    """Negative control: a peaked model exposes layout errors, else the test above proves little."""
    model, _, doc_ids = family_loaded
    ids, n = doc_ids[:500], 400
    full = logits(model, ids)[n:]
    kv = mangle(compute_prefix_kv(model, ids[:n])).contiguous()
    bad = logits(model, ids[n:], past=kv_to_cache(kv, model.config))
    agree = (bad.argmax(-1) == full.argmax(-1)).float().mean().item()
    assert agree < 0.5, f"argmax agreed on {agree:.0%} of positions despite a mangled KV"
    assert (bad - full).abs().mean() > 1.0


def test_compute_prefix_kv_refuses_bad_input(loaded):
    with pytest.raises(CartridgeFormatError, match="empty"):
        compute_prefix_kv(loaded[0], [])
    with pytest.raises(CartridgeFormatError, match="max_position_embeddings"):
        compute_prefix_kv(loaded[0], [1] * (DEFAULTS.max_position_embeddings + 1))


def test_load_model_refuses_a_non_model_dir(tmp_path):
    with pytest.raises(CartridgeFormatError, match="config.json"):
        load_model(tmp_path)


# --- create_first_k ------------------------------------------------------------------------------


def test_first_k(model_dir, loaded, doc_ids):
    c = create_first_k(model_dir, document_text(), max_tokens=100, model_and_tokenizer=loaded)
    assert isinstance(c, CreatedCartridge)
    assert c.token_ids == doc_ids[:100] and c.token_ids[0] == 1
    assert c.kv.shape == (2, 2, 100, 2, 64) and c.kv.dtype == torch.bfloat16
    assert torch.equal(c.kv, compute_prefix_kv(loaded[0], c.token_ids))
    p = c.provenance
    assert (p["method"], p["max_tokens"], p["sci_chunk"]) == ("first_k", 100, None)
    assert p["num_tokens"] == 100
    assert p["model_dir"] == str(model_dir) and len(p["source_sha256"]) == 64
    assert p["transformers_version"]


def test_first_k_whole_document_loading_the_model_itself(model_dir, doc_ids):
    c = create_first_k(model_dir, document_text())
    assert c.token_ids == doc_ids and c.kv.shape[2] == len(doc_ids)


def test_sci(model_dir, loaded, doc_ids):
    def make(seed):
        return create_first_k(model_dir, document_text(), max_tokens=120, sci_chunk=16, seed=seed,
                              model_and_tokenizer=loaded)

    a, a2, b = make(0), make(0), make(1)
    assert a.token_ids == a2.token_ids and torch.equal(a.kv, a2.kv)
    assert a.token_ids != b.token_ids
    for c in (a, b):
        assert len(c.token_ids) == 120 and c.token_ids[0] == 1 and c.kv.shape[2] == 120
        assert c.provenance["method"] == "sci"
        # The tokens are exactly the recorded document spans, in order.
        spans = c.provenance["sci_spans"]
        assert c.token_ids[1:] == [t for s, e in spans for t in doc_ids[1 + s : 1 + e]]
        assert c.token_ids != doc_ids[:120]
        assert torch.equal(c.kv, compute_prefix_kv(loaded[0], c.token_ids))


@pytest.mark.parametrize(
    "body,budget,chunk", [(100, 30, 7), (100, 99, 4), (50, 50, 8), (1000, 64, 64), (10, 9, 4)]
)
def test_sample_chunks(body, budget, chunk):
    for seed in range(20):
        spans = sample_chunks(body, budget, chunk, seed)
        assert sum(e - s for s, e in spans) == min(body, budget)
        assert all(0 <= s < e <= body for s, e in spans)
        if body > budget:
            assert all(e - s <= chunk for s, e in spans)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))


def test_create_refuses_bad_input(model_dir, loaded):
    kw = dict(model_and_tokenizer=loaded)
    for text in ("", "  \n"):
        with pytest.raises(CartridgeFormatError, match="empty"):
            create_first_k(model_dir, text, **kw)
    for max_tokens in (1, 0, -5):
        with pytest.raises(CartridgeFormatError, match="max_tokens"):
            create_first_k(model_dir, "some text", max_tokens=max_tokens, **kw)
    with pytest.raises(CartridgeFormatError, match="sci_chunk needs max_tokens"):
        create_first_k(model_dir, "some text", sci_chunk=8, **kw)
    with pytest.raises(CartridgeFormatError, match="sci_chunk"):
        create_first_k(model_dir, "some text", max_tokens=10, sci_chunk=0, **kw)


def test_document_longer_than_context(tmp_path):
    short = ensure_test_model(tmp_path, name="short", **SHORT_CTX)
    text = document_text()
    with pytest.raises(CartridgeFormatError, match="max_position_embeddings"):
        create_first_k(short, text)
    with pytest.raises(CartridgeFormatError, match="max_position_embeddings"):
        create_first_k(short, text, max_tokens=10_000)
    # Keeping a part that fits is allowed: that is what max_tokens and SCI are for.
    assert create_first_k(short, text, max_tokens=128).kv.shape[2] == 128
    assert create_first_k(short, text, max_tokens=64, sci_chunk=8).kv.shape[2] == 64


# --- the Qwen2 family: no BOS, attention biases, tied embeddings, ChatML ----------------------


def test_qwen2_is_shaped_like_qwen2(qwen_dir, qwen):
    from transformers import Qwen2ForCausalLM

    model, tok = qwen
    assert isinstance(model, Qwen2ForCausalLM) and model.dtype == torch.bfloat16
    cfg = json.loads((qwen_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["tie_word_embeddings"] is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for layer in model.model.layers:  # the biases exist and are not HF's zero init
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert getattr(layer.self_attn, proj).bias.float().std() > 0.3
        assert layer.self_attn.o_proj.bias is None
    # the tokenizer adds no BOS, although the config names one (as Qwen's configs do)
    assert tok.bos_token is None and cfg["bos_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
    text = "The keeper wound the clock."
    assert tok(text)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.chat_template == QWEN_CHAT_TEMPLATE
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> first, two <|im_end|>: special tokens


def test_qwen2_attention_and_logits_are_peaked(qwen):
    from transformers import Qwen2ForCausalLM

    model, tok = qwen
    params = BuildParams(**{**DEFAULTS.__dict__, "family": "qwen2"})
    torch.manual_seed(params.seed)
    fresh = Qwen2ForCausalLM(qwen2_config(params)).float().requires_grad_(False)
    assert torch.equal(model.model.embed_tokens.weight, fresh.model.embed_tokens.weight.bfloat16())
    ratio = (model.model.norm.weight.float().norm() / fresh.model.norm.weight.norm()).item()
    assert ratio == pytest.approx(PEAK_LM_HEAD_SCALE, rel=1e-3)
    ids = tok("The keeper climbed the tower and lit the lamp")["input_ids"]
    top = logits(model, ids).topk(2, dim=-1).values
    top0 = logits(fresh.bfloat16(), ids).topk(2, dim=-1).values
    gap, gap0 = (top[:, 0] - top[:, 1]).median(), (top0[:, 0] - top0[:, 1]).median()
    assert gap > 0.5 and gap > 5 * gap0


def test_create_without_bos_starts_with_the_document(qwen_dir, qwen):
    """Qwen2's tokenizer prepends nothing: the cartridge is the document's own tokens (the old
    `create` refused such a tokenizer)."""
    model, tok = qwen
    plain = tok(document_text(), add_special_tokens=False)["input_ids"]
    c = create_first_k(qwen_dir, document_text(), max_tokens=100, model_and_tokenizer=qwen)
    assert c.token_ids == plain[:100]
    assert c.provenance["leading_special_ids"] == [] and c.provenance["source_num_tokens"] == len(plain)
    assert torch.equal(c.kv, compute_prefix_kv(model, c.token_ids))
    assert c.kv.shape == (2, 2, 100, 2, 64)
    s = create_first_k(qwen_dir, document_text(), max_tokens=120, sci_chunk=16, seed=3, model_and_tokenizer=qwen)
    assert len(s.token_ids) == 120
    assert s.token_ids == [t for a, b in s.provenance["sci_spans"] for t in plain[a:b]]


def test_create_with_bos_keeps_it_first(model_dir, loaded):
    c = create_first_k(model_dir, document_text(), max_tokens=50, model_and_tokenizer=loaded)
    assert c.provenance["leading_special_ids"] == [loaded[1].bos_token_id] == c.token_ids[:1]


def test_explicit_head_dim(tmp_path):
    """A config whose head_dim is not hidden_size / num_heads (as Llama 3 and Qwen3 allow)."""
    d = ensure_test_model(tmp_path, name="hd32", head_dim=32, **SHORT_CTX | {"hidden_size": 128, "num_heads": 2})
    model, tok = load_model(d)
    assert json.loads((d / "config.json").read_text())["head_dim"] == 32
    geo = kv_geometry(model.config)
    assert (geo.num_layers, geo.num_kv_heads, geo.head_dim) == (1, 1, 32) and 128 // 2 != 32
    c = create_first_k(d, document_text(), max_tokens=40, model_and_tokenizer=(model, tok))
    assert c.kv.shape == (2, 1, 40, 1, 32)
    ids = tok(document_text())["input_ids"][:60]
    rest = logits(model, ids[40:], past=kv_to_cache(c.kv, model.config))
    assert torch.equal(rest.argmax(-1), logits(model, ids)[40:].argmax(-1))
    with pytest.raises(ValueError, match="head_dim is a Llama-family option"):
        ensure_test_model(tmp_path, family="qwen2", head_dim=32)


def test_kv_geometry_of_each_family(qwen, loaded):
    assert kv_geometry(qwen[0].config) == kv_geometry(loaded[0].config)  # same sizes, both families
    assert kv_geometry(loaded[0].config).head_dim == 64


def test_default_marker_is_unchanged_by_the_family_options(model_dir):
    """Models cached before the family/head_dim options stay valid (no rebuild)."""
    marker = json.loads((model_dir / MARKER_NAME).read_text())
    assert "family" not in marker and "head_dim" not in marker

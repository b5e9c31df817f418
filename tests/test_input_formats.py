"""Every input format, written the way its maker writes it (tests/cartridge_makers.py), converts
to KV equal to the maker's tensors bit for bit; PEFT's own model is the oracle for the PEFT
layout; unsafe pickles stay refused, ParameterList or not; model names are checked."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from cartridge_makers import (htd_list, make_peft_adapter, saved_as_if_on_cuda, trainable_cache_state,
                              write_cartridges_run, write_knlp_dir, write_tokasaurus_dir)
from conftest import random_kv
from lmcache_cartridge.cartridge.formats import load_input
from lmcache_cartridge.errors import CartridgeFormatError

L, T, H, D = 3, 48, 2, 8


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# --- HazyResearch/cartridges TrainableCache.save() ---------------------------------------------
@pytest.mark.parametrize("names", ["frozen", "fixed"])
@pytest.mark.parametrize("frozen,empty", [(1, None), (5, None), (0, "parameterlist"), (0, "none"), (0, "list")])
def test_trainable_cache_checkpoint_bit_exact(tmp_path, names, frozen, empty):
    kv = random_kv(L, T, H, D, seed=frozen)
    path = tmp_path / "cache-step64.pt"
    torch.save(trainable_cache_state(kv, frozen, names=names, empty=empty or "parameterlist"), path)
    if frozen or empty == "parameterlist":  # the file really pickles ParameterLists
        with pytest.raises(pickle.UnpicklingError, match="ParameterList"):
            torch.load(path, weights_only=True)
    loaded = load_input(path)
    assert loaded.source_format == "cartridges" and loaded.token_ids is None
    assert loaded.num_frozen_tokens == frozen
    assert bit_equal(loaded.kv, kv)  # frozen tokens first, then trainable, per layer and head
    assert loaded.suggested_id == f"{tmp_path.name}-step64"


def test_checkpoint_saved_on_cuda_loads_on_cpu(tmp_path):
    kv = random_kv(L, T, H, D, seed=9)
    path = tmp_path / "cache-step1.pt"
    with saved_as_if_on_cuda():
        torch.save(trainable_cache_state(kv, 1), path)
    with torch.serialization.safe_globals([torch.nn.ParameterList]), pytest.raises(RuntimeError, match="CUDA"):
        torch.load(path, weights_only=True)  # proves the file is CUDA-tagged
    assert bit_equal(load_input(path).kv, kv)


def test_training_run_names_and_symlink(tmp_path):
    kv = random_kv(L, T, H, D, seed=4)
    run = tmp_path / "run-abc"
    link = write_cartridges_run(run, kv, [128, 256])
    for p in (link, run):  # cache_last.pt, or the run directory itself
        loaded = load_input(p)
        assert bit_equal(loaded.kv, kv) and loaded.suggested_id == "run-abc-step256"


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_with_parameterlist_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    kv = random_kv(L, T, H, D)
    state = trainable_cache_state(kv, 1)
    cases = {"beside": {**state, "note": Evil(marker)}}
    inside = trainable_cache_state(kv, 1)
    inside["trainable_keys"].__dict__["extra"] = Evil(marker)  # inside the ParameterList's own state
    cases["inside"] = inside
    for name, obj in cases.items():
        path = tmp_path / f"{name}.pt"
        torch.save(obj, path)
        with pytest.raises(CartridgeFormatError, match="refused to load.*posix.system|refused to load.*os.system"):
            load_input(path)
        assert not marker.exists(), name


def test_trainable_cache_malformed(tmp_path):
    kv = random_kv(L, T, H, D)
    bad = {
        "frozen_layers_differ": {**trainable_cache_state(kv, 1),
                                 "frozen_keys": trainable_cache_state(kv, 1)["frozen_keys"][:2],
                                 "frozen_values": trainable_cache_state(kv, 1)["frozen_values"][:2]},
        "frozen_heads_differ": {**trainable_cache_state(kv, 1),
                                "frozen_keys": [t[:, :1] for t in htd_list(kv, 0)],
                                "frozen_values": [t[:, :1] for t in htd_list(kv, 1)]},
        "only_frozen_keys": {"trainable_keys": htd_list(kv, 0), "trainable_values": htd_list(kv, 1),
                             "frozen_keys": htd_list(kv, 0)},
        "all_empty": {"trainable_keys": [], "trainable_values": [], "frozen_keys": [], "frozen_values": []},
    }
    for name, obj in bad.items():
        path = tmp_path / f"{name}.pt"
        torch.save(obj, path)
        with pytest.raises(CartridgeFormatError):
            load_input(path)


# --- Tokasaurus ---------------------------------------------------------------------------------
@pytest.mark.parametrize("wandb_style", [False, True])
def test_tokasaurus_dir_bit_exact_and_model_checked(tmp_path, wandb_style):
    kv = random_kv(L, T, H, D, seed=2)
    d = write_tokasaurus_dir(tmp_path / "my-cart", kv, model="meta-llama/Llama-3.2-3B-Instruct",
                             wandb_style=wandb_style)
    for p in (d, d / "cartridge.pt"):
        loaded = load_input(p)
        assert loaded.source_format == "tokasaurus" and bit_equal(loaded.kv, kv)
        assert loaded.base_model == "meta-llama/Llama-3.2-3B-Instruct" and loaded.num_frozen_tokens == 1
        assert loaded.suggested_id == "my-cart"
    # the same model named by a local path ending in the hub id passes; another model is refused
    for same in ("/models/meta-llama/Llama-3.2-3B-Instruct", "/models/Llama-3.2-3B-Instruct/"):
        assert load_input(d, expected_model=same).kv is not None
    with pytest.raises(CartridgeFormatError, match=r"made for model 'meta-llama/Llama-3.2-3B-Instruct'.*"
                                                   r"Llama-3.1-8B.*--allow-model-mismatch"):
        load_input(d, expected_model="meta-llama/Llama-3.1-8B-Instruct")


def test_tokasaurus_max_tokens_must_match(tmp_path):
    d = write_tokasaurus_dir(tmp_path / "c", random_kv(L, T, H, D), model="m", max_tokens=T + 16)
    with pytest.raises(CartridgeFormatError, match=f"max_tokens={T + 16}.*{T} tokens"):
        load_input(d)
    (d / "config.yaml").write_text("model: {}\n")
    with pytest.raises(CartridgeFormatError, match="max_tokens is missing"):
        load_input(d)


# --- list[(k, v)] + prefix_token_ids.json ------------------------------------------------------------
def test_kv_pairs_with_prefix_token_ids(tmp_path):
    kv = random_kv(L, T, H, D, seed=6)
    ids = list(range(100, 100 + T))
    d = write_knlp_dir(tmp_path / "k", kv, ids, model="Qwen/Qwen2.5-7B-Instruct")
    for p in (d, d / "cartridge.pt"):
        loaded = load_input(p)
        assert loaded.source_format == "kv_pairs+prefix_token_ids"
        assert bit_equal(loaded.kv, kv) and loaded.token_ids == ids
        assert loaded.base_model == "Qwen/Qwen2.5-7B-Instruct"
    (d / "prefix_token_ids.json").write_text(json.dumps(ids[:-1] + [7]))
    with pytest.raises(CartridgeFormatError, match="prefix_token_ids_sha256"):
        load_input(d)
    (d / "meta.json").unlink()
    (d / "prefix_token_ids.json").write_text(json.dumps(ids[:-1]))
    with pytest.raises(CartridgeFormatError, match=f"{T} tokens of KV but prefix_token_ids.json has {T - 1}"):
        load_input(d)
    (d / "prefix_token_ids.json").unlink()
    alone = load_input(d / "cartridge.pt")  # no ids: a trained KV
    assert alone.source_format == "kv_pairs" and alone.token_ids is None and bit_equal(alone.kv, kv)


# --- PEFT CARTRIDGE adapters --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    return ensure_test_model()


def fresh_model(model_dir):
    from lmcache_cartridge.cartridge.model_kv import load_model

    return load_model(model_dir)[0]


@pytest.mark.parametrize("frozen", [0, 1, 3])
def test_peft_adapter_bit_exact_against_peft_get_prompt(tmp_path, tiny, frozen):
    from lmcache_cartridge.cartridge.model_kv import cache_to_kv
    from safetensors.torch import load_file

    pm = make_peft_adapter(
        fresh_model(tiny), tmp_path / "ad", num_virtual_tokens=16, num_frozen_tokens=frozen, seed=frozen
    )
    loaded = load_input(tmp_path / "ad")
    assert loaded.source_format == "peft" and loaded.num_frozen_tokens == frozen and loaded.token_ids is None
    assert loaded.base_model == str(tiny)
    emb = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))["prompt_embeddings"]
    assert loaded.kv.dtype == emb.dtype == torch.float32 and loaded.kv.shape == (2, 2, 16, 2, 64)
    # the maker's own view: PEFT's get_prompt builds the past_key_values the model attends to
    with torch.no_grad():
        ref = cache_to_kv(pm.get_prompt(batch_size=1))
    assert bit_equal(loaded.kv.to(ref.dtype), ref)
    # and every stored value is used exactly once
    assert torch.equal(torch.sort(loaded.kv.flatten()).values, torch.sort(emb.flatten()).values)


def test_peft_model_forward_is_the_oracle(tmp_path, tiny):
    """PEFT's own PeftModel forward with the adapter vs HF's plain model given our converted KV as
    past_key_values (positions offset by its length): the same logits (bf16 noise); K/V or layers
    swapped are far off."""
    from lmcache_cartridge.cartridge.model_kv import kv_to_cache

    p = 32
    pm = make_peft_adapter(fresh_model(tiny), tmp_path / "ad", num_virtual_tokens=p, num_frozen_tokens=1,
                           seed=11, scale=2.0)
    kv = load_input(tmp_path / "ad").kv.to(torch.bfloat16)
    base = fresh_model(tiny)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, base.config.vocab_size, (1, 24), generator=g)
    with torch.inference_mode():
        peft_logits = pm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()

        def ours(kv_):
            pos = torch.arange(p, p + ids.shape[1]).unsqueeze(0)
            return base(input_ids=ids, past_key_values=kv_to_cache(kv_, base.config), position_ids=pos).logits.float()

        got = ours(kv)
        kv_swapped = kv.flip(0)            # K and V exchanged
        layers_swapped = kv.flip(1)        # layer 0 <-> layer 1
        neg = [ours(kv_swapped), ours(layers_swapped)]
    d = (got - peft_logits).abs().max().item()
    d_neg = [(n - peft_logits).abs().mean().item() for n in neg]
    print(f"\n[peft oracle] max |dlogit| ours vs PEFT {d:.4f}; negatives mean |dlogit| {d_neg}")
    assert got.argmax(-1).tolist() == peft_logits.argmax(-1).tolist()
    assert d <= 0.05
    assert min(d_neg) >= 1.0


def test_peft_adapter_errors(tmp_path, tiny):
    make_peft_adapter(fresh_model(tiny), tmp_path / "ad", num_virtual_tokens=8, num_frozen_tokens=1)
    with pytest.raises(CartridgeFormatError, match="made for model.*--allow-model-mismatch"):
        load_input(tmp_path / "ad", expected_model="other-model")
    assert load_input(tmp_path / "ad", expected_model=str(tiny) + "/").kv is not None
    cfg_path = tmp_path / "ad" / "adapter_config.json"
    good = json.loads(cfg_path.read_text())
    for change, match in [({"peft_type": "LORA"}, "only CARTRIDGE"),
                          ({"num_virtual_tokens": 9}, r"shape \(8, 512\).*\[9, 2 layers"),
                          ({"num_frozen_tokens": 9}, "inconsistent geometry"),
                          ({"num_transformer_submodules": 2}, "encoder-decoder")]:
        cfg_path.write_text(json.dumps({**good, **change}))
        with pytest.raises(CartridgeFormatError, match=match):
            load_input(tmp_path / "ad")
    cfg_path.write_text(json.dumps(good))
    (tmp_path / "ad" / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CartridgeFormatError, match="safetensors"):
        load_input(tmp_path / "ad")


def test_directory_that_is_no_cartridge(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(CartridgeFormatError, match="not a cartridge directory"):
        load_input(tmp_path)


# --- `lmcache-cartridge pack` / `inspect` ---------------------------------------------------------------
def run_cli(capsys, *argv) -> tuple[int, str, str]:
    from lmcache_cartridge.tools.cli import main

    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_pack_and_inspect_every_format(tmp_path, tiny, capsys):
    """`inspect` says which format an input is read as; `pack` reads it and the manifest's
    provenance records the format and the base model; the packed KV is the input's, bit for bit."""
    from lmcache_cartridge.cartridge.packed import PackedCartridge

    C = 16
    kv = random_kv(2, 2 * C, 2, 64, seed=21)
    ids = list(range(10, 10 + 2 * C))
    pt = tmp_path / "run" / "cache-step7.pt"
    pt.parent.mkdir()
    torch.save(trainable_cache_state(kv, 1), pt)
    inputs = {
        "cartridges": (pt, None, "run-step7"),
        "tokasaurus": (write_tokasaurus_dir(tmp_path / "toka", kv, model=str(tiny)), str(tiny), "toka"),
        "kv_pairs+prefix_token_ids": (write_knlp_dir(tmp_path / "knlp", kv, ids, model=str(tiny)), str(tiny), "knlp"),
    }
    make_peft_adapter(fresh_model(tiny), tmp_path / "peft-ad", num_virtual_tokens=2 * C, num_frozen_tokens=1)
    peft_kv = load_input(tmp_path / "peft-ad").kv
    inputs["peft"] = (tmp_path / "peft-ad", str(tiny), "peft-ad")
    for fmt, (src, base, cid) in inputs.items():
        rc, out, _ = run_cli(capsys, "inspect", src)
        assert rc == 0 and f"read as                       {fmt}: " in out, out
        assert (base or "- (not recorded") in out
        info = json.loads(run_cli(capsys, "inspect", "--json", src)[1])
        assert info["read_as"] == fmt and info["base_model"] == base and info["num_tokens"] == 2 * C
        rc, out, err = run_cli(capsys, "pack", src, "-o", tmp_path / f"p-{fmt}", "--model", str(tiny),
                               "--model-dir", tiny, "--chunk-size", C, "-q")
        assert rc == 0, err
        assert f"read {src} as {fmt}" in out and f"packed {cid} (" in out
        p = PackedCartridge(tmp_path / f"p-{fmt}")
        m = p.manifest
        assert m.provenance["source_format"] == fmt and m.provenance.get("base_model") == base
        assert m.kind == ("first_k" if fmt == "kv_pairs+prefix_token_ids" else "trained")
        if fmt == "peft":  # fp32 adapter packed in the model's dtype, as PEFT casts it
            assert m.dtype == "bfloat16" and m.provenance["converted_from_dtype"] == "float32"
            assert bit_equal(p.load_kv(), peft_kv.to(torch.bfloat16))
        else:
            assert bit_equal(p.load_kv(), kv)
        if fmt in ("cartridges", "tokasaurus", "peft"):
            assert m.provenance["num_frozen_tokens"] == 1
        rc, out, _ = run_cli(capsys, "inspect", tmp_path / f"p-{fmt}")
        assert rc == 0 and f"read as                       {fmt}" in out
    rc, _, err = run_cli(capsys, "pack", tmp_path / "toka", "-o", tmp_path / "x", "--model", "another/model",
                         "--vocab-size", 1024, "-q")
    assert rc == 2 and "made for model" in err and "--allow-model-mismatch" in err
    assert not (tmp_path / "x").exists()


# --- bounded fuzzing of the makers' side files -------------------------------------------------------------
def test_side_files_fuzzed_give_clear_errors(tmp_path, tiny):
    """adapter_config.json, config.yaml, meta.json and prefix_token_ids.json with arbitrary values:
    the answer is a cartridge or a CartridgeFormatError, never another exception."""
    import yaml
    from hypothesis import HealthCheck, given, settings, strategies as st

    values = st.recursive(
        st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=8)
    kv = random_kv(2, 16, 2, 64, seed=3)
    make_peft_adapter(fresh_model(tiny), tmp_path / "ad", num_virtual_tokens=16)
    write_tokasaurus_dir(tmp_path / "toka", kv, model="m")
    write_knlp_dir(tmp_path / "knlp", kv, list(range(16)), model="m")
    files = {"ad/adapter_config.json": json, "toka/config.yaml": yaml, "knlp/meta.json": json}
    originals = {name: (tmp_path / name).read_text() for name in files}

    @settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def check(data):
        name = data.draw(st.sampled_from(sorted(files) + ["knlp/prefix_token_ids.json"]))
        path = tmp_path / name
        if name.endswith("prefix_token_ids.json"):
            path.write_text(json.dumps(data.draw(values)))
        else:
            doc = json.loads(originals[name]) if name.endswith(".json") else yaml.safe_load(originals[name])
            keys = sorted(doc) + ["kv_cache_initializer.max_tokens", "model.pretrained_model_name_or_path"]
            key = data.draw(st.sampled_from(keys))
            if "." in key and isinstance(doc.get(key.split(".")[0]), dict):
                doc[key.split(".")[0]][key.split(".")[1]] = data.draw(values)
            else:
                doc[key] = data.draw(values)
            text = json.dumps(doc) if name.endswith(".json") else yaml.safe_dump(doc)
            path.write_text(text)
        try:
            load_input(path.parent, expected_model=data.draw(st.none() | st.text(max_size=8)))
        except CartridgeFormatError:
            pass
        finally:
            path.write_text(originals.get(name, json.dumps(list(range(16)))))

    check()


@pytest.mark.parametrize("shape", ["zero_stride", "repeated_view", "shared_tuple"])
def test_small_file_of_huge_views_is_refused_before_materialising(tmp_path, shape):
    """torch.save keeps sizes and strides: a ~1.5 KB file can hold a [2, 4, 2**20, 8, 64] view of
    one element (zero strides), which the first `.contiguous()` would turn into 8 GiB; or one small
    storage viewed a thousand times, by a thousand tuples of their own or by one tuple the pickle
    names a thousand times. Refused with the reason, nothing allocated."""
    import resource

    from lmcache_cartridge.errors import CartridgeFormatError
    from lmcache_cartridge.cartridge.formats import load_input

    if shape == "zero_stride":
        kv = torch.zeros(1, dtype=torch.bfloat16).expand(2, 4, 2 ** 20, 8, 64)
        obj = {"token_ids": list(range(8)), "kv_cache": kv}
        needle = "zero strides"
    elif shape == "repeated_view":
        base = torch.randn(2, 1, 256, 2, 16).to(torch.bfloat16)
        obj = [(base[0], base[1]) for _ in range(1000)]
        needle = "more than the file"
    else:
        base = torch.randn(2, 1, 256, 2, 16).to(torch.bfloat16)
        obj = [(base[0], base[1])] * 1000
        needle = "referenced more than once"
    torch.save(obj, tmp_path / "bomb.pt")
    assert (tmp_path / "bomb.pt").stat().st_size < 600_000
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CartridgeFormatError, match=needle):
        load_input(tmp_path / "bomb.pt")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 1 << 20  # KiB: under 1 GiB more


# --- the token-ids-and-KV dict (`kv_cache_dict`, earlier `seed000`) ------------------------------------------
def test_kv_cache_dict_is_read_packed_and_inspected_under_its_name_and_its_earlier_one(tmp_path, tiny, capsys):
    """A `{'token_ids', 'kv_cache', 'metadata'}` `.pt` is read as `kv_cache_dict` (bit for bit,
    first-k), `inspect` and `pack` say so; `seed000`, the name manifests packed before the rename
    record, is accepted as the same format."""
    from lmcache_cartridge.cartridge.inputs import FORMATS, LoadedCartridge, canonical_format, describe
    from lmcache_cartridge.cartridge.packed import PackedCartridge

    C = 16
    kv = random_kv(2, 2 * C, 2, 64, seed=5)
    ids = list(range(10, 10 + 2 * C))
    src = tmp_path / "doc.pt"
    torch.save({"token_ids": ids, "kv_cache": {f"model.layers.{i}": kv[:, i].permute(0, 2, 1, 3).contiguous()
                                               for i in range(kv.shape[1])}, "metadata": {"note": "x"}}, src)
    loaded = load_input(src)
    assert loaded.source_format == "kv_cache_dict" and loaded.token_ids == ids and bit_equal(loaded.kv, kv)
    rc, out, _ = run_cli(capsys, "inspect", src)
    assert rc == 0 and "read as                       kv_cache_dict: dict {'token_ids', 'kv_cache', 'metadata'}" in out
    assert "seed" not in out
    rc, out, err = run_cli(capsys, "pack", src, "-o", tmp_path / "p", "--model", str(tiny), "--chunk-size", C, "-q")
    assert rc == 0 and f"read {src} as kv_cache_dict" in out, err
    m = PackedCartridge(tmp_path / "p").manifest
    assert m.provenance["source_format"] == "kv_cache_dict" and m.kind == "first_k"
    assert bit_equal(PackedCartridge(tmp_path / "p").load_kv(), kv)
    # the earlier name
    for name in ("kv_cache_dict", "seed000"):
        assert canonical_format(name) == "kv_cache_dict"
        old = LoadedCartridge(kv=loaded.kv, token_ids=ids, source_format=name)
        assert describe(old)["description"] == FORMATS["kv_cache_dict"]
    assert canonical_format("peft") == "peft" and canonical_format(None) is None
    assert "seed000" not in FORMATS

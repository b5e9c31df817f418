"""`create`'s options for real documents: the output directory is checked before any compute,
`--device` picks where the HF model runs, and the prefix KV is prefilled in chunks so that eager
attention never builds a `[heads, n, n]` score matrix.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lmcache_cartridge.cartridge.model_kv import compute_prefix_kv, load_model, resolve_device
from lmcache_cartridge.cartridge.packed import PackedCartridge, check_output_dir, pack_kv
from lmcache_cartridge.errors import CartridgeError, CartridgeFormatError
from lmcache_cartridge.tools import cli, create
from lmcache_cartridge.tools.create import create_first_k
from lmcache_cartridge.tools.testmodel import document_text, ensure_test_model

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


@pytest.fixture(scope="module")
def models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


PREFIX_TOKENS = 320


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, models_root):
    """(model dir, model, document ids) of each test-model family: the document's first
    PREFIX_TOKENS ids, which every chunk size below splits into several chunks (a token-by-token
    prefill of the whole 679-token document alone took minutes)."""
    model_dir = ensure_test_model(models_root, family=request.param)
    model, tok = load_model(model_dir)
    return model_dir, model, tok(document_text())["input_ids"][:PREFIX_TOKENS]


@pytest.fixture(scope="module")
def llama_dir(models_root):
    return ensure_test_model(models_root)


# --- the output directory, before the forward pass ------------------------------------------------
def _pack_tiny(out: Path, overwrite: bool) -> None:
    kv = torch.zeros(2, 1, 4, 1, 8, dtype=torch.bfloat16)
    pack_kv(kv, out, cartridge_id="probe", model="m", kind="first_k", token_ids=[1, 2, 3, 4], overwrite=overwrite)


def _refuses(fn) -> bool:
    try:
        fn()
    except (CartridgeError, OSError):
        return True
    return False


def _output_cases(tmp_path: Path) -> list[tuple[str, Path, bool]]:
    (tmp_path / "taken").mkdir()
    (tmp_path / "a_file").write_text("x")
    cases = [("fresh, parents missing", tmp_path / "new" / "deeper" / "c", False),
             ("exists", tmp_path / "taken", False),
             ("exists, --overwrite", tmp_path / "taken", True),
             ("parent is a file", tmp_path / "a_file" / "c", False),
             ("ancestor is a file", tmp_path / "a_file" / "x" / "c", False)]
    if not ROOT:  # root writes into a read-only directory: no refusal to compare
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        cases += [("parent not writable", locked / "c", False), ("missing under unwritable", locked / "x" / "c", False)]
    return cases


def test_output_check_agrees_with_what_pack_kv_does(tmp_path):
    """`check_output_dir` refuses exactly the directories `pack_kv` then fails to write, and
    leaves nothing behind (pack creates missing parents: so does not the check, it only probes)."""
    for name, out, overwrite in _output_cases(tmp_path):
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        early = _refuses(lambda: check_output_dir(out, overwrite))  # noqa: B023 (called in this iteration)
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, name
        late = _refuses(lambda: _pack_tiny(out, overwrite))  # noqa: B023 (called in this iteration)
        assert early == late, (
            f"{name}: the check {'refuses' if early else 'accepts'}, pack_kv {'fails' if late else 'writes'}"
        )


@pytest.mark.parametrize("kv_from", ["hf", "vllm"])
def test_bad_output_fails_before_the_model_is_loaded(tmp_path, llama_dir, monkeypatch, capsys, kv_from):
    """A bad -o ends in one error and exit 2 without loading the model or starting vLLM."""
    from lmcache_cartridge.tools import engine_kv

    def never(*a, **k):
        raise AssertionError("the model was loaded before the output directory was checked")

    monkeypatch.setattr(create, "load_model", never)
    monkeypatch.setattr(engine_kv, "EngineKVMaker", never)
    doc = tmp_path / "doc.txt"
    doc.write_text(document_text())
    (tmp_path / "taken").mkdir()
    (tmp_path / "a_file").write_text("x")
    for out, needle in [(tmp_path / "taken", "already exists"), (tmp_path / "a_file" / "c", "is a file")]:
        rc = cli.main(["create", "--model-dir", str(llama_dir), "--text", str(doc), "-o", str(out),
                       "--kv-from", kv_from, "-q"])
        err = capsys.readouterr().err
        assert rc == 2 and needle in err and str(out) in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_bad_output_fails_fast_with_a_model_that_cannot_load(tmp_path):
    """The same through the console script, with a model directory that would fail to load: the
    error names the output, so the model was never read."""
    from test_cli import cli as run_cli

    bad_model = tmp_path / "model"
    bad_model.mkdir()
    (bad_model / "config.json").write_text("{not json")
    doc = tmp_path / "doc.txt"
    doc.write_text(document_text())
    (tmp_path / "taken").mkdir()
    r = run_cli("create", "--model-dir", bad_model, "--text", doc, "-o", tmp_path / "taken", "--kv-from", "hf",
                home=tmp_path, check=False)
    assert r.returncode == 2 and "already exists" in r.stderr, r.stderr


# --- --device -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,needle", [("gpu", "not a torch device"), ("cuda:x", "not a torch device"),
                                         ("meta", "only cpu and cuda")])
def test_bad_device_strings_are_refused(name, needle):
    with pytest.raises(CartridgeError, match=needle):
        resolve_device(name)


def test_device_cpu_is_the_default():
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where CUDA is missing")
def test_cuda_without_cuda_says_so(tmp_path, llama_dir, monkeypatch, capsys):
    with pytest.raises(CartridgeError, match="CUDA is not available"):
        resolve_device("cuda:1")
    monkeypatch.setattr(create, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    doc = tmp_path / "doc.txt"
    doc.write_text(document_text())
    rc = cli.main(["create", "--model-dir", str(llama_dir), "--text", str(doc), "-o", str(tmp_path / "c"),
                   "--kv-from", "hf", "--device", "cuda", "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and "CUDA is not available" in err and "--device cpu" in err, err
    assert not (tmp_path / "c").exists()


def test_device_and_prefill_chunk_are_for_hf_only(tmp_path, llama_dir, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text(document_text())
    for extra in (["--device", "cpu"], ["--prefill-chunk", "64"]):
        rc = cli.main(["create", "--model-dir", str(llama_dir), "--text", str(doc), "-o", str(tmp_path / "c"),
                       "--kv-from", "vllm", *extra])
        assert rc == 2 and "--kv-from hf" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kv_matches_cpu_kv(llama_dir):
    """On the GPU: the same tokens, KV on CPU in the model's dtype, close to the CPU's. Not
    bit-exact: CUDA's GEMM and softmax kernels round every op differently, so any number of values
    may differ; each layer's K and V within 2**-4 of its largest value (a few bf16 ulps). A KV
    of other positions is outside that bound."""
    on_cpu = create_first_k(llama_dir, document_text(), max_tokens=300, prefill_chunk=128)
    on_gpu = create_first_k(llama_dir, document_text(), max_tokens=300, prefill_chunk=128, device="cuda")
    assert on_gpu.token_ids == on_cpu.token_ids
    assert on_gpu.kv.device.type == "cpu" and on_gpu.kv.dtype == on_cpu.kv.dtype == torch.bfloat16
    assert on_gpu.provenance["kv_computed_by"]["device"].startswith("cuda")
    assert within_bf16_rounding(on_gpu.kv, on_cpu.kv, scale=2**-4, differ=1.0)
    assert not within_bf16_rounding(on_gpu.kv[:, :, 1:], on_cpu.kv[:, :, :-1], scale=2**-4, differ=1.0)


def test_create_on_cpu_through_the_cli(tmp_path, llama_dir, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text(document_text())
    rc = cli.main(["create", "--model-dir", str(llama_dir), "--text", str(doc), "-o", str(tmp_path / "new" / "c"),
                   "--kv-from", "hf", "--device", "cpu", "--prefill-chunk", "100", "--max-tokens", "300", "-q"])
    assert rc == 0, capsys.readouterr().err
    m = PackedCartridge(tmp_path / "new" / "c").manifest
    assert m.num_tokens == 300
    assert m.provenance["kv_computed_by"] == {"engine": "transformers", "dtype": "bfloat16", "attention": "eager",
                                              "device": "cpu", "prefill_chunk": 100}


# --- chunked prefill ------------------------------------------------------------------------------
CHUNKS = [1, 7, 64, 100, 256]
SMALL_CHUNKS, SHORT = {1, 7}, 48  # these prefill SHORT tokens: as many steps of one kind, far fewer forwards


def _prefix(ids: list[int], chunk: int) -> list[int]:
    return ids[:SHORT] if chunk in SMALL_CHUNKS else ids


def _one_shot(model, ids: list[int]) -> dict[int, torch.Tensor]:
    """The one-shot KV of the short and the whole prefix, by length."""
    return {SHORT: compute_prefix_kv(model, ids[:SHORT], None), len(ids): compute_prefix_kv(model, ids, None)}


def test_chunked_prefill_is_exact(family):
    """Prefilling chunk by chunk through the HF cache is the one-shot computation: bit-exact,
    at every chunk size, with oneDNN off. (oneDNN's bf16 GEMM picks its kernel by the number of
    rows, so with it some chunk sizes round a few values one bf16 ulp apart: next test. The
    attention itself, the part chunking changes, matched there too; the first difference is an
    MLP projection.)"""
    _, model, ids = family
    with torch.backends.mkldnn.flags(enabled=False):
        one_shot = _one_shot(model, ids)
        for chunk in CHUNKS:
            prefix = _prefix(ids, chunk)
            assert torch.equal(compute_prefix_kv(model, prefix, chunk), one_shot[len(prefix)]), chunk


def within_bf16_rounding(kv: torch.Tensor, ref: torch.Tensor, scale: float = 2**-6, differ: float = 0.01) -> bool:
    """Each layer's K (and V) within `scale` of its largest value (2**-6: 2 to 4 bf16 ulps at the
    top of its range, a one-ulp difference in a hidden state carried through a projection), and
    at most a `differ` fraction of the values different at all."""
    diff = (kv.float() - ref.float()).abs().amax(dim=(2, 3, 4))
    top = ref.float().abs().amax(dim=(2, 3, 4))
    return bool((diff <= top * scale).all()) and (kv != ref).float().mean().item() <= differ


def test_chunked_prefill_is_within_rounding_with_default_kernels(family):
    """With the default kernels (oneDNN on) some chunk sizes are bit-exact and some round a few
    values apart; all are within bf16 rounding. A KV of other positions is far outside that."""
    _, model, ids = family
    refs = _one_shot(model, ids)
    for chunk in CHUNKS:
        prefix = _prefix(ids, chunk)
        kv, ref = compute_prefix_kv(model, prefix, chunk), refs[len(prefix)]
        assert kv.dtype == ref.dtype and kv.shape == ref.shape
        assert within_bf16_rounding(kv, ref), chunk
    one_shot = refs[len(ids)]
    shifted = compute_prefix_kv(model, ids[1:], 256)  # the same text one position earlier
    assert not within_bf16_rounding(shifted, one_shot[:, :, 1:])
    assert not within_bf16_rounding(shifted, one_shot[:, :, 1:], scale=2**-4, differ=1.0)  # nor the CUDA bound


def test_attention_scores_are_bounded_by_the_chunk(family):
    """The memory bound: the largest attention weights tensor eager attention builds is
    [heads, chunk, prefix], never [heads, n, n]. Seen by a hook on every attention module."""
    _, model, ids = family
    shapes: list[tuple[int, ...]] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out[1].shape)))
             for name, m in model.named_modules() if name.endswith("self_attn")]
    try:
        compute_prefix_kv(model, ids, 100)
        chunked = list(shapes)
        shapes.clear()
        compute_prefix_kv(model, ids, None)
        one_shot = list(shapes)
    finally:
        for h in hooks:
            h.remove()
    heads, n = model.config.num_attention_heads, len(ids)
    assert chunked and max(s[-2] for s in chunked) == 100 and max(s[-1] for s in chunked) == n
    assert max(torch.Size(s).numel() for s in chunked) <= heads * 100 * n
    assert max(s[-2] for s in one_shot) == n  # the hook would have seen a full matrix
    assert len(chunked) == model.config.num_hidden_layers * -(-n // 100)


def test_create_first_k_passes_its_chunk_and_checks_it(llama_dir):
    loaded = load_model(llama_dir)
    c = create_first_k(llama_dir, document_text(), max_tokens=200, prefill_chunk=64, model_and_tokenizer=loaded)
    assert torch.equal(c.kv, compute_prefix_kv(loaded[0], c.token_ids, 64))
    assert c.provenance["kv_computed_by"]["prefill_chunk"] == 64
    with pytest.raises(CartridgeFormatError, match="prefill_chunk"):
        create_first_k(llama_dir, document_text(), prefill_chunk=0, model_and_tokenizer=loaded)
    with pytest.raises(CartridgeFormatError, match="prefill chunk"):
        compute_prefix_kv(loaded[0], [1, 2, 3], 0)
    with pytest.raises(CartridgeFormatError, match="device"):
        create_first_k(llama_dir, document_text(), device="cpu", model_and_tokenizer=loaded)

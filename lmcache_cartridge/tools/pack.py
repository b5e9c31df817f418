"""`lmcache-cartridge pack`: a cartridge in any input format (`cartridge.inputs`: a `.pt`, a PEFT
adapter, a Tokasaurus directory, ...) written in the packed format, or a packed one re-chunked.
With a model directory the KV is checked against the model before anything is written, and a
token-only input has its KV computed once with it. The manifest's provenance says what the input
was read as (`source_format`) and the model it names.

Runs offline in the CLI's process; writes only the output directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lmcache_cartridge.cartridge.manifest import Manifest
from lmcache_cartridge.errors import CartridgeError


@dataclass(frozen=True)
class Packed:
    manifest: Manifest
    source_format: str | None = None  # what the input was read as; None: a packed cartridge re-chunked
    base_model: str | None = None     # the model the input itself names, where its format records one


def pack_input(src: Path, out: Path, *, model: str | None, model_dir: str | None, kind: str | None,
               dtype: str | None, cartridge_id: str | None, chunk_size: int, vocab: Callable, labels: list[str],
               overwrite: bool, progress: bool, check_model: bool = True) -> Packed:
    """Pack `src` into `out`. `model`: vLLM's name for the model (default: what the input names,
    else `model_dir`); `check_model`: the input's own base model must be `model`; `vocab()`: the
    vocabulary a trained cartridge's placeholder ids avoid (called only for one); `dtype`: a torch
    dtype name (default: the model's for float32 KV, `registration.model_dtype_for`)."""
    import torch

    from lmcache_cartridge.cartridge.formats import load_input
    from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME, id_from_path
    from lmcache_cartridge.cartridge.packed import PackedCartridge, pack_kv, rechunk
    from lmcache_cartridge.store.registration import model_dtype_for  # one rule, shared with the gateway

    if src.is_dir() and (src / MANIFEST_NAME).exists():
        return Packed(rechunk(PackedCartridge(src), out, chunk_size, overwrite=overwrite))
    loaded = load_input(src, expected_model=model if check_model else None)
    meta = loaded.metadata
    model = model or meta.get("model") or loaded.base_model or model_dir
    if not model:
        raise CartridgeError("name the model the KV belongs to: --model NAME (as vLLM's --model)")
    kv = loaded.kv
    provenance = {"source": str(src), "source_format": loaded.source_format}
    if loaded.base_model:
        provenance["base_model"] = loaded.base_model
    if loaded.num_frozen_tokens:
        provenance["num_frozen_tokens"] = loaded.num_frozen_tokens
    if kv is None:  # token-only cartridge: compute its KV once with the model
        kv = _computed_kv(src, loaded.token_ids, model_dir)
        provenance["kv_computed_with"] = str(model_dir)
    if kind is None:
        kind = "first_k" if loaded.token_ids is not None else "trained"
    if model_dir:  # the KV must be this model's: checked before anything is written
        _check_geometry(src, kv, model_dir)
    torch_dtype = getattr(torch, dtype) if dtype else model_dtype_for(kv, model_dir)
    if torch_dtype is not None and torch_dtype != kv.dtype:
        provenance["converted_from_dtype"] = str(kv.dtype).removeprefix("torch.")
    m = pack_kv(
        kv,
        out,
        cartridge_id=cartridge_id or loaded.suggested_id or id_from_path(src),
        model=model,
        kind=kind,
        token_ids=loaded.token_ids if kind == "first_k" else None,
        vocab=vocab() if kind == "trained" else None,
        chunk_size=chunk_size,
        dtype=torch_dtype,
        provenance=provenance,
        labels=labels or meta.get("labels", []) or [],
        overwrite=overwrite,
        progress=progress,
    )
    return Packed(m, loaded.source_format, loaded.base_model)


def _computed_kv(src: Path, token_ids, model_dir: str | None):
    """The KV of a token-only input, computed once with the model."""
    if not model_dir:
        raise CartridgeError(f"{src} holds only token ids; pass --model-dir DIR to compute its KV with the model")
    from lmcache_cartridge.cartridge.model_kv import compute_prefix_kv, load_model

    hf_model, _ = load_model(model_dir)
    return compute_prefix_kv(hf_model, token_ids)


def _check_geometry(src: Path, kv, model_dir: str) -> None:
    """CartridgeError unless `kv` has `model_dir`'s layers, KV heads and head_dim."""
    from transformers import AutoConfig

    from lmcache_cartridge.cartridge.model_kv import kv_geometry

    g = kv_geometry(AutoConfig.from_pretrained(model_dir))
    have = (int(kv.shape[1]), int(kv.shape[3]), int(kv.shape[4]))
    if have != (g.num_layers, g.num_kv_heads, g.head_dim):
        raise CartridgeError(f"{src}: KV of {have[0]} layers x {have[1]} KV heads x head_dim {have[2]}, but "
                             f"{model_dir} has {g.num_layers} x {g.num_kv_heads} x {g.head_dim}: "
                             "it was made for another model")

"""Reading cartridge *inputs*: every format their makers save, into one canonical KV tensor.

Runs wherever an input is read: `lmcache-cartridge pack` / `inspect` on an operator's machine,
and the gateway process when a request names a `.pt` or a directory. Pure data: no model, no
network; nothing here runs pickle code (see `torchfile`).

| `source_format`             | input (read by)                                                         |
|-----------------------------|-------------------------------------------------------------------------|
| `cartridges`                | `TrainableCache.save()` `.pt` (`cache-step<N>.pt`, `cache_last.pt`)     |
| `tokasaurus`                | directory with `cartridge.pt` + `config.yaml`                           |
| `peft`                      | PEFT `CARTRIDGE` adapter directory (`adapter_config.json` + weights)    |
| `kv_pairs+prefix_token_ids` | `list[(k, v)]` `.pt` with `prefix_token_ids.json` beside it             |
| `kv_pairs`                  | `list[(k, v)]` `.pt` alone (trained KV)                                 |
| `kv_cache_dict`             | `{'token_ids', 'kv_cache', 'metadata'}` `.pt` (earlier name: `seed000`) |

One module per maker's format; `load_input` picks by what is on disk, never by trial and error
across formats (a file that looks like one format and is broken gets that format's error).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmcache_cartridge.cartridge.inputs import kv_dict, kv_list, peft_adapter, tokasaurus, trainable_cache
from lmcache_cartridge.cartridge.inputs.common import LoadedCartridge, check_model, same_model
from lmcache_cartridge.cartridge.inputs.torchfile import safe_torch_load
from lmcache_cartridge.errors import CartridgeFormatError

__all__ = ["LoadedCartridge", "load_input", "dir_files", "parse_object", "safe_torch_load", "same_model", "FORMATS",
           "FORMAT_ALIASES", "canonical_format", "describe"]

FORMATS: dict[str, str] = {
    trainable_cache.FORMAT: "HazyResearch/cartridges TrainableCache.save() checkpoint",
    tokasaurus.FORMAT: "Tokasaurus cartridge directory (cartridge.pt + config.yaml)",
    peft_adapter.FORMAT: "PEFT CARTRIDGE adapter (adapter_config.json + adapter_model.safetensors)",
    kv_list.FORMAT_WITH_IDS: "list[(k, v)] per layer with prefix_token_ids.json (first-k)",
    kv_list.FORMAT: "list[(k, v)] per layer (trained KV, no token ids)",
    kv_dict.FORMAT: "dict {'token_ids', 'kv_cache', 'metadata'}: token ids and/or per-layer KV",
}
# Earlier names of a format, accepted wherever a format is named (a manifest's provenance).
FORMAT_ALIASES: dict[str, str] = {alias: kv_dict.FORMAT for alias in kv_dict.ALIASES}


def canonical_format(name: str | None) -> str | None:
    """A format's current name for `name`, which may be an earlier one (`FORMAT_ALIASES`)."""
    return FORMAT_ALIASES.get(name, name) if name else name

_RUN_CHECKPOINT = "cache_last.pt"  # a Cartridges training run directory's newest checkpoint


def parse_object(obj: Any) -> LoadedCartridge:
    """Parse what a `.pt` held (after the restricted unpickler)."""
    if kv_list.matches(obj):
        return kv_list.parse(obj)
    if not isinstance(obj, dict):
        raise CartridgeFormatError(f"expected a dict or a list of (k, v) pairs, got {type(obj).__name__}")
    if trainable_cache.matches(obj):
        return trainable_cache.parse(obj)
    if kv_dict.matches(obj):
        return kv_dict.parse(obj)
    raise CartridgeFormatError(
        "unrecognised cartridge: expected 'token_ids'/'kv_cache' (a kv_cache_dict), "
        "'trainable_keys'/'trainable_values' (+ 'frozen_*' or 'fixed_*', Cartridges TrainableCache) "
        f"or a list of (k, v) per layer; found keys {sorted(map(str, obj))[:8]}"
    )


def load_input(path: str | Path, *, expected_model: str | None = None, named: Path | None = None,
               beside: Path | None = None) -> LoadedCartridge:
    """Read any supported input (a `.pt` file or a directory); errors name the path and what was
    expected. With `expected_model`, a base model recorded by the input must name the same model.
    `named` and `beside` (the gateway): `path` is a file already open (`paths.opened_beneath`),
    `named` the path it was named by, `beside` its open directory, where files read beside it
    are opened without following a symlink."""
    path = Path(path)
    if path.is_dir():
        loaded = _load_dir(path)
    elif path.is_file():
        named = named or path
        if named.name == tokasaurus.PT_NAME and tokasaurus.matches(beside or named.parent):
            loaded = tokasaurus.load(beside or named.parent)
        else:
            loaded = _load_pt(path, named, beside)
    else:
        raise CartridgeFormatError(f"{path}: no such file or directory")
    check_model(loaded, expected_model, str(path))
    return loaded


def _load_pt(path: Path, named: Path | None = None, beside: Path | None = None) -> LoadedCartridge:
    named = named or path
    obj = safe_torch_load(path)
    try:
        loaded = parse_object(obj)
    except CartridgeFormatError as e:
        raise CartridgeFormatError(f"{named}: {e}") from None
    if loaded.source_format == kv_list.FORMAT:
        loaded = kv_list.attach_sidecars(loaded, named, beside)
    elif loaded.source_format == trainable_cache.FORMAT:
        loaded.suggested_id = trainable_cache.suggested_id(named)
    return loaded


def _load_dir(path: Path) -> LoadedCartridge:
    if (path / "manifest.json").is_file():
        raise CartridgeFormatError(f"{path} is already a packed cartridge (it has a manifest.json)")
    if peft_adapter.matches(path):
        return peft_adapter.load(path)
    if tokasaurus.matches(path):
        return tokasaurus.load(path)
    if (path / kv_list.IDS_NAME).is_file() and (path / tokasaurus.PT_NAME).is_file():
        return _load_pt(path / tokasaurus.PT_NAME)
    if (path / _RUN_CHECKPOINT).is_file():
        return _load_pt(path / _RUN_CHECKPOINT)
    raise CartridgeFormatError(
        f"{path}: not a cartridge directory: expected adapter_config.json (PEFT CARTRIDGE adapter), "
        "cartridge.pt + config.yaml (Tokasaurus), cartridge.pt + prefix_token_ids.json, or "
        "cache_last.pt (a Cartridges training run)")


def dir_files(names: set[str] | dict[str, object]) -> tuple[str, ...] | None:
    """Which of `names` (a listing of one directory level, e.g. an S3 prefix) `_load_dir` would
    read, by the same rules in the same order; None when they are no input directory."""
    if peft_adapter.CONFIG_NAME in names:
        return (peft_adapter.CONFIG_NAME, *(n for n in peft_adapter.WEIGHTS_NAMES if n in names))
    if tokasaurus.PT_NAME in names and tokasaurus.CONFIG_NAME in names:
        return tokasaurus.PT_NAME, tokasaurus.CONFIG_NAME
    if kv_list.IDS_NAME in names and tokasaurus.PT_NAME in names:
        return (tokasaurus.PT_NAME, kv_list.IDS_NAME, *((kv_list.META_NAME,) if kv_list.META_NAME in names else ()))
    if _RUN_CHECKPOINT in names:
        return (_RUN_CHECKPOINT,)
    return None


def describe(loaded: LoadedCartridge) -> dict[str, Any]:
    """What `lmcache-cartridge inspect` shows for an unpacked input: the format it was read as,
    the model it names, its geometry, and how `pack` will treat it."""
    kv = loaded.kv
    if kv is None:
        packs_as = "first_k, token-only (pack computes the KV with --model-dir)"
    elif loaded.token_ids is not None:
        packs_as = "first_k (its token ids go first in the prompt)"
    else:
        packs_as = "trained (no token ids: placeholder ids, whole chunks only)"
    return {
        "read_as": loaded.source_format,
        "description": FORMATS.get(canonical_format(loaded.source_format), ""),
        "packs_as": packs_as,
        "base_model": loaded.base_model,
        "num_tokens": loaded.num_tokens,
        "num_frozen_tokens": loaded.num_frozen_tokens,
        "num_layers": int(kv.shape[1]) if kv is not None else None,
        "num_kv_heads": int(kv.shape[3]) if kv is not None else None,
        "head_dim": int(kv.shape[4]) if kv is not None else None,
        "dtype": str(kv.dtype).removeprefix("torch.") if kv is not None else None,
        "num_token_ids": len(loaded.token_ids) if loaded.token_ids is not None else None,
        "suggested_id": loaded.suggested_id,
        "metadata": loaded.metadata,
    }

"""A plain per-layer `list[(k, v)]` `.pt`, optionally with `prefix_token_ids.json` beside it.

Runs wherever an input is read (CLI, gateway). Public tooling (e.g. knlp's cartridge builders)
writes `torch.save([(k, v) per layer])` with HF's `[1, kv_heads, T, head_dim]` tensors from a
prefill, a sibling `prefix_token_ids.json` (a JSON list of the T token ids the KV was computed
from) and `meta.json` (`model`, `dtype`, `n_layers`, `budget_tokens`, `prefix_token_ids_sha256` =
sha256 of `json.dumps(ids)`). With the ids the cartridge is first-k (its ids go first in the
prompt); without them it is a trained KV that gets placeholder ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from lmcache_cartridge.cartridge.inputs.common import LoadedCartridge, stack_pairs, token_list
from lmcache_cartridge.errors import CartridgeFormatError

FORMAT = "kv_pairs"
FORMAT_WITH_IDS = "kv_pairs+prefix_token_ids"
IDS_NAME = "prefix_token_ids.json"
META_NAME = "meta.json"


def matches(obj: Any) -> bool:
    return isinstance(obj, (list, tuple))


def parse(obj: Any) -> LoadedCartridge:
    return LoadedCartridge(kv=stack_pairs(obj, "list of (k, v)"), token_ids=None, source_format=FORMAT)


def attach_sidecars(loaded: LoadedCartridge, pt_path: Path, beside: Path | None = None) -> LoadedCartridge:
    """Add the token ids (and meta.json's model) found beside a `list[(k, v)]` file. `beside`:
    its directory, already open (the gateway's `paths.opened_beneath`): the files in it are
    opened without following a symlink, so a name flipped after the check reads nothing."""
    where = beside or pt_path.parent
    ids_path, meta_path = where / IDS_NAME, where / META_NAME
    nofollow = beside is not None
    meta = _read_json(meta_path, nofollow) if meta_path.is_file() else {}
    if not isinstance(meta, dict):
        raise CartridgeFormatError(f"{meta_path}: expected a JSON object")
    if isinstance(meta.get("model"), str):
        loaded.base_model = meta["model"]
    loaded.metadata = {k: v for k, v in meta.items() if isinstance(v, (str, int, float, bool)) and k != "model"}
    if not ids_path.is_file():
        return loaded
    raw = _read_json(ids_path, nofollow)
    ids = token_list(raw, f"{ids_path.name}")
    expected = meta.get("prefix_token_ids_sha256")
    if isinstance(expected, str) and hashlib.sha256(json.dumps(ids).encode()).hexdigest() != expected:
        raise CartridgeFormatError(
            f"{ids_path} does not match {META_NAME}'s prefix_token_ids_sha256: the ids are not the "
            "ones this KV was computed from")
    if len(ids) != loaded.kv.shape[2]:
        raise CartridgeFormatError(
            f"{pt_path} holds {loaded.kv.shape[2]} tokens of KV but {ids_path.name} has {len(ids)} ids")
    loaded.token_ids = ids
    loaded.source_format = FORMAT_WITH_IDS
    return loaded


def _read_json(path: Path, nofollow: bool = False) -> Any:
    try:
        with open(os.open(path, os.O_RDONLY | (os.O_NOFOLLOW if nofollow else 0)), encoding="utf-8") as f:
            return json.loads(f.read())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CartridgeFormatError(f"{path}: not readable JSON ({e})") from None

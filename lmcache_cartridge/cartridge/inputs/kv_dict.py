"""The token-ids-and-KV dict (`kv_cache_dict`): a `.pt` holding `{'token_ids', 'kv_cache', 'metadata'}`.

Read as `kv_cache_dict`; `seed000`, its earlier name, is an alias (`ALIASES`: manifests packed
before the rename record it). Runs wherever an input is read (CLI, gateway). `token_ids` (list or tensor) are real ids;
`kv_cache` is optional (absent: a token-only cartridge), a dict of per-layer entries whose names
carry the layer number, each either a tensor with a leading K/V axis (`[2, H, T, D]`,
`[2, 1, H, T, D]`, `[2, T, H, D]`; `metadata['kv_layout']` = 'HTD' / 'THD' settles ambiguous
shapes) or a `(k, v)` pair of `[H, T, D]` / `[1, H, T, D]`.
"""

from __future__ import annotations

import re
from typing import Any

from lmcache_cartridge.cartridge.inputs.common import LoadedCartridge, htd, stack_layers, token_list
from lmcache_cartridge.errors import CartridgeFormatError

FORMAT = "kv_cache_dict"
ALIASES = ("seed000",)  # earlier names of this format, still accepted where a format is named


def matches(obj: Any) -> bool:
    return isinstance(obj, dict) and ("token_ids" in obj or "kv_cache" in obj)


def parse(obj: dict) -> LoadedCartridge:
    token_ids = token_list(obj.get("token_ids"))
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise CartridgeFormatError("'metadata' must be a dict")
    kv_cache = obj.get("kv_cache")
    if kv_cache is None:
        if token_ids is None:
            raise CartridgeFormatError("cartridge has neither 'token_ids' nor 'kv_cache'")
        return LoadedCartridge(kv=None, token_ids=token_ids, metadata=metadata, source_format=FORMAT)
    if not isinstance(kv_cache, dict) or not kv_cache:
        raise CartridgeFormatError("'kv_cache' must be a non-empty dict of per-layer tensors")
    layers = _order_layers(kv_cache)
    num_tokens = len(token_ids) if token_ids is not None else None
    layout = str(metadata.get("kv_layout", "")).upper() or None
    kv = stack_layers([_layer(name, kv_cache[name], num_tokens, layout) for name in layers])
    if token_ids is not None and kv.shape[2] != len(token_ids):
        raise CartridgeFormatError(f"kv_cache holds {kv.shape[2]} tokens but token_ids has {len(token_ids)}")
    return LoadedCartridge(kv=kv, token_ids=token_ids, metadata=metadata, source_format=FORMAT)


def _order_layers(d: dict) -> list[str]:
    """Order per-layer entries by the layer number in their names; refuse ambiguous names."""
    numbered: dict[int, list] = {}
    for name in d:
        nums = re.findall(r"\d+", str(name))
        if not nums:
            raise CartridgeFormatError(f"kv_cache entry {name!r} has no layer number in its name")
        numbered.setdefault(int(nums[-1]), []).append(name)
    dup = [names for names in numbered.values() if len(names) > 1]
    if dup:
        raise CartridgeFormatError(f"kv_cache entries share a layer number: {dup[0]}")
    idx = sorted(numbered)
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise CartridgeFormatError(f"kv_cache layer numbers are not contiguous: {idx}")
    return [numbered[i][0] for i in idx]


def _layer(name: str, value: Any, num_tokens: int | None, layout: str | None):
    import torch

    if isinstance(value, (list, tuple)) and len(value) == 2:
        return htd(value[0], f"{name}[k]"), htd(value[1], f"{name}[v]")
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != 2:
        raise CartridgeFormatError(
            f"kv_cache[{name!r}] must be a (k, v) pair or a tensor with a leading K/V axis of 2"
        )
    t = value
    if t.dim() == 5 and t.shape[1] == 1:
        t = t[:, 0]
    if t.dim() != 4:
        raise CartridgeFormatError(
            f"kv_cache[{name!r}] has shape {tuple(value.shape)}; expected 4-D [2, H, T, D] or [2, T, H, D]")
    a, b = t.shape[1], t.shape[2]
    if layout is None:
        if num_tokens is not None and b == num_tokens and a != num_tokens:
            layout = "HTD"
        elif num_tokens is not None and a == num_tokens and b != num_tokens:
            layout = "THD"
        elif num_tokens is None:
            layout = "HTD"
        else:
            raise CartridgeFormatError(
                f"kv_cache[{name!r}] shape {tuple(t.shape)} is ambiguous; set metadata['kv_layout'] "
                "to 'HTD' or 'THD'"
            )
    if layout == "THD":
        t = t.permute(0, 2, 1, 3)
    elif layout != "HTD":
        raise CartridgeFormatError(f"metadata['kv_layout'] must be 'HTD' or 'THD', got {layout!r}")
    return htd(t[0], f"{name}[k]"), htd(t[1], f"{name}[v]")

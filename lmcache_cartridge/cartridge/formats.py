"""Reading cartridge *input* files (the formats people hand us) into one canonical tensor.

Canonical KV, used by `pack`, `create` and the tests: one tensor
`[2, num_layers, num_tokens, num_kv_heads, head_dim]` (0 = K, 1 = V), K after RoPE as the model
caches it. Every input is read with `torch.load(weights_only=True)`: a file that needs arbitrary
unpickling is refused, never executed.

Accepted inputs:
1. seed 000: `{'token_ids': list|tensor, 'kv_cache': optional dict[str, tensor], 'metadata': dict}`;
   per layer either a tensor with a leading K/V axis (`[2, H, T, D]`, `[2, 1, H, T, D]`,
   `[2, T, H, D]`) or a `(k, v)` pair of `[H, T, D]` / `[1, H, T, D]`.
2. Cartridges paper: `{'trainable_keys': [L x [1, H, T, D]], 'trainable_values', 'frozen_keys',
   'frozen_values'}` (frozen tokens first), the older `fixed_*` names, and the same lists saved
   as a flat state dict (`'trainable_keys.0'`, ...).
3. A plain `list[(k, v)]` per layer.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmcache_cartridge.errors import CartridgeFormatError


@dataclass
class LoadedCartridge:
    """An input file's content, normalised. `kv is None` for a token-only cartridge."""

    kv: torch.Tensor | None
    token_ids: list[int] | None
    metadata: dict[str, Any] = field(default_factory=dict)
    source_format: str = ""


def safe_torch_load(path: str | Path) -> Any:
    """`torch.load` that can only build tensors and plain containers."""
    path = Path(path)
    if not path.is_file():
        raise CartridgeFormatError(f"{path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except pickle.UnpicklingError as e:
        raise CartridgeFormatError(
            f"{path}: refused to load: the file holds pickled objects other than tensors and plain "
            f"containers (it could run code on load). Re-save it with tensors, lists, dicts, ints "
            f"and strings only. Detail: {str(e).splitlines()[0]}"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise CartridgeFormatError(f"{path}: not a readable torch file ({e})") from None


def load_input(path: str | Path) -> LoadedCartridge:
    """Read any supported input file; errors name the file and what was expected."""
    obj = safe_torch_load(path)
    try:
        return parse_object(obj)
    except CartridgeFormatError as e:
        raise CartridgeFormatError(f"{path}: {e}") from None


def parse_object(obj: Any) -> LoadedCartridge:
    if isinstance(obj, (list, tuple)):
        return LoadedCartridge(kv=_stack_pairs(obj, "list of (k, v)"), token_ids=None,
                               source_format="kv_pairs")
    if not isinstance(obj, dict):
        raise CartridgeFormatError(
            f"expected a dict or a list of (k, v) pairs, got {type(obj).__name__}"
        )
    if any(_paper_key(k) for k in obj):
        return _parse_paper(obj)
    if "token_ids" in obj or "kv_cache" in obj:
        return _parse_seed000(obj)
    raise CartridgeFormatError(
        "unrecognised cartridge: expected 'token_ids'/'kv_cache' (seed 000), "
        "'trainable_keys'/'trainable_values' (Cartridges paper) or a list of (k, v) per layer; "
        f"found keys {sorted(map(str, obj))[:8]}"
    )


# --- seed 000 ---------------------------------------------------------------------------------
def _parse_seed000(obj: dict) -> LoadedCartridge:
    token_ids = _token_list(obj.get("token_ids"))
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise CartridgeFormatError("'metadata' must be a dict")
    kv_cache = obj.get("kv_cache")
    if kv_cache is None:
        if token_ids is None:
            raise CartridgeFormatError("cartridge has neither 'token_ids' nor 'kv_cache'")
        return LoadedCartridge(kv=None, token_ids=token_ids, metadata=metadata,
                               source_format="seed000")
    if not isinstance(kv_cache, dict) or not kv_cache:
        raise CartridgeFormatError("'kv_cache' must be a non-empty dict of per-layer tensors")
    layers = _order_layers(kv_cache)
    num_tokens = len(token_ids) if token_ids is not None else None
    layout = str(metadata.get("kv_layout", "")).upper() or None
    per_layer = [_seed000_layer(name, kv_cache[name], num_tokens, layout) for name in layers]
    kv = _stack_layers(per_layer)
    if token_ids is not None and kv.shape[2] != len(token_ids):
        raise CartridgeFormatError(
            f"kv_cache holds {kv.shape[2]} tokens but token_ids has {len(token_ids)}"
        )
    return LoadedCartridge(kv=kv, token_ids=token_ids, metadata=metadata, source_format="seed000")


def _order_layers(d: dict) -> list[str]:
    """Order per-layer entries by the layer number in their names; refuse ambiguous names."""
    numbered = {}
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


def _seed000_layer(name: str, value: Any, num_tokens: int | None, layout: str | None):
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return _htd(value[0], f"{name}[k]"), _htd(value[1], f"{name}[v]")
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != 2:
        raise CartridgeFormatError(
            f"kv_cache[{name!r}] must be a (k, v) pair or a tensor with a leading K/V axis of 2"
        )
    t = value
    if t.dim() == 5 and t.shape[1] == 1:
        t = t[:, 0]
    if t.dim() != 4:
        raise CartridgeFormatError(f"kv_cache[{name!r}] has shape {tuple(value.shape)}; expected 4-D [2, H, T, D] or [2, T, H, D]")
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
    return _htd(t[0], f"{name}[k]"), _htd(t[1], f"{name}[v]")


# --- Cartridges paper -------------------------------------------------------------------------
_PAPER_RE = re.compile(r"^(trainable|frozen|fixed)_(keys|values)(?:\.(\d+))?$")


def _paper_key(k: Any) -> bool:
    return isinstance(k, str) and bool(_PAPER_RE.match(k))


def _parse_paper(obj: dict) -> LoadedCartridge:
    groups: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for k, v in obj.items():
        m = _PAPER_RE.match(k) if isinstance(k, str) else None
        if not m:
            continue
        group, part, idx = m.group(1), m.group(2), m.group(3)
        if group == "fixed":
            group = "frozen"
        slot = groups.setdefault((group, part), {})
        if idx is None:
            if not isinstance(v, (list, tuple)):
                raise CartridgeFormatError(f"'{k}' must be a list of per-layer tensors")
            slot.update(enumerate(v))
        else:
            slot[int(idx)] = v
    if ("trainable", "keys") not in groups and ("frozen", "keys") not in groups:
        raise CartridgeFormatError("no trainable_keys/frozen_keys found")

    def layer_list(group: str, part: str) -> list[torch.Tensor] | None:
        d = groups.get((group, part))
        if d is None:
            return None
        if sorted(d) != list(range(len(d))):
            raise CartridgeFormatError(f"{group}_{part} layers are not numbered 0..{len(d) - 1}")
        return [_htd(d[i], f"{group}_{part}[{i}]") for i in range(len(d))]

    parts = []
    for group in ("frozen", "trainable"):  # frozen first: the attention-sink convention
        ks, vs = layer_list(group, "keys"), layer_list(group, "values")
        if (ks is None) != (vs is None):
            raise CartridgeFormatError(f"{group}_keys and {group}_values must come together")
        if ks is None:
            continue
        if len(ks) != len(vs):
            raise CartridgeFormatError(f"{group}: {len(ks)} key layers but {len(vs)} value layers")
        parts.append(_stack_layers(list(zip(ks, vs))))
    if not parts:
        raise CartridgeFormatError("no complete keys/values pair (trainable_* or frozen_*) found")
    if len(parts) == 2 and parts[0].shape[1] != parts[1].shape[1]:
        raise CartridgeFormatError("frozen and trainable parts have different layer counts")
    kv = torch.cat(parts, dim=2) if len(parts) == 2 else parts[0]
    return LoadedCartridge(kv=kv, token_ids=None, source_format="cartridges")


# --- shared helpers ---------------------------------------------------------------------------
def _stack_pairs(pairs: Any, what: str) -> torch.Tensor:
    layers = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise CartridgeFormatError(f"{what}: entry {i} is not a (k, v) pair")
        layers.append((_htd(pair[0], f"layer {i} k"), _htd(pair[1], f"layer {i} v")))
    if not layers:
        raise CartridgeFormatError(f"{what}: empty")
    return _stack_layers(layers)


def _htd(t: Any, where: str) -> torch.Tensor:
    """One layer's K or V as `[H, T, D]` (batch axis of 1 dropped)."""
    if not isinstance(t, torch.Tensor):
        raise CartridgeFormatError(f"{where}: expected a tensor, got {type(t).__name__}")
    if t.dim() == 4 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 3:
        raise CartridgeFormatError(f"{where}: shape {tuple(t.shape)}; expected [1, H, T, D] or [H, T, D]")
    if not t.is_floating_point():
        raise CartridgeFormatError(f"{where}: dtype {t.dtype} is not a floating-point KV dtype")
    if t.numel() == 0:
        raise CartridgeFormatError(f"{where}: shape {tuple(t.shape)} is empty")
    return t


def _stack_layers(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """`[(k [H,T,D], v [H,T,D]) per layer]` -> canonical `[2, L, T, H, D]`."""
    if not layers:
        raise CartridgeFormatError("no layers")
    shape, dtype = layers[0][0].shape, layers[0][0].dtype
    for i, (k, v) in enumerate(layers):
        if k.shape != shape or v.shape != shape or k.dtype != dtype or v.dtype != dtype:
            raise CartridgeFormatError(
                f"layer {i}: K {tuple(k.shape)} {k.dtype} / V {tuple(v.shape)} {v.dtype} differ "
                f"from layer 0's {tuple(shape)} {dtype}"
            )
    k = torch.stack([k for k, _ in layers])  # [L, H, T, D]
    v = torch.stack([v for _, v in layers])
    return torch.stack([k, v]).permute(0, 1, 3, 2, 4).contiguous()


def _token_list(tokens: Any) -> list[int] | None:
    if tokens is None:
        return None
    if isinstance(tokens, torch.Tensor):
        if tokens.is_floating_point() or tokens.dim() > 2 or (tokens.dim() == 2 and tokens.shape[0] != 1):
            raise CartridgeFormatError("'token_ids' tensor must be 1-D integer (or [1, T])")
        tokens = tokens.reshape(-1).tolist()
    if not isinstance(tokens, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise CartridgeFormatError("'token_ids' must be a list of non-negative integers")
    if not tokens:
        raise CartridgeFormatError("'token_ids' is empty")
    return list(tokens)

"""HazyResearch/cartridges checkpoints: what `TrainableCache.save()` writes.

Runs wherever an input is read (CLI, gateway). The maker's code (`cartridges/cache.py`):

    torch.save({"trainable_keys": self.trainable_keys, "trainable_values": ...,
                "frozen_keys": self.frozen_keys, "frozen_values": ...}, path)

each an `nn.ParameterList` with one `[1, kv_heads, T, head_dim]` tensor per layer (bf16, usually
saved from CUDA), the first `num_frozen_tokens` tokens (default 1, the attention sink) in the
frozen lists. With zero frozen tokens the frozen lists are empty ParameterLists; code that builds
a cache without init tensors leaves them `None`; other public code writes plain `[]`. Files from
before August 2025 name the frozen part `fixed_*`. Training writes `{run_dir}/cache-step{N}.pt`
and links `cache_last.pt` to the newest. The same lists saved as a flat state dict
(`trainable_keys.0`, ...) are read too. Frozen tokens come first, as in `TrainableCache.update`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from lmcache_cartridge.cartridge.inputs.common import LoadedCartridge, htd, stack_layers
from lmcache_cartridge.cartridge.manifest import id_from_name
from lmcache_cartridge.errors import CartridgeFormatError

FORMAT = "cartridges"
_KEY_RE = re.compile(r"^(trainable|frozen|fixed)_(keys|values)(?:\.(\d+))?\Z")
_STEP_RE = re.compile(r"^cache-step(\d+)\Z")


def matches(obj: Any) -> bool:
    return isinstance(obj, dict) and any(isinstance(k, str) and _KEY_RE.match(k) for k in obj)


def parse(obj: dict) -> LoadedCartridge:
    groups: dict[tuple[str, str], dict[int, Any]] = {}
    present: set[tuple[str, str]] = set()
    for k, v in obj.items():
        m = _KEY_RE.match(k) if isinstance(k, str) else None
        if not m:
            continue
        group, part, idx = m.group(1), m.group(2), m.group(3)
        group = "frozen" if group == "fixed" else group
        present.add((group, part))
        slot = groups.setdefault((group, part), {})
        if idx is not None:
            slot[int(idx)] = v
        elif v is None:  # a cache built without init tensors: no frozen part
            continue
        elif isinstance(v, (list, tuple)):
            slot.update(enumerate(v))
        else:
            raise CartridgeFormatError(f"'{k}' must be a list of per-layer tensors, got {type(v).__name__}")

    def layer_list(group: str, part: str) -> list[torch.Tensor]:
        d = groups.get((group, part), {})
        if sorted(d) != list(range(len(d))):
            raise CartridgeFormatError(f"{group}_{part} layers are not numbered 0..{len(d) - 1}")
        return [htd(d[i], f"{group}_{part}[{i}]") for i in range(len(d))]

    parts, frozen_tokens = [], 0
    for group in ("frozen", "trainable"):  # frozen first: the attention-sink convention
        if ((group, "keys") in present) != ((group, "values") in present):
            raise CartridgeFormatError(f"{group}_keys and {group}_values must come together")
        ks, vs = layer_list(group, "keys"), layer_list(group, "values")
        if len(ks) != len(vs):
            raise CartridgeFormatError(f"{group}: {len(ks)} key layers but {len(vs)} value layers")
        if not ks:
            continue
        kv = stack_layers(list(zip(ks, vs)))
        if group == "frozen":
            frozen_tokens = int(kv.shape[2])
        parts.append(kv)
    if not parts:
        raise CartridgeFormatError("no keys/values (trainable_* or frozen_*/fixed_*) with any layer found")
    if len(parts) == 2:
        a, b = parts
        if a.shape[1] != b.shape[1]:
            raise CartridgeFormatError(
                f"frozen part has {a.shape[1]} layers but trainable part has {b.shape[1]}")
        if a.shape[3:] != b.shape[3:] or a.dtype != b.dtype:
            raise CartridgeFormatError(
                f"frozen part [{a.shape[3]} heads x {a.shape[4]}] {a.dtype} does not match trainable part "
                f"[{b.shape[3]} heads x {b.shape[4]}] {b.dtype}")
    kv = torch.cat(parts, dim=2) if len(parts) == 2 else parts[0]
    return LoadedCartridge(kv=kv, token_ids=None, source_format=FORMAT, num_frozen_tokens=frozen_tokens)


def suggested_id(path: Path) -> str | None:
    """`run/cache-step512.pt` -> `run-step512`; `run/cache_last.pt` -> its target's name."""
    real = path.resolve()
    m = _STEP_RE.match(real.stem)
    if m:
        return id_from_name(f"{real.parent.name}-step{m.group(1)}", fallback=None)
    return None

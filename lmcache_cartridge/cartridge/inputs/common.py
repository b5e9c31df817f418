"""What every input reader returns, and the tensor checks they share.

Runs wherever an input is read: the `pack`/`inspect` CLI on an operator's machine, and the
gateway process when a client names a `.pt` or a directory. Pure data: no model, no network.

Canonical KV: one tensor `[2, num_layers, num_tokens, num_kv_heads, head_dim]` (0 = K, 1 = V),
K after RoPE exactly as the model caches it, in the dtype the file stored (never converted here:
the converted KV equals the maker's tensors bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmcache_cartridge.errors import CartridgeFormatError


@dataclass
class LoadedCartridge:
    """An input's content, normalised. `kv is None` for a token-only cartridge.

    `token_ids` are real token ids only (first-k / token-only inputs); trained inputs have none
    and get placeholder ids when packed. `base_model` is the model the maker's files name (PEFT
    `base_model_name_or_path`, Tokasaurus `model.pretrained_model_name_or_path`, a `meta.json`
    `model`), `None` when the format records none. `num_frozen_tokens` counts the leading
    frozen (attention-sink) tokens of a trained cartridge; they come first in `kv`.
    """

    kv: torch.Tensor | None
    token_ids: list[int] | None
    metadata: dict[str, Any] = field(default_factory=dict)
    source_format: str = ""
    base_model: str | None = None
    num_frozen_tokens: int = 0
    suggested_id: str | None = None  # a cartridge id derived from the input's own names

    @property
    def num_tokens(self) -> int:
        return int(self.kv.shape[2]) if self.kv is not None else len(self.token_ids or [])


def same_model(a: str, b: str) -> bool:
    """Whether two model names plausibly name the same model: equal, or the same last path
    component, so a hub id and a local copy match (`meta-llama/Llama-3.2-3B-Instruct`,
    `/models/Llama-3.2-3B-Instruct`). Anything else is a mismatch.
    """
    pa = [p for p in str(a).split("/") if p]
    pb = [p for p in str(b).split("/") if p]
    return bool(pa) and bool(pb) and pa[-1] == pb[-1]


def check_model(loaded: LoadedCartridge, expected_model: str | None, where: str) -> None:
    """Refuse a cartridge whose recorded base model is not `expected_model` (when both known)."""
    if expected_model is None or loaded.base_model is None:
        return
    if not same_model(loaded.base_model, expected_model):
        raise CartridgeFormatError(
            f"{where}: the {loaded.source_format} cartridge was made for model "
            f"{loaded.base_model!r}, not {expected_model!r}; KV only works with the model that "
            "computed it. If both names are the same model, override the check (`lmcache-cartridge "
            "pack --allow-model-mismatch`, or `load_input(path, expected_model=None)`)"
        )


def htd(t: Any, where: str) -> torch.Tensor:
    """One layer's K or V as `[H, T, D]` (a batch axis of 1 dropped). Parameters become plain
    tensors sharing the same storage (no copy, no dtype change)."""
    if not isinstance(t, torch.Tensor):
        raise CartridgeFormatError(f"{where}: expected a tensor, got {type(t).__name__}")
    if isinstance(t, torch.nn.Parameter):
        t = t.detach()
    if t.dim() == 4 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 3:
        raise CartridgeFormatError(f"{where}: shape {tuple(t.shape)}; expected [1, H, T, D] or [H, T, D]")
    if not t.is_floating_point():
        raise CartridgeFormatError(f"{where}: dtype {t.dtype} is not a floating-point KV dtype")
    if t.numel() == 0:
        raise CartridgeFormatError(f"{where}: shape {tuple(t.shape)} is empty")
    return t


def stack_layers(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
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


def stack_pairs(pairs: Any, what: str) -> torch.Tensor:
    """A list of per-layer `(k, v)` pairs -> canonical KV."""
    layers = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise CartridgeFormatError(f"{what}: entry {i} is not a (k, v) pair")
        layers.append((htd(pair[0], f"layer {i} k"), htd(pair[1], f"layer {i} v")))
    if not layers:
        raise CartridgeFormatError(f"{what}: empty")
    return stack_layers(layers)


def token_list(tokens: Any, what: str = "'token_ids'") -> list[int] | None:
    """Token ids from a list or an integer tensor; `None` stays `None`."""
    if tokens is None:
        return None
    if isinstance(tokens, torch.Tensor):
        if tokens.is_floating_point() or tokens.dim() > 2 or (tokens.dim() == 2 and tokens.shape[0] != 1):
            raise CartridgeFormatError(f"{what} tensor must be 1-D integer (or [1, T])")
        tokens = tokens.reshape(-1).tolist()
    if not isinstance(tokens, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise CartridgeFormatError(f"{what} must be a list of non-negative integers")
    if not tokens:
        raise CartridgeFormatError(f"{what} is empty")
    return list(tokens)


def require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise CartridgeFormatError(f"{path.parent}: {what} needs {path.name}, which is missing")
    return path

"""A cartridge's KV as an HF transformers model computes it, and back into an HF cache.

Canonical KV layout across the project: one tensor `[2, num_layers, num_tokens, num_kv_heads,
head_dim]` (0 = K, 1 = V), K after RoPE exactly as HF caches it, in the model's dtype. Runs
offline (CLI `create`/`pack`) and in tests, where HF is the independent reference for what
vLLM computes; never on the serving path. The model runs on the device it is loaded on (CPU by
default, `create --device cuda` for a GPU); the KV always comes back on CPU, where packing reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmcache_cartridge.errors import CartridgeError, CartridgeFormatError

# Tokens per forward pass when computing a prefix KV: eager attention materialises a
# [heads, chunk, prefix] score matrix per layer (in float32) instead of [heads, n, n].
DEFAULT_PREFILL_CHUNK = 512


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one token's KV in a model: what a cartridge for it must have."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def kv_geometry(config: Any) -> KVGeometry:
    """An HF config's KV shape, read as transformers' attention reads it: an explicit `head_dim`
    wins (Llama 3, Qwen3, Gemma: it need not be hidden_size / num_heads), else the quotient; KV
    heads default to the attention heads (no GQA)."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVGeometry(int(config.num_hidden_layers), int(kv_heads), int(head_dim))


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch device `name` names, checked before any model is loaded: cpu or cuda[:N], and
    CUDA only where this process can use it."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError) as e:
        raise CartridgeError(f"device {str(name)!r} is not a torch device (use cpu, cuda or cuda:N): {e}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no usable GPU"
            raise CartridgeError(f"device {str(name)!r} asked for, but CUDA is not available here "
                                 f"(torch {torch.__version__}, {build}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CartridgeError(f"device {str(name)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise CartridgeError(f"device {str(name)!r}: only cpu and cuda[:N] are supported")
    return device


def load_model(model_dir: str | Path, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """Load (model, tokenizer) on `device` (checked first: `resolve_device`) in eval mode.

    Eager attention: it is the reference implementation, so the KV we keep is not shaped by a
    fused kernel's numerics (`compute_prefix_kv` prefills in chunks to bound its score matrices).
    `dtype=None` keeps the checkpoint's dtype (the serving dtype).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = resolve_device(device)
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise CartridgeFormatError(
            f"{model_dir} has no config.json: pass a local HF model directory (e.g. the path "
            "printed by `python -m lmcache_cartridge.tools.testmodel`)"
        )
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype if dtype is not None else "auto",
        attn_implementation="eager",
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model.to(target).eval(), tokenizer


def cache_to_kv(past_key_values: Any) -> torch.Tensor:
    """HF cache (per layer `[batch=1, kv_heads, T, head_dim]`) -> canonical `[2, L, T, H, D]`."""
    if hasattr(past_key_values, "layers"):  # transformers >= 4.56 DynamicCache
        pairs = [(layer.keys, layer.values) for layer in past_key_values.layers]
    else:  # legacy tuple of (k, v) per layer
        pairs = [(k, v) for k, v in past_key_values]
    if any(k.shape[0] != 1 for k, _ in pairs):
        raise ValueError("expected a batch of one sequence in the cache")
    keys = torch.stack([k[0].permute(1, 0, 2) for k, _ in pairs])
    values = torch.stack([v[0].permute(1, 0, 2) for _, v in pairs])
    return torch.stack([keys, values]).contiguous()


def kv_to_cache(kv: torch.Tensor, config: Any = None):
    """Canonical `[2, L, T, H, D]` -> a DynamicCache the HF model accepts as `past_key_values`."""
    from transformers import DynamicCache

    if kv.dim() != 5 or kv.shape[0] != 2:
        raise CartridgeFormatError(
            f"KV must be [2, layers, tokens, kv_heads, head_dim], got {tuple(kv.shape)}"
        )
    per_layer = kv.permute(1, 0, 3, 2, 4).unsqueeze(2)  # [L, 2, 1, H, T, D]
    layers = [(layer[0].contiguous(), layer[1].contiguous()) for layer in per_layer]
    return DynamicCache(layers, config=config)


def compute_prefix_kv(model: Any, token_ids: list[int],
                      chunk_tokens: int | None = DEFAULT_PREFILL_CHUNK) -> torch.Tensor:
    """KV of `token_ids` (positions 0..n-1) in the canonical layout, in the model's dtype, on CPU.

    Runs on the model's device. Prefills `chunk_tokens` tokens per forward pass with the HF
    cache as `past_key_values` (`None`: all at once), so eager attention's score matrices are
    `[heads, chunk, prefix]`, not `[heads, n, n]` (tens of GB for a 32k-token document). The
    chunking itself is exact: the KV differs from the one-shot KV only where a GEMM kernel
    rounds differently for another number of rows (tests/test_create_options.py).
    Only the backbone runs: no logits are computed.
    """
    if not token_ids:
        raise CartridgeFormatError("cannot compute KV for an empty token sequence")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise CartridgeFormatError(f"prefill chunk must be a positive number of tokens, got {chunk_tokens}")
    limit = model.config.max_position_embeddings
    if len(token_ids) > limit:
        raise CartridgeFormatError(
            f"{len(token_ids)} tokens exceed the model's max_position_embeddings ({limit}); "
            "pass fewer tokens (max_tokens) or use a longer-context model"
        )
    device = next(model.parameters()).device
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    step = chunk_tokens or len(token_ids)
    cache = None
    with torch.inference_mode():
        for start in range(0, len(token_ids), step):
            out = model.base_model(input_ids=input_ids[:, start:start + step], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
    kv = cache_to_kv(cache).cpu()
    if kv.shape[2] != len(token_ids):  # e.g. a sliding-window cache that dropped old tokens
        raise CartridgeFormatError(f"the model's cache kept {kv.shape[2]} of {len(token_ids)} tokens: "
                                   "cannot make a cartridge of this model's KV")
    return kv

"""A PEFT `CARTRIDGE` adapter directory (peft >= 0.21, `peft/tuners/cartridge/`).

Runs wherever an input is read (CLI, gateway); needs `safetensors`, not peft. What
`PeftModel.save_pretrained` writes for a `CartridgeConfig`:
- `adapter_config.json`: `peft_type: "CARTRIDGE"`, `num_virtual_tokens` (p), `num_frozen_tokens`
  (leading frozen tokens, default 1), `base_model_name_or_path`, and the prompt-learning
  geometry `num_layers`, `num_attention_heads` (= the KV heads after PEFT's GQA adjustment),
  `token_dim` (= kv_heads * head_dim), `num_transformer_submodules` (1 for decoder-only);
- `adapter_model.safetensors`: `prompt_embeddings` `[p, num_layers * 2 * token_dim]`, fp32 by
  default, per virtual token layer 0 K, layer 0 V, layer 1 K, ... each `kv_heads x head_dim`.
  `PeftModel.get_prompt` views it as `[p, num_layers * 2, heads, head_dim]` and splits K/V pairs.
The tensor is read with safetensors (no pickle). A legacy `adapter_model.bin` goes through the
same restricted `torch.load` as every `.pt`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lmcache_cartridge.cartridge.inputs.common import LoadedCartridge
from lmcache_cartridge.cartridge.inputs.torchfile import safe_torch_load
from lmcache_cartridge.cartridge.manifest import id_from_name
from lmcache_cartridge.errors import CartridgeFormatError

FORMAT = "peft"
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
TENSOR_NAME = "prompt_embeddings"


def matches(directory: Path) -> bool:
    return (directory / CONFIG_NAME).is_file()


def _int(cfg: dict, key: str, where: Path) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise CartridgeFormatError(f"{where}: '{key}' must be a non-negative integer, got {v!r}")
    return v


def _prompt_embeddings(directory: Path) -> torch.Tensor:
    for name in WEIGHTS_NAMES:
        path = directory / name
        if not path.is_file():
            continue
        if name.endswith(".safetensors"):
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(path), framework="pt") as f:
                    if TENSOR_NAME not in f.keys():
                        raise CartridgeFormatError(f"{path}: no '{TENSOR_NAME}' tensor (found {sorted(f.keys())[:8]})")
                    return f.get_tensor(TENSOR_NAME)
            except SafetensorError as e:
                raise CartridgeFormatError(f"{path}: not a readable safetensors file ({e})") from None
        state = safe_torch_load(path)
        if not isinstance(state, dict) or not isinstance(state.get(TENSOR_NAME), torch.Tensor):
            raise CartridgeFormatError(f"{path}: no '{TENSOR_NAME}' tensor")
        return state[TENSOR_NAME]
    raise CartridgeFormatError(f"{directory}: a PEFT adapter needs {WEIGHTS_NAMES[0]}, which is missing")


def load(directory: Path) -> LoadedCartridge:
    cfg_path = directory / CONFIG_NAME
    try:
        cfg = json.loads(cfg_path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CartridgeFormatError(f"{cfg_path}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CartridgeFormatError(f"{cfg_path}: expected a JSON object")
    if cfg.get("peft_type") != "CARTRIDGE":
        raise CartridgeFormatError(
            f"{cfg_path}: peft_type is {cfg.get('peft_type')!r}; only CARTRIDGE adapters hold a KV "
            "cache (LoRA, prefix tuning and other adapters change the model, not its cache)")
    p = _int(cfg, "num_virtual_tokens", cfg_path)
    frozen = _int(cfg, "num_frozen_tokens", cfg_path) if "num_frozen_tokens" in cfg else 1
    layers = _int(cfg, "num_layers", cfg_path)
    heads = _int(cfg, "num_attention_heads", cfg_path)
    token_dim = _int(cfg, "token_dim", cfg_path)
    submodules = cfg.get("num_transformer_submodules", 1)
    if submodules not in (1, None):
        raise CartridgeFormatError(
            f"{cfg_path}: num_transformer_submodules={submodules} (an encoder-decoder adapter); only "
            "decoder-only models are served")
    if p == 0 or layers == 0 or heads == 0 or token_dim % heads or frozen > p:
        raise CartridgeFormatError(
            f"{cfg_path}: inconsistent geometry: num_virtual_tokens={p}, num_frozen_tokens={frozen}, "
            f"num_layers={layers}, num_attention_heads={heads}, token_dim={token_dim}")
    emb = _prompt_embeddings(directory)
    if emb.dim() != 2 or tuple(emb.shape) != (p, layers * 2 * token_dim):
        raise CartridgeFormatError(
            f"{directory}: {TENSOR_NAME} has shape {tuple(emb.shape)}, adapter_config.json implies "
            f"[{p}, {layers} layers * 2 * {token_dim}]")
    if not emb.is_floating_point():
        raise CartridgeFormatError(f"{directory}: {TENSOR_NAME} dtype {emb.dtype} is not floating point")
    # [p, L*2*H*D] -> [p, L, 2, H, D] (per token: layer 0 K, layer 0 V, layer 1 K, ...) -> [2, L, p, H, D]
    kv = emb.reshape(p, layers, 2, heads, token_dim // heads).permute(2, 1, 0, 3, 4).contiguous()
    base = cfg.get("base_model_name_or_path")
    return LoadedCartridge(
        kv=kv, token_ids=None, source_format=FORMAT, num_frozen_tokens=frozen,
        base_model=base if isinstance(base, str) and base else None,
        metadata={k: cfg[k] for k in ("peft_version", "task_type", "revision") if isinstance(cfg.get(k), str)},
        suggested_id=id_from_name(directory.resolve().name, fallback=None),
    )

"""Fixture writers: cartridge inputs written the way their makers' own code writes them.

Each function cites the code it follows; none is our own format. Used by tests/test_input_formats*.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.nn as nn
import yaml


def htd_list(kv: torch.Tensor, part: int) -> list[torch.Tensor]:
    """Canonical `[2, L, T, H, D]` -> per layer `[1, H, T, D]` (HF / TrainableCache layout)."""
    return [kv[part, i].permute(1, 0, 2).unsqueeze(0).contiguous() for i in range(kv.shape[1])]


def trainable_cache_state(kv: torch.Tensor, num_frozen_tokens: int, *, names: str = "frozen",
                          empty: str = "parameterlist") -> dict:
    """What HazyResearch/cartridges `TrainableCache(config, init_keys, init_values,
    num_frozen_tokens).save(path)` passes to torch.save (cartridges/cache.py): ParameterLists of
    `nn.Parameter(vec[:, :, :n].contiguous())` (frozen, requires_grad False) and
    `nn.Parameter(vec[:, :, n:].contiguous())`. `names="fixed"` is the pre-August-2025 naming.
    With zero frozen tokens the frozen lists are `nn.ParameterList([])`; `empty="none"` is what a
    cache built without init tensors holds, `empty="list"` the plain `[]` other code writes."""
    keys, values = htd_list(kv, 0), htd_list(kv, 1)
    n = num_frozen_tokens

    def frozen(vecs):
        if not n:
            return {"parameterlist": nn.ParameterList([]), "none": None, "list": []}[empty]
        return nn.ParameterList([nn.Parameter(v[:, :, :n].contiguous(), requires_grad=False) for v in vecs])

    fk, fv = frozen(keys), frozen(values)
    return {
        "trainable_keys": nn.ParameterList([nn.Parameter(v[:, :, n:].contiguous()) for v in keys]),
        "trainable_values": nn.ParameterList([nn.Parameter(v[:, :, n:].contiguous()) for v in values]),
        f"{names}_keys": fk,
        f"{names}_values": fv,
    }


@contextlib.contextmanager
def saved_as_if_on_cuda():
    """Make torch.save record storage locations as 'cuda:0', byte for byte what a save from a
    GPU writes (the location tag is the only device information in the file). Training runs on
    CUDA, so real checkpoints carry it; this machine has no GPU. Checked once against a real
    save on an H100 (torch 2.11): identical data.pkl."""
    registry = torch.serialization._package_registry
    # A fresh string per storage, like torch's own CUDA tagger (f"cuda:{index}"): pickle then
    # memoizes exactly as in a real GPU save.
    entry = (-1, lambda obj: f"cuda:{int('0')}" if obj.device.type == "cpu" else None, lambda obj, loc: None)
    registry.insert(0, entry)
    try:
        yield
    finally:
        registry.remove(entry)


def write_cartridges_run(run_dir: Path, kv: torch.Tensor, steps: list[int], num_frozen_tokens: int = 1) -> Path:
    """cartridges/train.py: `{run_dir}/cache-step{N}.pt` per save and a `cache_last.pt` symlink
    to the newest. Every step here holds `kv` (only the last one matters)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for step in steps:
        torch.save(trainable_cache_state(kv, num_frozen_tokens), run_dir / f"cache-step{step}.pt")
    link = run_dir / "cache_last.pt"
    os.symlink(f"cache-step{steps[-1]}.pt", link)
    return link


def write_tokasaurus_dir(directory: Path, kv: torch.Tensor, *, model: str, num_fixed_tokens: int = 1,
                         max_tokens: int | None = None, wandb_style: bool = False) -> Path:
    """tokasaurus (branch geoff/cartridges) scripts/cartridges/generate_fake_cartridges.py:
    `cartridge.pt` = dict of ParameterLists with `fixed_*` names, `config.yaml` = the training
    config (yaml.dump) with `kv_cache_initializer.max_tokens` and
    `model.pretrained_model_name_or_path`. `wandb_style`: the config as a W&B run export
    (`{key: {desc, value}}`) with a python tag, as `download_cartridge_from_wandb` receives it."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(trainable_cache_state(kv, num_fixed_tokens, names="fixed"), directory / "cartridge.pt")
    init = {"_config_type": {"_is_type": True, "_module": "capsules.kv_initialization.strategies.first_n_tokens",
                             "_qualname": "KVCacheInitFromFirstNTokensOfContext.Config"},
            "max_tokens": kv.shape[2] if max_tokens is None else max_tokens,
            "num_frozen_tokens": num_fixed_tokens}
    model_cfg = {"_config_type": {"_is_type": True, "_module": "capsules.config", "_qualname": "HFModelConfig"},
                 "pretrained_model_name_or_path": model, "attn_implementation": "einsum",
                 "tuning_method": "custom_prefix"}
    config = {"kv_cache_initializer": init, "model": model_cfg, "name": "test_cartridge", "device": "cuda",
              "epochs": 2, "lr": 0.02, "seed": 42}
    if wandb_style:
        config = {k: {"desc": None, "value": v} for k, v in config.items()}
        text = yaml.dump(config, indent=2, default_flow_style=False)
        text += "betas:\n  desc: null\n  value: !!python/tuple\n  - 0.9\n  - 0.999\n"
    else:
        text = yaml.dump(config, indent=2, default_flow_style=False)
    (directory / "config.yaml").write_text(text)
    return directory


def write_knlp_dir(directory: Path, kv: torch.Tensor, token_ids: list[int], *, model: str) -> Path:
    """knlp's cartridge builder: `torch.save(list of (k, v))` of HF `[1, H, T, D]` tensors as
    `cartridge.pt`, `meta.json` (model, dtype, n_layers, budget_tokens, prefix_token_ids_sha256 =
    sha256(json.dumps(ids))) and `prefix_token_ids.json`."""
    directory.mkdir(parents=True, exist_ok=True)
    layers = list(zip(htd_list(kv, 0), htd_list(kv, 1)))
    torch.save(layers, directory / "cartridge.pt")
    sha = hashlib.sha256(json.dumps(token_ids).encode("utf-8")).hexdigest()
    meta = {"model": model, "dtype": "bfloat16", "n_layers": len(layers), "budget_tokens": len(token_ids),
            "block_size": 16, "prefix_token_ids_sha256": sha}
    (directory / "meta.json").write_text(json.dumps(meta, indent=2))
    (directory / "prefix_token_ids.json").write_text(json.dumps(token_ids))
    return directory


def make_peft_adapter(model, directory: Path, *, num_virtual_tokens: int, num_frozen_tokens: int = 1,
                      seed: int = 0, scale: float = 1.0):
    """PEFT's own path: `get_peft_model(model, CartridgeConfig(...))` (random normal init, PEFT's
    `reset_parameters`), optionally scaled, then `save_pretrained`. Returns the PeftModel."""
    from peft import CartridgeConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = CartridgeConfig(task_type="CAUSAL_LM", num_virtual_tokens=num_virtual_tokens,
                          num_frozen_tokens=num_frozen_tokens)
    pm = get_peft_model(model, cfg)
    if scale != 1.0:
        enc = pm.prompt_encoder["default"]
        with torch.no_grad():
            enc.load_prompt_embeddings(enc.weight * scale)
    pm.save_pretrained(directory)
    return pm

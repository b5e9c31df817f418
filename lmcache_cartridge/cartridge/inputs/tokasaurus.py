"""A Tokasaurus cartridge directory: `<dir>/cartridge.pt` + `config.yaml`.

Runs wherever an input is read (CLI, gateway). Tokasaurus (branch `geoff/cartridges`,
`tokasaurus/manager/cartridge_downloader.py`, `manager/types.py`, `model/types.py`) downloads a
training run's checkpoint as `cartridge.pt` (a `TrainableCache.save()` file, `fixed_*` or
`frozen_*`) next to the run's `config.yaml`, and reads from the YAML
`kv_cache_initializer.max_tokens` (the cartridge length; W&B exports nest it under `value`) and
`model.pretrained_model_name_or_path` (the base model). W&B configs may carry `!!python/...`
tags, which Tokasaurus rewrites with PyYAML's unsafe loader; here they are read as plain data and
never constructed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lmcache_cartridge.cartridge.inputs import trainable_cache
from lmcache_cartridge.cartridge.inputs.common import LoadedCartridge, require_file
from lmcache_cartridge.cartridge.inputs.torchfile import safe_torch_load
from lmcache_cartridge.cartridge.manifest import id_from_name
from lmcache_cartridge.errors import CartridgeFormatError

FORMAT = "tokasaurus"
PT_NAME, CONFIG_NAME = "cartridge.pt", "config.yaml"


def matches(directory: Path) -> bool:
    return (directory / CONFIG_NAME).is_file() and (directory / PT_NAME).is_file()


class _PlainLoader(yaml.SafeLoader):
    """SafeLoader that reads python-specific tags (`!!python/tuple`, `!!python/object:...`) as the
    plain list / mapping / scalar under them instead of failing or constructing objects."""


def _plain(loader: yaml.SafeLoader, _suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_PlainLoader.add_multi_constructor("tag:yaml.org,2002:python/", _plain)
_PlainLoader.add_multi_constructor("!", _plain)


def read_config(path: Path) -> dict:
    try:
        cfg = yaml.load(path.read_text("utf-8"), Loader=_PlainLoader)  # noqa: S506 (safe subclass)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise CartridgeFormatError(f"{path}: not readable YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict):
        raise CartridgeFormatError(f"{path}: expected a mapping at the top level")
    return cfg


def _section(cfg: dict, name: str) -> dict:
    sec = cfg.get(name) or {}
    if isinstance(sec, dict) and isinstance(sec.get("value"), dict) and len(set(sec) - {"value", "desc"}) == 0:
        sec = sec["value"]  # W&B export: {name: {desc: ..., value: {...}}}
    return sec if isinstance(sec, dict) else {}


def load(directory: Path) -> LoadedCartridge:
    cfg = read_config(require_file(directory / CONFIG_NAME, "a Tokasaurus cartridge"))
    pt = require_file(directory / PT_NAME, "a Tokasaurus cartridge")
    obj = safe_torch_load(pt)
    if not trainable_cache.matches(obj):
        raise CartridgeFormatError(f"{pt}: expected a TrainableCache checkpoint (trainable_keys, ...)")
    loaded = trainable_cache.parse(obj)
    init, model = _section(cfg, "kv_cache_initializer"), _section(cfg, "model")
    max_tokens = init.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise CartridgeFormatError(f"{directory / CONFIG_NAME}: kv_cache_initializer.max_tokens is missing")
    if max_tokens != loaded.num_tokens:
        raise CartridgeFormatError(
            f"{directory}: config.yaml says kv_cache_initializer.max_tokens={max_tokens} but "
            f"cartridge.pt holds {loaded.num_tokens} tokens ({loaded.num_frozen_tokens} frozen)")
    name = model.get("pretrained_model_name_or_path")
    loaded.base_model = name if isinstance(name, str) and name else None
    loaded.source_format = FORMAT
    loaded.metadata = {"max_tokens": max_tokens}
    if isinstance(init.get("num_frozen_tokens"), int):
        loaded.metadata["config_num_frozen_tokens"] = init["num_frozen_tokens"]
    loaded.suggested_id = id_from_name(directory.resolve().name, fallback=None)
    return loaded

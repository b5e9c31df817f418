"""`make demo`: build what it needs, then serve a cartridge. Runs on this machine, no cloud account.

Steps (each printed with the equivalent command):
1. the tiny local test model (built once, cached under $LMCACHE_CARTRIDGE_HOME/models);
2. a first-k cartridge from the document shipped in the package (`create`), `inspect`, `verify`;
3. `register` it in a demo registry and `doctor` the LMCache config the server would load;
4. LMCache's own engine, built from that YAML, finds the cartridge's chunks through the plugin.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from . import cli
from .paths import cache_root

REPO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "lmcache-cartridge.yaml"


def run_cli(*args: str) -> None:
    print(f"\n$ lmcache-cartridge {' '.join(shlex.quote(a) for a in args)}", flush=True)
    rc = cli.main(list(args))
    if rc != 0:
        raise SystemExit(f"demo step failed: lmcache-cartridge {args[0]} exited {rc}")


def demo_config(registry: Path, out: Path) -> Path:
    cfg = yaml.safe_load(REPO_CONFIG.read_text())
    cfg["extra_config"]["storage_plugin.cartridge.registry"] = str(registry)
    cfg["max_local_cpu_size"] = 1
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def lookup_through_lmcache(config_path: Path, model: str, token_ids: list[int]) -> int:
    """Build LMCache's engine from the YAML (its loader creates the plugin) and look up the prompt."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model)
    head_dim = hf.hidden_size // hf.num_attention_heads
    config = LMCacheEngineConfig.from_file(str(config_path))
    metadata = LMCacheMetadata(
        model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, chunk_size=config.chunk_size,
        kv_shape=(hf.num_hidden_layers, 2, config.chunk_size, hf.num_key_value_heads, head_dim))
    engine = LMCacheEngineBuilder.get_or_create("demo", config, metadata, None, None, None)
    try:
        engine.post_init()
        return engine.lookup(token_ids)
    finally:
        LMCacheEngineBuilder.destroy("demo")


def main() -> int:
    from .testmodel import ensure_test_model

    work = cache_root() / "demo"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print("== 1. test model", flush=True)
    model_dir = ensure_test_model()
    print(f"model: {model_dir}")

    print("\n== 2. create a first-k cartridge from the shipped document", flush=True)
    doc = Path(__file__).parent / "assets" / "document.txt"
    packed = work / "lighthouse"
    run_cli("create", "--model-dir", str(model_dir), "--text", str(doc), "-o", str(packed),
            "--id", "lighthouse", "--max-tokens", "512", "--label", "demo")
    run_cli("inspect", str(packed))
    run_cli("verify", str(packed))

    print("\n== 3. register and check the serving config", flush=True)
    registry = work / "registry.db"
    run_cli("register", str(packed), "--registry", str(registry))
    run_cli("list", "--registry", str(registry))
    config = demo_config(registry, work / "lmcache.yaml")
    run_cli("doctor", "--config", str(config), "--model", str(model_dir), "--verify")

    print("\n== 4. LMCache's engine (built from the YAML) looks the cartridge up", flush=True)
    from .manifest import Manifest

    m = Manifest.load(packed)
    user = [7, 8, 9]
    hit = lookup_through_lmcache(config, str(model_dir), m.token_ids + user)
    print(f"prompt of {len(m.token_ids) + len(user)} tokens: {hit} served from the cartridge "
          f"({m.num_full_chunks} chunks of {m.chunk_size}), the rest computed by the model")
    if hit != m.num_full_chunks * m.chunk_size:
        print("demo FAILED: LMCache did not find the cartridge", file=sys.stderr)
        return 1
    print("\ndemo OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

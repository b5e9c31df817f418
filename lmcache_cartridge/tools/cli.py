"""`lmcache-cartridge`: the command line. Runs on an operator's machine or next to a server.

User mistakes end in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.paths import default_cache_dir, default_packed_dir, default_registry_path

EXIT_USAGE = 2
EXIT_PROBLEMS = 1


def _default_id(path: Path) -> str:
    from lmcache_cartridge.store.registration import default_id

    return default_id(path.stem if path.is_file() else path.name)


def _vocab_from_args(args):
    from lmcache_cartridge.cartridge.packed import VocabInfo
    from lmcache_cartridge.store.registration import load_vocab

    if args.vocab_size:
        return VocabInfo(args.vocab_size, tuple(args.special_id or ()))
    if args.model_dir:
        return load_vocab(args.model_dir)
    return None


# --- pack -------------------------------------------------------------------------------------
def cmd_pack(args) -> int:
    import torch

    from lmcache_cartridge.cartridge.formats import load_input
    from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME
    from lmcache_cartridge.cartridge.packed import PackedCartridge, pack_kv, rechunk

    src = Path(args.input)
    out = Path(args.output)
    if src.is_dir() and (src / MANIFEST_NAME).exists():
        m = rechunk(PackedCartridge(src), out, args.chunk_size, overwrite=args.overwrite)
        print(f"re-chunked {m.cartridge_id}: {m.num_tokens} tokens in {len(m.chunks)} chunks -> {out}")
        return 0
    loaded = load_input(src)
    meta = loaded.metadata
    model = args.model or meta.get("model") or args.model_dir
    if not model:
        raise CartridgeError("name the model the KV belongs to: --model NAME (as vLLM's --model)")
    kv, kind, provenance = loaded.kv, args.kind, {"source": str(src), "source_format": loaded.source_format}
    if kv is None:  # token-only cartridge: compute its KV once with the model
        if not args.model_dir:
            raise CartridgeError(
                f"{src} holds only token ids; pass --model-dir DIR to compute its KV with the model"
            )
        from lmcache_cartridge.cartridge.model_kv import compute_prefix_kv, load_model

        hf_model, _ = load_model(args.model_dir)
        kv = compute_prefix_kv(hf_model, loaded.token_ids)
        provenance["kv_computed_with"] = str(args.model_dir)
    if kind is None:
        kind = "first_k" if loaded.token_ids is not None else "trained"
    dtype = getattr(torch, args.dtype) if args.dtype else None
    m = pack_kv(
        kv,
        out,
        cartridge_id=args.id or _default_id(src),
        model=model,
        kind=kind,
        token_ids=loaded.token_ids if kind == "first_k" else None,
        vocab=_vocab_from_args(args) if kind == "trained" else None,
        chunk_size=args.chunk_size,
        dtype=dtype,
        provenance=provenance,
        labels=args.label or meta.get("labels", []) or [],
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    print(f"packed {m.cartridge_id} ({m.kind}): {m.num_tokens} tokens, {len(m.chunks)} chunks, "
          f"{m.payload_nbytes / 2**20:.1f} MiB -> {out}")
    return 0


# --- inspect / verify -------------------------------------------------------------------------
def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def cmd_inspect(args) -> int:
    from lmcache_cartridge.cartridge.manifest import Manifest

    m = Manifest.load(args.path)
    if args.json:
        print(m.to_json())
        return 0
    ids = m.token_ids
    preview = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
    print(_table([
        ("id", m.cartridge_id),
        ("kind", m.kind),
        ("model", m.model),
        ("layers x kv_heads x head_dim", f"{m.num_layers} x {m.num_kv_heads} x {m.head_dim}"),
        ("dtype", m.dtype),
        ("tokens", f"{m.num_tokens} ({m.num_full_chunks} full chunks of {m.chunk_size})"),
        ("payload", f"{m.payload_nbytes} bytes ({m.payload_nbytes / 2**20:.2f} MiB)"),
        ("token ids", f"[{preview}]"),
        ("content hash", m.content_hash),
        ("labels", ", ".join(m.labels) or "-"),
        ("created", m.created_at),
        ("provenance", json.dumps(m.provenance, sort_keys=True)),
    ]))
    print()
    print(f"{'chunk':>5}  {'tokens':>6}  {'offset':>12}  {'bytes':>10}  sha256")
    for c in m.chunks:
        print(f"{c.index:>5}  {c.num_tokens:>6}  {c.offset:>12}  {c.nbytes:>10}  {c.sha256[:16]}")
    return 0


def cmd_verify(args) -> int:
    from lmcache_cartridge.cartridge.packed import PackedCartridge

    with PackedCartridge(args.path) as p:
        report = p.verify()
    if report.ok:
        print(f"OK: {p.manifest.cartridge_id}: {report.chunks_checked} chunks, checksums match, all values finite")
        return 0
    for problem in report.problems:
        print(f"FAIL: {problem}")
    return EXIT_PROBLEMS


# --- create -----------------------------------------------------------------------------------
def cmd_create(args) -> int:
    from lmcache_cartridge.tools.create import create_first_k
    from lmcache_cartridge.cartridge.packed import pack_kv

    text = Path(args.text).read_text(encoding="utf-8")
    made = create_first_k(args.model_dir, text, max_tokens=args.max_tokens,
                          sci_chunk=args.sci_chunk, seed=args.seed)
    out = Path(args.output)
    m = pack_kv(
        made.kv,
        out,
        cartridge_id=args.id or _default_id(Path(args.text)),
        model=args.model or str(args.model_dir),
        kind="first_k",
        token_ids=made.token_ids,
        chunk_size=args.chunk_size,
        provenance=made.provenance,
        labels=args.label or [],
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    print(f"created {m.cartridge_id}: {m.num_tokens} tokens of {args.text}, {len(m.chunks)} chunks -> {out}")
    return 0


def cmd_test_model(args) -> int:
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    print(ensure_test_model(Path(args.root) if args.root else None))
    return 0


# --- registry ---------------------------------------------------------------------------------
def _registry(args):
    from lmcache_cartridge.store.registry import Registry

    settings = _plugin_settings(args)
    return Registry(settings.registry if settings else args.registry)


def _load_lmcache_config(path):
    from lmcache.v1.config import LMCacheEngineConfig

    if not Path(path).is_file():
        raise CartridgeError(f"{path}: no such LMCache config file")
    try:
        return LMCacheEngineConfig.from_file(str(path))
    except Exception as e:  # LMCache raises assorted errors for bad YAML
        raise CartridgeError(f"{path}: LMCache cannot load this config: {e}") from e


def _plugin_settings(args):
    if not getattr(args, "config", None):
        return None
    from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
    from lmcache_cartridge.lmcache.settings import PluginSettings

    return PluginSettings.from_config(_load_lmcache_config(args.config), CartridgeStoragePlugin)


def cmd_register(args) -> int:
    from lmcache_cartridge.cartridge.packed import PackedCartridge, rechunk
    
    settings = _plugin_settings(args)
    if args.path.startswith("s3://"):
        from lmcache_cartridge.cartridge.compat import EngineShape
        from lmcache_cartridge.store.registration import register_s3
        from lmcache_cartridge.store.s3 import S3Settings

        s3 = dict(settings.s3 if settings else {})
        if args.s3_endpoint:
            s3["endpoint_url"] = args.s3_endpoint
        if args.s3_region:
            s3["region"] = args.s3_region
        cache_dir = settings.cache_dir if settings else default_cache_dir()
        entry = register_s3(_registry(args), args.path, cache_dir, S3Settings.from_mapping(s3),
                            labels=args.label or [], force_redownload=args.force_redownload,
                            engine=EngineShape.partial(chunk_size=args.chunk_size))
        print(f"registered {entry.id} ({entry.kind}, {entry.num_tokens} tokens, model {entry.model}) "
              f"from {entry.source_uri}{' (servers will download it again)' if args.force_redownload else ''}")
        return 0
    path = Path(args.path).resolve()
    with PackedCartridge(path) as packed:
        m = packed.manifest
        if args.chunk_size and m.chunk_size != args.chunk_size:
            target = Path(args.packed_dir or default_packed_dir()) / f"{m.cartridge_id}-c{args.chunk_size}"
            rechunk(packed, target, args.chunk_size, overwrite=True)
            print(f"re-chunked {m.cartridge_id} from {m.chunk_size} to {args.chunk_size} tokens -> {target}")
            path = target
    entry = _registry(args).register(path, source_uri=str(Path(args.path).resolve()), labels=args.label or [],
                                     force_redownload=args.force_redownload)
    print(f"registered {entry.id} ({entry.kind}, {entry.num_tokens} tokens, model {entry.model}) from {entry.path}")
    return 0


def cmd_list(args) -> int:
    entries = _registry(args).list()
    if args.json:
        from dataclasses import asdict

        print(json.dumps([asdict(e) for e in entries], indent=1))
        return 0
    if not entries:
        print("no cartridges registered")
        return 0
    head = ("id", "kind", "model", "tokens", "chunk", "shape LxHxD", "dtype", "labels", "path")
    rows = [(e.id, e.kind, e.model, str(e.num_tokens), str(e.chunk_size),
             f"{e.num_layers}x{e.num_kv_heads}x{e.head_dim}", e.dtype, ",".join(e.labels) or "-", e.path)
            for e in entries]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_remove(args) -> int:
    if not _registry(args).remove(args.id):
        raise CartridgeError(f"no cartridge {args.id!r} is registered")
    print(f"removed {args.id} from the registry (its files were not touched)")
    return 0


def cmd_label(args) -> int:
    e = _registry(args).label(args.id, add=args.add or [], remove=args.remove or [])
    print(f"{e.id}: labels {', '.join(e.labels) or '-'}")
    return 0


def cmd_doctor(args) -> int:
    """Check a config the way LMCache will load it, then every registered cartridge against it."""
    from lmcache_cartridge.cartridge.compat import EngineShape, mismatch
    from lmcache_cartridge.cartridge.keys import hash_config_problem
    from lmcache_cartridge.cartridge.manifest import Manifest
    from lmcache_cartridge.cartridge.packed import PackedCartridge
    from lmcache_cartridge.store.origins import has_payload
    from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
    from lmcache_cartridge.store.registry import Registry
    from lmcache_cartridge.lmcache.settings import PluginSettings

    results: list[tuple[str, str]] = []

    def check(level: str, msg: str) -> None:
        results.append((level, msg))
        print(f"{level:<4}  {msg}")

    config = _load_lmcache_config(args.config)
    check("OK", f"{args.config} loads as an LMCacheEngineConfig")
    try:
        settings = PluginSettings.from_config(config, CartridgeStoragePlugin)
        check("OK", f"storage plugin '{settings.name}' -> {CartridgeStoragePlugin.__module__}.{CartridgeStoragePlugin.__name__}")
    except CartridgeError as e:
        check("FAIL", f"plugin not configured: {e}")
        return EXIT_PROBLEMS
    if not config.local_cpu or not config.max_local_cpu_size or config.max_local_cpu_size <= 0:
        check("FAIL", "local_cpu must be true and max_local_cpu_size > 0: LocalCPUBackend is the allocator the plugin fills")
    else:
        check("OK", f"LocalCPUBackend allocator: {config.max_local_cpu_size} GB")
    if config.store_location != "LocalCPUBackend":
        check("WARN", f"store_location is {config.store_location!r}; set it to LocalCPUBackend so puts never reach the read-only plugin")
    problem = hash_config_problem(config.pre_caching_hash_algorithm)
    check("FAIL" if problem and not settings.allow_unstable_hash else "OK",
          problem or f"hash {config.pre_caching_hash_algorithm}: scheduler and workers agree on keys")
    if config.use_layerwise:
        check("FAIL", "use_layerwise: true is not supported by the cartridge plugin")
    try:
        entries = Registry(settings.registry).list()
        check("OK", f"registry {settings.registry}: {len(entries)} cartridges")
    except CartridgeError as e:
        check("FAIL", str(e))
        entries = []
    engine = EngineShape.partial(model_names=(args.model, *settings.accept_models) if args.model else None,
                                 chunk_size=int(config.chunk_size))
    for e in entries:
        try:
            if has_payload(e.source_uri):
                with PackedCartridge(e.path) as p:
                    m = p.manifest
                    report = p.verify() if args.verify else None
            else:  # S3 or composite: the manifest is here, the bytes are read where they live
                m, report = Manifest.load(e.path), None
        except CartridgeError as err:
            check("FAIL", f"{e.id}: {err}")
            continue
        why = mismatch(m, engine)
        if why:
            check("FAIL", f"{e.id}: {why}")
        elif report is not None and not report.ok:
            check("FAIL", f"{e.id}: " + "; ".join(report.problems))
        else:
            check("OK", f"{e.id}: {m.kind}, {m.num_full_chunks} servable chunks, model {m.model}")
    return EXIT_PROBLEMS if any(level == "FAIL" for level, _ in results) else 0


def cmd_stats(args) -> int:
    """Sum the tier counters that running plugins publish under their cache dir."""
    from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
    from lmcache_cartridge.lmcache.settings import PluginSettings

    if args.config:
        stats_dir = PluginSettings.from_config(_load_lmcache_config(args.config), CartridgeStoragePlugin).cache_dir / "stats"
    else:
        
        stats_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
        stats_dir = stats_dir / "stats"
    files = sorted(stats_dir.glob("*.json"))
    if not files:
        print(f"no statistics under {stats_dir} (no plugin has run with this cache dir)")
        return 0
    totals: dict[str, dict[str, int]] = {}
    for f in files:
        for tier, s in json.loads(f.read_text())["tiers"].items():
            t = totals.setdefault(tier, {"hits": 0, "misses": 0, "bytes": 0, "evictions": 0, "errors": 0})
            for k in t:
                t[k] += s.get(k, 0)
    if args.json:
        print(json.dumps({"sources": [f.name for f in files], "tiers": totals}, indent=1))
        return 0
    print(f"{len(files)} plugin instance(s) reporting from {stats_dir}")
    print(f"{'tier':<8}{'hits':>10}{'misses':>10}{'MiB':>12}{'evictions':>11}{'errors':>8}")
    for tier, t in sorted(totals.items()):
        print(f"{tier:<8}{t['hits']:>10}{t['misses']:>10}{t['bytes'] / 2**20:>12.1f}{t['evictions']:>11}{t['errors']:>8}")
    return 0


def cmd_gateway(args) -> int:
    """Serve the OpenAI-compatible gateway in front of a vLLM server."""
    import uvicorn

    from lmcache_cartridge.api.gateway import GatewaySettings, create_app
    
    settings = _plugin_settings(args)
    config = _load_lmcache_config(args.config) if args.config else None
    gs = GatewaySettings(
        upstream=args.upstream.rstrip("/"),
        model=args.model,
        tokenizer=args.tokenizer or args.model,
        registry=settings.registry if settings else Path(args.registry or default_registry_path()),
        cache_dir=settings.cache_dir if settings else default_cache_dir(),
        chunk_size=int(config.chunk_size) if config else args.chunk_size,
        local_roots=tuple(Path(r) for r in (args.allow_local or [])),
        s3=dict(settings.s3) if settings else ({"endpoint_url": args.s3_endpoint} if args.s3_endpoint else {}),
        max_cartridges=args.max_cartridges,
        max_body_bytes=args.max_body_bytes,
        serve_timeout=args.serve_timeout,
    )
    uvicorn.run(create_app(gs), host=args.host, port=args.port, log_level="warning")
    return 0


# --- parser -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmcache-cartridge", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    sp = add("pack", cmd_pack, "convert a cartridge (.pt in any supported format, or a packed dir) to the packed format")
    sp.add_argument("input")
    sp.add_argument("-o", "--output", required=True, help="directory to create")
    sp.add_argument("--id", help="cartridge id (default: from the file name)")
    sp.add_argument("--model", help="model name as vLLM's --model (default: metadata['model'] or --model-dir)")
    sp.add_argument("--model-dir", help="local HF model: vocabulary for placeholder ids, KV for token-only input")
    sp.add_argument("--kind", choices=["first_k", "trained"], help="default: first_k when token ids are given")
    sp.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk_size of the serving config")
    sp.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="convert KV to this dtype")
    sp.add_argument("--vocab-size", type=int, help="vocabulary size, instead of --model-dir")
    sp.add_argument("--special-id", type=int, action="append", help="special token id to avoid (repeatable)")
    sp.add_argument("--label", action="append", help="label (repeatable)")
    sp.add_argument("--overwrite", action="store_true")
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    sp = add("inspect", cmd_inspect, "show a packed cartridge's manifest")
    sp.add_argument("path")
    sp.add_argument("--json", action="store_true")

    sp = add("verify", cmd_verify, "recompute checksums and check values of a packed cartridge")
    sp.add_argument("path")

    sp = add("create", cmd_create, "make a first-k cartridge from a text document with a local HF model")
    sp.add_argument("--model-dir", required=True)
    sp.add_argument("--text", required=True, help="UTF-8 text file")
    sp.add_argument("-o", "--output", required=True)
    sp.add_argument("--model", help="model name recorded in the manifest (default: --model-dir)")
    sp.add_argument("--id")
    sp.add_argument("--max-tokens", type=int)
    sp.add_argument("--sci-chunk", type=int, help="sampled-chunk initialisation with chunks of this many tokens")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--chunk-size", type=int, default=256)
    sp.add_argument("--label", action="append")
    sp.add_argument("--overwrite", action="store_true")
    sp.add_argument("-q", "--quiet", action="store_true")

    sp = add("test-model", cmd_test_model, "build (once) the tiny local test model and print its directory")
    sp.add_argument("--root")

    def reg_opts(sp):
        sp.add_argument("--registry", help="registry database (default: $LMCACHE_CARTRIDGE_HOME/registry.db)")
        sp.add_argument("--config", help="LMCache YAML: use its plugin's registry")

    sp = add("register", cmd_register, "add a packed cartridge (directory or s3://bucket/prefix) to the registry; servers pick it up without restart")
    sp.add_argument("path")
    sp.add_argument("--label", action="append")
    sp.add_argument("--chunk-size", type=int, help="serving chunk_size: re-chunk a copy if the cartridge differs")
    sp.add_argument("--packed-dir", help="where re-chunked copies go (default: $LMCACHE_CARTRIDGE_HOME/packed)")
    sp.add_argument("--force-redownload", action="store_true", help="running servers drop cached copies and fetch again")
    sp.add_argument("--s3-endpoint", help="S3-compatible endpoint URL (s3:// paths)")
    sp.add_argument("--s3-region")
    reg_opts(sp)

    sp = add("list", cmd_list, "list registered cartridges")
    sp.add_argument("--json", action="store_true")
    reg_opts(sp)

    sp = add("remove", cmd_remove, "remove a cartridge from the registry (files are kept)")
    sp.add_argument("id")
    reg_opts(sp)

    sp = add("label", cmd_label, "add or remove labels")
    sp.add_argument("id")
    sp.add_argument("--add", action="append")
    sp.add_argument("--remove", action="append")
    reg_opts(sp)

    sp = add("gateway", cmd_gateway, "OpenAI-compatible gateway adding the `cartridges` field in front of vLLM")
    sp.add_argument("--upstream", required=True, help="the vLLM server, e.g. http://127.0.0.1:8000")
    sp.add_argument("--model", required=True, help="the upstream model name (vLLM --model)")
    sp.add_argument("--tokenizer", help="local tokenizer directory (default: --model)")
    sp.add_argument("--config", help="the server's LMCache YAML (registry, cache dir, S3, chunk size)")
    sp.add_argument("--registry")
    sp.add_argument("--chunk-size", type=int, default=256)
    sp.add_argument("--allow-local", action="append", help="directory local cartridge paths may come from (repeatable)")
    sp.add_argument("--s3-endpoint")
    sp.add_argument("--max-cartridges", type=int, default=4)
    sp.add_argument("--max-body-bytes", type=int, default=4 << 20)
    sp.add_argument("--serve-timeout", type=float, default=15.0,
                    help="seconds to wait for the engine's plugins to serve a newly registered cartridge (then 503)")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=8100)

    sp = add("stats", cmd_stats, "per-tier hits, misses, bytes and evictions of running plugins")
    sp.add_argument("--config", help="LMCache YAML: use its plugin's cache dir")
    sp.add_argument("--cache-dir")
    sp.add_argument("--json", action="store_true")

    sp = add("doctor", cmd_doctor, "check an LMCache config and its registered cartridges as the server will load them")
    sp.add_argument("--config", required=True)
    sp.add_argument("--model", help="the model name the server will use (vLLM --model)")
    sp.add_argument("--verify", action="store_true", help="also recompute every chunk checksum")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except CartridgeError as e:
        print(f"lmcache-cartridge: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"lmcache-cartridge: error: {e.strerror}: {e.filename}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

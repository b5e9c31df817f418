"""`lmcache-cartridge`: the command line. Runs on an operator's machine or next to a server.

User mistakes end in one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Callable

from lmcache_cartridge.api.settings import API_KEY_ENV
from lmcache_cartridge.errors import CartridgeError
from lmcache_cartridge.paths import default_cache_dir, default_packed_dir, default_registry_path
from lmcache_cartridge.tools.stopping import sigterm_as_interrupt

EXIT_USAGE = 2
EXIT_PROBLEMS = 1
# The config the server loads (LMCache reads it from this variable): every command's --config
# default, so that inside the server's pod `list`, `stats` and `doctor` see its registry. Without
# a file, a server configured by the LMCACHE_* environment alone (`configured_by_environment`) is
# read from that environment the same way.
SERVER_CONFIG = os.environ.get("LMCACHE_CONFIG_FILE") or None


def _server_config(args) -> bool:
    """Whether a command reads the server's LMCache config: --config (or LMCACHE_CONFIG_FILE), or
    the LMCACHE_* environment the server itself is configured by."""
    from lmcache_cartridge.lmcache.settings import configured_by_environment

    return bool(getattr(args, "config", None)) or configured_by_environment()


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
    """Pack any input format into the packed format, or re-chunk a packed cartridge (`tools.pack`)."""
    from lmcache_cartridge.tools.pack import pack_input

    src, out = Path(args.input), Path(args.output)
    p = pack_input(src, out, model=args.model, model_dir=args.model_dir, kind=args.kind, dtype=args.dtype,
                   cartridge_id=args.id, chunk_size=args.chunk_size, vocab=lambda: _vocab_from_args(args),
                   labels=args.label, overwrite=args.overwrite, progress=not args.quiet,
                   check_model=not getattr(args, "allow_model_mismatch", False))
    m = p.manifest
    if p.source_format is None:
        print(f"re-chunked {m.cartridge_id}: {m.num_tokens} tokens in {len(m.chunks)} chunks -> {out}")
        return 0
    print(f"read {src} as {p.source_format}" + (f" (base model {p.base_model})" if p.base_model else ""))
    print(f"packed {m.cartridge_id} ({m.kind}): {m.num_tokens} tokens, {len(m.chunks)} chunks, "
          f"{m.payload_nbytes / 2**20:.1f} MiB -> {out}")
    _say_model_name(m.model, given=m.model != args.model_dir)
    return 0


# --- inspect / verify -------------------------------------------------------------------------
def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def cmd_inspect(args) -> int:
    """A packed cartridge: its manifest, with what its input was read as. Any other input (a
    `.pt` or a cartridge directory): which format it is read as, and what it holds."""
    from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME, Manifest

    path = Path(args.path)
    if not (path.is_dir() and (path / MANIFEST_NAME).exists()):
        from lmcache_cartridge.cartridge.formats import load_input
        from lmcache_cartridge.cartridge.inputs import describe

        info = describe(load_input(path))
        if args.json:
            print(json.dumps({"path": str(path), **info}, indent=1, sort_keys=True, default=str))
            return 0
        geometry = (f"{info['num_layers']} x {info['num_kv_heads']} x {info['head_dim']}"
                    if info["num_layers"] is not None else "-")
        frozen = f" ({info['num_frozen_tokens']} frozen first)" if info["num_frozen_tokens"] else ""
        print(_table([
            ("path", str(path)),
            ("read as", f"{info['read_as']}: {info['description']}"),
            ("packs as", info["packs_as"]),
            ("base model", info["base_model"] or "- (not recorded by this format)"),
            ("layers x kv_heads x head_dim", geometry),
            ("dtype", info["dtype"] or "-"),
            ("tokens", f"{info['num_tokens']}{frozen}"),
            ("default id", info["suggested_id"] or "-"),
            ("metadata", json.dumps(info["metadata"], sort_keys=True, default=str)),
        ]))
        return 0
    m = Manifest.load(args.path)
    if args.json:
        print(m.to_json())
        return 0
    ids = m.token_ids
    preview = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
    prov = m.provenance
    read_as = prov.get("source_format") or "-"
    print(_table([
        ("id", m.cartridge_id),
        ("kind", m.kind),
        ("model", m.model),
        ("read as", read_as + (f" (base model {prov['base_model']})" if prov.get("base_model") else "")),
        ("layers x kv_heads x head_dim", f"{m.num_layers} x {m.num_kv_heads} x {m.head_dim}"),
        ("dtype", m.dtype),
        ("tokens", f"{m.num_tokens} ({m.num_full_chunks} full chunks of {m.chunk_size})"),
        ("payload", f"{m.payload_nbytes} bytes ({m.payload_nbytes / 2**20:.2f} MiB)"),
        ("layout", f"format {m.format_version}, {m.layout}" + (
            " (each TP rank reads only its KV heads)" if m.layout == "by_head" else
            " (every TP rank reads whole chunks; re-pack to read per rank)")),
        ("token ids", f"[{preview}]"),
        *([("after", f"{len(m.context_ids)} computed tokens ({m.context_chunks} chunks LMCache holds, not "
                     "this cartridge): its chunk keys are chained after them")] if m.context_ids else []),
        ("content hash", m.content_hash),
        ("labels", ", ".join(m.labels) or "-"),
        ("created", m.created_at),
        ("provenance", json.dumps(prov, sort_keys=True)),
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
    """Everything a user can get wrong (the text, the options, the output directory) is checked
    before the model is loaded or vLLM started: the forward pass takes minutes."""
    from lmcache_cartridge.cartridge.manifest import id_from_path, validate_id
    from lmcache_cartridge.cartridge.model_kv import DEFAULT_PREFILL_CHUNK, resolve_device
    from lmcache_cartridge.cartridge.packed import pack_kv
    from lmcache_cartridge.cartridge.packed import check_output_dir
    from lmcache_cartridge.tools.create import create_first_k

    text = Path(args.text).read_text(encoding="utf-8")
    out = Path(args.output)
    cartridge_id = args.id or id_from_path(args.text)
    validate_id(cartridge_id)
    kv_from = args.kv_from or default_kv_from()
    if kv_from == "vllm" and (args.device is not None or args.prefill_chunk is not None):
        raise CartridgeError("--device and --prefill-chunk are for --kv-from hf (vLLM runs on its own device)")
    device = resolve_device(args.device or "cpu")
    check_output_dir(out, args.overwrite)
    if kv_from == "vllm":
        import tempfile

        from lmcache_cartridge.tools.engine_kv import EngineKVMaker

        with tempfile.TemporaryDirectory(prefix="kv-maker-") as work, \
                EngineKVMaker(args.model_dir, work, threads_bind=args.cpu_bind) as engine:
            print("computing the KV with vLLM (a private server; --kv-from hf to use transformers)", flush=True)
            made = create_first_k(args.model_dir, text, max_tokens=args.max_tokens,
                                  sci_chunk=args.sci_chunk, seed=args.seed, engine=engine)
    else:
        print(f"computing the KV with transformers on {device}", flush=True)
        made = create_first_k(args.model_dir, text, max_tokens=args.max_tokens,
                              sci_chunk=args.sci_chunk, seed=args.seed, device=device,
                              prefill_chunk=DEFAULT_PREFILL_CHUNK if args.prefill_chunk is None else args.prefill_chunk)
    m = pack_kv(
        made.kv,
        out,
        cartridge_id=cartridge_id,
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
    _say_model_name(m.model, given=bool(args.model))
    return 0


def _say_model_name(model: str, given: bool) -> None:
    """Where the model-name trap is set, say so: the name recorded must be vLLM's --model string
    exactly, and without --model it is the directory."""
    if not given:
        print(f"model name recorded: {model!r} (the model directory). vLLM must be started with exactly this "
              "--model, or the plugin's accept_models must name it; pass --model NAME to record vLLM's name")


def default_kv_from() -> str:
    """`create`'s KV source when not given: vLLM (the serving engine) where it is installed."""
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def cmd_test_model(args) -> int:
    from lmcache_cartridge.tools.testmodel import ensure_test_model

    print(ensure_test_model(Path(args.root) if args.root else None, family=args.family))
    return 0


# --- registry ---------------------------------------------------------------------------------
def _registry(args, create: bool = True):
    """The registry the config (or --registry) names; `create=False` for commands that only read."""
    from lmcache_cartridge.store.registry import Registry

    settings = _plugin_settings(args)
    return Registry(settings.registry if settings else args.registry, create=create)


def _load_lmcache_config(path):
    """The config as the server loads it (`lmcache.settings.load_lmcache_config`)."""
    from lmcache_cartridge.lmcache.settings import load_lmcache_config

    return load_lmcache_config(path)


def _plugin_settings(args):
    if not _server_config(args):
        return None
    from lmcache_cartridge.lmcache.plugin import CartridgeStoragePlugin
    from lmcache_cartridge.lmcache.settings import PluginSettings

    return PluginSettings.from_config(_load_lmcache_config(args.config), CartridgeStoragePlugin)


def _s3_from_args(args) -> dict:
    """S3 settings for a command: the --config plugin's, else --s3-endpoint / --s3-region."""
    settings = _plugin_settings(args)
    s3 = dict(settings.s3) if settings else {}
    if getattr(args, "s3_endpoint", None):
        s3["endpoint_url"] = args.s3_endpoint
    if getattr(args, "s3_region", None):
        s3["region"] = args.s3_region
    return s3


def cmd_publish(args) -> int:
    """Upload a packed cartridge into a fleet's S3 catalog; every host syncing it serves it."""
    from lmcache_cartridge.store.catalog import publish
    from lmcache_cartridge.store.s3 import S3Settings

    e = publish(args.path, args.catalog, S3Settings.from_mapping(_s3_from_args(args)),
                labels=args.label or [], force_redownload=args.force_redownload)
    print(f"published {e.uri} ({e.kind}, {e.num_tokens} tokens, model {e.model}) to {args.catalog}"
          f"{' (hosts will download it again)' if args.force_redownload else ''}")
    return 0


def cmd_unpublish(args) -> int:
    from lmcache_cartridge.store.catalog import unpublish
    from lmcache_cartridge.store.s3 import S3Settings

    version = unpublish(args.id, args.catalog, S3Settings.from_mapping(_s3_from_args(args)))
    print(f"removed {args.id} from {args.catalog} (index version {version}; its bytes stay)")
    return 0


def _config_chunk_size(args) -> int:
    """The serving chunk size: the --config LMCache YAML's `chunk_size`, else LMCache's 256."""
    if _server_config(args):
        return int(_load_lmcache_config(getattr(args, "config", None)).chunk_size)
    return 256


def cmd_register(args) -> int:
    from lmcache_cartridge.cartridge.packed import PackedCartridge, rechunk

    settings = _plugin_settings(args)  # a config that cannot load fails before anything is written
    if args.path.startswith("s3://"):
        from lmcache_cartridge.store.s3 import S3Settings
        from lmcache_cartridge.tools.s3_register import register_s3_uri

        print(register_s3_uri(
            args.path, lambda: _registry(args), S3Settings.from_mapping(_s3_from_args(args)),
            settings.cache_dir if settings else default_cache_dir(), model_dir=args.model_dir, model=args.model,
            chunk_size=args.chunk_size, convert_chunk_size=args.chunk_size or _config_chunk_size(args),
            labels=args.label or [], force_redownload=args.force_redownload))
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
    from lmcache_cartridge.store.registry import RegistryError

    try:
        entries = _registry(args, create=False).list()
    except RegistryError:
        # A fresh install: nothing registered yet, so the default registry does not exist (and is
        # not created here). A path the config or --registry names is still an error: misspelled?
        settings = _plugin_settings(args)
        named = settings.registry if settings else args.registry
        if (Path(named) if named else default_registry_path()) != default_registry_path() \
                or default_registry_path().exists():
            raise
        entries = []
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
    if not _registry(args, create=False).remove(args.id):
        raise CartridgeError(f"no cartridge {args.id!r} is registered")
    print(f"removed {args.id} from the registry (its files were not touched)")
    return 0


def cmd_label(args) -> int:
    e = _registry(args, create=False).label(args.id, add=args.add or [], remove=args.remove or [])
    print(f"{e.id}: labels {', '.join(e.labels) or '-'}")
    return 0


def cmd_doctor(args) -> int:
    """Check a config the way LMCache will load it, then every registered cartridge against it
    (`tools.doctor`), one finding a line as each is made."""
    from lmcache_cartridge.tools.doctor import diagnose, failed

    findings = diagnose(args.config, model=args.model, verify=args.verify, on_finding=print)
    return EXIT_PROBLEMS if failed(findings) else 0


def cmd_mp_server(args) -> int:
    """Run `lmcache server` (LMCache's multiprocess mode) with the cartridge L2 adapter, configured
    from the same LMCache YAML the in-process plugin reads: one registry and cache for both modes."""
    from lmcache_cartridge.tools.lmcache_server import adapter_params, runnable, server_command

    params: dict = {}
    chunk_size, algo = args.chunk_size or 256, args.hash_algorithm or "sha256_cbor"
    if _server_config(args):
        cfg = _load_lmcache_config(args.config)
        params = adapter_params(cfg)
        chunk_size = args.chunk_size or int(cfg.chunk_size)
        algo = args.hash_algorithm or str(cfg.pre_caching_hash_algorithm or "sha256_cbor")
    cmd = server_command(args.port, args.http_port, params, chunk_size=chunk_size, hash_algorithm=algo,
                         l1_size_gb=args.l1_size_gb, transfer_mode=args.transfer_mode, host=args.host,
                         prefetch_policy=args.prefetch_policy, shm=not args.no_shm)
    if args.print:
        print(" ".join(shlex.quote(c) for c in cmd))
        return 0
    os.execv(sys.executable, runnable(cmd))
    return 1  # not reached


def cmd_stats(args) -> int:
    """Sum the tier counters of the plugin instances running with this cache dir (their
    serving-state records; a stopped server's is not counted)."""
    from lmcache_cartridge.store.tier_totals import sum_tier_stats

    settings = _plugin_settings(args)
    cache_dir = settings.cache_dir if settings else Path(args.cache_dir or default_cache_dir())
    totals = sum_tier_stats(cache_dir)
    if args.json:
        print(json.dumps(totals.to_json(), indent=1))
        return 0
    if not totals.instances:
        print(f"no running plugin instance publishes under {totals.stats_dir}")
        return 0
    print(f"{len(totals.instances)} plugin instance(s) running, from {totals.stats_dir}:")
    for st in totals.states:
        print(f"  {st.instance}: model {st.model}, rank {st.rank}/{st.world_size}, pid {st.pid}, "
              f"{len(st.cartridges)} cartridges served")
    print(f"{'tier':<8}{'hits':>10}{'misses':>10}{'MiB':>12}{'evictions':>11}{'errors':>8}")
    for tier, t in sorted(totals.tiers.items()):
        print(f"{tier:<8}{t['hits']:>10}{t['misses']:>10}{t['bytes'] / 2**20:>12.1f}"
              f"{t['evictions']:>11}{t['errors']:>8}")
    return 0


def cmd_gateway(args) -> int:
    """Serve the OpenAI-compatible gateway in front of a vLLM server (`api.launch`)."""
    from lmcache_cartridge.api.launch import gateway_settings, serve

    # the server's settings, read as the server reads them
    config = _load_lmcache_config(args.config) if _server_config(args) else None
    serve(gateway_settings(args, config), args.host, args.port)
    return 0


# --- parser -----------------------------------------------------------------------------------
GUIDE = """\
Serve KV cache cartridges to vLLM through LMCache: make or convert a cartridge, register it,
and the storage plugin inside every vLLM server that reads the same registry serves it (no
restart). A cartridge is a KV cache computed or trained offline for a document; a request that
starts with the cartridge's tokens loads that KV instead of prefilling it.

The first five minutes (`make demo` runs these steps on SmolLM2-135M-Instruct from PyPI):
  lmcache-cartridge test-model                                # a tiny local model, no download
  lmcache-cartridge create --model-dir MODEL --text doc.txt -o carts/doc
  lmcache-cartridge verify carts/doc
  lmcache-cartridge register carts/doc --config configs/lmcache-cartridge.yaml
  lmcache-cartridge doctor --config configs/lmcache-cartridge.yaml --model MODEL
  # start vLLM with LMCache and the connector: configs/vllm-serve-cpu.sh (or -gpu.sh)
  lmcache-cartridge gateway --upstream http://127.0.0.1:8000 --model MODEL \\
      --config configs/lmcache-cartridge.yaml --allow-local carts
  lmcache-cartridge stats --config configs/lmcache-cartridge.yaml

Files live under $LMCACHE_CARTRIDGE_HOME (default ~/.cache/lmcache_cartridge): the registry
(registry.db), the plugin's cache dir (cache/), test models (models/). A mistake in what you
typed ends in one `lmcache-cartridge: error: ...` line and exit status 2; a check that finds
problems (verify, doctor) exits 1.
"""


class _Parser(argparse.ArgumentParser):
    """argparse with the house rule for mistakes: one line and exit 2 (argparse's own usage dump
    would bury the reason); the full usage is one `--help` away."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="lmcache-cartridge", description=GUIDE, formatter_class=fmt)
    from lmcache_cartridge import __version__

    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           title="commands (each has --help)")

    def add(name: str, fn: Callable, summary: str, guide: str = "", example: str = "") -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=summary, formatter_class=fmt,
                            description=summary[0].upper() + summary[1:] + "." + (f"\n\n{guide}" if guide else ""),
                            epilog=f"example:\n  {example}" if example else None)
        sp.set_defaults(fn=fn)
        return sp

    # -- making cartridges
    sp = add("create", cmd_create, "make a first-k cartridge from a text document with a local HF model",
             "Runs the document through the model and keeps its KV cache. By default (--kv-from vllm)\n"
             "vLLM itself computes it, in a private server started for the purpose, and LMCache's own\n"
             "store path writes it out: the cartridge holds the bytes the serving engine computes for\n"
             "a prompt starting with the document, so served it answers exactly as the plain prompt.\n"
             "Run it on the kind of machine that will serve it (vLLM's CPU and GPU kernels round\n"
             "differently). --kv-from hf uses HF transformers (no vLLM needed; answers may part from\n"
             "the plain prompt's on near ties); it runs on --device (default cpu; cuda for a GPU) and\n"
             "prefills --prefill-chunk tokens at a time, so a long document never needs a full\n"
             "tokens x tokens attention matrix. The output directory is checked before any of this.\n"
             "Llama-style tokenizers put BOS first and the cartridge starts with it;\n"
             "tokenizers without BOS (Qwen2) start with the document's first token. Send requests as\n"
             "the cartridge's token ids followed by your own (the gateway does this for you).",
             "lmcache-cartridge create --model-dir ~/models/Qwen2.5-0.5B-Instruct --text doc.txt -o carts/doc")
    sp.add_argument("--model-dir", required=True, metavar="DIR",
                    help="local HF model directory (config.json, weights, tokenizer)")
    sp.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text file: the document")
    sp.add_argument("-o", "--output", required=True, metavar="DIR",
                    help="directory to create (the packed cartridge); checked before the model is loaded")
    sp.add_argument("--model", help="model name servers use (vLLM --model; default: --model-dir)")
    sp.add_argument("--id", help="cartridge id (default: from the text file's name)")
    sp.add_argument("--max-tokens", type=int, metavar="N", help="keep the first N tokens (default: the whole document)")
    sp.add_argument("--sci-chunk", type=int, metavar="N",
                    help="sampled-chunk initialisation: random N-token chunks of the document up to --max-tokens")
    sp.add_argument("--seed", type=int, default=0, help="seed for --sci-chunk (default 0)")
    sp.add_argument("--chunk-size", type=int, default=256, metavar="N",
                    help="LMCache chunk_size of the serving config (default 256)")
    sp.add_argument("--kv-from", choices=["vllm", "hf"],
                    help="what computes the KV: vllm (default where installed) or hf (transformers)")
    sp.add_argument("--cpu-bind", default="0-1", metavar="CPUS",
                    help="with --kv-from vllm on CPU: VLLM_CPU_OMP_THREADS_BIND of the private server (default 0-1)")
    sp.add_argument("--device", metavar="DEV",
                    help="with --kv-from hf: where the model runs, cpu (default), cuda or cuda:N; "
                         "the KV is kept on CPU")
    sp.add_argument("--prefill-chunk", type=int, metavar="N",
                    help="with --kv-from hf: tokens per forward pass (default 512); attention memory grows with "
                         "N x document tokens")
    sp.add_argument("--label", action="append", help="label (repeatable)")
    sp.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    sp = add("pack", cmd_pack, "convert a cartridge (.pt, PEFT adapter, ...) or re-chunk a packed one",
             "Reads the Cartridges paper's TrainableCache .pt files and the other supported input\n"
             "formats (never with pickle code execution) and writes the packed format servers read:\n"
             "a manifest, and the KV in chunks of --chunk-size tokens with a sha256 each.",
             "lmcache-cartridge pack cache_last.pt -o carts/trained --model meta-llama/Llama-3.2-1B-Instruct "
             "--model-dir ~/models/Llama-3.2-1B-Instruct")
    sp.add_argument("input", help="input file or directory (a packed directory is re-chunked)")
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
    sp.add_argument("--allow-model-mismatch", action="store_true",
                    help="pack although the input records another base model than --model (same model, other name)")
    sp.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    sp = add("inspect", cmd_inspect, "show a packed cartridge's manifest, or which format an input is read as",
             "On a packed directory: id, kind, model, KV shape and dtype, tokens, chunks and their\n"
             "checksums, and the input format it was packed from. On a .pt file or a cartridge\n"
             "directory (PEFT adapter, Tokasaurus): the format, base model, geometry and frozen tokens.",
             "lmcache-cartridge inspect cache_last.pt")
    sp.add_argument("path", help="packed cartridge directory, or an input file or directory")
    sp.add_argument("--json", action="store_true", help="the manifest as JSON")

    sp = add("verify", cmd_verify, "recompute a packed cartridge's checksums and check its values",
             "Exit 0 when every chunk matches its sha256 and holds only finite values, 1 otherwise.",
             "lmcache-cartridge verify carts/doc")
    sp.add_argument("path", help="packed cartridge directory")

    sp = add("test-model", cmd_test_model, "build (once) a tiny local test model and print its directory",
             "A 2-layer model with random weights and peaked attention and a tokenizer trained on a\n"
             "shipped document: loads in vLLM and HF transformers with no download. Kept under\n"
             "$LMCACHE_CARTRIDGE_HOME/models. `--family llama`: BOS first, separate LM head;\n"
             "`--family qwen2`: no BOS, attention biases, tied embeddings, ChatML chat template.",
             "lmcache-cartridge test-model --family qwen2")
    sp.add_argument("--family", choices=["llama", "qwen2"], default="llama", help="model family (default llama)")
    sp.add_argument("--root", help="directory to build it in (default: $LMCACHE_CARTRIDGE_HOME/models)")

    from lmcache_cartridge.tools import train as train_tool

    sp = add("train", train_tool.run_train, "train a cartridge for a document by self-study distillation (offline)",
             "Synthesises conversations about the document and trains the KV (PEFT's CARTRIDGE\n"
             "adapter) to answer as the model does with the whole document in context; the output is\n"
             "a packed `trained` cartridge ready for `register`. Needs the `train` extra (peft).\n"
             "Rerun the same command to resume from the work directory's checkpoint.",
             "lmcache-cartridge train --model-dir DIR --text doc.txt -o carts/doc-trained --tokens 256")
    train_tool.add_train_arguments(sp)

    # -- the registry servers read
    def reg_opts(sp):
        sp.add_argument("--registry", help="registry database (default: $LMCACHE_CARTRIDGE_HOME/registry.db)")
        sp.add_argument("--config", default=SERVER_CONFIG,
                        help="LMCache YAML: use its plugin's registry (and cache dir, S3 settings); default "
                             "$LMCACHE_CONFIG_FILE, the server's")

    sp = add("register", cmd_register, "add a packed cartridge (directory or s3://bucket/prefix) to the registry",
             "Servers whose plugin reads this registry serve it within a refresh period, without a\n"
             "restart. Registering the same id again replaces it.",
             "lmcache-cartridge register carts/doc --config configs/lmcache-cartridge.yaml")
    sp.add_argument("path", help="packed cartridge directory, or s3://bucket/prefix of one or of a maker's "
                                 "input directory (PEFT CARTRIDGE adapter, Tokasaurus; needs --model-dir)")
    sp.add_argument("--model-dir", help="s3:// input directories: the serving model (vocabulary, dtype)")
    sp.add_argument("--model", help="s3:// input directories: the model name vLLM serves (default: --model-dir)")
    sp.add_argument("--label", action="append", help="label (repeatable)")
    sp.add_argument("--chunk-size", type=int, help="serving chunk_size: re-chunk a copy if the cartridge differs")
    sp.add_argument("--packed-dir", help="where re-chunked copies go (default: $LMCACHE_CARTRIDGE_HOME/packed)")
    sp.add_argument("--force-redownload", action="store_true",
                    help="running servers drop cached copies and fetch again")
    sp.add_argument("--s3-endpoint", help="S3-compatible endpoint URL (s3:// paths)")
    sp.add_argument("--s3-region", help="S3 region (s3:// paths)")
    reg_opts(sp)

    def catalog_s3_opts(sp):
        sp.add_argument("--config", default=SERVER_CONFIG,
                        help="LMCache YAML: use its plugin's S3 settings; default $LMCACHE_CONFIG_FILE")
        sp.add_argument("--s3-endpoint", help="S3-compatible endpoint URL")
        sp.add_argument("--s3-region", help="S3 region")

    sp = add("publish", cmd_publish, "upload a packed cartridge into a fleet's S3 catalog",
             "Verifies the cartridge, uploads it under the catalog, then adds it to the catalog's\n"
             "versioned index. Every host whose plugin sets storage_plugin.<name>.catalog_uri to this\n"
             "catalog registers it at its next sync (catalog_period) and serves it without a restart.",
             "lmcache-cartridge publish carts/doc s3://bucket/catalog/ --config configs/lmcache-cartridge.yaml")
    sp.add_argument("path", help="packed cartridge directory")
    sp.add_argument("catalog", help="s3://bucket/prefix of the catalog")
    sp.add_argument("--label", action="append", help="label (repeatable)")
    sp.add_argument("--force-redownload", action="store_true",
                    help="every host drops its cached copies and fetches again")
    catalog_s3_opts(sp)

    sp = add("unpublish", cmd_unpublish, "remove a cartridge from a fleet's S3 catalog (its bytes stay)",
             "Hosts syncing the catalog stop serving it at their next sync.",
             "lmcache-cartridge unpublish doc s3://bucket/catalog/")
    sp.add_argument("id", help="cartridge id")
    sp.add_argument("catalog", help="s3://bucket/prefix of the catalog")
    catalog_s3_opts(sp)

    sp = add("list", cmd_list, "list registered cartridges", example="lmcache-cartridge list --json")
    sp.add_argument("--json", action="store_true", help="one JSON list")
    reg_opts(sp)

    sp = add("remove", cmd_remove, "remove a cartridge from the registry (its files are kept)",
             "Servers stop serving it within a refresh period.", "lmcache-cartridge remove doc")
    sp.add_argument("id", help="cartridge id")
    reg_opts(sp)

    sp = add("label", cmd_label, "add or remove labels of a registered cartridge",
             example="lmcache-cartridge label doc --add prod --remove staging")
    sp.add_argument("id", help="cartridge id")
    sp.add_argument("--add", action="append", help="label to add (repeatable)")
    sp.add_argument("--remove", action="append", help="label to remove (repeatable)")
    reg_opts(sp)

    # -- serving
    sp = add("doctor", cmd_doctor, "check an LMCache config and its registered cartridges as a server will load them",
             "Loads the YAML with LMCache's own loader, checks the plugin entry, the allocator, the\n"
             "hash algorithm, and every registered cartridge against the chunk size and model.\n"
             "Exit 0 when all is well, 1 when something would not be served.",
             "lmcache-cartridge doctor --config configs/lmcache-cartridge.yaml --model MODEL --verify")
    sp.add_argument("--config", default=SERVER_CONFIG,
                    help="the LMCache YAML the server loads (default $LMCACHE_CONFIG_FILE, else the server's "
                         "LMCACHE_* environment)")
    sp.add_argument("--model", help="the model name the server will use (vLLM --model)")
    sp.add_argument("--verify", action="store_true", help="also recompute every chunk checksum")

    sp = add("gateway", cmd_gateway, "serve the OpenAI-compatible gateway (adds a `cartridges` field) in front of vLLM",
             "POST /v1/completions and /v1/chat/completions with\n"
             '  "cartridges": [{"id": "doc"}]    (a registered id or label)\n'
             '  "cartridges": [{"id": "/srv/carts/doc", "source": "local"}]    (under an --allow-local root)\n'
             '  "cartridges": [{"id": "s3://bucket/carts/doc"}]    (under an --allow-s3 prefix)\n'
             "put the cartridge's tokens in front of the prompt and forward it to vLLM; unknown or\n"
             "incompatible cartridges are refused with a 4xx that says why.",
             "lmcache-cartridge gateway --upstream http://127.0.0.1:8000 --model MODEL "
             "--config configs/lmcache-cartridge.yaml --allow-local carts")
    sp.add_argument("--upstream", required=True, help="the vLLM server, e.g. http://127.0.0.1:8000")
    sp.add_argument("--model", required=True, help="the upstream model name (vLLM --model)")
    sp.add_argument("--tokenizer", help="local tokenizer directory (default: --model)")
    sp.add_argument("--config", default=SERVER_CONFIG,
                    help="the server's LMCache YAML (registry, cache dir, S3, chunk size); "
                         "default $LMCACHE_CONFIG_FILE")
    sp.add_argument("--registry", help="registry database, without --config")
    sp.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk_size, without --config (default 256)")
    sp.add_argument("--allow-local", action="append", metavar="DIR",
                    help="directory local cartridge paths may come from (repeatable)")
    sp.add_argument("--allow-s3", action="append", metavar="BUCKET[/PREFIX]",
                    help="S3 bucket or prefix clients may name in s3:// ids (repeatable; none by default)")
    sp.add_argument("--trained-chat-template", metavar="FILE|model",
                    help="chat prompts after a trained cartridge: a Jinja template file, or 'model' for the "
                         "model's own (default: the user turn right after the cartridge, no BOS, no system block)")
    sp.add_argument("--s3-endpoint", help="S3-compatible endpoint URL, without --config")
    sp.add_argument("--max-cartridges", type=int, default=4, help="most cartridges per request (default 4)")
    sp.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (default 4 MiB)")
    sp.add_argument("--max-cache-bytes", type=int, default=64 << 30,
                    help="bytes of S3 inputs and conversions clients may make the gateway keep under the cache dir "
                         "(objects/, packed/; least recently used evicted; default 64 GiB)")
    sp.add_argument("--force-redownload-interval", type=float, default=60.0, metavar="SECONDS",
                    help="honour a cartridge's force_redownload at most once per SECONDS (then 429); 0 refuses it "
                         "(default 60)")
    sp.add_argument("--serve-timeout", type=float, default=15.0,
                    help="seconds to wait for the engine's plugins to serve a newly registered cartridge (then 503)")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sp.add_argument("--port", type=int, default=8100, help="port to listen on (default 8100)")
    sp.add_argument("--api-key", action="append", metavar="KEY",
                    help=f"clients must send 'Authorization: Bearer KEY' on /v1/* (repeatable; also ${API_KEY_ENV}, "
                         "comma-separated); none: no check, and a warning when --host is not loopback")
    sp.add_argument("--tenants", metavar="FILE",
                    help="YAML of tenants: each with its API keys and the ids (globs), local roots and S3 "
                         "prefixes its keys may name; another tenant's cartridges are invisible to it")
    sp.add_argument("--upstream-api-key", metavar="KEY",
                    help="the key of a vLLM started with --api-key (default: $VLLM_API_KEY)")

    from lmcache_cartridge.tools import lmcache_server  # light: the server's command line, no LMCache import

    sp = add("mp-server", cmd_mp_server, "run LMCache's multiprocess server (`lmcache server`) serving cartridges",
             "LMCache's multiprocess (MP) mode: one `lmcache server` per host holds the KV cache and\n"
             "vLLM attaches with LMCacheMPConnector. This runs it with the cartridge L2 adapter and its\n"
             "server module, configured from the same LMCache YAML as the in-process plugin (registry,\n"
             "cache_dir, accept_models, s3.*; chunk_size and pre_caching_hash_algorithm become the\n"
             "server's). vLLM: configs/vllm-serve-mp.sh (CartridgeMPConnector: trained cartridges wait\n"
             "for their KV or fail, never recomputed). KV a client brought is served only to requests\n"
             "whose cache_salt names its salt, as the gateway sends them (docs/deployment.md).",
             "lmcache-cartridge mp-server --config configs/lmcache-cartridge.yaml --port 5555")
    sp.add_argument("--config", default=SERVER_CONFIG,
                    help="LMCache YAML with the cartridge plugin's settings; default $LMCACHE_CONFIG_FILE")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    sp.add_argument("--port", type=int, default=5555, help="the server's port vLLM connects to")
    sp.add_argument("--http-port", type=int, default=8080, help="the server's HTTP admin API (loopback)")
    sp.add_argument("--l1-size-gb", type=float, default=4.0, help="the server's L1 memory, allocated at start")
    sp.add_argument("--chunk-size", type=int, help="default: the YAML's chunk_size, else 256")
    sp.add_argument("--hash-algorithm", help="default: the YAML's pre_caching_hash_algorithm, else sha256_cbor")
    sp.add_argument("--transfer-mode", default="auto", choices=("auto", "engine_driven", "lmcache_driven"),
                    help="transfer modes the server accepts (vllm-cpu needs engine_driven: auto allows both)")
    sp.add_argument("--prefetch-policy", default=lmcache_server.PREFETCH_POLICY,
                    choices=lmcache_server.PREFETCH_POLICIES,
                    help="the server's --l2-prefetch-policy: `retain` (ours) keeps a cartridge chunk it loaded in L1, "
                         "so repeats hit L1 (until LRU evicts it); LMCache's `default` reads it from the adapter "
                         "on every hit")
    sp.add_argument("--no-shm", action="store_true",
                    help="keep L1 out of shared memory (/dev/shm, L1's size): workers then receive every chunk "
                         "pickled over the socket, several times slower (needed where /dev/shm is small)")
    sp.add_argument("--print", action="store_true", help="print the command instead of running it")

    sp = add("stats", cmd_stats, "per-tier hits, misses, bytes and evictions of running plugins",
             "Every plugin instance publishes its counters in its serving-state record under "
             "<cache_dir>/serving/; this sums those of running instances.",
             "lmcache-cartridge stats --config configs/lmcache-cartridge.yaml")
    sp.add_argument("--config", default=SERVER_CONFIG,
                    help="LMCache YAML: use its plugin's cache dir; default $LMCACHE_CONFIG_FILE")
    sp.add_argument("--cache-dir",
                    help="the plugin's cache dir, without --config (default: $LMCACHE_CARTRIDGE_HOME/cache)")
    sp.add_argument("--json", action="store_true", help="as JSON")
    return p


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def main(argv: list[str] | None = None) -> int:
    # LMCache logs INFO lines on import (device detection, config loading): a command's output is
    # its own. An explicit LMCACHE_LOG_LEVEL still wins.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    args = build_parser().parse_args(argv)
    try:
        with sigterm_as_interrupt():  # what a command started (a KV maker, an engine) stops with it
            return args.fn(args)
    except (CartridgeError, ValueError, OSError) as e:
        # Input the user gave that cannot work: a bad path, URI, value or file. (ValueError is how
        # parsers of user input refuse it, e.g. an S3 URI or a UTF-8 text file.)
        print(f"lmcache-cartridge: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

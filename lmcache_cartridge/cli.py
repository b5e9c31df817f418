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

from .errors import CartridgeError

EXIT_USAGE = 2
EXIT_PROBLEMS = 1


def _default_id(path: Path) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem if path.is_file() else path.name).strip("-.")
    return stem or "cartridge"


def _vocab_from_args(args):
    from .packed import VocabInfo

    if args.vocab_size:
        return VocabInfo(args.vocab_size, tuple(args.special_id or ()))
    if args.model_dir:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model_dir)
        return VocabInfo(len(tok), tuple(tok.all_special_ids))
    return None


# --- pack -------------------------------------------------------------------------------------
def cmd_pack(args) -> int:
    import torch

    from .formats import load_input
    from .manifest import MANIFEST_NAME
    from .packed import PackedCartridge, pack_kv, rechunk

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
        from .create import compute_prefix_kv, load_model

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
    from .manifest import Manifest

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
    from .packed import PackedCartridge

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
    from .create import create_first_k
    from .packed import pack_kv

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
    from .testmodel import ensure_test_model

    print(ensure_test_model(Path(args.root) if args.root else None))
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

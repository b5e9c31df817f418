"""Turning what a user points at into a registered cartridge: an S3 packed prefix (its manifest is
fetched; chunks stay in S3), a whole S3 object (a `.pt` in any input format, downloaded once into
the cache), an S3 prefix holding an input directory (a PEFT adapter, a Tokasaurus directory, ...:
listed once, its files downloaded once) and any input file or directory (converted once into a
content-addressed packed cartridge). Also the one vocabulary loader the CLI, gateway, `train` and
benchmarks share (ids come from `cartridge.manifest.id_from_name`).

Runs in the CLI (`register`, `pack`) and the gateway. Owns, under the cache dir: `manifests/`
(S3 manifests), `objects/` (downloaded objects and input directories) and `packed/` (converted inputs); serving
processes only read them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lmcache_cartridge.cartridge.compat import EngineShape, mismatch
from lmcache_cartridge.cartridge.manifest import MANIFEST_NAME, Manifest, id_from_name
from lmcache_cartridge.errors import CartridgeError, ManifestError
from lmcache_cartridge.paths import atomic_write
from lmcache_cartridge.store.cache_budget import touch  # reuse refreshes an item's place in the budget

if TYPE_CHECKING:
    import torch  # for the annotations only: the functions that use torch import it


# --- vocabularies -----------------------------------------------------------------------------
def load_vocab(tokenizer):
    """`VocabInfo` (size and special ids, what placeholder ids avoid) of a tokenizer or its directory."""
    from lmcache_cartridge.cartridge.packed import VocabInfo

    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    return VocabInfo(len(tokenizer), tuple(tokenizer.all_special_ids))


# --- S3 packed prefixes -----------------------------------------------------------------------
def s3_origin(uri: str) -> str:
    """The one spelling of an S3 prefix that a registration records as its origin (`source_uri`):
    s3://b/p and s3://b/p/ are one origin. ValueError for a URI that is not one."""
    from lmcache_cartridge.store.s3 import parse_s3_uri

    bucket, prefix = parse_s3_uri(uri)
    return f"s3://{bucket}/{prefix}".rstrip("/")


def fetch_s3_manifest(uri: str, settings, into_dir: Path) -> Manifest:
    """Download and validate an S3 cartridge's manifest into `into_dir` (atomically)."""
    from lmcache_cartridge.store.s3 import S3Origin

    with S3Origin(uri, settings) as origin:
        raw = origin.get_manifest_bytes()
    try:
        manifest = Manifest.from_dict(json.loads(raw))
    except ValueError as e:
        raise CartridgeError(f"{uri}/{MANIFEST_NAME} is not valid JSON: {e}") from e
    atomic_write(into_dir / MANIFEST_NAME, raw)
    return manifest


def register_s3(registry, uri: str, cache_dir: Path, settings, *, labels=(), force_redownload: bool = False,
                engine: EngineShape | None = None, chunk_size: int | None = None, replace_origin: bool = True,
                expect_id: str | None = None, client: bool = False, may_claim=None, catalog: str = ""):
    """Register an S3 packed cartridge: fetch its manifest, check it against `engine` (what the
    caller knows of the serving engine; `chunk_size` alone is shorthand for a shape knowing only
    that), index it; chunks are fetched on demand by the servers. The manifest lands in
    `cache_dir/manifests/<uri hash>`, the directory the entry points at.
    """
    if engine is None and chunk_size:
        engine = EngineShape.partial(chunk_size=chunk_size)
    uri = s3_origin(uri)
    into = Path(cache_dir) / "manifests" / hashlib.sha256(uri.encode()).hexdigest()[:24]
    manifest = fetch_s3_manifest(uri, settings, into)
    why = mismatch(manifest, engine) if engine is not None else None
    if why:
        raise CartridgeError(f"{uri}: {why}")
    return registry.register(into, source_uri=uri, labels=list(labels), force_redownload=force_redownload,
                             replace_origin=replace_origin, client=client, may_claim=may_claim,
                             expect_id=expect_id, catalog=catalog)


# --- whole S3 objects -------------------------------------------------------------------------
OBJECT_META = "object.json"


@dataclass(frozen=True)
class CachedObject:
    path: Path
    uri: str
    size: int
    etag: str
    sha256: str
    downloaded: bool  # False: served from the cache dir without any S3 request


def fetch_s3_object(uri: str, settings, cache_dir: Path, *, force: bool = False) -> CachedObject:
    """A whole S3 object (`s3://bucket/key.pt`) in `cache_dir/objects/<uri hash>/`, downloaded once;
    `force` downloads it again. The ETag, size and sha256 are kept beside it."""
    from lmcache_cartridge.store.s3 import S3Origin, parse_s3_uri

    bucket, key = parse_s3_uri(uri)
    if not key:
        raise ValueError(f"{uri!r} names a bucket; expected s3://bucket/path/to/cartridge.pt")
    uri = f"s3://{bucket}/{key}"
    d = Path(cache_dir) / "objects" / hashlib.sha256(uri.encode()).hexdigest()[:24]
    data, meta = d / Path(key).name, d / OBJECT_META
    if not force and meta.is_file() and data.is_file():
        try:
            m = json.loads(meta.read_text(encoding="utf-8"))
            if m["uri"] == uri and data.stat().st_size == m["size"]:
                touch(d)
                return CachedObject(data, uri, m["size"], m["etag"], m["sha256"], downloaded=False)
        except (ValueError, KeyError, TypeError):
            pass  # a damaged record: download again
    with S3Origin(uri, settings) as origin:
        info = origin.download_object(data)
    atomic_write(meta, json.dumps(asdict(info)).encode())
    return CachedObject(data, uri, info.size, info.etag, info.sha256, downloaded=True)


# --- S3 prefixes holding an input directory ---------------------------------------------------
DIR_META = "dir.json"
DIR_FILES = "files"


@dataclass(frozen=True)
class CachedDir:
    """An S3 prefix as listed once: `packed` (it holds a manifest.json: chunks stay in S3), or an
    input directory downloaded into `path` (`digest` as `content_digest` of that directory)."""

    uri: str
    packed: bool
    path: Path | None = None
    digest: str | None = None
    downloaded: int = 0  # files fetched by this call (0: all current in the cache dir)


def fetch_s3_dir(uri: str, settings, cache_dir: Path, *, force: bool = False) -> CachedDir:
    """List `s3://bucket/prefix/` once and say what it holds: a packed cartridge (manifest.json),
    or an input directory of a maker's format (`cartridge.inputs.dir_files`: a PEFT CARTRIDGE
    adapter, a Tokasaurus directory, ...), whose files are downloaded into
    `cache_dir/objects/<uri hash>/files/` unless the cache already has them at the listed size and
    ETag (`force`: download them again). An empty prefix is `NotFound`; anything else a
    `CartridgeError` naming what was found."""
    from lmcache_cartridge.cartridge.inputs import dir_files
    from lmcache_cartridge.store.s3 import NotFound, OriginError, S3Origin, TooLarge

    uri = s3_origin(uri)
    with S3Origin(uri, settings) as origin:
        listing = origin.list_names()
    if not listing:
        raise NotFound(f"LIST {uri}/: nothing there (no cartridge at this prefix)")
    if MANIFEST_NAME in listing:
        return CachedDir(uri, packed=True)
    names = dir_files(listing)
    if names is None:
        raise CartridgeError(
            f"{uri}/ is not a cartridge: expected manifest.json (packed), adapter_config.json + "
            "adapter_model.safetensors (PEFT CARTRIDGE adapter), cartridge.pt + config.yaml (Tokasaurus), "
            f"cartridge.pt + prefix_token_ids.json or cache_last.pt; found {sorted(listing)[:8]}")
    total = sum(listing[n][0] for n in names)
    if total > settings.max_object_bytes:  # what would be downloaded, checked on the listing
        raise TooLarge(f"{uri}/: its files hold {total} bytes, over the {settings.max_object_bytes}-byte limit "
                       "(s3.max_object_bytes)")
    d = Path(cache_dir) / "objects" / hashlib.sha256((uri + "/").encode()).hexdigest()[:24]
    files, meta_path = d / DIR_FILES, d / DIR_META
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("uri") != uri or not isinstance(meta.get("files"), dict):
            meta = {}
    except (OSError, ValueError):
        meta = {}
    known = {} if force else dict(meta.get("files") or {})
    record, fetched = {}, 0
    for name in names:
        size, etag = listing[name]
        had, path = known.get(name), files / name
        if had and had.get("size") == size and had.get("etag") == etag and path.is_file() \
                and path.stat().st_size == size:
            record[name] = had
            continue
        with S3Origin(f"{uri}/{name}", settings) as obj:
            info = obj.download_object(path)
        if info.etag != etag:  # replaced between the LIST and the download: the listing is stale
            raise OriginError(f"{uri}/{name} changed while it was being read; try again")
        record[name] = {"size": info.size, "etag": info.etag, "sha256": info.sha256}
        fetched += 1
    for stale in files.glob("*") if files.is_dir() else ():
        if stale.name not in record:  # a file the prefix no longer holds must not change the input
            stale.unlink()
    atomic_write(meta_path, json.dumps({"uri": uri, "files": record}).encode())
    touch(d)
    h = hashlib.sha256()  # content_digest of the directory, from the sha256s already computed
    for name in sorted(record):
        h.update(name.encode() + b"\0" + record[name]["sha256"].encode())
    return CachedDir(uri, packed=False, path=files, digest=h.hexdigest(), downloaded=fetched)


# --- input files and directories --------------------------------------------------------------
def content_digest(path: Path) -> str:
    """sha256 of a file, or of a directory's files (names and contents, sorted)."""
    if path.is_file():
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(path)).encode() + b"\0" + content_digest(p).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Converted:
    """An input after conversion: a packed directory, or (token-only input) just its token ids."""

    packed_dir: Path | None
    token_ids: list[int] | None


def model_dtype_for(kv, model_dir) -> torch.dtype | None:
    """float32 KV (PEFT adapters store fp32) packed for a local model: the model's dtype (its
    config.json), as PEFT itself casts the prefix at load; the engine serves only KV of its own
    dtype. Anything else keeps its dtype (None)."""
    import torch

    if kv is None or kv.dtype != torch.float32 or not model_dir:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def convert_input(path: Path, digest: str, cache_dir: Path, *, model: str, chunk_size: int, vocab,
                  name: str | None = None, model_dir: str | None = None, named: Path | None = None,
                  beside: Path | None = None) -> Converted:
    """Read any input `cartridge.formats.load_input` accepts and pack it once into
    `cache_dir/packed/<digest>` (content-addressed: the same bytes are converted once). A
    token-only input is not packed: its ids are a plain prompt prefix that vLLM computes itself.
    `vocab` is called only when a trained cartridge needs placeholder ids; `model_dir` (a local
    model directory) gives fp32 KV the model's dtype (`model_dtype_for`). `named`, `beside`:
    as `load_input`'s."""
    from lmcache_cartridge.cartridge.formats import load_input
    from lmcache_cartridge.cartridge.packed import pack_kv

    out = Path(cache_dir) / "packed" / digest[:32]
    if (out / MANIFEST_NAME).is_file():
        try:
            Manifest.load(out)
            touch(out)
            return Converted(out, None)
        except ManifestError:  # converted by an older version (e.g. no placeholder vocab): again
            pass
    loaded = load_input(path, named=named, beside=beside)
    if loaded.kv is None:
        return Converted(None, list(loaded.token_ids))
    kind = "first_k" if loaded.token_ids is not None else "trained"
    provenance = {"source": str(named or path), "sha256": digest, "format": loaded.source_format}
    dtype = model_dtype_for(loaded.kv, model_dir)
    if dtype is not None and dtype != loaded.kv.dtype:
        provenance["converted_from_dtype"] = str(loaded.kv.dtype).removeprefix("torch.")
    pack_kv(loaded.kv, out, dtype=dtype, cartridge_id=id_from_name(name or path.stem, digest), model=model, kind=kind,
            token_ids=loaded.token_ids, vocab=vocab() if kind == "trained" else None, chunk_size=chunk_size,
            provenance=provenance, overwrite=True)
    return Converted(out, None)

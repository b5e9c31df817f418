"""The packed cartridge's manifest: the one record of what a payload holds and how to check it.

A packed cartridge is a directory with two files:

- `manifest.json`: this record (small, scanned cheaply by the registry and the plugin);
- `kv.bin`: the payload, chunk after chunk. Its layout is one of `LAYOUTS` (the manifest's
  `layout`, tied to its `format_version`):
  - `by_head` (format 2, what `pack_kv` writes): each chunk is `[num_kv_heads, 2, num_layers,
    chunk_tokens, head_dim]`, so the KV heads a tensor-parallel rank holds (`cartridge.tp`) are
    one contiguous byte range of the chunk: a rank reads exactly its bytes with one `pread` or
    one ranged GET. Each head's bytes have their own BLAKE3 (`ChunkInfo.heads`), so a rank
    verifies what it read without the other ranks' heads.
  - `2ltd` (format 1, cartridges packed before): each chunk in LMCache's `KV_2LTD` layout
    `[2, num_layers, chunk_tokens, num_kv_heads * head_dim]`; still served as it is (a rank reads
    the whole chunk and keeps its columns).
  `packed.payload_to_engine` is the one place that turns payload bytes into LMCache's layout.

Files are immutable once written (packing renames a finished temp directory into place), so
any number of processes (vLLM's scheduler and workers) may read them at the same time.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from lmcache_cartridge.errors import CartridgeError, ManifestError

FORMAT_VERSION = 2
MIN_PLACEHOLDER_BITS = 96  # per chunk: ~2^96 packings to steer one chunk of placeholder ids
MAX_VOCAB = 1 << 24
LAYOUT_BY_HEAD = "by_head"
LAYOUT_2LTD = "2ltd"
LAYOUTS = {1: LAYOUT_2LTD, 2: LAYOUT_BY_HEAD}  # format_version -> payload layout
MANIFEST_NAME = "manifest.json"
PAYLOAD_NAME = "kv.bin"
KINDS = ("first_k", "trained")

# Ids become file names, registry keys and parts of URLs: keep them boring.
MAX_ID_LENGTH = 128
# \Z: "$" also matches before a final newline
_ID_RE = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_ID_LENGTH - 1}}}\Z")

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}


def dtype_from_name(name: str) -> torch.dtype:
    """Map a manifest dtype name (also accepts `torch.bfloat16`) to a torch dtype."""
    if not isinstance(name, str):
        raise ManifestError(f"KV dtype must be a string like 'bfloat16', got {name!r}")
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ManifestError(f"unsupported KV dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ManifestError(f"unsupported KV dtype {dtype}; expected one of {sorted(_DTYPES)}")


def derive_content_hash(shape: list[int], dtype: torch.dtype, chunk_size: int, chunks: list["ChunkInfo"]) -> str:
    """A cartridge's identity, derived, never read: its KV's shape, dtype, chunking and every
    digest of every chunk that a reader may verify (sha256, BLAKE3, per-head BLAKE3). `pack`
    writes it and every manifest read recomputes it, because it keys the CPU tier
    `(content_hash, index)` and names disk-cache files: a manifest claiming another cartridge's
    hash, or its sha256s with other BLAKE3s (reads verify BLAKE3), would be served that
    cartridge's cached bytes, or have its own served to that cartridge's requests."""
    h = hashlib.sha256()
    h.update(json.dumps([list(shape), str(dtype), chunk_size, "v2"]).encode())
    for c in chunks:
        h.update(json.dumps([c.sha256, c.blake3, c.heads]).encode())
    return h.hexdigest()


def legacy_content_hash(shape: list[int], dtype: torch.dtype, chunk_size: int, chunks: list["ChunkInfo"]) -> str:
    """What `pack` wrote before `derive_content_hash` covered BLAKE3 (sha256s only): accepted in a
    manifest on disk, never used as the identity in memory."""
    h = hashlib.sha256()
    h.update(json.dumps([list(shape), str(dtype), chunk_size]).encode())
    for c in chunks:
        h.update(bytes.fromhex(c.sha256))
    return h.hexdigest()


def validate_id(cartridge_id: str) -> str:
    """Refuse ids that could escape a directory or break a URL (`..`, `/`, spaces, ...)."""
    if not isinstance(cartridge_id, str) or not _ID_RE.match(cartridge_id) or ".." in cartridge_id:
        raise ManifestError(
            f"invalid cartridge id {cartridge_id!r}: use 1-128 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit, without '..'"
        )
    return cartridge_id


def id_from_name(name: str, digest: str | None = None, fallback: str | None = "cartridge") -> str | None:
    """The one rule that turns a file or directory name into a cartridge id `validate_id` accepts:
    runs of other characters become '-', '..' becomes '.', leading '-._' and trailing '-.' go, at
    most 80 characters. With `digest`, its first 12 characters are appended (two different files
    called `cartridge.pt` never share an id). A name with nothing left gives `fallback`."""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", name)
    clean = re.sub(r"\.{2,}", ".", clean).lstrip("-._").rstrip("-.")[:80].rstrip("-.")
    if not clean:
        if fallback is None:
            return None
        clean = fallback
    return validate_id(f"{clean}-{digest[:12]}" if digest else clean)


def id_from_path(path: str | Path) -> str:
    """The id of a cartridge made from `path` when none is given: the file's name without its
    suffix, or the directory's name (`id_from_name`)."""
    path = Path(path)
    return id_from_name(path.stem if path.is_file() else path.name)


@dataclass(frozen=True)
class ChunkInfo:
    """Where one chunk lives in the payload and what its bytes must hash to.

    `sha256` is the chunk's identity (the cartridge's `content_hash` is made from them).
    `blake3` is the digest a reader verifies the bytes against: the same guarantee at ~3x
    sha256's speed here (`benchmarks/integrity.py`), so a first hit is not bound by hashing.
    Cartridges packed before it existed have `None`: their bytes are verified by `sha256`
    (`whole_chunk_digest` is the one place that decides).
    """

    index: int
    offset: int
    nbytes: int
    num_tokens: int
    sha256: str
    blake3: str | None = None
    heads: list[str] | None = None  # `by_head` payloads: BLAKE3 of each KV head's bytes, in order


def whole_chunk_digest(info: ChunkInfo) -> tuple[str, str]:
    """(name, expected hex) of the digest that proves a whole chunk's bytes when they are read:
    BLAKE3 if its manifest has one, else sha256 (packed before per-chunk BLAKE3 existed)."""
    if info.blake3 is not None:
        return "blake3", info.blake3
    return "sha256", info.sha256


@dataclass(frozen=True)
class Span:
    """The bytes of one chunk that one reader needs (a rank's KV heads, or the whole chunk) and
    how to check them: `parts` are consecutive `(nbytes, digest name, expected hex)` pieces that
    cover the span exactly (one piece per head, or one for the whole chunk).

    Made by `Manifest.span`; read by origins (`offset`/`nbytes` in the payload), checked by
    `integrity.check_chunk`."""

    index: int
    offset: int
    nbytes: int
    num_tokens: int
    parts: tuple[tuple[int, str, str], ...]


@dataclass
class Manifest:
    cartridge_id: str
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_tokens: int
    kind: str
    token_ids: list[int]
    chunk_size: int
    chunks: list[ChunkInfo]
    content_hash: str
    created_at: str
    provenance: dict[str, Any] = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)
    payload: str = PAYLOAD_NAME
    format_version: int = FORMAT_VERSION
    layout: str = LAYOUT_BY_HEAD
    # Token ids that precede this cartridge's KV in every prompt it serves (whole chunks; empty
    # for every packed cartridge). Only a composite made by the gateway has them: a trained part
    # placed after tokens vLLM computes (`store.composite`). The plugin holds no KV for them (the
    # engine computes it and LMCache keeps it); they chain this cartridge's chunk keys, because
    # LMCache keys a chunk by every token before it (`key_token_ids`).
    context_ids: list[int] = field(default_factory=list)
    # Trained KV only: the vocabulary its placeholder ids were drawn from (`{"vocab_size": N,
    # "special_ids": [...]}`, `keys.placeholder_token_ids`). With it every read re-derives the ids
    # from the chunk digests (`check_placeholder_ids`): a manifest cannot give its KV the ids of
    # a prompt people send, or of another trained cartridge, so its KV reaches only requests that
    # name it.
    vocab: dict[str, Any] | None = None
    # A composite only: `[[kind, num_tokens], ...]` of its parts in order (the ids of each trained
    # part are derived from that part's own chunk digests). None: one part, this manifest's kind.
    # A first_k segment's ids are a document's own, checked by nobody: only a composite made from
    # registered parts may have one (`composes_first_k`).
    segments: list[list[Any]] | None = None

    # --- derived facts (one place computes each) -------------------------------------------
    def derived_content_hash(self, derive=derive_content_hash) -> str:
        """`derive_content_hash` of this manifest's geometry and chunk digests."""
        return derive([2, self.num_layers, self.num_tokens, self.num_kv_heads, self.head_dim],
                      self.torch_dtype, self.chunk_size, self.chunks)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def hidden_dim(self) -> int:
        """Width of one token's KV in one layer for all heads (`KV_2LTD`'s last dim)."""
        return self.num_kv_heads * self.head_dim

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (2, self.num_layers, num_tokens, self.hidden_dim)

    def chunk_nbytes(self, num_tokens: int) -> int:
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * num_tokens * self.hidden_dim * itemsize

    def head_nbytes(self, num_tokens: int) -> int:
        """Bytes of one KV head in a chunk of `num_tokens` (its K and V, every layer)."""
        return self.chunk_nbytes(num_tokens) // self.num_kv_heads

    def span(self, index: int, heads: tuple[int, int] | None = None) -> Span:
        """What to read of chunk `index` for KV heads `[start, end)` (all of them by default).

        A `by_head` chunk gives exactly those heads' bytes; a `2ltd` chunk (format 1) interleaves
        heads in every row, so any head range reads the whole chunk."""
        c = self.chunks[index]
        start, end = heads if heads is not None else (0, self.num_kv_heads)
        if self.layout == LAYOUT_2LTD or (start, end) == (0, self.num_kv_heads):
            name, expected = whole_chunk_digest(c)
            return Span(c.index, c.offset, c.nbytes, c.num_tokens, ((c.nbytes, name, expected),))
        hb = self.head_nbytes(c.num_tokens)
        return Span(c.index, c.offset + start * hb, (end - start) * hb, c.num_tokens,
                    tuple((hb, "blake3", c.heads[h]) for h in range(start, end)))

    @property
    def key_token_ids(self) -> list[int]:
        """The ids LMCache's chunk keys are computed over: the context, then the cartridge's own.
        The cartridge's chunk i is key `len(context_ids) // chunk_size + i` of them."""
        return self.context_ids + self.token_ids

    @property
    def context_chunks(self) -> int:
        """How many leading chunk keys of `key_token_ids` belong to the context, not to us."""
        return len(self.context_ids) // self.chunk_size

    @property
    def composes_first_k(self) -> bool:
        """Whether some of this (trained) manifest's ids are a first-k part's: `segments` names one.

        Those ids are a document's own, checked by nobody, and the manifest's kind is `trained`,
        so the registry salts none of its KV (it salts first-k KV a client brought, by kind). Were
        such a manifest read as written, anyone could give KV of their own the ids of a prompt
        people send, and LMCache (keys from token ids only) would serve it to every request
        sending that prompt without naming it. A segment is only ever written by
        `composite_manifest`, for a composite the gateway (or an instance's
        `HostComposer`) builds from registered parts, never from a client's KV: so such a manifest
        is read only as the composite of the parts listed beside it (`load`,
        `check_composite`), and served only from a composite origin (the plugin).
        Salting it instead (as a client's first-k KV is) would break the real composites: the
        gateway sends their requests unsalted, their first chunks keyed as the operator's first-k
        part is, and a request carries one salt at most."""
        return any(isinstance(s, list) and s and s[0] == "first_k" for s in self.segments or ())

    @property
    def num_full_chunks(self) -> int:
        return self.num_tokens // self.chunk_size

    @property
    def payload_nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    # --- (de)serialisation ------------------------------------------------------------------
    def to_json(self) -> str:
        d = asdict(self)
        for c in d["chunks"]:  # a cartridge packed without them keeps its old manifest
            for optional in ("blake3", "heads"):
                if c[optional] is None:
                    del c[optional]
        if not d["context_ids"]:
            del d["context_ids"]  # only composites after computed tokens carry it
        for optional in ("vocab", "segments"):  # trained cartridges / composites only
            if d[optional] is None:
                del d[optional]
        if self.format_version == 1:
            del d["layout"]  # format 1 had no such field: it is always `2ltd`
        return json.dumps(d, indent=1, sort_keys=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], directory: str | Path | None = None) -> "Manifest":
        """A checked manifest; `directory` is where it was read (`load`): a manifest with a first-k
        segment must be the composite of the parts `parts.json` there lists (`composes_first_k`)."""
        if not isinstance(d, dict):
            raise ManifestError("manifest must be a JSON object")
        version = d.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version not in LAYOUTS:
            raise ManifestError(
                f"manifest format_version {version!r} is not supported (this build reads "
                f"{sorted(LAYOUTS)}); re-pack the cartridge with this version's `lmcache-cartridge pack`"
            )
        if not isinstance(d.get("layout", ""), str) or d.get("layout", LAYOUTS[version]) != LAYOUTS[version]:
            raise ManifestError(f"manifest format_version {version} has layout {LAYOUTS[version]!r}, "
                                f"not {d.get('layout')!r}")
        d = {**d, "layout": LAYOUTS[version]}
        try:
            if not isinstance(d["chunks"], list) or not all(isinstance(c, dict) for c in d["chunks"]):
                raise TypeError("chunks must be a list of objects")
            chunks = [ChunkInfo(**c) for c in d["chunks"]]
            m = cls(**{**d, "chunks": chunks})
        except (KeyError, TypeError) as e:
            raise ManifestError(f"manifest is missing or has unexpected fields: {e}") from e
        m.validate()
        if m.composes_first_k:  # a first-k part's unchecked ids: only as the composite of its parts
            check_composite(m, directory)
        return m

    @classmethod
    def load(cls, directory: str | Path) -> "Manifest":
        path = Path(directory) / MANIFEST_NAME
        try:
            raw = path.read_text(encoding="utf-8")
        except FileNotFoundError as e:
            raise ManifestError(f"{path} not found: is {directory} a packed cartridge?") from e
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(d, directory)

    # --- checks -----------------------------------------------------------------------------
    def validate(self) -> None:
        """Internal consistency: every number that serving relies on agrees with the others."""
        validate_id(self.cartridge_id)
        dtype_from_name(self.dtype)
        for name, typ in (("token_ids", list), ("chunks", list), ("provenance", dict), ("labels", list),
                          ("content_hash", str), ("created_at", str)):
            if not isinstance(getattr(self, name), typ):
                raise ManifestError(f"manifest field {name} must be a {typ.__name__}")
        if not all(isinstance(x, str) for x in self.labels):
            raise ManifestError("manifest labels must be strings")
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_tokens", "chunk_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ManifestError(f"manifest field {name} must be a positive integer, got {v!r}")
        if self.kind not in KINDS:
            raise ManifestError(f"manifest kind {self.kind!r} must be one of {KINDS}")
        if not isinstance(self.model, str) or not self.model:
            raise ManifestError("manifest field model must name the model the KV was made with")
        if LAYOUTS.get(self.format_version) != self.layout:
            raise ManifestError(f"manifest format_version {self.format_version!r} does not go with "
                                f"layout {self.layout!r}")
        if self.payload != PAYLOAD_NAME:
            raise ManifestError(f"manifest payload must be {PAYLOAD_NAME!r}, got {self.payload!r}")
        if len(self.token_ids) != self.num_tokens or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.token_ids
        ):
            raise ManifestError(
                f"manifest has {len(self.token_ids)} token ids for num_tokens={self.num_tokens}, "
                "or ids that are not non-negative integers"
            )
        if not isinstance(self.context_ids, list) or len(self.context_ids) % self.chunk_size or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.context_ids
        ):
            raise ManifestError(
                f"manifest context_ids must be whole chunks of {self.chunk_size} non-negative token ids, "
                f"got {len(self.context_ids) if isinstance(self.context_ids, list) else self.context_ids!r}")
        if self.kind == "trained" and self.num_tokens % self.chunk_size:
            raise ManifestError(
                f"trained cartridge has {self.num_tokens} tokens, not a multiple of chunk_size "
                f"{self.chunk_size}"
            )
        self._check_chunks()
        self._check_content_hash()
        self.check_placeholder_ids()

    def _check_chunks(self) -> None:
        """Each chunk record follows the one before it and has the size and digests its layout
        gives; together they cover `num_tokens`."""
        offset, tokens = 0, 0
        for i, c in enumerate(self.chunks):
            if not all(isinstance(v, int) and not isinstance(v, bool)
                       for v in (c.index, c.offset, c.nbytes, c.num_tokens)) or not isinstance(c.sha256, str) \
                    or not (c.blake3 is None or isinstance(c.blake3, str)):
                raise ManifestError(f"manifest chunk {i} has fields of the wrong type")
            expect_tokens = min(self.chunk_size, self.num_tokens - tokens)
            if (
                c.index != i
                or c.offset != offset
                or c.num_tokens != expect_tokens
                or c.nbytes != self.chunk_nbytes(c.num_tokens)
                or not re.fullmatch(r"[0-9a-f]{64}", c.sha256 or "")
                or (c.blake3 is not None and not re.fullmatch(r"[0-9a-f]{64}", c.blake3))
                or (c.heads is not None) != (self.layout == LAYOUT_BY_HEAD)
                or (c.heads is not None and (not isinstance(c.heads, list) or len(c.heads) != self.num_kv_heads
                                             or not all(isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h)
                                                        for h in c.heads)))
            ):
                raise ManifestError(
                    f"manifest chunk {i} is inconsistent (offset {c.offset} vs {offset}, tokens "
                    f"{c.num_tokens} vs {expect_tokens}, bytes {c.nbytes} vs "
                    f"{self.chunk_nbytes(expect_tokens)}, or a malformed sha256, blake3 or per-head "
                    f"digests for layout {self.layout!r})"
                )
            offset += c.nbytes
            tokens += c.num_tokens
        if tokens != self.num_tokens:
            raise ManifestError(
                f"manifest chunks cover {tokens} tokens but num_tokens is {self.num_tokens}"
            )

    def _check_content_hash(self) -> None:
        """`content_hash` is the one its chunk digests derive (an older version's derivation is
        taken and replaced by today's)."""
        derived = self.derived_content_hash()
        if self.content_hash != derived:
            if self.content_hash != self.derived_content_hash(legacy_content_hash):
                raise ManifestError(
                    f"manifest content_hash {self.content_hash[:80]!r} is not the hash of its chunks "
                    f"({derived}): the content hash is derived from the chunk digests, never taken from "
                    "the manifest")
            self.content_hash = derived  # packed by an older version: the identity is the derived one

    def check_placeholder_ids(self) -> None:
        """The ids of trained KV are `placeholder_token_ids` of its content hash (derived from its
        chunk digests, never read), drawn from enough of a vocabulary that nobody can steer them
        (`MIN_PLACEHOLDER_BITS` per chunk). First-k ids are the document's own and are not
        checked here: KV a client brought reaches only requests that name it (`cache_salt`), and
        a first_k segment of a trained manifest is read only as a composite of registered parts
        (`composes_first_k`)."""
        from lmcache_cartridge.cartridge.keys import placeholder_candidates, placeholder_token_ids

        if self.kind != "trained":
            if self.vocab is not None or self.segments is not None:
                raise ManifestError(f"a {self.kind} manifest has no vocab or segments")
            return
        v = self.vocab
        if not isinstance(v, dict) or set(v) != {"vocab_size", "special_ids"} \
                or not isinstance(v["vocab_size"], int) or isinstance(v["vocab_size"], bool) \
                or not 0 < v["vocab_size"] <= MAX_VOCAB or not isinstance(v["special_ids"], list) \
                or len(v["special_ids"]) > MAX_VOCAB \
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in v["special_ids"]):
            raise ManifestError(
                f"trained manifest {self.cartridge_id!r} has no valid vocab ({{vocab_size, special_ids}}): "
                "its placeholder ids cannot be checked. It was packed before they were; re-pack it "
                "from its source with this version (`lmcache-cartridge pack ... --model-dir MODEL`)")
        size, special = v["vocab_size"], tuple(v["special_ids"])
        bits = self.chunk_size * math.log2(max(len(placeholder_candidates(size, special)), 1))
        if bits < MIN_PLACEHOLDER_BITS:
            raise ManifestError(
                f"trained manifest {self.cartridge_id!r}: placeholder ids from a vocabulary of {size} "
                f"with {len(special)} special ids in chunks of {self.chunk_size} carry {bits:.0f} bits "
                f"per chunk, fewer than {MIN_PLACEHOLDER_BITS}: chunk keys could be steered")
        segments = self.segments if self.segments is not None else [[self.kind, self.num_tokens]]
        if not isinstance(segments, list) or not all(
                isinstance(s, list) and len(s) == 2 and s[0] in ("trained", "first_k")
                and isinstance(s[1], int) and not isinstance(s[1], bool) and s[1] > 0
                and s[1] % self.chunk_size == 0 for s in segments) \
                or sum(s[1] for s in segments) != self.num_tokens:
            raise ManifestError(f"manifest {self.cartridge_id!r}: segments {str(segments)[:200]} must be "
                                f"[kind, whole chunks] parts adding up to {self.num_tokens} tokens")
        start = 0
        for kind, n in segments:
            if kind == "trained":
                chunks = self.chunks[start // self.chunk_size:(start + n) // self.chunk_size]
                shape = [2, self.num_layers, n, self.num_kv_heads, self.head_dim]
                ids = self.token_ids[start:start + n]
                if not any(ids == placeholder_token_ids(derive(shape, self.torch_dtype, self.chunk_size, chunks),
                                                        n, size, special)
                           for derive in (derive_content_hash, legacy_content_hash)):
                    raise ManifestError(
                        f"trained manifest {self.cartridge_id!r}: token ids {start}..{start + n} are not the "
                        "placeholder ids of its content hash: a trained cartridge's ids are derived from "
                        "its KV, never taken from the manifest")
            start += n


# --- composites ---------------------------------------------------------------------------------
# What `composite_manifest` makes of parts in order, and the check that a manifest with a first-k
# segment is exactly that (`check_composite`, part of every read of a manifest). Pure manifest
# logic (no registry, no origin); `store.composite` registers composites with it and describes the
# composition rule.
PARTS_NAME = "parts.json"  # beside a composite's manifest: its parts' directories, in order

_SAME = ("model", "num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_size", "layout")


def _identity(m: Manifest) -> str:
    """What makes a part this part: its bytes, and for a first-k part also its token ids (its
    content hash covers the KV only; a trained part's ids are derived from its content hash)."""
    if m.kind == "trained":
        return m.content_hash
    return m.content_hash + ":" + hashlib.sha256(json.dumps(m.token_ids).encode()).hexdigest()


def composite_manifest(parts: list[Manifest], context_ids: list[int] | tuple[int, ...] = ()) -> Manifest:
    """The manifest of `parts` served in this order after `context_ids`; an error names the first
    disagreement."""
    context_ids = [int(t) for t in context_ids]
    if len(parts) < (1 if context_ids else 2) or not any(p.kind == "trained" for p in parts):
        raise CartridgeError("a composite needs a trained cartridge and another cartridge or context tokens")
    first = parts[0]
    for p in parts:
        if p.kind not in ("trained", "first_k"):
            raise CartridgeError(f"{p.cartridge_id!r} is {p.kind}: it has no KV to compose")
        if p.num_tokens % p.chunk_size:
            raise CartridgeError(f"{p.cartridge_id!r} has {p.num_tokens} tokens, not whole chunks of "
                                 f"{p.chunk_size}: a composite's parts must be whole chunks")
        for f in _SAME:
            if getattr(p, f) != getattr(first, f):
                raise CartridgeError(
                    f"cartridges {first.cartridge_id!r} and {p.cartridge_id!r} cannot be served together: "
                    f"{f} {getattr(first, f)!r} vs {getattr(p, f)!r}")
    vocabs = {json.dumps(p.vocab, sort_keys=True) for p in parts if p.kind == "trained"}
    if len(vocabs) != 1:
        raise CartridgeError(f"trained parts {[p.cartridge_id for p in parts]} drew their placeholder ids "
                             "from different vocabularies")
    chunks: list[ChunkInfo] = []
    offset = 0
    for p in parts:
        for c in p.chunks:
            chunks.append(replace(c, index=len(chunks), offset=offset))
            offset += c.nbytes
    identity = "composite:" + ",".join(_identity(p) for p in parts)
    if context_ids:  # the same parts after other tokens are another composite (other keys)
        identity += ";after:" + hashlib.sha256(json.dumps(context_ids).encode()).hexdigest()
    digest = hashlib.sha256(identity.encode()).hexdigest()
    m = replace(
        first, cartridge_id=f"composite-{digest[:24]}", kind="trained", num_tokens=sum(p.num_tokens for p in parts),
        token_ids=[t for p in parts for t in p.token_ids], chunks=chunks, content_hash="",
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        provenance={"composite_of": [p.cartridge_id for p in parts],
                    "content_hashes": [p.content_hash for p in parts]},
        labels=[], context_ids=context_ids, vocab=json.loads(vocabs.pop()),
        segments=[s for p in parts for s in (p.segments or [[p.kind, p.num_tokens]])])
    m.content_hash = m.derived_content_hash()  # its bytes are the parts' bytes: their hash, as any cartridge's
    m.validate()
    return m


_CHECKING: ContextVar[frozenset[str]] = ContextVar("lmcache_cartridge_composite_checking", default=frozenset())


def check_composite(m: Manifest, directory: str | Path | None) -> None:
    """Refuse `m`, a manifest whose segments name a first-k part (`Manifest.composes_first_k`),
    unless it is exactly what `composite_manifest` makes of the parts `parts.json` beside it
    lists: same id, token ids, segments and content hash (so the same chunk digests). Then each
    first-k segment's ids and KV are a first-k cartridge's own, read (and checked) from where
    that part lives, and `register_composite` composes registered, unsalted parts only.

    A manifest written anywhere else (a client's directory or S3 prefix, a catalog entry) has no
    `parts.json`, or one naming a first-k part that nobody registered as the operator's: the
    first case is refused here, the second by the plugin, which serves a composed first-k
    segment only from a composite origin (`lmcache.plugin`, `origins.is_composite`)."""
    where = f"manifest {m.cartridge_id!r}" + (f" in {directory}" if directory is not None else "")
    listing_path = Path(directory) / PARTS_NAME if directory is not None else None
    if listing_path is None or not listing_path.is_file():
        raise ManifestError(
            f"{where} has a first_k segment but is not a composite made by this host (no {PARTS_NAME} "
            "beside it): a first-k part's ids are nobody's checked claim, so only the gateway composes "
            "them, from registered first-k cartridges. Serve first-k KV as a first_k cartridge")
    here = str(Path(directory).resolve())
    checking = _CHECKING.get()
    if here in checking:
        raise ManifestError(f"{where}: its {PARTS_NAME} lists the composite itself")
    token = _CHECKING.set(checking | {here})
    try:
        listing = json.loads(listing_path.read_text(encoding="utf-8"))
        if not isinstance(listing, list) or not all(isinstance(p, dict) and isinstance(p.get("path"), str)
                                                    for p in listing):
            raise ManifestError(f"{where}: {PARTS_NAME} is not a list of parts with paths")
        want = composite_manifest([Manifest.load(p["path"]) for p in listing], m.context_ids)
    except ManifestError:
        raise
    except (OSError, ValueError, CartridgeError) as e:
        raise ManifestError(f"{where}: not the composite of the parts its {PARTS_NAME} lists: {e}") from None
    finally:
        _CHECKING.reset(token)
    if (want.cartridge_id, want.content_hash, want.token_ids, want.segments) \
            != (m.cartridge_id, m.content_hash, m.token_ids, m.segments):
        raise ManifestError(f"{where} is not the composite of the parts its {PARTS_NAME} lists "
                            f"({want.cartridge_id}): its ids, segments or chunks differ from theirs")

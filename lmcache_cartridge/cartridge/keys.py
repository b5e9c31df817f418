"""Chunk keys: which LMCache `CacheEngineKey`s name a cartridge's chunks in *this* process.

Keys are never precomputed offline or re-implemented: they come from LMCache's own
`ChunkedTokenDatabase`, built from the serving config and metadata (model name, world size,
rank, KV dtype, chunk size, hash algorithm), so they cannot drift from what the engine looks up.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Iterable, Sequence

import numpy as np

from lmcache_cartridge.errors import KeyConfigError

logger = logging.getLogger(__name__)

# The LMCache key tag (`CacheEngineKey.tags`, from a request's `lmcache.tag.*` kv_transfer_params)
# under which KV a client brought is served: only requests the gateway sends naming that
# cartridge carry it (`client_kv_salt`), so nobody else's prompt ever matches its keys.
SALT_TAG = "lmcache.tag.lmcache_cartridge_salt"

# Hash algorithms whose chain starts from a per-process random seed unless PYTHONHASHSEED is set
# (vLLM's `resolve_none_hash_seed`; Python's `hash()` of a str is randomised per process too).
_SEED_DEPENDENT = {"builtin", "xxhash", "xxhash_cbor"}


@functools.lru_cache(maxsize=1)  # once per process: importing vLLM costs seconds where nothing has yet
def vllm_seeds_every_hash_randomly() -> bool:
    """Whether the installed vLLM starts every prefix-hash chain (`NONE_HASH`) from random bytes
    unless PYTHONHASHSEED is set, sha256_cbor included: vLLMs without `resolve_none_hash_seed`
    (0.26 among them: `init_none_hash` takes `os.urandom(32)`; later ones derive a fixed seed for
    cryptographic hashes). LMCache re-initialises `NONE_HASH` through vLLM in every process, so
    there every process, and every LMCache token database, keys chunks differently. False where
    vLLM is not installed."""
    try:
        from vllm.v1.core import kv_cache_utils as kcu
    except Exception:  # noqa: BLE001 - no vLLM (or a broken one): nothing hashes here
        return False
    return hasattr(kcu, "init_none_hash") and not hasattr(kcu, "resolve_none_hash_seed")


def hash_config_problem(hash_algorithm: str, env: dict[str, str] | None = None) -> str | None:
    """Explain why scheduler and workers would hash differently, or None when they agree.

    Runs anywhere (CLI `doctor`, plugin start). A mismatch never serves wrong bytes, only misses
    every lookup silently, which is why we say it loudly instead.
    """
    env = os.environ if env is None else env
    algo = (hash_algorithm or "builtin").strip()
    if algo in {"sha256", "sha256_cbor", "sha256_cbor_64bit"}:
        if env.get("PYTHONHASHSEED") is None and vllm_seeds_every_hash_randomly():
            return (
                f"pre_caching_hash_algorithm {algo!r} with PYTHONHASHSEED unset on this vLLM (no "
                "resolve_none_hash_seed: every process starts its chunk hashes from random bytes): "
                "cartridge keys differ between processes. Export PYTHONHASHSEED=0 for vLLM and for "
                "every process that makes cartridges (vLLM 0.32 needs neither)."
            )
        return None
    if algo not in _SEED_DEPENDENT:
        return (
            f"pre_caching_hash_algorithm {algo!r} is unknown to vLLM; LMCache falls back to "
            "Python's hash(). Use sha256_cbor."
        )
    if env.get("PYTHONHASHSEED") is None:
        return (
            f"pre_caching_hash_algorithm {algo!r} with PYTHONHASHSEED unset: vLLM's scheduler and "
            "workers compute different chunk keys and every cartridge lookup misses. Set "
            "pre_caching_hash_algorithm: sha256_cbor (recommended) or export PYTHONHASHSEED=0."
        )
    return None


class ChunkKeyMapper:
    """Maps token ids to the chunk keys LMCache will look up for them, in this process.

    Owned by one plugin instance (one engine, one rank). Building it imports vLLM's hash
    function through LMCache, so build it once and reuse it.
    """

    def __init__(self, config, metadata) -> None:
        from lmcache_cartridge.lmcache_compat import ChunkedTokenDatabase

        self.config = config
        self.metadata = metadata
        self.chunk_size: int = int(config.chunk_size)
        self._db = ChunkedTokenDatabase(config, metadata)

    def chunk_ranges(self, token_ids: Sequence[int], salt: str = "") -> list[tuple[int, int, object]]:
        """`(start, end, CacheEngineKey)` for every chunk LMCache would look up, in order, for a
        request carrying `salt` (`SALT_TAG`; "" for none).

        Only full chunks unless the config sets `save_unfull_chunk`: the tokens of a partial
        last chunk are recomputed by the model, never loaded.
        """
        return list(self._db.process_tokens(list(token_ids), request_configs=salt_configs(salt)))

    def keys(self, token_ids: Sequence[int], salt: str = "") -> list[object]:
        return [key for _, _, key in self.chunk_ranges(token_ids, salt)]

    def cartridge_keys(self, manifest, salt: str = "") -> list[object]:
        """The keys of `manifest`'s own chunks, in order: chained over its context ids (tokens the
        engine computes before it, whose chunks LMCache holds, not us) and then its own ids;
        tagged with `salt` when a client brought the KV (the registry entry's `salt`)."""
        return self.keys(manifest.key_token_ids, salt)[manifest.context_chunks:]


def salt_configs(salt: str) -> dict | None:
    """The `request_configs` LMCache builds a request's keys from when it carries `salt`."""
    return {SALT_TAG: salt} if salt else None


def client_kv_salt(manifest) -> str:
    """The salt of a first-k cartridge a client brought: derived from its KV (content hash) and
    its ids, so two clients' KV for the same tokens are two cartridges, and the same file named
    twice is one."""
    ids = hashlib.sha256(",".join(map(str, manifest.token_ids)).encode()).hexdigest()
    return hashlib.sha256(f"client-kv:{manifest.content_hash}:{ids}".encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=8)
def placeholder_candidates(vocab_size: int, special_ids: tuple[int, ...] = ()) -> np.ndarray:
    """The ids placeholders are drawn from: the vocabulary without its special tokens, in order."""
    keep = np.ones(vocab_size, dtype=bool)
    special = np.array([i for i in special_ids if 0 <= i < vocab_size], dtype=np.int64)
    keep[special] = False
    out = np.nonzero(keep)[0].astype(np.int64)
    out.setflags(write=False)
    return out


def placeholder_token_ids(
    content_hash: str, num_tokens: int, vocab_size: int, special_ids: Iterable[int] = ()
) -> list[int]:
    """Deterministic stand-in token ids for a trained cartridge, derived from its content hash.

    Trained KV has no real tokens, but LMCache and vLLM key everything on token ids. Drawing
    them pseudo-randomly from the vocabulary (never special tokens) gives each cartridge its own
    key chain: two cartridges agree on the first chunk with probability ~(1/vocab)^chunk_size.
    """
    special = tuple(sorted({int(i) for i in special_ids}))
    candidates = placeholder_candidates(int(vocab_size), special)
    if len(candidates) < 2:
        raise KeyConfigError(
            f"vocabulary of {vocab_size} tokens with {len(special)} special ids leaves no room "
            "for placeholder ids"
        )
    seed = int.from_bytes(hashlib.sha256(("placeholder:" + content_hash).encode()).digest()[:16], "little")
    rng = np.random.Generator(np.random.PCG64(seed))
    return candidates[rng.integers(0, len(candidates), size=num_tokens)].tolist()

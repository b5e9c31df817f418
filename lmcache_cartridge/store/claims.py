"""Whose cartridge serves a chunk key that several registry entries claim.

A chunk key is a function of token ids (and the model, and a salt for KV a client brought), and a
first-k manifest's ids are whatever its writer put there. So entries can claim the same keys
with different KV: the operator's handbook and a catalog entry whose writer copied its ids, or
two catalog entries. Were every entry's keys indexed in turn, the last one winning, a catalog's
writer could answer the operator's prompts with KV of their own.

The rule, one place for the in-process plugin (`lmcache.plugin`) and the MP adapter
(`lmcache.mp_adapter`):

- Claims of the same bytes never conflict (the same chunk digest, layout and shape: either one
  serves what the other would; a composite's chunks are its parts' own).
- Otherwise precedence decides (`Entry.rank`): the operator's registrations over a catalog's,
  a catalog's over a client's. Among the operator's own, the one registered first serves the
  key (`Entry.added_at`, kept across re-registrations of the same origin; then the id): a
  later registration, whoever made it and whatever its id, never takes over a key in use.
  An entry's rank is what the registry recorded: a client's request never raises it
  (`registry._standing`).
- A catalog's or a client's entry that claims a key served with other bytes, or whose claim is
  ambiguous (entries of its rank claim it with different bytes and none of the operator's does),
  is refused whole, with the reason: it serves none of its keys, and its name answers 400.

Pure functions over entries and manifests: no registry, no tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Hashable, TypeVar

from lmcache_cartridge.cartridge.manifest import Manifest
from lmcache_cartridge.store.registry import Entry

T = TypeVar("T")
WHO = {0: "the operator's", 1: "a catalog's", 2: "a client's"}


@dataclass(frozen=True)
class Claim(Generic[T]):
    """One served cartridge's claim: `owner` (what the index maps to), its registry entry and
    manifest, and its `(key, chunk index)` pairs."""

    owner: T
    entry: Entry
    manifest: Manifest
    keys: list[tuple[Hashable, int]]


def chunk_identity(m: Manifest, index: int) -> tuple:
    """What a chunk's bytes are: two claims with the same identity serve the same KV."""
    c = m.chunks[index]
    return (m.layout, m.dtype, m.num_layers, m.num_kv_heads, m.head_dim, c.num_tokens, c.sha256)


@dataclass(frozen=True)
class _Bid:
    n: int          # the claim's position
    rank: int
    id: str
    added_at: float
    identity: tuple
    index: int


def settle(claims: list[Claim[T]]) -> tuple[dict[Hashable, tuple[T, int]], dict[str, str]]:
    """The index `{key: (owner, chunk index)}` of `claims` under the rule above, and the entries
    refused `{id: why}` (they appear nowhere in the index)."""
    bids: dict[Hashable, list[_Bid]] = {}
    for n, c in enumerate(claims):
        for key, i in c.keys:
            bid = _Bid(n, c.entry.rank, c.entry.id, c.entry.added_at, chunk_identity(c.manifest, i), i)
            bids.setdefault(key, []).append(bid)
    refused: dict[int, str] = {}
    for bs in bids.values():
        if len({b.identity for b in bs}) > 1:
            for n, why in _losers(bs).items():
                refused.setdefault(n, why)
    index: dict[Hashable, tuple[T, int]] = {}
    for key, bs in bids.items():
        alive = [b for b in bs if b.n not in refused]
        if alive:
            best = _served(alive)
            index[key] = (claims[best.n].owner, best.index)
    return index, {claims[n].entry.id: why for n, why in refused.items()}


def _served(bs: list[_Bid]) -> _Bid:
    """The claim that serves a key: the most trusted rank's, and within it the one registered
    first (then the smallest id; among a catalog's or clients' claims these are the same bytes
    by then)."""
    return min(bs, key=lambda b: (b.rank, b.added_at, b.id))


def _losers(bs: list[_Bid]) -> dict[int, str]:
    """The claims of a catalog or a client that may not serve one contested key, and why."""
    winner = _served(bs)
    top = winner.rank
    first = [b for b in bs if b.rank == top]
    served = winner.identity if top == 0 or len({b.identity for b in first}) == 1 else None
    whose = f"{winner.id!r}'s ({WHO[top]} registration, which takes precedence)"
    out = {}
    for b in bs:
        if b.rank == 0 or b.identity == served:
            continue
        if served is None:
            names = sorted({x.id for x in first})
            out[b.n] = (f"ambiguous: {', '.join(map(repr, names))} ({WHO[top]} registrations) claim the same chunk "
                        "keys (the same token ids) with different KV, and none of the operator's does: none of "
                        "them is served. Keep one, or register the right one yourself (`lmcache-cartridge "
                        "register`: the operator's registration takes precedence)")
        else:
            out[b.n] = (f"its chunk keys (its token ids) are {whose} with different KV: {WHO[b.rank]} cartridge "
                        "never serves another's keys. Give it its own token ids, or remove one")
    return out

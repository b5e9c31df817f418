"""Key parity: the keys our mapping computes for a packed cartridge are exactly the keys a real
LMCacheEngine stores for the same tokens. Importable, and runnable as a script so it can run
under a different PYTHONHASHSEED (builtin hash must be seeded at interpreter start).

Prints one JSON line: {"algo": ..., "first_k": bool, "trained": bool, "bytes_equal": bool}.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from lmc_helpers import Engine, make_config, make_metadata  # noqa: E402
from lmcache_cartridge.cartridge.keys import ChunkKeyMapper
from lmcache_cartridge.cartridge.packed import PackedCartridge, VocabInfo, pack_kv

L, H, D, CHUNK = 2, 2, 16, 64


def run(algo: str) -> dict:
    out = {"algo": algo}
    config = make_config(chunk_size=CHUNK, pre_caching_hash_algorithm=algo)
    metadata = make_metadata(model_name="parity-model", num_layers=L, num_kv_heads=H, head_dim=D,
                             chunk_size=CHUNK)
    g = torch.Generator().manual_seed(7)
    with tempfile.TemporaryDirectory() as tmp, Engine(config, metadata) as eng:
        mapper = ChunkKeyMapper(config, metadata)
        cases = {
            # first-k: real token ids, a partial last chunk (LMCache stores only full ones)
            "first_k": dict(kind="first_k", token_ids=list(range(3, 3 + 3 * CHUNK + 10)), n=3 * CHUNK + 10),
            "trained": dict(kind="trained", token_ids=None, n=2 * CHUNK),
        }
        bytes_equal = True
        for name, c in cases.items():
            kv = torch.randn(2, L, c["n"], H, D, generator=g).to(torch.bfloat16)
            m = pack_kv(kv, Path(tmp) / name, cartridge_id=name, model="parity-model", kind=c["kind"],
                        token_ids=c["token_ids"], vocab=VocabInfo(1000, (0, 1, 2)), chunk_size=CHUNK)
            eng.clear_local_cpu()
            eng.store(m.token_ids, kv.reshape(2, L, c["n"], H * D))
            cpu = eng.backend("LocalCPUBackend")
            stored = list(cpu.hot_cache.keys())
            ours = mapper.keys(m.token_ids)
            out[name] = stored == ours and len(ours) == m.num_full_chunks
            packed = PackedCartridge(Path(tmp) / name)
            for i, key in enumerate(ours):
                obj = cpu.hot_cache[key]
                bytes_equal &= torch.equal(obj.tensor.view(torch.uint8), packed.read_chunk(i).view(torch.uint8))
        out["bytes_equal"] = bytes_equal
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))

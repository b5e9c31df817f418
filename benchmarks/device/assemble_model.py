"""Rebuild the real model's model.safetensors on the GPU box from `hf_payload.sh`'s pieces:
the xz'd high and low bytes of its bf16 weights (`/root/parts/p*`, in order), checked against the
host's SHA-256 (`/root/kit/sha`). Usage: python3 assemble_model.py MODEL_DIR"""
import hashlib
import lzma
import sys
from pathlib import Path

import numpy as np

parts = sorted(Path("/root/parts").glob("p*"))
blob = b"".join(p.read_bytes() for p in parts)
HI = int(Path("/root/kit/hi_len").read_text())
hi = np.frombuffer(lzma.decompress(blob[:HI]), dtype=np.uint8)
lo = np.frombuffer(lzma.decompress(blob[HI:]), dtype=np.uint8)
out = np.empty(2 * len(hi), dtype=np.uint8)
out[0::2], out[1::2] = lo, hi
data = out.tobytes()
assert hashlib.sha256(data).hexdigest() == Path("/root/kit/sha").read_text().strip(), "model bytes differ"
dst = Path(sys.argv[1]) / "model.safetensors"
dst.write_bytes(data)
print("assembled", dst, len(data), "bytes from", len(parts), "pieces")

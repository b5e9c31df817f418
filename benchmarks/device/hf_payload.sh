#!/usr/bin/env bash
# The payload for a self-study run on the GPU box without vLLM (HF + PEFT: benchmarks/gpu_scale.sh):
# the real model's weights (its bf16 safetensors split into high and low bytes, each xz'd: 177 of
# 269 MB), its tokenizer and config, and the wheels the box lacks (PEFT with the CARTRIDGE adapter,
# blake3, pydantic), cut into folders PREFIX1, PREFIX2, ... that each fit one call beside the
# checkout (64 MB a call, the checkout counted as the disk it takes). Needs `make venv model` here.
#
#   benchmarks/device/hf_payload.sh [PREFIX]        # default .hfcarry: .hfcarry1 .. .hfcarry4
#
# Then on the box, one call per folder, each within 30 s of the last (hf_on_device.sh's header).
set -euo pipefail
cd "$(dirname "$0")/../.."
P=${1:-.hfcarry}
PY=${PYTHON:-.venv/bin/python}
M=${LMCACHE_CARTRIDGE_HOME:-$PWD/.cache}/models/SmolLM2-135M-Instruct
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
mkdir -p "$T/kit"
"$PY" - "$M/model.safetensors" "$T" <<'PYEOF'
import sys
import numpy as np
b = np.fromfile(sys.argv[1], dtype=np.uint8)
b[1::2].tofile(f"{sys.argv[2]}/hi.bin")  # sign and exponent: compress to about a third
b[0::2].tofile(f"{sys.argv[2]}/lo.bin")  # mantissa: barely compresses
PYEOF
xz -T1 -6 -c "$T/hi.bin" > "$T/hi.xz"
xz -T1 -1 -c "$T/lo.bin" > "$T/lo.xz"
stat -c %s "$T/hi.xz" > "$T/kit/hi_len"
sha256sum "$M/model.safetensors" | cut -d' ' -f1 > "$T/kit/sha"
xz -9 -c "$M/tokenizer.json" > "$T/kit/tok.xz"
cp "$M"/{build_params.json,chat_template.jinja,config.json,generation_config.json,tokenizer_config.json} "$T/kit/"
# the box has torch, transformers, numpy, tqdm, safetensors; these at the versions installed here
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
for pkg in peft blake3 pydantic pydantic_core annotated_types typing_inspection typing_extensions; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$T/kit" "$pkg==$(version "$pkg")"
done
cat "$T/hi.xz" "$T/lo.xz" > "$T/model.xzs"
used=$(git ls-files -z | du -c -B1 --files0-from=- | tail -1 | cut -f1)
"$PY" - "$T" "$P" "$used" <<'PYEOF'
import shutil, sys
from pathlib import Path
t, prefix, used = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
room = 64_000_000 - used - 400_000  # a call's limit, less the checkout and a margin for edits
kit = sum(f.stat().st_size for f in (t / "kit").iterdir())
blob = (t / "model.xzs").read_bytes()
cuts, at, first = [], 0, True
while at < len(blob):
    n = room - (kit if first else 0)
    cuts.append(blob[at:at + n]); at += n; first = False
for i, part in enumerate(cuts, 1):
    d = Path(f"{prefix}{i}")
    shutil.rmtree(d, ignore_errors=True); d.mkdir()
    (d / f"p{i}").write_bytes(part)
    if i == 1:
        shutil.copytree(t / "kit", d / "kit")
    print(d, sum(f.stat().st_size for f in d.rglob("*") if f.is_file()), "bytes")
PYEOF
echo "carry each folder in its own call; add them to .git/info/exclude: $(ls -d "$P"[0-9]* | tr '\n' ' ')"

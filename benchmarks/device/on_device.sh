#!/bin/bash
# Runs ON the CUDA box (device tool), from the lead's checkout root, with the payload pieces of
# make_payload.sh carried one per call as .devcarry/cNN/piece.NN. A warm box keeps /root and /tmp
# only if the next call comes within 30 s, so the calls are chained quickly:
#   call 1: bash .devcarry/c00/on_device.sh stash 00 lmcache   (stash, install LMCache, CUDA LMCache tests, non-vLLM suite)
#   call 2: bash .devcarry/c01/on_device.sh stash 01            (just stash; the script travels in c00 only: copy it)
#   call 3: bash /root/on_device.sh stash 02 install e2e         (install vLLM, CUDA end-to-end tests)
#   call 4: bash /root/on_device.sh ttft                          (benchmarks/ttft.py --device)
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0   # flashinfer is not carried: vLLM 0.26 imports it for its sampler unless this is 0
export PYTHONPATH=/tmp/site:/root/x/repo LMCACHE_CARTRIDGE_HOME=/root/x/repo/.cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PIPI="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site"
cp "$0" /root/on_device.sh 2>/dev/null
mkdir -p /root/p /root/x
while [ $# -gt 0 ]; do
  case $1 in
    stash) cp .devcarry/c$2/piece.$2 /root/p/; shift ;;
    lmcache)
      { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -V
        python3 -c "import torch;print('torch',torch.__version__,torch.version.cuda,torch.cuda.is_available())"; } | tee $OUT/env.txt
      (cd /root/x && tar -xf /root/p/piece.00 2>/dev/null); $PIPI /root/x/a_lmc/*.whl
      (cd /root/x/repo && timeout 200 python3 -m pytest -q -p no:cacheprovider -s -rs tests/test_cuda_lmcache_engine.py \
         "tests/test_residency.py::test_memory_tier_on_cuda" 2>&1 | tee $OUT/cuda_lmcache_tests.txt | tail -20
       timeout 200 python3 -m pytest -q -p no:cacheprovider -n 12 -m "not slow" -rfEs --tb=line --ignore=tests/test_cpu_kv.py \
         --ignore=tests/test_s3.py --ignore=tests/test_s3_serving.py --ignore=tests/test_bench_chunk_retrieval.py \
         --ignore=tests/test_cuda_vllm_e2e.py --ignore=tests/test_cuda_lmcache_engine.py tests 2>&1 | tee $OUT/nonvllm_suite.txt | tail -30) ;;
    install)
      (cd /root/x && rm -rf a_lmc repo b_vdeps && cat /root/p/piece.* | tar -xf - && $PIPI a_lmc/*.whl b_vdeps/*.whl \
        && tar -xzf vllm026.tar.gz -C /tmp/site && rm vllm026.tar.gz) || exit 3 ;;
    e2e)
      (cd /root/x/repo && timeout 420 python3 -m pytest -q -p no:cacheprovider -s -rfEs --tb=short --basetemp=/root/x/pt3 \
         tests/test_cuda_vllm_e2e.py 2>&1 | tee $OUT/cuda_vllm_e2e.txt | grep -E "\[|passed|failed|^E " | tail -40)
      for f in $(find /root/x/pt3 -name server.log); do tail -c 3000000 $f > $OUT/e2e_server.log; done ;;
    ttft)
      mkdir -p $OUT/ttft
      (cd /root/x/repo && timeout ${TTFT_S:-540} python3 benchmarks/ttft.py --device --baseline lmcache --out $OUT/ttft \
         --work /root/x/bench ${TTFT_ARGS:-} 2>&1 | tee $OUT/ttft/ttft_log.txt | grep -E "^\[ *[0-9]" | tail -60)
      for f in $(find /root/x/bench/servers -name server.log); do n=$(basename $(dirname $f)); tail -c 3000000 $f > $OUT/ttft/server_$n.log; done ;;
  esac
  shift
done

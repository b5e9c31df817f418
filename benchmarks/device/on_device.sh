#!/bin/bash
# Runs ON the CUDA box (device tool), from the checkout root that the tool sends every call, with
# the pieces of make_payload.sh carried one per call as .devcarry/cNN/. A warm box keeps /root
# only if the next call comes within 30 s, so the calls are chained quickly:
#   call 1 (carry .devcarry/c00): bash benchmarks/device/on_device.sh stash 00 env lmcache models pack
#   call 2 (carry .devcarry/c01): bash benchmarks/device/on_device.sh stash 01
#   call 3 (carry .devcarry/c02): DEADLINE_S=570 bash benchmarks/device/on_device.sh stash 02 install engine e2e ttft pack
#   (TTFT_ARGS replaces the TTFT stage's default arms, lengths and concurrency; a call runs 600 s at most)
# The production-shape table (fused_copy.py and ttft.py --shape; no model weights travel):
#   call 1 (carry .devcarry/c00): bash benchmarks/device/on_device.sh stash 00 env lmcache shapes copybench pack
#   call 2 (carry .devcarry/c01): bash benchmarks/device/on_device.sh stash 01
#   call 3 (carry .devcarry/c02): DEADLINE_S=585 bash benchmarks/device/on_device.sh stash 02 install engine prod pack
# The self-study data-scale point on the GPU (payload made with QUALITY=1: pieces c03, c04 too), in
# four calls (c00 and c04 fit one call together):
#   call 1 (carry .devcarry/c00 .devcarry/c04): bash benchmarks/device/on_device.sh stash 00 stash 04 env lmcache pack
#   call 2 (carry .devcarry/c01): ... stash 01;  call 3 (carry .devcarry/c02): ... stash 02
#   call 4 (carry .devcarry/c03): DEADLINE_S=585 bash benchmarks/device/on_device.sh stash 03 install quality pack
#   (QUALITY_ARGS replaces the quality stage's arguments below; rerun `quality pack` to resume)
# Every stage appends to /root/res (a log per stage, the benchmark's JSON); `pack` puts it all in
# $OUT/res.tgz and the one-line results in $OUT/summary.txt (at most 8 files come back per call).
# Of these only the benchmarks' JSON, markdown and png go into benchmarks/results, with a README.md
# quoting the test summaries and log lines the figures rest on (benchmarks/device/README.md).
# DEADLINE_S: seconds this call may use in all; the TTFT stage is given what is left of it.
T0=$(date +%s); DEADLINE=$((T0 + ${DEADLINE_S:-560}))
REPO=$PWD
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0   # flashinfer is not carried: vLLM 0.26 imports it for its sampler unless this is 0
export PYTHONPATH=/tmp/site:$REPO LMCACHE_CARTRIDGE_HOME=/root/x/home HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PATH=/tmp/site/bin:$PATH LMCACHE_DISABLE_BANNER=1
PIPI="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site"
mkdir -p /root/p /root/x /root/res /tmp/site
say() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a /root/res/summary.txt; }
left() { echo $(( DEADLINE - $(date +%s) )); }
while [ $# -gt 0 ]; do
  case $1 in
    stash) cp .devcarry/c$2/* /root/p/; say "stashed piece $2: $(ls /root/p | tr '\n' ' ')"; shift ;;
    env)
      { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -V; nproc
        python3 -c "import torch;print('torch',torch.__version__,torch.version.cuda,torch.cuda.is_available())"
        python3 -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|triton|numpy|numba|peft) "; } > /root/res/env.txt 2>&1
      say "env: $(tr '\n' ' ' < /root/res/env.txt)"
      # page cache for the big imports every server process makes (torch, CUDA libraries), in the background
      sp=$(python3 -c "import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))")
      setsid sh -c "find $sp/torch $sp/nvidia $sp/transformers $sp/triton -type f -print0 | xargs -0 cat > /dev/null" \
        > /dev/null 2>&1 < /dev/null & ;;
    lmcache)
      (cd /root/x && tar -xf /root/p/lmc.tar && $PIPI a_lmc/*.whl) || { say "lmcache install failed"; exit 3; }
      python3 -c "import torch, lmcache.cuda_ops as c; print('lmcache.cuda_ops loaded from', c.__file__)" > /root/res/cuda_ops.txt 2>&1
      say "$(tail -1 /root/res/cuda_ops.txt)" ;;
    engine)  # LMCache's engine and CUDA connector in this process; needs vLLM (the fused-K|V hook), so after install.
      # vLLM 0.26 starts chunk hashes from random bytes unless PYTHONHASHSEED is set: the plugin then
      # serves nothing, by design (the servers the e2e tests start get a shared seed themselves)
      PYTHONHASHSEED=0 timeout 150 python3 -m pytest -q -p no:cacheprovider -s -rfEs --tb=short tests/test_cuda_lmcache_engine.py \
        "tests/test_residency.py::test_memory_tier_on_cuda" > /root/res/cuda_lmcache_tests.txt 2>&1
      say "LMCache CUDA tests: $(grep -E '(passed|failed|error|skipped)' /root/res/cuda_lmcache_tests.txt | tail -1)" ;;
    models)  # the tests' and the benchmark's local models (random weights), made once per box
      python3 -c "from lmcache_cartridge.tools.testmodel import ensure_test_model as e; print(e())
import sys; sys.path.insert(0, 'benchmarks'); from ttft import BENCH_MODEL; print(BENCH_MODEL.ensure())" \
        > /root/res/models.txt 2>&1
      say "models: $(tail -2 /root/res/models.txt | tr '\n' ' ')" ;;
    install)
      # one pip run for both sets: `--target --upgrade` replaces a top-level folder another wheel shares
      # (opentelemetry/: the api's `context` would be lost under the exporters')
      (cd /root/x && cat /root/p/rest.tar.* | tar -xf - && rm -rf /tmp/site/opentelemetry && $PIPI a_lmc/*.whl b_vdeps/*.whl \
        && { [ ! -f vllm026.tar.xz ] || tar -xJf vllm026.tar.xz -C /tmp/site; } && rm -f vllm026.tar.xz) || { say "vLLM install failed"; exit 3; }
      python3 -m compileall -q -j 0 /tmp/site/vllm /tmp/site/lmcache "$REPO/lmcache_cartridge" > /dev/null 2>&1
      python3 -c "import vllm, lmcache.cuda_ops; print('vllm', vllm.__version__)" > /root/res/vllm_import.txt 2>&1
      say "installed: $(tail -1 /root/res/vllm_import.txt)" ;;
    e2e)
      timeout $(( $(left) < 420 ? $(left) : 420 )) python3 -m pytest -q -p no:cacheprovider -s -rfEs --tb=short \
        --basetemp=/root/x/pt3 tests/test_cuda_vllm_e2e.py tests/test_cuda_mp_e2e.py > /root/res/cuda_vllm_e2e.txt 2>&1
      say "vLLM CUDA e2e: $(grep -E '(passed|failed|error|skipped)' /root/res/cuda_vllm_e2e.txt | tail -1)"
      grep -E "^\[(e2e|cuda)" /root/res/cuda_vllm_e2e.txt | tee -a /root/res/summary.txt
      i=0; for f in $(find /root/x/pt3 -name server.log); do i=$((i+1)); tail -c 2000000 "$f" > /root/res/e2e_server_$i.log; done ;;
    ttft)
      n=ttft$([ -n "${TTFT_ARGS:-}" ] && echo "_$(echo "$TTFT_ARGS" | md5sum | cut -c1-6)")
      mkdir -p /root/res/$n
      timeout $(( $(left) - 15 )) python3 benchmarks/ttft.py --device --baseline lmcache --out /root/res/$n \
        --work /root/x/bench ${TTFT_ARGS:---arms full_prefill,cartridge,prefix_cache --lengths 4096,8192,16384 --concurrency 1,4 --samples 8} \
        > /root/res/$n/ttft_log.txt 2>&1
      say "TTFT ($n): rc=$? $(grep -c '' /root/res/$n/ttft_log.txt) log lines; $(tail -1 /root/res/$n/ttft_log.txt)"
      for f in $(find /root/x/bench/servers -name server.log); do
        tail -c 2000000 "$f" > /root/res/$n/server_$(basename "$(dirname "$f")").log; done ;;
    copybench)  # the fused K|V load against the bus (torch and LMCache only: runs before vLLM is installed)
      mkdir -p /root/res/fused_copy
      timeout $(( $(left) - 10 )) python3 benchmarks/fused_copy.py --device cuda --shapes llama-3.1-8b,llama-3.2-1b,bench \
        --tokens 4096,16384,32768 --reps 4 --profile --out /root/res/fused_copy > /root/res/fused_copy/log.txt 2>&1
      say "fused copy: rc=$? $(grep -c '^{' /root/res/fused_copy/log.txt) cells" ;;
    shapes)  # the production shapes' config and tokenizer (no weights), made before the TTFT stage needs them
      python3 -c "from lmcache_cartridge.tools.testmodel import ensure_shape_model as e; print(e('llama-3.1-8b')); print(e('llama-3.2-1b'))" \
        > /root/res/shapes.txt 2>&1
      say "shapes: $(tail -2 /root/res/shapes.txt | tr '\n' ' ')" ;;
    prod)  # TTFT at a production shape (random weights, vLLM's --load-format dummy): PROD_SHAPE, PROD_ARGS
      n=ttft_${PROD_SHAPE:-llama-3.1-8b}; mkdir -p /root/res/$n
      timeout $(( $(left) - 15 )) python3 benchmarks/ttft.py --device --shape ${PROD_SHAPE:-llama-3.1-8b} \
        --baseline lmcache --prefix-on-lmcache --lmcache-gb ${PROD_LMCACHE_GB:-16} --out /root/res/$n --work /root/x/bench \
        ${PROD_ARGS:---arms full_prefill,cartridge,cartridge_cached,prefix_cache,cartridge_mp,mp_l1 --lengths 4096,16384,32768 --concurrency 1,8 --samples 4} \
        > /root/res/$n/ttft_log.txt 2>&1
      say "TTFT ($n): rc=$? $(tail -1 /root/res/$n/ttft_log.txt | cut -c1-300)"
      grep -E "p50|healthy|cartridge ttft" /root/res/$n/ttft_log.txt | tail -40 >> /root/res/summary.txt
      for f in $(find /root/x/bench/servers -name server.log -o -name lmcache-server.log); do
        tail -c 1000000 "$f" > /root/res/$n/$(basename "$(dirname "$f")")_$(basename "$f"); done
      df -h /dev/shm > /root/res/$n/shm.txt 2>&1 ;;
    quality)  # the data-scale curve's largest point on the GPU (payload made with QUALITY=1):
      # the real model's carried wheel where `ensure_real_model` looks, then quality_scale.py (which converts it) (train on CUDA,
      # synthesis by vLLM on the same GPU); resumable, so a later call within 30 s goes on
      mkdir -p /root/res/quality "$LMCACHE_CARTRIDGE_HOME/downloads" && cp /root/x/c_model/*.whl "$LMCACHE_CARTRIDGE_HOME/downloads/"
      timeout $(( $(left) - 20 )) python3 benchmarks/quality_scale.py --work /root/x/quality --out /root/res/quality/scale_gpu \
        ${QUALITY_ARGS:---scales 16384 --tokens 256 --no-baselines --probe-threads 8 --synth-batch 1024 --synth-eager} \
        > /root/res/quality/log.txt 2>&1
      say "quality: rc=$? $(grep '^\[scale\]' /root/res/quality/log.txt | tail -2 | cut -c1-300 | tr '\n' ' ')"
      # how far each stage got, for a run stopped by the deadline: saved batches and checkpoints with their times
      find /root/x/quality -name metrics.jsonl -exec cp {} /root/res/quality/ \;
      find /root/x/quality -type f -printf '%TT %s %p\n' 2>/dev/null \
        | sort > /root/res/quality/files.txt ;;
    pack) tar -czf "$OUT/res.tgz" -C /root res; cp /root/res/summary.txt "$OUT/" ;;
  esac
  shift
done

#!/usr/bin/env bash
# On the GPU box: a self-study data-scale point with HF + PEFT (no vLLM), from hf_payload.sh's
# folders. Stages run in the order given, in one call or several:
#   stash N      move folder PREFIX<N>'s piece (and the kit, in the first) to /root, where the next
#                call finds it if it starts within 30 s
#   kit          install the kit's wheels (/tmp/site) and the model's config and tokenizer
#   probe        synthesis and training speed on random weights of the model's shape (hf_probe.py)
#   smoke        gpu_scale.sh at 64 conversations on random weights, in /tmp/smoke
#   model        the real weights from the pieces (assemble_model.py, checked against the host's hash)
#   scale N      benchmarks/gpu_scale.sh N: the tar in $OUT
# The four calls of an H200 run (carry in brackets):
#   bash benchmarks/device/hf_on_device.sh stash 1 kit probe smoke   [.hfcarry1]
#   bash benchmarks/device/hf_on_device.sh stash 2                   [.hfcarry2]
#   bash benchmarks/device/hf_on_device.sh stash 3                   [.hfcarry3]
#   bash benchmarks/device/hf_on_device.sh stash 4 model scale 8192  [.hfcarry4]
set -eo pipefail
cd "$(dirname "$0")/../.."
P=${PREFIX:-.hfcarry}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export LMCACHE_CARTRIDGE_HOME=${LMCACHE_CARTRIDGE_HOME:-$PWD/.cache}
M=$LMCACHE_CARTRIDGE_HOME/models/SmolLM2-135M-Instruct
OUT=${OUT:-$PWD}
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
T0=$(date +%s)
while [ $# -gt 0 ]; do
    stage=$1; shift
    case $stage in
    stash)
        n=$1; shift
        mkdir -p /root/parts /root/kit
        mv "$P$n"/p* /root/parts/
        if [ -d "$P$n/kit" ]; then cp -r "$P$n/kit/." /root/kit/; fi
        log "stashed piece $n: $(ls /root/parts | tr '\n' ' ')" ;;
    kit)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            /root/kit/*.whl
        mkdir -p "$M"
        cp /root/kit/{build_params.json,chat_template.jinja,config.json,generation_config.json,tokenizer_config.json} "$M/"
        python3 -c "import lzma; open('$M/tokenizer.json', 'wb').write(lzma.decompress(open('/root/kit/tok.xz', 'rb').read()))"
        log "kit: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader); $(nproc) cores; $(python3 --version)" ;;
    probe)
        python3 benchmarks/device/hf_probe.py "$M" "${SYNTH_BATCH:-1024}" 2>&1 | grep -vi warn
        log "probe done" ;;
    smoke)
        python3 - "$M" <<'PYEOF'
import sys
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]), dtype=torch.bfloat16)
save_file({k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"},  # tied
          f"{sys.argv[1]}/model.safetensors", metadata={"format": "pt"})
PYEOF
        WORK=/tmp/smoke OUT=/tmp benchmarks/gpu_scale.sh 64 --heldout 8 2>&1 | grep -vi "warn\|Loading weights" | tail -5
        rm -f "$M/model.safetensors"
        log "smoke: $(tar -tf /tmp/gpu_scale_n64.tar | tr '\n' ' ')" ;;
    model)
        python3 benchmarks/device/assemble_model.py "$M"
        log "model assembled" ;;
    scale)
        n=$1; shift
        OUT=$OUT benchmarks/gpu_scale.sh "$n" 2>&1 | grep -vi "warn\|Loading weights" | tee "$OUT/gpu_scale_n$n.log"
        log "scale $n done" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
    esac
done

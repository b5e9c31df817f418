#!/usr/bin/env bash
# The data-scale curve's point at N conversations, trained on a CUDA machine: the synthesis by
# HF transformers on batches of conversations (vLLM is not needed there), the training by PEFT,
# with the curve's settings (quality_scale.py's), fp32 training as on the CPU.
#
#   benchmarks/gpu_scale.sh 8192                 # on the GPU machine, in a checkout with the model
#   mkdir -p .cache/quality/scale_gpu/carts       # back here: the tar into a work dir of its own
#   tar -xf gpu_scale_n8192.tar -C .cache/quality/scale_gpu/carts
#   .venv/bin/python benchmarks/quality_scale.py --scales 8192 --no-baselines \
#       --work .cache/quality/scale_gpu --out benchmarks/results/quality/scale_gpu   # asks its questions
#
# A work dir of its own, because a GPU run's conversations are not the CPU run's of the same scale
# (HF there, vLLM here) though the cartridge's name is the same. The model must sit where this
# checkout's LMCACHE_CARTRIDGE_HOME puts it (`make model`; on the GPU box without a network:
# device/hf_payload.sh and device/hf_on_device.sh). Leaves gpu_scale_n<N>.tar (the cartridge, its
# metrics, wall time and coverage report; not the conversations or checkpoints) in $OUT or the
# current directory.
set -euo pipefail
N=${1:?usage: benchmarks/gpu_scale.sh CONVERSATIONS [quality_scale.py options]}
shift
cd "$(dirname "$0")/.."
export LMCACHE_CARTRIDGE_HOME=${LMCACHE_CARTRIDGE_HOME:-$PWD/.cache} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PYTHON=${PYTHON:-python3}
WORK=${WORK:-$PWD/.cache/quality/scale}  # quality_scale.py's --work
"$PYTHON" benchmarks/quality_scale.py --scales "$N" --tokens 256 --no-baselines --train-only --work "$WORK" \
    --device "${DEVICE:-cuda}" --synth-backend hf --synth-batch "${SYNTH_BATCH:-1024}" "$@"
carts=$WORK/carts
# everything the work directory holds but the conversations, checkpoints and synthesis shards
tar -C "$carts" -cf "${OUT:-.}/gpu_scale_n$N.tar" --exclude=data.pt --exclude=checkpoint.pt --exclude=synth .
echo "gpu_scale: wrote ${OUT:-.}/gpu_scale_n$N.tar"

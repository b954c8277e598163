#!/usr/bin/env bash
# One lent-GPU call: train the joint (12-layer) cross-encoder from the pack, then score every
# train pair with it (distillation targets for the split reranker). DEVICE.md says how to call it.
#   service/offline/training/device_teacher.sh PACK OUT [TRAIN_MINUTES] [TEACHER_MINUTES]
set -euo pipefail
pack=${1:?pack dir}; out=${2:?output dir}; train_min=${3:-6.5}; teacher_min=${4:-1.5}
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi -L || true
${PYTHON:-python3} -m service.offline.training.train --pack "$pack" --out "$out" --ckpt-dir /tmp/reranker-ckpt --device "${DEVICE:-cuda}" \
  --minutes "$train_min" --layers 12 --max-len 256 --group 16 --batch-groups 32 --epochs 5 \
  --lr 5e-5 --head-lr-mult 20 --warmup 0.06 --eval-every 400 --keep best --seed 0 2>&1 | grep -v '\] progress' || true
grep '"progress"' "$out/log.jsonl" | awk 'NR % 4 == 1' | cut -c1-220 || true
${PYTHON:-python3} -m service.offline.training.teacher --pack "$pack" --weights "$out" --out "$out/teacher.npz" --device "${DEVICE:-cuda}" \
  --minutes "$teacher_min" 2>&1 | grep -v sha256

#!/usr/bin/env bash
# For a GPU machine with PyTorch (the device tool's image): the paper's run in
# PyTorch, seeds 0 and 1, with cuDNN's TF32 on (PyTorch's default) and off.
# Run from the repository root with the data carried in `.duq_data/`:
#   mkdir -p .duq_data/keras/datasets .duq_data/mnist
#   cp -r ../shared/data/keras/datasets/fashion-mnist .duq_data/keras/datasets/
#   cp ../shared/data/mnist/t10k-* .duq_data/mnist/
# then: bash examples/results/fashion_mnist/pytorch_run/device_check.sh
# (carry `.duq_data`). Results land in $OUT (or ./pytorch_gpu_out). Each run is
# cut at LIMIT_S seconds (default 540) with its finished epochs logged.
set -u
out=${OUT:-pytorch_gpu_out}
mkdir -p "$out"
script=examples/results/fashion_mnist/pytorch_run/train_pytorch.py
export DUQ_DATA=.duq_data
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt" 2>&1
for seed in 0 1; do
  for tf32 in off on; do
    timeout "${LIMIT_S:-540}" "${PYTHON:-python}" "$script" --seed $seed --device cuda --tf32 $tf32 \
      --state-dir "$out/gpu_tf32_${tf32}_seed$seed" > "$out/log_tf32_${tf32}_seed$seed.txt" 2>&1 &
  done
done
wait
# state.pt is kept: a later call resumes from it if the folder is carried back.
tail -n 2 "$out"/*/epochs.jsonl

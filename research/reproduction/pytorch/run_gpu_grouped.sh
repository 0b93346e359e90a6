#!/usr/bin/env bash
# For a GPU machine with PyTorch (CUDA) and numpy: as many full
# 30-epoch runs as fit in TRAIN_S seconds (default 480), trained as one grouped
# network (train_pytorch_grouped.py): half with the paper code's recipe, half
# as keras_duq trains (zero biases, exact BCE gradient). Float32 (TF32 off).
# Run from the repository root with the data in `.duq_data/` (see README.md).
# It times 8, 16 and 32 models per step, picks the largest count whose 30
# epochs fit, and trains it. Results land in $OUT (default ./pytorch_gpu_out):
# gpu.txt, timing.txt, epochs.jsonl, log.txt. The state stays in STATE_DIR
# (default /tmp/duq_grouped_state), so running it again on the same machine
# resumes the run (the model count is then read from STATE_DIR/models).
set -u
out=${OUT:-pytorch_gpu_out}
state=${STATE_DIR:-/tmp/duq_grouped_state}
script=research/reproduction/pytorch/train_pytorch_grouped.py
export DUQ_DATA=${DUQ_DATA:-.duq_data} PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
device=${DEVICE:-cuda}  # DEVICE=cpu, TIMING_MODELS="2 4", TIMING_STEPS=7 and
# EXTRA_ARGS="--train-subset 1024 --epochs 2" are for smoke tests of this script.
deadline=$(( $(date +%s) + ${TRAIN_S:-480} ))
mkdir -p "$out" "$state"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
"$python" -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" >> "$out/gpu.txt" 2>&1

if [[ ! -f "$state/models" ]]; then
  "$python" "$script" --self-check --device "$device" > "$out/self_check.txt" 2>&1 || {
    echo "self-check failed"; cat "$out/self_check.txt"; exit 1; }
  for g in ${TIMING_MODELS:-8 16 32}; do
    "$python" "$script" --models "$g" --keras-like $(( g / 2 )) --device "$device" \
      --max-steps "${TIMING_STEPS:-25}" \
      --state-dir "$state/timing" 2>&1 | tail -n 1 | tee -a "$out/timing.txt"
  done
  # Largest count whose 30 epochs (468 steps each, plus 10% for evaluation and
  # the epoch ends) fit before the deadline; timings between the measured
  # counts are interpolated.
  "$python" - "$out/timing.txt" $(( deadline - $(date +%s) )) > "$state/models" <<'EOF'
import re, sys
points = sorted((int(m), float(s)) for m, s in
                re.findall(r"(\d+) models: ([\d.]+) s/step", open(sys.argv[1]).read()))
left = float(sys.argv[2])
best = points[0][0]
for g in range(points[0][0], points[-1][0] + 1, 2):
    lo = max(p for p in points if p[0] <= g)
    hi = min(p for p in points if p[0] >= g)
    step = lo[1] if hi == lo else lo[1] + (g - lo[0]) * (hi[1] - lo[1]) / (hi[0] - lo[0])
    if 30 * 468 * step * 1.10 < left:
        best = g
print(best)
EOF
fi
models=$(cat "$state/models")
echo "models: $models, $(( deadline - $(date +%s) )) s left" | tee -a "$out/log.txt"
timeout $(( deadline - $(date +%s) )) "$python" "$script" --models "$models" \
  --keras-like $(( models / 2 )) --seed 1 --tf32 off --state-dir "$state/run" \
  --device "$device" ${EXTRA_ARGS:-} \
  2>&1 | tee -a "$out/log.txt"
cp "$state/run/epochs.jsonl" "$out/" 2>/dev/null
"$python" - "$out/epochs.jsonl" <<'EOF'
import json, sys, collections
rows = [json.loads(line) for line in open(sys.argv[1])]
last = max(r["epoch"] for r in rows)
for epoch in sorted({r["epoch"] for r in rows if "auroc" in r}):
    by = collections.defaultdict(list)
    for r in rows:
        if r["epoch"] == epoch and "auroc" in r:
            by[r["variant"]].append(r["auroc"])
    print(epoch, {k: (len(v), round(sum(v) / len(v), 4), round(min(v), 4), round(max(v), 4))
                  for k, v in by.items()})
print("last epoch", last)
EOF

#!/usr/bin/env bash
# For a GPU machine with PyTorch (CUDA) and numpy: the paper's run in
# PyTorch over several seeds, in float32 (cuDNN's TF32 off), with TF32 on
# (PyTorch's default), and with keras_duq's two remaining differences (zero
# biases, the last partial batch kept).
# Run from the repository root with the data carried in `.duq_data/`:
#   mkdir -p .duq_data/keras/datasets .duq_data/mnist
#   cp -r ../shared/data/keras/datasets/fashion-mnist .duq_data/keras/datasets/
#   cp ../shared/data/mnist/t10k-* .duq_data/mnist/
# then: bash research/reproduction/pytorch/run_gpu_queue.sh
# Runs go PARALLEL at a time (default 8) from a queue in
# order of priority; no run starts in the last 120 s, and all stop at LIMIT_S
# (default 480) with their finished epochs logged. Results land in $OUT (default
# ./pytorch_gpu_out): gpu.txt, epochs.jsonl (every run's epochs) and logs.txt.
set -u
out=${OUT:-pytorch_gpu_out}
export STATE=${STATE_DIR:-/tmp/duq_pytorch_state}
export SCRIPT=research/reproduction/pytorch/train_pytorch.py
export DUQ_DATA=${DUQ_DATA:-.duq_data} PYTHONUNBUFFERED=1
export DEADLINE=$(( $(date +%s) + ${LIMIT_S:-480} ))
export PYTHON=${PYTHON:-python3}
mkdir -p "$out" "$STATE"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" >> "$out/gpu.txt" 2>&1

run_one() {  # tf32 seed bias_init last_batch
  local name="tf32_$1_seed$2_bias_$3_last_$4"
  local left=$(( DEADLINE - $(date +%s) ))
  if (( left < 120 )); then echo "$name: not started, ${left} s left"; return; fi
  # EXTRA_ARGS (e.g. `--device cpu --train-subset 300 --epochs 5`) is for smoke tests.
  timeout "$left" "$PYTHON" "$SCRIPT" --device cuda --tf32 "$1" --seed "$2" \
    --bias-init "$3" --last-batch "$4" --state-dir "$STATE/$name" ${EXTRA_ARGS:-} \
    > "$STATE/$name.log" 2>&1
  echo "$name: exit $? after $(( $(date +%s) - DEADLINE + left )) s"
}
export -f run_one

# Priority: float32 seeds, then TF32 on, then keras_duq's differences, then more seeds.
printf '%s\n' \
  "off 0 pytorch drop" "off 1 pytorch drop" "off 2 pytorch drop" "off 3 pytorch drop" \
  "on 0 pytorch drop" "on 1 pytorch drop" "off 0 zeros keep" "off 1 zeros keep" \
  "off 4 pytorch drop" "off 5 pytorch drop" "off 2 zeros keep" "off 3 zeros keep" \
  "on 2 pytorch drop" "on 3 pytorch drop" "off 6 pytorch drop" "off 7 pytorch drop" |
  xargs -P "${PARALLEL:-8}" -L1 bash -c 'run_one "$@"' _ | tee "$out/logs.txt"

for log in "$STATE"/*.log; do echo "== $log"; tail -n 3 "$log"; done >> "$out/logs.txt"
"$PYTHON" - "$STATE" "$out/epochs.jsonl" <<'EOF'
import glob, json, os, sys
state, target = sys.argv[1:]
rows = []
for path in sorted(glob.glob(os.path.join(state, "*", "epochs.jsonl"))):
    run = os.path.basename(os.path.dirname(path))
    rows += [{"run": run, **json.loads(line)} for line in open(path)]
with open(target, "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
for row in rows:
    if "auroc" in row:
        print(f"{row['run']:40s} epoch {row['epoch']:2d}  accuracy {row['test_accuracy']:.4f}"
              f"  AUROC {row['auroc']:.4f}  {row['seconds']:.1f} s")
EOF

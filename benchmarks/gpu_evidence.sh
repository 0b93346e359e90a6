#!/usr/bin/env bash
# keras_duq's GPU evidence on the JAX backend, one prepared device call per part.
#
# The lent GPU machine has JAX (CUDA), scikit-learn and matplotlib but no
# TensorFlow or Keras, and no network. Prepare here, once, in the repository
# root (both folders are ignored by git and travel with `carry`):
#
#   echo /.whl/ >> .git/info/exclude; echo /.gpu_data/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl keras==3.15.1 namex optree
#   mkdir -p .gpu_data/fashion-mnist .gpu_data/mnist
#   cp ../shared/data/keras/datasets/fashion-mnist/*.gz .gpu_data/fashion-mnist/
#   cp ../shared/data/mnist/t10k-*.gz .gpu_data/mnist/
#
# Then, with the device tool: run(command="bash benchmarks/gpu_evidence.sh speed",
# carry=[".whl", ".gpu_data"], timeout_s=...). Parts (several may be given):
#
#   speed         ms/step through `fit` (benchmarks/jax_speed.py): the paper's
#                 FashionMNIST CNN and the CIFAR ResNet-18, softmax / DUQ / DUQ
#                 with the penalty, float32 with matmul precision "highest"
#                 (no TF32) and mixed_bfloat16; then the CNN at JAX's default
#                 precision.
#   fm_float32    examples/fashion_mnist.py, the paper's recipe (30 epochs,
#   fm_bfloat16   seed $SEED, default 0), float32 ("highest") or mixed_bfloat16.
#
# Everything is logged to $OUT (at most 8 files come back): gpu.txt,
# jax_speed_*.json, fm_*_results.json and one log per part.
# SMOKE=1 shrinks every part to a few steps and leaves the ResNet out (a
# check on a CPU before a lease).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_evidence_out}"
SEED="${SEED:-0}"
mkdir -p "$OUT"
export KERAS_BACKEND=jax PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
data=.gpu_data
[ -d "$data" ] || data=../shared/data/keras/datasets  # a local CPU check
mnist=.gpu_data/mnist
[ -d "$mnist" ] || mnist=../shared/data/mnist

{
    nvidia-smi 2>/dev/null || echo "no nvidia-smi"
    python3 -c "import jax, keras; print('jax', jax.__version__, jax.devices()); print('keras', keras.__version__)"
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

resnet=--resnet
if [ "${SMOKE:-0}" = 1 ]; then
    resnet=  # its penalty step takes minutes on a CPU
    speed_args=(--steps 2 --repeats 1)
    fm_args=(--epochs 1 --train-subset 512 --test-subset 512 --ood-eval-every 1)
else
    speed_args=()
    fm_args=()
fi

fashion_mnist() {  # $1: part name, $2: --mixed-precision value
    JAX_DEFAULT_MATMUL_PRECISION=highest python3 examples/fashion_mnist.py \
        --seed "$SEED" --mixed-precision "$2" \
        --fashion-mnist-path "$data/fashion-mnist" --mnist-path "$mnist" \
        --output-dir "/tmp/$1" "${fm_args[@]}" 2>&1 | tee "$OUT/$1.log"
    cp "/tmp/$1/results.json" "$OUT/$1_seed${SEED}_results.json"
}

for part in "$@"; do
    case "$part" in
        speed)
            python3 benchmarks/jax_speed.py $resnet --matmul-precision highest \
                --output "$OUT/jax_speed_highest.json" "${speed_args[@]}" 2>&1 | tee "$OUT/speed.log"
            python3 benchmarks/jax_speed.py --matmul-precision default \
                --output "$OUT/jax_speed_default.json" "${speed_args[@]}" 2>&1 | tee -a "$OUT/speed.log"
            ;;
        fm_float32) fashion_mnist fm_float32 none ;;
        fm_bfloat16) fashion_mnist fm_bfloat16 mixed_bfloat16 ;;
        *) echo "unknown part '$part'; expected speed, fm_float32 or fm_bfloat16" >&2; exit 2 ;;
    esac
done

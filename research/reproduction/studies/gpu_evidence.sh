#!/usr/bin/env bash
# keras_duq's GPU measurements on the JAX and PyTorch backends, and the
# paper's PyTorch code for comparison, in one script.
#
# Written for a GPU machine that has JAX (CUDA), PyTorch (CUDA), scikit-learn
# and matplotlib but no TensorFlow or Keras, and no network. Prepare, once, on a machine with
# network, in the repository root, and copy both folders along with the
# repository (git ignores them):
#
#   echo /.whl/ >> .git/info/exclude; echo /.duq_data/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl keras==3.15.1 namex optree
#   mkdir -p .duq_data/keras/datasets .duq_data/mnist
#   cp -r ../shared/data/keras/datasets/fashion-mnist .duq_data/keras/datasets/
#   cp ../shared/data/mnist/t10k-*.gz .duq_data/mnist/
#
# Then, on the GPU machine, from the repository root:
#
#   BUDGET=560 bash research/reproduction/studies/gpu_evidence.sh speed default fm
#
# Parts, run in the order given:
#
#   speed     ms/step through `fit` and predict time (research/reproduction/studies/jax_speed.py):
#             the paper's FashionMNIST CNN, then the CIFAR ResNet-18; softmax /
#             DUQ / DUQ with the penalty; float32 with matmul precision
#             "highest" (no TF32) and mixed_bfloat16. At most SPEED_S seconds
#             (default 240); the JSON keeps every model measured before that.
#             SPEED_NETWORKS and SPEED_POLICIES pick a part of the table (e.g.
#             "cifar_resnet18" and "mixed_bfloat16").
#   torch_speed
#             the same table on Keras's PyTorch backend (float32 without
#             TF32, and mixed_bfloat16), at most SPEED_S seconds.
#   default   the CNN again at JAX's default precision (TF32 allowed), at most
#             60 seconds.
#   fm        research/reproduction/fashion_mnist.py, the paper's recipe (30 epochs), for
#             every seed in SEEDS (default "0 1") and policy in FM_POLICIES
#             (default float32 ("highest") and mixed_bfloat16), all in
#             parallel on the one GPU (their times are not step timings). Each
#             run logs every epoch, so a run stopped by BUDGET still shows
#             how far it got.
#   paper     the paper's code (research/reproduction/pytorch/train_pytorch.py, 30
#             epochs, PyTorch's default TF32 convolutions unless PAPER_TF32=off)
#             for every seed in PAPER_SEEDS (default "0 1 2"), in parallel
#             with each other and with fm when both are named in one call
#             (`fm+paper`). Epoch logs go to $OUT/paper_seed<S>.jsonl.
#   tuning    research/benchmarks/tuning_fashion_mnist.py: `keras_duq.tuning.search` with
#             the paper's recipe (5 epochs per trial), then 30 epochs with the
#             choice, for every seed in TUNING_SEEDS (default "0 1 2"), in
#             parallel; $OUT/tuning_fm_seed<S>.json each.
#
# LOG names the log (default run, so $OUT/run.log).
# BUDGET (seconds, default 3600) bounds the whole script: each part stops at
# the budget. Everything goes to $OUT: run.log (the
# GPU, then every part's output, fm's lines prefixed by run), jax_speed_*.json
# and fm_<policy>_seed<S>.json.
# SMOKE=1 shrinks every part to a few steps and leaves the ResNet out (a
# check on a CPU before using the GPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/gpu_evidence_out}"
SEEDS="${SEEDS:-0 1}"
FM_POLICIES="${FM_POLICIES:-float32 mixed_bfloat16}"
BUDGET="${BUDGET:-3600}"
SPEED_S="${SPEED_S:-240}"
mkdir -p "$OUT"
log="$OUT/${LOG:-run}.log"
export KERAS_BACKEND=jax PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
data=.duq_data/keras/datasets
[ -d "$data" ] || data=../shared/data/keras/datasets  # a local CPU check
mnist=.duq_data/mnist
[ -d "$mnist" ] || mnist=../shared/data/mnist
export DUQ_DATA="${DUQ_DATA:-$(dirname "$mnist")}"

{
    nvidia-smi 2>/dev/null || echo "no nvidia-smi"
    nproc
    python3 -c "import jax, keras; print('jax', jax.__version__, jax.devices()); print('keras', keras.__version__)"
    python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"
} 2>&1 | tee "$log"

read -r -a networks <<< "${SPEED_NETWORKS:-fashion_mnist_cnn cifar_resnet18}"
read -r -a policies <<< "${SPEED_POLICIES:-float32 mixed_bfloat16}"
read -r -a kinds <<< "${SPEED_KINDS:-softmax duq duq_penalty}"
speed_args=(--kinds "${kinds[@]}")
fm_args=()
tuning_args=()
paper_args=(--epochs 30 --device "${PAPER_DEVICE:-cuda}" --tf32 "${PAPER_TF32:-on}")
if [ "${SMOKE:-0}" = 1 ]; then
    networks=(fashion_mnist_cnn)  # the ResNet's penalty step takes minutes on a CPU
    speed_args+=(--steps 2 --repeats 1)
    fm_args=(--epochs 1 --train-subset 512 --test-subset 512 --ood-eval-every 1)
    paper_args=(--epochs 1 --train-subset 512 --device "${PAPER_DEVICE:-cuda}")
    tuning_args=(--train-subset 1000 --test-subset 500 --epochs-per-trial 1
        --final-epochs 1 --max-trials 2)
fi

fm() {  # starts the keras_duq runs in the background
    # Several processes share the GPU: no process may take most of its memory.
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    for seed in $SEEDS; do
        for policy in $FM_POLICIES; do
            name="fm_${policy#mixed_}_seed$seed"
            mp=$policy; [ "$policy" = float32 ] && mp=none
            (
                JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$1" \
                    python3 -m reproduction.fashion_mnist --seed "$seed" \
                    --mixed-precision "$mp" --fashion-mnist-path "$data/fashion-mnist" \
                    --mnist-path "$mnist" --output-dir "/tmp/$name" "${fm_args[@]}" 2>&1 \
                    | sed -u "s/^/[$name] /" >> "$log"
                cp "/tmp/$name/results.json" "$OUT/$name.json"
            ) &
        done
    done
}

paper() {  # starts the paper code's runs in the background
    for seed in ${PAPER_SEEDS:-0 1 2}; do
        (
            timeout "$1" python3 research/reproduction/pytorch/train_pytorch.py --seed "$seed" \
                --state-dir "/tmp/paper_seed$seed" "${paper_args[@]}" 2>&1 \
                | sed -u "s/^/[paper_seed$seed] /" >> "$log"
            cp "/tmp/paper_seed$seed/epochs.jsonl" "$OUT/paper_seed$seed.jsonl"
        ) &
    done
}

tuning() {  # starts the tuning runs in the background
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    for seed in ${TUNING_SEEDS:-0 1 2}; do
        (
            JAX_DEFAULT_MATMUL_PRECISION=highest timeout "$1" \
                python3 -m benchmarks.tuning_fashion_mnist --seeds "$seed" \
                --fashion-mnist-path "$data/fashion-mnist" --mnist-path "$mnist" \
                --output-dir "/tmp/tuning_seed$seed" --output "$OUT/tuning_fm_seed$seed.json" \
                "${tuning_args[@]}" 2>&1 | sed -u "s/^/[tuning_seed$seed] /" >> "$log"
        ) &
    done
}

left() {  # seconds of the budget left, less $1
    echo $(( BUDGET - SECONDS - $1 > 1 ? BUDGET - SECONDS - $1 : 1 ))
}

for part in "$@"; do
    echo "== $part at ${SECONDS}s" | tee -a "$log"
    case "$part" in
        speed)
            limit=$(left 5); [ "$limit" -gt "$SPEED_S" ] && limit=$SPEED_S
            timeout "$limit" python3 -m reproduction.studies.jax_speed --networks "${networks[@]}" \
                --policies "${policies[@]}" --matmul-precision highest --output "$OUT/jax_speed_highest.json" \
                "${speed_args[@]}" 2>&1 | tee -a "$log"
            ;;
        default)
            limit=$(left 5); [ "$limit" -gt 60 ] && limit=60
            timeout "$limit" python3 -m reproduction.studies.jax_speed --matmul-precision default \
                --output "$OUT/jax_speed_default.json" "${speed_args[@]}" 2>&1 | tee -a "$log"
            ;;
        torch_speed)
            limit=$(left 5); [ "$limit" -gt "$SPEED_S" ] && limit=$SPEED_S
            KERAS_BACKEND=torch timeout "$limit" python3 -m reproduction.studies.jax_speed \
                --networks "${networks[@]}" --policies "${policies[@]}" \
                --matmul-precision highest --output "$OUT/torch_speed_highest.json" \
                "${speed_args[@]}" 2>&1 | tee -a "$log"
            ;;
        fm) fm "$(left 10)"; wait ;;
        paper) paper "$(left 10)"; wait ;;
        fm+paper) fm "$(left 10)"; paper "$(left 10)"; wait ;;
        tuning) tuning "$(left 10)"; wait ;;
        *) echo "unknown part '$part'; expected speed, torch_speed, default, fm, paper, fm+paper or tuning" >&2; exit 2 ;;
    esac
done
echo "== done at ${SECONDS}s" | tee -a "$log"

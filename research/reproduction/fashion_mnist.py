"""FashionMNIST vs. MNIST: the paper's image experiment (Section 4.2).

Trains DUQ (or the softmax / deep ensemble baselines) on FashionMNIST with
the paper's three-layer CNN and settings (Appendix A), then measures how well
the certainty separates the FashionMNIST test set from the MNIST test set.
Writes `results.json` and the ROC, rejection and histogram figures into
`--output-dir`.

    # DUQ, the paper's settings (30 epochs; hours on a laptop CPU)
    python -m research.reproduction.fashion_mnist --model duq --output-dir outputs/duq \\
        --mnist-path ../shared/data/mnist
    # baselines
    python -m research.reproduction.fashion_mnist --model softmax --output-dir outputs/softmax
    python -m research.reproduction.fashion_mnist --model ensemble --output-dir outputs/ensemble
    # quick smoke run
    python -m research.reproduction.fashion_mnist --epochs 2 --train-subset 3000 \\
        --batch-size 64 --output-dir outputs/smoke

FashionMNIST comes from `keras.datasets.fashion_mnist` (set `KERAS_HOME` to
a folder holding `datasets/fashion-mnist/` to run offline) or from
`--fashion-mnist-path`, MNIST's test set from `--mnist-path` (a folder with
the original IDX files) or, without it, from `keras.datasets.mnist`.

Paper results to compare with (30 epochs, full training set, 5 runs):
DUQ (lambda 0.05) 92.4% accuracy, AUROC 0.955; softmax 92.4%, AUROC 0.843;
5-model deep ensemble 93.6%, AUROC 0.861.
"""

from __future__ import annotations

import argparse
import math
import sys

import keras
import numpy as np

import keras_duq
from research.reproduction import _harness

# Shared with research/reproduction/cifar10.py; still importable from here.
from research.reproduction._harness import LEARNING_RATE as LEARNING_RATE
from research.reproduction._harness import (
    MIXED_PRECISION_POLICIES as MIXED_PRECISION_POLICIES,
)
from research.reproduction._harness import SGD_MOMENTUM as SGD_MOMENTUM
from research.reproduction._harness import EpochLog as EpochLog
from research.reproduction._harness import jit_compile_argument as jit_compile_argument
from research.reproduction._harness import nan_to_none as nan_to_none
from research.reproduction._harness import (
    pytorch_default_initializer as pytorch_default_initializer,
)
from research.reproduction._harness import read_epoch_log as read_epoch_log
from research.reproduction._harness import save_figures as save_figures
from research.reproduction._harness import set_dtype_policy as set_dtype_policy
from research.reproduction._harness import train_model as train_model

NUM_CLASSES = 10
WEIGHT_DECAY = 1e-4
# The learning rate is divided by 5 after every 10 epochs (epochs 10 and 20).
LR_DECAY_FACTOR = 5.0
LR_DECAY_EVERY_EPOCHS = 10


def parse_args(argv=None) -> argparse.Namespace:
    parser = _harness.new_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument(
        "--gradient-penalty",
        type=float,
        default=0.05,
        help="DUQ's lambda (the paper's best on FashionMNIST).",
    )
    parser.add_argument(
        "--penalty-interval",
        type=int,
        default=1,
        help="Compute the penalty on every Nth step only, weighted N times "
        "(keras_duq.DUQModel's penalty_interval); 1 is the paper's exact penalty.",
    )
    parser.add_argument("--length-scale", type=float, default=0.1)
    parser.add_argument(
        "--spectral-normalization",
        type=float,
        default=None,
        metavar="COEFFICIENT",
        help="DUQ: wrap the backbone's convolutions and dense layer with "
        "keras_duq.spectral_normalize(backbone, coefficient=COEFFICIENT)",
    )
    _harness.add_arguments(parser, "--bias-correction", "--centroid-momentum", "--head")
    parser.add_argument(
        "--kernel-initializer",
        default="reference",
        help="Initializer of DUQ's projection W: 'reference' (normal, stddev "
        "0.05, as the paper's code) or a Keras initializer name such as "
        "'he_normal' (keras_duq's default).",
    )
    parser.add_argument(
        "--bce-epsilon",
        type=float,
        default=0.0,
        help="Floor of K(1-K) in the cross-entropy gradient: 0 is exact, "
        "1e-12 is PyTorch's binary_cross_entropy as in the paper's code "
        "(see keras_duq.DUQModel).",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--validation-split",
        type=int,
        default=0,
        help="Hold out this many random training images (the paper: 5000) "
        "and report accuracy and misclassification AUROC on them.",
    )
    parser.add_argument("--ensemble-size", type=int, default=5)
    parser.add_argument("--output-dir", default="outputs/fashion_mnist")
    _harness.add_arguments(parser, "--max-steps-per-epoch")
    parser.add_argument(
        "--train-subset",
        type=int,
        default=None,
        help="Train on this many random training images (smoke runs).",
    )
    parser.add_argument(
        "--test-subset",
        type=int,
        default=None,
        help="Evaluate on the first N images of each test set (smoke runs).",
    )
    parser.add_argument(
        "--mnist-path",
        default=None,
        help="Folder with MNIST's t10k IDX files; default: keras.datasets.mnist.",
    )
    parser.add_argument(
        "--fashion-mnist-path",
        default=None,
        help="Folder with FashionMNIST's IDX files; default: "
        "keras.datasets.fashion_mnist.",
    )
    _harness.add_run_arguments(parser, ood_name="MNIST")
    _harness.add_arguments(parser, "--mixed-precision")
    parser.add_argument("--verbose", type=int, default=2, choices=(0, 1, 2))
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "ensemble_size", "penalty_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_steps_per_epoch", "train_subset", "test_subset"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.validation_split < 0 or args.ood_eval_every < 0:
        parser.error("--validation-split and --ood-eval-every must be >= 0")
    if not args.bce_epsilon >= 0:
        parser.error("--bce-epsilon must be >= 0 (0: the exact gradient)")
    _harness.check_tensorboard(parser, args)
    return args


# ---------------------------------------------------------------- models


def build_backbone(l2: float = 0.0) -> keras.Sequential:
    """The paper's CNN, up to the 256-unit feature layer.

    Three 3x3 convolutions (64, 128, 128 filters; the third unpadded), each
    followed by BatchNorm, ReLU and 2x2 max pooling, then a 256-unit ReLU
    dense layer. BatchNorm uses PyTorch's momentum and epsilon, as the
    reference code.

    Args:
        l2: L2 regularisation factor put on every weight (kernels, biases,
            BatchNorm scale and offset); `0` for none.
    """
    regularizer = keras.regularizers.L2(l2) if l2 else None

    def conv_block(filters, padding):
        return [
            keras.layers.Conv2D(
                filters,
                3,
                padding=padding,
                kernel_initializer=pytorch_default_initializer(),
                kernel_regularizer=regularizer,
                bias_regularizer=regularizer,
            ),
            _harness.pytorch_batch_normalization(regularizer),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(2),
        ]

    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            *conv_block(64, "same"),
            *conv_block(128, "same"),
            *conv_block(128, "valid"),
            keras.layers.Flatten(),
            keras.layers.Dense(
                256,
                activation="relu",
                kernel_initializer=pytorch_default_initializer(),
                kernel_regularizer=regularizer,
                bias_regularizer=regularizer,
            ),
        ],
        name="backbone",
    )


def learning_rate_schedule(steps_per_epoch: int, epochs: int):
    """0.05, divided by 5 after every 10 epochs (epochs 10 and 20 of 30)."""
    return _harness.step_decay_schedule(
        steps_per_epoch,
        range(LR_DECAY_EVERY_EPOCHS, epochs, LR_DECAY_EVERY_EPOCHS),
        lambda i: LEARNING_RATE / LR_DECAY_FACTOR**i,
    )


def make_optimizer(steps_per_epoch: int, epochs: int) -> keras.optimizers.SGD:
    """SGD with momentum 0.9 and the paper's step schedule."""
    return keras.optimizers.SGD(
        learning_rate_schedule(steps_per_epoch, epochs), momentum=SGD_MOMENTUM
    )


def build_duq_model(args, steps_per_epoch: int) -> keras_duq.DUQModel:
    """DUQ on the paper's backbone, compiled. Weight decay is built in."""
    backbone = build_backbone()
    if args.spectral_normalization:
        backbone = keras_duq.spectral_normalize(
            backbone, coefficient=args.spectral_normalization
        )
    model = keras_duq.wrap(
        backbone,
        NUM_CLASSES,
        head=args.head,
        centroid_dims=256,
        length_scale=args.length_scale,
        momentum=args.centroid_momentum,
        kernel_initializer=(
            # The reference code draws W from N(0, 0.05^2).
            keras.initializers.RandomNormal(stddev=0.05)
            if args.kernel_initializer == "reference"
            else args.kernel_initializer
        ),
        gradient_penalty=args.gradient_penalty,
        penalty_interval=args.penalty_interval,
        weight_decay=WEIGHT_DECAY,
        bce_epsilon=args.bce_epsilon,
        bias_correction=args.bias_correction,
        **keras_duq.PAPER_SETTINGS,  # the paper's loss, W's rate, no clipping
    )
    model.compile(
        optimizer=make_optimizer(steps_per_epoch, args.epochs),
        jit_compile=jit_compile_argument(args),
    )
    return model


def build_softmax_model(args, steps_per_epoch: int) -> keras.Model:
    """The same backbone with a 10-way softmax layer, compiled.

    Weight decay: DUQ's coupled decay adds `1e-4 * w` to each gradient;
    `L2(5e-5)` adds `5e-5 * ||w||^2` to the loss, whose gradient is the same
    `1e-4 * w`. It is put on every weight, as PyTorch's SGD decay is.
    """
    l2 = WEIGHT_DECAY / 2
    regularizer = keras.regularizers.L2(l2)
    model = keras.Sequential(
        [
            build_backbone(l2),
            keras.layers.Dense(
                NUM_CLASSES,
                activation="softmax",
                kernel_initializer=pytorch_default_initializer(),
                kernel_regularizer=regularizer,
                bias_regularizer=regularizer,
            ),
        ],
        name="softmax",
    )
    return _harness.compile_softmax(
        model, make_optimizer(steps_per_epoch, args.epochs), args
    )


def build_model(args, steps_per_epoch: int, seed: int) -> keras.Model:
    """The `--model` of `seed`, built from a fresh Keras state.

    Keras's layer-name counters and other global state survive
    `set_random_seed`. Starting fresh makes ensemble member `i` the same
    model, names included, that `--model softmax --seed seed + i` builds in
    a new process, so members can be trained in separate processes.
    """
    _harness.fresh_keras_state(args, seed)
    if args.model == "duq":
        return build_duq_model(args, steps_per_epoch)
    return build_softmax_model(args, steps_per_epoch)


# ------------------------------------------------------------------ data


def load_data(args):
    """Normalised train, validation (or `None`), test and OoD arrays."""
    (x_train, y_train), (x_test, y_test) = keras_duq.datasets.load_fashion_mnist(
        args.fashion_mnist_path
    )
    x_ood, _ = keras_duq.datasets.load_mnist_test(args.mnist_path)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(x_train))
    validation = None
    if args.validation_split:
        held_out, order = order[: args.validation_split], order[args.validation_split :]
        validation = (
            keras_duq.datasets.normalize(x_train[held_out]),
            y_train[held_out],
        )
    if args.train_subset:
        order = order[: args.train_subset]
    if args.test_subset:
        x_test, y_test = x_test[: args.test_subset], y_test[: args.test_subset]
        x_ood = x_ood[: args.test_subset]
    # Both sets use FashionMNIST's training statistics (paper, Section 4.2).
    return (
        (keras_duq.datasets.normalize(x_train[order]), y_train[order].astype("int32")),
        validation,
        (keras_duq.datasets.normalize(x_test), y_test.astype("int32")),
        keras_duq.datasets.normalize(x_ood),
    )


# -------------------------------------------------------------- training


def training_callbacks(args, test, x_ood, method, log_dir):
    return _harness.training_callbacks(
        args,
        method,
        log_dir,
        lambda: (
            keras_duq.datasets.make_dataset(*test, batch_size=512),
            keras_duq.datasets.make_dataset(x_ood, batch_size=512),
        ),
    )


def predict(models, x):
    """Scores of one model, or the averaged probabilities of an ensemble."""
    return _harness.predict(models, x, batch_size=512)


def evaluate(models, method, test, x_ood, validation=None) -> dict:
    """Accuracy, OoD metrics and rejection curve; certainties for the plots."""
    x_test, y_test = test
    test_scores, ood_scores = predict(models, x_test), predict(models, x_ood)
    if validation is not None:
        x_val, y_val = validation
        validation = predict(models, x_val), y_val
    return _harness.evaluate_scores(method, test_scores, y_test, ood_scores, validation)


def main(argv=None) -> dict:
    """Runs the experiment; returns the dict written to `results.json`."""
    return _harness.run_main(_run, parse_args(argv))


def _run(args, start) -> dict:
    keras.utils.set_random_seed(args.seed)
    train_data, validation, test, x_ood = load_data(args)

    steps_per_epoch = math.ceil(len(train_data[0]) / args.batch_size)

    def make_dataset(seed):
        return keras_duq.datasets.make_dataset(
            *train_data,
            batch_size=args.batch_size,
            shuffle=True,
            seed=seed,
            repeat=True,
        )

    if args.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, args.max_steps_per_epoch)
    method = _harness.certainty_method(args.model)
    models, history, train_time = _harness.train_members(
        args,
        build_model,
        make_dataset,
        steps_per_epoch,
        lambda log_dir: training_callbacks(args, test, x_ood, method, log_dir),
    )
    results, *evaluated = evaluate(models, method, test, x_ood, validation)
    return _harness.finish(
        args,
        results,
        evaluated,
        names=("FashionMNIST", "MNIST"),
        start=start,
        steps_per_epoch=steps_per_epoch,
        data={
            "num_train": len(train_data[0]),
            "num_test": len(test[0]),
            "num_ood": len(x_ood),
        },
        history=history,
        train_time=train_time,
        versions={
            "backend": keras.backend.backend(),
            "keras": keras.__version__,
            "keras_duq": keras_duq.__version__,
        },
    )


if __name__ == "__main__":
    main(sys.argv[1:])

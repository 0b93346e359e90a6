"""CIFAR-10 vs. SVHN: the paper's headline image experiment (Section 5.2).

Trains DUQ (or the softmax / deep ensemble baselines) on CIFAR-10 with the
paper's ResNet-18 and settings (Section 5.2, Appendix A), then measures how
well the certainty separates the CIFAR-10 test set from the SVHN test set.
Writes `results.json` and the paper's figures (histograms of the certainty
on CIFAR-10 and SVHN, the rejection-classification curve, the ROC curve)
into `--output-dir`.

    # DUQ, the paper's text (75 epochs, lambda 0.5; a GPU job)
    python -m research.reproduction.cifar10 --model duq --output-dir outputs/duq
    # DUQ, the paper's code (100 epochs, lambda 0.75, weight decay 5e-4, ...)
    python -m research.reproduction.cifar10 --model duq --recipe paper_code \\
        --output-dir outputs/duq_code
    # baselines
    python -m research.reproduction.cifar10 --model softmax --output-dir outputs/softmax
    python -m research.reproduction.cifar10 --model ensemble --output-dir outputs/ensemble
    # quick smoke run
    python -m research.reproduction.cifar10 --epochs 1 --max-steps-per-epoch 2 \\
        --test-subset 64 --output-dir outputs/smoke

The data come from tensorflow-datasets: `cifar10` (train and test splits)
and the test split of `svhn_cropped` (26,032 images) as OoD set. Without
network, prepare them on another machine with
`tfds.builder(name, data_dir=DIR).download_and_prepare()`, copy DIR over and
pass `--data-dir DIR` (docs/cifar10.md). `--download` lets tfds download
them itself.

Recipes (`--recipe`; flags such as `--epochs` or `--gradient-penalty`
override single values):

- `paper` (default), the paper's text: ResNet-18 without its last linear
  layer (512 features), SGD lr 0.05, momentum 0.9, batch 128, 75 epochs, lr
  x 0.2 at epochs 25 and 50, weight decay 1e-4, lambda 0.5, centroid size
  512, length scale 0.1, gamma 0.999, centroids drawn from normal(0, 0.05).
- `paper_code`, the paper's code (`train_duq_cifar.py`; docs/cifar10.md on
  its versions): 100 epochs, lr
  x 0.2 at epochs 25, 50 and 75, weight decay 5e-4, lambda 0.75,
  torchvision's last linear layer kept as a 512 x 512 layer, W drawn from a
  Kaiming normal over a fan-in of classes x features, the centroid state
  started at N = 13. Its softmax and ensemble baselines follow
  `train_deep_ensemble.py`: 75 epochs, lr x 0.1 at epochs 25 and 50, weight
  decay 5e-4.

Paper results to compare with (Table 3, CIFAR-10 vs. SVHN, full training
set): DUQ (lambda 0.5) 93.2% +- 0.4 accuracy, AUROC 0.927 +- 0.013; DUQ
(lambda 0) 94.2% +- 0.2, AUROC 0.861 +- 0.032; softmax 94.1% +- 0.2, AUROC
0.906 +- 0.007; 5-model deep ensemble 95.2%, AUROC 0.933 +- 0.008.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import keras_duq
from research.reproduction import _harness
from research.reproduction._harness import LEARNING_RATE
from research.reproduction._harness import SGD_MOMENTUM
from research.reproduction._harness import jit_compile_argument
from research.reproduction._harness import pytorch_default_initializer

NUM_CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)
IN_DISTRIBUTION = "cifar10"
OUT_OF_DISTRIBUTION = "svhn_cropped"
# Random crops are taken after padding this many zero pixels on every side.
CROP_PADDING = 4
EVAL_BATCH_SIZE = 500
# ResNet-18's stages: (filters, stride of the first block); two blocks each.
RESNET18_STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))
BLOCKS_PER_STAGE = 2
FEATURES = 512

# The settings that differ between the paper's text and its code. Shared by
# both: SGD with lr 0.05 and momentum 0.9, batch 128, centroid size 512,
# length scale 0.1, gamma 0.999, the augmentation and normalisation.
RECIPES = {
    # Section 5.2 and Appendix A of the paper.
    "paper": {
        "duq": dict(
            epochs=75,
            lr_milestones=(25, 50),
            lr_decay=0.2,
            weight_decay=1e-4,
            gradient_penalty=0.5,
            feature_layer=False,
            # The paper does not say; keras_duq's default.
            kernel_initializer="he_normal",
            # Appendix A: "In all experiments, we initialise the centroids
            # using draws from N(0, 0.05 I_n)" (a stddev, as in the code). The
            # count N is not stated: keras_duq's 12.
            initial_centroid_count=None,
            initial_centroid_stddev=0.05,
        ),
        "softmax": dict(
            epochs=75,
            lr_milestones=(25, 50),
            lr_decay=0.2,
            weight_decay=1e-4,
        ),
    },
    # The authors' code: train_duq_cifar.py with utils/resnet_duq.py (DUQ),
    # train_deep_ensemble.py (softmax and ensemble).
    "paper_code": {
        "duq": dict(
            epochs=100,
            lr_milestones=(25, 50, 75),
            lr_decay=0.2,
            weight_decay=5e-4,
            gradient_penalty=0.75,
            # `resnet18(num_classes=512)`: the last linear layer stays, 512 x 512.
            feature_layer=True,
            # `kaiming_normal_` on W of shape (centroids, classes, features).
            kernel_initializer="reference",
            # N = 13 and m = 13 * normal(0, 0.05): centroids ~ normal(0, 0.05).
            initial_centroid_count=13.0,
            initial_centroid_stddev=0.05,
        ),
        "softmax": dict(
            epochs=75,
            lr_milestones=(25, 50),
            lr_decay=0.1,
            weight_decay=5e-4,
        ),
    },
}


def parse_args(argv=None) -> argparse.Namespace:
    """Parses the command line and fills unset values from `--recipe`."""
    parser = _harness.new_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipe",
        choices=tuple(RECIPES),
        default="paper",
        help="'paper': the paper's text; 'paper_code': the authors' code "
        "(see the module docstring and docs/cifar10.md).",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="Default: the recipe's (paper 75; paper_code 100 for DUQ, 75 "
        "for softmax and ensemble).",
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=LEARNING_RATE)
    parser.add_argument(
        "--weight-decay",
        type=float,
        default=None,
        help="Coupled L2 weight decay (PyTorch SGD's). Default: the recipe's "
        "(paper 1e-4, paper_code 5e-4).",
    )
    parser.add_argument(
        "--gradient-penalty",
        type=float,
        default=None,
        help="DUQ's lambda. Default: the recipe's (paper 0.5, paper_code 0.75).",
    )
    parser.add_argument("--length-scale", type=float, default=0.1)
    _harness.add_arguments(parser, "--centroid-momentum", "--head")
    parser.add_argument("--centroid-dims", type=int, default=FEATURES)
    parser.add_argument(
        "--kernel-initializer",
        default=None,
        help="Initializer of DUQ's projection W: 'reference' (Kaiming normal "
        "over a fan-in of classes x features, as the paper's code) or a Keras "
        "initializer name. Default: the recipe's (paper 'he_normal', "
        "paper_code 'reference').",
    )
    parser.add_argument(
        "--feature-layer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Keep ResNet-18's last linear layer as a 512 x 512 layer in DUQ's "
        "backbone. Default: the recipe's (paper no, paper_code yes).",
    )
    parser.add_argument(
        "--initial-centroid-stddev",
        type=float,
        default=None,
        help="Draw the initial centroids from normal(0, stddev). Default: the "
        "recipe's, 0.05 (the paper, Appendix A, and its code); 1 gives "
        "keras_duq's default distribution.",
    )
    _harness.add_arguments(parser, "--bias-correction")
    parser.add_argument(
        "--bce-epsilon",
        type=float,
        default=0.0,
        help="Floor of K(1-K) in the cross-entropy gradient: 0 is exact, "
        "1e-12 is PyTorch's binary_cross_entropy as in the paper's code.",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--validation-split",
        type=int,
        default=10000,
        help="Hold out this many random training images (the paper: 10,000 of "
        "50,000) and report accuracy and misclassification AUROC on them, by "
        "which the paper chooses lambda. 0: train on all images.",
    )
    parser.add_argument("--ensemble-size", type=int, default=5)
    parser.add_argument("--output-dir", default="outputs/cifar10")
    parser.add_argument(
        "--data-dir",
        default=None,
        help="tensorflow-datasets data_dir holding the prepared cifar10 and "
        "svhn_cropped (default: tfds's, ~/tensorflow_datasets or "
        "$TFDS_DATA_DIR).",
    )
    parser.add_argument(
        "--download",
        action="store_true",
        help="Let tfds download and prepare missing data (needs network).",
    )
    parser.add_argument(
        "--normalization-stats",
        default=None,
        metavar="MEAN_R,MEAN_G,MEAN_B,STD_R,STD_G,STD_B",
        help="Per-channel mean and std on the [0, 1] scale, e.g. from an "
        "earlier run's results.json ('normalization'). Default: computed from "
        "the training images in the pipeline.",
    )
    _harness.add_arguments(parser, "--mixed-precision", "--max-steps-per-epoch")
    parser.add_argument(
        "--test-subset",
        type=int,
        default=None,
        help="Evaluate on the first N images of each evaluation set: CIFAR-10 "
        "test, SVHN test and the validation split (smoke runs).",
    )
    _harness.add_run_arguments(parser, ood_name="SVHN")
    parser.add_argument("--verbose", type=int, default=2, choices=(0, 1, 2))
    args = parser.parse_args(argv)

    recipe = RECIPES[args.recipe]["duq" if args.model == "duq" else "softmax"]
    for name in ("epochs", "weight_decay"):
        if getattr(args, name) is None:
            setattr(args, name, recipe[name])
    if args.model == "duq":
        for name in ("gradient_penalty", "kernel_initializer", "feature_layer"):
            if getattr(args, name) is None:
                setattr(args, name, recipe[name])
    else:
        # Only DUQ has a penalty, a projection W and a choice of feature layer;
        # the softmax head sits on the pooled features, as in the paper's code.
        duq_only = (
            "gradient_penalty",
            "kernel_initializer",
            "feature_layer",
            "initial_centroid_stddev",
        )
        for name in duq_only:
            if getattr(args, name) is not None:
                parser.error(f"--{name.replace('_', '-')} applies to --model duq only")
        args.gradient_penalty = None
        args.feature_layer = False
    args.lr_milestones = list(recipe["lr_milestones"])
    args.lr_decay = recipe["lr_decay"]
    args.initial_centroid_count = recipe.get("initial_centroid_count")
    if args.initial_centroid_stddev is None:
        args.initial_centroid_stddev = recipe.get("initial_centroid_stddev")

    for name in ("epochs", "batch_size", "ensemble_size", "centroid_dims"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be >= 1. Received: "
                f"{getattr(args, name)}"
            )
    for name in ("max_steps_per_epoch", "test_subset"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1. Received: {value}")
    if args.validation_split < 0 or args.ood_eval_every < 0:
        parser.error(
            "--validation-split and --ood-eval-every must be >= 0. Received: "
            f"{args.validation_split} and {args.ood_eval_every}"
        )
    for name in ("learning_rate", "length_scale"):
        if not getattr(args, name) > 0:
            parser.error(
                f"--{name.replace('_', '-')} must be > 0. "
                f"Received: {getattr(args, name)}"
            )
    if not args.weight_decay >= 0 or not args.bce_epsilon >= 0:
        parser.error(
            "--weight-decay and --bce-epsilon must be >= 0. Received: "
            f"{args.weight_decay} and {args.bce_epsilon}"
        )
    if args.gradient_penalty is not None and not args.gradient_penalty >= 0:
        parser.error(
            f"--gradient-penalty must be >= 0. Received: {args.gradient_penalty}"
        )
    stddev = args.initial_centroid_stddev
    if stddev is not None and not stddev > 0:
        parser.error(
            "--initial-centroid-stddev must be > 0. Received: "
            f"{args.initial_centroid_stddev}"
        )
    if args.model == "duq" and args.bias_correction and args.initial_centroid_count:
        parser.error(
            "--bias-correction sets its own initial centroid state, and "
            f"--recipe {args.recipe} starts it at N = "
            f"{args.initial_centroid_count:g}: use one of them."
        )
    if args.normalization_stats is not None:
        args.normalization_stats = _parse_normalization_stats(
            parser, args.normalization_stats
        )
    _harness.check_tensorboard(parser, args)
    return args


def _parse_normalization_stats(parser, text):
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 6 or not all(math.isfinite(v) for v in values):
        parser.error(
            "--normalization-stats takes six numbers MEAN_R,MEAN_G,MEAN_B,"
            f"STD_R,STD_G,STD_B. Received: {text!r}"
        )
    if not all(v > 0 for v in values[3:]):
        parser.error(f"--normalization-stats: the stds must be > 0. Received: {text!r}")
    return {"mean": values[:3], "std": values[3:]}


# ---------------------------------------------------------------- models


def torchvision_conv_initializer() -> keras.initializers.Initializer:
    """torchvision ResNet's convolutions: Kaiming normal over the fan-out."""
    return keras.initializers.VarianceScaling(
        scale=2.0, mode="fan_out", distribution="untruncated_normal"
    )


def build_resnet18(feature_layer: bool = False, l2: float = 0.0) -> keras.Model:
    """The paper's ResNet-18 for 32 x 32 images, up to its features.

    torchvision's ResNet-18 (BasicBlocks, [2, 2, 2, 2]) with the paper's
    changes: the first convolution has 64 3 x 3 filters with stride 1, the
    first max pooling is skipped, and the global average pooling gives 512
    features. BatchNorm uses PyTorch's momentum and epsilon. The weights
    start as torchvision's: convolutions Kaiming normal over the fan-out,
    except the first, which the paper's code replaces after construction and
    so gets PyTorch's default initialisation.

    Args:
        feature_layer: bool, keep torchvision's last linear layer as a
            512 x 512 layer after the pooling (the paper's code and its
            Appendix A). `False` (default): the features are the pooled
            ones (the paper's Section 5.2: "skip ... the last linear layer").
        l2: L2 regularisation factor put on every weight (kernels, biases,
            BatchNorm scale and offset); `0` for none.

    Returns:
        A functional `keras.Model` from `(batch, 32, 32, 3)` images to
        `(batch, 512)` features.
    """
    regularizer = keras.regularizers.L2(l2) if l2 else None

    def conv(x, filters, kernel_size, strides, name, initializer=None):
        if kernel_size == 3 and strides != 1:
            # PyTorch pads one pixel on every side; Keras's "same" would pad
            # a stride-2 convolution at the bottom and right only, which
            # shifts the sampling grid.
            x = keras.layers.ZeroPadding2D(1, name=f"{name}_pad")(x)
            padding = "valid"
        else:
            padding = "same"
        return keras.layers.Conv2D(
            filters,
            kernel_size,
            strides=strides,
            padding=padding,
            use_bias=False,
            kernel_initializer=initializer or torchvision_conv_initializer(),
            kernel_regularizer=regularizer,
            name=name,
        )(x)

    def batch_norm(x, name):
        return _harness.pytorch_batch_normalization(regularizer, name)(x)

    def basic_block(x, filters, strides, name):
        shortcut = x
        y = conv(x, filters, 3, strides, f"{name}_conv1")
        y = keras.layers.ReLU(name=f"{name}_relu1")(batch_norm(y, f"{name}_bn1"))
        y = batch_norm(conv(y, filters, 3, 1, f"{name}_conv2"), f"{name}_bn2")
        if strides != 1 or x.shape[-1] != filters:
            shortcut = conv(x, filters, 1, strides, f"{name}_downsample_conv")
            shortcut = batch_norm(shortcut, f"{name}_downsample_bn")
        y = keras.layers.Add(name=f"{name}_add")([y, shortcut])
        return keras.layers.ReLU(name=f"{name}_out")(y)

    inputs = keras.Input(IMAGE_SHAPE, name="images")
    x = conv(inputs, 64, 3, 1, "conv1", initializer=pytorch_default_initializer())
    x = keras.layers.ReLU(name="relu1")(batch_norm(x, "bn1"))
    for stage, (filters, strides) in enumerate(RESNET18_STAGES, start=1):
        for block in range(BLOCKS_PER_STAGE):
            x = basic_block(
                x, filters, strides if block == 0 else 1, f"layer{stage}_{block}"
            )
    features = keras.layers.GlobalAveragePooling2D(name="avgpool")(x)
    if feature_layer:
        bound = 1.0 / math.sqrt(FEATURES)
        features = keras.layers.Dense(
            FEATURES,
            kernel_initializer=pytorch_default_initializer(),
            bias_initializer=keras.initializers.RandomUniform(-bound, bound),
            kernel_regularizer=regularizer,
            bias_regularizer=regularizer,
            name="fc",
        )(features)
    return keras.Model(inputs, features, name="resnet18")


def learning_rate_schedule(args, steps_per_epoch: int):
    """0.05, times `lr_decay` at each milestone epoch that falls in the run."""
    return _harness.step_decay_schedule(
        steps_per_epoch,
        [e for e in args.lr_milestones if e < args.epochs],
        lambda i: args.learning_rate * args.lr_decay**i,
    )


def make_optimizer(args, steps_per_epoch: int) -> keras.optimizers.SGD:
    return keras.optimizers.SGD(
        learning_rate_schedule(args, steps_per_epoch), momentum=SGD_MOMENTUM
    )


def duq_kernel_initializer(name: str, features: int):
    """DUQ's W initializer; 'reference' is the paper code's.

    The code draws W of shape (centroids, classes, features) with PyTorch's
    `kaiming_normal_`, whose fan-in is classes x features: a normal with
    stddev sqrt(2 / (classes x features)).
    """
    if name == "reference":
        return keras.initializers.RandomNormal(
            stddev=math.sqrt(2.0 / (NUM_CLASSES * features))
        )
    return name


def build_duq_model(args, steps_per_epoch: int, seed: int) -> keras_duq.DUQModel:
    """DUQ on the paper's ResNet-18, compiled. Weight decay is built in."""
    backbone = build_resnet18(feature_layer=args.feature_layer)
    model = keras_duq.wrap(
        backbone,
        NUM_CLASSES,
        head=args.head,
        centroid_dims=args.centroid_dims,
        length_scale=args.length_scale,
        momentum=args.centroid_momentum,
        kernel_initializer=duq_kernel_initializer(
            args.kernel_initializer, backbone.output.shape[-1]
        ),
        gradient_penalty=args.gradient_penalty,
        weight_decay=args.weight_decay,
        bce_epsilon=args.bce_epsilon,
        bias_correction=args.bias_correction,
        **keras_duq.PAPER_SETTINGS,  # the paper's loss, W's rate, no clipping
    )
    head = model.duq_output
    if args.initial_centroid_count:
        # The paper's code starts N at 13 where keras_duq starts it at 12, as
        # the FashionMNIST code. The state is plain variables: set it after
        # building.
        head.centroid_counts.assign(
            np.full((NUM_CLASSES,), args.initial_centroid_count, "float32")
        )
    if args.initial_centroid_stddev is not None:
        _harness.set_initial_centroids(head, args.initial_centroid_stddev, seed)
    model.compile(
        optimizer=make_optimizer(args, steps_per_epoch),
        jit_compile=jit_compile_argument(args),
    )
    return model


def build_softmax_model(args, steps_per_epoch: int) -> keras.Model:
    """The same ResNet-18 with a 10-way softmax layer, compiled.

    Weight decay: `L2(wd / 2)` on every weight adds `wd * w` to each
    gradient, PyTorch SGD's coupled decay (and DUQ's).
    """
    l2 = args.weight_decay / 2
    regularizer = keras.regularizers.L2(l2) if l2 else None
    bound = 1.0 / math.sqrt(FEATURES)
    model = keras.Sequential(
        [
            build_resnet18(l2=l2),
            keras.layers.Dense(
                NUM_CLASSES,
                activation="softmax",
                kernel_initializer=pytorch_default_initializer(),
                bias_initializer=keras.initializers.RandomUniform(-bound, bound),
                kernel_regularizer=regularizer,
                bias_regularizer=regularizer,
                # The probabilities stay float32 under mixed precision.
                dtype="float32",
                name="classifier",
            ),
        ],
        name="softmax",
    )
    return _harness.compile_softmax(model, make_optimizer(args, steps_per_epoch), args)


def build_model(args, steps_per_epoch: int, seed: int) -> keras.Model:
    """The `--model` of `seed`, built from a fresh Keras state.

    Starting fresh makes ensemble member `i` the same model, names included,
    that `--model softmax --seed seed + i` builds in a new process.
    """
    _harness.fresh_keras_state(args, seed)
    if args.model == "duq":
        return build_duq_model(args, steps_per_epoch, seed)
    return build_softmax_model(args, steps_per_epoch)


# ------------------------------------------------------------------ data


def load_split(name: str, split: str, args) -> tf.data.Dataset:
    """`(uint8 image, int64 label)` pairs of a tfds split, in file order."""
    import tensorflow_datasets as tfds

    try:
        return tfds.load(
            name,
            split=split,
            as_supervised=True,
            data_dir=args.data_dir,
            download=args.download,
            shuffle_files=False,
        )
    except AssertionError as error:
        if "could not find data" not in str(error):
            raise
        raise FileNotFoundError(
            f"tensorflow-datasets has no prepared `{name}` in the data_dir. "
            "Prepare it on a machine with network "
            f"(`tfds.builder('{name}', data_dir=DIR).download_and_prepare()`), "
            "copy DIR here and pass `--data-dir DIR`, or pass `--download` "
            f"(docs/cifar10.md). Received: `--data-dir={args.data_dir!r}`"
        ) from error


def count_examples(dataset: tf.data.Dataset) -> int:
    """The number of elements; counted in one pass when tf.data does not know."""
    cardinality = int(dataset.cardinality())
    if cardinality >= 0:
        return cardinality
    return int(dataset.reduce(np.int64(0), lambda count, _: count + 1))


def split_validation(train: tf.data.Dataset, num_validation: int, seed: int):
    """Holds out `num_validation` random training images.

    Returns the training part, the validation part (`None` when
    `num_validation` is 0) and the number of training images. The choice is
    fixed by `seed` and made in the pipeline: a lookup of each element's
    index, so nothing is loaded into Python.
    """
    total = count_examples(train)
    if num_validation >= total:
        raise ValueError(
            "--validation-split must leave training images: the training "
            f"split has {total}. Received: `--validation-split={num_validation}`"
        )
    if not num_validation:
        return train, None, total
    held_out = np.zeros(total, bool)
    held_out[np.random.default_rng(seed).permutation(total)[:num_validation]] = True
    held_out = tf.constant(held_out)

    def part(keep_held_out, size):
        return (
            train.enumerate()
            .filter(lambda i, _: tf.equal(tf.gather(held_out, i), keep_held_out))
            .map(lambda _, example: example)
            # A filter hides the size from tf.data; `predict` then warns that
            # the data ran out.
            .apply(tf.data.experimental.assert_cardinality(size))
        )

    num_train = total - num_validation
    return part(False, num_train), part(True, num_validation), num_train


def channel_statistics(images: tf.data.Dataset) -> dict:
    """Per-channel mean and std of `uint8` images on the `[0, 1]` scale.

    One `tf.data` reduction (float64 sums) over the dataset of
    `(image, label)` pairs: the paper's "per channel mean and standard
    deviation, as computed on the training set".
    """

    def accumulate(totals, batch):
        pixels = tf.cast(batch, tf.float64) / 255.0
        count = tf.cast(tf.reduce_prod(tf.shape(pixels)[:-1]), tf.float64)
        return (
            totals[0] + tf.reduce_sum(pixels, axis=(0, 1, 2)),
            totals[1] + tf.reduce_sum(tf.square(pixels), axis=(0, 1, 2)),
            totals[2] + count,
        )

    zeros = tf.zeros((IMAGE_SHAPE[-1],), tf.float64)
    total, total_squares, count = (
        images.map(lambda image, label: image)
        .batch(1000)
        .reduce((zeros, zeros, tf.constant(0.0, tf.float64)), accumulate)
    )
    mean = total / count
    std = tf.sqrt(tf.maximum(total_squares / count - tf.square(mean), 0.0))
    mean, std = mean.numpy().tolist(), std.numpy().tolist()
    if not all(s > 0 for s in std):
        raise ValueError(
            "The training images are constant in a channel, so they cannot be "
            f"normalised. Received: per-channel std {std}"
        )
    return {"mean": mean, "std": std}


def normalize(image, mean, std):
    """`uint8` pixels to float32, standardised per channel."""
    pixels = tf.cast(image, tf.float32) / 255.0
    return (pixels - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)


def augment(image, seed):
    """The paper's augmentation of one image `(32, 32, 3)`.

    A random 32 x 32 crop after padding 4 zero pixels on every side, then a
    horizontal flip with probability 0.5. Apply it to the raw pixels, before
    normalisation: the padding is black, as in the paper's code (torchvision
    pads the PIL image). Stateless: the output depends only on the image and
    `seed`, so a run is reproducible whatever the parallelism of the
    pipeline.

    Args:
        image: tensor `(32, 32, 3)`, any dtype.
        seed: int tensor of shape `(2,)`.

    Returns:
        A tensor of the same shape and dtype.
    """
    crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    padded = tf.pad(
        image, [[CROP_PADDING, CROP_PADDING], [CROP_PADDING, CROP_PADDING], [0, 0]]
    )
    cropped = tf.image.stateless_random_crop(padded, tf.shape(image), seed=crop_seed)
    return tf.image.stateless_random_flip_left_right(cropped, seed=flip_seed)


def _pipeline_options():
    options = tf.data.Options()
    # Fixed parallelism and buffers instead of tf.data's autotuning, as in
    # keras_duq.datasets.make_dataset: with autotuning on, dropping the
    # iterator of a repeated dataset at the end of `fit` could wait for the
    # autotuning thread's next wake-up, up to a minute.
    options.autotune.enabled = False
    return options


def _parallel_calls():
    return max(1, min(os.cpu_count() or 1, 16))


def make_training_dataset(
    train: tf.data.Dataset,
    normalization: dict,
    batch_size: int,
    seed: int,
    num_examples: int,
    augmentation: bool = True,
) -> tf.data.Dataset:
    """Shuffled, augmented, normalised, batched training data, repeated.

    `train` yields raw `(uint8 image, label)` pairs and should be cached.
    Each pass over it is a fresh permutation (the whole set is the shuffle
    buffer); batches run over pass boundaries, so no image is dropped for
    good. Every image gets its own augmentation seed from a seeded random
    stream.

    Returns:
        A dataset of `(float32 images (batch, 32, 32, 3), int32 labels)`.
    """
    mean, std = normalization["mean"], normalization["std"]
    images = train.shuffle(num_examples, seed=seed, reshuffle_each_iteration=True)
    images = images.repeat()
    seeds = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True)
    seeds = seeds.batch(2)

    def prepare(example, augment_seed):
        image, label = example
        if augmentation:
            image = augment(image, augment_seed)
        return normalize(image, mean, std), tf.cast(label, tf.int32)

    return (
        tf.data.Dataset.zip((images, seeds))
        .map(prepare, num_parallel_calls=_parallel_calls())
        .batch(batch_size, drop_remainder=True)
        .prefetch(2)
        .with_options(_pipeline_options())
    )


def make_evaluation_dataset(
    dataset: tf.data.Dataset, normalization: dict, subset: int | None = None
) -> tf.data.Dataset:
    """Normalised, batched, never augmented; cached so passes repeat exactly."""
    mean, std = normalization["mean"], normalization["std"]
    if subset:
        dataset = dataset.take(subset)

    def prepare(image, label):
        return normalize(image, mean, std), tf.cast(label, tf.int32)

    return (
        dataset.cache()
        .map(prepare, num_parallel_calls=_parallel_calls())
        .batch(EVAL_BATCH_SIZE)
        .prefetch(2)
        .with_options(_pipeline_options())
    )


def load_data(args):
    """The raw cached training part, its size, the normalisation statistics and
    the evaluation datasets (validation or `None`, CIFAR-10 test, SVHN test)."""
    train, validation, num_train = split_validation(
        load_split(IN_DISTRIBUTION, "train", args), args.validation_split, args.seed
    )
    # 50,000 images are 150 MB of uint8: kept in memory after the first pass.
    train = train.cache()
    if args.normalization_stats is not None:
        normalization = dict(args.normalization_stats, source="--normalization-stats")
    else:
        normalization = dict(
            channel_statistics(train), source=f"training images ({num_train})"
        )
    # Both test sets use CIFAR-10's training statistics, as in the paper's
    # code: an OoD input gets the preprocessing of the training data.
    evaluation = {
        name: None
        if data is None
        else make_evaluation_dataset(data, normalization, args.test_subset)
        for name, data in (
            ("validation", validation),
            ("test", load_split(IN_DISTRIBUTION, "test", args)),
            ("ood", load_split(OUT_OF_DISTRIBUTION, "test", args)),
        )
    }
    return train, num_train, normalization, evaluation


# -------------------------------------------------------------- training


def training_callbacks(args, evaluation, method, log_dir):
    return _harness.training_callbacks(
        args,
        method,
        log_dir,
        lambda: (evaluation["test"], evaluation["ood"]),
        batch_size=EVAL_BATCH_SIZE,
    )


# ------------------------------------------------------------ evaluation


def predict(models, dataset):
    """Scores of one model, or the averaged probabilities of an ensemble."""
    return _harness.predict(models, dataset.map(lambda image, label: image))


def labels_of(dataset) -> np.ndarray:
    return np.concatenate(
        [batch for batch in dataset.map(lambda image, label: label).as_numpy_iterator()]
    )


def misclassification_auroc(certainty, correct):
    """The AUROC, or `None` when every prediction is right (or every one wrong)."""
    if correct.all() or not correct.any():
        return None
    return keras_duq.evaluation.misclassification_auroc(certainty, correct)


def evaluate(models, method, evaluation):
    """Accuracy, OoD metrics and rejection curve; certainties for the plots."""
    validation = None
    if evaluation["validation"] is not None:
        validation = (
            predict(models, evaluation["validation"]),
            labels_of(evaluation["validation"]),
        )
    results, in_certainty, ood_certainty, curve = _harness.evaluate_scores(
        method,
        predict(models, evaluation["test"]),
        labels_of(evaluation["test"]),
        predict(models, evaluation["ood"]),
        validation,
        misclassification_auroc,
    )
    if validation is not None:
        results["num_validation_evaluated"] = len(validation[1])
    sizes = {"num_test": len(in_certainty), "num_ood": len(ood_certainty)}
    return results, sizes, in_certainty, ood_certainty, curve


def main(argv=None) -> dict:
    """Runs the experiment; returns the dict written to `results.json`."""
    return _harness.run_main(_run, parse_args(argv))


def _run(args, start) -> dict:
    keras.utils.set_random_seed(args.seed)
    train, num_train, normalization, evaluation = load_data(args)

    steps_per_epoch = max(1, num_train // args.batch_size)
    if args.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, args.max_steps_per_epoch)
    method = _harness.certainty_method(args.model)

    def make_dataset(seed):
        return make_training_dataset(
            train, normalization, args.batch_size, seed, num_train
        )

    models, history, train_time = _harness.train_members(
        args,
        build_model,
        make_dataset,
        steps_per_epoch,
        lambda log_dir: training_callbacks(args, evaluation, method, log_dir),
    )
    results, sizes, *evaluated = evaluate(models, method, evaluation)
    import tensorflow_datasets as tfds

    return _harness.finish(
        args,
        results,
        evaluated,
        names=("CIFAR-10", "SVHN"),
        start=start,
        steps_per_epoch=steps_per_epoch,
        data={
            "num_train": num_train,
            "num_validation": args.validation_split,
            **sizes,
            "in_distribution": f"{IN_DISTRIBUTION}/test",
            "out_of_distribution": f"{OUT_OF_DISTRIBUTION}/test",
            "normalization": normalization,
        },
        history=history,
        train_time=train_time,
        versions={
            "keras": keras.__version__,
            "keras_duq": keras_duq.__version__,
            "tensorflow": tf.__version__,
            "tensorflow_datasets": tfds.__version__,
        },
        run={"recipe": args.recipe},
    )


if __name__ == "__main__":
    main(sys.argv[1:])

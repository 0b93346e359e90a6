"""
Title: CIFAR-10 vs SVHN: DUQ on a ResNet with tensorflow-datasets
Description: Train a DUQ ResNet on CIFAR-10 from a tf.data pipeline and flag
street-view digits (SVHN) as out of distribution.

The paper's headline image benchmark (Section 5.2): a classifier of CIFAR-10's
ten object classes should be uncertain about SVHN's house numbers. This
example reads both data sets with tensorflow-datasets, trains a compact
ResNet with a DUQ head on CIFAR-10 with the paper's augmentation (pad 4
pixels, random crop, horizontal flip) and measures how well the certainty
separates the CIFAR-10 test set from SVHN's.

    python examples/cifar10.py --download          # 30 epochs: a GPU job
    python examples/cifar10.py --quick --download  # a smoke run (KERAS_DUQ_SMOKE=1 too)

Data: `tfds.load` reads `cifar10` and `svhn_cropped` from `--data-dir`
(default `~/tensorflow_datasets`). `--download` lets it download and prepare
them; on a machine without network, prepare them elsewhere with
`tfds.builder(name, data_dir=DIR).download_and_prepare()` and copy DIR over.
Needs `pip install tensorflow-datasets "keras-duq[plots]"`; the pipeline uses
TensorFlow's `tf.data`.
"""

# ----------------------------------------------------------------------
# Setup

import argparse
import os

import keras
import matplotlib.pyplot as plt
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

import keras_duq
from keras_duq import evaluation
from keras_duq import plots

parser = argparse.ArgumentParser(description="DUQ on CIFAR-10, SVHN as OoD.")
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--data-dir", default=None, help="tensorflow-datasets' data_dir.")
parser.add_argument(
    "--download", action="store_true", help="Let tfds download the data."
)
parser.add_argument("--output-dir", default=os.path.join("outputs", "cifar10"))
parser.add_argument(
    "--quick",
    action="store_true",
    default=os.environ.get("KERAS_DUQ_SMOKE") == "1",
    help="A smoke run: 1 epoch on 128 images, a tiny network.",
)
args = parser.parse_args()
epochs = 1 if args.quick else args.epochs
batch_size = 32 if args.quick else 128
keras.utils.set_random_seed(0)

# ----------------------------------------------------------------------
# The data
#
# Both sets are standardised with CIFAR-10's channel statistics: an OoD input
# must be preprocessed exactly as the training data.

MEAN = np.array([0.4914, 0.4822, 0.4465], "float32")
STD = np.array([0.2470, 0.2435, 0.2616], "float32")


def load(name, split):
    return tfds.load(
        name,
        split=split,
        as_supervised=True,
        data_dir=args.data_dir,
        download=args.download,
    )


def normalize(image, label):
    return (tf.cast(image, tf.float32) / 255.0 - MEAN) / STD, label


def augment(image, label):
    # The paper's augmentation, on the raw pixels: the padding is black.
    image = tf.image.pad_to_bounding_box(image, 4, 4, 40, 40)
    image = tf.image.random_crop(image, (32, 32, 3))
    return tf.image.random_flip_left_right(image), label


train, test, ood = (
    load("cifar10", "train"),
    load("cifar10", "test"),
    load("svhn_cropped", "test"),
)
if args.quick:
    train, test, ood = train.take(128), test.take(64), ood.take(64)
autotune = tf.data.AUTOTUNE
train = (
    train.shuffle(10_000, seed=0)
    .map(augment, num_parallel_calls=autotune)
    .map(normalize, num_parallel_calls=autotune)
    .batch(batch_size, drop_remainder=True)
    .prefetch(autotune)
)
test, ood = (data.map(normalize).batch(500).cache() for data in (test, ood))

# ----------------------------------------------------------------------
# A ResNet backbone
#
# Three stages of residual blocks, then global average pooling: the features.
# Any Keras model that outputs `(batch, features)` works; the paper uses a
# ResNet-18 (`python -m research.reproduction.cifar10` builds it).


def residual_block(x, filters, stride):
    shortcut = x
    x = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(
        x
    )
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False)(
            shortcut
        )
        shortcut = keras.layers.BatchNormalization()(shortcut)
    return keras.layers.ReLU()(x + shortcut)


widths = (16, 32, 64) if args.quick else (64, 128, 256)
inputs = keras.Input((32, 32, 3))
x = keras.layers.Conv2D(widths[0], 3, padding="same", use_bias=False)(inputs)
x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
for stage, filters in enumerate(widths):
    for block in range(2):
        x = residual_block(x, filters, stride=2 if stage > 0 and block == 0 else 1)
features = keras.layers.GlobalAveragePooling2D()(x)
backbone = keras.Model(inputs, features, name="resnet")

# ----------------------------------------------------------------------
# DUQ
#
# The paper's CIFAR-10 settings: length scale 0.1, centroid momentum 0.999 and
# a gradient penalty of 0.5, chosen by the misclassification AUROC on
# validation data. SGD with momentum; the learning rate drops by 5x after a
# third and two thirds of the training. Weight decay (1e-4) is built in.

model = keras_duq.wrap(
    backbone,
    num_classes=10,
    length_scale=0.1,
    momentum=0.999,
    gradient_penalty=0.5,
    **keras_duq.PAPER_SETTINGS,  # the paper's loss, W's rate, no clipping
)
steps = epochs * int(train.cardinality())
schedule = keras.optimizers.schedules.PiecewiseConstantDecay(
    [max(steps // 3, 1), max(2 * steps // 3, 2)], [0.05, 0.01, 0.002]
)
model.compile(optimizer=keras.optimizers.SGD(schedule, momentum=0.9))
model.fit(train, epochs=epochs, verbose=2)

# ----------------------------------------------------------------------
# Uncertainty metrics
#
# The certainty is the largest kernel value. AUROC with SVHN as the positive
# class: 1.0 separates the sets perfectly, 0.5 not at all. The paper reports
# 93.2% accuracy and AUROC 0.927 for a ResNet-18 trained for 75 epochs.

kernel_values = model.predict(test, verbose=0)
labels = np.concatenate([y for _, y in test.as_numpy_iterator()])
in_certainty = kernel_values.max(axis=1)
ood_certainty = model.predict(ood, verbose=0).max(axis=1)
correct = kernel_values.argmax(axis=1) == labels
metrics = {
    "accuracy": float(correct.mean()),
    **evaluation.ood_metrics(in_certainty, ood_certainty),
    "misclassification_auroc": evaluation.misclassification_auroc(
        in_certainty, correct
    ),
}
print(", ".join(f"{name} {value:.3f}" for name, value in metrics.items()))

# ----------------------------------------------------------------------
# Figures

os.makedirs(args.output_dir, exist_ok=True)
figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
plots.plot_certainty_histograms(
    in_certainty,
    ood_certainty,
    in_label="CIFAR-10 (test)",
    ood_label="SVHN (test)",
    ax=axes[0],
)
plots.plot_rejection_curve(
    in_certainty=in_certainty,
    in_correct=correct,
    ood_certainty=ood_certainty,
    label="DUQ",
    ax=axes[1],
)
figure.tight_layout()
path = os.path.join(args.output_dir, "cifar10_vs_svhn.png")
figure.savefig(path, dpi=100)
plt.close(figure)
print(f"wrote {path}")

# ----------------------------------------------------------------------
# Next steps
#
# The paper's ResNet-18, its two recipes, the baselines and resumable runs:
# `python -m research.reproduction.cifar10 --help` (docs/cifar10.md).

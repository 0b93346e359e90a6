"""
Title: Bring your own backbone: DUQ on a keras.applications model
Description: Put a DUQ head on MobileNetV2, train it, pick a certainty
threshold and save the model.

`keras_duq.wrap` takes any Keras model that outputs a feature vector
`(batch, features)` and returns a `DUQModel` that trains with `fit`, predicts
per-class kernel values and saves like any Keras model. This example wraps
`keras.applications.MobileNetV2`, trains it on a FashionMNIST subset, checks
how well its certainty separates right from wrong predictions and FashionMNIST
from MNIST digits, chooses a certainty threshold, and saves and reloads it.

    python examples/bring_your_own_backbone.py          # 5 epochs, 6,000 images
    python examples/bring_your_own_backbone.py --quick  # a smoke run

FashionMNIST comes through `keras.datasets` (set `KERAS_HOME` to a folder
holding `datasets/fashion-mnist/` to run offline), MNIST's test set from
`--mnist-path` (the original IDX files) or `keras.datasets.mnist`. With your
own data, replace the data section: any arrays or `tf.data.Dataset` that `fit`
accepts will do.
"""

# ----------------------------------------------------------------------
# Setup

import argparse
import os
import tempfile

import keras
import numpy as np

import keras_duq
from keras_duq import datasets
from keras_duq import evaluation

parser = argparse.ArgumentParser(description="DUQ on a keras.applications backbone.")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument(
    "--weights", default=None, help='"imagenet" starts from pretrained weights.'
)
parser.add_argument("--mnist-path", default=os.environ.get("KERAS_DUQ_MNIST"))
parser.add_argument(
    "--quick",
    action="store_true",
    default=os.environ.get("KERAS_DUQ_SMOKE") == "1",
    help="A smoke run: 1 epoch on 256 images (the numbers then mean little).",
)
args = parser.parse_args()
epochs = 1 if args.quick else args.epochs
num_train, num_test = (256, 256) if args.quick else (6000, 1000)
keras.utils.set_random_seed(0)

# ----------------------------------------------------------------------
# The data
#
# MobileNetV2 takes RGB images of at least 32 x 32 pixels scaled to [-1, 1]:
# pad the 28 x 28 grayscale images to 32 x 32 and repeat the channel. OoD
# images (MNIST) go through exactly the same preprocessing.


def preprocess(images):
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)))
    return np.repeat(images[..., None], 3, axis=-1).astype("float32") / 127.5 - 1.0


(x_train, y_train), (x_test, y_test) = datasets.load_fashion_mnist()
x_ood, _ = datasets.load_mnist_test(args.mnist_path)
x_train, y_train = preprocess(x_train[:num_train]), y_train[:num_train]
x_test, y_test = preprocess(x_test[:num_test]), y_test[:num_test]
x_ood = preprocess(x_ood[:num_test])

# ----------------------------------------------------------------------
# The backbone
#
# `include_top=False, pooling="avg"` makes a keras.applications model return a
# feature vector: 1280 features for MobileNetV2 (alpha 0.35 keeps it small).
# keras.applications' BatchNormalization layers average their statistics with
# momentum 0.999; a training of a few hundred steps from scratch needs a faster
# average, or inference sees statistics still close to their initial values.

backbone = keras.applications.MobileNetV2(
    input_shape=(32, 32, 3),
    include_top=False,
    weights=args.weights,
    pooling="avg",
    alpha=0.35,
)
for layer in backbone.layers:
    if isinstance(layer, keras.layers.BatchNormalization):
        layer.momentum = 0.9

# ----------------------------------------------------------------------
# Wrap it with DUQ
#
# The head's centroids default to at most 256 dimensions: 1280 x 256 x 10 =
# 3.3M weights instead of 16.4M at full width. The centroid momentum 0.99 suits
# a short training (0.999, the default, averages over ~1000 steps).

model = keras_duq.wrap(
    backbone,
    num_classes=10,
    length_scale=0.1,
    momentum=0.99,
    gradient_penalty=0.1,
)
steps = epochs * int(np.ceil(num_train / 64))
learning_rate = keras.optimizers.schedules.CosineDecay(0.05, decay_steps=steps)
# A smoke run (four steps) runs eagerly: compiling MobileNetV2's double
# backprop into a graph takes longer on a CPU than the steps themselves.
model.compile(
    optimizer=keras.optimizers.SGD(learning_rate, momentum=0.9),
    run_eagerly=args.quick,
)
print(
    f"backbone {backbone.count_params():,} weights, "
    f"DUQ head {model.duq_output.count_params():,} weights"
)
model.fit(x_train, y_train, batch_size=64, epochs=epochs, verbose=2)

# ----------------------------------------------------------------------
# Is the certainty useful?
#
# Two questions. Does it separate right from wrong predictions (the
# misclassification AUROC: the measure to choose `gradient_penalty` and
# `length_scale` by, on validation data, with no OoD data needed)? And does it
# separate FashionMNIST from MNIST (the OoD AUROC)?

kernel_values = model.predict(x_test, verbose=0)
certainty = kernel_values.max(axis=1)
correct = kernel_values.argmax(axis=1) == y_test
ood_certainty = model.predict(x_ood, verbose=0).max(axis=1)
metrics = {
    "accuracy": float(correct.mean()),
    "misclassification_auroc": evaluation.misclassification_auroc(certainty, correct),
    "ood_auroc": evaluation.ood_metrics(certainty, ood_certainty)["auroc"],
}
print(", ".join(f"{name} {value:.3f}" for name, value in metrics.items()))

# ----------------------------------------------------------------------
# A certainty threshold
#
# In production, inputs below a threshold are flagged for a human or a
# fallback. `certainty_threshold` picks the one that keeps 95% of
# in-distribution inputs (choose it on held-out data, as here).

threshold = evaluation.certainty_threshold(certainty, keep=0.95)
flagged = float((ood_certainty < threshold).mean())
print(f"threshold {threshold:.4f}: flags 5% of FashionMNIST and {flagged:.0%} of MNIST")

# ----------------------------------------------------------------------
# Save and reload
#
# The `.keras` file holds everything, centroids included; loading it needs
# keras_duq installed. (For TensorFlow-only serving see examples/serving.py.)

with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "duq_mobilenet.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
same = np.allclose(
    reloaded.predict(x_test[:32], verbose=0), kernel_values[:32], atol=1e-5
)
print(f"saved and reloaded; the reloaded model predicts the same: {same}")

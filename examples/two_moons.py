"""
Title: Knowing what you don't know on two moons
Description: Train DUQ on scikit-learn's two moons and map its certainty, with
and without the gradient penalty.

DUQ (Deterministic Uncertainty Quantification, van Amersfoort et al., 2020)
replaces a classifier's softmax with one RBF kernel per class, centred on a
class centroid. The largest kernel value is the model's *certainty*: close to
1 near a class's training data and close to 0 far from all of it, from a
single deterministic forward pass.

This example trains DUQ on the two-moons toy problem with and without the
gradient penalty, on two backbones, and draws the certainty over the plane
(the paper's Figures 1 and 3). It runs in a few minutes on a laptop CPU:

    python examples/two_moons.py          # outputs/two_moons/certainty_maps.png
    python examples/two_moons.py --quick  # a smoke run (KERAS_DUQ_SMOKE=1 too)

Needs scikit-learn and matplotlib (`pip install "keras-duq[plots]" scikit-learn`).
"""

# ----------------------------------------------------------------------
# Setup

import argparse
import os

import keras
import matplotlib.pyplot as plt
import numpy as np
from sklearn.datasets import make_moons

import keras_duq

parser = argparse.ArgumentParser(description="DUQ on two moons: certainty maps.")
parser.add_argument("--epochs", type=int, default=30)
parser.add_argument("--output-dir", default=os.path.join("outputs", "two_moons"))
parser.add_argument(
    "--quick",
    action="store_true",
    default=os.environ.get("KERAS_DUQ_SMOKE") == "1",
    help="A smoke run: 2 epochs on fewer points (the maps then mean little).",
)
args = parser.parse_args()
epochs = 2 if args.quick else args.epochs
keras.utils.set_random_seed(0)

# ----------------------------------------------------------------------
# The data
#
# Two interleaving half circles, plus "far" points: uniform over the plotted
# area and more than 1.0 away from every training point. A good model is
# certain on the moons and uncertain on the far points.

X_RANGE, Y_RANGE = (-3.5, 4.5), (-3.0, 3.5)
# The quick run's 320 points are 5 full batches of 64: on JAX a last, smaller
# batch would compile a second train step.
num_train = 320 if args.quick else 1500
x_train, y_train = make_moons(num_train, noise=0.1, random_state=0)
x_test, y_test = make_moons(500, noise=0.1, random_state=1)
x_train, x_test = x_train.astype("float32"), x_test.astype("float32")

rng = np.random.default_rng(0)
candidates = np.stack(
    [rng.uniform(*X_RANGE, 5000), rng.uniform(*Y_RANGE, 5000)], axis=1
)
distances = np.linalg.norm(candidates[:, None, :] - x_train[None, :, :], axis=-1)
x_far = candidates[distances.min(axis=1) > 1.0].astype("float32")
print(
    f"{len(x_train)} training points, {len(x_test)} test points, "
    f"{len(x_far)} far points"
)

# ----------------------------------------------------------------------
# A distance-preserving backbone
#
# The gradient penalty keeps the features sensitive to the input. A backbone
# whose layers cannot shrink distances much helps further: far inputs then stay
# far in feature space and cannot land on a centroid. Spectral normalisation
# (`keras_duq.SpectralNormalization`) caps each dense layer's largest singular
# value (estimated by one power iteration per training step); residual blocks
# `h + relu(f(h))` of such layers keep distances, as in DUE (van Amersfoort et
# al., 2021).


def sn_dense(units):
    """A dense layer whose spectral norm is capped at 3."""
    return keras_duq.SpectralNormalization(keras.layers.Dense(units), coefficient=3.0)


def residual_sn_backbone():
    inputs = keras.Input((2,))
    features = sn_dense(32)(inputs)
    for _ in range(2):
        features = features + keras.layers.ReLU()(sn_dense(32)(features))
    return keras.Model(inputs, features, name="residual_sn_mlp")


def plain_mlp_backbone():
    # The paper's MLP. Its last layer is linear: a ReLU right before DUQ's
    # projection lets units die, and each dead unit is a direction in which
    # the certainty stops changing.
    return keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(20, activation="relu"),
            keras.layers.Dense(20, activation="relu"),
            keras.layers.Dense(20),
        ],
        name="mlp",
    )


# ----------------------------------------------------------------------
# DUQ, with and without the penalty
#
# `keras_duq.wrap` puts the DUQ head on any backbone that outputs
# `(batch, features)`. The problem-specific settings are the paper's for two
# moons: centroids of size 10, length scale 0.3, centroid momentum 0.99,
# penalty weight 1.0, `W` drawn from a unit normal; the rest are the library's
# defaults. The loss is built in: `compile` takes only the optimizer.


def train(backbone, gradient_penalty):
    model = keras_duq.wrap(
        backbone,
        num_classes=2,
        centroid_dims=10,
        length_scale=0.3,
        momentum=0.99,
        kernel_initializer=keras.initializers.RandomNormal(stddev=1.0),
        gradient_penalty=gradient_penalty,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    model.fit(x_train, y_train, batch_size=64, epochs=epochs, verbose=0)
    return model


models = {
    "spectrally normalised, penalty 1.0": train(residual_sn_backbone(), 1.0),
    "spectrally normalised, no penalty": train(residual_sn_backbone(), 0.0),
    "plain MLP, no penalty": train(plain_mlp_backbone(), 0.0),
}

# ----------------------------------------------------------------------
# Certainty near and far from the data
#
# `predict` returns the kernel values, `(batch, 2)` in [0, 1]: the prediction
# is their argmax and the certainty their max. Separating the test points from
# the far points by certainty is an out-of-distribution (OoD) detection task:
# `keras_duq.evaluation.ood_metrics` gives its AUROC.

results = {}
for name, model in models.items():
    test_kernels = model.predict(x_test, batch_size=1000, verbose=0)
    test_certainty = test_kernels.max(axis=1)
    far_certainty = model.predict(x_far, batch_size=1000, verbose=0).max(axis=1)
    ood = keras_duq.evaluation.ood_metrics(test_certainty, far_certainty)
    results[name] = result = {
        "test_accuracy": float((test_kernels.argmax(axis=1) == y_test).mean()),
        "test_certainty": float(test_certainty.mean()),
        "far_certainty": float(far_certainty.mean()),
        "auroc": ood["auroc"],
    }
    print(
        f"{name}: test accuracy {result['test_accuracy']:.3f}, mean certainty "
        f"{result['test_certainty']:.3f} on the moons and "
        f"{result['far_certainty']:.3f} far from them, AUROC {result['auroc']:.3f}"
    )

# ----------------------------------------------------------------------
# Certainty maps
#
# Yellow is certain, dark blue uncertain. On the spectrally normalised
# backbone the certain region hugs the moons, with the penalty and (on most
# seeds) without it. The plain MLP without the penalty maps whole regions far
# from the data onto a centroid and stays certain there: the paper's Figure 3.
# With the penalty (`gradient_penalty=1.0`) it hugs the moons on most seeds.

os.makedirs(args.output_dir, exist_ok=True)
figure, axes = plt.subplots(1, 3, figsize=(18, 4.5))
for ax, (name, model) in zip(axes, models.items()):
    keras_duq.plots.plot_certainty_map(
        model,
        x_train,
        y_train,
        X_RANGE,
        Y_RANGE,
        resolution=60 if args.quick else 200,
        title=name,
        ax=ax,
    )
figure.tight_layout()
path = os.path.join(args.output_dir, "certainty_maps.png")
figure.savefig(path, dpi=100)
plt.close(figure)
print(f"wrote {path}")

# ----------------------------------------------------------------------
# Next steps
#
# - `model.save("duq.keras")` saves the model, centroids included.
# - The paper's three-layer MLP, seed sweeps and the results reported in
#   docs/reports/two_moons.md: `python -m research.reproduction.two_moons --help`.

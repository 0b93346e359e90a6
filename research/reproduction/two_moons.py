"""DUQ on two moons: the paper's Figure 1 (and Figure 3 without the penalty).

Trains a DUQ model on scikit-learn's two moons with the head, optimizer and
penalty of the paper's reference notebook, prints test accuracy and
certainty statistics, and writes a certainty map. The backbone is a
spectrally normalised residual MLP (`--backbone residual_sn`, the default)
or the paper's three-layer MLP (`--backbone paper`).

    python -m research.reproduction.two_moons                                       # the demo
    python -m research.reproduction.two_moons --seeds $(seq 0 19)                   # the 20-seed sweep
    python -m research.reproduction.two_moons --backbone paper                      # Figure 1
    python -m research.reproduction.two_moons --backbone paper --gradient-penalty 0 # Figure 3's failure

Each run is checked against the demo's bar (`meets_bar`). The default met it
on 19 of seeds 0-19 (20 with oneDNN off) and 18 of seeds 100-119; the paper's
MLP on about 85-90% of seeds, whatever the penalty weight in [0.25, 1]
(docs/reports/two_moons.md has the tables).

"Far" points are sampled uniformly in [-3.5, 4.5] x [-3, 3.5] and kept when
farther than 1.0 from every training point. A good DUQ model is uncertain
there (mean certainty near 0) and certain on the test set.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import keras
import numpy as np
from keras import ops
from sklearn.datasets import make_moons
from sklearn.metrics import roc_auc_score
from sklearn.neighbors import NearestNeighbors

import keras_duq

X_RANGE = (-3.5, 4.5)
Y_RANGE = (-3.0, 3.5)
DEFAULT_GRADIENT_PENALTY = 1.0


def meets_bar(result):
    """The demo's bar: accurate, uncertain far from the data, and separating."""
    return (
        result["test_accuracy"] >= 0.98
        and result["far_certainty_mean"] <= 0.05
        and result["auroc_test_vs_far"] >= 0.99
    )


def make_data(seed, num_train=1500, num_test=500, noise=0.1):
    """Two moons train/test sets and "far" points, all float32."""
    x_train, y_train = make_moons(num_train, noise=noise, random_state=seed)
    x_test, y_test = make_moons(num_test, noise=noise, random_state=seed + 1000)
    rng = np.random.default_rng(seed)
    candidates = np.stack(
        [rng.uniform(*X_RANGE, 20000), rng.uniform(*Y_RANGE, 20000)], axis=1
    )
    distance, _ = NearestNeighbors(n_neighbors=1).fit(x_train).kneighbors(candidates)
    x_far = candidates[distance[:, 0] > 1.0]
    return (
        (x_train.astype("float32"), y_train),
        (x_test.astype("float32"), y_test),
        x_far.astype("float32"),
    )


@keras.saving.register_keras_serializable(package="two_moons")
class SpectralNormalizedDense(keras.layers.Layer):
    """A dense layer whose kernel's spectral norm is at most `coefficient`.

    Spectral normalisation (Miyato et al., 2018) as DUE (van Amersfoort et
    al., 2021) uses it: the kernel is divided by `max(1, sigma /
    coefficient)`, where `sigma`, its largest singular value, is estimated by
    one power iteration per training step. Residual blocks `h + relu(f(h))`
    of such layers keep distances: inputs far apart stay apart in feature
    space, so points far from the data cannot be mapped onto a centroid.
    Unlike `keras.layers.SpectralNormalization`, which rescales the kernel
    to norm 1 and writes it back into the weights, the norm is only capped
    and the gradient flows through the rescaling.

    Args:
        units: int, the output size.
        coefficient: float > 0, the largest spectral norm allowed. Defaults
            to `3.0`.

    Example:

    ```python
    features = SpectralNormalizedDense(32)(keras.Input((2,)))
    ```
    """

    def __init__(self, units, coefficient=3.0, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.coefficient = coefficient

    def build(self, input_shape):
        self.kernel = self.add_weight(
            shape=(input_shape[-1], self.units),
            initializer="glorot_uniform",
            name="kernel",
        )
        self.bias = self.add_weight(
            shape=(self.units,), initializer="zeros", name="bias"
        )
        self.vector_u = self.add_weight(
            shape=(1, self.units),
            initializer="random_normal",
            trainable=False,
            name="vector_u",
        )

    def call(self, inputs, training=False):
        vector_v = ops.matmul(self.vector_u, ops.transpose(self.kernel))
        vector_v = vector_v / (ops.norm(vector_v) + 1e-12)
        vector_u = ops.matmul(vector_v, self.kernel)
        vector_u = vector_u / (ops.norm(vector_u) + 1e-12)
        if training:
            self.vector_u.assign(vector_u)
        vector_u, vector_v = ops.stop_gradient(vector_u), ops.stop_gradient(vector_v)
        sigma = ops.sum(ops.matmul(vector_v, self.kernel) * vector_u)
        kernel = self.kernel / ops.maximum(1.0, sigma / self.coefficient)
        return ops.matmul(inputs, kernel) + self.bias

    def get_config(self):
        return {
            **super().get_config(),
            "units": self.units,
            "coefficient": self.coefficient,
        }


def build_backbone(backbone="residual_sn"):
    """The feature extractor: `"residual_sn"` (default) or `"paper"`.

    `"paper"` is the paper's MLP: three dense layers of 20 units. As in the
    reference notebook, its third layer is linear: a ReLU right before DUQ's
    projection lets units die, and every dead unit is a direction in input
    space along which the features (and so the certainty) stop changing,
    leaving bands of high certainty far from the data.

    `"residual_sn"`: a spectrally normalised dense layer of 32 units, then
    two residual blocks `h + relu(SpectralNormalizedDense(32)(h))` with
    norm at most 3, as DUE's feature extractor. Such blocks keep distances,
    so far points cannot be mapped onto a centroid: it left no such band on
    any seed measured (docs/two_moons.md).
    """
    if backbone == "paper":
        return keras.Sequential(
            [
                keras.Input((2,)),
                keras.layers.Dense(20, activation="relu"),
                keras.layers.Dense(20, activation="relu"),
                keras.layers.Dense(20),
            ],
            name="mlp",
        )
    if backbone != "residual_sn":
        raise ValueError(
            f"Expected `backbone` to be 'residual_sn' or 'paper'. Received: `backbone={backbone!r}`"
        )
    inputs = keras.Input((2,))
    features = SpectralNormalizedDense(32)(inputs)
    for _ in range(2):
        features = features + keras.layers.ReLU()(SpectralNormalizedDense(32)(features))
    return keras.Model(inputs, features, name="residual_sn_mlp")


def build_model(
    gradient_penalty=DEFAULT_GRADIENT_PENALTY,
    bias_correction=False,
    penalty_interval=1,
    backbone="residual_sn",
):
    """A compiled DUQ model with the reference notebook's head and optimizer."""
    model = keras_duq.wrap(
        build_backbone(backbone),
        num_classes=2,
        centroid_dims=10,
        length_scale=0.3,
        momentum=0.99,
        # The reference notebook's W initialisation for this 20-unit model.
        kernel_initializer=keras.initializers.RandomNormal(stddev=1.0),
        gradient_penalty=gradient_penalty,
        penalty_interval=penalty_interval,
        weight_decay=1e-4,
        bias_correction=bias_correction,
        **keras_duq.PAPER_SETTINGS,  # the paper's loss, W's rate, no clipping
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    return model


def run(
    seed,
    gradient_penalty=DEFAULT_GRADIENT_PENALTY,
    epochs=30,
    output_dir=None,
    verbose=0,
    bias_correction=False,
    penalty_interval=1,
    backbone="residual_sn",
):
    """Trains one model; returns its metrics (and writes the map if asked)."""
    # A fresh Keras state per run, so a seed gives the same model whether it
    # runs alone or after other seeds in this process.
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    (x_train, y_train), (x_test, y_test), x_far = make_data(seed)
    model = build_model(gradient_penalty, bias_correction, penalty_interval, backbone)
    start = time.perf_counter()
    model.fit(x_train, y_train, batch_size=64, epochs=epochs, verbose=verbose)
    train_seconds = time.perf_counter() - start
    test_kernels = model.predict(x_test, batch_size=1000, verbose=0)
    far_certainty = model.predict(x_far, batch_size=1000, verbose=0).max(axis=1)
    test_certainty = test_kernels.max(axis=1)
    labels = np.concatenate(
        [np.zeros(len(test_certainty)), np.ones(len(far_certainty))]
    )
    # OoD (far) is the positive class; the detector's score is -certainty.
    auroc = roc_auc_score(labels, -np.concatenate([test_certainty, far_certainty]))
    results = {
        "seed": seed,
        "gradient_penalty": gradient_penalty,
        "penalty_interval": penalty_interval,
        "backbone": backbone,
        "epochs": epochs,
        "test_accuracy": float((test_kernels.argmax(axis=1) == y_test).mean()),
        "test_certainty_mean": float(test_certainty.mean()),
        "far_certainty_mean": float(far_certainty.mean()),
        "far_certainty_max": float(far_certainty.max()),
        "num_far_points": int(len(far_certainty)),
        "auroc_test_vs_far": float(auroc),
        "train_seconds": round(train_seconds, 2),
    }
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        label = "" if backbone == "residual_sn" else f" ({backbone} backbone)"
        title = f"DUQ{label}, gradient penalty {gradient_penalty:g}, seed {seed}"
        axes = keras_duq.plots.plot_certainty_map(
            model, x_train, y_train, X_RANGE, Y_RANGE, title=title
        )
        interval = f"_every{penalty_interval}" if penalty_interval > 1 else ""
        prefix = "two_moons" if backbone == "residual_sn" else f"two_moons_{backbone}"
        path = os.path.join(
            output_dir, f"{prefix}_gp{gradient_penalty:g}{interval}_seed{seed}.png"
        )
        axes.figure.savefig(path, dpi=100)
        # The plot draws on a pyplot figure: close it, sweeps make many.
        import matplotlib.pyplot

        matplotlib.pyplot.close(axes.figure)
        results["figure"] = path
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--gradient-penalty", type=float, default=DEFAULT_GRADIENT_PENALTY
    )
    parser.add_argument(
        "--backbone",
        choices=("residual_sn", "paper"),
        default="residual_sn",
        help="residual_sn: a spectrally normalised residual MLP (default); "
        "paper: the paper's three-layer MLP (docs/two_moons.md).",
    )
    parser.add_argument("--bias-correction", action="store_true")
    parser.add_argument(
        "--penalty-interval",
        type=int,
        default=1,
        help="Penalty on every Nth step only, weighted N times; 1: every step.",
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--output-dir", default="outputs/two_moons")
    parser.add_argument("--verbose", type=int, default=0)
    args = parser.parse_args(argv)
    all_results = []
    for seed in args.seeds:
        results = run(
            seed,
            args.gradient_penalty,
            args.epochs,
            args.output_dir,
            args.verbose,
            args.bias_correction,
            args.penalty_interval,
            args.backbone,
        )
        all_results.append(results)
        print(
            f"seed {seed}: test accuracy {results['test_accuracy']:.4f}, "
            f"mean certainty test {results['test_certainty_mean']:.3f} / "
            f"far {results['far_certainty_mean']:.4f}, "
            f"AUROC test vs far {results['auroc_test_vs_far']:.4f} "
            f"({results['train_seconds']:.1f} s)"
            + ("" if meets_bar(results) else "  [misses the bar]")
        )
    passed = sum(meets_bar(r) for r in all_results)
    print(
        f"{passed} of {len(all_results)} seeds meet the bar (accuracy >= 0.98, "
        "mean far certainty <= 0.05, AUROC test vs far >= 0.99)"
    )
    os.makedirs(args.output_dir, exist_ok=True)
    interval = f"_every{args.penalty_interval}" if args.penalty_interval > 1 else ""
    backbone = "" if args.backbone == "residual_sn" else f"_{args.backbone}"
    path = os.path.join(
        args.output_dir, f"results{backbone}_gp{args.gradient_penalty:g}{interval}.json"
    )
    with open(path, "w") as f:
        json.dump(all_results, f, indent=2)
    print(f"wrote {path}")
    return all_results


if __name__ == "__main__":
    main()

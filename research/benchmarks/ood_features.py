"""Where a backbone puts out-of-distribution inputs, seen through a softmax head.

Trains one of `research.benchmarks.own_model_defaults`' backbones with a
`Dense(10, "softmax")` head on FashionMNIST (standardised, Adam at its
default rate, batch 128), then compares its features (the backbone's
output) on the FashionMNIST test set and on the MNIST test digits: which
class the head gives the digits, the mean feature norm per class, the
squared distance to the nearest class mean (of the features of the first
10,000 training images), and the AUROC (FashionMNIST against MNIST) of
three scores: the largest softmax probability, the feature norm and the
negative distance to the nearest class mean. A backbone that maps the
digits onto one class's region gives any head on it little to separate
them by; one that maps them far from every class mean leaves a
distance-based head something to find.

    KERAS_HOME=../shared/data/keras python -m research.benchmarks.ood_features \\
        --backbone quickstart --epochs 1 --seed 0 \\
        --mnist-path ../shared/data/mnist --output ood_features.json
"""

from __future__ import annotations

import argparse
import json
import platform

import keras
import numpy as np

from keras_duq import evaluation
from research.benchmarks.own_model_defaults import BACKBONES
from research.benchmarks.own_model_defaults import load

MEAN_IMAGES = 10_000
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)


def feature_statistics(
    train_features,
    train_labels,
    features,
    labels,
    ood_features,
    probabilities,
    ood_probabilities,
):
    """The numbers of the module docstring, from features and softmax outputs.

    Args:
        train_features, train_labels: `(n_train, d)` training features and
            their `(n_train,)` labels, for the class means.
        features, labels: `(n, d)` in-distribution test features, `(n,)`.
        ood_features: `(m, d)` out-of-distribution features.
        probabilities, ood_probabilities: the head's `(n, k)` and `(m, k)`
            softmax outputs.
    """
    train_features = np.asarray(train_features, dtype=np.float64)
    features = np.asarray(features, dtype=np.float64)
    ood_features = np.asarray(ood_features, dtype=np.float64)
    classes = probabilities.shape[1]
    means = np.stack(
        [train_features[train_labels == c].mean(axis=0) for c in range(classes)]
    )

    def nearest_mean_distance(f):
        return np.min(((f[:, None, :] - means[None]) ** 2).sum(axis=-1), axis=1)

    distance = nearest_mean_distance(features)
    ood_distance = nearest_mean_distance(ood_features)
    norm = np.linalg.norm(features, axis=1)
    ood_norm = np.linalg.norm(ood_features, axis=1)

    def auroc(score, ood_score):
        return float(evaluation.ood_metrics(score, ood_score)["auroc"])

    return {
        "accuracy": float(np.mean(probabilities.argmax(axis=1) == labels)),
        "ood_predicted_class_share": [
            float(share)
            for share in np.bincount(
                ood_probabilities.argmax(axis=1), minlength=classes
            )
            / len(ood_probabilities)
        ],
        "feature_norm_per_class": [
            float(norm[labels == c].mean()) for c in range(classes)
        ],
        "ood_feature_norm": float(ood_norm.mean()),
        "median_nearest_mean_distance": float(np.median(distance)),
        "ood_median_nearest_mean_distance": float(np.median(ood_distance)),
        "auroc_max_probability": auroc(
            probabilities.max(axis=1), ood_probabilities.max(axis=1)
        ),
        "auroc_feature_norm": auroc(norm, ood_norm),
        "auroc_nearest_mean_distance": auroc(-distance, -ood_distance),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", choices=sorted(BACKBONES), default="quickstart")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mnist-path", default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    x_train, y_train, x_test, y_test, x_ood = load(
        args.mnist_path, None, standardize=True
    )
    keras.utils.set_random_seed(args.seed)
    backbone = BACKBONES[args.backbone]()
    model = keras.Sequential([backbone, keras.layers.Dense(10, activation="softmax")])
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x_train, y_train, batch_size=128, epochs=args.epochs, verbose=2)
    result = {
        "backbone": args.backbone,
        "epochs": args.epochs,
        "seed": args.seed,
        "classes": FASHION_MNIST_CLASSES,
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "python": platform.python_version(),
        **feature_statistics(
            backbone.predict(x_train[:MEAN_IMAGES], verbose=0),
            y_train[:MEAN_IMAGES],
            backbone.predict(x_test, verbose=0),
            y_test,
            backbone.predict(x_ood, verbose=0),
            model.predict(x_test, verbose=0),
            model.predict(x_ood, verbose=0),
        ),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

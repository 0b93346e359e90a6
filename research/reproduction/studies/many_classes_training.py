"""Does DUQ's loss still train at 1,000 classes? A Gaussian-mixture check.

`--classes` clusters in 64 dimensions (centres normal(0, 1), examples at
standard deviation `--spread` around them), `--per-class` training and 10
test examples per class, an MLP backbone (`Dense(256, relu)` twice),
`keras_duq.wrap`'s defaults (the head `"auto"` picks: shared at 1,000
classes on 256 features) and a softmax head on the same backbone, Adam,
batch 64. Out-of-distribution: points drawn from normal(0, 1) with no
cluster, scored by DUQ's certainty and softmax's maximum probability.
Reports test accuracy, AUROC and the training history per seed.

    python -m research.reproduction.studies.many_classes_training --seeds 0 1 2 \
        --output research/reproduction/results/many_classes_training.jsonl
    python -m research.reproduction.studies.many_classes_training --methods duq \
        --set categorical_cross_entropy_weight=0.0  # a `wrap` argument
"""

from __future__ import annotations

import argparse
import ast
import time

import keras
import numpy as np

import keras_duq
from keras_duq import evaluation
from research.benchmarks.recipe import emit


def make_data(seed, classes, per_class, spread, dims=64):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dims)).astype("float32")

    def sample(n):
        y = np.repeat(np.arange(classes), n)
        x = centres[y] + spread * rng.normal(size=(len(y), dims)).astype("float32")
        return x.astype("float32"), y

    far = rng.normal(size=(2000, dims)).astype("float32")
    return sample(per_class), sample(10), far


def backbone(dims=64):
    return keras.Sequential(
        [
            keras.Input((dims,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
        ]
    )


def run(seed, method, args):
    (x, y), (x_test, y_test), far = make_data(
        seed, args.classes, args.per_class, args.spread
    )
    keras.utils.set_random_seed(seed)
    if method == "duq":
        model = keras_duq.wrap(backbone(), num_classes=args.classes, **args.overrides)
        model.compile(optimizer="adam")
        head = model.duq_output
    else:
        inputs = keras.Input((64,))
        outputs = keras.layers.Dense(args.classes, activation="softmax")(
            backbone()(inputs)
        )
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer="adam",
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        head = None
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=64, epochs=args.epochs, verbose=0).history
    seconds = time.perf_counter() - start
    scores = model.predict(x_test, verbose=0)
    far_scores = model.predict(far, verbose=0)
    return {
        "method": method,
        "seed": seed,
        "classes": args.classes,
        "per_class": args.per_class,
        "spread": args.spread,
        "epochs": args.epochs,
        "head": None if head is None else head.resolved_head,
        "overrides": args.overrides if method == "duq" else {},
        "train_accuracy": float(history["accuracy"][-1]),
        "test_accuracy": float(np.mean(scores.argmax(1) == y_test)),
        "ood_auroc": float(
            evaluation.ood_metrics(scores.max(1), far_scores.max(1))["auroc"]
        ),
        "train_seconds": round(seconds, 1),
        "history": {
            name: [round(float(v), 4) for v in values]
            for name, values in history.items()
            if name in ("accuracy", "certainty", "gradient_penalty", "loss")
        },
        "keras_duq": keras_duq.__version__,
        "backend": keras.backend.backend(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--per-class", type=int, default=20)
    parser.add_argument("--spread", type=float, default=0.3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--methods", nargs="+", default=["duq", "softmax"])
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="A `wrap` argument (a Python literal) for the DUQ model.",
    )
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    args.overrides = {
        name: ast.literal_eval(value)
        for name, value in (item.split("=", 1) for item in args.set)
    }
    for seed in args.seeds:
        for method in args.methods:
            emit(run(seed, method, args), args.output)


if __name__ == "__main__":
    main()

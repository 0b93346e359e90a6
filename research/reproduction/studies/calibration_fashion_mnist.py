"""Calibration and selective prediction on FashionMNIST: DUQ against softmax.

For each seed, the README quickstart's backbone (a keras.io-style CNN) is
trained twice with Adam on the first 50,000 FashionMNIST training images,
standardised: once with DUQ's head (`keras_duq.wrap` defaults) and once
with a softmax head. The last 10,000 training images are the validation
set that fits `keras_duq.evaluation.CertaintyCalibrator` (isotonic
regression of correctness on confidence), for both heads. On the test set
it reports, per run: accuracy, AUROC against MNIST, ECE (15 equal-width
bins) of the raw confidence (DUQ: the largest kernel value; softmax: the
largest probability) and of the calibrated one, AURC, and the accuracy on
the 90% most confident test images.

    python -m research.reproduction.studies.calibration_fashion_mnist \\
        --output research/reproduction/results/calibration_fashion_mnist.json

Needs `KERAS_HOME` pointing at an offline copy of FashionMNIST (or network)
and `--mnist-path` (MNIST's test set as IDX files); the defaults are
`../shared/data` beside the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT.parent / "shared" / "data"
os.environ.setdefault("KERAS_HOME", str(DATA / "keras"))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_duq  # noqa: E402
from keras_duq import datasets  # noqa: E402
from keras_duq import evaluation  # noqa: E402
from research.benchmarks.own_model_defaults import dropout_backbone as backbone  # noqa: E402

HEADS = ("duq", "softmax")


def confidence(model, x):
    """`(predictions, confidence)`: kernel values or probabilities, maximised."""
    scores = model.predict(x, batch_size=1000, verbose=0)
    return scores.argmax(axis=1), scores.max(axis=1)


def run(head, seed, data, epochs):
    (x_train, y_train), (x_val, y_val), (x_test, y_test), x_ood = data
    keras.utils.set_random_seed(seed)
    if head == "duq":
        model = keras_duq.wrap(
            backbone(),
            num_classes=10,
            projection_learning_rate=1.0,
            categorical_cross_entropy_weight=0.0,
        )
        model.compile(optimizer="adam")
    else:
        model = keras.Sequential(
            [backbone(), keras.layers.Dense(10, activation="softmax")]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    start = time.perf_counter()
    model.fit(x_train, y_train, batch_size=128, epochs=epochs, verbose=0)
    seconds = time.perf_counter() - start
    val_pred, val_conf = confidence(model, x_val)
    calibrator = evaluation.CertaintyCalibrator().fit(val_conf, val_pred == y_val)
    pred, conf = confidence(model, x_test)
    correct = pred == y_test
    _, ood_conf = confidence(model, x_ood)
    return {
        "head": head,
        "seed": seed,
        "epochs": epochs,
        "accuracy": float(correct.mean()),
        "auroc_vs_mnist": evaluation.ood_metrics(conf, ood_conf)["auroc"],
        "ece_raw": evaluation.expected_calibration_error(conf, correct),
        "ece_calibrated": evaluation.expected_calibration_error(
            calibrator(conf), correct
        ),
        "aurc": evaluation.aurc(conf, correct),
        "accuracy_at_90_coverage": 1.0
        - evaluation.risk_at_coverage(conf, correct, coverage=0.9),
        "train_seconds": round(seconds, 1),
    }


def summary(runs):
    table = {}
    for head in HEADS:
        rows = [r for r in runs if r["head"] == head]
        if not rows:
            continue
        table[head] = {
            key: {
                "mean": float(np.mean([r[key] for r in rows])),
                "min": float(np.min([r[key] for r in rows])),
                "max": float(np.max([r[key] for r in rows])),
            }
            for key in (
                "accuracy",
                "auroc_vs_mnist",
                "ece_raw",
                "ece_calibrated",
                "aurc",
                "accuracy_at_90_coverage",
            )
        }
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--mnist-path", default=str(DATA / "mnist"))
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    (x_train, y_train), (x_test, y_test) = datasets.load_fashion_mnist()
    x_ood, _ = datasets.load_mnist_test(args.mnist_path)
    x_train, x_test, x_ood = (datasets.normalize(x) for x in (x_train, x_test, x_ood))
    data = (
        (x_train[:50000], y_train[:50000]),
        (x_train[50000:], y_train[50000:]),
        (x_test, y_test),
        x_ood,
    )
    report = {
        "description": __doc__.split("\n\n")[0],
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "keras_duq": keras_duq.__version__,
        "runs": [],
    }
    for seed in args.seeds:
        for head in HEADS:
            report["runs"].append(run(head, seed, data, args.epochs))
            report["summary"] = summary(report["runs"])
            print(json.dumps(report["runs"][-1]), flush=True)
            if args.output:
                Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()

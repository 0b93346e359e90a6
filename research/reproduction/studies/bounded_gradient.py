"""Does a bounded cross-entropy gradient keep training on distant inputs finite?

keras_duq's default cross-entropy gradient is exact (`bce_epsilon=0`): for a
kernel value K it grows like 1 / K, without bound as an example moves far
from its centroid. `bce_epsilon=1e-12` bounds it as PyTorch's
`binary_cross_entropy` in the paper's code does. This script measures, side
by side in one run:

- `distant`: a small Dense model (length scale 0.1, SGD 0.01) trained 5
  epochs on inputs multiplied by 1, 10, 100 and 1000, penalty off and on:
  whether training ends with finite weights, or keras_duq's guard stops it;
- `fashion_mnist`: FashionMNIST after one epoch of the paper's recipe
  (research/reproduction/fashion_mnist.py), training accuracy of the epoch, test accuracy
  and AUROC against MNIST, over seeds.

    python -m research.reproduction.studies.bounded_gradient --output research/reproduction/results/bounded_gradient.json
    python -m research.reproduction.studies.bounded_gradient --parts distant

FashionMNIST needs `KERAS_HOME` pointing at an offline copy (or network) and
`--mnist-path`; the default is `../shared/data` beside the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT.parent / "shared" / "data"
os.environ.setdefault("KERAS_HOME", str(DATA / "keras"))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_duq  # noqa: E402

EPSILONS = (0.0, 1e-12)


def distant(scales=(1.0, 10.0, 100.0, 1000.0), epochs=5):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64")
    rows = []
    for gradient_penalty in (0.0, 1.0):
        for scale in scales:
            for bce_epsilon in EPSILONS:
                keras.utils.set_random_seed(0)
                backbone = keras.Sequential(
                    [keras.Input((4,)), keras.layers.Dense(16, activation="relu")]
                )
                model = keras_duq.wrap(
                    backbone,
                    num_classes=2,
                    length_scale=0.1,
                    gradient_penalty=gradient_penalty,
                    bce_epsilon=bce_epsilon,
                    projection_learning_rate=1.0,
                    categorical_cross_entropy_weight=0.0,
                )
                model.compile(optimizer=keras.optimizers.SGD(0.01))
                outcome, accuracy = "finished", None
                try:
                    history = model.fit(
                        x * scale, y, epochs=epochs, batch_size=32, verbose=0
                    )
                    accuracy = round(float(history.history["accuracy"][-1]), 4)
                except Exception as error:  # noqa: BLE001 - the guard's error is the outcome
                    outcome = f"stopped: {type(error).__name__}"
                finite = all(np.all(np.isfinite(v.numpy())) for v in model.weights)
                rows.append(
                    {
                        "gradient_penalty": gradient_penalty,
                        "input_scale": scale,
                        "bce_epsilon": bce_epsilon,
                        "outcome": outcome,
                        "weights_finite": bool(finite),
                        "last_epoch_accuracy": accuracy,
                    }
                )
                print(rows[-1], flush=True)
    return rows


def fashion_mnist(seeds, mnist_path, scratch):
    rows = []
    for seed in seeds:
        for bce_epsilon in EPSILONS:
            out = Path(scratch) / f"eps{bce_epsilon:g}_seed{seed}"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "research.reproduction.fashion_mnist",
                    "--model",
                    "duq",
                    "--gradient-penalty",
                    "0.05",
                    "--epochs",
                    "1",
                    "--seed",
                    str(seed),
                    "--bce-epsilon",
                    str(bce_epsilon),
                    "--mnist-path",
                    mnist_path,
                    "--ood-eval-every",
                    "0",
                    "--output-dir",
                    str(out),
                    "--verbose",
                    "0",
                ],
                check=True,
                cwd=ROOT,
            )
            result = json.loads((out / "results.json").read_text())
            rows.append(
                {
                    "seed": seed,
                    "bce_epsilon": bce_epsilon,
                    "epoch_1_training_accuracy": round(
                        result["history"]["accuracy"][0], 4
                    ),
                    "test_accuracy": result["accuracy"],
                    "auroc_vs_mnist": round(result["auroc"], 4),
                }
            )
            print(rows[-1], flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["distant", "fashion_mnist"])
    parser.add_argument("--fashion-mnist-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--mnist-path", default=str(DATA / "mnist"))
    parser.add_argument("--scratch-dir", default="/tmp/keras_duq_bounded_gradient")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    report = {
        "machine": platform.processor() or platform.machine(),
        "keras": keras.__version__,
    }
    if "distant" in args.parts:
        report["distant"] = distant()
    if "fashion_mnist" in args.parts:
        report["fashion_mnist"] = fashion_mnist(
            args.fashion_mnist_seeds, args.mnist_path, args.scratch_dir
        )
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Does a bias-corrected centroid moving average help short trainings?

DUQ's centroid state starts as if every class had been seen 12 times at a
random centroid (the paper's initialisation). With momentum 0.999 that prior
dominates for hundreds of steps. `DUQOutput(bias_correction=True)` makes each
centroid the average of its class's embeddings from the first batch on. This
script measures both settings, side by side in one run, on:

- `moons`: the two-moons demo (research/reproduction/two_moons.py) over 20 seeds;
- `fashion_mnist`: FashionMNIST after one epoch (research/reproduction/fashion_mnist.py,
  the paper's recipe), accuracy and AUROC against MNIST, over seeds;
- `mobilenet`: a MobileNetV2 backbone (alpha 0.35, 32x32 inputs, trained
  from scratch) on a FashionMNIST subset for 5 epochs of 16 steps: `predict`
  accuracy against the accuracy in training mode, and the certainty.

    python -m research.reproduction.studies.centroid_bias_correction --output research/reproduction/results/centroid_bias_correction.json
    python -m research.reproduction.studies.centroid_bias_correction --parts moons mobilenet

FashionMNIST needs `KERAS_HOME` pointing at an offline copy (or network) and
`--mnist-path`; the default is `../shared/data` beside the repository.
"""

from __future__ import annotations

import argparse
import importlib.util
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


def _example(name):
    return importlib.import_module(f"research.reproduction.{name}")


def moons(seeds, gradient_penalty):
    two_moons = _example("two_moons")
    rows = []
    for bias_correction in (False, True):
        for seed in seeds:
            result = two_moons.run(
                seed, gradient_penalty, bias_correction=bias_correction
            )
            result["bias_correction"] = bias_correction
            result["meets_bar"] = two_moons.meets_bar(result)
            rows.append(result)
            print(
                "moons",
                bias_correction,
                seed,
                result["meets_bar"],
                round(result["far_certainty_mean"], 4),
                flush=True,
            )
    return rows


def fashion_mnist(seeds, mnist_path, output_dir):
    example = _example("fashion_mnist")
    rows = []
    for seed in seeds:
        for bias_correction in (False, True):
            flag = "--bias-correction" if bias_correction else "--no-bias-correction"
            results = example.main(
                [
                    "--model",
                    "duq",
                    "--epochs",
                    "1",
                    "--seed",
                    str(seed),
                    flag,
                    "--ood-eval-every",
                    "0",
                    "--mnist-path",
                    str(mnist_path),
                    "--output-dir",
                    str(Path(output_dir) / f"fm_{seed}_{bias_correction}"),
                    "--verbose",
                    "0",
                ]
            )
            rows.append(
                {
                    "seed": seed,
                    "bias_correction": bias_correction,
                    "accuracy": results["accuracy"],
                    "auroc": results["auroc"],
                    "train_accuracy": results.get("history", {}).get(
                        "accuracy", [None]
                    )[-1],
                }
            )
            print("fashion_mnist", rows[-1], flush=True)
    return rows


def mobilenet(seeds, epochs=5, steps=16, batch_size=32):
    (x_train, y_train), (x_test, y_test) = keras.datasets.fashion_mnist.load_data()

    def prepare(images):
        images = np.repeat(images[..., None], 3, axis=-1).astype("float32")
        images = np.pad(images, ((0, 0), (2, 2), (2, 2), (0, 0)))  # 32x32
        return images / 127.5 - 1.0

    num_train = steps * batch_size
    x_train, y_train = prepare(x_train[:num_train]), y_train[:num_train]
    x_test, y_test = prepare(x_test[:1000]), y_test[:1000]
    rows = []
    for seed in seeds:
        for bias_correction in (False, True):
            keras.utils.set_random_seed(seed)
            backbone = keras.applications.MobileNetV2(
                input_shape=(32, 32, 3),
                include_top=False,
                weights=None,
                pooling="avg",
                alpha=0.35,
            )
            model = keras_duq.wrap(
                backbone,
                num_classes=10,
                gradient_penalty=0.0,
                bias_correction=bias_correction,
                projection_learning_rate=1.0,
                categorical_cross_entropy_weight=0.0,
            )
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
            history = model.fit(
                x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=0
            )
            kernels = model.predict(x_test, verbose=0)
            training_mode = np.concatenate(
                [
                    model(x_test[i : i + 250], training=True).numpy()
                    for i in range(0, len(x_test), 250)
                ]
            )
            rows.append(
                {
                    "seed": seed,
                    "bias_correction": bias_correction,
                    "train_accuracy_last_epoch": history.history["accuracy"][-1],
                    "predict_accuracy": float((kernels.argmax(1) == y_test).mean()),
                    "training_mode_accuracy": float(
                        (training_mode.argmax(1) == y_test).mean()
                    ),
                    "median_certainty": float(np.median(kernels.max(1))),
                }
            )
            print("mobilenet", rows[-1], flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts", nargs="+", default=["moons", "fashion_mnist", "mobilenet"]
    )
    parser.add_argument("--moons-seeds", type=int, nargs="+", default=list(range(20)))
    parser.add_argument("--moons-gradient-penalty", type=float, default=None)
    parser.add_argument("--fashion-mnist-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--mobilenet-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--mnist-path", default=str(DATA / "mnist"))
    parser.add_argument("--scratch-dir", default="/tmp/keras_duq_bias_correction")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    report = {
        "machine": platform.processor() or platform.machine(),
        "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default"),
        "keras": keras.__version__,
    }
    start = time.time()
    if "moons" in args.parts:
        penalty = args.moons_gradient_penalty
        if penalty is None:
            penalty = _example("two_moons").DEFAULT_GRADIENT_PENALTY
        report["moons"] = {
            "gradient_penalty": penalty,
            "runs": moons(args.moons_seeds, penalty),
        }
    if "fashion_mnist" in args.parts:
        report["fashion_mnist"] = fashion_mnist(
            args.fashion_mnist_seeds, args.mnist_path, args.scratch_dir
        )
    if "mobilenet" in args.parts:
        report["mobilenet"] = mobilenet(args.mobilenet_seeds)
    report["seconds"] = round(time.time() - start, 1)
    text = json.dumps(report, indent=1)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

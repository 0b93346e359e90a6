"""Training and inference speed of DUQ against a softmax model, side by side.

    python benchmarks/benchmark_speed.py [--output benchmarks/results.json]

Measures, in one process on the same machine and data shapes:

- training step time (median of timed windows after warm-up) for a softmax
  model, DUQ without the penalty and DUQ with the two-sided penalty, on the
  paper's FashionMNIST CNN at batch 128 and on the two-moons MLP at batch 64;
- inference time at batch 1 and batch 1000, softmax against DUQ.

Prints absolute numbers and the ratios DUQ / softmax, and writes them as JSON.
Timings go through `train_on_batch` / `predict_on_batch`, so each includes the
same small Python overhead per call for every model.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import keras
import numpy as np

import keras_duq


def fashion_mnist_backbone():
    """The paper's FashionMNIST CNN (Appendix A), up to its 256 features."""
    layers = [keras.Input((28, 28, 1))]
    for filters, padding in ((64, "same"), (128, "same"), (128, "valid")):
        layers += [
            keras.layers.Conv2D(filters, 3, padding=padding),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(),
        ]
    layers += [keras.layers.Flatten(), keras.layers.Dense(256, activation="relu")]
    return keras.Sequential(layers)


def two_moons_backbone():
    return keras.Sequential(
        [keras.Input((2,))] + [keras.layers.Dense(20, activation="relu") for _ in range(3)]
    )


def build(kind, make_backbone, num_classes):
    backbone = make_backbone()
    if kind == "softmax":
        model = keras.Sequential(
            [backbone, keras.layers.Dense(num_classes, activation="softmax")]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
            loss="sparse_categorical_crossentropy",
        )
        return model
    model = keras_duq.wrap(
        backbone,
        num_classes,
        gradient_penalty=0.0 if kind == "duq_no_penalty" else 0.05,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    return model


def median_seconds(fn, warmup=3, windows=5, calls_per_window=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(calls_per_window):
            fn()
        times.append((time.perf_counter() - start) / calls_per_window)
    return statistics.median(times)


def benchmark(name, make_backbone, input_shape, num_classes, batch_size):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size,) + input_shape).astype("float32")
    y = rng.integers(0, num_classes, size=batch_size)
    x_infer = rng.normal(size=(1000,) + input_shape).astype("float32")
    results = {}
    for kind in ("softmax", "duq_no_penalty", "duq_penalty"):
        keras.utils.set_random_seed(0)
        model = build(kind, make_backbone, num_classes)
        step = median_seconds(lambda model=model: model.train_on_batch(x, y))
        results[f"train_step_s/{kind}"] = step
        results[f"train_examples_per_s/{kind}"] = batch_size / step
        if kind != "duq_penalty":  # inference does not depend on the penalty
            label = "duq" if kind.startswith("duq") else "softmax"
            results[f"infer_batch1_s/{label}"] = median_seconds(
                lambda model=model: model.predict_on_batch(x_infer[:1])
            )
            results[f"infer_batch1000_s/{label}"] = median_seconds(
                lambda model=model: model.predict_on_batch(x_infer),
                warmup=2,
                windows=3,
            )
    ratios = {
        "train_duq_no_penalty/softmax": results["train_step_s/duq_no_penalty"]
        / results["train_step_s/softmax"],
        "train_duq_penalty/softmax": results["train_step_s/duq_penalty"]
        / results["train_step_s/softmax"],
        "infer_batch1_duq/softmax": results["infer_batch1_s/duq"]
        / results["infer_batch1_s/softmax"],
        "infer_batch1000_duq/softmax": results["infer_batch1000_s/duq"]
        / results["infer_batch1000_s/softmax"],
    }
    print(f"\n{name} (batch {batch_size})")
    for key, value in results.items():
        print(f"  {key:36s} {value:12.5f}")
    for key, value in ratios.items():
        print(f"  ratio {key:30s} {value:8.2f}x")
    return {"absolute": results, "ratios": ratios}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="benchmarks/results.json")
    args = parser.parse_args(argv)
    report = {
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "fashion_mnist_cnn": benchmark(
            "FashionMNIST CNN", fashion_mnist_backbone, (28, 28, 1), 10, 128
        ),
        "two_moons_mlp": benchmark("two-moons MLP", two_moons_backbone, (2,), 2, 64),
    }
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()

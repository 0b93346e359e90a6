"""Speed of the current keras_duq on the Keras backend of this process.

`python -m research.benchmarks` runs this module once per installed backend (with
`KERAS_BACKEND` set) and prints the table; run it directly to measure one
backend and get JSON:

    KERAS_BACKEND=jax python -m research.benchmarks.speed --quick

Measured side by side, on the same batches, for each network:

- a training step of a softmax model, of DUQ without the gradient penalty and
  of DUQ with it (`model.train_on_batch`, so every model pays the same
  per-call overhead);
- inference (`model.predict_on_batch`) of the softmax model and of DUQ.

The models are timed in interleaved rounds (one window of each model per
round), so that a slower or busier moment of the machine falls on all of them;
each time is the median over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import keras
import numpy as np

import keras_duq

TRAIN_KINDS = ("softmax", "duq", "duq_penalty")
PREDICT_KINDS = ("softmax", "duq")


def _fashion_mnist_cnn():
    from research.reproduction import fashion_mnist

    return fashion_mnist.build_backbone()


def _two_moons_mlp():
    from research.reproduction import two_moons

    return two_moons.build_backbone()


# Per network: its backbone, input shape, classes, training batch size and
# DUQ settings (the paper's for FashionMNIST, the demo's for two moons).
NETWORKS = {
    "fashion_mnist_cnn": dict(
        backbone=_fashion_mnist_cnn,
        input_shape=(28, 28, 1),
        num_classes=10,
        batch_size=128,
        duq=dict(
            centroid_dims=256,
            length_scale=0.1,
            gradient_penalty=0.05,
            projection_learning_rate=1.0,
            categorical_cross_entropy_weight=0.0,
        ),
    ),
    "two_moons_mlp": dict(
        backbone=_two_moons_mlp,
        input_shape=(2,),
        num_classes=2,
        batch_size=64,
        duq=dict(
            centroid_dims=10,
            length_scale=0.3,
            gradient_penalty=1.0,
            projection_learning_rate=1.0,
            categorical_cross_entropy_weight=0.0,
        ),
    ),
}


def build(kind: str, network: str) -> keras.Model:
    """A compiled softmax (`"softmax"`) or DUQ (`"duq"`, `"duq_penalty"`) model."""
    settings = NETWORKS[network]
    keras.utils.set_random_seed(0)
    backbone = settings["backbone"]()
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    if kind == "softmax":
        model = keras.Sequential(
            [
                backbone,
                keras.layers.Dense(settings["num_classes"], activation="softmax"),
            ]
        )
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
        return model
    duq = dict(settings["duq"])
    if kind == "duq":
        duq["gradient_penalty"] = 0.0
    model = keras_duq.wrap(backbone, settings["num_classes"], **duq)
    model.compile(optimizer=optimizer)
    return model


def median_seconds(fn, warmup, windows, calls_per_window, min_window_s=0.5):
    """Median seconds per call of `fn` over timed windows, after warm-up."""
    return statistics.median(
        interleaved_seconds(
            {"fn": fn}, warmup, windows, calls_per_window, min_window_s
        )["fn"]
    )


def interleaved_seconds(fns, warmup, windows, calls_per_window, min_window_s=0.5):
    """Seconds per call of each callable in `fns`, one window of each per round.

    Returns a dict of lists (one value per window). Millisecond calls run
    more times per window, so that a window rises above the timer's noise.
    """
    calls = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        for _ in range(warmup):
            fn()
        per_call = (time.perf_counter() - start) / max(warmup, 1)
        calls[name] = max(calls_per_window, int(min_window_s / max(per_call, 1e-9)))
    times = {name: [] for name in fns}
    for _ in range(windows):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            times[name].append((time.perf_counter() - start) / calls[name])
    return times


def _batch(network, batch_size, seed=0):
    settings = NETWORKS[network]
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch_size,) + settings["input_shape"]).astype("float32")
    y = rng.integers(0, settings["num_classes"], size=batch_size).astype("int32")
    return x, y


def measure(network: str, quick: bool = False) -> dict:
    """Training-step and inference milliseconds of every model on `network`."""
    batch_size = NETWORKS[network]["batch_size"]
    predict_batch_size = 256 if quick else 1000
    windows, min_window_s = (2, 0.05) if quick else (7, 0.5)
    x, y = _batch(network, batch_size)
    x_predict, _ = _batch(network, predict_batch_size, seed=1)
    models = {kind: build(kind, network) for kind in TRAIN_KINDS}
    train = interleaved_seconds(
        {
            kind: (lambda m=model: m.train_on_batch(x, y))
            for kind, model in models.items()
        },
        warmup=2 if quick else 5,
        windows=windows,
        calls_per_window=1 if quick else 5,
        min_window_s=min_window_s,
    )
    predict = interleaved_seconds(
        {
            kind: (lambda m=models[kind]: m.predict_on_batch(x_predict))
            for kind in PREDICT_KINDS
        },
        warmup=2 if quick else 5,
        windows=windows,
        calls_per_window=1 if quick else 5,
        min_window_s=min_window_s,
    )
    return {
        "batch_size": batch_size,
        "predict_batch_size": predict_batch_size,
        "train_ms": {k: 1000 * statistics.median(v) for k, v in train.items()},
        "predict_ms": {k: 1000 * statistics.median(v) for k, v in predict.items()},
    }


def _processor():
    # `platform.processor()` is empty on many Linux machines.
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def machine() -> dict:
    """The hardware and software the numbers were measured on."""
    backend = keras.backend.backend()
    module = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}.get(backend)
    version = __import__(module).__version__ if module else None
    return {
        "platform": platform.platform(),
        "processor": _processor(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "keras": keras.__version__,
        "keras_duq": keras_duq.__version__,
        "backend": backend,
        "backend_version": version,
        "devices": _devices(backend),
    }


def _devices(backend):
    if backend == "jax":
        import jax

        return [str(device) for device in jax.devices()]
    if backend == "tensorflow":
        import tensorflow as tf

        return [device.name for device in tf.config.list_logical_devices()]
    if backend == "torch":
        import torch

        return ["cuda"] if torch.cuda.is_available() else ["cpu"]
    return []


def run(networks, quick=False) -> dict:
    """Measures `networks` on this process's backend; returns a JSON-able dict."""
    return {
        "machine": machine(),
        "quick": quick,
        "networks": {network: measure(network, quick) for network in networks},
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--networks", nargs="+", choices=sorted(NETWORKS), default=sorted(NETWORKS)
    )
    parser.add_argument(
        "--quick", action="store_true", help="A smoke run: few, short windows."
    )
    parser.add_argument("--output", help="Write the results as JSON to this file.")
    args = parser.parse_args(argv)
    report = run(args.networks, args.quick)
    text = json.dumps(report, indent=1)
    if args.output:
        with open(args.output, "w") as file:
            file.write(text + "\n")
    else:
        print(text)
    return report


if __name__ == "__main__":
    main()

"""What DUQ's head costs: a training step (with the penalty) against a softmax step.

On three networks of the defaults' benchmark, a 26-class MLP (16 inputs,
two `Dense(128)` layers), the README quickstart's FashionMNIST CNN and
CLINC150's text model (150 intents, `penalty_input` on the embeddings),
each head variant's `train_on_batch` is timed in interleaved rounds beside
a softmax model's on the same batch (`research.benchmarks.speed`), and its
median step time is printed as a ratio to softmax's:

    python -m research.benchmarks.head_cost
    python -m research.benchmarks.head_cost --variants default "centroid_dims=32"

A variant is `default` (`wrap(backbone, num_classes)` as it is) or
`name=value` arguments of `wrap`, separated by `;`.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics

import keras
import numpy as np

import keras_duq
from research.benchmarks import recipe
from research.benchmarks import speed


def _mlp():
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
        ]
    )


def _text():
    return keras.Sequential(
        [
            keras.Input((32,), dtype="int32"),
            keras.layers.Embedding(20_000, 64, mask_zero=True, name="embedding"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(128, activation="relu"),
        ]
    )


NETWORKS = {
    "mlp_26_classes": (_mlp, (16,), "float32", 26, 32, {}),
    "fashion_mnist_cnn": (
        lambda: recipe.quickstart_cnn(dropout=0.0),
        (28, 28, 1),
        "float32",
        10,
        128,
        {},
    ),
    "clinc150_text": (_text, (32,), "int32", 150, 64, {"penalty_input": "embedding"}),
}


def _variant(text):
    if text == "default":
        return {}
    return {
        name.strip(): ast.literal_eval(value)
        for name, value in (item.split("=", 1) for item in text.split(";"))
    }


def measure(network, variants, windows=7):
    build, shape, dtype, classes, batch_size, extra = NETWORKS[network]
    rng = np.random.default_rng(0)
    if dtype == "int32":
        x = rng.integers(1, 20_000, size=(batch_size, *shape)).astype("int32")
    else:
        x = rng.normal(size=(batch_size, *shape)).astype("float32")
    y = rng.integers(0, classes, size=batch_size).astype("int32")
    keras.utils.set_random_seed(0)
    softmax = keras.Sequential([build(), keras.layers.Dense(classes, activation="softmax")])
    softmax.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    models = {"softmax": softmax}
    for variant in variants:
        keras.utils.set_random_seed(0)
        model = keras_duq.wrap(build(), classes, **{**extra, **_variant(variant)})
        model.compile(optimizer="adam")
        model.duq_output.start_from_features(model.feature_extractor(x))
        models[variant] = model
    times = speed.interleaved_seconds(
        {name: (lambda m=model: m.train_on_batch(x, y)) for name, model in models.items()},
        warmup=5,
        windows=windows,
        calls_per_window=5,
    )
    base = statistics.median(times["softmax"])
    return {
        "softmax_ms": round(1000 * base, 3),
        "ratios": {
            name: round(statistics.median(t) / base, 2)
            for name, t in times.items()
            if name != "softmax"
        },
        "head_values": {
            name: int(np.prod(model.duq_output.kernel.shape))
            for name, model in models.items()
            if name != "softmax"
        },
        "centroid_dims": {
            name: int(model.duq_output.centroid_sums.shape[0])
            for name, model in models.items()
            if name != "softmax"
        },
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", nargs="+", default=sorted(NETWORKS))
    parser.add_argument("--variants", nargs="+", default=["default"])
    parser.add_argument("--windows", type=int, default=7)
    args = parser.parse_args(argv)
    report = {"machine": speed.machine(), "networks": {}}
    for network in args.networks:
        report["networks"][network] = measure(network, args.variants, args.windows)
        print(json.dumps({network: report["networks"][network]}), flush=True)
    return report


if __name__ == "__main__":
    main()

"""The library's defaults beyond FashionMNIST: small data, text intents, two moons.

Each problem is trained with `keras_duq.wrap`'s defaults (plus the
problem-specific arguments a problem names, e.g. two moons' head) and,
where asked, a softmax head on the same backbone; every run appends one JSON
record to `--output`.

    python -m benchmarks.recipe --problem small_data --seeds 0 1 2
    python -m benchmarks.recipe --problem clinc150 --seeds 0 1 2 --softmax
    python -m benchmarks.recipe --problem two_moons --seeds $(seq 0 19)
    python -m benchmarks.recipe --problem two_moons --seeds 0 1 2 --set gradient_penalty=0

`--set name=value` overrides one `wrap` argument (a Python literal), to
compare a candidate default with the current one in the same run;
`--epochs` shortens a problem's budget for a quick look. The runs behind
docs/beyond_fashion_mnist.md are in `reproduction/results/recipe/`.

Problems:

- `small_data`: `Embedding(50, 8)` -> `GlobalAveragePooling1D` ->
  `Dense(16, relu)`, 256 training sequences of 20 token ids whose label is
  whether the mean token id is above the median (learnable by pooling),
  `penalty_input="embedding"`, Adam, batch 32, 20 epochs (160 steps).
  Reported: training accuracy, as the accuracy a model reaches on what it
  was fit to.
- `clinc150`: CLINC150 (`../shared/data/clinc150/data_full.json`): 150
  intents, trained on `train` (15,000 queries), tested on `test` (4,500)
  against `oos_test` (1,000 out-of-scope queries). `TextVectorization`
  (20,000 tokens, 32 per query) -> `Embedding(20000, 64)` ->
  `GlobalAveragePooling1D` -> `Dense(128, relu)`, `penalty_input` on the
  embeddings, Adam, batch 64, 10 epochs. Softmax scores with its maximum
  probability.
- `two_moons`: the paper's problem-specific arguments (3x20 MLP,
  `centroid_dims=10`, `length_scale=0.3`, `momentum=0.99`, penalty 1.0, `W ~
  N(0, 1)`, SGD 0.01 momentum 0.9, 30 epochs, batch 64) and the library's
  defaults otherwise; the demo's bar of `reproduction.two_moons`.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import time

import keras
import numpy as np

import keras_duq
from keras_duq import evaluation

HERE = os.path.dirname(os.path.abspath(__file__))
CLINC150 = os.path.join(
    HERE, "..", "..", "shared", "data", "clinc150", "data_full.json"
)


def small_data(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 50, size=(256, 20)).astype("int32")
    means = x.mean(axis=1)
    y = (means > np.median(means)).astype("int32")
    x_test = rng.integers(1, 50, size=(1000, 20)).astype("int32")
    y_test = (x_test.mean(axis=1) > np.median(means)).astype("int32")

    def backbone():
        return keras.Sequential(
            [
                keras.Input((20,), dtype="int32"),
                keras.layers.Embedding(50, 8, name="embedding"),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(16, activation="relu"),
            ]
        )

    return {
        "train": (x, y),
        "test": (x_test, y_test),
        "ood": None,
        "backbone": backbone,
        "num_classes": 2,
        "wrap": {"penalty_input": "embedding"},
        "optimizer": lambda: keras.optimizers.Adam(),
        "batch_size": 32,
        "epochs": 20,
    }


def clinc150(seed):
    with open(CLINC150) as f:
        data = json.load(f)
    intents = sorted({intent for _, intent in data["train"]})
    index = {intent: i for i, intent in enumerate(intents)}

    def split(name):
        texts = np.array([text for text, _ in data[name]])
        labels = np.array([index.get(intent, -1) for _, intent in data[name]])
        return texts, labels

    x_train, y_train = split("train")
    x_test, y_test = split("test")
    x_ood, _ = split("oos_test")
    vectorize = keras.layers.TextVectorization(
        max_tokens=20_000, output_sequence_length=32
    )
    vectorize.adapt(x_train)

    def ids(texts):
        return keras.ops.convert_to_numpy(vectorize(texts)).astype("int32")

    def backbone():
        return keras.Sequential(
            [
                keras.Input((32,), dtype="int32"),
                keras.layers.Embedding(20_000, 64, name="embedding"),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(128, activation="relu"),
            ]
        )

    return {
        "train": (ids(x_train), y_train),
        "test": (ids(x_test), y_test),
        "ood": ids(x_ood),
        "backbone": backbone,
        "num_classes": len(intents),
        "wrap": {"penalty_input": "embedding"},
        "optimizer": lambda: keras.optimizers.Adam(),
        "batch_size": 64,
        "epochs": 10,
    }


def two_moons(seed):
    from reproduction import two_moons as moons

    (x_train, y_train), (x_test, y_test), x_far = moons.make_data(seed)
    return {
        "train": (x_train, y_train),
        "test": (x_test, y_test),
        "ood": x_far,
        "backbone": lambda: moons.build_backbone("paper"),
        "num_classes": 2,
        "wrap": {
            "centroid_dims": 10,
            "length_scale": 0.3,
            "momentum": 0.99,
            "gradient_penalty": 1.0,
            "kernel_initializer": keras.initializers.RandomNormal(stddev=1.0),
        },
        "optimizer": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
        "batch_size": 64,
        "epochs": 30,
    }


PROBLEMS = {"small_data": small_data, "clinc150": clinc150, "two_moons": two_moons}


def run(problem, seed, method, overrides, epochs=None):
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    spec = PROBLEMS[problem](seed)
    if epochs is not None:
        spec["epochs"] = epochs
    x, y = spec["train"]
    x_test, y_test = spec["test"]
    keras.utils.set_random_seed(seed)
    backbone = spec["backbone"]()
    if method == "softmax":
        model = keras.Sequential(
            [backbone, keras.layers.Dense(spec["num_classes"], activation="softmax")]
        )
        model.compile(
            optimizer=spec["optimizer"](),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    else:
        model = keras_duq.wrap(
            backbone,
            num_classes=spec["num_classes"],
            **{**spec["wrap"], **overrides},
        )
        model.compile(optimizer=spec["optimizer"]())
    start = time.perf_counter()
    history = model.fit(
        x, y, batch_size=spec["batch_size"], epochs=spec["epochs"], verbose=0
    )
    seconds = time.perf_counter() - start
    train_scores = model.predict(x, batch_size=1000, verbose=0)
    test_scores = model.predict(x_test, batch_size=1000, verbose=0)
    record = {
        "problem": problem,
        "method": method,
        "seed": seed,
        "overrides": {k: repr(v) for k, v in overrides.items()},
        "epochs": spec["epochs"],
        "train_accuracy": float(np.mean(train_scores.argmax(1) == y)),
        "test_accuracy": float(np.mean(test_scores.argmax(1) == y_test)),
        "test_certainty_mean": float(test_scores.max(1).mean()),
        "train_seconds": round(seconds, 1),
        "history": {
            k: [round(float(v), 4) for v in values]
            for k, values in history.history.items()
            if k in ("accuracy", "certainty", "gradient_penalty")
        },
    }
    if spec["ood"] is not None:
        ood_scores = model.predict(spec["ood"], batch_size=1000, verbose=0)
        metrics = evaluation.ood_metrics(test_scores.max(1), ood_scores.max(1))
        record.update(
            ood_auroc=float(metrics["auroc"]),
            ood_fpr_at_95_tpr=float(metrics["fpr_at_95_tpr"]),
            ood_certainty_mean=float(ood_scores.max(1).mean()),
        )
    if problem == "two_moons" and method == "duq":
        from reproduction import two_moons as moons

        record["meets_bar"] = bool(
            moons.meets_bar(
                {
                    "test_accuracy": record["test_accuracy"],
                    "far_certainty_mean": record["ood_certainty_mean"],
                    "auroc_test_vs_far": record["ood_auroc"],
                }
            )
        )
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", choices=sorted(PROBLEMS), required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--softmax", action="store_true", help="Also a softmax head.")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--label", default="defaults")
    parser.add_argument(
        "--epochs", type=int, default=None, help="The problem's if unset."
    )
    parser.add_argument("--output", default=None, help="JSONL file to append to.")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        name, value = item.split("=", 1)
        overrides[name] = ast.literal_eval(value)
    methods = ["duq"] + (["softmax"] if args.softmax else [])
    for seed in args.seeds:
        for method in methods:
            record = run(
                args.problem,
                seed,
                method,
                overrides if method == "duq" else {},
                args.epochs,
            )
            record.update(
                label=args.label if method == "duq" else "softmax",
                keras_duq=keras_duq.__version__,
                keras=keras.__version__,
                backend=keras.backend.backend(),
                cpu=platform.processor() or platform.machine(),
            )
            emit(record, args.output)


def emit(record, output=None):
    """Prints `record` as one JSON line and appends it to `output` if given."""
    line = json.dumps(record)
    print(line, flush=True)
    if output:
        with open(output, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()

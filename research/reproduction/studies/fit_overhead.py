"""How much of a whole `fit` call is spent outside its training steps.

Trains the paper's FashionMNIST CNN with a DUQ head on random numpy data for
`--steps` steps per `fit` call and compares the wall time of each call with
the sum of its per-batch times (from `on_train_batch_begin` to
`on_train_batch_end`), over `--runs` calls in one process, with and without
the gradient penalty, fed NumPy arrays (Keras's own tf.data pipeline for
arrays, which keras_duq runs with autotuning off) and
`keras_duq.datasets.make_dataset` (autotuning off too). A ratio near 1 means
`fit` adds little around the steps; the first call (tracing) is left out.
Before keras_duq turned autotuning off for arrays, the NumPy rows measured
1.93-1.99 with the penalty (docs/performance.md).

    python -m research.reproduction.studies.fit_overhead --output research/reproduction/results/fit_overhead.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import keras
import numpy as np

import keras_duq
from research.reproduction import fashion_mnist

ROOT = Path(__file__).resolve().parents[3]


class BatchTimes(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def build(gradient_penalty):
    model = keras_duq.wrap(
        fashion_mnist.build_backbone(),
        10,
        centroid_dims=256,
        gradient_penalty=gradient_penalty,
        projection_learning_rate=1.0,
        categorical_cross_entropy_weight=0.0,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * args.batch_size, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, size=len(x))
    report = {
        "machine": platform.processor() or platform.machine(),
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "results": {},
    }
    dataset = keras_duq.datasets.make_dataset(
        x, y, batch_size=args.batch_size, shuffle=True, seed=0
    )
    for gradient_penalty, inputs in (
        (0.05, "numpy"),
        (0.05, "make_dataset"),
        (0.0, "numpy"),
        (0.0, "make_dataset"),
    ):
        data = {"x": x, "y": y} if inputs == "numpy" else {"x": dataset}
        keras.utils.set_random_seed(0)
        model = build(gradient_penalty)
        model.fit(
            **data,
            batch_size=None if inputs != "numpy" else args.batch_size,
            epochs=1,
            verbose=0,
        )
        rows = []
        for _ in range(args.runs):
            timer = BatchTimes()
            start = time.perf_counter()
            model.fit(
                **data,
                batch_size=None if inputs != "numpy" else args.batch_size,
                epochs=1,
                verbose=0,
                callbacks=[timer],
            )
            wall = time.perf_counter() - start
            rows.append(
                {
                    "fit_seconds": round(wall, 3),
                    "sum_of_batches_seconds": round(sum(timer.times), 3),
                    "ratio": round(wall / sum(timer.times), 3),
                    "median_batch_ms": round(1000 * float(np.median(timer.times)), 1),
                }
            )
            print(f"penalty {gradient_penalty}, {inputs}: {rows[-1]}", flush=True)
        report["results"][f"gradient_penalty={gradient_penalty}, {inputs}"] = rows
    text = json.dumps(report, indent=1)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""Training time with the penalty on every k-th step only (`penalty_interval`).

Times `model.fit` on the paper's FashionMNIST CNN with a DUQ head (batch
128, random data, NumPy inputs) for `penalty_interval` 1 (the paper's exact
penalty), 2, 4 and 8, and without the penalty. The models train in one
process in interleaved rounds of `--steps` steps (a multiple of 8, so every
interval sees its share of penalty steps); the report gives each model's
mean step time over all rounds (the cost per step averaged over penalty and
plain steps) and its ratio to the exact penalty.

    python -m research.reproduction.studies.lazy_penalty_speed --output research/reproduction/results/lazy_penalty_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import keras
import numpy as np

import keras_duq
from research.reproduction import fashion_mnist

INTERVALS = (1, 2, 4, 8)


def build(gradient_penalty, penalty_interval):
    keras.utils.set_random_seed(0)
    model = keras_duq.wrap(
        fashion_mnist.build_backbone(),
        10,
        centroid_dims=256,
        gradient_penalty=gradient_penalty,
        penalty_interval=penalty_interval,
        projection_learning_rate=1.0,
        categorical_cross_entropy_weight=0.0,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=24, help="steps per round (a multiple of 8)"
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.steps % 8:
        parser.error("--steps must be a multiple of 8")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * 128, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, size=len(x))
    names = [f"penalty_interval={k}" for k in INTERVALS] + ["no penalty"]
    models = {name: build(0.05, k) for name, k in zip(names, INTERVALS)}
    models["no penalty"] = build(0.0, 1)
    for model in models.values():  # trace, and start every model at step 0 of a cycle
        model.fit(x[: 8 * 128], y[: 8 * 128], batch_size=128, shuffle=False, verbose=0)
    seconds = {name: [] for name in models}
    for round_ in range(args.rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            start = time.perf_counter()
            models[name].fit(x, y, batch_size=128, shuffle=False, verbose=0)
            seconds[name].append((time.perf_counter() - start) / args.steps)
    exact = statistics.mean(seconds["penalty_interval=1"])
    report = {
        "machine": platform.processor() or platform.machine(),
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "batch_size": 128,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "mean_step_ms": {
            n: round(1000 * statistics.mean(s), 1) for n, s in seconds.items()
        },
        "per_round_step_ms": {
            n: [round(1000 * v, 1) for v in s] for n, s in seconds.items()
        },
        "time_vs_exact": {
            n: round(statistics.mean(s) / exact, 3) for n, s in seconds.items()
        },
    }
    print(
        f"FashionMNIST CNN, batch 128, whole-fit time per step, mean of {args.rounds} rounds:"
    )
    for name in names:
        print(
            f"  {name:<20} {report['mean_step_ms'][name]:7.1f} ms  ({report['time_vs_exact'][name]:.2f}x the exact penalty)"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Cost per training step of spectral normalisation (`keras_duq.spectral_normalize`).

Times `model.fit` on the paper's FashionMNIST CNN with a DUQ head and the
gradient penalty on (batch 128, random data), with and without spectral
normalisation of its three convolutions and its dense layer (one power
iteration per step, the default). Both models train in one process, in
interleaved rounds of `--steps` steps, so that both see the same machine
load; the report gives each model's mean step time, as wall time and as
this process's CPU time (less sensitive to other work on a shared machine),
and the ratios.

    python -m research.benchmarks.spectral_normalization_speed \
        --output research/reproduction/results/benchmarks/spectral_normalization_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import keras
import numpy as np

import keras_duq
from research.reproduction import fashion_mnist
from research.reproduction.studies.cifar10_speed import cpu_model

ROOT = Path(__file__).resolve().parents[2]
BATCH_SIZE = 128


def paper_backbone():
    """The paper's FashionMNIST CNN, from the reproduction harness."""
    return fashion_mnist.build_backbone()


def build(spectral, coefficient):
    keras.utils.set_random_seed(0)
    backbone = paper_backbone()
    if spectral:
        backbone = keras_duq.spectral_normalize(backbone, coefficient=coefficient)
    model = keras_duq.wrap(
        backbone,
        10,
        centroid_dims=256,
        gradient_penalty=0.05,
        projection_learning_rate=1.0,
        categorical_cross_entropy_weight=0.0,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    return model


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="steps per round")
    parser.add_argument("--coefficient", type=float, default=3.0)
    parser.add_argument("--output", default=None, help="JSON file for the report")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * BATCH_SIZE, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, size=len(x))
    names = ["plain", "spectral_normalization"]
    models = {name: build(name != "plain", args.coefficient) for name in names}
    for model in models.values():  # trace and compile outside the timing
        model.fit(x[:BATCH_SIZE], y[:BATCH_SIZE], batch_size=BATCH_SIZE, verbose=0)
    seconds = {name: [] for name in names}
    # CPU time of this process: less sensitive than wall time to other
    # processes on a shared machine.
    cpu_seconds = {name: [] for name in names}
    load_before = os.getloadavg()[0]
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start, cpu_start = time.perf_counter(), time.process_time()
            models[name].fit(x, y, batch_size=BATCH_SIZE, shuffle=False, verbose=0)
            seconds[name].append((time.perf_counter() - start) / args.steps)
            cpu_seconds[name].append((time.process_time() - cpu_start) / args.steps)
    mean = {name: statistics.mean(values) for name, values in seconds.items()}
    cpu_mean = {name: statistics.mean(values) for name, values in cpu_seconds.items()}
    report = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "batch_size": BATCH_SIZE,
        "gradient_penalty": 0.05,
        "coefficient": args.coefficient,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "mean_step_ms": {n: round(1000 * v, 1) for n, v in mean.items()},
        "per_round_step_ms": {
            n: [round(1000 * v, 1) for v in s] for n, s in seconds.items()
        },
        "time_vs_plain": round(mean["spectral_normalization"] / mean["plain"], 3),
        "mean_cpu_ms_per_step": {n: round(1000 * v, 1) for n, v in cpu_mean.items()},
        "cpu_time_vs_plain": round(
            cpu_mean["spectral_normalization"] / cpu_mean["plain"], 3
        ),
        "per_round_time_vs_plain": [
            round(a / b, 3)
            for a, b in zip(seconds["spectral_normalization"], seconds["plain"])
        ],
    }
    print(
        f"FashionMNIST CNN + DUQ with penalty, batch {BATCH_SIZE}, mean of {args.rounds} rounds:"
    )
    for name in names:
        print(f"  {name:<24} {report['mean_step_ms'][name]:7.1f} ms per step")
    print(
        f"  ratio: {report['time_vs_plain']:.3f}x (CPU time: {report['cpu_time_vs_plain']:.3f}x)"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

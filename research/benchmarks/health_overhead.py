"""What the health checks cost: a training step with and without them, side by side.

Trains the paper's FashionMNIST CNN (BatchNormalization included) with a DUQ
head, batches of 128, gradient penalty 0.05, on random data, as two models
with the same initial weights: `health_checks=True` (the default) and
`health_checks=False`. After tracing, the two models take `--pairs` pairs of
steps (`train_on_batch` on the same batch), one step each in turn, the order
alternating from pair to pair: each pair's two steps ran a moment apart, so a
change in the machine's load weighs on both alike. The per-step cost of the
checks is the median over pairs of the ratio of the two step times, in wall
time and in this process's CPU time (less sensitive to other processes). The
once-per-epoch check (`HealthCheck.on_epoch_end`: centroid overlap,
the BatchNormalization comparison on the sample `fit` draws, 512 examples in
batches of 128) and the end-of-`fit` checks (`HealthCheck.on_train_end`) are
timed separately, through the callback's hooks; the epoch
check is expressed per step of a full FashionMNIST epoch (469 steps of 128).
On a busy machine the pair ratios scatter; the per-step metric updates are
therefore also timed alone, as a compiled function on tensors of the step's
shapes.

    python -m research.benchmarks.health_overhead \
        --output research/reproduction/results/benchmarks/health_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import keras_duq
from keras_duq.callbacks import HealthCheck
from research.reproduction import fashion_mnist

FASHION_MNIST_STEPS_PER_EPOCH = 469
# The size of the sample `fit` draws for its checks (docs/guide/health_checks.md).
CHECK_SAMPLE_SIZE = 512


def build(health_checks):
    keras.utils.set_random_seed(0)
    model = keras_duq.wrap(
        fashion_mnist.build_backbone(),
        10,
        centroid_dims=256,
        gradient_penalty=0.05,
        health_checks=health_checks,
        projection_learning_rate=1.0,
        categorical_cross_entropy_weight=0.0,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    return model


def cpu_name():
    """The processor's model name (`lscpu`'s "Model name"), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def quartiles(ratios):
    """The median and quartiles of the per-pair ratios (with / without checks)."""
    q1, median, q3 = np.percentile(ratios, [25, 50, 75])
    return {
        "median": round(float(median), 4),
        "quartiles": [round(float(q1), 4), round(float(q3), 4)],
    }


def seconds(function, repeats=5):
    """Median wall time of `function()` over `repeats` calls, after one warm-up call."""
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch_size, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, size=len(x))
    models = {checks: build(checks) for checks in (True, False)}
    for model in models.values():
        for _ in range(3):  # tracing, then warm caches
            model.train_on_batch(x, y)
    wall = {True: [], False: []}
    cpu = {True: [], False: []}
    for pair in range(args.pairs):
        for checks in (True, False) if pair % 2 == 0 else (False, True):
            start, start_cpu = time.perf_counter(), time.process_time()
            models[checks].train_on_batch(x, y)
            wall[checks].append(time.perf_counter() - start)
            cpu[checks].append(time.process_time() - start_cpu)
    wall_ratios = np.array(wall[True]) / np.array(wall[False])
    cpu_ratios = np.array(cpu[True]) / np.array(cpu[False])
    with_checks, without = (float(np.median(wall[c])) for c in (True, False))
    print(
        f"median step: {1000 * with_checks:.1f} ms with checks, {1000 * without:.1f} ms "
        f"without; median ratio {np.median(wall_ratios):.4f} (wall), "
        f"{np.median(cpu_ratios):.4f} (CPU time)",
        flush=True,
    )
    # The added computation alone, in a compiled function as in the step:
    # robust to a busy machine, where the step-time ratio is noisy.
    (health,) = models[True]._step_metrics
    log_kernel = tf.constant(
        rng.normal(-5.0, 3.0, size=(args.batch_size, 10)), "float32"
    )
    penalty = tf.constant(rng.uniform(0.0, 1.0, size=args.batch_size), "float32")
    weight = tf.constant(float(args.batch_size))
    update = tf.function(
        lambda: health.update_state(log_kernel, penalty, weight),
        autograph=False,
    )
    metric_update = seconds(lambda: [update() for _ in range(100)]) / 100
    # The once-per-epoch and end-of-fit checks, on the model with checks
    # (the latter called directly: `fit` runs them only after start-up).
    model = models[True]
    sample = rng.normal(size=(CHECK_SAMPLE_SIZE, *x.shape[1:])).astype("float32")
    callback = HealthCheck(sample, batch_size=args.batch_size)
    callback.set_model(model)
    callback.on_train_begin()
    callback.on_epoch_begin(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_duq.DUQHealthWarning)
        epoch_end = seconds(lambda: callback.on_epoch_end(0, {}))
        train_end = seconds(lambda: callback.on_train_end({}))
    per_epoch = epoch_end / (FASHION_MNIST_STEPS_PER_EPOCH * without)
    report = {
        "what": "DUQ training step of the paper's FashionMNIST CNN, batch 128, "
        "gradient penalty 0.05, with and without health checks",
        "machine": cpu_name(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "backend": keras.backend.backend(),
        "pairs": args.pairs,
        "batch_size": args.batch_size,
        "check_sample_size": CHECK_SAMPLE_SIZE,
        "median_step_ms": {
            "health_checks=True": round(1000 * with_checks, 2),
            "health_checks=False": round(1000 * without, 2),
        },
        "median_step_cpu_ms": {
            "health_checks=True": round(1000 * float(np.median(cpu[True])), 2),
            "health_checks=False": round(1000 * float(np.median(cpu[False])), 2),
        },
        "pair_ratio_wall": quartiles(wall_ratios),
        "pair_ratio_cpu_time": quartiles(cpu_ratios),
        "metric_update_alone_ms": round(1000 * metric_update, 4),
        "metric_update_alone_per_step": round(metric_update / without, 5),
        "epoch_end_check_ms": round(1000 * epoch_end, 1),
        "end_of_fit_check_ms": round(1000 * train_end, 1),
        "epoch_end_check_per_fashion_mnist_epoch": round(per_epoch, 4),
        "checks_alone_per_fashion_mnist_epoch": round(
            metric_update / without + per_epoch, 5
        ),
        "command": " ".join(
            ["python -m research.benchmarks.health_overhead"] + (argv or sys.argv[1:])
        ),
    }
    text = json.dumps(report, indent=1)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

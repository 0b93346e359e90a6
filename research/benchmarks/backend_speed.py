"""Training step time on each Keras backend: softmax, DUQ and DUQ with the penalty.

One run times `model.fit` steps of the paper's FashionMNIST CNN (batch 128,
random data) for a softmax classifier, DUQ without the penalty and DUQ with
the two-sided penalty, on TensorFlow, JAX and PyTorch side by side. Each
backend runs in its own worker process (a process has one backend); the
parent asks the workers for one timed `fit` call per model in turn,
`--rounds` times, rotating which backend goes first, so that every backend
sees the same machine load. A step time is the wall time of one `fit` call
of `--steps` steps divided by the steps, after a first call that traces and
compiles; the report gives the median over rounds, and each model's step
time over softmax's on the same backend.

    python research/benchmarks/backend_speed.py --output research/reproduction/results/benchmarks/backend_speed.json
    python research/benchmarks/backend_speed.py --backends tensorflow torch --steps 5 --rounds 2

Needs the backends it runs (`torch` is not a keras_duq dependency). Every
backend uses Keras's default `jit_compile` (`"auto"`: XLA on JAX, a
TensorFlow graph on TensorFlow, eager PyTorch).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("tensorflow", "jax", "torch")
KINDS = ("softmax", "duq", "duq_penalty")
CLASSES, CENTROID_DIMS, LENGTH_SCALE, PENALTY = 10, 256, 0.1, 0.05


def worker(batch_size, steps):
    """Serves timing requests (`kind` per line) under this process's backend."""
    import keras
    import numpy as np

    import keras_duq

    spec = importlib.util.spec_from_file_location(
        "fashion_mnist", ROOT / "examples" / "fashion_mnist.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size * steps, 28, 28, 1)).astype("float32")
    y = rng.integers(0, CLASSES, size=batch_size * steps)

    def build(kind):
        keras.utils.set_random_seed(0)
        backbone = example.build_backbone()
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        if kind == "softmax":
            model = keras.Sequential(
                [backbone, keras.layers.Dense(CLASSES, activation="softmax")]
            )
            model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
        else:
            model = keras_duq.wrap(
                backbone,
                CLASSES,
                centroid_dims=CENTROID_DIMS,
                length_scale=LENGTH_SCALE,
                gradient_penalty=PENALTY if kind == "duq_penalty" else 0.0,
                projection_learning_rate=1.0,
                categorical_cross_entropy_weight=0.0,
            )
            model.compile(optimizer=optimizer)
        return model

    def fit_ms(model):
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        # Waits for asynchronous backends (JAX) to finish the last step.
        keras.ops.convert_to_numpy(model.trainable_variables[0])
        return (time.perf_counter() - start) / steps * 1000.0

    models = {kind: build(kind) for kind in KINDS}
    for model in models.values():
        fit_ms(model)  # traces and compiles
    versions = {"keras": keras.__version__, "backend_version": _backend_version()}
    print(json.dumps(versions), flush=True)
    for line in sys.stdin:
        print(json.dumps(fit_ms(models[line.strip()])), flush=True)


def _backend_version():
    import keras

    name = keras.backend.backend()
    module = importlib.import_module(name)
    return f"{name} {module.__version__}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument(
        "--steps", type=int, default=10, help="steps per timed fit call"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.batch_size, args.steps)
    workers, versions = {}, {}
    for backend in args.backends:
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        workers[backend] = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "--batch-size",
                str(args.batch_size),
                "--steps",
                str(args.steps),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
    for backend, process in workers.items():
        versions[backend] = json.loads(process.stdout.readline())
    times = {backend: {kind: [] for kind in KINDS} for backend in workers}
    for round_ in range(args.rounds):
        order = (
            args.backends[round_ % len(args.backends) :]
            + args.backends[: round_ % len(args.backends)]
        )
        for backend in order:
            for kind in KINDS:
                workers[backend].stdin.write(kind + "\n")
                workers[backend].stdin.flush()
                times[backend][kind].append(
                    json.loads(workers[backend].stdout.readline())
                )
    for process in workers.values():
        process.stdin.close()
        process.wait()
    report = {
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
        "network": "FashionMNIST CNN (examples/fashion_mnist.py), random data",
        "batch_size": args.batch_size,
        "steps_per_call": args.steps,
        "rounds": args.rounds,
        "ms_per_step": {},
    }
    for backend, by_kind in times.items():
        medians = {kind: statistics.median(values) for kind, values in by_kind.items()}
        report["ms_per_step"][backend] = {
            **{kind: round(value, 1) for kind, value in medians.items()},
            "duq_over_softmax": round(medians["duq"] / medians["softmax"], 2),
            "duq_penalty_over_softmax": round(
                medians["duq_penalty"] / medians["softmax"], 2
            ),
            "all": {
                kind: [round(v, 1) for v in values] for kind, values in by_kind.items()
            },
        }
        row = report["ms_per_step"][backend]
        print(
            f"{backend:>10}: softmax {row['softmax']:.1f}, DUQ {row['duq']:.1f} "
            f"({row['duq_over_softmax']}x), DUQ + penalty {row['duq_penalty']:.1f} "
            f"({row['duq_penalty_over_softmax']}x) ms/step"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""The DUQ head at many classes: size, training step, inference and memory.

For each number of classes and head (`per_class`, `shared`), a fresh process
builds a one-layer backbone (`Dense(features, relu)` on `features` inputs,
ResNet-50's width by default) with `keras_duq.wrap`'s defaults and the
head, trains a few steps with Adam and the gradient penalty on (the
default), and reports:

- `head_values`: the head's values (trainable and centroid state), and the
  ratio to a softmax head on the same features (`features * classes +
  classes`);
- `train_step_ms`: best of `--steps` training steps after two warm-up steps, and
  `softmax_train_step_ms`, the same for a softmax head on the same backbone in
  the same process (Adam, sparse categorical cross-entropy), and their ratio;
- `predict_ms`: best of `--steps` inference batches (`predict_on_batch`);
- `peak_rss_gb`: the process's peak resident memory after the DUQ steps
  (before the softmax model is built).

A per-class head larger than `--max-per-class-values` is not built (its
values and their float32 size are reported instead): at 1,000 classes on
2048 features it needs about 18 GB.

    python -m research.benchmarks.many_classes --output research/reproduction/results/benchmarks/many_classes.json
    python -m research.benchmarks.many_classes --classes 1000 --batch-size 128  # ImageNet shape
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

SIZES = (10, 100, 1000, 10000)
HEADS = ("per_class", "shared")


def measure(classes, head, features, batch_size, steps, centroid_dims):
    """One configuration, in this process: the dict of measurements."""
    import resource

    import keras
    import numpy as np

    import keras_duq

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size, features)).astype("float32")
    y = rng.integers(0, classes, size=batch_size)

    def backbone():
        return keras.Sequential(
            [keras.Input((features,)), keras.layers.Dense(features, activation="relu")]
        )

    def best_of(function):
        # Warm-up: tracing and compilation (TensorFlow's second call
        # still traces once more).
        function()
        function()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            function()
            times.append(time.perf_counter() - start)
        return 1000 * min(times)

    model = keras_duq.wrap(
        backbone(), num_classes=classes, head=head, centroid_dims=centroid_dims
    )
    model.compile(optimizer="adam")
    head_layer = model.duq_output
    record = {
        "classes": classes,
        "head": head_layer.resolved_head,
        "features": features,
        "centroid_dims": head_layer._resolved_centroid_dims,
        "batch_size": batch_size,
        "head_values": head_layer.count_params(),
        "softmax_head_values": features * classes + classes,
    }
    record["head_values_ratio"] = record["head_values"] / record["softmax_head_values"]
    record["train_step_ms"] = best_of(lambda: model.train_on_batch(x, y))
    record["predict_ms"] = best_of(lambda: model.predict_on_batch(x))
    record["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    inputs = keras.Input((features,))
    softmax = keras.Model(
        inputs, keras.layers.Dense(classes, activation="softmax")(backbone()(inputs))
    )
    softmax.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    record["softmax_train_step_ms"] = best_of(lambda: softmax.train_on_batch(x, y))
    record["softmax_predict_ms"] = best_of(lambda: softmax.predict_on_batch(x))
    record["train_step_ratio"] = (
        record["train_step_ms"] / record["softmax_train_step_ms"]
    )
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--heads", nargs="+", default=list(HEADS), choices=HEADS)
    parser.add_argument("--features", type=int, default=2048)
    parser.add_argument("--centroid-dims", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-per-class-values", type=float, default=2e8)
    parser.add_argument("--output", default=None, help="JSON file to write.")
    parser.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._one:  # a child process: one configuration
        classes, head = args._one.split(":")
        record = measure(
            int(classes),
            head,
            args.features,
            args.batch_size,
            args.steps,
            args.centroid_dims,
        )
        print(json.dumps(record), flush=True)
        return

    import keras

    records = []
    dims = args.centroid_dims or min(args.features, 256)
    for classes in args.classes:
        for head in args.heads:
            values = args.features * dims * classes
            if head == "per_class" and values > args.max_per_class_values:
                record = {
                    "classes": classes,
                    "head": head,
                    "features": args.features,
                    "not_built": f"{values:,} projection values "
                    f"({4 * values / 2**30:.1f} GiB of float32, before "
                    "gradients and optimizer state)",
                }
            else:
                command = [
                    sys.executable,
                    "-m",
                    "research.benchmarks.many_classes",
                    f"--_one={classes}:{head}",
                    f"--features={args.features}",
                    f"--batch-size={args.batch_size}",
                    f"--steps={args.steps}",
                ]
                if args.centroid_dims:
                    command.append(f"--centroid-dims={args.centroid_dims}")
                result = subprocess.run(
                    command,
                    capture_output=True,
                    text=True,
                    cwd=os.path.dirname(
                        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
                    ),
                )
                if result.returncode != 0:
                    record = {
                        "classes": classes,
                        "head": head,
                        "error": result.stderr.strip().splitlines()[-1:],
                    }
                else:
                    record = json.loads(result.stdout.strip().splitlines()[-1])
            print(json.dumps(record), flush=True)
            records.append(record)
    report = {
        "command": "python -m research.benchmarks.many_classes "
        + " ".join(argv or sys.argv[1:]),
        "backend": keras.backend.backend(),
        "keras": keras.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "records": records,
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

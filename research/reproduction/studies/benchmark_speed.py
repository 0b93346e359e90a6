"""Training and inference speed of DUQ against a softmax model, side by side.

The detailed TensorFlow study behind docs/reports/performance.md's tables (XLA,
bfloat16, a full epoch through `fit`, memory); `python -m research.benchmarks` is
the short, every-backend version.

    python -m research.reproduction.studies.benchmark_speed                 # everything, ~20 min on 2 cores
    python -m research.reproduction.studies.benchmark_speed --quick         # fewer windows, short epoch

Measures, in one run on one machine with the same data shapes:

- training step time and examples/s (median of timed windows after warm-up)
  for a softmax model, DUQ without the penalty and DUQ with the two-sided
  penalty, on the paper's FashionMNIST CNN (batch 128, from
  `research/reproduction/fashion_mnist.py`) and the two-moons MLP (batch 64, from
  `research/reproduction/two_moons.py`), each compiled as a TensorFlow graph and with XLA;
- inference time at batch 1 and batch 1000, softmax against DUQ;
- the CNN steps under `mixed_bfloat16`;
- one full epoch of real FashionMNIST through `model.fit` and the
  `tf.data` pipeline (`keras_duq.datasets.make_dataset`) against the sum of its steps
  (steps x the step time of the same `fit` on one batch held in memory,
  the faster of a run before and one after the epoch), with the batch
  times inside the epoch and the time outside them, and the peak resident
  memory of that training process (each model
  in a fresh process).

Prints absolute numbers and the ratios DUQ / softmax, and writes them as
JSON. Step times come from the model's own compiled train function (what
`fit` calls once per step), so no model pays Python overhead the others
do not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import keras_duq
from research.benchmarks.speed import median_seconds
from research.reproduction import fashion_mnist
from research.reproduction import two_moons

ROOT = Path(__file__).resolve().parents[3]
KINDS = ("softmax", "duq_no_penalty", "duq_penalty")


# Per task: backbone builder, input shape, classes, batch size, DUQ settings.
TASKS = {
    "fashion_mnist_cnn": dict(
        backbone=lambda: fashion_mnist.build_backbone(),
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
        backbone=lambda: two_moons.build_model(0.0).feature_extractor,
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


def build(kind, task, jit_compile=False):
    """A compiled softmax or DUQ model on the task's backbone."""
    settings = TASKS[task]
    backbone = settings["backbone"]()
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    if kind == "softmax":
        model = keras.Sequential(
            [
                backbone,
                keras.layers.Dense(settings["num_classes"], activation="softmax"),
            ]
        )
        model.compile(
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            jit_compile=jit_compile,
        )
        return model
    duq = dict(settings["duq"])
    if kind == "duq_no_penalty":
        duq["gradient_penalty"] = 0.0
    model = keras_duq.wrap(backbone, settings["num_classes"], **duq)
    model.compile(optimizer=optimizer, jit_compile=jit_compile)
    return model


def _batch(task, batch_size=None, seed=0):
    settings = TASKS[task]
    rng = np.random.default_rng(seed)
    batch_size = batch_size or settings["batch_size"]
    x = rng.normal(size=(batch_size,) + settings["input_shape"]).astype("float32")
    y = rng.integers(0, settings["num_classes"], size=batch_size).astype("int32")
    return x, y


def train_step(model, task):
    """A zero-argument callable running one training step on a batch in memory."""
    x, y = _batch(task)
    iterator = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
    model.make_train_function()

    def step():
        # Reading a value waits for the step to finish.
        logs = model.train_function(iterator)
        float(logs["loss"])

    return step


def step_seconds(model, task, windows):
    """Median time of one training step on a batch held in memory."""
    return median_seconds(
        train_step(model, task), warmup=3, windows=windows, calls_per_window=5
    )


def _peak_rss_mb():
    """Peak resident memory of this process image, in MB.

    Linux keeps `ru_maxrss` across `execve`, so an epoch run started by the
    full benchmark reported the parent's peak (the same 2051 MB for both
    models in one run). `VmHWM` starts afresh with the new image.
    """
    try:
        with open("/proc/self/status") as file:
            for line in file:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu():
    """The CPU's model name and bfloat16 instructions, from /proc/cpuinfo."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return {
        # `platform.processor()` is empty on many Linux machines.
        "processor": fields.get("model name") or platform.processor(),
        "bfloat16_instructions": sorted(flags & {"avx512_bf16", "amx_bf16"}),
    }


def machine():
    return {
        "platform": platform.platform(),
        **_cpu(),
        "cpus": os.cpu_count(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }


def train_benchmark(task, windows):
    results = {}
    for jit_compile, mode in ((False, "graph"), (True, "xla")):
        for kind in KINDS:
            keras.backend.clear_session()
            keras.utils.set_random_seed(0)
            model = build(kind, task, jit_compile)
            seconds = step_seconds(model, task, windows)
            results[f"{mode}/{kind}"] = {
                "step_s": seconds,
                "examples_per_s": TASKS[task]["batch_size"] / seconds,
            }
    return results


def inference_benchmark(task, windows):
    results = {}
    x, _ = _batch(task, batch_size=1000)
    for jit_compile, mode in ((False, "graph"), (True, "xla")):
        for kind in ("softmax", "duq_no_penalty"):
            keras.backend.clear_session()
            keras.utils.set_random_seed(0)
            model = build(kind, task, jit_compile)
            label = "duq" if kind != "softmax" else "softmax"
            for batch_size in (1, 1000):
                batch = x[:batch_size]
                results[f"{mode}/{label}/batch{batch_size}_s"] = median_seconds(
                    lambda model=model, batch=batch: model.predict_on_batch(batch),
                    warmup=3,
                    windows=windows,
                    calls_per_window=5 if batch_size == 1000 else 20,
                )
    return results


def bfloat16_benchmark(windows):
    results = {}
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        for kind in ("softmax", "duq_penalty"):
            keras.backend.clear_session()
            keras.utils.set_random_seed(0)
            model = build(kind, "fashion_mnist_cnn")
            results[f"mixed_bfloat16/{kind}"] = {
                "step_s": step_seconds(model, "fashion_mnist_cnn", windows)
            }
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return results


class _BatchTimes(keras.callbacks.Callback):
    """When each batch of `fit` began and ended (the wait for its data included)."""

    def on_train_begin(self, logs=None):
        self.begin, self.end = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.begin.append(time.perf_counter())

    def on_train_batch_end(self, batch, logs=None):
        self.end.append(time.perf_counter())

    @property
    def seconds(self):
        return [end - begin for begin, end in zip(self.begin, self.end)]


def _timed_fit(model, dataset, steps, callbacks=()):
    start = time.perf_counter()
    model.fit(
        dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=list(callbacks)
    )
    return time.perf_counter() - start


def epoch_run(kind, steps, warmup_windows, memory_steps=40):
    """One epoch of real FashionMNIST through `fit`; run in a fresh process.

    The sum of its steps is `steps` times the step time of the same `fit`
    on one real batch held in memory (the same compiled train function, the
    same input signature, no input pipeline), timed right before and right
    after the epoch; the faster of the two counts. Inside the epoch each
    batch's time (the wait for its data included) and the time outside the
    batches are recorded, to tell a slow input pipeline (slow batches) from
    time `fit` spends outside the batches (before, between, after them). The step time of the train
    function on a fixed-shape batch (`step_seconds`, as in the step
    benchmark) is reported beside it.
    """
    keras.utils.set_random_seed(0)
    (x_train, y_train), _ = keras_duq.datasets.load_fashion_mnist()
    x_train = keras_duq.datasets.normalize(x_train)
    y_train = y_train.astype("int32")
    batch_size = TASKS["fashion_mnist_cnn"]["batch_size"]
    model = build(kind, "fashion_mnist_cnn")
    fixed_shape_step = step_seconds(model, "fashion_mnist_cnn", warmup_windows)
    dataset = keras_duq.datasets.make_dataset(
        x_train, y_train, batch_size=batch_size, shuffle=True, seed=0, repeat=True
    )
    # The same pipeline over one batch: the same element spec (batch
    # dimension unknown), so `fit` runs the same traced function.
    memory = keras_duq.datasets.make_dataset(
        x_train[:batch_size], y_train[:batch_size], batch_size=batch_size, repeat=True
    )
    full_epoch = -(-len(x_train) // batch_size)
    steps = min(steps or full_epoch, full_epoch)
    memory_steps = min(memory_steps, steps)
    # Trace `fit`'s own train function before timing.
    model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
    model.fit(memory, epochs=1, steps_per_epoch=2, verbose=0)
    before = _timed_fit(model, memory, memory_steps) / memory_steps
    batch_times = _BatchTimes()
    fit_start = time.perf_counter()
    epoch = _timed_fit(model, dataset, steps, [batch_times])
    after = _timed_fit(model, memory, memory_steps) / memory_steps
    # The faster of the two is the steady step time and makes the epoch's
    # ratio the stricter one. (Before `make_dataset` turned tf.data's
    # autotuning off, one of the two often stalled for seconds at its end.)
    step = min(before, after)
    batch_seconds = batch_times.seconds
    median_batch = statistics.median(batch_seconds)
    return {
        "steps": steps,
        "epoch_s": epoch,
        "fit_memory_step_s": step,
        "fit_memory_step_before_after_s": [before, after],
        "sum_of_steps_s": steps * step,
        "epoch_over_sum_of_steps": epoch / (steps * step),
        "median_batch_in_epoch_s": median_batch,
        "sum_of_batches_in_epoch_s": sum(batch_seconds),
        # A tail of slow batches (a stall, or this shared machine slowing
        # down) shows as a sum of batch times well above steps x the median.
        "batches_over_twice_the_median": sum(
            t > 2 * median_batch for t in batch_seconds
        ),
        "slowest_batches_in_epoch_s": sorted(batch_seconds)[-5:],
        # The rest of the epoch: `fit`'s set-up before the first batch, the
        # loop between batches, and the tear-down after the last.
        "before_first_batch_s": batch_times.begin[0] - fit_start,
        "between_batches_s": sum(
            begin - end for begin, end in zip(batch_times.begin[1:], batch_times.end)
        ),
        "after_last_batch_s": fit_start + epoch - batch_times.end[-1],
        "first_batch_in_epoch_s": batch_seconds[0],
        "fixed_shape_step_s": fixed_shape_step,
        "epoch_over_sum_of_fixed_shape_steps": epoch / (steps * fixed_shape_step),
        "peak_rss_mb": _peak_rss_mb(),
    }


def epoch_benchmark(steps, windows):
    results = {}
    for kind in ("softmax", "duq_penalty"):
        output = subprocess.run(
            [
                sys.executable,
                "-m",
                "research.reproduction.studies.benchmark_speed",
                "--epoch-run",
                kind,
                "--epoch-steps",
                str(steps or 0),
                "--windows",
                str(windows),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        ).stdout
        results[kind] = json.loads(output.strip().splitlines()[-1])
    return results


def ratios(report):
    out = {}
    for task in TASKS:
        train = report["train"][task]
        for mode in ("graph", "xla"):
            softmax = train[f"{mode}/softmax"]["step_s"]
            for kind in KINDS[1:]:
                out[f"{task}/train/{mode}/{kind}"] = (
                    train[f"{mode}/{kind}"]["step_s"] / softmax
                )
        best_softmax = min(train[f"{m}/softmax"]["step_s"] for m in ("graph", "xla"))
        for kind in KINDS[1:]:
            best = min(train[f"{m}/{kind}"]["step_s"] for m in ("graph", "xla"))
            out[f"{task}/train/best_mode/{kind}"] = best / best_softmax
        infer = report["inference"][task]
        for mode in ("graph", "xla"):
            for batch_size in (1, 1000):
                out[f"{task}/inference/{mode}/batch{batch_size}"] = (
                    infer[f"{mode}/duq/batch{batch_size}_s"]
                    / infer[f"{mode}/softmax/batch{batch_size}_s"]
                )
    if "bfloat16" in report:
        bf16 = report["bfloat16"]
        out["fashion_mnist_cnn/train/mixed_bfloat16/duq_penalty"] = (
            bf16["mixed_bfloat16/duq_penalty"]["step_s"]
            / bf16["mixed_bfloat16/softmax"]["step_s"]
        )
        graph = report["train"]["fashion_mnist_cnn"]
        for kind in ("softmax", "duq_penalty"):
            out[f"fashion_mnist_cnn/bfloat16_over_float32/{kind}"] = (
                bf16[f"mixed_bfloat16/{kind}"]["step_s"]
                / graph[f"graph/{kind}"]["step_s"]
            )
    if "epoch" in report:
        epoch = report["epoch"]
        for kind, values in epoch.items():
            out[f"fashion_mnist_cnn/epoch_over_sum_of_steps/{kind}"] = values[
                "epoch_over_sum_of_steps"
            ]
        out["fashion_mnist_cnn/peak_rss/duq_penalty"] = (
            epoch["duq_penalty"]["peak_rss_mb"] / epoch["softmax"]["peak_rss_mb"]
        )
    return out


def print_report(report):
    for task in TASKS:
        print(f"\n{task} (batch {TASKS[task]['batch_size']}): training step")
        for name, values in report["train"][task].items():
            print(
                f"  {name:28s} {values['step_s'] * 1000:10.2f} ms"
                f" {values['examples_per_s']:12.0f} examples/s"
            )
        print(f"{task}: inference")
        for name, seconds in report["inference"][task].items():
            print(f"  {name:28s} {seconds * 1000:10.3f} ms")
    for name, values in report.get("bfloat16", {}).items():
        print(f"  {name:40s} {values['step_s'] * 1000:10.2f} ms")
    for kind, values in report.get("epoch", {}).items():
        print(
            f"  full epoch {kind:14s} {values['epoch_s']:8.1f} s for {values['steps']}"
            f" steps; sum of steps {values['sum_of_steps_s']:8.1f} s"
            f" (in-memory step {values['fit_memory_step_s'] * 1000:.0f} ms, the faster of before/after:"
            f" {values['fit_memory_step_before_after_s'][0] * 1000:.0f}/"
            f"{values['fit_memory_step_before_after_s'][1] * 1000:.0f} ms; median batch in"
            f" the epoch {values['median_batch_in_epoch_s'] * 1000:.0f} ms; after the last"
            f" batch {values['after_last_batch_s']:.1f} s; first batch"
            f" {values['first_batch_in_epoch_s']:.2f} s; fixed-shape step"
            f" {values['fixed_shape_step_s'] * 1000:.0f} ms);"
            f" peak RSS {values['peak_rss_mb']:7.0f} MB"
        )
    print("\nratios (DUQ / softmax unless named otherwise)")
    for name, value in report["ratios"].items():
        print(f"  {name:60s} {value:6.2f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output", default="research/reproduction/results/benchmark_speed.json"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 timing windows instead of 7 and a 60-step epoch.",
    )
    parser.add_argument("--windows", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--epoch-steps",
        type=int,
        default=None,
        help="Steps of the fit-vs-steps epoch (default: a full epoch, 469).",
    )
    parser.add_argument("--skip-epoch", action="store_true")
    parser.add_argument("--skip-bfloat16", action="store_true")
    parser.add_argument(
        "--epoch-run", choices=("softmax", "duq_penalty"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    windows = args.windows or (3 if args.quick else 7)
    if args.epoch_run:
        print(json.dumps(epoch_run(args.epoch_run, args.epoch_steps, windows)))
        return None
    epoch_steps = args.epoch_steps or (60 if args.quick else None)
    report = {
        "machine": machine(),
        "train": {task: train_benchmark(task, windows) for task in TASKS},
        "inference": {task: inference_benchmark(task, windows) for task in TASKS},
    }
    if not args.skip_bfloat16:
        report["bfloat16"] = bfloat16_benchmark(max(3, windows // 2))
    if not args.skip_epoch:
        report["epoch"] = epoch_benchmark(epoch_steps, windows)
    report["ratios"] = ratios(report)
    print_report(report)
    with open(args.output, "w") as file:
        json.dump(report, file, indent=2)
    print(f"\nwrote {args.output}")
    return report


if __name__ == "__main__":
    main()

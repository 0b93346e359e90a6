"""Training step time of the paper's CIFAR-10 ResNet-18: softmax against DUQ.

    python -m research.reproduction.studies.cifar10_speed          # batch 128: the real measurement
    python -m research.reproduction.studies.cifar10_speed --steps 2 --warmup 1 --batch-size 8 \\
        --output /tmp/cifar10_speed.json                  # check that it runs

Times, side by side in one process on random data, `model.fit` steps of:

- `softmax`: the ResNet-18 with a softmax layer;
- `duq`: DUQ without the gradient penalty (lambda 0);
- `duq_penalty`: DUQ with the two-sided penalty (lambda 0.5, the paper's);

all built by `research/reproduction/cifar10.py` (the `--recipe` given, default the
paper's text), so the benchmark times exactly the example's models. A
callback times each step from `on_train_batch_begin` to
`on_train_batch_end` (the step's loss read back, so the step has finished);
the first `--warmup` steps (tracing, first-run allocations) are left out and
the median of the next `--steps` is reported. With `--rounds R` the models
take turns R times, `--steps` timed steps each turn, so that a machine whose
speed drifts slows all of them alike.

Prints a table with the ratios to softmax beside the reference numbers
(PyTorch on an NVIDIA H200, the paper's 1080 Ti epochs) and writes it all,
with the CPU model, the core count and the TensorFlow and Keras versions, as
JSON (`--output`, default `research/reproduction/results/cifar10_speed.json`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import keras_duq

ROOT = Path(__file__).resolve().parents[3]
KINDS = ("softmax", "duq", "duq_penalty")
NUM_CLASSES = 10

# Measured elsewhere, not by this script: shown beside its numbers, labelled.
REFERENCE = {
    "pytorch_h200_step_ms": {
        "source": "PyTorch reference timings of the paper code's training step on "
        "an NVIDIA H200 (not measured by this script)",
        "float32": {"softmax": 17.9, "duq": 23.5, "duq_penalty": 111.4},
        "bfloat16": {"softmax": 10.1, "duq": 16.5, "duq_penalty": 50.0},
    },
    "paper_1080ti_epoch_s": {
        "source": "the paper, Section 5.2: one epoch on an NVIDIA 1080 Ti",
        "seconds": {"softmax": 21, "duq": 27, "duq_penalty": 103},
    },
}


def _load_example():
    return importlib.import_module("research.reproduction.cifar10")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="Steps left out at the start of each model's first turn.",
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="Timed steps per model and turn."
    )
    parser.add_argument("--rounds", type=int, default=1, help="Turns per model.")
    parser.add_argument(
        "--models",
        default=",".join(KINDS),
        help=f"Comma-separated subset of {','.join(KINDS)}.",
    )
    parser.add_argument(
        "--gradient-penalty",
        type=float,
        default=0.5,
        help="lambda of `duq_penalty` (the paper's CIFAR-10 value).",
    )
    parser.add_argument(
        "--recipe",
        default="paper",
        help="`--recipe` of research/reproduction/cifar10.py.",
    )
    parser.add_argument(
        "--mixed-precision",
        default="none",
        choices=("none", "mixed_float16", "mixed_bfloat16"),
    )
    parser.add_argument(
        "--jit-compile",
        choices=("auto", "true", "false"),
        default="auto",
        help="As in research/reproduction/cifar10.py (auto: no XLA on CPUs).",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output",
        default=str(ROOT / "research" / "benchmarks" / "cifar10_speed.json"),
        help="Where to write the JSON.",
    )
    args = parser.parse_args(argv)
    for name in ("batch_size", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be >= 1. Received: "
                f"{getattr(args, name)}"
            )
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0. Received: {args.warmup}")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(KINDS))
    if unknown or not args.models:
        parser.error(f"--models takes names from {KINDS}. Received: {args.models}")
    return args


class StepTimer(keras.callbacks.Callback):
    """Seconds of each training step, from batch begin to batch end."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # Reading the loss waits for the step to finish, wherever it runs.
        np.asarray((logs or {}).get("loss", 0.0))
        self.seconds.append(time.perf_counter() - self._start)


def build(example, kind, args):
    """The example's compiled model for `kind`."""
    argv = [
        "--recipe",
        args.recipe,
        "--batch-size",
        str(args.batch_size),
        "--mixed-precision",
        args.mixed_precision,
        "--jit-compile",
        args.jit_compile,
    ]
    if kind == "softmax":
        argv += ["--model", "softmax"]
    else:
        penalty = 0.0 if kind == "duq" else args.gradient_penalty
        argv += ["--model", "duq", "--gradient-penalty", str(penalty)]
    model_args = example.parse_args(argv)
    # A long epoch keeps the learning rate constant over the timed steps.
    return example.build_model(model_args, steps_per_epoch=10**6, seed=args.seed)


def random_batches(batch_size, seed):
    """One random, normalised-looking batch, repeated forever."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(batch_size, 32, 32, 3)).astype("float32")
    labels = rng.integers(0, NUM_CLASSES, size=batch_size).astype("int32")
    return tf.data.Dataset.from_tensors((images, labels)).repeat()


def time_steps(model, data, num_steps):
    timer = StepTimer()
    model.fit(
        data,
        epochs=1,
        steps_per_epoch=num_steps,
        callbacks=[timer],
        verbose=0,
        shuffle=False,
    )
    return timer.seconds


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> dict:
    args = parse_args(argv)
    example = _load_example()
    previous_policy = keras.mixed_precision.global_policy()
    data = random_batches(args.batch_size, args.seed)
    try:
        models = {kind: build(example, kind, args) for kind in args.models}
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)
    timed = {kind: [] for kind in args.models}
    warmup = {}
    for round_index in range(args.rounds):
        for kind, model in models.items():
            skip = args.warmup if round_index == 0 else 0
            seconds = time_steps(model, data, skip + args.steps)
            if round_index == 0:
                warmup[kind] = seconds[:skip]
            timed[kind] += seconds[skip:]
            print(
                f"round {round_index + 1}/{args.rounds} {kind}: "
                f"{1000 * statistics.median(seconds[skip:]):.1f} ms/step",
                flush=True,
            )

    results = {}
    for kind in args.models:
        results[kind] = {
            "median_step_ms": 1000 * statistics.median(timed[kind]),
            "step_ms": [1000 * s for s in timed[kind]],
            "warmup_step_ms": [1000 * s for s in warmup[kind]],
            "examples_per_s": args.batch_size / statistics.median(timed[kind]),
        }
    if "softmax" in results:
        base = results["softmax"]["median_step_ms"]
        for entry in results.values():
            entry["ratio_to_softmax"] = entry["median_step_ms"] / base
    report = {
        "benchmark": "research/reproduction/cifar10.py ResNet-18, model.fit on random data",
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": [d.name for d in tf.config.list_physical_devices("GPU")],
        "versions": {
            "python": platform.python_version(),
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "keras_duq": keras_duq.__version__,
        },
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "results": results,
        "reference": REFERENCE,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as file:
        json.dump(report, file, indent=2)
    print_table(report)
    print(f"-> {args.output}")
    return report


def print_table(report):
    settings = report["settings"]
    pytorch = REFERENCE["pytorch_h200_step_ms"]
    paper = REFERENCE["paper_1080ti_epoch_s"]["seconds"]
    print(
        f"\n{report['cpu']} ({report['cpu_count']} cores), TF "
        f"{report['versions']['tensorflow']}, Keras {report['versions']['keras']}, "
        f"batch {settings['batch_size']}, {settings['mixed_precision']}, "
        f"median of {settings['steps'] * settings['rounds']} steps"
    )
    header = (
        f"{'model':<13}{'this run ms/step':>18}{'x softmax':>11}"
        f"{'PyTorch H200 fp32':>19}{'bf16':>7}{'paper 1080Ti s/epoch':>22}"
    )
    print(header)
    print("-" * len(header))
    for kind, entry in report["results"].items():
        ratio = entry.get("ratio_to_softmax")
        print(
            f"{kind:<13}{entry['median_step_ms']:>18.1f}"
            f"{'' if ratio is None else f'{ratio:.2f}x':>11}"
            f"{pytorch['float32'][kind]:>19.1f}{pytorch['bfloat16'][kind]:>7.1f}"
            f"{paper[kind]:>22}"
        )
    print(
        "(PyTorch and paper columns: reference numbers for the paper code "
        "and from the paper, not measured by this script.)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])

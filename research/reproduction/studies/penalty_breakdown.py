"""Where the gradient penalty's step time goes, on the FashionMNIST CNN.

    python -m research.reproduction.studies.penalty_breakdown            # ~4 min on 2 cores
    python -m research.reproduction.studies.penalty_breakdown --rounds 3 # shorter

Times, side by side in one process (graph mode, batch 128, each model's own
compiled train function on a batch held in memory), in interleaved rounds so
that a drift of the machine's speed hits every model alike:

- softmax, DUQ without the penalty and DUQ with the two-sided penalty on the
  paper's CNN;
- the same three on the CNN with its BatchNormalization layers removed: an
  upper bound on what any faster BatchNormalization (first or second
  derivative) could save;
- the backbone's forward pass in inference mode, the pass that the centroid
  update runs after the optimizer step, with and without BatchNormalization:
  what remains without it is the convolutions' share, a floor for DUQ
  without the penalty however the BatchNormalization were computed.

Prints the median step times and their ratios to the softmax step of the
same backbone and of the paper's CNN, and writes them as JSON
(`research/reproduction/results/penalty_breakdown.json`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import keras
import tensorflow as tf

from research.reproduction.studies import benchmark_speed as speed

ROOT = Path(__file__).resolve().parents[3]
TASK = "fashion_mnist_cnn"


def _without_batch_normalization():
    backbone = speed.fashion_mnist.build_backbone()
    return keras.Sequential(
        [keras.Input(speed.TASKS[TASK]["input_shape"])]
        + [
            layer
            for layer in backbone.layers
            if not isinstance(layer, keras.layers.BatchNormalization)
        ]
    )


@contextlib.contextmanager
def _backbone(batch_norm):
    """Within it, `speed.build` uses the CNN with or without BatchNormalization."""
    original = speed.TASKS[TASK]["backbone"]
    if not batch_norm:
        speed.TASKS[TASK]["backbone"] = _without_batch_normalization
    try:
        yield
    finally:
        speed.TASKS[TASK]["backbone"] = original


def _steppers(batch_norm):
    """`{name: zero-argument callable running one step}` for the three models."""
    steppers = {}
    with _backbone(batch_norm):
        for kind in speed.KINDS:
            keras.utils.set_random_seed(0)
            steppers[kind] = speed.train_step(speed.build(kind, TASK), TASK)
    return steppers


def _inference_forward(batch_norm):
    with _backbone(batch_norm):
        keras.utils.set_random_seed(0)
        model = speed.build("duq_penalty", TASK)
    x, _ = speed._batch(TASK)
    x = tf.constant(x)
    forward = tf.function(lambda x: model.feature_extractor(x, training=False))

    def step():
        forward(x).numpy()

    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5, help="Steps per timed window.")
    parser.add_argument(
        "--output",
        default=str(ROOT / "research" / "benchmarks" / "penalty_breakdown.json"),
    )
    args = parser.parse_args(argv)

    steppers = {f"with_batchnorm/{k}": v for k, v in _steppers(True).items()}
    steppers.update({f"without_batchnorm/{k}": v for k, v in _steppers(False).items()})
    steppers["with_batchnorm/inference_forward"] = _inference_forward(True)
    steppers["without_batchnorm/inference_forward"] = _inference_forward(False)
    for step in steppers.values():  # trace and warm up
        for _ in range(3):
            step()
    times = {name: [] for name in steppers}
    for _ in range(args.rounds):
        for name, step in steppers.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                step()
            times[name].append((time.perf_counter() - start) / args.calls)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratios = {}
    for variant in ("with_batchnorm", "without_batchnorm"):
        softmax = medians[f"{variant}/softmax"]
        for name, value in medians.items():
            if name.startswith(variant + "/"):
                ratios[name] = value / softmax
    # The question for DUQ's step: how much do these parts add to the
    # softmax step of the paper's CNN (with BatchNormalization)?
    paper_softmax = medians["with_batchnorm/softmax"]
    paper_ratios = {name: value / paper_softmax for name, value in medians.items()}
    print(
        f"{'part':42s} {'median ms':>10s} {'/ softmax':>10s} {'/ CNN softmax':>14s}"
        "   (rounds: ms)"
    )
    for name, value in medians.items():
        rounds = " ".join(f"{t * 1000:.0f}" for t in times[name])
        print(
            f"{name:42s} {value * 1000:10.1f} {ratios[name]:9.2f}x "
            f"{paper_ratios[name]:13.2f}x   ({rounds})"
        )
    report = {
        "machine": speed.machine(),
        "rounds": args.rounds,
        "calls_per_round": args.calls,
        "median_step_s": medians,
        "round_step_s": times,
        "ratio_to_softmax_of_same_backbone": ratios,
        "ratio_to_softmax_with_batchnorm": paper_ratios,
    }
    with open(args.output, "w") as file:
        json.dump(report, file, indent=2)
    print(f"wrote {args.output}")
    return report


if __name__ == "__main__":
    main()

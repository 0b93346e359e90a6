"""`keras_duq.tuning.search` on FashionMNIST, beside the paper's values.

For each seed: 5000 random training images are held out as validation data
(the paper's split); the search chooses the length scale and the gradient
penalty on them with the paper's CNN, head and optimizer (SGD 0.05,
momentum 0.9, batch 128), 5 epochs per trial; then research/reproduction/fashion_mnist.py
trains with the chosen values on the other 55,000 images (30 epochs, the
paper's schedule) and reports test accuracy and AUROC against MNIST's test
set. The paper's values: length scale 0.1, penalty 0.05. Writes
research/reproduction/results/benchmarks/tuning_fashion_mnist.json.

    KERAS_HOME=../shared/data/keras python -m research.benchmarks.tuning_fashion_mnist \\
        --mnist-path ../shared/data/mnist
    # smoke run (minutes)
    python -m research.benchmarks.tuning_fashion_mnist --mnist-path ../shared/data/mnist \\
        --seeds 0 --train-subset 1000 --test-subset 500 --epochs-per-trial 1 \\
        --final-epochs 1 --max-trials 2 --output /tmp/tuning_smoke.json

`--recipe quickstart` runs the same search on the README quickstart's setup
instead, a budget a CPU can afford: its backbone (conv, pooling, dropout,
dense), Adam at its default rate, batch 128 and the library's defaults for
every other `wrap` argument (`--projection-learning-rate` sets that one),
on the same 55,000 / 5000 split. Then it trains
the quickstart's model for `--final-epochs` epochs (default 10) three times:
with the search's choice, with `wrap`'s default length scale and penalty,
and with the paper's (0.1, 0.05); it records test accuracy and AUROC
against MNIST after every epoch. It writes
research/reproduction/results/benchmarks/tuning_fashion_mnist_quickstart.json.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import time
from pathlib import Path

import keras

import keras_duq

ROOT = Path(__file__).resolve().parents[2]
from research.benchmarks import RESULTS  # noqa: E402
from research.benchmarks import own_model_defaults  # noqa: E402
from research.reproduction import fashion_mnist  # noqa: E402

PAPER = {"length_scale": 0.1, "gradient_penalty": 0.05}
# Read from the head and the model, so that the comparison follows the
# library's defaults.
LIBRARY_DEFAULTS = {
    "length_scale": inspect.signature(keras_duq.DUQOutput)
    .parameters["length_scale"]
    .default,
    "gradient_penalty": inspect.signature(keras_duq.DUQModel)
    .parameters["gradient_penalty"]
    .default,
}
NUM_VALIDATION = 5000
QUICKSTART_BATCH_SIZE = 128


def example_arguments(seed, args):
    """research/reproduction/fashion_mnist.py's flags for this seed's data split."""
    example_args = ["--seed", str(seed), "--validation-split", str(NUM_VALIDATION)]
    for flag in ("train_subset", "test_subset", "mnist_path", "fashion_mnist_path"):
        value = getattr(args, flag)
        if value is not None:
            example_args += [f"--{flag.replace('_', '-')}", str(value)]
    return example_args


def run_seed(seed, args):
    example_args = example_arguments(seed, args)
    example = fashion_mnist.parse_args(example_args)
    train, validation, _, _ = fashion_mnist.load_data(example)
    steps_per_epoch = math.ceil(len(train[0]) / example.batch_size)
    start = time.perf_counter()
    result = keras_duq.tuning.search(
        fashion_mnist.build_backbone,
        *train,
        validation_data=validation,
        num_classes=fashion_mnist.NUM_CLASSES,
        epochs=args.epochs_per_trial,
        batch_size=example.batch_size,
        # The paper's schedule, constant over the first 10 epochs.
        optimizer=lambda: fashion_mnist.make_optimizer(
            steps_per_epoch, args.epochs_per_trial
        ),
        max_trials=args.max_trials,
        seed=seed,
        centroid_dims=256,
        momentum=0.999,
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.05),
        weight_decay=fashion_mnist.WEIGHT_DECAY,
        projection_learning_rate=1.0,
        categorical_cross_entropy_weight=0.0,
    )
    search_seconds = time.perf_counter() - start
    print(result.summary())
    final = fashion_mnist.main(
        example_args
        + [
            "--epochs",
            str(args.final_epochs),
            "--length-scale",
            str(result.best["length_scale"]),
            "--gradient-penalty",
            str(result.best["gradient_penalty"]),
            "--output-dir",
            os.path.join(args.output_dir, f"seed{seed}"),
            "--ood-eval-every",
            "0",
            "--verbose",
            "0",
        ]
    )
    return {
        "seed": seed,
        "search_seconds": round(search_seconds, 1),
        "best": result.best,
        "trials": result.trials,
        "chosen_values": {
            key: final[key]
            for key in (
                "accuracy",
                "auroc",
                "validation_accuracy",
                "validation_misclassification_auroc",
                "train_time_s",
            )
        },
    }


def run_quickstart_seed(seed, args):
    """The search and three final trainings on the README quickstart's setup."""
    example = fashion_mnist.parse_args(example_arguments(seed, args))
    train, validation, test, x_ood = fashion_mnist.load_data(example)
    start = time.perf_counter()
    result = keras_duq.tuning.search(
        own_model_defaults.dropout_backbone,
        *train,
        validation_data=validation,
        num_classes=fashion_mnist.NUM_CLASSES,
        epochs=args.epochs_per_trial,
        batch_size=QUICKSTART_BATCH_SIZE,
        optimizer=keras.optimizers.Adam,
        max_trials=args.max_trials,
        seed=seed,
        **quickstart_wrap(args),
    )
    search_seconds = time.perf_counter() - start
    print(result.summary(), flush=True)
    candidates = {
        "chosen": result.best,
        "library_defaults": LIBRARY_DEFAULTS,
        "paper": PAPER,
    }
    finals = {}
    for name, values in candidates.items():
        same = [other for other in finals if candidates[other] == values]
        if same:  # The same values train the same model: reuse its numbers.
            finals[name] = {"same_as": same[0]}
            continue
        keras.utils.set_random_seed(seed)
        model = keras_duq.wrap(
            own_model_defaults.dropout_backbone(),
            fashion_mnist.NUM_CLASSES,
            **values,
            **quickstart_wrap(args),
        )
        model.compile(optimizer=keras.optimizers.Adam())
        metrics = own_model_defaults.EpochMetrics(*test, x_ood, "duq")
        model.fit(
            *train,
            batch_size=QUICKSTART_BATCH_SIZE,
            epochs=args.final_epochs,
            callbacks=[metrics],
            verbose=0,
        )
        finals[name] = {"values": values, "epochs": metrics.rows}
    return {
        "seed": seed,
        "search_seconds": round(search_seconds, 1),
        "best": result.best,
        "trials": result.trials,
        "final": finals,
    }


def quickstart_wrap(args):
    """`wrap` arguments the quickstart recipe sets: none unless given."""
    given = {
        "projection_learning_rate": args.projection_learning_rate,
        "categorical_cross_entropy_weight": args.categorical_cross_entropy_weight,
    }
    return {name: value for name, value in given.items() if value is not None}


def summarize(paths, at_epochs=(1, 3, 10)):
    """Markdown tables of `--recipe quickstart` results, seeds side by side.

    The first table has every trial (validation accuracy and
    misclassification AUROC per seed; `*` marks each seed's choice); the
    second, for each set of final values, the mean test accuracy, each
    seed's AUROC against MNIST and its mean after each epoch in `at_epochs`.
    """
    runs = sorted(
        (run for path in paths for run in json.loads(Path(path).read_text())["runs"]),
        key=lambda run: run["seed"],
    )
    seeds = [run["seed"] for run in runs]
    trials = {}
    for run in runs:
        for trial in run["trials"]:
            key = (trial["stage"], trial["length_scale"], trial["gradient_penalty"])
            chosen = run["best"] == {"length_scale": key[1], "gradient_penalty": key[2]}
            cell = "diverged"
            if not trial["diverged"]:
                cell = (
                    f"{trial['val_accuracy']:.4f} / "
                    f"{trial['val_misclassification_auroc']:.4f}"
                )
            trials.setdefault(key, {})[run["seed"]] = cell + (" *" if chosen else "")
    lines = [
        "| stage | length scale | penalty |"
        + "".join(f" seed {seed}: val accuracy / AUROC |" for seed in seeds),
        "|" + "---|" * (3 + len(seeds)),
    ]
    for (stage, length_scale, penalty), cells in sorted(trials.items()):
        lines.append(
            f"| {stage} | {length_scale:g} | {penalty:g} |"
            + "".join(f" {cells[seed]} |" if seed in cells else " |" for seed in seeds)
        )
    header = "| values | length scale / penalty per seed |"
    for epoch in at_epochs:
        header += f" epoch {epoch}: accuracy | AUROC per seed | AUROC mean |"
    lines += ["", header, "|" + "---|" * (2 + 3 * len(at_epochs))]
    for name in ("chosen", "library_defaults", "paper"):
        finals = []
        for run in runs:
            final = run["final"][name]
            finals.append(run["final"][final.get("same_as", name)])
        values = ", ".join(
            f"{final['values']['length_scale']:g} / "
            f"{final['values']['gradient_penalty']:g}"
            for final in finals
        )
        row = f"| {name.replace('_', ' ')} | {values} |"
        for epoch in at_epochs:
            rows = [
                m for final in finals for m in final["epochs"] if m["epoch"] == epoch
            ]
            row += own_model_defaults.epoch_cells(rows)
        lines.append(row)
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--recipe",
        choices=("paper", "quickstart"),
        default="paper",
        help="The paper's CNN, optimizer and head, or the README quickstart's.",
    )
    parser.add_argument(
        "--summarize",
        nargs="+",
        metavar="JSON",
        help="Print Markdown tables of these `--recipe quickstart` results and exit.",
    )
    parser.add_argument("--at-epochs", type=int, nargs="+", default=[1, 3, 10])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs-per-trial", type=int, default=5)
    parser.add_argument(
        "--final-epochs",
        type=int,
        default=None,
        help="Epochs of the final training (default: 30 paper, 10 quickstart).",
    )
    parser.add_argument("--max-trials", type=int, default=None)
    parser.add_argument(
        "--projection-learning-rate",
        type=float,
        default=None,
        help="`--recipe quickstart`: `wrap`'s projection_learning_rate "
        "(default: the library's).",
    )
    parser.add_argument(
        "--categorical-cross-entropy-weight",
        type=float,
        default=None,
        help="`--recipe quickstart`: `wrap`'s categorical_cross_entropy_weight "
        "(default: the library's; 0 is the paper's loss).",
    )
    parser.add_argument("--train-subset", type=int, default=None)
    parser.add_argument("--test-subset", type=int, default=None)
    parser.add_argument("--mnist-path", default=None)
    parser.add_argument("--fashion-mnist-path", default=None)
    parser.add_argument("--output-dir", default="outputs/tuning_fashion_mnist")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize, args.at_epochs))
        return
    quickstart = args.recipe == "quickstart"
    if args.final_epochs is None:
        args.final_epochs = 10 if quickstart else 30
    if args.output is None:
        name = "tuning_fashion_mnist" + ("_quickstart" if quickstart else "")
        args.output = str(RESULTS / f"{name}.json")
    run = run_quickstart_seed if quickstart else run_seed
    runs = []
    for seed in args.seeds:
        runs.append(run(seed, args))
        # Written after every seed, so a long run that stops keeps its seeds.
        write_report(args, runs)


def write_report(args, runs):
    report = {
        "description": __doc__.splitlines()[0],
        "settings": vars(args),
        "num_validation": NUM_VALIDATION,
        "paper": PAPER,
        "library_defaults": LIBRARY_DEFAULTS,
        "versions": {
            "backend": keras.backend.backend(),
            "keras": keras.__version__,
            "keras_duq": keras_duq.__version__,
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
        "runs": runs,
    }
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

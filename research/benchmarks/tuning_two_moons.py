"""`keras_duq.tuning.search` on two moons, against the demo's bar.

For each seed: the search chooses the length scale and the gradient penalty
on a separate draw of 500 two-moons validation points (in-distribution
only), with the demo's backbone (or the paper's MLP), head and optimizer and 10 epochs per trial
(the demo trains 30). Then a fresh model is trained with the chosen values
exactly as the demo trains (30 epochs) and checked against the demo's bar
(test accuracy >= 0.98, mean certainty on far points <= 0.05, AUROC test vs
far >= 0.99), beside the demo itself with the paper's values (length scale
0.3, penalty 1.0). Writes research/reproduction/results/benchmarks/tuning_two_moons.json.

    python -m research.benchmarks.tuning_two_moons                     # seeds 0 1 2
    python -m research.benchmarks.tuning_two_moons --backbone paper    # the paper's MLP
    python -m research.benchmarks.tuning_two_moons --seeds 0 --epochs-per-trial 5
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import keras
import numpy as np
import sklearn
from sklearn.datasets import make_moons

import keras_duq

ROOT = Path(__file__).resolve().parents[2]
from research.benchmarks import RESULTS  # noqa: E402
from research.reproduction import two_moons  # noqa: E402

PAPER = {"length_scale": 0.3, "gradient_penalty": 1.0}


def demo_wrap():
    """The demo's `wrap` arguments other than the two searched (see
    `two_moons.build_model`), held fixed during the search and the final
    run. Made after the seed is set: the initializer draws its seed then."""
    return dict(
        centroid_dims=10,
        momentum=0.99,
        kernel_initializer=keras.initializers.RandomNormal(stddev=1.0),
        weight_decay=1e-4,
        projection_learning_rate=1.0,
        categorical_cross_entropy_weight=0.0,
    )


NUM_VALIDATION = 500


def demo_optimizer():
    return keras.optimizers.SGD(0.01, momentum=0.9)


def train_and_check(seed, best, backbone, epochs=30):
    """The demo's training and metrics, with the chosen values."""
    keras.utils.set_random_seed(seed)
    (x_train, y_train), (x_test, y_test), x_far = two_moons.make_data(seed)
    model = keras_duq.wrap(
        two_moons.build_backbone(backbone), num_classes=2, **demo_wrap(), **best
    )
    model.compile(optimizer=demo_optimizer())
    model.fit(x_train, y_train, batch_size=64, epochs=epochs, verbose=0)
    test_kernels = model.predict(x_test, batch_size=1000, verbose=0)
    far_certainty = model.predict(x_far, batch_size=1000, verbose=0).max(axis=1)
    test_certainty = test_kernels.max(axis=1)
    results = {
        "test_accuracy": float((test_kernels.argmax(axis=1) == y_test).mean()),
        "far_certainty_mean": float(far_certainty.mean()),
        "auroc_test_vs_far": keras_duq.evaluation.ood_metrics(
            test_certainty, far_certainty
        )["auroc"],
    }
    results["meets_bar"] = bool(two_moons.meets_bar(results))
    return results


def resident_megabytes():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def run_seed(seed, epochs_per_trial, backbone):
    (x_train, y_train), _, _ = two_moons.make_data(seed)
    x_val, y_val = make_moons(NUM_VALIDATION, noise=0.1, random_state=seed + 2000)
    start = time.perf_counter()
    result = keras_duq.tuning.search(
        lambda: two_moons.build_backbone(backbone),
        x_train,
        y_train,
        validation_data=(x_val.astype("float32"), y_val),
        num_classes=2,
        epochs=epochs_per_trial,
        optimizer=demo_optimizer,
        seed=seed,
        **demo_wrap(),
    )
    search_seconds = time.perf_counter() - start
    print(result.summary())
    chosen = train_and_check(seed, result.best, backbone)
    paper = two_moons.run(seed, backbone=backbone)
    print(
        f"seed {seed}: chose {result.best} in {search_seconds:.0f} s; "
        f"chosen: {chosen}; paper's values: accuracy {paper['test_accuracy']:.3f}, "
        f"far certainty {paper['far_certainty_mean']:.4f}"
    )
    return {
        "seed": seed,
        "search_seconds": round(search_seconds, 1),
        "resident_mb_after_search": resident_megabytes(),
        "best": result.best,
        "trials": result.trials,
        "chosen_values": chosen,
        "paper_values": {
            "test_accuracy": paper["test_accuracy"],
            "far_certainty_mean": paper["far_certainty_mean"],
            "auroc_test_vs_far": paper["auroc_test_vs_far"],
            "meets_bar": bool(two_moons.meets_bar(paper)),
        },
    }


def environment():
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in cpu.splitlines()
            if "Model name" in line
        ),
        platform.processor(),
    )
    return {
        "cpu": model,
        "python": platform.python_version(),
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "scikit-learn": sklearn.__version__,
        "numpy": np.__version__,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs-per-trial", type=int, default=10)
    parser.add_argument(
        "--backbone", choices=("residual_sn", "paper"), default="residual_sn"
    )
    parser.add_argument(
        "--output",
        help="default: research/reproduction/results/benchmarks/tuning_two_moons[_paper].json",
    )
    args = parser.parse_args(argv)
    suffix = "" if args.backbone == "residual_sn" else f"_{args.backbone}"
    output = args.output or str(RESULTS / f"tuning_two_moons{suffix}.json")
    runs = [run_seed(seed, args.epochs_per_trial, args.backbone) for seed in args.seeds]
    report = {
        "description": __doc__.splitlines()[0],
        "backbone": args.backbone,
        "epochs_per_trial": args.epochs_per_trial,
        "num_validation": NUM_VALIDATION,
        "paper": PAPER,
        "environment": environment(),
        "runs": runs,
    }
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        report["environment"]["tensorflow"] = tf.__version__
    Path(output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()

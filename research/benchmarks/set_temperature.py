"""Conformal set sizes from DUQ's kernel values, with and without a temperature.

For each seed, trains a problem's DUQ model (`wrap`'s defaults) and its
softmax model (`research.benchmarks.recipe`), splits the test set as
`research.benchmarks.mistakes` does (a seeded 20% as validation data) and
prints the coverage and mean size of split-conformal sets at 90% and 95%
from: softmax's probabilities (`softmax`); the kernel values normalised to
sum to one (`normalized`); `softmax(log K / T)` with `T` fitted by
likelihood on the validation part (`tempered`); and the same with `T`
fitted on half the validation part and the threshold on the other half
(`tempered_split`, strictly split-conformal):

    python -m research.benchmarks.set_temperature --problem fashion_mnist --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json

import keras
import numpy as np
from scipy.optimize import minimize_scalar

from keras_duq import evaluation
from research.benchmarks import mistakes
from research.benchmarks import recipe


def _tempered(log_kernel, temperature):
    z = log_kernel / temperature
    z = np.exp(z - z.max(1, keepdims=True))
    return z / z.sum(1, keepdims=True)


def _fitted_temperature(log_kernel, labels):
    def loss(log_t):
        p = _tempered(log_kernel, np.exp(log_t))[np.arange(len(labels)), labels]
        return -np.mean(np.log(np.maximum(p, 1e-30)))

    return float(np.exp(minimize_scalar(loss, bounds=(-6, 6), method="bounded").x))


def _test_scores(problem, seed, method):
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    spec = recipe.PROBLEMS[problem](seed)
    spec["wrap"] = {k: v for k, v in spec["wrap"].items() if k == "penalty_input"}
    keras.utils.set_random_seed(seed)
    model = recipe.build(spec, method)
    x, y = spec["train"]
    model.fit(x, y, batch_size=spec["batch_size"], epochs=spec["epochs"], verbose=0)
    x_test, y_test = spec["test"]
    return model.predict(x_test, batch_size=1000, verbose=0), y_test


def _sets(scores, labels, calibration, held):
    return {
        str(coverage): evaluation.prediction_set_metrics(
            evaluation.prediction_sets(
                scores[held],
                evaluation.conformal_threshold(
                    scores[calibration], labels[calibration], coverage
                ),
            ),
            labels[held],
        )
        for coverage in mistakes.COVERAGES
    }


def measure(problem, seed):
    kernel_values, labels = _test_scores(problem, seed, "duq")
    probabilities, _ = _test_scores(problem, seed, "softmax")
    order = np.random.default_rng(seed + 104729).permutation(len(labels))
    cut = int(mistakes.VALIDATION_SHARE * len(order))
    val, held = order[:cut], order[cut:]
    log_kernel = np.log(np.maximum(kernel_values, 1e-38))
    temperature = _fitted_temperature(log_kernel[val], labels[val])
    half = len(val) // 2
    split_temperature = _fitted_temperature(log_kernel[val[:half]], labels[val[:half]])
    return {
        "problem": problem,
        "seed": seed,
        "accuracy": {
            "duq": float(np.mean(kernel_values.argmax(1) == labels)),
            "softmax": float(np.mean(probabilities.argmax(1) == labels)),
        },
        "temperature": temperature,
        "softmax": _sets(probabilities, labels, val, held),
        "normalized": _sets(_tempered(log_kernel, 1.0), labels, val, held),
        "tempered": _sets(_tempered(log_kernel, temperature), labels, val, held),
        "tempered_split": _sets(
            _tempered(log_kernel, split_temperature), labels, val[half:], held
        ),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="fashion_mnist")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = parser.parse_args(argv)
    for seed in args.seeds:
        print(json.dumps(measure(args.problem, seed)), flush=True)


if __name__ == "__main__":
    main()

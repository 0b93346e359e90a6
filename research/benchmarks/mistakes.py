"""Likely mistakes and OoD from one pass: the scores of docs/reports/mistakes.md.

`metrics(method, test_scores, y_test, ood_scores, seed)` splits the test set
(a seeded 20% as validation data, the rest held out) and measures on the held
out part, for DUQ (kernel values) and for softmax (probabilities):

- `misclassification_auroc`, `ood_auroc` and `ece` of each score: DUQ's
  certainty (`certainty`), DUQ's `CertaintyCalibrator` fitted on the
  validation kernel values (`p_correct`), softmax's maximum probability
  (`max_probability`) and its isotonic calibration (`p_correct`);
- split-conformal prediction sets at 90% and 95% target coverage, fitted on
  the validation part: the coverage reached and the mean set size, from the
  kernel values (`sets_kernel`) and from the kernel values normalised to sum
  to one (`sets_normalized`), or from the probabilities (softmax).

`research.benchmarks.recipe.run` adds them to every record of a problem with
an OoD set; `python -m research.benchmarks.mistakes --summarize FILE ...`
prints the table:

    python -m research.benchmarks.defaults --problems fashion_mnist clinc150 \\
        cifar10_cnn digits_held_out --seeds 0 1 2 --output defaults.jsonl
    python -m research.benchmarks.mistakes --summarize defaults.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np

from keras_duq import evaluation

VALIDATION_SHARE = 0.2
COVERAGES = (0.9, 0.95)


def metrics(method, test_scores, y_test, ood_scores, seed):
    """The record's `mistakes` entry (see the module docstring)."""
    order = np.random.default_rng(seed + 104729).permutation(len(y_test))
    cut = int(VALIDATION_SHARE * len(order))
    val, held = order[:cut], order[cut:]
    correct = test_scores.argmax(1) == y_test
    scores = {}
    certainty = test_scores.max(1)
    ood_certainty = ood_scores.max(1)
    scores["certainty" if method == "duq" else "max_probability"] = (
        certainty[held],
        ood_certainty,
    )
    if correct[val].all() or not correct[val].any():
        calibrated = None
    else:
        calibrator = evaluation.CertaintyCalibrator()
        if method == "duq":
            calibrator.fit(test_scores[val], correct[val])
            calibrated = (calibrator(test_scores[held]), calibrator(ood_scores))
        else:
            calibrator.fit(certainty[val], correct[val])
            calibrated = (calibrator(certainty[held]), calibrator(ood_certainty))
        scores["p_correct"] = calibrated
    result = {}
    # Too few mistakes (e.g. none among the held-out digits): no ranking.
    both = correct[held].any() and not correct[held].all()
    for name, (in_score, out_score) in scores.items():
        result[name] = {
            "misclassification_auroc": float(
                evaluation.misclassification_auroc(in_score, correct[held])
            )
            if both
            else None,
            "ood_auroc": float(evaluation.ood_metrics(in_score, out_score)["auroc"]),
            "ece": float(
                evaluation.expected_calibration_error(
                    np.clip(in_score, 0, 1), correct[held]
                )
            ),
        }
    set_scores = {"sets_kernel" if method == "duq" else "sets": test_scores}
    if method == "duq":
        total = test_scores.sum(1, keepdims=True)
        set_scores["sets_normalized"] = np.where(
            total > 0, test_scores / np.maximum(total, 1e-38), 1.0 / test_scores.shape[1]
        )
    for name, values in set_scores.items():
        result[name] = {}
        for coverage in COVERAGES:
            threshold = evaluation.conformal_threshold(values[val], y_test[val], coverage)
            sets = evaluation.prediction_sets(values[held], threshold)
            result[name][str(coverage)] = evaluation.prediction_set_metrics(
                sets, y_test[held]
            )
    return result


def _mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}"


def summarize(paths, label="defaults"):
    """Markdown tables: the scores' metrics, and the prediction sets."""
    runs = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in paths:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if record.get("label") == label and "mistakes" in record:
                    runs[record["problem"]][record["method"]].append(record["mistakes"])
    rows = [
        "| problem | seeds | score | misclassification AUROC | OoD AUROC | ECE |",
        "|---|---|---|---|---|---|",
    ]
    set_rows = [
        "| problem | sets from | coverage at 90% | size at 90% | coverage at 95% "
        "| size at 95% | empty at 95% |",
        "|---|---|---|---|---|---|---|",
    ]
    for problem, methods in runs.items():
        for method in ("duq", "softmax"):
            records = methods.get(method, [])
            for score in ("certainty", "p_correct", "max_probability"):
                present = [r[score] for r in records if score in r]
                if not present:
                    continue
                rows.append(
                    f"| {problem} | {len(present)} | {method} {score} | "
                    + " | ".join(
                        _mean_std([p[key] for p in present])
                        for key in ("misclassification_auroc", "ood_auroc", "ece")
                    )
                    + " |"
                )
            for name in ("sets_kernel", "sets_normalized", "sets"):
                present = [r[name] for r in records if name in r]
                if not present:
                    continue
                cells = []
                for coverage in COVERAGES:
                    at = [p[str(coverage)] for p in present]
                    cells += [
                        _mean_std([a["coverage"] for a in at]),
                        f"{np.mean([a['mean_size'] for a in at]):.2f}",
                    ]
                cells.append(f"{np.mean([a['empty'] for a in at]):.3f}")
                set_rows.append(f"| {problem} | {method} {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n\n" + "\n".join(set_rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summarize", nargs="+", metavar="FILE", required=True)
    parser.add_argument("--label", default="defaults")
    args = parser.parse_args(argv)
    print(summarize(args.summarize, args.label))


if __name__ == "__main__":
    main()

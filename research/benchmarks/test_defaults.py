"""The defaults matrix's summary and the mistakes metrics, on records made by hand."""

import json

import numpy as np


def _record(method, seed, accuracy, auroc, seconds, warnings=()):
    return {
        "problem": "wine",
        "method": method,
        "seed": seed,
        "label": "defaults",
        "test_accuracy": accuracy,
        "ood_auroc": auroc,
        "test_certainty_mean": 0.5,
        "train_seconds": seconds,
        "warnings": list(warnings),
    }


def test_defaults_summary_gives_means_spreads_ratios_and_warnings(tmp_path):
    from research.benchmarks import defaults

    records = [
        _record("duq", 0, 0.9, 0.8, 4.0, ["LowCertaintyWarning"]),
        _record("duq", 1, 0.7, 0.6, 2.0),
        _record("softmax", 0, 0.8, 0.5, 1.0),
        _record("softmax", 1, 0.8, 0.7, 2.0),
        {**_record("duq", 0, 0.1, 0.1, 1.0), "label": "other"},  # not counted
    ]
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    row = defaults.summarize([str(path)]).splitlines()[2]
    assert row.startswith("| wine | 2 | 0.800 / 0.800 | 0.700 ± 0.100 | 0.600 ± 0.100 |")
    assert "| 2.00x | LowCertaintyWarning (1) |" in row


def test_mistakes_metrics_split_fit_on_validation_and_measure_the_rest():
    from research.benchmarks import mistakes

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 500)
    scores = rng.uniform(size=(500, 3)).astype("float32")
    scores[np.arange(500), labels] += rng.uniform(0, 1, 500)  # mostly right
    ood = 0.3 * rng.uniform(size=(200, 3)).astype("float32")
    result = mistakes.metrics("duq", scores, labels, ood, seed=0)
    assert set(result) == {"certainty", "p_correct", "sets_kernel", "sets_normalized"}
    for score in ("certainty", "p_correct"):
        assert 0.5 < result[score]["ood_auroc"] <= 1.0
        assert 0.5 < result[score]["misclassification_auroc"] <= 1.0
    for coverage in ("0.9", "0.95"):
        reached = result["sets_kernel"][coverage]["coverage"]
        assert abs(reached - float(coverage)) < 0.06
    softmax = mistakes.metrics("softmax", scores, labels, ood, seed=0)
    assert set(softmax) == {"max_probability", "p_correct", "sets"}

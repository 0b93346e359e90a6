"""Uncertainty evaluation: OoD metrics, calibration, selective prediction.

Everything here works on numpy arrays of per-example scores, so it serves DUQ
models (kernel values), softmax models and ensembles (probabilities) alike.
`keras_duq.callbacks.OODEvaluation` runs the OoD metrics from inside `fit`.

- Certainty: `certainty_scores`.
- Out-of-distribution detection: `ood_metrics`, `misclassification_auroc`,
  `rejection_curve`.
- Calibration: `calibration_curve`, `expected_calibration_error`, and
  `CertaintyCalibrator`, which maps DUQ's certainty (a kernel value, not a
  probability) to the probability that the prediction is right.
- Selective prediction (answer only when certain enough):
  `risk_coverage_curve`, `aurc`, `risk_at_coverage`, and
  `certainty_threshold`, the threshold to deploy with `certainty >= t`.
- Prediction sets with a guaranteed coverage (split conformal):
  `conformal_threshold`, `prediction_sets`, `prediction_set_metrics`.

Example:

```python
from keras_duq import evaluation

in_certainty = evaluation.certainty_scores(model.predict(x_test))
ood_certainty = evaluation.certainty_scores(model.predict(x_ood))
evaluation.ood_metrics(in_certainty, ood_certainty)
# {"auroc": ..., "aupr": ..., "fpr_at_95_tpr": ...}
```

The calibration and selective-prediction functions turn the certainty into a
probability of being right, and into a threshold that refuses inputs.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from sklearn import metrics as sk_metrics

from keras_duq._calibration import CertaintyCalibrator
from keras_duq._evaluation_inputs import as_certainty
from keras_duq._evaluation_inputs import as_correct
from keras_duq._evaluation_inputs import check_both_outcomes
from keras_duq._evaluation_inputs import check_finite
from keras_duq._evaluation_inputs import check_fraction
from keras_duq._evaluation_inputs import count_for_fraction
from keras_duq._evaluation_inputs import detection_problem
from keras_duq._validation import check_int

__all__ = [
    "CALIBRATION_STRATEGIES",
    "CERTAINTY_METHODS",
    "CertaintyCalibrator",
    "aurc",
    "calibration_curve",
    "certainty_scores",
    "certainty_threshold",
    "conformal_threshold",
    "expected_calibration_error",
    "misclassification_auroc",
    "ood_metrics",
    "prediction_set_metrics",
    "prediction_sets",
    "rejection_curve",
    "risk_at_coverage",
    "risk_coverage_curve",
]

CERTAINTY_METHODS = ("max", "negative_entropy")
CALIBRATION_STRATEGIES = ("uniform", "quantile")

# The operating point of `fpr_at_95_tpr`: the share of OoD examples that must
# be caught.
_TPR_LEVEL = 0.95


def certainty_scores(scores: ArrayLike, method: str = "max") -> np.ndarray:
    """Per-example certainty from per-class scores.

    Higher always means more certain, so that every metric in `keras_duq`
    reads the same way whatever model made the scores.

    Example:

    ```python
    kernel_values = duq_model.predict(x_test)          # DUQ: (n, classes)
    certainty = keras_duq.evaluation.certainty_scores(kernel_values)

    probabilities = np.mean([m.predict(x_test) for m in ensemble], axis=0)
    certainty = keras_duq.evaluation.certainty_scores(
        probabilities, method="negative_entropy"
    )
    ```

    Args:
        scores: array-like `(num_examples, num_classes)`: DUQ kernel values,
            or softmax (or averaged ensemble) probabilities.
        method: `"max"` (default): the largest score, i.e. DUQ's certainty or
            the maximum softmax probability. `"negative_entropy"`:
            `sum_c p_c log p_c` (the negative predictive entropy, `0` for a
            one-hot prediction), the usual certainty of softmax models and
            deep ensembles; the scores must be probabilities.

    Returns:
        A float64 numpy array `(num_examples,)`.
    """
    if method not in CERTAINTY_METHODS:
        raise ValueError(
            f"Unknown certainty method. Expected one of {CERTAINTY_METHODS}. "
            f"Received: `method={method!r}`"
        )
    scores = np.asarray(scores, dtype="float64")
    if scores.ndim != 2 or scores.shape[1] < 1:
        raise ValueError(
            "Expected `scores` of shape (num_examples, num_classes), one row "
            "of per-class scores per example (the output of "
            f"`model.predict`). Received: `scores` of shape {scores.shape}"
        )
    check_finite("scores", scores)
    if method == "max":
        return scores.max(axis=1)
    if np.any(scores < 0):
        raise ValueError(
            "`method='negative_entropy'` needs probabilities, but `scores` "
            "contains negative values. Pass softmax outputs, not logits "
            "(e.g. `keras.ops.softmax(logits)`). Received: minimum score "
            f"{scores.min()}"
        )
    # 0 * log(0) is taken as 0, its limit, instead of numpy's nan.
    safe = np.where(scores > 0, scores, 1.0)
    return np.sum(scores * np.log(safe), axis=1)


def ood_metrics(
    in_distribution_certainty: ArrayLike, out_of_distribution_certainty: ArrayLike
) -> dict[str, float]:
    """How well certainty separates in-distribution from OoD examples.

    Convention: out-of-distribution (OoD) is the *positive* class and the
    detector's score is the *uncertainty* `-certainty`. A perfect detector
    (every OoD example less certain than every in-distribution example) gives
    `auroc == 1.0`, `aupr == 1.0` and `fpr_at_95_tpr == 0.0`; a detector
    that cannot tell them apart gives `auroc` near `0.5`; an AUROC near `0`
    means the sign of the certainty is flipped.

    Example:

    ```python
    metrics = keras_duq.evaluation.ood_metrics(
        keras_duq.evaluation.certainty_scores(model.predict(x_fashion_mnist_test)),
        keras_duq.evaluation.certainty_scores(model.predict(x_mnist_test)),
    )
    metrics["auroc"]   # 0.955 for DUQ in the paper
    ```

    Args:
        in_distribution_certainty: array-like `(num_in,)`, certainty of the
            in-distribution test examples (e.g. from `certainty_scores`).
        out_of_distribution_certainty: array-like `(num_ood,)`, certainty of
            the OoD examples.

    Returns:
        A dict of floats:

        - `"auroc"`: area under the ROC curve (the paper's metric).
        - `"aupr"`: average precision with OoD as positive.
        - `"fpr_at_95_tpr"`: the fraction of in-distribution examples flagged
            as OoD at the strictest threshold that flags at least 95% of the
            OoD examples.
    """
    in_certainty = as_certainty("in_distribution_certainty", in_distribution_certainty)
    ood_certainty = as_certainty(
        "out_of_distribution_certainty", out_of_distribution_certainty
    )
    is_ood, uncertainty = detection_problem(in_certainty, ood_certainty)
    # Without `drop_intermediate=False`, sklearn may drop the first point at
    # or above 95% TPR when it lies on a straight segment of the curve.
    fpr, tpr, _ = sk_metrics.roc_curve(is_ood, uncertainty, drop_intermediate=False)
    first_above = int(np.searchsorted(tpr, _TPR_LEVEL, side="left"))
    return {
        "auroc": float(sk_metrics.roc_auc_score(is_ood, uncertainty)),
        "aupr": float(sk_metrics.average_precision_score(is_ood, uncertainty)),
        "fpr_at_95_tpr": float(fpr[first_above]),
    }


def misclassification_auroc(certainty: ArrayLike, correct: ArrayLike) -> float:
    """AUROC of certainty separating correct from wrong predictions.

    Correct predictions are the positive class: `1.0` means every correct
    prediction is more certain than every wrong one. The paper uses this on
    validation data to choose the gradient penalty weight without access to
    any OoD data.

    Example:

    ```python
    kernel_values = model.predict(x_val)
    score = keras_duq.evaluation.misclassification_auroc(
        kernel_values.max(axis=1), kernel_values.argmax(axis=1) == y_val
    )
    ```

    Args:
        certainty: array-like `(num_examples,)`, per-example certainty.
        correct: array-like `(num_examples,)` of bools (or 0/1), whether each
            prediction is right. Needs both right and wrong predictions.

    Returns:
        The AUROC as a float.
    """
    certainty = as_certainty("certainty", certainty)
    correct = as_correct("correct", correct, len(certainty))
    check_both_outcomes(
        correct, "The misclassification AUROC", "Evaluate on more examples."
    )
    return float(sk_metrics.roc_auc_score(correct, certainty))


def rejection_curve(
    in_certainty: ArrayLike,
    in_correct: ArrayLike,
    ood_certainty: ArrayLike | None = None,
    num_points: int = 101,
) -> dict[str, np.ndarray]:
    """Accuracy on the kept data as the least certain examples are rejected.

    The paper's Figure 6: in-distribution and (optionally) OoD test examples
    are pooled, predictions on OoD examples count as wrong, and for each
    rejected fraction the least certain examples are set aside and the
    accuracy is computed on the rest. Tied certainties are rejected in
    proportion (the expected accuracy of breaking ties at random), so
    underflowed DUQ kernel values of exactly zero are not ordered by chance.

    `oracle_accuracy` is the best any certainty could do with the same
    predictions: it rejects all wrong predictions (OoD included) first. With
    all in-distribution predictions correct it is the paper's "theoretical
    maximum".

    Example:

    ```python
    in_scores = model.predict(x_in)
    curve = keras_duq.evaluation.rejection_curve(
        in_scores.max(axis=1),
        in_scores.argmax(axis=1) == y_in,
        ood_certainty=model.predict(x_ood).max(axis=1),
    )
    keras_duq.plots.plot_rejection_curve(curve).figure.savefig("rejection.png")
    ```

    Args:
        in_certainty: array-like `(num_in,)`, certainty on the
            in-distribution examples.
        in_correct: array-like `(num_in,)` of bools (or 0/1), whether each
            in-distribution prediction is right.
        ood_certainty: optional array-like `(num_ood,)`, certainty on OoD
            examples, all counted as wrong.
        num_points: int >= 2, number of rejected fractions, evenly spaced
            from `0` to `1`. Defaults to `101` (steps of 1%).

    Returns:
        A dict of float64 arrays `(num_points,)`: `"rejected_fraction"`,
        `"accuracy"` and `"oracle_accuracy"`. At a fraction of `1` nothing is
        kept and both accuracies are `nan`.
    """
    check_int("num_points", num_points, minimum=2)
    certainty = as_certainty("in_certainty", in_certainty)
    correct = as_correct("in_correct", in_correct, len(certainty)).astype("float64")
    if ood_certainty is not None:
        ood_certainty = as_certainty("ood_certainty", ood_certainty)
        certainty = np.concatenate([certainty, ood_certainty])
        correct = np.concatenate([correct, np.zeros(len(ood_certainty))])
    total = len(certainty)
    fractions = np.linspace(0.0, 1.0, num_points)
    kept = total - np.rint(fractions * total)
    num_correct = correct.sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        accuracy = _kept_correct(certainty, correct, kept) / kept
        # Wrong predictions go first, so all the correct ones are kept until
        # only correct ones are left.
        oracle = np.minimum(num_correct, kept) / kept
    accuracy[kept == 0] = np.nan
    oracle[kept == 0] = np.nan
    return {
        "rejected_fraction": fractions,
        "accuracy": accuracy,
        "oracle_accuracy": oracle,
    }


def expected_calibration_error(
    confidence: ArrayLike,
    correct: ArrayLike,
    num_bins: int = 15,
    strategy: str = "uniform",
) -> float:
    """Expected calibration error (ECE): how far confidence is from accuracy.

    The textbook definition (Naeini et al. 2015, Guo et al. 2017): with the
    examples grouped into bins by confidence (see `calibration_curve`),

    `ECE = sum over bins of (n_bin / n) * |accuracy_bin - confidence_bin|`

    `0` is perfectly calibrated. DUQ's certainty is a kernel value, not a
    probability, so nothing makes its raw ECE small: to compare DUQ with
    softmax models on calibration, also report the ECE of
    `CertaintyCalibrator` outputs fitted on validation data.

    Example:

    ```python
    kernel_values = duq_model.predict(x_test)
    correct = kernel_values.argmax(axis=1) == y_test
    raw = keras_duq.evaluation.expected_calibration_error(
        kernel_values.max(axis=1), correct
    )
    calibrator = keras_duq.evaluation.CertaintyCalibrator().fit(
        val_certainty, val_correct
    )
    calibrated = keras_duq.evaluation.expected_calibration_error(
        calibrator(kernel_values.max(axis=1)), correct
    )
    ```

    Args:
        confidence: array-like `(num_examples,)` in `[0, 1]`.
        correct: array-like `(num_examples,)` of bools (or 0/1), whether each
            prediction is right.
        num_bins: int >= 1, number of bins. Defaults to `15`.
        strategy: `"uniform"` (default, equal-width bins, the textbook ECE)
            or `"quantile"` (equal-count bins).

    Returns:
        The ECE as a float in `[0, 1]`.
    """
    curve = calibration_curve(confidence, correct, num_bins, strategy)
    filled = curve["count"] > 0
    weights = curve["count"][filled] / curve["count"].sum()
    gaps = np.abs(curve["accuracy"][filled] - curve["confidence"][filled])
    return float(np.sum(weights * gaps))


def calibration_curve(
    confidence: ArrayLike,
    correct: ArrayLike,
    num_bins: int = 15,
    strategy: str = "uniform",
) -> dict[str, np.ndarray]:
    """Per-bin accuracy and mean confidence: the data of a reliability diagram.

    Examples are grouped into bins by confidence; a calibrated model is right
    as often as it is confident in every bin (`accuracy == confidence`).
    Bins are closed on the right, `(low, high]`, with a confidence of exactly
    `0` in the first bin. `expected_calibration_error` and
    `keras_duq.plots.plot_reliability_diagram` are built on this function.

    Example:

    ```python
    probabilities = softmax_model.predict(x_test)
    curve = keras_duq.evaluation.calibration_curve(
        probabilities.max(axis=1), probabilities.argmax(axis=1) == y_test
    )
    curve["accuracy"] - curve["confidence"]   # > 0: under-confident bins
    ```

    Args:
        confidence: array-like `(num_examples,)` in `[0, 1]`: the maximum
            softmax (or ensemble) probability, a DUQ certainty (max kernel
            value) or a calibrated probability (`CertaintyCalibrator`).
        correct: array-like `(num_examples,)` of bools (or 0/1), whether each
            prediction is right.
        num_bins: int >= 1, number of bins. Defaults to `15`, the usual
            choice since Guo et al. (2017).
        strategy: `"uniform"` (default): bins of equal width on `[0, 1]`.
            `"quantile"`: bins holding (about) the same number of examples,
            with edges at quantiles of `confidence`; tied confidences can
            leave some bins empty.

    Returns:
        A dict:

        - `"bin_edges"`: float64 `(num_bins + 1,)`, increasing.
        - `"count"`: int64 `(num_bins,)`, examples per bin.
        - `"confidence"`: float64 `(num_bins,)`, mean confidence per bin
            (`nan` for an empty bin).
        - `"accuracy"`: float64 `(num_bins,)`, fraction correct per bin
            (`nan` for an empty bin).
    """
    check_int("num_bins", num_bins, minimum=1)
    if strategy not in CALIBRATION_STRATEGIES:
        raise ValueError(
            f"Unknown binning strategy. Expected one of {CALIBRATION_STRATEGIES}. "
            f"Received: `strategy={strategy!r}`"
        )
    confidence = as_certainty("confidence", confidence)
    if confidence.min() < 0 or confidence.max() > 1:
        raise ValueError(
            "Calibration compares confidence with accuracy, so `confidence` "
            "must lie in [0, 1] (a probability or a DUQ kernel value). For "
            "other certainties (e.g. negative entropy) fit a "
            "`keras_duq.evaluation.CertaintyCalibrator` and pass its output. "
            f"Received: values in [{confidence.min()}, {confidence.max()}]"
        )
    correct = as_correct("correct", correct, len(confidence)).astype("float64")
    quantiles = np.linspace(0.0, 1.0, num_bins + 1)
    if strategy == "uniform":
        edges = quantiles
    else:
        edges = np.quantile(confidence, quantiles)
    bin_index = np.digitize(confidence, edges[1:-1], right=True)
    count = np.bincount(bin_index, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_confidence = np.bincount(bin_index, confidence, num_bins) / count
        accuracy = np.bincount(bin_index, correct, num_bins) / count
    return {
        "bin_edges": edges,
        "count": count,
        "confidence": mean_confidence,
        "accuracy": accuracy,
    }


def risk_coverage_curve(
    confidence: ArrayLike, correct: ArrayLike
) -> dict[str, np.ndarray]:
    """Error rate among the most certain examples as more are accepted.

    Selective prediction answers only the examples it is most certain of.
    At coverage `k / n` the `k` most certain examples are accepted and the
    risk is the fraction of them that are wrong. Tied certainties are
    accepted in proportion (the expected risk of breaking ties at random),
    as in `rejection_curve`, of which this is the per-example mirror image
    (`risk = 1 - accuracy` at `rejected_fraction = 1 - coverage`).

    Example:

    ```python
    curve = keras_duq.evaluation.risk_coverage_curve(certainty, correct)
    plt.plot(curve["coverage"], curve["risk"])
    ```

    Args:
        confidence: array-like `(num_examples,)`, any certainty where higher
            means more certain (kernel values, probabilities, negative
            entropy).
        correct: array-like `(num_examples,)` of bools (or 0/1), whether each
            prediction is right.

    Returns:
        A dict of float64 arrays `(num_examples,)`: `"coverage"`
        (`1/n, 2/n, ..., 1`) and `"risk"`.
    """
    confidence = as_certainty("confidence", confidence)
    correct = as_correct("correct", correct, len(confidence)).astype("float64")
    accepted = np.arange(1, len(confidence) + 1, dtype="float64")
    risk = 1.0 - _kept_correct(confidence, correct, accepted) / accepted
    return {"coverage": accepted / len(confidence), "risk": risk}


def aurc(confidence: ArrayLike, correct: ArrayLike) -> float:
    """Area under the risk-coverage curve (AURC, Geifman et al. 2019).

    The mean of the risk over the coverages `1/n, ..., 1` of
    `risk_coverage_curve`: lower is better. It mixes the error rate (the
    risk at full coverage) with how well certainty ranks errors last; a
    certainty that ranks every error below every correct prediction reaches
    the lowest AURC those predictions allow.

    Example:

    ```python
    keras_duq.evaluation.aurc(kernel_values.max(axis=1),
                              kernel_values.argmax(axis=1) == y_test)
    ```

    Args:
        confidence: per-example certainty, as in `risk_coverage_curve`.
        correct: whether each prediction is right, as in
            `risk_coverage_curve`.

    Returns:
        The AURC as a float in `[0, 1]`.
    """
    return float(np.mean(risk_coverage_curve(confidence, correct)["risk"]))


def risk_at_coverage(
    confidence: ArrayLike, correct: ArrayLike, coverage: float = 0.9
) -> float:
    """Error rate on the most certain `coverage` fraction of the examples.

    The `ceil(coverage * n)` most certain examples are accepted (ties in
    proportion, as in `risk_coverage_curve`). The accuracy at that coverage
    is `1 - risk_at_coverage(...)`.

    Example:

    ```python
    risk = keras_duq.evaluation.risk_at_coverage(certainty, correct, coverage=0.9)
    print(f"accuracy on the 90% most certain: {1 - risk:.3f}")
    ```

    Args:
        confidence: per-example certainty, as in `risk_coverage_curve`.
        correct: whether each prediction is right, as in
            `risk_coverage_curve`.
        coverage: float in `(0, 1]`, the fraction of examples to accept.
            Defaults to `0.9`.

    Returns:
        The risk as a float in `[0, 1]`.
    """
    check_fraction("coverage", coverage)
    curve = risk_coverage_curve(confidence, correct)
    accepted = count_for_fraction(len(curve["risk"]), coverage)
    return float(curve["risk"][accepted - 1])


def certainty_threshold(certainty: ArrayLike, keep: float = 0.95) -> float:
    """The certainty threshold that accepts a target share of examples.

    Returns the largest `t` such that `certainty >= t` holds for at least
    `keep` of the given examples: compute it on in-distribution validation
    data and deploy `accept = certainty >= t`, e.g. as
    `model.export(path, certainty_threshold=t)`. Inputs the model has never
    seen are then refused when they are less certain than all but about
    `1 - keep` of the validation data.

    Use the certainty the deployed model computes (the float32 output of
    `model.predict`): the threshold is then one of its values, and the
    comparison in the exported model keeps exactly the counted examples.

    Example:

    ```python
    val_certainty = model.predict(x_val).max(axis=1)
    t = keras_duq.evaluation.certainty_threshold(val_certainty, keep=0.95)
    accept = model.predict(x_new).max(axis=1) >= t
    ```

    Args:
        certainty: array-like `(num_examples,)`, certainty on
            in-distribution validation data (higher is more certain).
        keep: float in `(0, 1]`, the fraction of these examples to accept.
            Defaults to `0.95`.

    Returns:
        The threshold `t` as a float (one of the given certainties).
    """
    check_fraction("keep", keep)
    certainty = as_certainty("certainty", certainty)
    accepted = count_for_fraction(len(certainty), keep)
    return float(np.sort(certainty)[len(certainty) - accepted])


def conformal_threshold(
    scores: ArrayLike, labels: ArrayLike, coverage: float = 0.9
) -> float:
    """Split-conformal threshold: prediction sets that hold the true class at `coverage`.

    Fitted on labelled in-distribution validation data that the model did
    not train on: with `t` returned, the set `{c : scores[c] >= t}` of a new
    example from the same distribution holds its true class with
    probability at least `coverage` (marginally, over examples; Vovk et al.,
    2005). `t` is the `floor((n + 1) * (1 - coverage))`-th smallest score of
    the true class among the `n` validation examples.

    For DUQ pass the kernel values: the sets are then the classes whose
    centroid is close enough, and an input far from every centroid gets an
    empty set (the model abstains) instead of a guess. For softmax models
    pass the probabilities. `prediction_sets` applies the threshold and
    `prediction_set_metrics` measures the coverage reached and the sets' size.

    Example:

    ```python
    t = keras_duq.evaluation.conformal_threshold(model.predict(x_val), y_val, 0.9)
    sets = keras_duq.evaluation.prediction_sets(model.predict(x_test), t)
    keras_duq.evaluation.prediction_set_metrics(sets, y_test)
    # {"coverage": ~0.9, "mean_size": ..., "empty": ...}
    ```

    Args:
        scores: array-like `(num_examples, num_classes)`, per-class scores
            (higher: more likely) on validation data.
        labels: array-like `(num_examples,)` of class indices.
        coverage: float in `(0, 1)`, the target probability that a set
            holds the true class. Defaults to `0.9`.

    Returns:
        The threshold `t` as a float; `-inf` (every class in every set)
        when there are too few examples for `coverage`
        (`n < 1 / (1 - coverage) - 1`).
    """
    if isinstance(coverage, bool) or not isinstance(coverage, (int, float)) or not (
        0 < coverage < 1
    ):
        raise ValueError(
            "Expected `coverage` to be a probability in (0, 1), e.g. 0.9. "
            f"Received: `coverage={coverage!r}`"
        )
    scores, labels = _scores_and_labels(scores, labels)
    true_scores = np.sort(scores[np.arange(len(labels)), labels])
    # A tolerance as in `count_for_fraction`: 0.1 * 20 is 2, not 1.9999.
    below = int(np.floor(round((len(labels) + 1) * (1 - coverage), 9)))
    if below < 1:
        return float("-inf")
    return float(true_scores[below - 1])


def prediction_sets(scores: ArrayLike, threshold: float) -> np.ndarray:
    """The classes whose score reaches `threshold`, per example.

    Example:

    ```python
    sets = keras_duq.evaluation.prediction_sets(model.predict(x_test), t)
    abstained = ~sets.any(axis=1)     # far from every centroid
    ```

    Args:
        scores: array-like `(num_examples, num_classes)`, per-class scores as
            passed to `conformal_threshold`.
        threshold: float, from `conformal_threshold`.

    Returns:
        A bool array `(num_examples, num_classes)`: `True` for each class in
        the example's set.
    """
    scores = np.asarray(scores, dtype="float64")
    if scores.ndim != 2:
        raise ValueError(
            "Expected `scores` of shape (num_examples, num_classes), e.g. "
            f"`model.predict(x)`. Received: `scores` of shape {scores.shape}"
        )
    return scores >= threshold


def prediction_set_metrics(sets: ArrayLike, labels: ArrayLike) -> dict[str, float]:
    """Coverage and size of prediction sets.

    Example:

    ```python
    keras_duq.evaluation.prediction_set_metrics(sets, y_test)
    # {"coverage": 0.91, "mean_size": 1.2, "empty": 0.0}
    ```

    Args:
        sets: bool array `(num_examples, num_classes)` from `prediction_sets`.
        labels: array-like `(num_examples,)` of class indices.

    Returns:
        dict with `coverage` (the fraction of sets holding the true class),
        `mean_size` (the average number of classes in a set) and `empty`
        (the fraction of empty sets: inputs the model abstains on).
    """
    sets, labels = _scores_and_labels(sets, labels)
    sets = sets.astype(bool)
    return {
        "coverage": float(np.mean(sets[np.arange(len(labels)), labels])),
        "mean_size": float(np.mean(sets.sum(axis=1))),
        "empty": float(np.mean(~sets.any(axis=1))),
    }


def _scores_and_labels(scores, labels):
    scores = np.asarray(scores)
    labels = np.asarray(labels)
    if scores.ndim != 2 or len(scores) == 0:
        raise ValueError(
            "Expected per-class scores of shape (num_examples, num_classes) "
            f"with at least one example. Received: shape {scores.shape}"
        )
    if labels.shape != (len(scores),):
        raise ValueError(
            f"Expected `labels` of shape ({len(scores)},), one class index per "
            f"example. Received: `labels` of shape {labels.shape}"
        )
    if labels.dtype.kind not in "iu" or labels.min() < 0 or labels.max() >= scores.shape[1]:
        raise ValueError(
            f"Expected `labels` to be class indices in [0, {scores.shape[1]}). "
            f"Received: `labels` of dtype {labels.dtype} in "
            f"[{labels.min()}, {labels.max()}]"
        )
    if scores.dtype != bool and not np.isfinite(scores).all():
        raise ValueError("Expected finite scores. Received: scores with NaN or Inf")
    return scores, labels


def _kept_correct(certainty, correct, kept):
    """Expected correct predictions among the `kept` most certain examples.

    Every tie group is split in proportion, i.e. the expectation over random
    tie-breaking: the cumulative count is interpolated between group
    boundaries.
    """
    values, group = np.unique(certainty, return_inverse=True)
    group_sizes = np.bincount(group, minlength=len(values))
    group_correct = np.bincount(group, weights=correct, minlength=len(values))
    boundaries = np.concatenate([[0.0], np.cumsum(group_sizes)])
    correct_at_boundaries = np.concatenate([[0.0], np.cumsum(group_correct)])
    rejected_correct = np.interp(
        len(certainty) - np.asarray(kept), boundaries, correct_at_boundaries
    )
    return correct.sum() - rejected_correct

"""Uncertainty evaluation: certainty scores, OoD metrics, rejection curves.

Everything here works on numpy arrays of per-example scores, so it serves DUQ
models (kernel values), softmax models and ensembles (probabilities) alike.
`keras_duq.callbacks.OODEvaluation` runs the same metrics from inside `fit`.

Example:

```python
from keras_duq import evaluation

in_certainty = evaluation.certainty_scores(model.predict(x_test))
ood_certainty = evaluation.certainty_scores(model.predict(x_ood))
evaluation.ood_metrics(in_certainty, ood_certainty)
# {"auroc": ..., "aupr": ..., "fpr_at_95_tpr": ...}
```
"""

from __future__ import annotations

import math

import numpy as np
from sklearn import metrics as sk_metrics

from keras_duq._validation import check_int

CERTAINTY_METHODS = ("max", "negative_entropy")

# The operating point of `fpr_at_95_tpr`: the share of OoD examples that must
# be caught.
_TPR_LEVEL = 0.95


def certainty_scores(scores, method: str = "max") -> np.ndarray:
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
    _check_finite("scores", scores)
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


def ood_metrics(in_distribution_certainty, out_of_distribution_certainty) -> dict:
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
    in_certainty = _as_certainty("in_distribution_certainty", in_distribution_certainty)
    ood_certainty = _as_certainty(
        "out_of_distribution_certainty", out_of_distribution_certainty
    )
    is_ood, uncertainty = _detection_problem(in_certainty, ood_certainty)
    # Without `drop_intermediate=False`, sklearn may drop the first point at
    # or above 95% TPR when it lies on a straight segment of the curve.
    fpr, tpr, _ = sk_metrics.roc_curve(is_ood, uncertainty, drop_intermediate=False)
    first_above = int(np.searchsorted(tpr, _TPR_LEVEL, side="left"))
    return {
        "auroc": float(sk_metrics.roc_auc_score(is_ood, uncertainty)),
        "aupr": float(sk_metrics.average_precision_score(is_ood, uncertainty)),
        "fpr_at_95_tpr": float(fpr[first_above]),
    }


def misclassification_auroc(certainty, correct) -> float:
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
    certainty = _as_certainty("certainty", certainty)
    correct = _as_correct("correct", correct, len(certainty))
    if correct.all() or not correct.any():
        raise ValueError(
            "The misclassification AUROC needs both correct and wrong "
            "predictions, but all predictions are "
            f"{'correct' if correct.all() else 'wrong'}. Evaluate on more "
            f"examples. Received: {len(correct)} predictions"
        )
    return float(sk_metrics.roc_auc_score(correct, certainty))


def rejection_curve(
    in_certainty, in_correct, ood_certainty=None, num_points: int = 101
) -> dict:
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
    keras_duq.plots.plot_rejection_curve(curve).savefig("rejection.png")
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
    certainty = _as_certainty("in_certainty", in_certainty)
    correct = _as_correct("in_correct", in_correct, len(certainty)).astype("float64")
    if ood_certainty is not None:
        ood_certainty = _as_certainty("ood_certainty", ood_certainty)
        certainty = np.concatenate([certainty, ood_certainty])
        correct = np.concatenate([correct, np.zeros(len(ood_certainty))])
    total = len(certainty)
    fractions = np.linspace(0.0, 1.0, num_points)
    rejected = np.rint(fractions * total)
    kept = total - rejected

    # Correct predictions among the `k` least certain, with every tie group
    # rejected uniformly: interpolate between the cumulative counts at the
    # group boundaries.
    values, group = np.unique(certainty, return_inverse=True)
    group_sizes = np.bincount(group, minlength=len(values))
    group_correct = np.bincount(group, weights=correct, minlength=len(values))
    boundaries = np.concatenate([[0.0], np.cumsum(group_sizes)])
    correct_at_boundaries = np.concatenate([[0.0], np.cumsum(group_correct)])
    rejected_correct = np.interp(rejected, boundaries, correct_at_boundaries)

    num_correct = correct.sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        accuracy = (num_correct - rejected_correct) / kept
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


def _detection_problem(in_certainty, ood_certainty):
    """Binary labels (OoD = 1) and detector scores (uncertainty)."""
    is_ood = np.concatenate(
        [np.zeros(len(in_certainty), "int64"), np.ones(len(ood_certainty), "int64")]
    )
    uncertainty = -np.concatenate([in_certainty, ood_certainty])
    return is_ood, uncertainty


def _as_certainty(name, values):
    values = np.asarray(values, dtype="float64")
    if values.ndim != 1 or len(values) == 0:
        raise ValueError(
            f"Expected `{name}` to be a non-empty 1-D array of per-example "
            "certainties. Turn per-class scores into certainties with "
            f"`keras_duq.evaluation.certainty_scores(scores)`. Received: `{name}` of "
            f"shape {values.shape}"
        )
    _check_finite(name, values)
    return values


def _as_correct(name, values, length):
    values = np.asarray(values)
    if values.shape != (length,):
        raise ValueError(
            f"Expected `{name}` to have shape ({length},), one entry per "
            f"certainty. Received: `{name}` of shape {values.shape}"
        )
    if values.dtype != bool:
        if not np.all((values == 0) | (values == 1)):
            raise ValueError(
                f"Expected `{name}` to hold booleans or 0/1, e.g. "
                f"`predictions == labels`. Received: values {np.unique(values)[:5]}"
            )
        values = values.astype(bool)
    return values


def _check_finite(name, values):
    if not np.all(np.isfinite(values)):
        raise ValueError(
            f"`{name}` contains NaN or infinite values "
            f"({int(np.sum(~np.isfinite(values)))} of {values.size}). Check the "
            "model's predictions (a diverged model predicts NaN)."
        )

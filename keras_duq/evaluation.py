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

Example:

```python
from keras_duq import evaluation

in_certainty = evaluation.certainty_scores(model.predict(x_test))
ood_certainty = evaluation.certainty_scores(model.predict(x_ood))
evaluation.ood_metrics(in_certainty, ood_certainty)
# {"auroc": ..., "aupr": ..., "fpr_at_95_tpr": ...}
```

See docs/calibration.md for calibration and selective prediction.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import keras
import numpy as np
from keras import ops
from numpy.typing import ArrayLike
from sklearn import metrics as sk_metrics

from keras_duq._typing import Tensor
from keras_duq._validation import check_int

__all__ = [
    "CALIBRATION_STRATEGIES",
    "CERTAINTY_METHODS",
    "CertaintyCalibrator",
    "aurc",
    "calibration_curve",
    "certainty_scores",
    "certainty_threshold",
    "expected_calibration_error",
    "misclassification_auroc",
    "ood_metrics",
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
    certainty = _as_certainty("certainty", certainty)
    correct = _as_correct("correct", correct, len(certainty))
    _check_both_outcomes(
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
    certainty = _as_certainty("in_certainty", in_certainty)
    correct = _as_correct("in_correct", in_correct, len(certainty)).astype("float64")
    if ood_certainty is not None:
        ood_certainty = _as_certainty("ood_certainty", ood_certainty)
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
    confidence = _as_certainty("confidence", confidence)
    if confidence.min() < 0 or confidence.max() > 1:
        raise ValueError(
            "Calibration compares confidence with accuracy, so `confidence` "
            "must lie in [0, 1] (a probability or a DUQ kernel value). For "
            "other certainties (e.g. negative entropy) fit a "
            "`keras_duq.evaluation.CertaintyCalibrator` and pass its output. "
            f"Received: values in [{confidence.min()}, {confidence.max()}]"
        )
    correct = _as_correct("correct", correct, len(confidence)).astype("float64")
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
    confidence = _as_certainty("confidence", confidence)
    correct = _as_correct("correct", correct, len(confidence)).astype("float64")
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
    _check_fraction("coverage", coverage)
    curve = risk_coverage_curve(confidence, correct)
    accepted = _count_for_fraction(len(curve["risk"]), coverage)
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
    _check_fraction("keep", keep)
    certainty = _as_certainty("certainty", certainty)
    accepted = _count_for_fraction(len(certainty), keep)
    return float(np.sort(certainty)[len(certainty) - accepted])


@keras.saving.register_keras_serializable(package="keras_duq")
class CertaintyCalibrator:
    """Maps certainty to the probability that the prediction is right.

    DUQ's certainty is a kernel value: it ranks examples well, but
    `certainty == 0.8` does not mean "right 80% of the time". The calibrator
    fits an isotonic regression (scikit-learn's `IsotonicRegression`,
    increasing, values in `[0, 1]`) of `correct` on `certainty` over
    validation data. The fitted map is kept as two float32 numpy arrays,
    `thresholds` and `values`: piecewise linear between them, constant
    outside. It works the same for softmax or ensemble confidences.

    Calling the calibrator uses only `keras.ops`, so it runs on numpy arrays
    (returning numpy), and on backend tensors (returning a tensor), inside a
    `tf.function` or a `jax.jit` too, e.g. in a serving signature. It is
    computed in float32.

    Save it on its own with `save(path)` / `CertaintyCalibrator.load(path)`
    (a small JSON file), or inside a Keras config through `get_config()` /
    `from_config()` (registered as `"keras_duq>CertaintyCalibrator"`).

    Example:

    ```python
    val_scores = model.predict(x_val)
    calibrator = keras_duq.evaluation.CertaintyCalibrator().fit(
        val_scores.max(axis=1), val_scores.argmax(axis=1) == y_val
    )
    probability_correct = calibrator(model.predict(x_test).max(axis=1))
    calibrator.save("calibrator.json")
    calibrator = keras_duq.evaluation.CertaintyCalibrator.load("calibrator.json")
    ```

    Args:
        thresholds: optional, a fitted map's increasing certainties (as in
            `get_config()`); leave unset and call `fit`.
        values: optional, the probabilities at `thresholds`, non-decreasing
            in `[0, 1]`.
    """

    def __init__(
        self, thresholds: ArrayLike | None = None, values: ArrayLike | None = None
    ) -> None:
        if (thresholds is None) != (values is None):
            raise ValueError(
                "Pass both `thresholds` and `values` (a fitted map, as in "
                "`get_config()`), or neither and call `fit`. Received: "
                f"`thresholds={thresholds!r}`, `values={values!r}`"
            )
        if thresholds is not None:
            thresholds, values = _as_calibration_map(thresholds, values)
        self.thresholds = thresholds
        self.values = values

    @property
    def fitted(self) -> bool:
        """Whether the map is set (by `fit` or the constructor)."""
        return self.thresholds is not None

    def fit(self, certainty: ArrayLike, correct: ArrayLike) -> CertaintyCalibrator:
        """Fits the map on validation data; returns the calibrator.

        Args:
            certainty: array-like `(num_examples,)`, certainty on
                in-distribution validation data (not the training data, on
                which the model is over-confident).
            correct: array-like `(num_examples,)` of bools (or 0/1), whether
                each prediction is right; both outcomes must occur.

        Returns:
            `self`, fitted.
        """
        # Fitted on float32 values, the certainty a model outputs, so that
        # every threshold is exactly representable in the float32 map.
        certainty = _as_certainty("certainty", certainty).astype("float32")
        correct = _as_correct("correct", correct, len(certainty))
        _check_both_outcomes(
            correct,
            "Fitting a calibrator",
            "A map fitted on one outcome would be constant. Fit on more (or "
            "harder) validation examples.",
        )
        from sklearn.isotonic import IsotonicRegression

        isotonic = IsotonicRegression(
            y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip"
        )
        isotonic.fit(certainty.astype("float64"), correct.astype("float64"))
        self.thresholds, self.values = _as_calibration_map(
            isotonic.X_thresholds_, isotonic.y_thresholds_
        )
        return self

    def __call__(self, certainty: ArrayLike | Tensor) -> np.ndarray | Tensor:
        """The probability that each prediction is right.

        Args:
            certainty: certainties of any shape: a numpy array (or list), or
                a backend tensor (also symbolic, inside `tf.function`).

        Returns:
            float32 probabilities of the same shape: a numpy array for numpy
            input, otherwise a backend tensor.
        """
        if not self.fitted:
            raise ValueError(
                "This CertaintyCalibrator is not fitted yet. Call "
                "`calibrator.fit(val_certainty, val_correct)` first, or load a "
                "fitted one with `CertaintyCalibrator.load(path)`."
            )
        probability = _piecewise_linear(certainty, self.thresholds, self.values)
        if isinstance(certainty, (np.ndarray, np.generic, list, tuple, float, int)):
            return ops.convert_to_numpy(probability)
        return probability

    def get_config(self) -> dict[str, Any]:
        """The map as a JSON-serialisable dict (lists of floats, or None)."""
        if not self.fitted:
            return {"thresholds": None, "values": None}
        return {
            "thresholds": [float(x) for x in self.thresholds],
            "values": [float(y) for y in self.values],
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CertaintyCalibrator:
        """Rebuilds a calibrator from `get_config()`."""
        return cls(**config)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the fitted map to a JSON file at `path`."""
        if not self.fitted:
            raise ValueError(
                "Only a fitted CertaintyCalibrator can be saved. Call "
                f"`fit(val_certainty, val_correct)` first. Received: `path={path!r}`"
            )
        with open(path, "w") as file:
            json.dump(
                {"class_name": type(self).__name__, "config": self.get_config()}, file
            )

    @classmethod
    def load(cls, path: str | os.PathLike) -> CertaintyCalibrator:
        """Reads a calibrator written by `save(path)`."""
        with open(path) as file:
            saved = json.load(file)
        if not isinstance(saved, dict) or saved.get("class_name") != cls.__name__:
            raise ValueError(
                f"Expected a file written by `{cls.__name__}.save`. Received: "
                f"`path={path!r}` holding {str(saved)[:80]!r}"
            )
        return cls.from_config(saved["config"])

    def __repr__(self) -> str:
        size = "not fitted" if not self.fitted else f"{len(self.thresholds)} knots"
        return f"<CertaintyCalibrator ({size})>"


def _piecewise_linear(x, thresholds, values):
    """The calibration map at `x`: linear between knots, constant outside.

    Only `keras.ops`, so it runs on every backend and inside traced graphs.
    The segment is a count of knots at or below `x` (what `digitize` gives),
    not `digitize` or `searchsorted`: older Keras 3 lacks `searchsorted`,
    and ONNX and OpenVINO have no operator for TensorFlow's `Bucketize`.
    """
    x = ops.cast(ops.convert_to_tensor(x), "float32")
    if len(thresholds) == 1:
        return ops.full_like(x, values[0])
    knots_below = ops.greater_equal(ops.expand_dims(x, -1), thresholds)
    segment = ops.sum(ops.cast(knots_below, "int32"), axis=-1)
    segment = ops.clip(segment - 1, 0, len(thresholds) - 2)
    low_x = _select(thresholds, segment)
    high_x = _select(thresholds, segment + 1)
    low_y = _select(values, segment)
    high_y = _select(values, segment + 1)
    weight = ops.clip((x - low_x) / (high_x - low_x), 0.0, 1.0)
    # The minimum keeps float32 rounding from stepping above the next knot,
    # so the map stays monotone.
    return ops.minimum(low_y + weight * (high_y - low_y), high_y)


def _select(table, index):
    """`table[index]` as a masked sum (exact: one term is not zero).

    Not `take`: PyTorch's ONNX exporter has no operator for the flattening
    inside Keras's `take` on PyTorch.
    """
    # A constant, not `ops.arange`: jax2onnx's `arange` needs a stop value.
    positions = np.arange(len(table), dtype="int32")
    matches = ops.equal(ops.expand_dims(index, -1), positions)
    table = ops.convert_to_tensor(table, "float32")
    return ops.sum(ops.where(matches, table, 0.0), axis=-1)


def _as_calibration_map(thresholds, values):
    thresholds = np.asarray(thresholds, dtype="float32")
    values = np.asarray(values, dtype="float32")
    problem = None
    if thresholds.ndim != 1 or len(thresholds) == 0 or values.shape != thresholds.shape:
        problem = "1-D arrays of the same, non-zero length"
    elif not (np.all(np.isfinite(thresholds)) and np.all(np.isfinite(values))):
        problem = "finite values"
    elif np.any(np.diff(thresholds) <= 0):
        problem = "strictly increasing `thresholds`"
    elif np.any(np.diff(values) < 0) or values.min() < 0 or values.max() > 1:
        problem = "non-decreasing `values` in [0, 1]"
    if problem:
        raise ValueError(
            f"A calibration map needs {problem}. Pass the arrays of a fitted "
            "calibrator's `get_config()`, or call `fit`. Received: "
            f"`thresholds` {thresholds.tolist()[:5]}, `values` {values.tolist()[:5]}"
        )
    return thresholds, values


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


def _count_for_fraction(total, fraction):
    # Rounded before the ceiling so that 0.9 * 10 (9.000000000000002 in
    # floating point) counts 9 examples, not 10.
    return max(1, math.ceil(round(fraction * total, 9)))


def _check_both_outcomes(correct, what, fix):
    if correct.all() or not correct.any():
        raise ValueError(
            f"{what} needs both correct and wrong predictions, but all "
            f"predictions are {'correct' if correct.all() else 'wrong'}. {fix} "
            f"Received: {len(correct)} predictions"
        )


def _check_fraction(name, value):
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= 1
    ):
        raise ValueError(
            f"Expected `{name}` to be a fraction in (0, 1], e.g. 0.95. "
            f"Received: `{name}={value!r}`"
        )


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

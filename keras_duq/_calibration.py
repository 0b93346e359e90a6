"""`CertaintyCalibrator`: DUQ's certainty mapped to the probability of a correct prediction."""

from __future__ import annotations

import json
import os
from typing import Any

import keras
import numpy as np
from keras import ops
from numpy.typing import ArrayLike

from keras_duq._evaluation_inputs import as_certainty
from keras_duq._evaluation_inputs import as_correct
from keras_duq._evaluation_inputs import check_both_outcomes
from keras_duq._typing import Tensor

# `log K` is floored here before the calibrator's features are taken: kernel
# values underflow to 0 far from every centroid, and a floor keeps the
# features finite (exp(-80) is below float32's smallest normal number).
LOG_KERNEL_FLOOR = -80.0


@keras.saving.register_keras_serializable(package="keras_duq")
class CertaintyCalibrator:
    """Maps kernel values (or certainty) to the probability that the prediction is right.

    DUQ's certainty is a kernel value: it ranks examples well, but
    `certainty == 0.8` does not mean "right 80% of the time", and it says how
    far an input is from the training data, not how close the call between
    two classes was. Fitted on the kernel values `(num_examples,
    num_classes)`, the calibrator uses both: a logistic regression of
    `correct` on the distance (`log` of the largest kernel value) and the
    ambiguity (its margin over the second largest, and over the mean of all
    classes, in `log` space), kept as `weights` (three floats) and `bias`.
    Fitted on certainties `(num_examples,)` (or softmax and ensemble
    confidences), it is an isotonic regression (scikit-learn's
    `IsotonicRegression`, increasing, values in `[0, 1]`), kept as two
    float32 arrays `thresholds` and `values`: piecewise linear between them,
    constant outside.

    Calling the calibrator uses only `keras.ops`, so it runs on numpy arrays
    (returning numpy), and on backend tensors (returning a tensor), inside a
    `tf.function` or a `jax.jit` too, e.g. in a serving signature. It is
    computed in float32.

    Save it on its own with `save(path)` / `CertaintyCalibrator.load(path)`
    (a small JSON file), or inside a Keras config through `get_config()` /
    `from_config()` (registered as `"keras_duq>CertaintyCalibrator"`).

    Example:

    ```python
    val_kernel_values = model.predict(x_val)
    calibrator = keras_duq.evaluation.CertaintyCalibrator().fit(
        val_kernel_values, val_kernel_values.argmax(axis=1) == y_val
    )
    probability_correct = calibrator(model.predict(x_test))
    calibrator.save("calibrator.json")
    calibrator = keras_duq.evaluation.CertaintyCalibrator.load("calibrator.json")
    ```

    Args:
        thresholds: optional, a fitted map's increasing scores (as in
            `get_config()`); leave unset and call `fit`.
        values: optional, the probabilities at `thresholds`, non-decreasing
            in `[0, 1]`.
        weights: optional, with `bias`: a fitted map's score weights
            (distance, margin to the second class, margin to the mean; a map
            saved with two weights uses the first two), for a map over
            kernel values.
        bias: optional float, the score's bias.
    """

    def __init__(
        self,
        thresholds: ArrayLike | None = None,
        values: ArrayLike | None = None,
        weights: ArrayLike | None = None,
        bias: float | None = None,
    ) -> None:
        if (
            (thresholds is None) != (values is None)
            or (weights is None) != (bias is None)
            or (thresholds is not None and weights is not None)
        ):
            raise ValueError(
                "Pass both `thresholds` and `values` (a map over certainties) "
                "or both `weights` and `bias` (a map over kernel values), as "
                "in `get_config()`, or none of them and call `fit`. Received: "
                f"`thresholds={thresholds!r}`, `values={values!r}`, "
                f"`weights={weights!r}`, `bias={bias!r}`"
            )
        if thresholds is not None:
            thresholds, values = _as_calibration_map(thresholds, values)
        if weights is not None:
            weights = np.asarray(weights, dtype="float32")
            if weights.shape not in ((2,), (3,)) or not np.isfinite(weights).all():
                raise ValueError(
                    "Expected `weights` to be three finite floats (distance, "
                    "margin to the second class, margin to the mean), or two "
                    "(a map saved without the last), as in `get_config()`. "
                    f"Received: `weights={weights!r}`"
                )
            bias = float(bias)
        self.thresholds = thresholds
        self.values = values
        self.weights = weights
        self.bias = bias

    @property
    def fitted(self) -> bool:
        """Whether the map is set (by `fit` or the constructor)."""
        return self.thresholds is not None or self.weights is not None

    def fit(self, scores: ArrayLike, correct: ArrayLike) -> CertaintyCalibrator:
        """Fits the map on validation data; returns the calibrator.

        Args:
            scores: array-like, on in-distribution validation data (not the
                training data, on which the model is over-confident): the
                kernel values `(num_examples, num_classes)` (`predict`'s
                output), or certainties `(num_examples,)`.
            correct: array-like `(num_examples,)` of bools (or 0/1), whether
                each prediction is right; both outcomes must occur.

        Returns:
            `self`, fitted.
        """
        kernel_values = np.asarray(scores, dtype="float32")
        per_class = kernel_values.ndim == 2
        if per_class:
            if kernel_values.shape[0] == 0 or kernel_values.shape[1] < 2:
                raise ValueError(
                    "Expected kernel values of shape (num_examples, num_classes) "
                    "with at least one example and two classes, or certainties "
                    f"(num_examples,). Received: `scores` of shape {kernel_values.shape}"
                )
            check_finite_scores("scores", kernel_values)
            features = ops.convert_to_numpy(_score_features(kernel_values))
        else:
            # Fitted on float32 values, the certainty a model outputs, so that
            # every threshold is exactly representable in the float32 map.
            certainty = as_certainty("scores", scores).astype("float32")
        correct = as_correct("correct", correct, len(kernel_values))
        check_both_outcomes(
            correct,
            "Fitting a calibrator",
            "A map fitted on one outcome would be constant. Fit on more (or "
            "harder) validation examples.",
        )
        from sklearn.isotonic import IsotonicRegression

        if per_class:
            from sklearn.linear_model import LogisticRegression

            regression = LogisticRegression(C=1.0).fit(features, correct)
            self.weights = regression.coef_[0].astype("float32")
            self.bias = float(regression.intercept_[0])
            # The logistic map itself: strictly monotone in its score, so it
            # keeps every distinction between examples, where an isotonic
            # step on few validation mistakes would tie most of them (and
            # with them out-of-distribution inputs).
            self.thresholds = self.values = None
            return self
        self.weights = self.bias = None
        isotonic = IsotonicRegression(
            y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip"
        )
        isotonic.fit(certainty.astype("float64"), correct.astype("float64"))
        self.thresholds, self.values = _as_calibration_map(
            isotonic.X_thresholds_, isotonic.y_thresholds_
        )
        return self

    @property
    def takes_kernel_values(self) -> bool:
        """Whether the map was fitted on kernel values (else on certainties)."""
        return self.weights is not None

    def __call__(self, scores: ArrayLike | Tensor) -> np.ndarray | Tensor:
        """The probability that each prediction is right.

        Args:
            scores: what the map was fitted on: kernel values `(...,
                num_classes)`, or certainties of any shape; a numpy array (or
                list), or a backend tensor (also symbolic, inside
                `tf.function`).

        Returns:
            float32 probabilities, one per example: a numpy array for numpy
            input, otherwise a backend tensor.
        """
        if not self.fitted:
            raise ValueError(
                "This CertaintyCalibrator is not fitted yet. Call "
                "`calibrator.fit(val_kernel_values, val_correct)` first, or load a "
                "fitted one with `CertaintyCalibrator.load(path)`."
            )
        values = scores
        if isinstance(scores, (np.ndarray, list, tuple)) and np.size(scores) == 0:
            # No examples: TensorFlow's eager `max` refuses an empty tensor.
            shape = np.shape(scores)
            return np.zeros(shape[:-1] if self.takes_kernel_values else shape, "float32")
        if self.takes_kernel_values:
            shape = getattr(scores, "shape", None)
            if shape is None:
                shape = np.shape(scores)
            if len(shape) < 2:
                raise ValueError(
                    "This calibrator was fitted on kernel values (num_examples, "
                    "num_classes): pass `model.predict(x)`, not the certainty. "
                    f"Received: scores of shape {tuple(shape)}"
                )
            probability = ops.sigmoid(
                _score(_score_features(scores), self.weights, self.bias)
            )
        else:
            probability = _piecewise_linear(values, self.thresholds, self.values)
        if isinstance(scores, (np.ndarray, np.generic, list, tuple, float, int)):
            return ops.convert_to_numpy(probability)
        return probability

    def get_config(self) -> dict[str, Any]:
        """The map as a JSON-serialisable dict (lists of floats, or None)."""
        if self.takes_kernel_values:
            return {
                "thresholds": None,
                "values": None,
                "weights": [float(w) for w in self.weights],
                "bias": self.bias,
            }
        if not self.fitted:
            return {"thresholds": None, "values": None, "weights": None, "bias": None}
        return {
            "thresholds": [float(x) for x in self.thresholds],
            "values": [float(y) for y in self.values],
            "weights": None,
            "bias": None,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CertaintyCalibrator:
        """Rebuilds a calibrator from `get_config()`.

        Args:
            config: dict, what `get_config()` returned.
        """
        return cls(**config)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the fitted map to a JSON file (`CertaintyCalibrator.load` reads it).

        Args:
            path: str or path-like, the file to write.
        """
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
        """Reads a calibrator written by `save(path)`.

        Args:
            path: str or path-like, the JSON file `save` wrote.
        """
        with open(path) as file:
            saved = json.load(file)
        if not isinstance(saved, dict) or saved.get("class_name") != cls.__name__:
            raise ValueError(
                f"Expected a file written by `{cls.__name__}.save`. Received: "
                f"`path={path!r}` holding {str(saved)[:80]!r}"
            )
        return cls.from_config(saved["config"])

    def __repr__(self) -> str:
        if self.takes_kernel_values:
            state = "on kernel values"
        elif self.fitted:
            state = f"{len(self.thresholds)} knots"
        else:
            state = "not fitted"
        return f"<CertaintyCalibrator ({state})>"


def _score_features(kernel_values):
    """`(..., 3)`: the distance and the ambiguity of each row of kernel values.

    Distance: `log` of the largest kernel value (low far from every
    centroid). Ambiguity: its margin over the second largest in `log` space
    (small where two classes are about as close), and over the mean of all
    classes (small where several are: with ten or more classes the second
    largest alone missed it, docs/reports/mistakes.md). All from `log K`
    floored at `LOG_KERNEL_FLOOR`. Only `keras.ops` (no `top_k`), so it runs
    in every export format.
    """
    kernel_values = ops.cast(ops.convert_to_tensor(kernel_values), "float32")
    log_kernel = ops.maximum(
        ops.log(ops.maximum(kernel_values, 1e-38)), LOG_KERNEL_FLOOR
    )
    largest = ops.max(log_kernel, axis=-1, keepdims=True)
    # The largest value masked to the floor: the second largest, or the
    # largest again where two classes tie (a margin of 0).
    ties = ops.sum(ops.cast(ops.greater_equal(log_kernel, largest), "int32"), axis=-1)
    second = ops.max(
        ops.where(ops.greater_equal(log_kernel, largest), LOG_KERNEL_FLOOR, log_kernel),
        axis=-1,
    )
    mean = ops.mean(log_kernel, axis=-1)
    largest = ops.squeeze(largest, -1)
    second = ops.where(ops.greater(ties, 1), largest, second)
    return ops.stack([largest, largest - second, largest - mean], axis=-1)


def _score(features, weights, bias):
    """The logistic regression's score (its logit) of `_score_features`.

    `weights` may be shorter than the features (a map saved with fewer):
    the first ones are used.
    """
    weights = np.asarray(weights, "float32")
    features = ops.cast(features[..., : len(weights)], "float32")
    return ops.sum(features * ops.convert_to_tensor(weights), axis=-1) + bias


def check_finite_scores(name, values):
    if not np.isfinite(values).all():
        raise ValueError(
            f"Expected `{name}` to be finite kernel values in [0, 1]. "
            f"Received: `{name}` with NaN or Inf"
        )


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

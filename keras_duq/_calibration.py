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
        certainty = as_certainty("certainty", certainty).astype("float32")
        correct = as_correct("correct", correct, len(certainty))
        check_both_outcomes(
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

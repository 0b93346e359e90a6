"""`DUQBatchError`: what a rejected batch or training step raises, on every backend."""

from __future__ import annotations

from typing import Any

from keras_duq._validation import FRACTIONAL_LABEL_MESSAGE
from keras_duq._validation import NON_FINITE_CENTROID_MESSAGE
from keras_duq._validation import NON_FINITE_INPUT_MESSAGE
from keras_duq._validation import NON_FINITE_LABEL_MESSAGE
from keras_duq._validation import NON_FINITE_STEP_MESSAGE
from keras_duq._validation import is_float
from keras_duq._validation import label_range_message
from keras_duq._validation import label_shape_message
from keras_duq._validation import soft_label_message

# Error codes of a batch or step, as the steps compute them; 0 means none.
LABEL_RANGE, FRACTIONAL_LABEL, NON_FINITE_INPUT = 1, 2, 3
NON_FINITE_STEP, NON_FINITE_CENTROIDS = 4, 5
# Labels whose shape only the batch tells (TensorFlow's relaxed retraces).
LABEL_SHAPE = 6
# A one-hot row that is not exactly one 1 and zeros (soft or smoothed
# labels), and a label that is NaN or infinite. Higher codes win within a
# batch (`ops.max`): a NaN label is named as such, not as "fractional".
SOFT_LABEL, NON_FINITE_LABEL = 7, 8
BATCH_ERRORS = (
    LABEL_RANGE,
    FRACTIONAL_LABEL,
    NON_FINITE_INPUT,
    LABEL_SHAPE,
    SOFT_LABEL,
    NON_FINITE_LABEL,
)
REASONS = {
    LABEL_RANGE: "label_range",
    FRACTIONAL_LABEL: "fractional_label",
    NON_FINITE_INPUT: "non_finite_input",
    NON_FINITE_STEP: "non_finite_step",
    NON_FINITE_CENTROIDS: "non_finite_centroids",
    LABEL_SHAPE: "label_shape",
    SOFT_LABEL: "soft_label",
    NON_FINITE_LABEL: "non_finite_label",
}


def is_one_hot(shape: tuple, num_classes: int) -> bool:
    """Whether labels of `shape` are one-hot (else class indices).

    Raises the label shape error for a shape that is neither `(batch,
    num_classes)` nor `(batch,)` / `(batch, 1)`.
    """
    if len(shape) == 2 and shape[-1] == num_classes:
        return True
    if len(shape) == 1 or (len(shape) == 2 and shape[-1] == 1):
        return False
    raise ValueError(label_shape_message(num_classes, shape))


def label_codes(labels: Any, num_classes: int, xp: Any) -> Any:
    """The error code of each class-index label `(batch,)`: 0 when valid.

    `FRACTIONAL_LABEL` for a float label that is not whole (NaN included),
    else `LABEL_RANGE` outside `[0, num_classes)`. The one rule of what a
    valid label value is: `xp` is `numpy` for in-memory labels, checked
    whole before a call, or `keras.ops` for each batch inside the step.
    """
    codes = xp.where(xp.logical_and(labels >= 0, labels < num_classes), 0, LABEL_RANGE)
    if is_float(labels.dtype):
        codes = xp.where(xp.equal(labels, xp.floor(labels)), codes, FRACTIONAL_LABEL)
        codes = xp.where(xp.isfinite(labels), codes, NON_FINITE_LABEL)
    return codes


def one_hot_codes(labels: Any, xp: Any) -> Any:
    """The error code of each one-hot label row `(batch, num_classes)`: 0 when valid.

    A valid row holds exactly one 1 and zeros elsewhere. `NON_FINITE_LABEL`
    for a row with NaN or Inf, else `SOFT_LABEL` for any other row (soft or
    smoothed labels, several or no 1s), which DUQ's per-class targets and
    centroid counts would silently misread. The one rule of what a valid
    one-hot row is, for `xp` = `numpy` or `keras.ops` as in `label_codes`.
    """
    binary = xp.logical_or(xp.equal(labels, 0), xp.equal(labels, 1))
    valid = xp.logical_and(xp.all(binary, axis=-1), xp.equal(xp.sum(labels, axis=-1), 1))
    codes = xp.where(valid, 0, SOFT_LABEL)
    if is_float(labels.dtype):
        finite = xp.all(xp.isfinite(labels), axis=-1)
        codes = xp.where(finite, codes, NON_FINITE_LABEL)
    return codes


def error_message(code: int, num_classes: int) -> str:
    """The message of a non-zero error code."""
    return {
        LABEL_RANGE: label_range_message(num_classes),
        FRACTIONAL_LABEL: FRACTIONAL_LABEL_MESSAGE,
        NON_FINITE_INPUT: NON_FINITE_INPUT_MESSAGE,
        NON_FINITE_STEP: NON_FINITE_STEP_MESSAGE,
        NON_FINITE_CENTROIDS: NON_FINITE_CENTROID_MESSAGE,
        LABEL_SHAPE: label_shape_message(num_classes, "other than these"),
        SOFT_LABEL: soft_label_message(num_classes),
        NON_FINITE_LABEL: NON_FINITE_LABEL_MESSAGE,
    }[code]


class DUQBatchError(ValueError):
    """A batch or training step that DUQ's step rejected before it changed anything.

    Raised by `fit`, `evaluate`, `train_on_batch` and `test_on_batch` on
    every backend when a batch holds labels out of range, fractional, NaN or
    soft (one-hot rows other than one 1 and zeros), or (on TensorFlow) of a
    shape only the batch tells, or non-finite inputs,
    or when a training step's loss, gradients or centroid
    update are not finite. The rejected batch changed no weight, centroid,
    optimizer slot or `optimizer.iterations`.

    Example:

    ```python
    try:
        model.fit(dataset, epochs=3)
    except keras_duq.DUQBatchError as error:
        print(error.reason, error.steps_applied)
    ```

    Args:
        reason: `"label_range"`, `"fractional_label"`, `"label_shape"`,
            `"soft_label"`, `"non_finite_label"`, `"non_finite_input"`, `"non_finite_step"` or
            `"non_finite_centroids"`; kept as the
            attribute `reason`.
        message: what happened and how to fix it.
        steps_applied: in `fit`, the training steps of the call that were
            applied before the rejected batch, which the model keeps;
            `None` elsewhere. Kept as the attribute `steps_applied`.
    """

    def __init__(
        self, reason: str, message: str, steps_applied: int | None = None
    ) -> None:
        self.reason = reason
        self.steps_applied = steps_applied
        # Without the count: `_after_steps` adds its own.
        self._cause = message
        if steps_applied is not None:
            message = (
                f"{message} The rejected batch changed nothing; {steps_applied} "
                "training step(s) of this `fit` call were applied before it "
                "and the model keeps them."
            )
        super().__init__(message)

    def _after_steps(self, steps_applied: int) -> DUQBatchError:
        """The same error, saying how many steps of `fit` were applied before it."""
        return DUQBatchError(self.reason, self._cause, steps_applied)


def batch_error(code: int, num_classes: int) -> DUQBatchError:
    """The `DUQBatchError` of a non-zero error code."""
    code = int(code)
    return DUQBatchError(REASONS[code], error_message(code, num_classes))

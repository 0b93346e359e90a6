"""`DUQBatchError`: what a rejected batch or training step raises, on every backend."""

from __future__ import annotations

from keras_duq._validation import FRACTIONAL_LABEL_MESSAGE
from keras_duq._validation import NON_FINITE_CENTROID_MESSAGE
from keras_duq._validation import NON_FINITE_INPUT_MESSAGE
from keras_duq._validation import NON_FINITE_STEP_MESSAGE
from keras_duq._validation import label_range_message
from keras_duq._validation import label_shape_message

# Error codes of a batch or step, as the steps compute them; 0 means none.
LABEL_RANGE, FRACTIONAL_LABEL, NON_FINITE_INPUT = 1, 2, 3
NON_FINITE_STEP, NON_FINITE_CENTROIDS = 4, 5
# Labels whose shape only the batch tells (TensorFlow's relaxed retraces).
LABEL_SHAPE = 6
BATCH_ERRORS = (LABEL_RANGE, FRACTIONAL_LABEL, NON_FINITE_INPUT, LABEL_SHAPE)
REASONS = {
    LABEL_RANGE: "label_range",
    FRACTIONAL_LABEL: "fractional_label",
    NON_FINITE_INPUT: "non_finite_input",
    NON_FINITE_STEP: "non_finite_step",
    NON_FINITE_CENTROIDS: "non_finite_centroids",
    LABEL_SHAPE: "label_shape",
}


def error_message(code: int, num_classes: int) -> str:
    """The message of a non-zero error code."""
    return {
        LABEL_RANGE: label_range_message(num_classes),
        FRACTIONAL_LABEL: FRACTIONAL_LABEL_MESSAGE,
        NON_FINITE_INPUT: NON_FINITE_INPUT_MESSAGE,
        NON_FINITE_STEP: NON_FINITE_STEP_MESSAGE,
        NON_FINITE_CENTROIDS: NON_FINITE_CENTROID_MESSAGE,
        LABEL_SHAPE: label_shape_message(num_classes, "other than these"),
    }[code]


class DUQBatchError(ValueError):
    """A batch or training step that DUQ's step rejected before it changed anything.

    Raised by `fit`, `evaluate`, `train_on_batch` and `test_on_batch` on
    every backend when a batch holds labels out of range or fractional (or,
    on TensorFlow, of a shape only the batch tells), or non-finite inputs,
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
            `"non_finite_input"`, `"non_finite_step"` or
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

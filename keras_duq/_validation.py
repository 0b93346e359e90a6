"""Argument checks shared by the library, with Keras-style messages."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from keras_duq._typing import Tensor


def check_int(name: str, value: Any, minimum: int) -> None:
    """Raises a `ValueError` unless `value` is an int >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"Expected `{name}` to be an integer >= {minimum}. "
            f"Received: `{name}={value!r}`"
        )


def check_non_negative(name: str, value: Any) -> None:
    """Raises a `ValueError` unless `value` is a number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(
            f"Expected `{name}` to be a float >= 0. Received: `{name}={value!r}`"
        )


def check_positive(name: str, value: Any, detail: str = "") -> None:
    """Raises a `ValueError` unless `value` is a finite number > 0.

    `detail`, if given, follows "a float > 0" in the message.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value < float("inf")
    ):
        detail = f" {detail}" if detail else ""
        raise ValueError(
            f"Expected `{name}` to be a float > 0{detail}. Received: `{name}={value!r}`"
        )


def check_positive_int(name: str, value: Any) -> None:
    """Raises a `ValueError` unless `value` is an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"Expected `{name}` to be an integer >= 1. Received: `{name}={value!r}`"
        )


# Shared by every guard against non-finite training state.
NON_FINITE_TRAINING_MESSAGE = (
    "a non-finite value (NaN or Inf) appeared in training, so this update "
    "was not applied (the weights and centroids keep their last finite "
    "values) and training stopped. Likely causes, most common first: inputs "
    "that are not normalised (e.g. raw 0-255 pixels: scale them to about "
    "unit variance); a learning rate that is too high (lower it, or clip "
    "gradients harder with the model's `clipnorm`); a `length_scale` that "
    "is too small for the scale of the features (try a larger one); a "
    "backbone with BatchNormalization whose weights grow faster than its "
    "moving statistics follow (SGD at a high rate from scratch): the "
    "inference-mode features that update the centroids run away (keep "
    "gradient clipping on: the model's `clipnorm`, 1.0 unless it was turned "
    "off, or the optimizer's; or pass `projection_learning_rate=1.0`)."
)

NON_FINITE_STEP_MESSAGE = (
    "DUQModel: a training step produced a non-finite loss or gradient: "
    + NON_FINITE_TRAINING_MESSAGE
)
NON_FINITE_CENTROID_MESSAGE = (
    "DUQOutput: the centroid update is not finite: " + NON_FINITE_TRAINING_MESSAGE
)
NON_FINITE_INPUT_MESSAGE = (
    "DUQModel received an input batch containing NaN or Inf values. Clean or "
    "impute the data before training (e.g. `np.nan_to_num`); the gradient "
    "penalty and the centroids cannot recover from a non-finite input."
)
FRACTIONAL_LABEL_MESSAGE = (
    "Labels must be whole class indices, but a fractional label (e.g. 0.5) "
    "was found. Pass integer class indices, or one-hot labels of shape "
    "(batch, num_classes)."
)
NON_FINITE_LABEL_MESSAGE = (
    "Labels must be finite class indices or one-hot rows, but a NaN or "
    "infinite label was found. Drop or fix the examples whose label is "
    "missing before training."
)


def soft_label_message(num_classes: int) -> str:
    return (
        f"One-hot labels of shape (batch, {num_classes}) must hold exactly one "
        "1 and zeros in each row, but a soft or smoothed row (e.g. [0.7, 0.3]) "
        "was found. DUQ trains each class's kernel towards 0 or 1 and moves "
        "each centroid with its own class's examples, so soft labels are not "
        "supported: pass hard labels, e.g. `y.argmax(axis=-1)` as class "
        "indices, and leave label smoothing out."
    )


def label_range_message(num_classes: int) -> str:
    return (
        f"Labels must be class indices in [0, {num_classes}) for this model "
        f"with num_classes={num_classes}, but a label outside that range was "
        "found. Check the labels, or build the model with the right "
        "`num_classes`."
    )


def _label_formats(num_classes: int) -> str:
    return f"(batch,) or (batch, 1) class indices, or one-hot (batch, {num_classes})"


def label_shape_message(num_classes: int, shape: Any) -> str:
    return (
        f"Expected labels of shape {_label_formats(num_classes)} for this "
        f"model with num_classes={num_classes}. Received: labels of shape "
        f"{shape}. If the labels are one-hot for a different number of "
        "classes, build the model with that `num_classes`."
    )


def own_loss_message(loss: Any) -> str:
    return (
        "DUQModel computes its own loss (binary cross-entropy on the kernel "
        "values, the categorical term over distances to the centroids and the "
        "gradient penalty). Remove `loss` from `compile()`. "
        f"Received: `loss={loss!r}`"
    )


def label_dtype_message(num_classes: int, dtype: Any) -> str:
    return (
        f"Expected numeric labels: {_label_formats(num_classes)}. Received: "
        f"labels of dtype {dtype}."
    )


def standardize_inputs(specs: Any, x: Any) -> Any:
    """Casts inputs declared floating point to their declared dtype.

    Integer images (`uint8`) must become floats before the penalty's input
    gradient is taken; integer inputs declared as such (token ids) stay.
    """
    from keras import ops

    def cast(spec: keras.KerasTensor, value: Any) -> Tensor:
        value = ops.convert_to_tensor(value)
        dtype = keras.backend.standardize_dtype(value.dtype)
        if is_float(spec.dtype) and dtype != spec.dtype:
            return ops.cast(value, spec.dtype)
        return value

    try:
        return keras.tree.map_structure(cast, specs, x)
    except (ValueError, TypeError):
        # A structure Keras accepts but that differs from the declared
        # one (e.g. a list for a dict); the functional call maps it.
        return keras.tree.map_structure(ops.convert_to_tensor, x)


def is_float(dtype: Any) -> bool:
    """Whether `dtype` (any form Keras accepts) is a floating-point type."""
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype))


def finite_row_mask(array: Any, xp: Any) -> Any:
    """`(batch,)` bool: whether each row (first axis) of a float `array` is finite.

    The one rule of a finite input example: `xp` is `numpy` for in-memory
    data, checked before a call, or `keras.ops` inside the model and its
    exports. `|x| < inf` rather than `isfinite`: it converts to every export
    format's runtime.
    """
    rows = xp.reshape(array, (xp.shape(array)[0], -1))
    return xp.all(xp.less(xp.abs(rows), float("inf")), axis=1)


def non_finite_rows(array: np.ndarray) -> np.ndarray:
    """The indices of the rows (first axis) of `array` holding NaN or Inf.

    A sum is one fast pass; the exact check runs only where it is not finite
    (or a large sum overflowed). Integer arrays are always finite.
    """
    array = np.asarray(array)
    if array.dtype.kind not in "fc":
        return np.zeros((0,), np.int64)
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.sum(array)):
            return np.zeros((0,), np.int64)
        rows = array if array.ndim else array.reshape(1)
        return np.flatnonzero(~finite_row_mask(rows, np))

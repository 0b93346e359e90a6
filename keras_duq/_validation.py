"""Checks of arguments and data, with Keras-style messages, for the whole library.

Arguments: `check_int`, `check_positive` and the messages of bad labels,
inputs and steps. The error codes that the training and test steps compute
for a batch they reject, and `DUQBatchError`, what such a batch raises on
every backend.

Data, before `fit`, `evaluate` or `predict` changes anything: in-memory data
(NumPy arrays, backend tensors, lists and dicts of them) is checked whole,
in one vectorised pass per array, before the first step: inputs against the
model's input shapes, emptiness, non-finite inputs (not in `predict`, which
returns NaN for such rows), and the labels' format and values. A batch check
inside the step would find a bad label only when its batch comes, after the
earlier batches have trained the model. Streams (`tf.data`, generators,
`PyDataset`) are checked batch by batch in the step; an empty
`tf.data.Dataset` of known size is rejected here.
"""

from __future__ import annotations

import sys
from typing import Any

import keras
import numpy as np

from keras_duq import _compat
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
    valid = xp.logical_and(
        xp.all(binary, axis=-1), xp.equal(xp.sum(labels, axis=-1), 1)
    )
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


NO_LABELS_MESSAGE = (
    "DUQModel needs labels to train and evaluate: pass `y` (or a dataset of "
    "`(x, y)` pairs)."
)


def lists_as_arrays(model: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments with Python lists of labels (and of a single
    input's rows) as NumPy arrays: Keras reads a list as one array per
    model input or output, and its error then names `x` for labels."""
    arguments = dict(arguments)
    single_input = len(model.feature_extractor.inputs) == 1
    for name in ("x", "y"):
        value = arguments.get(name)
        if isinstance(value, list) and (name == "y" or single_input):
            try:
                arguments[name] = np.asarray(value)
            except ValueError:  # ragged: the data check reports it
                pass
    validation = arguments.get("validation_data")
    if isinstance(validation, tuple) and len(validation) >= 2:
        if isinstance(validation[1], list):
            arguments["validation_data"] = (
                validation[0],
                np.asarray(validation[1]),
                *validation[2:],
            )
    return arguments


def check_call_data(model: Any, method: str, arguments: dict[str, Any]) -> None:
    """Raises a `ValueError` for bad data of a `fit`/`evaluate`/`predict` call.

    `arguments` maps every parameter of the Keras method to its value.
    Nothing is changed, so a rejected call leaves the model as it was.
    """
    x, y = arguments.get("x"), arguments.get("y")
    weights = arguments.get("sample_weight")
    validation = arguments.get("validation_data")
    if isinstance(validation, (tuple, list)):
        validation = keras.utils.unpack_x_y_sample_weight(tuple(validation))
    else:
        validation = None  # a dataset: checked batch by batch
    if method != "predict":
        # Labels that are not numbers (strings, objects), before Keras's data
        # adapter fails on them with a bare dtype error.
        for labels in (y, validation and validation[1]):
            dtype = array_dtype(labels)
            if dtype is not None and dtype.kind not in "iuf":
                raise ValueError(label_dtype_message(model.num_classes, dtype))
    if x is None:
        raise ValueError(
            f"`{method}` received no data. Pass `x` (arrays, a "
            "`tf.data.Dataset`, a generator or a `keras.utils.PyDataset`). "
            "Received: `x=None`"
        )
    _check_text_inputs(model.feature_extractor.input, x)
    _check_class_weight(arguments.get("class_weight"), model.num_classes)
    _check_dataset_not_empty(method, "x", x)
    _check_dataset_spec(method, model.feature_extractor.input, x)
    if not _compat.is_array_data(x, y, weights):
        return
    inputs = model.feature_extractor.input
    check_arrays(
        method, inputs, x, y, model.num_classes, "x", labels=method != "predict"
    )
    if validation is not None:
        val_x, val_y, val_weights = validation
        if _compat.is_array_data(val_x, val_y, val_weights):
            check_arrays(
                method, inputs, val_x, val_y, model.num_classes, "validation_data"
            )


def check_arrays(
    method: str,
    specs: Any,
    x: Any,
    y: Any,
    num_classes: int,
    name: str,
    labels: bool = True,
) -> None:
    """Checks in-memory inputs `x` (and labels `y` if `labels`) for one call."""
    pairs = _paired_inputs(specs, x)
    for path, spec, value in pairs:
        array = _as_array(value)
        where = f"`{name}{path}`"
        if array.ndim == 0 or array.shape[0] == 0:
            raise ValueError(
                f"`{method}` received empty data: {where} has no examples "
                f"(shape {array.shape}). Pass at least one example."
            )
        if spec is not None:
            _check_shape(where, spec, array)
        if method != "predict" and array.dtype.kind == "f":
            _check_finite(where, array)
    if not labels:
        return
    if y is None:
        raise ValueError(NO_LABELS_MESSAGE)
    label_name = "y" if name == "x" else f"{name}[1]"
    _check_labels(label_name, _as_array(y), num_classes)


def _is_text(value):
    if isinstance(value, str):
        return True
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], str):
        return True
    dtype = getattr(value, "dtype", None)
    return (
        isinstance(dtype, np.dtype)
        and dtype.kind in "USO"
        and (
            dtype.kind != "O"
            or (value.size and isinstance(value.flat[0], (str, bytes)))
        )
    )


def _check_text_inputs(specs, x):
    """Text where the model takes numbers: say how to feed text."""
    for path, spec, value in _paired_inputs(specs, x):
        if spec is None or spec.dtype == "string" or not _is_text(value):
            continue
        raise ValueError(
            f"`x{path}` holds text, but the model's input takes {spec.dtype} "
            "values. Put a `keras.layers.TextVectorization` layer at the start "
            "of the backbone with `keras.Input(shape=(1,), dtype='string')`, "
            "or pass token ids (integers) from a tokenizer, with an "
            "`Embedding` layer in the backbone. Received: "
            f"`x{path}` of text, e.g. {_first_item(value)!r:.80}"
        )


def _first_item(value):
    if isinstance(value, str):
        return value
    first = np.asarray(value).reshape(-1)[0]
    return first.item() if isinstance(first, np.generic) else first


def _check_class_weight(class_weight, num_classes):
    if class_weight is None:
        return
    if not isinstance(class_weight, dict):
        raise ValueError(
            "Expected `class_weight` to be a dict from class index to weight, "
            f"e.g. {{0: 1.0, 1: 5.0}}. Received: `class_weight={class_weight!r}`"
        )
    for key, weight in class_weight.items():
        valid_key = isinstance(key, (int, np.integer)) and not isinstance(key, bool)
        if not valid_key or not 0 <= key < num_classes:
            raise ValueError(
                f"`class_weight` names class {key!r}, but this model's classes "
                f"are the integers 0 to {num_classes - 1}. Drop the entry, or "
                "build the model with the right `num_classes`. Received: "
                f"`class_weight={class_weight!r}`"
            )
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float, np.number))
            or not (np.isfinite(weight) and weight >= 0)
        ):
            raise ValueError(
                "Expected each `class_weight` value to be a finite number >= 0. "
                f"Received: `class_weight[{key!r}]={weight!r}`"
            )


def _check_dataset_spec(method, specs, data):
    """A `tf.data.Dataset` whose inputs cannot match the model's, before a step."""
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(data, tf.data.Dataset):
        return
    element = data.element_spec
    if isinstance(element, tuple):
        element = element[0]
    for path, spec, value in _paired_inputs(specs, element):
        if spec is None or not isinstance(value, tf.TensorSpec):
            continue
        if value.shape.rank is None:
            continue
        expected, received = tuple(spec.shape), tuple(value.shape)
        if not _compatible(expected, received):
            raise ValueError(
                f"The dataset's inputs do not match the model's: expected "
                f"`x{path}` batches of shape {expected} (the batch axis first), "
                f"but the dataset's elements have shape {received}. Batch the "
                "dataset (`dataset.batch(32)`) or reshape its inputs in a "
                f"`dataset.map`. Received: the dataset passed to `{method}`"
            )


def _compatible(expected, received):
    """Whether inputs of shape `received` fit a declared `expected` (batch axis
    first; `None` on either side, an unknown size, matches any)."""
    return len(expected) == len(received) and all(
        e is None or r is None or e == r for e, r in zip(expected[1:], received[1:])
    )


def _check_dataset_not_empty(method, name, data):
    try:
        import tensorflow as tf
    except ImportError:  # pragma: no cover - TensorFlow is optional
        return
    if isinstance(data, tf.data.Dataset) and int(data.cardinality()) == 0:
        raise ValueError(
            f"`{method}` received empty data: the `tf.data.Dataset` passed "
            f"as `{name}` has no elements. Check its source and any `take`, "
            "`filter` or `batch(..., drop_remainder=True)` that emptied it."
        )


def _paired_inputs(specs, x):
    """`[(path, spec or None, value)]`: each input array with its declared spec."""
    if isinstance(specs, dict) and isinstance(x, dict):
        return [(f"[{key!r}]", specs.get(key), value) for key, value in x.items()]
    if isinstance(specs, (list, tuple)) and isinstance(x, (list, tuple)):
        if len(specs) == len(x):
            return [(f"[{i}]", s, v) for i, (s, v) in enumerate(zip(specs, x))]
        return [(f"[{i}]", None, v) for i, v in enumerate(x)]
    if isinstance(specs, keras.KerasTensor) and not isinstance(x, (list, tuple, dict)):
        return [("", specs, x)]
    return [(f"[{i}]", None, v) for i, v in enumerate(keras.tree.flatten(x))]


def _as_array(value):
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu()
    return np.asarray(value)


def _check_shape(where, spec, array):
    expected = tuple(spec.shape)
    received = array.shape
    if _compatible(expected, received):
        return
    hint = ""
    if len(received) == len(expected) - 1:
        if all(e is None or e == r for e, r in zip(expected[1:], received)):
            hint = " It looks like one example without its batch axis: use `x[None]`."
        elif all(e is None or e == r for e, r in zip(expected[1:-1], received[1:])):
            hint = " If the last axis is missing, add it: `x[..., None]`."
    raise ValueError(
        f"Expected {where} of shape {expected} (the batch axis first, as the "
        f"model's input declares).{hint} Received: {where} of shape {received}"
    )


def _check_finite(where, array):
    bad = non_finite_rows(array)
    if bad.size == 0:
        return
    raise ValueError(
        f"{NON_FINITE_INPUT_MESSAGE} Received: {where} with {bad.size} example(s) "
        f"containing NaN or Inf, the first at index {int(bad[0])}."
    )


def _check_labels(name, y, num_classes):
    if y.dtype.kind not in "iuf":
        return  # the label dtype check reports it
    one_hot = is_one_hot(y.shape, num_classes)
    labels = y if one_hot else y.reshape(-1)
    if labels.shape[0] == 0:
        raise ValueError(
            f"Received empty labels: `{name}` has no examples (shape {y.shape})."
        )
    with np.errstate(invalid="ignore"):
        if one_hot:
            codes = one_hot_codes(labels, np)
        else:
            codes = label_codes(labels, num_classes, np)
    for code, message in (
        (NON_FINITE_LABEL, NON_FINITE_LABEL_MESSAGE),
        (SOFT_LABEL, soft_label_message(num_classes)),
        (FRACTIONAL_LABEL, FRACTIONAL_LABEL_MESSAGE),
        (LABEL_RANGE, label_range_message(num_classes)),
    ):
        bad = np.flatnonzero(codes == code)
        if bad.size:
            i = int(bad[0])
            value = labels[i].tolist() if one_hot else labels[i].item()
            raise ValueError(
                f"{message} Received: `{name}[{i}]={value!r}` "
                f"({bad.size} such label(s))."
            )


def array_dtype(labels):
    """The NumPy dtype of in-memory labels (arrays, lists, pandas), else None."""
    if isinstance(labels, list):
        try:
            return np.asarray(labels).dtype
        except ValueError:  # ragged: Keras's adapter reports it
            return None
    dtype = getattr(labels, "dtype", None)
    return dtype if isinstance(dtype, np.dtype) else None


EMPTY_STREAM_MESSAGE = (
    "`{method}` received empty data: its input yielded no batches. Check the "
    "dataset, generator or `PyDataset` passed as `x` (and `steps`, if given)."
)

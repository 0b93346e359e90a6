"""Checks of a call's data before `fit`, `evaluate` or `predict` changes anything.

In-memory data (NumPy arrays, backend tensors, lists and dicts of them) is
checked whole, in one vectorised pass per array, before the first step:
inputs against the model's input shapes, emptiness, non-finite inputs (not
in `predict`, which returns NaN for such rows), and the labels' format and
values. A batch check inside the step would find a bad label only when its
batch comes, after the earlier batches have trained the model. Streams
(`tf.data`, generators, `PyDataset`) are checked batch by batch in the
step; an empty `tf.data.Dataset` of known size is rejected here.
"""

from __future__ import annotations

import sys
from typing import Any

import keras
import numpy as np

from keras_duq import _compat
from keras_duq._errors import FRACTIONAL_LABEL
from keras_duq._errors import LABEL_RANGE
from keras_duq._errors import NON_FINITE_LABEL
from keras_duq._errors import SOFT_LABEL
from keras_duq._errors import is_one_hot
from keras_duq._errors import label_codes
from keras_duq._errors import one_hot_codes
from keras_duq._validation import FRACTIONAL_LABEL_MESSAGE
from keras_duq._validation import NON_FINITE_INPUT_MESSAGE
from keras_duq._validation import NON_FINITE_LABEL_MESSAGE
from keras_duq._validation import label_dtype_message
from keras_duq._validation import label_range_message
from keras_duq._validation import non_finite_rows
from keras_duq._validation import soft_label_message

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
    return isinstance(dtype, np.dtype) and dtype.kind in "USO" and (
        dtype.kind != "O" or (value.size and isinstance(value.flat[0], (str, bytes)))
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
        if isinstance(weight, bool) or not isinstance(
            weight, (int, float, np.number)
        ) or not (np.isfinite(weight) and weight >= 0):
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

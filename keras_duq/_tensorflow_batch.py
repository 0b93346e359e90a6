"""Checks and standardises one training or evaluation batch (TensorFlow backend).

Checks of values (label range, integer labels, finite inputs) run in the
graph. `validate_batch` routes every tensor the step uses through them, so a
bad batch raises before the optimizer or the centroid update touches any
state.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_duq._validation import FRACTIONAL_LABEL_MESSAGE
from keras_duq._validation import NON_FINITE_INPUT_MESSAGE
from keras_duq._validation import is_float
from keras_duq._validation import label_dtype_message
from keras_duq._validation import label_range_message
from keras_duq._validation import label_shape_message
from keras_duq._validation import standardize_inputs

def validate_batch(model, x, y, sample_weight):
    """Returns `(x, labels_one_hot, sample_weight)`, all depending on the checks."""
    model._check_batch_structure(y)
    x = standardize_inputs(model.feature_extractor.input, x)
    if sample_weight is not None:
        sample_weight = tf.reshape(tf.cast(sample_weight, "float32"), (-1,))
    labels_one_hot, checks = labels_to_one_hot(y, model.num_classes)
    checks += _finite_input_checks(x)
    if not checks:
        return x, labels_one_hot, sample_weight
    with tf.control_dependencies(checks):
        return tf.nest.map_structure(
            lambda t: None if t is None else tf.identity(t),
            (x, labels_one_hot, sample_weight),
        )


def labels_to_one_hot(y, num_classes):
    """One-hot float32 labels and the in-graph checks of their values.

    Accepts every documented format in any order on one model. Keras
    retraces the step with relaxed shapes when the label shape changes
    between calls, so the format is decided from the static shape when it is
    known and at run time otherwise.
    """
    y = tf.convert_to_tensor(y)
    if y.dtype == tf.bool or not (y.dtype.is_integer or y.dtype.is_floating):
        raise ValueError(label_dtype_message(num_classes, y.dtype.name))
    rank = y.shape.rank
    last = y.shape[-1] if rank else None
    if rank is not None and (
        rank not in (1, 2) or (rank == 2 and last not in (None, 1, num_classes))
    ):
        raise ValueError(label_shape_message(num_classes, y.shape))
    if rank == 2 and last == num_classes:
        return tf.cast(y, "float32"), []
    if rank == 1 or (rank == 2 and last == 1):
        indices, checks = _class_indices(tf.reshape(y, (-1,)), num_classes)
        return tf.one_hot(indices, num_classes, dtype="float32"), checks
    return _labels_of_unknown_format(y, num_classes)


def _labels_of_unknown_format(y, num_classes):
    rank = tf.rank(y)
    # The size of the last axis, read as 1 for rank-1 labels.
    last = tf.shape(tf.reshape(y, (tf.shape(y)[0], -1)))[-1]
    is_one_hot = tf.logical_and(tf.equal(rank, 2), tf.equal(last, num_classes))
    is_indices = tf.logical_or(
        tf.equal(rank, 1), tf.logical_and(tf.equal(rank, 2), tf.equal(last, 1))
    )
    shape_check = tf.debugging.Assert(
        tf.logical_or(is_one_hot, is_indices),
        [label_shape_message(num_classes, "(printed next)"), tf.shape(y)],
    )
    flat = tf.reshape(y, (-1,))
    # One-hot labels pass the index checks trivially: they only bind for indices.
    candidate = tf.where(is_one_hot, tf.zeros_like(flat), flat)
    indices, checks = _class_indices(candidate, num_classes)
    one_hot = tf.cond(
        is_one_hot,
        lambda: tf.cast(tf.reshape(y, (-1, num_classes)), "float32"),
        lambda: tf.one_hot(indices, num_classes, dtype="float32"),
    )
    return one_hot, [shape_check] + checks


def _class_indices(labels, num_classes):
    """int64 class indices from a flat label vector, and their checks."""
    checks = []
    if labels.dtype.is_floating:
        checks.append(
            tf.debugging.assert_equal(
                labels,
                tf.floor(labels),
                message=FRACTIONAL_LABEL_MESSAGE,
                summarize=5,
            )
        )
    indices = tf.cast(labels, "int64")
    checks += [
        tf.debugging.assert_non_negative(indices, label_range_message(num_classes)),
        tf.debugging.assert_less(
            indices, tf.constant(num_classes, "int64"), label_range_message(num_classes)
        ),
    ]
    return indices, checks


def _finite_input_checks(x):
    return [
        tf.debugging.assert_all_finite(t, NON_FINITE_INPUT_MESSAGE)
        for t in tf.nest.flatten(x)
        if is_float(t.dtype)
    ]

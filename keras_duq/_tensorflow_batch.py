"""One-hot labels whose format is only known at run time (TensorFlow backend).

Keras retraces a TensorFlow step with relaxed shapes when the label shape
changes between calls, so a model may see labels whose rank or last axis
is unknown while the step is traced. Labels of known format take the
backend-neutral path (`_trainer.labels_to_one_hot`); these are decided in
the graph.
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_duq import _errors
from keras_duq import _trainer
from keras_duq._validation import label_shape_message


def labels_to_one_hot(y, num_classes):
    """One-hot float32 labels and the error code of their values."""
    y = tf.convert_to_tensor(y)
    rank = y.shape.rank
    if rank is not None and (rank == 1 or (rank == 2 and y.shape[-1] is not None)):
        return _trainer.labels_to_one_hot(y, num_classes)
    if rank is not None and rank not in (1, 2):
        raise ValueError(label_shape_message(num_classes, y.shape))
    # Checks the dtype before anything runs.
    _trainer.labels_to_one_hot(tf.zeros((0,), y.dtype), num_classes)
    return _labels_of_unknown_format(y, num_classes)


def _labels_of_unknown_format(y, num_classes):
    rank = tf.rank(y)
    # The size of the last axis, read as 1 for rank-1 labels.
    last = tf.shape(tf.reshape(y, (tf.shape(y)[0], -1)))[-1]
    is_one_hot = tf.logical_and(tf.equal(rank, 2), tf.equal(last, num_classes))
    is_indices = tf.logical_or(
        tf.equal(rank, 1), tf.logical_and(tf.equal(rank, 2), tf.equal(last, 1))
    )
    flat = tf.reshape(y, (-1,))
    # One-hot labels pass the index checks trivially: they only bind for indices.
    candidate = tf.where(is_one_hot, tf.zeros_like(flat), flat)
    indices_one_hot, code = _trainer.labels_to_one_hot(candidate, num_classes)
    # A shape that is neither is the batch's error, before its values'.
    shape_code = tf.where(tf.logical_or(is_one_hot, is_indices), 0, _errors.LABEL_SHAPE)
    code = _trainer.first_error(tf.cast(shape_code, code.dtype), code)
    one_hot = tf.cond(
        is_one_hot,
        lambda: tf.cast(tf.reshape(flat, (-1, num_classes)), "float32"),
        lambda: indices_one_hot,
    )
    row_code = tf.cond(
        is_one_hot,
        lambda: ops.max(_errors.one_hot_codes(one_hot, ops), initial=0),
        lambda: tf.zeros((), code.dtype),
    )
    code = _trainer.first_error(code, tf.cast(row_code, code.dtype))
    return one_hot, code

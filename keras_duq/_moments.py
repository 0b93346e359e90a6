"""Batch moments that TensorFlow differentiates correctly twice.

The gradient penalty differentiates an input gradient, so every layer of the
backbone is differentiated twice. `tf.nn.moments`, which Keras's
`BatchNormalization` and `GroupNormalization` use for the batch statistics on
the TensorFlow backend, computes the variance around `stop_gradient(mean)`.
That leaves the first derivative exact (the variance's derivative with respect
to the mean is zero) but drops a term of the second: the penalty's gradient
for every weight below a normalization layer is then slightly wrong. One sign
of it: the gradient of a bias that feeds `BatchNormalization` should be zero,
since the normalization removes any constant shift, and without this module
it is not.

`second_order_moments()` makes Keras use the same formula without the
`stop_gradient` while the DUQ training step builds its forward pass. The
values (and first derivatives) are bitwise the same as `tf.nn.moments`'s.
"""

import contextlib
import threading
import warnings

import tensorflow as tf
from keras.src.backend.tensorflow import nn as _keras_tf_nn

# Keras's TensorFlow backend computes unsynchronized batch moments in this
# module-level function; `moments` looks it up at call time.
_KERAS_MOMENTS = "_compute_moments"

_lock = threading.Lock()
_depth = 0
_original = None
_warned = False


def moments(x, axes, keepdims=False):
    """Mean and (biased) variance of `x` over `axes`, twice differentiable.

    The same operations as `tf.nn.moments`, but the variance stays a function
    of the mean in the gradient graph.
    """
    mean = tf.reduce_mean(x, axes, keepdims=True)
    variance = tf.reduce_mean(tf.math.squared_difference(x, mean), axes, keepdims=True)
    if not keepdims:
        mean = tf.squeeze(mean, axes)
        variance = tf.squeeze(variance, axes)
    return mean, variance


def is_supported() -> bool:
    """Whether the installed Keras computes batch moments where we can swap them."""
    return hasattr(_keras_tf_nn, _KERAS_MOMENTS)


@contextlib.contextmanager
def second_order_moments():
    """Within the block, Keras layers compute batch moments with `moments`.

    Nested and concurrent blocks (one per replica under a distribution
    strategy) share one swap, undone when the last block exits. Any other
    code that runs meanwhile gets the same values as without the swap.
    """
    global _depth, _original, _warned
    if not is_supported():
        if not _warned:
            _warned = True
            warnings.warn(
                "keras_duq could not find Keras's batch-moments function "
                f"(`keras.src.backend.tensorflow.nn.{_KERAS_MOMENTS}`), so the "
                "gradient penalty's gradient through BatchNormalization and "
                "GroupNormalization misses a second-order term. Install a "
                "Keras 3 release up to the one keras_duq was tested with, or "
                "report this with your Keras version.",
                stacklevel=3,
            )
        yield
        return
    with _lock:
        if _depth == 0:
            _original = getattr(_keras_tf_nn, _KERAS_MOMENTS)
            setattr(_keras_tf_nn, _KERAS_MOMENTS, moments)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                setattr(_keras_tf_nn, _KERAS_MOMENTS, _original)
                _original = None

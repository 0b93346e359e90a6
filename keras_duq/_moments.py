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

from __future__ import annotations

from contextlib import AbstractContextManager

import tensorflow as tf

from keras_duq import _compat


def moments(
    x: tf.Tensor, axes: int | list[int] | tuple[int, ...], keepdims: bool = False
) -> tuple[tf.Tensor, tf.Tensor]:
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
    return _compat.batch_moments_supported()


def second_order_moments() -> AbstractContextManager[None]:
    """Within the block, Keras layers compute batch moments with `moments`.

    Nested and concurrent blocks share one swap (see `_compat`). Any other
    code that runs meanwhile gets the same values as without the swap.
    """
    return _compat.swap_batch_moments(moments)

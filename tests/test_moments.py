"""Batch moments for double backprop: values, second derivatives, the swap."""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import nn as keras_tf_nn

import keras_duq
from keras_duq import _compat
from keras_duq import _tensorflow_trainer as _moments

# TensorFlow's second-order batch moments (keras_duq._tensorflow_trainer).
pytestmark = pytest.mark.requires_backend("tensorflow")


@pytest.fixture
def float64():
    # A global dtype policy, which other tests may have set, wins over floatx.
    policy, floatx = keras.config.dtype_policy(), keras.config.floatx()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield
    finally:
        keras.config.set_dtype_policy(policy)
        keras.config.set_floatx(floatx)


@pytest.mark.parametrize("keepdims", [False, True])
def test_values_are_those_of_tf_nn_moments(keepdims):
    x = tf.constant(np.random.default_rng(0).normal(3.0, 2.0, (8, 5, 5, 3)), tf.float32)
    mean, variance = _moments.moments(x, [0, 1, 2], keepdims=keepdims)
    expected_mean, expected_variance = tf.nn.moments(x, [0, 1, 2], keepdims=keepdims)
    np.testing.assert_array_equal(mean.numpy(), expected_mean.numpy())
    np.testing.assert_array_equal(variance.numpy(), expected_variance.numpy())


def _variance_hessian(moments):
    x = tf.constant(np.random.default_rng(1).normal(size=(5,)))
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            _, variance = moments(x, [0])
        gradient = inner.gradient(variance, x)
    return outer.jacobian(gradient, x).numpy()


def test_second_derivative_of_the_variance_is_exact():
    # var(x) = mean((x - mean(x))^2) has the Hessian 2/n (I - 1 1^T / n).
    n = 5
    exact = 2.0 / n * (np.eye(n) - np.ones((n, n)) / n)
    np.testing.assert_allclose(_variance_hessian(_moments.moments), exact, atol=1e-12)
    # What the swap is for: tf.nn.moments drops the -1/n part.
    wrong = _variance_hessian(lambda x, axes: tf.nn.moments(x, axes))
    np.testing.assert_allclose(wrong, 2.0 / n * np.eye(n), atol=1e-12)


def _model_with_bias_before_batch_norm():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, name="before_norm")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras_duq.DUQOutput(
        num_classes=3, centroid_dims=6, length_scale=0.5, momentum=0.9
    )(x)
    model = keras_duq.DUQModel(inputs, outputs, gradient_penalty=1.0, weight_decay=0.0)
    model.compile(optimizer=keras.optimizers.SGD(1.0))
    return model


def test_penalty_leaves_a_bias_before_batch_normalization_alone(float64):
    # BatchNormalization removes any constant shift of its input, so the
    # loss, the penalty included, does not depend on the bias before it:
    # its gradient is zero. With tf.nn.moments' second derivative this
    # step moved the bias by 0.02 (the kernel by 0.23).
    model = _model_with_bias_before_batch_norm()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 4)), rng.integers(0, 3, 16)
    layer = model.feature_extractor.get_layer("before_norm")
    assert layer.bias.dtype == "float64"
    bias, kernel = layer.bias.numpy().copy(), layer.kernel.numpy().copy()
    model.train_on_batch(x, y)
    assert np.abs(layer.kernel.numpy() - kernel).max() > 1e-2  # it trained
    np.testing.assert_allclose(layer.bias.numpy(), bias, rtol=0, atol=1e-12)


def test_swap_is_undone_after_nested_and_failing_blocks():
    assert _compat.batch_moments_supported()  # else this Keras needs a new swap point
    original = keras_tf_nn._compute_moments
    with _moments.second_order_moments():
        swapped = keras_tf_nn._compute_moments
        assert swapped is not original
        with _moments.second_order_moments():
            assert keras_tf_nn._compute_moments is swapped
        assert keras_tf_nn._compute_moments is swapped
    assert keras_tf_nn._compute_moments is original
    with pytest.raises(RuntimeError, match="inside"):
        with _moments.second_order_moments():
            raise RuntimeError("inside")
    assert keras_tf_nn._compute_moments is original


def test_concurrent_blocks_share_one_swap():
    original = keras_tf_nn._compute_moments
    inside, release = threading.Barrier(3), threading.Event()
    seen = []

    def block():
        with _moments.second_order_moments():
            inside.wait()
            release.wait()
            seen.append(keras_tf_nn._compute_moments is not original)

    threads = [threading.Thread(target=block) for _ in range(2)]
    for thread in threads:
        thread.start()
    inside.wait()  # both threads are inside their blocks
    release.set()
    for thread in threads:
        thread.join()
    assert seen == [True, True]
    assert keras_tf_nn._compute_moments is original

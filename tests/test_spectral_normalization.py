"""`keras_duq.SpectralNormalization` and `keras_duq.spectral_normalize`."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_duq
from keras_duq import _compat


def _np(x):
    """A tensor or variable as a NumPy array, on any backend."""
    return keras.ops.convert_to_numpy(x)


def _dense_model(singular_values, seed=0):
    """A model `x -> x K` whose kernel has exactly these singular values."""
    rng = np.random.default_rng(seed)
    rows, columns = 6, len(singular_values)
    left, _ = np.linalg.qr(rng.normal(size=(rows, rows)))
    right, _ = np.linalg.qr(rng.normal(size=(columns, columns)))
    kernel = (left[:, :columns] * np.asarray(singular_values)) @ right.T
    inputs = keras.Input((rows,))
    layer = keras.layers.Dense(columns, bias_initializer="ones")
    model = keras.Model(inputs, layer(inputs))
    layer.kernel.assign(kernel.astype("float32"))
    return model


def _operator_norm(model, shape):
    """Exact norm of the linear part of `model`, from its outputs on unit inputs."""
    size = int(np.prod(shape))
    basis = np.eye(size, dtype="float32").reshape((size,) + tuple(shape))
    zero = np.zeros((1,) + tuple(shape), "float32")
    matrix = _np(model(basis)).astype("float32") - _np(model(zero)).astype("float32")
    return np.linalg.norm(matrix.reshape(size, -1), 2)


def _train_calls(model, shape, calls):
    for _ in range(calls):
        model(np.zeros((1,) + tuple(shape), "float32"), training=True)


def test_dense_norm_is_capped_at_coefficient():
    model = _dense_model([10.0, 5.0, 2.0, 1.0])
    normalized = keras_duq.spectral_normalize(model, coefficient=2.0)
    # A spectral gap of 2 makes 20 one-step iterations converge to ~1e-12.
    _train_calls(normalized, (6,), 20)
    assert _operator_norm(normalized, (6,)) <= 2.1
    assert _operator_norm(normalized, (6,)) >= 1.9
    # The original model and its kernel are untouched.
    assert _operator_norm(model, (6,)) == pytest.approx(10.0, rel=1e-5)
    assert not any(
        isinstance(layer, keras_duq.SpectralNormalization) for layer in model.layers
    )


def test_layer_within_bound_is_unchanged():
    # The power-iteration estimate never exceeds the true norm, so a layer
    # below the bound keeps its exact outputs, before and after training calls.
    model = _dense_model([1.5, 1.0, 0.5])
    normalized = keras_duq.spectral_normalize(model, coefficient=2.0)
    x = np.random.default_rng(1).normal(size=(5, 6)).astype("float32")
    np.testing.assert_array_equal(_np(normalized(x)), _np(model(x)))
    _train_calls(normalized, (6,), 3)
    np.testing.assert_array_equal(_np(normalized(x)), _np(model(x)))
    np.testing.assert_array_equal(_np(normalized(x, training=True)), _np(model(x)))


_CONVOLUTIONS = {
    "conv2d_same": (lambda: keras.layers.Conv2D(3, 3, padding="same"), (5, 5, 2)),
    "conv2d_strided_odd": (
        lambda: keras.layers.Conv2D(3, 3, strides=2, padding="same"),
        (7, 7, 2),
    ),
    "conv2d_channels_first": (
        lambda: keras.layers.Conv2D(
            3, 3, strides=2, padding="same", data_format="channels_first"
        ),
        (2, 6, 5),
    ),
    "conv2d_grouped_valid": (
        lambda: keras.layers.Conv2D(4, 2, strides=2, groups=2),
        (6, 6, 2),
    ),
    "conv1d_causal_dilated": (
        lambda: keras.layers.Conv1D(3, 3, padding="causal", dilation_rate=2),
        (9, 2),
    ),
    "conv3d": (lambda: keras.layers.Conv3D(2, 2, padding="same"), (3, 4, 3, 2)),
    "depthwise": (
        lambda: keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same"),
        (5, 5, 3),
    ),
    "depthwise_strided": (
        lambda: keras.layers.DepthwiseConv2D(3, strides=2),
        (8, 8, 3),
    ),
}


@pytest.mark.parametrize("name", sorted(_CONVOLUTIONS))
def test_convolution_operator_norm_is_capped(name):
    make_layer, shape = _CONVOLUTIONS[name]
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape)
    layer = make_layer()
    model = keras.Model(inputs, layer(inputs))
    layer.kernel.assign(layer.kernel * 5.0)
    assert _operator_norm(model, shape) > 3.0
    normalized = keras_duq.spectral_normalize(
        model, coefficient=1.0, power_iterations=50
    )
    _train_calls(normalized, shape, 1)
    # The exact operator norm of the convolution, not of its reshaped
    # kernel, is capped: it ends at the coefficient, not below or above it.
    assert 0.95 <= _operator_norm(normalized, shape) <= 1.05


def _assert_transpose_is_adjoint(name):
    """`<A v, u> == <v, A^T u>` for the power iteration's convolution pair."""
    make_layer, shape = _CONVOLUTIONS[name]
    wrapper = keras_duq.SpectralNormalization(make_layer())
    wrapper.build((None,) + shape)
    operator, kernel = wrapper._operator, wrapper.layer.kernel
    rng = np.random.default_rng(0)
    v = rng.normal(size=(1,) + shape).astype("float32")
    u = rng.normal(size=wrapper.vector_u.shape).astype("float32")
    forward = _np(operator.apply(v, kernel))
    backward = _np(operator.transpose(u, kernel))
    assert forward.shape == u.shape and backward.shape == v.shape
    np.testing.assert_allclose(np.sum(forward * u), np.sum(v * backward), rtol=1e-4)


@pytest.mark.parametrize("name", sorted(_CONVOLUTIONS))
def test_convolution_transpose_is_adjoint(name):
    _assert_transpose_is_adjoint(name)


def test_training_calls_update_vector_and_inference_does_not():
    normalized = keras_duq.spectral_normalize(
        _dense_model([10.0, 5.0]), coefficient=2.0
    )
    wrapper = normalized.layers[-1]
    x = np.ones((2, 6), "float32")
    before = _np(wrapper.vector_u).copy()
    kernel = _np(wrapper.layer.kernel).copy()
    first = normalized(x)
    np.testing.assert_array_equal(_np(wrapper.vector_u), before)
    np.testing.assert_array_equal(_np(normalized(x)), _np(first))
    normalized(x, training=True)
    assert not np.array_equal(_np(wrapper.vector_u), before)
    np.testing.assert_array_equal(_np(wrapper.layer.kernel), kernel)


@pytest.mark.requires_backend("tensorflow")  # tf.GradientTape
def test_gradient_sees_the_rescaling():
    # d(output)/d(kernel) includes the derivative of 1 / sigma(kernel): the
    # gradient of the normalised output along the kernel itself is 0, since
    # scaling the kernel does not change the normalised kernel.
    normalized = keras_duq.spectral_normalize(
        _dense_model([10.0, 5.0]), coefficient=2.0
    )
    _train_calls(normalized, (6,), 20)
    wrapper = normalized.layers[-1]
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 6)).astype("float32"))
    with tf.GradientTape() as tape:
        outputs = normalized(x)
    gradient = tape.gradient(outputs, wrapper.layer.kernel)
    along_kernel = tf.reduce_sum(gradient * wrapper.layer.kernel)
    scale = float(tf.norm(gradient)) * float(tf.norm(wrapper.layer.kernel))
    assert abs(float(along_kernel)) < 1e-4 * scale


def _cnn_backbone():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
    x = keras.layers.BatchNormalization(name="norm")(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.DepthwiseConv2D(3, strides=2, padding="same", name="depthwise")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.Sequential([keras.layers.Dense(8, name="dense")], name="head")(x)
    return keras.Model(inputs, x)


def _images(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0).astype("int64")
    return x, y


def _wrappers(model):
    return [
        layer
        for layer in _compat.all_layers(model)
        if isinstance(layer, keras_duq.SpectralNormalization)
    ]


def test_functional_cnn_with_batch_norm_is_normalized_and_trains():
    backbone = _cnn_backbone()
    x, y = _images()
    normalized = keras_duq.spectral_normalize(backbone, coefficient=1.0)
    assert sorted(w.name for w in _wrappers(normalized)) == [
        "conv",
        "dense",
        "depthwise",
    ]
    assert isinstance(normalized.get_layer("norm"), keras.layers.BatchNormalization)
    # Weights kept (BatchNormalization's statistics included).
    for original, copy in [("conv", "conv"), ("norm", "norm")]:
        original_weights = backbone.get_layer(original).get_weights()
        copy_layer = normalized.get_layer(copy)
        copy_layer = getattr(copy_layer, "layer", copy_layer)
        for a, b in zip(original_weights, copy_layer.get_weights()):
            np.testing.assert_array_equal(a, b)
    model = keras_duq.wrap(
        normalized, num_classes=2, length_scale=0.5, gradient_penalty=0.5
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    vectors = [_np(w.vector_u).copy() for w in _wrappers(normalized)]
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses))
    assert np.all(np.isfinite(history.history["gradient_penalty"]))
    for before, wrapper in zip(vectors, _wrappers(normalized)):
        assert not np.array_equal(before, _np(wrapper.vector_u))
    assert np.all(np.isfinite(model.predict(x, verbose=0)))


@pytest.mark.requires_backend(
    "tensorflow"
)  # TensorFlow error type; all backends: test_backends.py
def test_rejected_batch_keeps_power_iteration_vectors():
    keras.utils.set_random_seed(0)
    normalized = keras_duq.spectral_normalize(
        _dense_model([10.0, 5.0]), coefficient=2.0
    )
    model = keras_duq.wrap(
        normalized, num_classes=2, length_scale=0.1, gradient_penalty=1.0
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32")
    y = np.zeros(16, "int64")
    wrapper = _wrappers(normalized)[0]
    before = _np(wrapper.vector_u).copy()
    # Inputs this large overflow the distances to the centroids: the forward
    # pass (which stepped the power iteration) is rejected as a whole.
    with pytest.raises(keras_duq.DUQBatchError, match="non-finite"):
        model.fit(x * 1e30, y, batch_size=16, verbose=0)
    np.testing.assert_array_equal(_np(wrapper.vector_u), before)
    model.fit(x, y, batch_size=16, verbose=0)
    assert not np.array_equal(_np(wrapper.vector_u), before)


def test_keras_file_round_trip(tmp_path):
    backbone = keras_duq.spectral_normalize(_cnn_backbone(), coefficient=0.5)
    model = keras_duq.wrap(backbone, num_classes=2, length_scale=0.5)
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    x, y = _images(16)
    model.fit(x, y, batch_size=16, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0)
    )
    for original, copy in zip(_wrappers(model), _wrappers(loaded)):
        np.testing.assert_array_equal(_np(original.vector_u), _np(copy.vector_u))
        assert copy.coefficient == 0.5


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision(policy):
    keras.config.set_dtype_policy(policy)
    try:
        model = _dense_model([10.0, 5.0, 2.0, 1.0])
        normalized = keras_duq.spectral_normalize(model, coefficient=2.0)
        wrapper = normalized.layers[-1]
        _train_calls(normalized, (6,), 20)
        assert wrapper.compute_dtype == policy.split("_")[1]
        assert wrapper.vector_u.dtype == "float32"
        assert wrapper.layer.kernel.dtype == "float32"
        # Float16 rounding of the output only (bfloat16: 8 significant bits).
        assert _operator_norm(normalized, (6,)) == pytest.approx(2.0, rel=0.03)
        x, y = _images(16)
        backbone = keras_duq.spectral_normalize(_cnn_backbone(), coefficient=1.0)
        duq = keras_duq.wrap(
            backbone, num_classes=2, length_scale=0.5, gradient_penalty=0.5
        )
        duq.compile(optimizer=keras.optimizers.SGD(0.05))
        history = duq.fit(x, y, batch_size=8, verbose=0)
        assert np.isfinite(history.history["loss"][-1])
    finally:
        keras.config.set_dtype_policy("float32")


def test_unsupported_layer_raises():
    with pytest.raises(ValueError, match="Received: `layer=<LSTM"):
        keras_duq.SpectralNormalization(keras.layers.LSTM(3))
    with pytest.raises(ValueError, match="Received: `coefficient=0"):
        keras_duq.SpectralNormalization(keras.layers.Dense(3), coefficient=0)
    with pytest.raises(ValueError, match="Received: `power_iterations=0"):
        keras_duq.SpectralNormalization(keras.layers.Dense(3), power_iterations=0)


def test_convolution_needs_fixed_input_size():
    wrapper = keras_duq.SpectralNormalization(keras.layers.Conv2D(2, 3))
    with pytest.raises(ValueError, match="fixed spatial dimensions"):
        wrapper(keras.Input((None, None, 3)))


def test_sequential_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5, 5, 2)),
            keras.layers.Conv2D(3, 3, name="conv"),
            keras.layers.Flatten(),
            keras.layers.Dense(2, name="dense"),
        ]
    )
    normalized = keras_duq.spectral_normalize(model, coefficient=100.0)
    assert isinstance(normalized, keras.Sequential)
    assert [type(layer).__name__ for layer in normalized.layers] == [
        "SpectralNormalization",
        "Flatten",
        "SpectralNormalization",
    ]
    x = np.random.default_rng(0).normal(size=(3, 5, 5, 2)).astype("float32")
    np.testing.assert_array_equal(_np(normalized(x, training=True)), _np(model(x)))


def test_spectral_normalize_rejects_subclassed_and_duq_models():
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    subclassed = Subclassed()
    subclassed(np.zeros((1, 3), "float32"))
    with pytest.raises(ValueError, match="subclassed model"):
        keras_duq.spectral_normalize(subclassed)
    duq = keras_duq.wrap(_dense_model([1.0, 1.0]), num_classes=2)
    with pytest.raises(ValueError, match="before `keras_duq.wrap`"):
        keras_duq.spectral_normalize(duq)


@pytest.mark.slow
def test_jax_backend():
    from harness import run

    assert run("spectral_normalization_jax.py", backend="jax") == {"ok": True}

"""The DUQ math, checked against direct numpy transcriptions of the paper.

On every backend: gradients come from the backend's own autodiff
(`_value_and_gradients`), their references are hand-computed in NumPy.
"""

import keras
import numpy as np
import pytest

from keras_duq import _ops


def _rng():
    return np.random.default_rng(0)


def _value_and_gradients(function, *inputs):
    """`function(*inputs)` (a scalar) and its gradient for each input, as NumPy.

    With the running backend's autodiff: `tf.GradientTape`, `jax.grad` or
    `torch.autograd.grad`.
    """
    inputs = [keras.ops.convert_to_tensor(np.asarray(x, "float32")) for x in inputs]
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(inputs)
            value = function(*inputs)
        gradients = tape.gradient(value, inputs)
    elif backend == "jax":
        import jax

        value, gradients = jax.value_and_grad(function, range(len(inputs)))(*inputs)
    else:
        import torch

        inputs = [x.requires_grad_() for x in inputs]
        value = function(*inputs)
        gradients = torch.autograd.grad(value, inputs, allow_unused=True)
        value = value.detach()
    numpy = keras.ops.convert_to_numpy
    return numpy(value), [None if g is None else numpy(g) for g in gradients]


def test_squared_distances_is_mean_over_centroid_dims():
    rng = _rng()
    embeddings = rng.normal(size=(4, 5, 3)).astype("float32")
    centroids = rng.normal(size=(5, 3)).astype("float32")
    expected = np.array(
        [
            [np.mean((embeddings[b, :, c] - centroids[:, c]) ** 2) for c in range(3)]
            for b in range(4)
        ]
    )
    got = _ops.squared_distances(embeddings, centroids)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_log_kernel_values_match_rbf_formula():
    distances = np.array([[0.0, 0.01, 0.5]], dtype="float32")
    length_scale = 0.1
    got = np.exp(_ops.log_kernel_values(distances, length_scale))
    np.testing.assert_allclose(got, np.exp(-distances / (2 * 0.1**2)), rtol=1e-5)


def test_binary_cross_entropy_matches_textbook_formula():
    rng = _rng()
    log_kernel = -rng.uniform(0.01, 5.0, size=(6, 4)).astype("float32")
    labels = np.eye(4, dtype="float32")[rng.integers(0, 4, size=6)]
    kernel = np.exp(log_kernel.astype("float64"))
    expected = -np.mean(
        labels * np.log(kernel) + (1 - labels) * np.log(1 - kernel), axis=-1
    )
    got = _ops.binary_cross_entropy(
        keras.ops.convert_to_tensor(log_kernel), keras.ops.convert_to_tensor(labels)
    )
    np.testing.assert_allclose(keras.ops.convert_to_numpy(got), expected, rtol=1e-5)


def test_binary_cross_entropy_keeps_gradient_when_kernels_saturate():
    # Kernel values of exp(-200) underflow to 0 in float32. Keras's clipped
    # binary_crossentropy then gives the true class no gradient; the
    # log-space loss must still pull the true class towards its centroid.
    log_kernel = [[-200.0, -300.0]]
    labels = keras.ops.convert_to_tensor([[1.0, 0.0]])
    loss, (gradient,) = _value_and_gradients(
        lambda z: keras.ops.sum(_ops.binary_cross_entropy(z, labels)), log_kernel
    )
    assert np.isfinite(loss)
    np.testing.assert_allclose(gradient[0, 0], -0.5, rtol=1e-6)

    _, (clipped_gradient,) = _value_and_gradients(
        lambda z: keras.ops.mean(
            keras.losses.binary_crossentropy(labels, keras.ops.exp(z))
        ),
        log_kernel,
    )
    assert clipped_gradient[0, 0] == 0.0


@pytest.mark.parametrize("epsilon", [1e-12, 1e-7])
def test_binary_cross_entropy_epsilon_gives_the_floored_gradient(epsilon):
    # dL/dK_c = (K_c - y_c) / max(K_c (1 - K_c), epsilon) / num_classes, so
    # dL/dlog K_c = K_c times that: hand-computed in float64.
    log_kernel_values = np.array(
        [[-60.0, -2.0, -40.0], [-1e-3, -25.0, -0.5]], dtype="float32"
    )
    labels = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype="float32")
    labels_tensor = keras.ops.convert_to_tensor(labels)
    _, (gradient,) = _value_and_gradients(
        lambda z: keras.ops.sum(_ops.binary_cross_entropy(z, labels_tensor, epsilon)),
        log_kernel_values,
    )
    kernel = np.exp(log_kernel_values.astype("float64"))
    expected = (
        kernel * (kernel - labels) / np.maximum(kernel * (1 - kernel), epsilon) / 3
    )
    # XLA (JAX) flushes subnormal intermediates to zero: 6e-24 comes out 0.
    np.testing.assert_allclose(gradient, expected, rtol=1e-5, atol=1e-20)
    # Only the gradient changes, not the value.
    log_kernel = keras.ops.convert_to_tensor(log_kernel_values)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(
            _ops.binary_cross_entropy(log_kernel, labels_tensor, epsilon)
        ),
        keras.ops.convert_to_numpy(
            _ops.binary_cross_entropy(log_kernel, labels_tensor)
        ),
        rtol=1e-6,
    )


def test_binary_cross_entropy_epsilon_zero_is_exact_gradient():
    labels = keras.ops.convert_to_tensor([[1.0, 0.0]])
    _, (gradient,) = _value_and_gradients(
        lambda z: keras.ops.sum(_ops.binary_cross_entropy(z, labels, 0.0)),
        [[-60.0, -2.0]],
    )
    np.testing.assert_allclose(gradient[0, 0], -0.5)


def test_binary_cross_entropy_is_finite_at_zero_distance():
    log_kernel = keras.ops.convert_to_tensor([[0.0, 0.0]], "float32")
    labels = keras.ops.convert_to_tensor([[1.0, 0.0]], "float32")
    loss = _ops.binary_cross_entropy(log_kernel, labels)
    assert np.isfinite(keras.ops.convert_to_numpy(loss)).all()


def test_categorical_cross_entropy_is_over_distances_in_length_scales():
    rng = _rng()
    log_kernel = -rng.uniform(0.01, 500.0, size=(6, 4)).astype("float32")
    labels = np.eye(4, dtype="float32")[rng.integers(0, 4, size=6)]
    # log K = -d / (2 sigma^2): the distance in length scales is sqrt(-2 log K)
    # (plus a floor of 1e-6 under the root).
    logits = -np.sqrt(-2.0 * log_kernel.astype("float64") + 1e-6)
    log_softmax = logits - logits.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    expected = -np.sum(labels * log_softmax, axis=-1)
    got = _ops.categorical_cross_entropy(
        keras.ops.convert_to_tensor(log_kernel), keras.ops.convert_to_tensor(labels)
    )
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(got), expected, rtol=1e-5, atol=1e-6
    )


def test_duq_loss_weighs_the_categorical_term_against_the_summed_bce():
    rng = _rng()
    log_kernel = keras.ops.convert_to_tensor(
        -rng.uniform(0.01, 5.0, size=(6, 4)).astype("float32")
    )
    labels = keras.ops.convert_to_tensor(
        np.eye(4, dtype="float32")[rng.integers(0, 4, size=6)]
    )
    penalty = keras.ops.convert_to_tensor(rng.uniform(size=6).astype("float32"))
    bce = keras.ops.convert_to_numpy(_ops.binary_cross_entropy(log_kernel, labels))
    cce = keras.ops.convert_to_numpy(_ops.categorical_cross_entropy(log_kernel, labels))
    loss, bce_part = _ops.duq_loss(
        log_kernel, labels, penalty, 0.5, categorical_cross_entropy_weight=3.0
    )
    expected = np.mean(bce + 3.0 * cce + 0.5 * keras.ops.convert_to_numpy(penalty))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(bce_part), np.mean(bce))


def test_categorical_term_pushes_from_the_nearest_wrong_centroid_with_bounded_force():
    # A misclassified example far from every centroid: class 1 is nearest,
    # the label is class 0. The binary cross-entropy's push from class 1 is
    # about K_1 = exp(-d_1 / 2) <= exp(-50); the categorical term pushes with
    # a force that does not grow with the distance.
    labels = keras.ops.convert_to_tensor([[1.0, 0.0, 0.0]])

    def feature_gradient(weight, scale):
        # Distances along one feature axis: d_c = (x - e_c)^2, length scale 1.
        centroids = keras.ops.convert_to_tensor([-2.0 * scale, scale, 3.0 * scale])

        def loss(x):
            distances = keras.ops.square(x - centroids)[None]
            return _ops.duq_loss(
                _ops.log_kernel_values(distances, 1.0),
                labels,
                categorical_cross_entropy_weight=weight,
            )[0]

        return _value_and_gradients(loss, 0.0)[1][0]

    # Without the term, class 0's pull (towards -2 scale, a positive
    # gradient of size (x + 2 scale) / 3) grows with the distance; the push
    # from class 1 (at +scale, nearest) is negligible.
    for scale in (10.0, 100.0):
        bce_only = feature_gradient(0.0, scale)
        np.testing.assert_allclose(bce_only, 2 * scale / 3, rtol=1e-5)
        # The term at weight 1 adds d/dx (r_0 - r_1) = 1 + 1 (r_c = |x - e_c|,
        # p_1 ~ 1): a pull towards class 0 and a push away from class 1 of
        # size 1 each, at either scale.
        np.testing.assert_allclose(
            feature_gradient(1.0, scale) - bce_only, 2.0, rtol=1e-4
        )


def test_gradient_norms_flatten_all_inputs_per_example():
    rng = _rng()
    first = rng.normal(size=(3, 2, 2)).astype("float32")
    second = rng.normal(size=(3, 5)).astype("float32")
    expected = np.sqrt((first.reshape(3, -1) ** 2).sum(1) + (second**2).sum(1))
    got = _ops.gradient_norms([first, None, second])
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_gradient_norms_are_safe_at_zero():
    penalty, (outer,) = _value_and_gradients(
        lambda g: keras.ops.mean(_ops.gradient_penalty(_ops.gradient_norms([g]))),
        np.zeros((4, 3)),
    )
    assert penalty == pytest.approx(1.0)
    assert np.isfinite(outer).all()


def test_gradient_norms_need_some_gradient():
    with pytest.raises(ValueError, match="gradient_penalty=0"):
        _ops.gradient_norms([None])


def test_gradient_penalty_two_and_one_sided():
    norms = np.array([0.0, 0.5, 1.0, 3.0], dtype="float32")
    np.testing.assert_allclose(
        _ops.gradient_penalty(norms, "two_sided"), [1.0, 0.25, 0.0, 4.0]
    )
    np.testing.assert_allclose(
        _ops.gradient_penalty(norms, "one_sided"), [0.0, 0.0, 0.0, 4.0]
    )


def test_unknown_penalty_lists_valid_options():
    with pytest.raises(ValueError, match="two_sided.*one_sided.*Received"):
        _ops.validate_penalty("both_sided")


def test_centroid_statistics_and_moving_average_match_paper():
    rng = _rng()
    embeddings = rng.normal(size=(5, 4, 3)).astype("float32")
    labels = np.array([0, 2, 2, 1, 2])
    one_hot = np.eye(3, dtype="float32")[labels]
    counts, sums = (
        keras.ops.convert_to_numpy(t)
        for t in _ops.centroid_statistics(
            keras.ops.convert_to_tensor(embeddings),
            keras.ops.convert_to_tensor(one_hot),
        )
    )
    np.testing.assert_allclose(counts, [1, 1, 3])
    for c in range(3):
        np.testing.assert_allclose(
            sums[:, c], embeddings[labels == c, :, c].sum(0), rtol=1e-6
        )
    old_counts = np.full(3, 12.0, dtype="float32")
    new_counts = _ops.moving_average(old_counts, counts, 0.9)
    np.testing.assert_allclose(new_counts, 0.9 * 12 + 0.1 * np.array([1, 1, 3]))
    old_sums = rng.normal(size=(4, 3)).astype("float32")
    new_sums = _ops.moving_average(old_sums, sums, 0.9)
    np.testing.assert_allclose(
        _ops.centroids(new_counts, new_sums),
        (0.9 * old_sums + 0.1 * np.asarray(sums)) / np.asarray(new_counts),
        rtol=1e-5,
    )


def test_coupled_weight_decay_gradient_is_weight_decay_times_weight():
    weights = [np.array([[1.0, -2.0]]), np.array([3.0])]
    _, gradients = _value_and_gradients(
        lambda *w: _ops.coupled_weight_decay_loss(list(w), 1e-4), *weights
    )
    for weight, gradient in zip(weights, gradients):
        np.testing.assert_allclose(gradient, 1e-4 * weight, rtol=1e-6)
    # A weight left out (an embedding table) gets no term: its gradient is 0.
    value, gradients = _value_and_gradients(
        lambda *w: _ops.coupled_weight_decay_loss(list(w), 1e-4, (), (True, False)),
        *weights,
    )
    np.testing.assert_allclose(value, 0.5e-4 * 5.0, rtol=1e-6)
    np.testing.assert_allclose(gradients[0], 1e-4 * weights[0], rtol=1e-6)
    # (no gradient at all where the backend says so: TensorFlow's None)
    assert gradients[1] is None or not np.any(gradients[1])


def test_clipped_by_norm_scales_long_gradients_to_the_bound():
    rng = _rng()
    long = rng.normal(size=(3, 4)).astype("float32") * 10.0
    short = np.array([0.1, -0.2], dtype="float32")
    zero = np.zeros((2,), dtype="float32")
    tensors = [keras.ops.convert_to_tensor(g) for g in (long, short)]
    tensors += [None, keras.ops.convert_to_tensor(zero)]
    got = _ops.clipped_by_norm(tensors, 1.5)
    assert got[2] is None
    got = [keras.ops.convert_to_numpy(g) for g in got if g is not None]
    np.testing.assert_allclose(got[0], long * 1.5 / np.linalg.norm(long), rtol=1e-6)
    np.testing.assert_allclose(got[1], short, rtol=1e-6)
    np.testing.assert_array_equal(got[2], zero)


def test_clipped_by_norm_keeps_a_non_finite_gradient_non_finite():
    gradient = keras.ops.convert_to_tensor(np.array([1.0, np.inf], "float32"))
    (got,) = _ops.clipped_by_norm([gradient], 1.0)
    assert not np.isfinite(keras.ops.convert_to_numpy(got)).all()

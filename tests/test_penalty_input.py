"""`penalty_input`: the gradient penalty with respect to a layer's output (token models).

Runs on every backend (`KERAS_BACKEND=tensorflow|jax|torch`); the penalty
computed by hand uses the backend's own automatic differentiation.
"""

import json

import harness
import keras
import numpy as np
import pytest
from keras import ops

import keras_duq

VOCABULARY, LENGTH, DIMS = 30, 6, 8


def _backbone(mask_zero=True):
    return keras.Sequential(
        [
            keras.Input((LENGTH,), dtype="int32"),
            keras.layers.Embedding(
                VOCABULARY, DIMS, mask_zero=mask_zero, name="embedding"
            ),
            keras.layers.GlobalAveragePooling1D(name="pooling"),
            keras.layers.Dense(16, activation="tanh", name="dense"),
        ]
    )


def _model(**kwargs):
    kwargs = {"length_scale": 0.5, "gradient_penalty": 0.5, **kwargs}
    return keras_duq.wrap(
        _backbone(), num_classes=2, penalty_input="embedding", **kwargs
    )


def _tokens(n=32, seed=0):
    """Token ids with padding (0) at the end, and labels from the first token."""
    x = harness.token_ids(n, LENGTH, VOCABULARY, lengths=(2, LENGTH), seed=seed)
    return x, (x[:, 0] > VOCABULARY // 2).astype("int32")


def _gradient(function, z):
    """d function(z) / dz with the backend's own automatic differentiation."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(z)
            value = function(z)
        return tape.gradient(value, z)
    if backend == "jax":
        import jax

        return jax.grad(function)(z)
    import torch

    z = z.detach().requires_grad_(True)
    return torch.autograd.grad(function(z), z)[0]


def _penalty_by_hand(model, x):
    """Mean two-sided penalty `(s ||d sum_c K_c / dz|| - 1)^2`, z the embeddings, and the norms.

    `s` is the embeddings' spread over the batch's unpadded positions: the
    root of their mean per-dimension variance.
    """
    backbone = model.feature_extractor.layers[-1]
    embedding, pooling, dense = (
        backbone.get_layer(name) for name in ("embedding", "pooling", "dense")
    )
    mask = ops.not_equal(x, 0)

    def kernel_sum(z):
        features = dense(pooling(z, mask=mask))
        return ops.sum(ops.exp(model.duq_output.log_kernel_values(features)))

    z = embedding(ops.convert_to_tensor(x))
    kept = ops.convert_to_numpy(z).astype("float64")[x != 0]
    spread = np.sqrt(kept.var(axis=0).mean())
    gradient = ops.convert_to_numpy(_gradient(kernel_sum, z)) * spread
    norms = np.sqrt((gradient.reshape(len(x), -1).astype("float64") ** 2).sum(-1))
    return float(np.mean((norms - 1.0) ** 2)), norms


def test_penalty_matches_the_gradient_with_respect_to_the_embeddings():
    # A length scale measured on the features, so that the kernel values
    # change with the embeddings at their small initial scale.
    model = _model(health_checks=False, length_scale="auto")
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    x, y = _tokens()
    # A few steps first, so that the kernel values and the gradient are not
    # those of the initialisation.
    model.fit(x, y, epochs=2, batch_size=8, verbose=0)
    logs = model.evaluate(x, y, batch_size=len(x), verbose=0, return_dict=True)
    expected, norms = _penalty_by_hand(model, x)
    # Not the trivial case of a zero gradient (penalty 1 whatever the layer).
    assert norms.mean() > 0.01, norms
    np.testing.assert_allclose(logs["gradient_penalty"], expected, rtol=1e-5, atol=1e-6)


def test_padding_mask_is_kept_in_the_penalty_pass():
    # Padding (token 0) changes nothing where the mask is respected: the
    # penalty of a batch equals that of the same tokens with more padding
    # embedded differently (a different row 0 of the embedding matrix).
    model = _model(health_checks=False)
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    x, y = _tokens(n=16)
    before = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    embedding = model.feature_extractor.layers[-1].get_layer("embedding")
    table = ops.convert_to_numpy(embedding.embeddings).copy()
    table[0] += 5.0
    embedding.embeddings.assign(table)
    after = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    np.testing.assert_allclose(
        after["gradient_penalty"], before["gradient_penalty"], rtol=1e-5
    )


def test_penalty_does_not_depend_on_the_scale_of_the_embeddings():
    # The gradient is taken per unit of the embeddings' spread, as for
    # standardised inputs: embeddings 10 times larger, read by a Dense layer
    # with a kernel 10 times smaller, give the same features and the same
    # penalty.
    model = _model(health_checks=False)
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    x, y = _tokens(n=16)
    before = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    backbone = model.feature_extractor.layers[-1]
    embedding, dense = backbone.get_layer("embedding"), backbone.get_layer("dense")
    embedding.embeddings.assign(embedding.embeddings * 10.0)
    dense.kernel.assign(dense.kernel / 10.0)
    after = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    np.testing.assert_allclose(after["bce"], before["bce"], rtol=1e-5)
    np.testing.assert_allclose(
        after["gradient_penalty"], before["gradient_penalty"], rtol=1e-5
    )


def test_token_model_trains_and_its_penalty_changes():
    # A length scale measured on the features: at the fixed 0.5 the kernel
    # values of these small features barely change with the embeddings,
    # and the penalty per unit of their spread stays near 1.
    model = _model(length_scale="auto")
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    x, y = _tokens(n=64)
    embeddings = ops.convert_to_numpy(model.trainable_weights[0]).copy()
    history = model.fit(x, y, epochs=4, batch_size=16, verbose=0).history
    penalties = history["gradient_penalty"]
    assert np.isfinite(penalties).all()
    # Not constant: the penalty moves the embeddings' gradient norm.
    assert np.ptp(penalties) > 1e-3 * max(penalties), penalties
    assert not np.allclose(ops.convert_to_numpy(model.trainable_weights[0]), embeddings)


def test_weight_decay_leaves_the_rows_of_absent_tokens_alone():
    # Coupled decay would give every embedding row a gradient on every step,
    # which Adam turns into a step of about its learning rate; the rows of
    # tokens that no batch holds must keep their values, the others decay.
    model = _model(weight_decay=0.5)
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    x, y = _tokens(n=32)
    x = np.where(x >= VOCABULARY // 2, 1, x).astype("int32")  # half the ids absent
    y = (x[:, 0] > 2).astype("int32")
    weights = [ops.convert_to_numpy(w).copy() for w in model.trainable_weights]
    model.train_on_batch(x, y)
    after = [ops.convert_to_numpy(w) for w in model.trainable_weights]
    absent = np.setdiff1d(np.arange(VOCABULARY), x)
    assert model.trainable_weights[0].path.endswith("embeddings")
    np.testing.assert_array_equal(after[0][absent], weights[0][absent])
    present = np.unique(x)
    assert not np.allclose(after[0][present], weights[0][present])
    # Every other weight still decays: with an enormous decay each moves.
    for before, now in zip(weights[1:], after[1:]):
        assert not np.allclose(before, now)


def _functional_model(**kwargs):
    """The Embedding layer in the DUQ model's own graph, not in a nested backbone."""
    tokens = keras.Input((LENGTH,), dtype="int32", name="tokens")
    z = keras.layers.Embedding(VOCABULARY, DIMS, name="words")(tokens)
    features = keras.layers.GlobalAveragePooling1D()(z)
    outputs = keras_duq.DUQOutput(num_classes=2, length_scale=0.5)(features)
    return keras_duq.DUQModel(tokens, outputs, penalty_input="words", **kwargs)


@pytest.mark.parametrize("penalty_interval", [1, 2])
def test_lazy_penalty_and_functional_model(penalty_interval):
    model = _functional_model(penalty_interval=penalty_interval)
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    x, y = _tokens()
    history = model.fit(x, y, epochs=2, batch_size=8, verbose=0).history
    assert np.isfinite(history["gradient_penalty"]).all()
    assert model.predict(x, verbose=0).shape == (len(x), 2)


@pytest.mark.parametrize("build", [_model, _functional_model])
def test_keras_round_trip_keeps_penalty_input(build, tmp_path):
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    x, y = _tokens()
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    path = tmp_path / "token.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    assert restored.penalty_input == model.penalty_input
    assert json.dumps(restored.get_config()) == json.dumps(model.get_config())
    # The training-only copy of the graph is not saved: the same weights.
    assert len(restored.weights) == len(model.weights)
    logs = model.evaluate(x, y, batch_size=len(x), verbose=0, return_dict=True)
    restored_logs = restored.evaluate(
        x, y, batch_size=len(x), verbose=0, return_dict=True
    )
    np.testing.assert_allclose(
        restored_logs["gradient_penalty"], logs["gradient_penalty"], rtol=1e-6
    )


def test_integer_inputs_error_points_to_penalty_input():
    with pytest.raises(ValueError, match="penalty_input='embedding'"):
        keras_duq.wrap(_backbone(), num_classes=2)


@pytest.mark.parametrize(
    ("penalty_input", "match"),
    [
        (
            "embeddings",
            r"no layer 'embeddings'.*'embedding'.*Received: `penalty_input='embeddings'`",
        ),
        (3, r"name of a layer \(a string\).*Received: `penalty_input=3`"),
        ("input_layer", r"names an input"),
        ("ids", r"output is floating point.*'ids' outputs"),
    ],
)
def test_bad_penalty_input_raises(penalty_input, match):
    tokens = keras.Input((LENGTH,), dtype="int32", name="input_layer")
    ids = keras.layers.Identity(name="ids")(tokens)
    z = keras.layers.Embedding(VOCABULARY, DIMS, name="embedding")(ids)
    features = keras.layers.GlobalAveragePooling1D()(z)
    outputs = keras_duq.DUQOutput(num_classes=2)(features)
    with pytest.raises(ValueError, match=match):
        keras_duq.DUQModel(tokens, outputs, penalty_input=penalty_input)


def test_layer_inside_a_subclassed_layer_is_named_in_the_error():
    class Encoder(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.embedding = keras.layers.Embedding(VOCABULARY, DIMS, name="inner")

        def call(self, tokens):
            return ops.mean(self.embedding(tokens), axis=1)

    tokens = keras.Input((LENGTH,), dtype="int32")
    features = Encoder(name="encoder")(tokens)
    outputs = keras_duq.DUQOutput(num_classes=2)(features)
    with pytest.raises(
        ValueError, match="inside the subclassed layer or model 'encoder'"
    ):
        keras_duq.DUQModel(tokens, outputs, penalty_input="inner")
    # Its own output is a layer output like any other.
    model = keras_duq.DUQModel(tokens, outputs, penalty_input="encoder")
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    x, y = _tokens(n=8)
    logs = model.train_on_batch(x, y, return_dict=True)
    assert np.isfinite(logs["gradient_penalty"])


def test_mixed_float16_step_matches_float32(policy):
    x, y = _tokens()
    logs, weights = {}, None
    for name in ("float32", "mixed_float16"):
        policy(name)
        model = _model()
        if weights is None:
            weights = model.get_weights()
        else:
            model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        logs[name] = model.train_on_batch(x, y, return_dict=True)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    np.testing.assert_allclose(
        logs["mixed_float16"]["gradient_penalty"],
        logs["float32"]["gradient_penalty"],
        rtol=1e-2,
    )


@pytest.mark.slow
@pytest.mark.requires_backend("tensorflow")  # tf.distribute
def test_mirrored_strategy_matches_one_device():
    # The replicas run their steps in threads of their own, each with its
    # own probe. Two logical CPUs must be configured before TensorFlow
    # starts: a fresh process.
    from harness import run

    report = run("penalty_input_mirrored.py", backend="tensorflow")
    np.testing.assert_allclose(*report["penalties"], rtol=1e-5)
    assert report["difference"] < 1e-5

"""DUQModel: the training step, its loss and penalty, Keras workflows, saving, errors."""

import json
import os

import harness
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_duq
from keras_duq import _duq_model
from keras_duq import _ops
from keras_duq import _validation

# What a rejected batch raises: a `ValueError`, or TensorFlow's graph error.
REJECTED = (ValueError, tf.errors.InvalidArgumentError)


_data = harness.tabular_data


def _model(batch_norm=False, gradient_penalty=0.5, **kwargs):
    def layers():
        norm = [keras.layers.BatchNormalization()] if batch_norm else []
        dense = keras.layers.Dense
        return [dense(8, activation="relu"), *norm, dense(8, activation="relu")]

    return harness.dense_model(layers, gradient_penalty=gradient_penalty, **kwargs)


def _compiled(lr=0.05, jit_compile="auto", **kwargs):
    model = _model(**kwargs)
    model.compile(optimizer=keras.optimizers.SGD(lr), jit_compile=jit_compile)
    return model


_state = harness.state
_assert_state_equal = harness.assert_state_equal


def _decayed_weights(model):
    """`(value, rate)` of each trainable weight, with W in place of `kernel`.

    `kernel` stores W divided by the projection's rate; the decay acts on W.
    """
    head = model.duq_output
    return [
        (
            keras.ops.convert_to_numpy(head.projection if w is head.kernel else w),
            head.projection_learning_rate if w is head.kernel else 1.0,
        )
        for w in model.trainable_weights
    ]


def _reference_loss(model, x, y, sample_weight=None):
    """BCE + categorical term + lambda * penalty + weight decay, from plain TF ops."""
    x = tf.constant(x)
    head = model.duq_output
    with tf.GradientTape() as tape:
        tape.watch(x)
        features = model.feature_extractor(x, training=False)
        kernel = tf.reshape(
            tf.matmul(features, head.projection),
            (-1, head.centroid_dims, head.num_classes),
        )
        centroids = head.centroid_sums / head.centroid_counts
        distance = tf.reduce_mean(tf.square(kernel - centroids[None]), axis=1)
        kernel_values = tf.exp(-distance / (2 * tf.square(head.length_scales)))
        total = tf.reduce_sum(kernel_values)
    gradient = tape.gradient(total, x)
    norm = tf.norm(tf.reshape(gradient, (tf.shape(x)[0], -1)), axis=1)
    k = tf.cast(kernel_values, tf.float64).numpy()
    one_hot = np.eye(head.num_classes)[y]
    bce = -np.mean(one_hot * np.log(k) + (1 - one_hot) * np.log(1 - k), axis=1)
    # Cross-entropy over minus the distances in length scales, sqrt(-2 log K)
    # (a floor of 1e-6 under the root), weighed per example.
    logits = -np.sqrt(-2.0 * np.log(k) + 1e-6)
    logits -= logits.max(axis=1, keepdims=True)
    log_softmax = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    cce = -np.sum(one_hot * log_softmax, axis=1)
    per_example = (
        bce
        + model.categorical_cross_entropy_weight * cce
        + model.gradient_penalty * (norm.numpy() - 1) ** 2
    )
    if sample_weight is not None:
        per_example = per_example * sample_weight
    decay = (
        0.5
        * model._weight_decay_in_effect()
        * sum(float(np.sum(w**2)) for w, _ in _decayed_weights(model))
    )
    return float(np.mean(per_example)) + decay


# ------------------------------------------------------------- the step


@pytest.mark.requires_backend("tensorflow")  # reference by tf.GradientTape
def test_evaluate_loss_matches_reference_formula():
    model = _compiled()
    x, y = _data()
    logs = model.evaluate(x, y, batch_size=64, return_dict=True, verbose=0)
    assert logs["loss"] == pytest.approx(_reference_loss(model, x, y), rel=1e-4)
    assert set(logs) >= {"loss", "bce", "gradient_penalty", "accuracy"}


@pytest.mark.requires_backend("tensorflow")  # reference by tf.GradientTape
def test_sample_weight_weights_the_per_example_loss():
    model = _compiled()
    x, y = _data()
    weights = np.linspace(0.0, 2.0, len(y)).astype("float32")
    logs = model.evaluate(
        x, y, sample_weight=weights, batch_size=64, return_dict=True, verbose=0
    )
    assert logs["loss"] == pytest.approx(
        _reference_loss(model, x, y, weights), rel=1e-4
    )


def test_class_weight_equals_the_matching_sample_weight():
    x, y = _data()
    class_weight = {0: 0.5, 1: 2.0, 2: 1.0}
    by_class = _compiled()
    by_class.fit(
        x,
        y,
        batch_size=64,
        epochs=1,
        class_weight=class_weight,
        shuffle=False,
        verbose=0,
    )
    by_sample = _compiled()
    weights = np.array([class_weight[int(label)] for label in y], dtype="float32")
    by_sample.fit(
        x, y, batch_size=64, epochs=1, sample_weight=weights, shuffle=False, verbose=0
    )
    for a, b in zip(by_class.weights, by_sample.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)


def test_centroids_update_once_in_inference_mode_at_the_steps_weights():
    # BatchNorm makes training-mode and inference-mode features differ, so
    # this catches an update from the training pass or from other weights
    # than those the step's gradients were taken at.
    model = _compiled(batch_norm=True)
    x, y = _data()
    head = model.duq_output
    counts = head.centroid_counts.numpy().copy()
    sums = head.centroid_sums.numpy().copy()
    features = keras.ops.convert_to_numpy(model.feature_extractor(x, training=False))
    embedded = np.einsum(
        "bf,fdc->bdc",
        features,
        keras.ops.convert_to_numpy(head.projection).reshape(8, 6, 3),
    )
    weights_before = [w.numpy().copy() for w in model.trainable_weights]
    model.train_on_batch(x, y)
    assert any(
        not np.array_equal(a, b.numpy())
        for a, b in zip(weights_before, model.trainable_weights)
    )
    one_hot = np.eye(3)[y]
    np.testing.assert_allclose(
        head.centroid_counts.numpy(), 0.9 * counts + 0.1 * one_hot.sum(0), rtol=1e-6
    )
    expected_sums = 0.9 * sums + 0.1 * np.einsum("bdc,bc->dc", embedded, one_hot)
    np.testing.assert_allclose(
        head.centroid_sums.numpy(), expected_sums, rtol=1e-4, atol=1e-5
    )


def test_coupled_weight_decay_adds_weight_decay_times_weight():
    x, y = _data()
    with_decay = _compiled(lr=1.0, weight_decay=0.01, gradient_penalty=0.0)
    without = _compiled(lr=1.0, weight_decay=0.0, gradient_penalty=0.0)
    initial = _decayed_weights(with_decay)
    with_decay.train_on_batch(x, y)
    without.train_on_batch(x, y)
    for (w0, r), (a, _), (b, _) in zip(
        initial, _decayed_weights(with_decay), _decayed_weights(without)
    ):
        # Plain SGD, lr 1: the only difference is -lr * weight_decay * w0, which
        # W takes at its rate.
        np.testing.assert_allclose(a - b, -0.01 * r * w0, atol=1e-6)


@pytest.mark.parametrize(
    "optimizer, decay",
    [
        (lambda: keras.optimizers.SGD(0.5), 1e-4),
        (lambda: keras.optimizers.SGD(0.5, momentum=0.9), 1e-4),
        (lambda: keras.optimizers.Adam(0.01), 0.0),
        (lambda: keras.optimizers.RMSprop(0.01), 0.0),
    ],
)
def test_default_weight_decay_is_the_papers_under_sgd_and_none_otherwise(
    optimizer, decay
):
    x, y = _data()
    trained = []
    for weight_decay in (None, decay):
        model = _model(weight_decay=weight_decay, gradient_penalty=0.0)
        # Eager: one step each, not worth a traced function.
        model.compile(optimizer=optimizer(), run_eagerly=True)
        model.train_on_batch(x, y)
        trained.append([keras.ops.convert_to_numpy(w) for w in model.weights])
    for default, explicit in zip(*trained):
        np.testing.assert_array_equal(default, explicit)
    # And the decay is real where it applies: an explicit one differs.
    model = _model(weight_decay=0.5, gradient_penalty=0.0)
    model.compile(optimizer=optimizer(), run_eagerly=True)
    model.train_on_batch(x, y)
    assert not all(
        np.array_equal(keras.ops.convert_to_numpy(w), t)
        for w, t in zip(model.weights, trained[0])
    )


def test_bce_epsilon_stops_the_pull_of_far_centroids():
    # At initialisation every kernel value is far below 1e-12 (length scale
    # 0.01). With the paper code's epsilon the cross-entropy then barely
    # moves the backbone; the exact gradient moves it.
    x, y = _data()

    def weight_change(bce_epsilon):
        model = _model(
            gradient_penalty=0.0,
            weight_decay=0.0,
            bce_epsilon=bce_epsilon,
            categorical_cross_entropy_weight=0.0,  # the paper's loss alone
        )
        model.duq_output.length_scales.assign(np.full(3, 0.01, "float32"))
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        assert model.predict_on_batch(x).max() < 1e-12
        before = model.feature_extractor.trainable_weights[0].numpy().copy()
        model.train_on_batch(x, y)
        return np.abs(
            model.feature_extractor.trainable_weights[0].numpy() - before
        ).max()

    exact, floored = weight_change(0.0), weight_change(1e-12)
    assert exact > 1e-3
    assert floored < 1e-6 * exact


def _penalty_term(model, x):
    _, penalty = model._log_kernel_and_penalty(x, training=False)
    return tf.reduce_mean(penalty)


@pytest.mark.requires_backend("tensorflow")  # gradients by tf.GradientTape
def test_penalty_gradient_reaches_backbone_and_matches_finite_differences():
    model = _model(gradient_penalty=1.0)
    x, _ = _data(n=8)
    x = tf.constant(x)
    variable = model.feature_extractor.trainable_weights[0]
    with tf.GradientTape() as tape:
        penalty = _penalty_term(model, x)
    gradient = tape.gradient(penalty, variable).numpy()
    assert np.abs(gradient).max() > 1e-4
    original = variable.numpy().copy()
    rows, cols = np.unravel_index(
        np.argsort(-np.abs(gradient), axis=None)[:3], gradient.shape
    )
    for i, j in zip(rows, cols):
        estimates = []
        for sign in (1.0, -1.0):
            perturbed = original.copy()
            perturbed[i, j] += sign * 1e-2
            variable.assign(perturbed)
            estimates.append(float(_penalty_term(model, x)))
        variable.assign(original)
        finite_difference = (estimates[0] - estimates[1]) / 2e-2
        assert finite_difference == pytest.approx(gradient[i, j], rel=0.05, abs=1e-4)


@pytest.mark.requires_backend("tensorflow")  # the TensorFlow step's penalty
def test_no_nan_when_kernels_underflow_at_initialisation():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    features = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras_duq.DUQOutput(
        num_classes=3,
        length_scale=1e-3,
        kernel_initializer=keras.initializers.RandomNormal(stddev=10.0),
    )(features)
    model = keras_duq.DUQModel(inputs, outputs, gradient_penalty=1.0)
    # A tiny learning rate: this test is about the penalty's norm at zero,
    # not about how far the first (huge) loss gradient throws the weights.
    model.compile(optimizer=keras.optimizers.SGD(1e-9))
    x, y = _data()
    assert np.all(model.predict(x, verbose=0) == 0.0)  # fully saturated
    gradient_norm = _ops.gradient_norms(
        [model._log_kernel_and_penalty(tf.constant(x), training=True)[1]]
    )
    assert np.isfinite(gradient_norm.numpy()).all()
    logs = model.fit(x, y, epochs=2, batch_size=16, verbose=0).history
    assert all(np.isfinite(v).all() for v in logs.values())
    assert all(np.isfinite(w.numpy()).all() for w in model.weights)


@pytest.mark.requires_backend("tensorflow")  # the TensorFlow step's penalty
def test_zero_penalty_skips_penalty():
    model = _compiled(gradient_penalty=0.0)
    x, y = _data()
    _, penalty = model._log_kernel_and_penalty(tf.constant(x), training=True)
    assert penalty is None
    logs = model.fit(x, y, epochs=1, verbose=0).history
    assert "gradient_penalty" not in logs and "bce" in logs


def test_one_sided_penalty_trains():
    model = _compiled(penalty="one_sided")
    x, y = _data()
    history = model.fit(x, y, epochs=3, verbose=0).history
    assert np.isfinite(history["gradient_penalty"]).all()


def test_predictions_do_not_depend_on_the_batch():
    model = _compiled(batch_norm=True)
    x, y = _data()
    model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    full = model.predict(x, batch_size=64, verbose=0)
    for i in (0, 17, 63):
        np.testing.assert_allclose(
            model.predict(x[i : i + 1], verbose=0)[0], full[i], rtol=1e-5, atol=1e-7
        )


def test_model_learns_a_separable_problem():
    rng = np.random.default_rng(1)
    centers = np.array([[3, 0, 0, 0], [0, 3, 0, 0], [0, 0, 3, 0]], dtype="float32")
    y = rng.integers(0, 3, size=300)
    x = (centers[y] + rng.normal(scale=0.5, size=(300, 4))).astype("float32")
    model = _compiled(lr=0.05)
    history = model.fit(x, y, epochs=15, batch_size=32, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    assert history["accuracy"][-1] > 0.9


# ------------------------------------------------------- keras workflows


def test_fit_logs_and_compiled_metrics_receive_kernel_values():
    seen = {}

    class KernelRange(keras.metrics.Metric):
        def __init__(self, name="kernel_range", **kwargs):
            super().__init__(name=name, **kwargs)
            self.low = self.add_variable((), initializer="ones", name="low")
            self.high = self.add_variable((), initializer="zeros", name="high")

        def update_state(self, y_true, y_pred, sample_weight=None):
            seen["shape"] = tuple(y_pred.shape)
            self.low.assign(keras.ops.minimum(self.low, keras.ops.min(y_pred)))
            self.high.assign(keras.ops.maximum(self.high, keras.ops.max(y_pred)))

        def result(self):
            return self.high - self.low

    model = _model()
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        metrics=[
            keras.metrics.SparseCategoricalAccuracy(name="sparse_acc"),
            KernelRange(),
        ],
    )
    x, y = _data()
    history = model.fit(
        x, y, validation_data=(x, y), epochs=2, batch_size=16, verbose=0
    ).history
    for key in (
        "loss",
        "bce",
        "gradient_penalty",
        "accuracy",
        "sparse_acc",
        "kernel_range",
    ):
        assert key in history and "val_" + key in history, key
    assert seen["shape"][-1] == 3
    assert 0.0 <= history["kernel_range"][-1] <= 1.0
    np.testing.assert_allclose(history["sparse_acc"], history["accuracy"], atol=1e-6)
    logs = model.evaluate(x, y, return_dict=True, verbose=0)
    assert set(logs) == {
        "loss",
        "bce",
        "gradient_penalty",
        "accuracy",
        "sparse_acc",
        "kernel_range",
        "certainty",
        "underflow",
        "zero_input_gradient",
    }


def test_tf_data_and_callbacks(tmp_path):
    model = _compiled()
    x, y = _data(n=96)
    train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=0).batch(16)
    val = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=1),
        keras.callbacks.ModelCheckpoint(
            str(tmp_path / "best.keras"), save_best_only=True
        ),
        keras.callbacks.TensorBoard(str(tmp_path / "logs")),
        keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
    ]
    history = model.fit(
        train, validation_data=val, epochs=3, callbacks=callbacks, verbose=0
    )
    assert len(history.history["loss"]) >= 2
    restored = keras.models.load_model(tmp_path / "best.keras")
    assert isinstance(restored, keras_duq.DUQModel)
    assert any(
        name.startswith("events")
        for _, _, files in os.walk(tmp_path / "logs")
        for name in files
    )


def _fit_arguments(model, *args, **kwargs):
    fit = keras.Model.fit.__get__(model)
    arguments = _duq_model._bound_arguments(fit, args, kwargs)
    return model.prepare_arguments("fit", arguments)


def _rows(dataset, index):
    return np.concatenate([batch[index].numpy() for batch in dataset])


@pytest.mark.requires_backend("tensorflow")  # tf.data feeding
def test_arrays_reach_fit_as_keras_batches_without_autotuning():
    # With autotuning on, a whole `fit` on arrays took up to twice its steps'
    # time (research/reproduction/studies/fit_overhead.py); the batches must stay Keras's own.
    model = _compiled()
    x, y = _data(n=70)
    arguments = _fit_arguments(model, x, y, 32, validation_split=0.2)
    train, validation = arguments["x"], arguments["validation_data"]
    for dataset, batches in ((train, 2), (validation, 1)):
        assert isinstance(dataset, tf.data.Dataset)
        assert dataset.options().autotune.enabled is False
        assert int(dataset.cardinality()) == batches
    # Keras's split: the last 20% validates, in order; training is shuffled.
    np.testing.assert_array_equal(_rows(validation, 0), x[56:])
    np.testing.assert_array_equal(_rows(validation, 1), y[56:])
    np.testing.assert_array_equal(np.sort(_rows(train, 1)), np.sort(y[:56]))
    assert arguments["validation_split"] == 0.0 and arguments["batch_size"] is None


def test_datasets_and_generators_reach_fit_unchanged():
    model = _compiled()
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    assert _fit_arguments(model, dataset, epochs=2)["x"] is dataset


def test_array_fit_keeps_keras_semantics():
    x, y = _data(n=80)
    model = _compiled()
    history = model.fit(x, y, 16, 2, 0, validation_split=0.25, shuffle=False)
    assert len(history.history["loss"]) == 2
    logs = model.evaluate(x[60:], y[60:], batch_size=16, return_dict=True, verbose=0)
    assert history.history["val_loss"][-1] == pytest.approx(logs["loss"], rel=1e-5)
    seen = []
    counter = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(batch)
    )
    model.fit(
        x, y, batch_size=8, steps_per_epoch=3, epochs=2, verbose=0, callbacks=[counter]
    )
    assert seen == [0, 1, 2, 0, 1, 2]
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(32)
    np.testing.assert_allclose(
        model.predict(x, verbose=0), model.predict(dataset, verbose=0), rtol=1e-6
    )


def test_dict_inputs_and_uint8_images():
    keras.utils.set_random_seed(0)
    image = keras.Input((6, 6, 1), name="image")
    extra = keras.Input((3,), name="extra")
    x = keras.layers.Flatten()(image)
    x = keras.layers.Concatenate()([x, extra])
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras_duq.DUQOutput(num_classes=2)(x)
    model = keras_duq.DUQModel(
        {"image": image, "extra": extra}, outputs, gradient_penalty=0.5
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    rng = np.random.default_rng(0)
    data = {
        # Small integers: raw 0-255 pixels make training stop on a non-finite
        # step (test_unnormalised_inputs_stop_training_with_finite_state).
        "image": rng.integers(0, 4, size=(32, 6, 6, 1)).astype("uint8"),
        "extra": rng.normal(size=(32, 3)).astype("float32"),
    }
    y = rng.integers(0, 2, size=32)
    history = model.fit(data, y, epochs=2, batch_size=8, verbose=0).history
    assert np.isfinite(history["gradient_penalty"]).all()
    # The penalty norm covers both inputs together.
    prepared = _validation.standardize_inputs(
        model.feature_extractor.input,
        {k: keras.ops.convert_to_tensor(v[:4]) for k, v in data.items()},
    )
    assert keras.backend.standardize_dtype(prepared["image"].dtype) == "float32"


def test_integer_only_inputs_need_penalty_off():
    tokens = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(20, 4)(tokens)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras_duq.DUQOutput(num_classes=2)(x)
    with pytest.raises(ValueError, match="gradient_penalty=0"):
        keras_duq.DUQModel(tokens, outputs, gradient_penalty=0.1)
    model = keras_duq.DUQModel(tokens, outputs, gradient_penalty=0.0)
    model.compile(optimizer="sgd")
    x = np.random.default_rng(0).integers(0, 20, size=(16, 5))
    model.fit(x, np.arange(16) % 2, epochs=1, verbose=0)


# ----------------------------------------------------------------- saving


def test_keras_save_and_load_round_trip(tmp_path):
    model = _model(batch_norm=True)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    x, y = _data()
    model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    path = tmp_path / "duq.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    assert type(restored) is keras_duq.DUQModel
    np.testing.assert_array_equal(
        restored.predict(x, verbose=0), model.predict(x, verbose=0)
    )
    for a, b in zip(model.weights, restored.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # Compared as JSON, the form they are saved in (tuples become lists).
    assert json.dumps(restored.get_config()) == json.dumps(model.get_config())
    # A file saved before the categorical term existed trained without it.
    config = model.get_config()
    del config["categorical_cross_entropy_weight"]
    old = keras_duq.DUQModel.from_config(config)
    assert old.categorical_cross_entropy_weight == 0.0
    # One saved when the weight was divided by the number of classes: the
    # same loss, as a weight per example.
    config = model.get_config()
    del config["categorical_cross_entropy_per_example"]
    config["categorical_cross_entropy_weight"] = 10.0
    old = keras_duq.DUQModel.from_config(config)
    assert old.categorical_cross_entropy_weight == 10.0 / model.num_classes
    # Training continues exactly like the original (same optimizer state).
    model.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    restored.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0)
    for a, b in zip(model.weights, restored.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


# ------------------------------------------- mixed precision, distribution


@pytest.mark.requires_backend("tensorflow")  # the TensorFlow step's penalty
def test_mixed_float16_step_matches_float32(policy):
    x, y = _data()
    updates, penalties = {}, {}
    initial = None
    for name in ("float32", "mixed_float16"):
        policy(name)
        model = _compiled(gradient_penalty=1.0)
        if initial is None:
            initial = [w.numpy().copy() for w in model.weights]
        for weight, value in zip(model.weights, initial):
            weight.assign(value)
        if name == "mixed_float16":
            # compile() wraps the optimizer, so the step must scale the loss.
            assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
            assert model.feature_extractor.layers[1].compute_dtype == "float16"
        penalties[name] = float(_penalty_term(model, tf.constant(x)))
        model.train_on_batch(x, y)
        updates[name] = [w.numpy() - v for w, v in zip(model.weights, initial)]
    assert penalties["mixed_float16"] == pytest.approx(penalties["float32"], rel=1e-3)
    for reference, update in zip(updates["float32"], updates["mixed_float16"]):
        scale = np.abs(reference).max()
        np.testing.assert_allclose(update, reference, atol=0.01 * scale + 1e-7)


def _tiny_input_gradient_model():
    # Far from every centroid (largest kernel value ~3e-10), the penalty's
    # input gradient is ~1e-10: zero in float16 unless scaled.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(
        16,
        activation="relu",
        bias_initializer="ones",
        kernel_initializer=keras.initializers.RandomNormal(stddev=1.0),
    )(inputs)
    outputs = keras_duq.DUQOutput(
        num_classes=3, centroid_dims=6, length_scale=0.2, momentum=0.9
    )(x)
    model = keras_duq.DUQModel(inputs, outputs, gradient_penalty=1.0)
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    return model


@pytest.mark.requires_backend("tensorflow")  # gradients by tf.GradientTape
def test_penalty_gradient_survives_float16_underflow(policy, monkeypatch):
    x, _ = _data(n=16)
    x = tf.constant(x)

    def penalty_gradient(model):
        # As in train_step: the outer gradient is loss-scaled too.
        scale = float(model.optimizer.scale_loss(1.0))
        kernel = model.feature_extractor.layers[1].kernel
        with tf.GradientTape() as tape:
            penalty = _penalty_term(model, x) * scale
        return tape.gradient(penalty, kernel).numpy() / scale

    reference = penalty_gradient(_tiny_input_gradient_model())
    policy("mixed_float16")
    model = _tiny_input_gradient_model()
    model.optimizer.build(model.trainable_variables)
    assert float(model._input_gradient_scale()) == 2.0**15
    scaled = penalty_gradient(model)
    # Without the scale the float16 input gradient is all zeros, and so is
    # the penalty's gradient (measured: scaled 0.3% off, unscaled 100%).
    monkeypatch.setattr(type(model), "_input_gradient_scale", lambda model: None)
    unscaled = penalty_gradient(model)

    def error(gradient):
        return np.abs(gradient - reference).max() / np.abs(reference).max()

    assert error(scaled) < 0.01, error(scaled)
    assert error(unscaled) > 0.5, error(unscaled)


@pytest.fixture(scope="module")
def mirrored_reports():
    # Two logical CPUs must be configured before TensorFlow starts: a fresh
    # process, which runs every case below (one TensorFlow start).
    return harness.run("mirrored.py", backend="tensorflow")


@pytest.mark.requires_backend("tensorflow")  # tf.distribute
@pytest.mark.parametrize(
    "head, length_scale",
    [("per_class", "0.5"), ("shared", "0.5"), ("per_class", "auto"), ("shared", "auto")],
)
def test_mirrored_strategy_matches_one_device(mirrored_reports, head, length_scale):
    # Without the cross-replica sum in update_centroids the weights differ by
    # ~0.8 here (measured), the replicas' centroid copies agreeing. With
    # `"auto"` the length scale follows the spread of the global batch (the
    # replicas see different classes, so their own spreads differ).
    report = mirrored_reports[f"{head}-{length_scale}"]
    assert report["replicas"] == 2 and report["copies"] == 2
    assert report["copy_difference"] == 0.0
    assert report["difference"] < 1e-5


def _free_ports(count):
    import socket

    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [str(sock.getsockname()[1]) for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


@pytest.mark.slow  # three processes, each starting TensorFlow
@pytest.mark.requires_backend("tensorflow")  # tf.distribute
def test_multi_worker_mirrored_strategy_matches_one_process(tmp_path):
    # Two worker processes on 127.0.0.1 (one CPU replica each) train on
    # halves of each global batch; both must end with the weights and
    # centroid state of one process training on the whole batches. Without
    # the cross-replica sum in update_centroids the workers still agree
    # (the state's "mean" aggregation), but the centroid sums differ from
    # the reference by ~1.0 (measured).
    import subprocess
    import sys

    sys.path.insert(0, harness.SCRIPTS_DIR)
    try:
        from distributed_model import build
    finally:
        sys.path.remove(harness.SCRIPTS_DIR)
    keras.utils.set_random_seed(0)
    reference = build()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = np.array([0] * 2 + [1] * 6 + [2] * 8)  # the workers see different classes
    initial = tmp_path / "initial.npz"
    np.savez(
        initial,
        x=x,
        y=y,
        **{f"w{i}": w.numpy() for i, w in enumerate(reference.weights)},
    )
    reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)

    ports = ",".join(_free_ports(2))
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                harness.script_path("multi_worker.py"),
                str(i),
                ports,
                str(initial),
                str(tmp_path / f"worker{i}.npz"),
            ],
            env=harness.script_env("tensorflow"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        for worker in workers:
            _, stderr = worker.communicate(timeout=300)
            assert worker.returncode == 0, stderr[-3000:]
    finally:
        for worker in workers:
            worker.kill()
    results = [np.load(tmp_path / f"worker{i}.npz") for i in range(2)]
    assert int(results[0]["replicas"]) == 2
    for i, weight in enumerate(reference.weights):
        np.testing.assert_array_equal(results[0][f"w{i}"], results[1][f"w{i}"])
        np.testing.assert_allclose(
            results[0][f"w{i}"], weight.numpy(), atol=1e-5, err_msg=weight.path
        )


def test_backup_and_restore_resumes_exactly(tmp_path):
    x, y = _data()

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() == 9:  # mid epoch 3
                raise RuntimeError("interrupted")

    def fresh(initial):
        model = _model(batch_norm=True)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
        for weight, value in zip(model.weights, initial):
            weight.assign(value)
        return model

    reference = _model(batch_norm=True)
    initial = [w.numpy().copy() for w in reference.weights]
    reference = fresh(initial)
    fit = dict(epochs=4, batch_size=16, shuffle=False, verbose=0)
    reference.fit(x, y, **fit)

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        fresh(initial).fit(x, y, callbacks=[backup, Interrupt()], **fit)
    resumed = fresh(initial)
    epochs_run = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: epochs_run.append(epoch)
    )
    restore = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    resumed.fit(x, y, callbacks=[restore, record], **fit)
    assert epochs_run == [2, 3]  # it resumed after the last completed epoch

    for a, b in zip(reference.weights, resumed.weights):
        np.testing.assert_allclose(
            a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7, err_msg=a.path
        )
    for a, b in zip(reference.optimizer.variables, resumed.optimizer.variables):
        np.testing.assert_allclose(
            a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7, err_msg=a.path
        )


# ----------------------------------------------------------------- errors


def test_loss_in_compile_is_rejected_at_compile():
    model = _model()
    with pytest.raises(ValueError, match="Remove `loss`.*Received: `loss='mse'`"):
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="Remove `loss`"):
        model.compile("sgd", "mse")
    model.compile(optimizer="sgd")
    x, y = _data()
    assert np.isfinite(model.fit(x, y, epochs=1, verbose=0).history["loss"]).all()


def test_loaded_model_is_compiled_as_saved(tmp_path):
    # DUQModel overrides `compile`, which makes Keras skip the compilation on
    # load unless the model restores it itself.
    model = _model()
    top_2 = keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top_2")
    model.compile(optimizer=keras.optimizers.Adam(0.003), metrics=[top_2])
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert isinstance(loaded.optimizer, keras.optimizers.Adam)
    assert float(np.asarray(loaded.optimizer.learning_rate)) == pytest.approx(0.003)
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    logs = loaded.evaluate(x, y, return_dict=True, verbose=0)
    assert logs["top_2"] == pytest.approx(
        model.evaluate(x, y, return_dict=True, verbose=0)["top_2"]
    )


@pytest.mark.parametrize("route", ["y", "list", "validation_data", "evaluate"])
def test_non_numeric_labels_get_a_clear_error(route):
    model = _compiled()
    x, y = _data()
    names = np.array(["a", "b", "c"])[y]
    state = _state(model)
    with pytest.raises(
        ValueError, match=r"Expected numeric labels.*Received: labels of dtype <U1"
    ):
        if route == "y":
            model.fit(x, names, epochs=1, verbose=0)
        elif route == "list":
            model.fit(x, list(names), epochs=1, verbose=0)
        elif route == "validation_data":
            model.fit(x, y, validation_data=(x, names), epochs=1, verbose=0)
        else:
            model.evaluate(x, names, verbose=0)
    _assert_state_equal(model, state)


def test_xla_step_matches_graph_step():
    x, y = _data()
    models = []
    for jit_compile in (False, True):
        model = _compiled(jit_compile=jit_compile, batch_norm=True)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        models.append(model)
    assert models[1].jit_compile and not models[0].jit_compile
    for graph, xla in zip(*(m.weights for m in models)):
        np.testing.assert_allclose(
            xla.numpy(), graph.numpy(), atol=1e-5, err_msg=graph.path
        )
    logs = [m.evaluate(x, y, verbose=0, return_dict=True) for m in models]
    for name in logs[0]:
        np.testing.assert_allclose(logs[1][name], logs[0][name], rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gradient_penalty": -1.0}, "gradient_penalty"),
        ({"weight_decay": -1e-4}, "weight_decay"),
        ({"bce_epsilon": -1e-12}, "bce_epsilon"),
        (
            {"categorical_cross_entropy_weight": -1.0},
            "categorical_cross_entropy_weight",
        ),
        ({"penalty": "both"}, "two_sided"),
        ({"penalty_interval": 0}, "penalty_interval"),
        ({"penalty_interval": 2.0}, "penalty_interval"),
        ({"clipnorm": 0.0}, "clipnorm"),
        ({"clipnorm": float("inf")}, "clipnorm"),
        ({"clipnorm": True}, "clipnorm"),
    ],
)
def test_bad_model_arguments(kwargs, message):
    with pytest.raises(ValueError, match=f"(?s){message}.*Received"):
        _model(**kwargs)


def _one_step_weights(optimizer, **kwargs):
    model = _model(**kwargs)
    model.compile(optimizer=optimizer)
    x, y = _data()
    # Far from unit variance: the first gradients are longer than 1e-3.
    model.train_on_batch(x * 3.0, y)
    return [keras.ops.convert_to_numpy(w) for w in model.trainable_weights]


def _assert_weights_close(first, second):
    for a, b in zip(first, second):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_scale", [False, True], ids=["plain", "loss_scale"])
def test_clipnorm_clips_as_the_optimizer_argument_does(loss_scale):
    def sgd(**clipping):
        optimizer = keras.optimizers.SGD(0.05, **clipping)
        if loss_scale:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        return optimizer

    model_clipped = _one_step_weights(sgd(), clipnorm=1e-3)
    optimizer_clipped = _one_step_weights(sgd(clipnorm=1e-3), clipnorm=None)
    _assert_weights_close(model_clipped, optimizer_clipped)
    unclipped = _one_step_weights(sgd(), clipnorm=None)
    assert any(not np.allclose(a, b) for a, b in zip(model_clipped, unclipped)), (
        "the bound was never reached: the test measures nothing"
    )


def test_optimizer_clipping_rules_over_the_models():
    optimizer_only = _one_step_weights(
        keras.optimizers.SGD(0.05, clipvalue=1e-3), clipnorm=None
    )
    both = _one_step_weights(keras.optimizers.SGD(0.05, clipvalue=1e-3))
    _assert_weights_close(both, optimizer_only)


def test_clipnorm_is_saved_and_old_files_load_unclipped():
    model = _model(clipnorm=0.5)
    config = model.get_config()
    assert config["clipnorm"] == 0.5
    assert keras_duq.DUQModel.from_config(config).clipnorm == 0.5
    del config["clipnorm"]
    assert keras_duq.DUQModel.from_config(config).clipnorm is None
    assert _model().clipnorm == 1.0
    assert keras_duq.PAPER_SETTINGS["clipnorm"] is None


def test_outputs_must_come_from_duq_output():
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3)(inputs)
    with pytest.raises(ValueError, match="DUQOutput"):
        keras_duq.DUQModel(inputs, outputs)


@pytest.mark.parametrize("gradient_penalty", [0.0, 1.0], ids=["no_penalty", "penalty"])
def test_unnormalised_inputs_stop_training_with_finite_state(gradient_penalty):
    # Raw-pixel-scale inputs make the exact log-space loss overflow within a
    # few steps when the gradients are not clipped; training must stop with
    # advice, never leave NaN behind.
    model = _unnormalised_input_model(gradient_penalty, clipnorm=None)
    x, y = _data(n=256, classes=2)
    with pytest.raises(REJECTED, match="not normalised"):
        model.fit(x * 1000.0, y, epochs=5, batch_size=32, verbose=0)
    for variable in model.weights:
        assert np.all(np.isfinite(variable.numpy())), variable.path


@pytest.mark.parametrize("gradient_penalty", [0.0, 1.0], ids=["no_penalty", "penalty"])
def test_unnormalised_inputs_with_clipping_warn_with_finite_state(gradient_penalty):
    # The default clipping keeps the same run finite: it does not learn
    # (every kernel value underflows), and `fit` says why.
    model = _unnormalised_input_model(gradient_penalty)
    x, y = _data(n=256, classes=2)
    with pytest.warns(keras_duq.DUQHealthWarning, match="not standardised"):
        model.fit(x * 1000.0, y, epochs=5, batch_size=32, verbose=0)
    for variable in model.weights:
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(variable))), variable.path


def _unnormalised_input_model(gradient_penalty, **kwargs):
    keras.utils.set_random_seed(0)
    backbone = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(16, activation="relu")]
    )
    model = keras_duq.wrap(
        backbone,
        num_classes=2,
        length_scale=0.1,
        gradient_penalty=gradient_penalty,
        **kwargs,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    return model


def test_non_finite_gradient_step_is_not_applied():
    model = _compiled()
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    state = _state(model)
    # Finite inputs whose loss overflows to Inf in the first step.
    with pytest.raises(REJECTED, match="non-finite"):
        model.fit(x * 1e30, y, epochs=1, verbose=0)
    _assert_state_equal(model, state)


def test_every_label_format_in_any_order_on_one_model():
    model = _compiled(classes=3)
    x, y = _data(classes=3)
    formats = [
        y,
        y[:, None],
        np.eye(3, dtype="float32")[y],
        y.astype("float32"),
        y[:, None].astype("int32"),
        np.eye(3, dtype="float32")[y],
        y,
    ]
    for labels in formats:
        history = model.fit(x, labels, batch_size=32, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][-1])
        logs = model.evaluate(x, labels, verbose=0, return_dict=True)
        predicted = model.predict(x, verbose=0).argmax(axis=1)
        assert logs["accuracy"] == pytest.approx(np.mean(predicted == y), abs=1e-6)


class _SpectralBlock(keras.layers.Layer):
    """A custom layer (not a Model) that owns a SpectralNormalization."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.normalized = _spectral_dense()

    def call(self, x):
        return self.normalized(x)


def _spectral_dense():
    initializer = keras.initializers.RandomNormal(stddev=3.0)
    return keras.layers.SpectralNormalization(
        keras.layers.Dense(8, kernel_initializer=initializer)
    )


@pytest.mark.parametrize("placement", ["in_model", "in_custom_layer"])
def test_failed_step_keeps_spectral_normalization_kernels(placement):
    # Keras's SpectralNormalization writes the normalised kernel into the
    # (trainable) kernel during the forward pass; a rejected step must undo it,
    # also where the wrapper sits inside a user's own layer.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    layer = _spectral_dense() if placement == "in_model" else _SpectralBlock()
    features = layer(inputs)
    model = keras_duq.DUQModel(
        inputs, keras_duq.DUQOutput(2, length_scale=0.1)(features), gradient_penalty=1.0
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    state = _state(model)
    x, _ = _data(n=32, features=4, classes=2)
    with pytest.raises(REJECTED, match="not normalised"):
        model.fit(x * 1e20, np.zeros(32, "int64"), batch_size=32, verbose=0)
    _assert_state_equal(model, state)

"""The same DUQ behaviour on every Keras backend, checked in this process.

Run the file under `KERAS_BACKEND=tensorflow`, `jax` and `torch`: nothing
here depends on which one.
"""

import harness
import keras
import numpy as np
import pytest
from harness import data as _data
from harness import make_model as _model

import keras_duq


def _state(model):
    return harness.state(model, optimizer=True)


def _unchanged(model, state):
    return all(np.array_equal(a, b) for a, b in zip(state, _state(model)))


@pytest.mark.parametrize("head", ["per_class", "shared"])
def test_fit_evaluate_predict_callbacks_and_keras_file(tmp_path, head):
    model = _model(head=head)
    assert model.duq_output.resolved_head == head
    x, y = _data(n=64)
    stopper = keras.callbacks.EarlyStopping(monitor="val_loss", patience=10)
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        validation_data=(x, y),
        verbose=0,
        callbacks=[stopper],
    ).history
    assert {"loss", "bce", "gradient_penalty", "accuracy", "val_loss"} <= set(history)
    assert "duq_error_code" not in history
    assert np.isfinite(history["loss"]).all()
    assert int(model.optimizer.iterations) == 8
    logs = model.evaluate(x, y, verbose=0, return_dict=True)
    assert logs["loss"] == pytest.approx(history["val_loss"][-1], rel=1e-5)
    kernels = model.predict(x, verbose=0)
    assert kernels.shape == (64, 3) and kernels.dtype == np.float32
    assert 0.0 <= kernels.min() <= kernels.max() <= 1.0
    assert logs["accuracy"] == pytest.approx(np.mean(kernels.argmax(1) == y), abs=1e-6)

    path = str(tmp_path / "model.keras")
    model.save(path)
    reloaded = keras.saving.load_model(path)
    np.testing.assert_allclose(reloaded.predict(x, verbose=0), kernels, atol=1e-6)
    assert reloaded.duq_output.resolved_head == head
    assert int(reloaded.optimizer.iterations) == 8
    reloaded.fit(x, y, batch_size=16, epochs=1, verbose=0)  # keeps training
    assert int(reloaded.optimizer.iterations) == 12


# XLA drops Assert ops silently: the step's checks must hold compiled and not.
# The bad batches come as a stream, which only the step checks (in-memory
# arrays are checked whole before the call: test_failed_calls.py), the bad
# values in its first batch.
@pytest.mark.parametrize("jit_compile", [False, True], ids=["no_jit", "jit"])
def test_rejected_batches_change_nothing(jit_compile):
    # Not a weight, centroid, optimizer slot or `optimizer.iterations`: a
    # learning-rate schedule stays where it was. The overflow also overflows
    # BatchNormalization's batch variance: its moving statistics must stay.
    # One model meets every bad batch in turn, and trains on between them.
    model = _model(jit_compile=jit_compile)
    x, y = _data(n=32)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    nan_x = np.where(np.arange(32)[:, None, None, None] == 3, np.nan, x)
    cases = {
        "too_large": (x, y + 3, "class indices in"),
        "negative": (x, y - 1, "class indices in"),
        "fractional": (x, y + 0.5, "fractional"),
        "nan_input": (nan_x, y, "NaN"),
        "overflow": (x * 1e30, y, "non-finite"),
        "wrong_one_hot_width": (x, np.eye(5, dtype="float32")[y], "label"),
        "soft_one_hot": (x, 0.9 * np.eye(3, dtype="float32")[y] + 0.1 / 3, "soft"),
        "nan_label": (x, np.where(np.arange(32) == 5, np.nan, y), "NaN or infinite"),
    }

    def stream(bad_x, bad_y):
        for start in (0, 16):
            yield bad_x[start : start + 16].astype("float32"), bad_y[start : start + 16]

    steps = 4
    for case, (bad_x, bad_y, message) in cases.items():
        assert int(model.optimizer.iterations) == steps, case
        state = _state(model)
        with pytest.raises(ValueError, match=message):
            model.fit(stream(bad_x, bad_y), epochs=1, verbose=0)
        assert _unchanged(model, state), case
        assert int(model.optimizer.iterations) == steps, case
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # still trains
        steps += 2


class _OverflowsInInference(keras.layers.Layer):
    """Features that overflow in inference mode only: the step is finite, the centroids not."""

    def call(self, x, training=None):
        return x if training else x * keras.ops.exp(keras.ops.abs(x))


def test_failed_centroid_update_applies_nothing_of_the_step():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    x = _OverflowsInInference()(keras.layers.Dense(8)(inputs))
    outputs = keras_duq.DUQOutput(3, centroid_dims=6, length_scale=0.5)(x)
    model = keras_duq.DUQModel(inputs, outputs, gradient_penalty=0.0)
    model.compile(optimizer=keras.optimizers.SGD(1e-6, momentum=0.9))
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.arange(16) % 3
    model.fit(x, y, batch_size=16, verbose=0)
    state = _state(model)
    # exp(1000) overflows float32 in inference mode: the centroid update.
    with pytest.raises(keras_duq.DUQBatchError, match="centroid update is not finite"):
        model.fit(1000 * x, y, batch_size=16, verbose=0)
    assert _unchanged(model, state)
    assert int(model.optimizer.iterations) == 1


def test_bad_labels_in_evaluate_raise():
    model = _model()
    x, y = _data(n=32)
    with pytest.raises(ValueError, match="fractional"):
        model.evaluate(x, y + 0.5, verbose=0)
    with pytest.raises(ValueError, match="labels of shape"):
        model.fit(x, np.zeros((32, 2, 2)), verbose=0)


def test_label_formats_and_sample_weights_agree():
    model = _model()
    x, y = _data(n=32)
    reference = model.evaluate(x, y, verbose=0, return_dict=True)
    for labels in (y[:, None], np.eye(3, dtype="float32")[y], y.astype("float32")):
        logs = model.evaluate(x, labels, verbose=0, return_dict=True)
        assert logs["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    doubled = model.evaluate(
        x, y, sample_weight=np.full(32, 2.0), verbose=0, return_dict=True
    )
    assert doubled["bce"] == pytest.approx(2 * reference["bce"], rel=1e-5)


def test_lazy_penalty_is_the_scaled_penalty_on_every_kth_step_only():
    # penalty_interval=2, lambda=0.5: step 0 is an exact step with lambda=1,
    # step 1 a step without the penalty (plain SGD, so no optimizer state).
    x, y = _data(n=16)

    def trained(gradient_penalty, start=None, **kwargs):
        model = _model(gradient_penalty, momentum=0.0, **kwargs)
        if start is not None:
            model.set_weights(start)
        model.logs = model.fit(x, y, batch_size=16, shuffle=False, verbose=0).history
        return model

    def difference(a, b):
        return max(float(np.abs(u - v).max()) for u, v in zip(a, b))

    lazy = trained(0.5, penalty_interval=2)
    assert difference(lazy.get_weights(), trained(1.0).get_weights()) <= 1e-5
    assert lazy.logs["gradient_penalty"][0] > 0
    after_first = lazy.get_weights()
    lazy.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    plain = trained(0.0, start=after_first)
    assert difference(lazy.get_weights(), plain.get_weights()) <= 1e-5
    assert difference(lazy.get_weights(), after_first) > 1e-3
    assert keras_duq.DUQModel.from_config(lazy.get_config()).penalty_interval == 2


@pytest.mark.parametrize(
    "name, head",
    [
        ("mixed_bfloat16", "per_class"),
        ("mixed_float16", "per_class"),
        ("mixed_float16", "shared"),
    ],
)
def test_mixed_precision_trains(policy, name, head):
    policy(name)
    model = _model(gradient_penalty=1.0, head=head)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) == (
        name == "mixed_float16"
    )
    x, y = _data()
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0).history
    assert np.isfinite(history["loss"]).all()
    assert history["loss"][-1] < history["loss"][0]
    assert model.predict(x[:4], verbose=0).dtype == np.float32


def test_overflowing_loss_scaled_step_is_skipped(policy):
    model = _model(batch_norm=False)
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.05), initial_scale=3e38
        )
    )
    x, y = _data(n=16)
    model.optimizer.build(model.trainable_weights)
    weights = [keras.ops.convert_to_numpy(v) for v in model.weights]
    # Far-away inputs: 3e38 * loss overflows float32, and so does the
    # penalty's input gradient, scaled by the same 3e38.
    logs = model.train_on_batch(100 * x, y, return_dict=True)
    assert all(
        np.array_equal(a, keras.ops.convert_to_numpy(b))
        for a, b in zip(weights, model.weights)
    )
    assert float(model.optimizer.dynamic_scale) < 3e38
    assert int(model.optimizer.iterations) == 0
    # The skipped step is left out of the metrics, whose values stay finite.
    assert all(np.isfinite(value) for value in logs.values()), logs
    # With ordinary inputs the scaled gradients are finite again: the step
    # and the centroid update both apply.
    counts = keras.ops.convert_to_numpy(model.duq_output.centroid_counts)
    model.train_on_batch(x, y)
    assert int(model.optimizer.iterations) == 1
    assert not np.array_equal(
        counts, keras.ops.convert_to_numpy(model.duq_output.centroid_counts)
    )


@pytest.mark.parametrize("batch", ["accepted", "rejected"])
def test_a_step_computes_checks_then_commits_each_variable_once(monkeypatch, batch):
    # Compute, check, commit: a rejected batch assigns nothing (so nothing
    # is put back), and an accepted one assigns each variable at most once.
    # Eager steps, so that each assignment is a Python call (on JAX, the
    # trainer assigns nothing itself: its step returns the new state).
    model = _model(batch_norm=True)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), run_eagerly=True)
    x, y = _data(n=16)
    model.train_on_batch(x, y)  # builds the optimizer and the metrics
    # The model's own variables (weights, layer state, centroids) that a
    # call of `assign` changed: metrics are reset and updated several times.
    own = {id(variable) for variable in model.variables}
    changed = []
    original = keras.Variable.assign

    # Writes inside a `keras.StatelessScope` (the step's compute phase) are
    # recorded by the scope and change no variable.
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    def recording(variable, value):
        if in_stateless_scope():
            return original(variable, value)
        before = keras.ops.convert_to_numpy(variable.value)
        result = original(variable, value)
        after = keras.ops.convert_to_numpy(variable.value)
        if id(variable) in own and not np.array_equal(before, after):
            changed.append(variable.path)
        return result

    monkeypatch.setattr(keras.Variable, "assign", recording)
    if batch == "rejected":
        with pytest.raises(ValueError, match="non-finite"):
            model.train_on_batch(x * 1e30, y)
        # Not even a change that is put back later.
        assert changed == []
    else:
        model.train_on_batch(x, y)
        repeated = [path for path in set(changed) if changed.count(path) > 1]
        assert repeated == [], repeated
        head = model.duq_output
        assert head.centroid_sums.path in changed


def test_trainers_copy_no_variable():
    # A structural check of the three trainers: no clone, copy or identity
    # of a variable, and nothing named restore or rollback.
    import ast
    import pathlib

    package = pathlib.Path(keras_duq.__file__).parent
    for module in ("_trainer", "_tensorflow_trainer", "_torch_trainer", "_jax_trainer"):
        tree = ast.parse((package / f"{module}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                assert node.func.attr not in ("clone", "copy", "deepcopy"), module
                if node.func.attr == "identity":
                    assert not any(
                        isinstance(a, ast.Name) and a.id in ("variable", "v")
                        for a in node.args
                    ), module
            if isinstance(node, (ast.FunctionDef, ast.Name)):
                name = getattr(node, "name", getattr(node, "id", ""))
                assert "restore" not in name and "rollback" not in name, (module, name)


class _CountsPasses(keras.layers.Layer):
    """The identity, counting the forward passes it runs (eagerly) by mode."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.passes = []

    def call(self, x):
        self.passes.append(None)
        return x


class _CountsTrainingPasses(_CountsPasses):
    def call(self, x, training=None):
        self.passes.append(bool(training))
        return x


@pytest.mark.parametrize("counter", [_CountsPasses, _CountsTrainingPasses])
def test_centroid_update_reuses_the_training_pass_where_inference_is_the_same(
    counter,
):
    # No layer takes `training`: inference mode computes what the training
    # pass did, and the step runs one forward pass. A layer that takes it
    # (Dropout, BatchNormalization, custom) gets an inference pass of its own.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    counting = counter()
    features = counting(keras.layers.Dense(8, activation="relu")(inputs))
    outputs = keras_duq.DUQOutput(3, centroid_dims=6)(features)
    model = keras_duq.DUQModel(inputs, outputs, gradient_penalty=0.5)
    model.compile(optimizer=keras.optimizers.SGD(0.05), run_eagerly=True)
    x, y = harness.tabular_data(n=16)
    model.train_on_batch(x, y)
    counting.passes.clear()
    model.train_on_batch(x, y)
    if counter is _CountsPasses:
        assert counting.passes == [None]
    else:
        assert counting.passes == [True, False]


def test_reused_training_features_give_the_inference_pass_centroid_update(
    monkeypatch,
):
    def trained():
        keras.utils.set_random_seed(0)
        model = keras_duq.wrap(
            keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)]), 3
        )
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
        model.fit(x, np.arange(32) % 3, batch_size=16, epochs=2, verbose=0)
        return [keras.ops.convert_to_numpy(v) for v in model.variables]

    reused = trained()
    monkeypatch.setattr(
        keras_duq.DUQModel, "_features_for_centroids", lambda self: False
    )
    separate = trained()
    assert len(reused) == len(separate)
    for a, b in zip(reused, separate):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

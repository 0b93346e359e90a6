"""Health checks: each failure built on purpose warns, a healthy model does not."""

import warnings

import harness
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_duq
from keras_duq import _health
from keras_duq.callbacks import HealthCheck

# Enough steps for `fit` to check (see `HealthCheck`).
STEPS = _health.rules.WARMUP_STEPS


def _data(n=400, **kwargs):
    # Every class equally often, so that per-class checks see each class.
    return harness.tabular_data(n, balanced=True, **kwargs)


def _model(layers=(), **kwargs):
    """Dense-ReLU-Dense, with `layers` (e.g. a BatchNormalization) after the
    input, compiled with momentum SGD."""

    def backbone():
        return [
            *layers,
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(8),
        ]

    model = harness.dense_model(backbone, **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    return model


# A length scale far below the spread of the embeddings: every kernel value
# underflows; with the paper's loss and its floor on the cross-entropy's
# gradient they get no gradient, so they stay so.
UNDERFLOWING = {
    "length_scale": 1e-4,
    "bce_epsilon": 1e-12,
    "categorical_cross_entropy_weight": 0.0,
    "gradient_penalty": 0.0,
}


def _health_warnings(record):
    return [w for w in record if issubclass(w.category, keras_duq.DUQHealthWarning)]


class _Recorder:
    """Records every warning raised inside the block, whatever the filters."""

    def __enter__(self):
        self._context = warnings.catch_warnings(record=True)
        self.record = self._context.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._context.__exit__(*exc)

    def of(self, category):
        return [str(w.message) for w in self.record if issubclass(w.category, category)]

    @property
    def health(self):
        return _health_warnings(self.record)


def _fit(model, x, y, epochs=1, batch_size=4, **kwargs):
    return model.fit(x, y, epochs=epochs, batch_size=batch_size, verbose=0, **kwargs)


def _over_two_fits(model, x, y, category):
    """The messages of `category` over two `fit` calls: a cause warns once per model."""
    with _Recorder() as record:
        _fit(model, x, y, batch_size=16)
        _fit(model, x, y, batch_size=16)
    return record.of(category)


# ------------------------------------------------------------ logged numbers


def test_fit_and_evaluate_log_the_numbers_behind_the_checks():
    model = _model(gradient_penalty=0.5)
    x, y = _data(n=64)
    history = _fit(model, x, y, validation_data=(x, y), batch_size=16).history
    for key in ("certainty", "underflow", "zero_input_gradient"):
        assert key in history and "val_" + key in history, key
    assert 0.0 <= history["certainty"][0] <= 1.0
    assert 0.0 <= history["centroid_overlap"][0] <= 1.0
    # In inference mode, `certainty` and `underflow` are those of `predict`.
    logs = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    certainty = model.predict(x, verbose=0).max(axis=1)
    assert logs["certainty"] == pytest.approx(certainty.mean(), rel=1e-5)
    assert logs["underflow"] == np.mean(certainty < np.finfo(np.float32).tiny)


def test_zero_input_gradient_counts_examples_whose_input_gradient_is_zero():
    # Inputs multiplied by 0: the kernel values cannot depend on them.
    model = _model(layers=[keras.layers.Rescaling(0.0)], gradient_penalty=0.5)
    x, y = _data(n=64)
    history = _fit(model, x, y, batch_size=16).history
    assert history["zero_input_gradient"] == [1.0]
    # Only the two-sided penalty tells a zero gradient; without the penalty
    # nothing is computed.
    for kwargs in ({"penalty": "one_sided"}, {"gradient_penalty": 0.0}):
        logged = _model(**kwargs).get_metrics_result()
        assert "zero_input_gradient" not in logged and "certainty" in logged


def test_batch_health_averages_each_number_over_its_examples_or_penalised_batches():
    # `certainty` and `underflow` over every example; `zero_input_gradient`
    # over the batches that computed the penalty, weighted by their size (a
    # lazy penalty's skipped step has weight 0).
    from keras_duq._health import BatchHealth

    health = BatchHealth(zero_gradient=True)
    for log_kernel, penalty, weight in (
        ([[np.log(0.5), np.log(0.1)], [-100.0, -120.0]], [1.0, 0.0], 2.0),
        ([[0.0, -1.0]], [1.0], 0.0),
        ([[np.log(0.2), -5.0]], [1.0], 1.0),
    ):
        health.update_state(
            keras.ops.convert_to_tensor(np.array(log_kernel, "float32")),
            keras.ops.convert_to_tensor(np.array(penalty, "float32")),
            weight,
        )
    result = {
        k: float(keras.ops.convert_to_numpy(v)) for k, v in health.result().items()
    }
    assert result["certainty"] == pytest.approx((0.5 + 0.0 + 1.0 + 0.2) / 4, rel=1e-6)
    assert result["underflow"] == pytest.approx(1 / 4)
    assert result["zero_input_gradient"] == pytest.approx((0.5 * 2 + 1.0) / 3, rel=1e-6)
    health.reset_state()
    assert all(
        float(keras.ops.convert_to_numpy(v)) == 0.0 for v in health.result().values()
    )


def test_health_checks_false_logs_and_warns_nothing():
    model = _model(**UNDERFLOWING, health_checks=False)
    x, y = _data()
    with _Recorder() as recorder:
        history = _fit(model, x, y).history
        model.evaluate(x, y, verbose=0)
        model.predict(x, verbose=0)
    assert recorder.health == []
    assert set(history) == {"loss", "bce", "accuracy"}
    assert model.get_config()["health_checks"] is False
    restored = keras_duq.DUQModel.from_config(model.get_config())
    assert restored.health_checks is False
    wrapped = keras_duq.wrap(
        keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]),
        2,
        health_checks=False,
    )
    assert wrapped.health_checks is False
    with pytest.raises(ValueError, match="`health_checks=1`"):
        _model(health_checks=1)


# ------------------------------------------------------------ each failure


def test_kernel_values_underflowing_in_training_warn():
    model = _model(**UNDERFLOWING)
    x, y = _data(n=4 * STEPS)
    with _Recorder() as recorder:
        history = _fit(model, x, y).history
    assert history["underflow"] == [1.0]
    messages = recorder.of(keras_duq.KernelUnderflowWarning)
    (message,) = [m for m in messages if "in training mode (" in m]
    assert "100%" in message
    assert "length_scale" in message


def test_low_in_distribution_certainty_warns_with_the_threshold_fix(monkeypatch):
    # Past the start-up (here: after 32 steps), the end of `fit` (and
    # `evaluate`) warns exactly when the mean certainty of in-distribution
    # inputs is below the rule's threshold; the length scale sets it.
    monkeypatch.setattr(_health.rules, "WARMUP_STEPS", 0)
    monkeypatch.setattr(_health.rules, "WARMUP_DATA_SHARE", 0.0)
    x, y = _data(n=128)
    outcomes = []
    for length_scale in (1.0, 0.05):
        model = _model(length_scale=length_scale)
        with _Recorder() as recorder:
            _fit(model, x, y)
            model.evaluate(x, y, verbose=0)
        certainty = float(model.predict(x, verbose=0).max(axis=1).mean())
        warned = recorder.of(keras_duq.LowCertaintyWarning)
        assert bool(warned) == (certainty < _health.rules.LOW_CERTAINTY), certainty
        outcomes.append(bool(warned))
        for message in warned:
            assert "certainty_threshold" in message and "length_scale" in message
    assert outcomes == [False, True]


def test_kernel_values_underflowing_in_inference_warn_in_evaluate_and_predict():
    x, y = _data(n=64)
    with _Recorder() as recorder:
        _model(length_scale=1e-4).evaluate(x, y, verbose=0)
    (message,) = recorder.of(keras_duq.KernelUnderflowWarning)
    assert "inference mode (`evaluate`)" in message
    model = _model(length_scale=1e-4)
    with _Recorder():
        _fit(model, x[:4], y[:4])  # an untrained model's predictions warn of nothing
    with _Recorder() as recorder:
        # Out-of-distribution inputs (as `OODEvaluation` predicts them)
        # should get certainty 0: no warning.
        with _health.out_of_distribution(model):
            model.predict(x, verbose=0)
        assert recorder.health == []
        model.predict(x, verbose=0)
        model.predict(x, verbose=0)  # once per model
    (message,) = recorder.of(keras_duq.KernelUnderflowWarning)
    assert "inference mode (`predict`)" in message and "out-of-distribution" in message


def test_unsettled_batch_norm_statistics_warn_and_name_the_layer():
    # Inputs far from BatchNormalization's initial moving statistics (mean
    # 0, variance 1), few steps at Keras's default momentum 0.99.
    batch_norm = keras.layers.BatchNormalization(name="input_bn")
    model = _model(layers=[batch_norm])
    x, y = _data(n=64, scale=10.0, shift=5.0)
    with _Recorder() as recorder:
        history = _fit(model, x, y, batch_size=16).history
        model.evaluate(x, y, verbose=0)
    assert history["batch_norm_gap"][0] > _health.rules.BATCH_NORM_GAP
    (message,) = recorder.of(keras_duq.BatchNormStatisticsWarning)
    assert "input_bn" in message and "recompute_batch_norm_statistics" in message


def test_small_errors_in_many_batch_norm_layers_add_up_and_warn():
    # Five BatchNormalization layers, each off by only 0.2 standard
    # deviations of its output: together they move the features enough that
    # inference mode computes something else than training.
    layers = []
    for i in range(5):
        layers += [
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(name=f"bn{i}"),
        ]
    model = _model(layers=layers)
    x, y = _data(n=256)
    with _Recorder() as recorder:
        keras_duq.recompute_batch_norm_statistics(model, x, batch_size=len(x))
        model.evaluate(x, y, batch_size=len(x), verbose=0)
    assert recorder.health == []  # settled: no warning
    for layer in layers[1::2]:
        std = keras.ops.sqrt(layer.moving_variance + layer.epsilon)
        layer.moving_mean.assign(layer.moving_mean + 0.2 * std)
    comparison = _health.ModeComparison(model, x)
    assert max(comparison.errors.values()) < 0.3
    assert comparison.gap > _health.rules.BATCH_NORM_GAP
    with _Recorder() as recorder:
        model.evaluate(x, y, batch_size=len(x), verbose=0)
    (message,) = recorder.of(keras_duq.BatchNormStatisticsWarning)
    assert "`evaluate`" in message and "bn" in message


def test_dropout_after_settled_batch_norm_gives_no_warning(monkeypatch):
    # Epochs of a few milliseconds: measure `batch_norm_gap` at each one.
    monkeypatch.setattr(_health.rules, "CHECK_TIME_SHARE", float("inf"))
    # Dropout makes training-mode features differ from inference-mode ones
    # by design; only the BatchNormalization statistics count.
    model = _model(
        layers=[
            keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.Dense(16),
            keras.layers.Dropout(0.5),
        ]
    )
    x, y = _data(n=4 * STEPS)
    with _Recorder() as recorder:
        history = _fit(model, x, y, epochs=2).history
        model.evaluate(x, y, verbose=0)
    assert recorder.of(keras_duq.BatchNormStatisticsWarning) == []
    assert history["batch_norm_gap"][-1] < _health.rules.BATCH_NORM_GAP


def test_per_epoch_comparison_stays_within_its_share_of_training_time(monkeypatch):
    # A share of 0: the first epoch is measured (nothing spent yet), then
    # every comparison would exceed the share, in later `fit` calls too.
    monkeypatch.setattr(_health.rules, "CHECK_TIME_SHARE", 0.0)
    model = _model(layers=[keras.layers.BatchNormalization(momentum=0.9)])
    x, y = _data(n=4 * STEPS)
    with _Recorder():
        gaps = _fit(model, x, y, epochs=3).history["batch_norm_gap"]
        later = _fit(model, x, y, epochs=2).history["batch_norm_gap"]
    assert np.isfinite(gaps[0]) and np.isnan(gaps[1:] + later).all()
    # An unbounded share measures every epoch.
    monkeypatch.setattr(_health.rules, "CHECK_TIME_SHARE", float("inf"))
    with _Recorder():
        gaps = _fit(model, x, y, epochs=2).history["batch_norm_gap"]
    assert np.isfinite(gaps).all()


def test_centroid_that_never_received_its_class_warns():
    model = _model()
    x, y = _data(n=4 * STEPS)
    y = y % 2  # class 2 never appears
    with _Recorder() as recorder:
        _fit(model, x, y)
    (message,) = recorder.of(keras_duq.CentroidWarning)
    assert "classes [2] received no training examples" in message


def test_collapsed_features_warn_about_overlapping_centroids_and_a_constant_penalty():
    # Inputs multiplied by 0 and no biases: every embedding is 0, so every
    # centroid moves to 0, and the input gradient is 0.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    features = keras.layers.Dense(8, use_bias=False)(
        keras.layers.Rescaling(0.0)(inputs)
    )
    outputs = keras_duq.DUQOutput(3, centroid_dims=6, momentum=0.9)(features)
    model = keras_duq.DUQModel(inputs, outputs, gradient_penalty=0.5)
    model.compile(optimizer="sgd")
    x, y = _data(n=4 * STEPS)
    with _Recorder() as recorder:
        history = _fit(model, x, y, epochs=2).history
    assert history["centroid_overlap"][-1] > 0.99
    (overlap,) = recorder.of(keras_duq.CentroidWarning)
    assert "overlap" in overlap and "kernel value" in overlap
    (penalty,) = recorder.of(keras_duq.ConstantPenaltyWarning)
    assert "100%" in penalty and "epoch 2" in penalty


# ------------------------------------------------------------ no false alarm


def _two_moons_model():
    """examples/two_moons.py's spectrally normalised residual model."""

    def sn_dense(units):
        return keras_duq.SpectralNormalization(
            keras.layers.Dense(units), coefficient=3.0
        )

    inputs = keras.Input((2,))
    features = sn_dense(32)(inputs)
    for _ in range(2):
        features = features + keras.layers.ReLU()(sn_dense(32)(features))
    model = keras_duq.wrap(
        keras.Model(inputs, features),
        num_classes=2,
        centroid_dims=10,
        length_scale=0.3,
        momentum=0.99,
        kernel_initializer=keras.initializers.RandomNormal(stddev=1.0),
        gradient_penalty=1.0,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    return model


def test_healthy_two_moons_model_gives_no_health_warning():
    from sklearn.datasets import make_moons

    keras.utils.set_random_seed(0)
    x, y = make_moons(1500, noise=0.1, random_state=0)
    x_test, y_test = make_moons(500, noise=0.1, random_state=1000)
    x, x_test = x.astype("float32"), x_test.astype("float32")
    model = _two_moons_model()
    with _Recorder() as recorder:
        history = _fit(
            model, x, y, epochs=6, batch_size=64, validation_data=(x_test, y_test)
        ).history
        model.evaluate(x_test, y_test, verbose=0)
        model.predict(x_test, verbose=0)
    assert recorder.health == []
    assert history["val_accuracy"][-1] > 0.9  # trained, not merely quiet


def test_healthy_batch_norm_model_gives_no_health_warning(monkeypatch):
    # Epochs of a few milliseconds: measure `batch_norm_gap` at each one.
    monkeypatch.setattr(_health.rules, "CHECK_TIME_SHARE", float("inf"))
    model = _model(layers=[keras.layers.BatchNormalization(momentum=0.9)])
    # Batches of 32: with batches of 4 the moving statistics themselves
    # scatter by about 0.1-0.2 standard deviations, a real gap.
    x, y = _data(n=32 * STEPS, scale=10.0, shift=5.0)
    with _Recorder() as recorder:
        history = _fit(model, x, y, epochs=2, batch_size=32).history
        # Inputs unlike the training data have other batch statistics by
        # nature: `predict` compares no modes.
        model.predict(-3.0 * x, verbose=0)
    assert recorder.of(keras_duq.BatchNormStatisticsWarning) == []
    with _Recorder() as recorder:
        model.evaluate(x, y, verbose=0)
        model.predict(x, verbose=0)
    assert recorder.health == []
    assert history["batch_norm_gap"][-1] < _health.rules.BATCH_NORM_GAP


def test_no_warning_before_the_warm_up():
    # A fresh model's kernel values underflow; `fit` says nothing about it
    # before the model has had `WARMUP_STEPS` steps.
    model = _model(**UNDERFLOWING)
    x, y = _data(n=16)
    with _Recorder() as recorder:
        _fit(model, x, y, epochs=3)
    assert recorder.health == []


def test_short_run_without_certainty_and_with_a_constant_penalty_warns():
    # Too few steps for the warm-up, but the whole run ended with no
    # certainty and a penalty without gradient: `fit` says so before it returns.
    model = _model(**{**UNDERFLOWING, "gradient_penalty": 0.5})
    x, y = _data(n=16)
    with _Recorder() as recorder:
        _fit(model, x, y, epochs=3)
    messages = recorder.of(keras_duq.KernelUnderflowWarning)
    assert len(messages) == 1 and "`fit` ended after 12 training steps" in messages[0]


def test_the_short_run_warning_names_a_fix_that_works():
    # The issue's case: a fixed length scale far below the features' spread
    # leaves every kernel value underflowing. The warning names
    # `length_scale="auto"`; with it the same short run trains.
    x, y = _data(n=64)
    settings = {**UNDERFLOWING, "gradient_penalty": 0.5}
    with _Recorder() as recorder:
        _fit(_model(**settings), x, y, epochs=2)
    (message,) = recorder.of(keras_duq.KernelUnderflowWarning)
    assert '`length_scale` at its default, `"auto"`' in message
    fixed = _model(**{**settings, "length_scale": "auto"})
    with _Recorder() as recorder:
        history = _fit(fixed, x, y, epochs=2).history
    assert recorder.of(keras_duq.KernelUnderflowWarning) == []
    assert history["underflow"][-1] == 0.0
    assert np.mean(fixed.predict(x, verbose=0).max(axis=1)) > 1e-3


def test_predicting_far_inputs_after_a_healthy_fit_does_not_warn():
    # Out-of-distribution inputs get a certainty of 0: that is the answer,
    # once `fit` found the in-distribution kernel values healthy.
    model = _model()
    x, y = _data(n=64)
    with _Recorder() as recorder:
        _fit(model, x, y, epochs=2)
        model.predict(1e3 * x, verbose=0)
    assert recorder.of(keras_duq.KernelUnderflowWarning) == []


def test_an_untrained_model_predicts_without_warnings():
    model = _model(**UNDERFLOWING)
    x, _ = _data(n=16)
    with _Recorder() as recorder:
        model.predict(x, verbose=0)
    assert recorder.health == []


def test_evaluate_right_after_recomputing_statistics_does_not_warn_about_them():
    model = _model(layers=[keras.layers.BatchNormalization()])
    x, y = _data(n=256, scale=10.0, shift=5.0)
    _fit(model, x[:32], y[:32], batch_size=16)
    keras_duq.recompute_batch_norm_statistics(model, x[:128])
    with _Recorder() as recorder:
        model.evaluate(x, y, verbose=0)
    assert recorder.of(keras_duq.BatchNormStatisticsWarning) == []


# ------------------------------------------------------------ the warnings


def test_warnings_are_user_warnings_that_filters_silence():
    for category in (
        keras_duq.KernelUnderflowWarning,
        keras_duq.BatchNormStatisticsWarning,
        keras_duq.CentroidWarning,
        keras_duq.ConstantPenaltyWarning,
    ):
        assert issubclass(category, keras_duq.DUQHealthWarning)
    assert issubclass(keras_duq.DUQHealthWarning, UserWarning)
    x, y = _data(n=16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=keras_duq.KernelUnderflowWarning)
        _model(length_scale=1e-4).predict(x, verbose=0)
    assert _health_warnings(record) == []


def test_health_check_callback_given_by_the_user_replaces_the_automatic_one():
    model = _model()
    x, y = _data(n=64)
    seen = []

    class Counting(HealthCheck):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(self.inputs.shape)
            super().on_epoch_end(epoch, logs)

    history = _fit(model, x, y, batch_size=16, callbacks=[Counting(x[:8])]).history
    assert seen == [(8, 4)] and "centroid_overlap" in history
    softmax = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="softmax")]
    )
    softmax.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="`HealthCheck` checks DUQ models"):
        softmax.fit(x, y, epochs=1, verbose=0, callbacks=[HealthCheck()])
    with pytest.raises(ValueError, match="batch_size"):
        HealthCheck(x, batch_size=0)


def test_inputs_are_sampled_from_arrays_datasets_and_py_datasets():
    x, y = _data(n=1000)
    sample, chunk_size = _health.sample_inputs(x, batch_size=32)
    assert sample.shape == (_health.rules.SAMPLE_SIZE, 4) and chunk_size == 32
    assert {tuple(row) for row in sample} <= {tuple(row) for row in x}
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    sample, chunk_size = _health.sample_inputs(dataset)
    np.testing.assert_array_equal(sample, x[: _health.rules.SAMPLE_SIZE])
    assert chunk_size == 16

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 10

        def __getitem__(self, index):
            rows = slice(100 * index, 100 * (index + 1))
            return x[rows], y[rows]

    sample, chunk_size = _health.sample_inputs(Batches())
    np.testing.assert_array_equal(sample, x[:600])  # whole batches
    assert chunk_size == 100
    # Generators are not read.
    assert _health.sample_inputs(iter([x])) == (None, None)
    # Large inputs: fewer examples, within the byte budget, but a whole batch.
    images = np.zeros((300, 224, 224, 3), "float32")
    sample, _ = _health.sample_inputs(images, batch_size=32)
    assert len(sample) == _health.rules.SAMPLE_BYTES // (224 * 224 * 3 * 4) == 111
    sample, _ = _health.sample_inputs(images, batch_size=256)
    assert len(sample) == 256


def test_the_mode_comparison_does_not_depend_on_the_chunk_size():
    # A settled model: its statistics re-estimated on the same sample, in
    # the same chunks, leave nothing to compare; other chunk sizes give
    # other (slightly different) batch statistics but the same verdict.
    layers = [keras.layers.Dense(16), keras.layers.BatchNormalization()]
    model = _model(layers=layers)
    x, _ = _data(n=512)
    keras_duq.recompute_batch_norm_statistics(model, x, batch_size=64)
    assert _health.ModeComparison(model, x, chunk_size=64).gap < 1e-5
    for chunk_size in (32, 100, 512):
        assert _health.ModeComparison(model, x, chunk_size).gap < 0.05


def test_predict_compares_no_modes_and_the_model_keeps_no_sample(monkeypatch):
    # `predict` reads the underflow off its own outputs; the modes are
    # compared by `fit` and `evaluate` on their own data.
    monkeypatch.setattr(_health.rules, "WARMUP_STEPS", 0)
    model = _model(layers=[keras.layers.BatchNormalization()])
    x, y = _data(n=64)
    _fit(model, x, y, batch_size=32)
    comparisons = []
    original = _health.checks.ModeComparison

    def counted(*args, **kwargs):
        comparisons.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_health.checks, "ModeComparison", counted)
    model.predict(x, batch_size=64, verbose=0)
    assert comparisons == []
    model.evaluate(x, y, batch_size=64, verbose=0)
    assert comparisons == [1]
    state = _health.state_of(model)
    assert not any(isinstance(v, np.ndarray) for v in vars(state).values())


# ------------------------------------------------------------ the BN fix


def _features(model, x, training):
    extractor = model.feature_extractor
    if not training:
        return keras.ops.convert_to_numpy(extractor(x, training=False))
    trainable = [v.value for v in extractor.trainable_variables]
    non_trainable = [v.value for v in extractor.non_trainable_variables]
    features, _ = extractor.stateless_call(trainable, non_trainable, x, training=True)
    return keras.ops.convert_to_numpy(features)


def _relative_gap(model, x):
    training, inference = _features(model, x, True), _features(model, x, False)
    return np.linalg.norm(training - inference) / np.linalg.norm(training)


def test_recompute_batch_norm_statistics_settles_them():
    nested = keras.Sequential(
        [keras.Input((4,)), keras.layers.BatchNormalization(name="inner_bn")],
        name="nested",
    )
    frozen = keras.layers.BatchNormalization(name="frozen_bn")
    frozen.trainable = False
    model = _model(
        layers=[
            nested,
            frozen,
            keras.layers.Dense(6),
            keras.layers.BatchNormalization(),
        ]
    )
    x, y = _data(n=256, scale=10.0, shift=5.0)
    _fit(model, x[:32], y[:32], batch_size=16)
    assert _relative_gap(model, x) > 0.5
    weights = [keras.ops.convert_to_numpy(v).copy() for v in model.trainable_variables]
    frozen_state = [
        keras.ops.convert_to_numpy(v).copy() for v in frozen.non_trainable_variables
    ]
    momenta = [layer.momentum for layer in (nested.layers[0], frozen)]

    names = keras_duq.recompute_batch_norm_statistics(model, x, batch_size=len(x))
    assert "inner_bn" in names and "frozen_bn" not in names and len(names) == 2
    # One batch of all the data: the moving statistics are its statistics,
    # so inference mode computes what training mode computes on it.
    assert _relative_gap(model, x) < 1e-4
    for old, variable in zip(weights, model.trainable_variables):
        np.testing.assert_array_equal(old, keras.ops.convert_to_numpy(variable))
    for old, variable in zip(frozen_state, frozen.non_trainable_variables):
        np.testing.assert_array_equal(old, keras.ops.convert_to_numpy(variable))
    assert [layer.momentum for layer in (nested.layers[0], frozen)] == momenta

    # Batches of a dataset: the average of their statistics.
    _fit(model, x[:32] * 3.0, y[:32], batch_size=16)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    keras_duq.recompute_batch_norm_statistics(model, dataset)
    assert _relative_gap(model, x) < 0.05


def test_recompute_batch_norm_statistics_errors_change_nothing():
    model = _model()
    x, _ = _data(n=32)
    with pytest.raises(ValueError, match="found no BatchNormalization"):
        keras_duq.recompute_batch_norm_statistics(model, x)
    model = _model(layers=[keras.layers.BatchNormalization()])
    state = [keras.ops.convert_to_numpy(v).copy() for v in model.weights]
    with pytest.raises(ValueError, match="steps"):
        keras_duq.recompute_batch_norm_statistics(model, x, steps=0)
    endless = tf.data.Dataset.from_tensor_slices(x).batch(8).repeat()
    with pytest.raises(ValueError, match="endless"):
        keras_duq.recompute_batch_norm_statistics(model, endless)
    for old, variable in zip(state, model.weights):
        np.testing.assert_array_equal(old, keras.ops.convert_to_numpy(variable))
    keras_duq.recompute_batch_norm_statistics(model, endless, steps=2)


def test_recompute_callback_settles_statistics_before_validation_and_at_the_end():
    # The setup that warns in test_unsettled_batch_norm_statistics_warn_and_
    # name_the_layer; the callback re-estimates the statistics on all the
    # inputs as one batch after each epoch's steps.
    model = _model(layers=[keras.layers.BatchNormalization(name="input_bn")])
    x, y = _data(n=64, scale=10.0, shift=5.0)
    gaps_at_validation = []
    probe = keras.callbacks.LambdaCallback(
        on_test_begin=lambda logs: gaps_at_validation.append(_relative_gap(model, x))
    )
    recompute = keras_duq.callbacks.RecomputeBatchNormStatistics(x, batch_size=len(x))
    with _Recorder() as recorder:
        # Passed after the probe: `fit` runs it first all the same.
        history = _fit(
            model,
            x,
            y,
            epochs=2,
            batch_size=16,
            validation_data=(x, y),
            callbacks=[probe, recompute],
        ).history
        model.evaluate(x, y, verbose=0)
    assert len(gaps_at_validation) == 2 and max(gaps_at_validation) < 1e-4
    assert max(history["batch_norm_gap"]) < _health.rules.BATCH_NORM_GAP
    assert _relative_gap(model, x) < 1e-4
    assert recorder.of(keras_duq.BatchNormStatisticsWarning) == []


def test_recompute_callback_without_validation_recomputes_at_epoch_end():
    model = _model(layers=[keras.layers.BatchNormalization()], health_checks=False)
    x, y = _data(n=64, scale=10.0, shift=5.0)
    callback = keras_duq.callbacks.RecomputeBatchNormStatistics(x, batch_size=len(x))
    _fit(model, x, y, batch_size=16, callbacks=[callback])
    assert _relative_gap(model, x) < 1e-4


def test_recompute_callback_bad_arguments_raise_before_training():
    x, y = _data(n=32)
    callbacks = keras_duq.callbacks
    with pytest.raises(ValueError, match="steps"):
        callbacks.RecomputeBatchNormStatistics(x, steps=0)
    with pytest.raises(ValueError, match="batch_size"):
        callbacks.RecomputeBatchNormStatistics(x, batch_size=0)
    with pytest.raises(ValueError, match="endless"):
        callbacks.RecomputeBatchNormStatistics(
            tf.data.Dataset.from_tensor_slices(x).batch(8).repeat()
        )
    with pytest.raises(ValueError, match="read again"):
        callbacks.RecomputeBatchNormStatistics(iter([x[:8], x[8:16]]))
    with pytest.raises(ValueError, match="no data"):
        callbacks.RecomputeBatchNormStatistics(x[:0])
    # A model without BatchNormalization fails before its first step.
    model = _model()
    state = [keras.ops.convert_to_numpy(v).copy() for v in model.weights]
    with pytest.raises(ValueError, match="found no BatchNormalization"):
        _fit(model, x, y, callbacks=[callbacks.RecomputeBatchNormStatistics(x)])
    for old, variable in zip(state, model.weights):
        np.testing.assert_array_equal(old, keras.ops.convert_to_numpy(variable))
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 0


# ------------------------------------------------------------ other settings


# The suite under JAX runs every check natively; this subprocess brings the
# JAX check to a TensorFlow-only run, once (with the tests marked slow).
@pytest.mark.slow
@pytest.mark.requires_backend("tensorflow")
def test_jax_backend_warns_too():
    from harness import run

    out = run("health_jax.py", backend="jax")
    assert out["warnings"] == [
        "BatchNormStatisticsWarning",
        "CentroidWarning",
        "ConstantPenaltyWarning",
    ]
    assert out["zero_input_gradient"] == [1.0, 1.0]
    assert len(out["names"]) == 1 and out["gap_after_recompute"] < 1e-4


# JAX on a CPU takes over a minute to compile MobileNetV3Small's training
# step (two minutes eagerly); the other tests of this file run every check
# on JAX.
@pytest.mark.requires_backend("tensorflow", "torch")
def test_keras_applications_backbone_with_collapsed_inference_certainty_warns():
    # MobileNetV3Small after 4 steps: BatchNormalization's moving statistics
    # (momentum 0.99) are still near their initial values, and in inference
    # mode the features collapse.
    keras.utils.set_random_seed(0)
    backbone = keras.applications.MobileNetV3Small(
        weights=None, include_top=False, pooling="avg", input_shape=(32, 32, 3)
    )
    model = keras_duq.wrap(backbone, num_classes=10, gradient_penalty=0.0)
    # Eager steps: four of them cost less than tracing the step.
    model.compile(optimizer="adam", run_eagerly=True)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, size=(128, 32, 32, 3)).astype("float32")
    y = np.arange(128) % 10
    with _Recorder() as recorder:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        model.predict(x[:64], verbose=0)
    (message,) = recorder.of(keras_duq.BatchNormStatisticsWarning)
    assert "end of `fit`" in message and "_bn" in message


# ------------------------------------------------------------ feature noise


def _dropout_last():
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(16, "relu"), keras.layers.Dropout(0.5)]
    )


def _dropout_then_flatten():
    inputs = keras.Input((4,))
    x = keras.layers.Reshape((4, 4))(keras.layers.Dense(16, "relu")(inputs))
    x = keras.layers.SpatialDropout1D(0.2, name="spatial")(x)
    return keras.Model(inputs, keras.layers.Flatten()(x))


def _nested_noise():
    inner = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), keras.layers.GaussianNoise(0.1)]
    )
    return keras.Sequential([keras.Input((4,)), inner])


@pytest.mark.parametrize(
    "build, name",
    [
        (_dropout_last, "dropout"),
        (_dropout_then_flatten, "spatial"),
        (_nested_noise, "gaussian_noise"),
    ],
)
def test_features_out_of_a_noise_layer_warn_once_at_the_start_of_fit(build, name):
    keras.utils.set_random_seed(0)
    model = keras_duq.wrap(build(), 3)
    model.compile(optimizer="sgd")
    x, y = _data(n=32)
    with _Recorder() as record:
        _fit(model, x, y, batch_size=16)
        _fit(model, x, y, batch_size=16)
    (message,) = record.of(keras_duq.FeatureDropoutWarning)
    assert f"`{name}" in message and "Remove that layer" in message


class _DropoutDefinedLast(keras.Model):
    """Creates its Dropout last but applies it first."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(8)
        self.dropout = keras.layers.Dropout(0.5)

    def call(self, x, training=None):
        return self.dense(self.dropout(x, training=training))


def test_noise_before_the_last_dense_layer_or_health_checks_off_do_not_warn():
    dense_last = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dropout(0.5), keras.layers.Dense(8)]
    )
    x, y = _data(n=32)
    for model in (
        keras_duq.wrap(dense_last, 3),
        keras_duq.wrap(_DropoutDefinedLast(), 3, input_shape=(4,)),
        keras_duq.wrap(_dropout_last(), 3, health_checks=False),
    ):
        model.compile(optimizer="sgd")
        with _Recorder() as record:
            _fit(model, x, y, batch_size=16)
        assert not record.of(keras_duq.FeatureDropoutWarning)


# ------------------------------------------------------------- input scale


@pytest.mark.parametrize("scale, shift", [(1.0, 3.0), (6.0, 0.0), (0.05, 0.0)])
def test_inputs_far_from_standardised_warn_once_at_the_start_of_fit(scale, shift):
    x, y = _data(n=32, scale=scale, shift=shift)
    messages = _over_two_fits(_model(), x, y, keras_duq.InputScaleWarning)
    assert len(messages) == 1
    assert "not standardised" in messages[0] and "Normalization" in messages[0]
    # A Sequential backbone's input has Keras's automatic name: the message
    # names the argument instead.
    assert "keras_tensor" not in messages[0] and "`x`" in messages[0]


def test_standardised_inputs_or_a_normalising_backbone_do_not_warn_about_scale():
    x, y = _data(n=32)
    shifted, _ = _data(n=32, shift=3.0)
    for model, inputs in (
        (_model(), x),
        (_model(layers=[keras.layers.BatchNormalization()]), shifted),
        (_model(layers=[keras.layers.Rescaling(1 / 3.0, offset=-1.0)]), shifted),
    ):
        with _Recorder() as record:
            _fit(model, inputs, y, batch_size=16)
        assert not record.of(keras_duq.InputScaleWarning)


# ----------------------------------------------------------------- padding


def _token_model(mask_zero=False, **kwargs):
    keras.utils.set_random_seed(0)
    backbone = keras.Sequential(
        [
            keras.Input((12,), dtype="int32"),
            keras.layers.Embedding(30, 8, mask_zero=mask_zero, name="words"),
            keras.layers.GlobalAveragePooling1D(name="average"),
            keras.layers.Dense(16, activation="relu"),
        ]
    )
    model = keras_duq.wrap(backbone, num_classes=3, penalty_input="words", **kwargs)
    model.compile(optimizer="adam")
    return model


def _token_data(lengths=(3, 12), n=32):
    """Token ids 1-29 in the first `length` positions of each row, padding (0) after."""
    return harness.token_ids(n, 12, 30, lengths=lengths), np.arange(n) % 3


def test_averaging_over_padding_warns_once_at_the_start_of_fit():
    x, y = _token_data()
    messages = _over_two_fits(_token_model(), x, y, keras_duq.PaddingWarning)
    assert len(messages) == 1
    assert "`words`" in messages[0] and "`average`" in messages[0]
    assert "mask_zero=True" in messages[0]


def test_masked_or_unpadded_tokens_or_health_checks_off_do_not_warn_about_padding():
    padded, y = _token_data()
    unpadded, _ = _token_data(lengths=(12, 12))
    for model, x in (
        (_token_model(mask_zero=True), padded),
        (_token_model(), unpadded),
        (_token_model(health_checks=False), padded),
    ):
        with _Recorder() as record:
            _fit(model, x, y, batch_size=16)
        assert not record.of(keras_duq.PaddingWarning)


@pytest.mark.requires_backend("tensorflow")  # string inputs
def test_averaging_over_padding_of_an_own_text_vectorization_warns():
    # An object array: Keras's array adapter takes no NumPy `str_` arrays.
    texts = np.array(
        ["a b c d e f g h", "a b", "c d e", "f g h a b c", "d"] * 8, object
    )
    vectorize = keras.layers.TextVectorization(output_sequence_length=10)
    vectorize.adapt(texts)
    keras.utils.set_random_seed(0)
    backbone = keras.Sequential(
        [
            keras.Input((), dtype="string"),
            vectorize,
            keras.layers.Embedding(20, 8, name="words"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(16, activation="relu"),
        ]
    )
    model = keras_duq.wrap(backbone, num_classes=3, penalty_input="words")
    model.compile(optimizer="adam")
    messages = _over_two_fits(model, texts, np.arange(40) % 3, keras_duq.PaddingWarning)
    assert len(messages) == 1 and "mask_zero=True" in messages[0]

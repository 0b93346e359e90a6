"""wrap(): every kind of Keras backbone wraps and trains one step."""

import inspect

import keras
import numpy as np
import pytest

import keras_duq


def _train_one_step(model, x, num_classes, run_eagerly=False):
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        run_eagerly=run_eagerly,
    )
    y = np.arange(len(x)) % num_classes
    before = model.duq_output.centroid_counts.numpy().copy()
    logs = model.train_on_batch(x, y, return_dict=True)
    assert np.isfinite(list(logs.values())).all()
    assert not np.array_equal(before, model.duq_output.centroid_counts.numpy())
    predictions = model.predict(x, verbose=0)
    assert predictions.shape == (len(x), num_classes)
    return logs


def _images(n=4, size=8, channels=1):
    return (
        np.random.default_rng(0)
        .normal(size=(n, size, size, channels))
        .astype("float32")
    )


def test_sequential_backbone():
    backbone = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.GlobalAveragePooling2D(),
        ]
    )
    model = keras_duq.wrap(backbone, num_classes=3)
    assert model.feature_extractor.layers[-1] is backbone
    assert model.duq_output.centroids.shape == (4, 3)  # centroid_dims = features
    _train_one_step(model, _images(), 3)


def test_functional_backbone_and_arguments_reach_the_parts():
    inputs = keras.Input((5,))
    features = keras.layers.Dense(6, activation="relu")(inputs)
    backbone = keras.Model(inputs, features)
    model = keras_duq.wrap(
        backbone,
        num_classes=4,
        centroid_dims=3,
        length_scale=0.2,
        momentum=0.95,
        gradient_penalty=0.3,
        penalty="one_sided",
        weight_decay=1e-3,
        bce_epsilon=1e-12,
        categorical_cross_entropy_weight=2.0,
    )
    head = model.duq_output
    assert (head.num_classes, head.centroid_dims, head.length_scale, head.momentum) == (
        4,
        3,
        0.2,
        0.95,
    )
    assert (model.gradient_penalty, model.penalty, model.weight_decay) == (
        0.3,
        "one_sided",
        1e-3,
    )
    assert model.bce_epsilon == 1e-12
    assert model.categorical_cross_entropy_weight == 2.0
    x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
    _train_one_step(model, x, 4)


def test_categorical_weight_defaults_higher_for_features_out_of_dropout():
    def weight(*last, **kwargs):
        backbone = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(6, activation="relu"), *last]
        )
        model = keras_duq.wrap(backbone, num_classes=2, **kwargs)
        return model.categorical_cross_entropy_weight

    assert weight() == 1.0
    # 1 + 2 p / (1 - p) for dropout at rate p.
    assert weight(keras.layers.Dropout(0.5), keras.layers.Flatten()) == 3.0
    assert weight(keras.layers.Dropout(0.2)) == pytest.approx(1.5)
    assert weight(keras.layers.Dropout(1.0)) == 1.0  # features always zero
    # A dropout that feeds a Dense layer leaves the features noiseless.
    assert weight(keras.layers.Dropout(0.5), keras.layers.Dense(4)) == 1.0
    # A weight the user gives is kept, and the one used is saved.
    assert weight(keras.layers.Dropout(0.5), categorical_cross_entropy_weight=0) == 0
    backbone = keras.Sequential([keras.Input((5,)), keras.layers.Dropout(0.5)])
    config = keras_duq.wrap(backbone, num_classes=2).get_config()
    assert config["categorical_cross_entropy_weight"] == 3.0


def test_paper_settings_give_the_papers_loss_and_projection_rate():
    backbone = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
    model = keras_duq.wrap(backbone, num_classes=3, **keras_duq.PAPER_SETTINGS)
    assert model.categorical_cross_entropy_weight == 0.0
    assert model.duq_output.projection_learning_rate == 1.0
    with pytest.raises(TypeError):
        keras_duq.PAPER_SETTINGS["projection_learning_rate"] = 0.5  # read-only


def test_subclassed_backbone_needs_input_shape():
    class Backbone(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(6, activation="relu")

        def call(self, inputs):
            return self.dense(inputs)

    with pytest.raises(ValueError, match="input_shape"):
        keras_duq.wrap(Backbone(), num_classes=2)
    model = keras_duq.wrap(Backbone(), num_classes=2, input_shape=(5,))
    x = np.random.default_rng(0).normal(size=(4, 5)).astype("float32")
    _train_one_step(model, x, 2)


# JAX on a CPU takes over a minute for ResNet50's double backprop, compiled
# or eager; the other tests of this file wrap and train on JAX.
@pytest.mark.requires_backend("tensorflow", "torch")
def test_keras_applications_backbone():
    backbone = keras.applications.ResNet50(
        weights=None, include_top=False, pooling="avg", input_shape=(32, 32, 3)
    )
    model = keras_duq.wrap(backbone, num_classes=2, centroid_dims=16)
    # From scratch, the exact cross-entropy's first gradient is huge (every
    # kernel value underflows): unclipped, one step at 0.01 leaves weights
    # whose inference-mode activations overflow by conv4 (the BatchNorm
    # moving statistics still near their start), and fit stops with the
    # non-finite-centroid error. The model's gradient clipping (`clipnorm`,
    # on by default) keeps the step sane. Eager: compiling
    # ResNet50's double backprop takes over a minute on 2 cores, the step
    # itself seconds; the compiled step is tested on the smaller backbones.
    x = _images(n=2, size=32, channels=3)
    _train_one_step(model, x, 2, run_eagerly=True)


def test_frozen_backbone_trains_only_the_head():
    backbone = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(6, activation="relu")]
    )
    backbone.trainable = False
    frozen = [w.numpy().copy() for w in backbone.weights]
    model = keras_duq.wrap(backbone, num_classes=2)
    head_kernel = model.duq_output.kernel.numpy().copy()
    x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
    _train_one_step(model, x, 2)
    for old, new in zip(frozen, backbone.weights):
        np.testing.assert_array_equal(old, new.numpy())
    assert not np.array_equal(head_kernel, model.duq_output.kernel.numpy())


def test_fixed_projection_trains_only_the_backbone(tmp_path):
    backbone = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6)])
    model = keras_duq.wrap(backbone, num_classes=2, trainable_projection=False)
    assert not model.duq_output.kernel.trainable
    head_kernel = keras.ops.convert_to_numpy(model.duq_output.kernel).copy()
    backbone_kernel = keras.ops.convert_to_numpy(backbone.weights[0]).copy()
    x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
    _train_one_step(model, x, 2)
    np.testing.assert_array_equal(
        head_kernel, keras.ops.convert_to_numpy(model.duq_output.kernel)
    )
    assert not np.array_equal(
        backbone_kernel, keras.ops.convert_to_numpy(backbone.weights[0])
    )
    model.save(tmp_path / "model.keras")
    restored = keras.models.load_model(tmp_path / "model.keras")
    assert not restored.duq_output.kernel.trainable


@pytest.mark.parametrize(
    "optimizer", [lambda: keras.optimizers.SGD(0.1), lambda: keras.optimizers.Adam()]
)
def test_projection_learning_rate_scales_each_step_of_the_projection(
    optimizer, tmp_path
):
    # Two models with the same initial weights: W moves `rate` times as far,
    # the backbone the same, weight decay and the penalty included. A power
    # of two for `rate` stores `W / rate` exactly.
    rate = 0.25
    models, moves = {}, {}
    for r in (1.0, rate):
        keras.utils.set_random_seed(0)
        backbone = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6)])
        model = keras_duq.wrap(
            backbone, num_classes=2, gradient_penalty=0.5, projection_learning_rate=r
        )
        model.compile(optimizer=optimizer())
        before = keras.ops.convert_to_numpy(model.duq_output.projection).copy()
        x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
        model.train_on_batch(x, np.arange(8) % 2)
        after = keras.ops.convert_to_numpy(model.duq_output.projection)
        models[r], moves[r] = model, after - before
    assert np.abs(moves[1.0]).max() > 1e-4
    # Within float32 rounding of W (about 1e-7 here); unscaled, they would
    # differ by 3/4 of a move (1e-4 to 1e-2).
    np.testing.assert_allclose(moves[rate], rate * moves[1.0], rtol=1e-3, atol=1e-6)
    for a, b in zip(
        models[1.0].feature_extractor.weights, models[rate].feature_extractor.weights
    ):
        # W / rate rounds differently from W: a few float32 ulps of the weights.
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(a),
            keras.ops.convert_to_numpy(b),
            rtol=1e-6,
            atol=1e-6,
        )
    models[rate].save(tmp_path / "model.keras")
    restored = keras.models.load_model(tmp_path / "model.keras")
    assert restored.duq_output.projection_learning_rate == rate
    np.testing.assert_allclose(
        restored.predict(x, verbose=0), models[rate].predict(x, verbose=0), atol=1e-6
    )


@pytest.mark.parametrize("kind", ["conv1d", "gru"])
def test_sequence_backbone(kind):
    layers = [keras.Input((12, 3))]
    if kind == "conv1d":
        layers += [
            keras.layers.Conv1D(4, 3, activation="relu"),
            keras.layers.GlobalAveragePooling1D(),
        ]
    else:
        layers += [keras.layers.GRU(5)]
    model = keras_duq.wrap(keras.Sequential(layers), num_classes=3)
    x = np.random.default_rng(0).normal(size=(6, 12, 3)).astype("float32")
    _train_one_step(model, x, 3)


def test_feature_maps_are_rejected_with_the_layer_to_add():
    backbone = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3)])
    with pytest.raises(ValueError, match="GlobalAveragePooling2D.*Flatten"):
        keras_duq.wrap(backbone, num_classes=3)


def test_several_outputs_are_rejected():
    inputs = keras.Input((4,))
    backbone = keras.Model(
        inputs, [keras.layers.Dense(2)(inputs), keras.layers.Dense(3)(inputs)]
    )
    with pytest.raises(ValueError, match="single feature tensor"):
        keras_duq.wrap(backbone, num_classes=3)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_classes": 1}, "num_classes"),
        ({"num_classes": 3, "length_scale": 0}, "length_scale"),
        ({"num_classes": 3, "momentum": 1.5}, "momentum"),
        ({"num_classes": 3, "gradient_penalty": -0.1}, "gradient_penalty"),
        ({"num_classes": 3, "penalty": "three_sided"}, "penalty"),
    ],
)
def test_bad_arguments(kwargs, name):
    backbone = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=f"(?s){name}.*Received"):
        keras_duq.wrap(backbone, **kwargs)


def test_wrap_lists_every_argument_of_the_head_and_the_model_with_its_default():
    signature = inspect.signature(keras_duq.wrap).parameters
    for cls, own in (
        (keras_duq.DUQOutput, ("num_classes",)),
        (keras_duq.DUQModel, ("inputs", "outputs")),
    ):
        for name, parameter in inspect.signature(cls.__init__).parameters.items():
            if name in ("self", "kwargs", *own):
                continue
            assert signature[name].default == parameter.default, name
            assert f"        {name}: " in keras_duq.wrap.__doc__, name


def test_an_argument_of_neither_the_head_nor_the_model_raises_before_building():
    backbone = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6)])
    with pytest.raises(TypeError, match=r"length_scal\b"):
        keras_duq.wrap(backbone, num_classes=2, length_scal=0.3)
    assert not backbone._inbound_nodes[1:]  # the backbone was not called

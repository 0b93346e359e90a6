"""DUQOutput: kernel values, centroid state, arguments and config."""

import keras
import numpy as np
import pytest

import keras_duq


def _layer(**kwargs):
    kwargs.setdefault("num_classes", 3)
    kwargs.setdefault("centroid_dims", 4)
    layer = keras_duq.DUQOutput(**kwargs)
    layer.build((None, 5))
    return layer


def _features(batch=6, features=5, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, features)).astype("float32")


def test_kernel_values_match_paper_formula():
    layer = _layer(length_scale=0.5)
    features = _features()
    kernel = keras.ops.convert_to_numpy(layer.projection).reshape(5, 4, 3)
    centroids = layer.centroid_sums.numpy() / layer.centroid_counts.numpy()
    expected = np.empty((6, 3))
    for c in range(3):
        embedded = features @ kernel[:, :, c]  # W_c f(x)
        distance = np.mean((embedded - centroids[:, c]) ** 2, axis=1)
        expected[:, c] = np.exp(-distance / (2 * 0.5**2))
    got = keras.ops.convert_to_numpy(layer(features))
    assert got.shape == (6, 3) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-7)
    assert ((got >= 0) & (got <= 1)).all()


def test_initial_state_follows_reference():
    layer = _layer(num_classes=10, centroid_dims=64)
    np.testing.assert_array_equal(layer.centroid_counts.numpy(), np.full(10, 12.0))
    # m_c = 12 * normal(0, 1), so the initial centroids are standard normal.
    assert abs(float(np.std(keras.ops.convert_to_numpy(layer.centroids))) - 1.0) < 0.1
    assert not layer.centroid_counts.trainable
    assert not layer.centroid_sums.trainable
    assert layer.kernel.trainable
    assert tuple(layer.kernel.shape) == (5, 64 * 10)


def test_centroid_dims_default_to_feature_size():
    layer = keras_duq.DUQOutput(num_classes=2)
    layer.build((None, 7))
    assert tuple(layer.centroids.shape) == (7, 2)


def test_default_head_stays_proportionate_on_wide_backbones():
    # ResNet50's 2048 features and 10 classes: 42M weights at one centroid
    # dimension per feature; the default caps the head at 6M.
    layer = keras_duq.DUQOutput(num_classes=10)
    layer.build((None, 2048))
    assert tuple(layer.centroids.shape) == (256, 10)
    assert layer.count_params() <= 6_000_000
    # The paper's FashionMNIST CNN (256 features) keeps 256.
    layer = keras_duq.DUQOutput(num_classes=10)
    layer.build((None, 256))
    assert tuple(layer.centroids.shape) == (256, 10)
    # An explicit value is never capped.
    layer = keras_duq.DUQOutput(num_classes=10, centroid_dims=512)
    layer.build((None, 512))
    assert tuple(layer.centroids.shape) == (512, 10)


def test_calling_never_changes_centroids():
    layer = _layer()
    before = [v.numpy().copy() for v in layer.non_trainable_weights]
    layer(_features(), training=True)
    layer(_features(), training=False)
    for old, variable in zip(before, layer.non_trainable_weights):
        np.testing.assert_array_equal(old, variable.numpy())


def test_update_centroids_is_one_moving_average_step():
    layer = _layer(momentum=0.9)
    features = _features()
    labels = np.array([0, 1, 1, 2, 2, 2])
    old_counts = layer.centroid_counts.numpy().copy()
    old_sums = layer.centroid_sums.numpy().copy()
    embedded = np.einsum(
        "bf,fdc->bdc",
        features,
        keras.ops.convert_to_numpy(layer.projection).reshape(5, 4, 3),
    )
    layer.update_centroids(features, np.eye(3, dtype="float32")[labels])
    expected_counts = 0.9 * old_counts + 0.1 * np.array([1, 2, 3])
    np.testing.assert_allclose(
        layer.centroid_counts.numpy(), expected_counts, rtol=1e-6
    )
    for c in range(3):
        expected = 0.9 * old_sums[:, c] + 0.1 * embedded[labels == c, :, c].sum(0)
        np.testing.assert_allclose(
            layer.centroid_sums.numpy()[:, c], expected, rtol=1e-5
        )


def test_output_is_float32_under_mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        layer = keras_duq.DUQOutput(num_classes=2)
        output = layer(keras.ops.cast(_features(), "bfloat16"))
        assert keras.backend.standardize_dtype(output.dtype) == "float32"
        assert layer.compute_dtype == "float32"
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_trainable_length_scale_is_a_weight():
    layer = _layer(trainable_length_scale=True, length_scale=0.2)
    assert layer.length_scales.trainable
    np.testing.assert_allclose(layer.length_scales.numpy(), [0.2, 0.2, 0.2])
    assert not _layer().length_scales.trainable


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_classes": 1}, "num_classes"),
        ({"num_classes": 2.5}, "num_classes"),
        ({"num_classes": 3, "centroid_dims": 0}, "centroid_dims"),
        ({"num_classes": 3, "length_scale": 0.0}, "length_scale"),
        ({"num_classes": 3, "length_scale": -1.0}, "length_scale"),
        ({"num_classes": 3, "momentum": 1.0}, "momentum"),
        ({"num_classes": 3, "momentum": -0.1}, "momentum"),
        ({"num_classes": 3, "dtype": "float16"}, "float32"),
        ({"num_classes": 3, "projection_learning_rate": 0.0}, "trainable_projection"),
        ({"num_classes": 3, "projection_learning_rate": -0.1}, "projection_learning"),
        ({"num_classes": 3, "projection_learning_rate": True}, "projection_learning"),
        ({"num_classes": 3, "projection_learning_rate": "0.1"}, "projection_learning"),
        ({"num_classes": 3, "projection_learning_rate": float("inf")}, "projection"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=f"(?s){message}.*Received"):
        keras_duq.DUQOutput(**kwargs)


def test_feature_maps_are_rejected_with_a_fix():
    layer = keras_duq.DUQOutput(num_classes=3)
    with pytest.raises(ValueError, match="GlobalAveragePooling2D"):
        layer.build((None, 7, 7, 16))


def test_config_round_trip():
    layer = keras_duq.DUQOutput(
        num_classes=4,
        centroid_dims=8,
        length_scale=0.3,
        momentum=0.99,
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.05),
        trainable_length_scale=True,
        trainable_projection=False,
        projection_learning_rate=0.1,
        name="head",
    )
    config = layer.get_config()
    restored = keras_duq.DUQOutput.from_config(config)
    assert restored.get_config() == config
    assert config["num_classes"] == 4 and config["centroid_dims"] == 8
    assert config["length_scale"] == 0.3 and config["momentum"] == 0.99


def test_config_without_projection_learning_rate_loads_at_the_paper_rate():
    # A layer saved before the option existed trained W at the optimizer's
    # rate and stored W itself in `kernel`: it must load that way, not with
    # today's default, or its kernel values would be read at 0.3 of W.
    layer = keras_duq.DUQOutput(num_classes=3)
    assert layer.projection_learning_rate == 0.3
    config = layer.get_config()
    del config["projection_learning_rate"]
    restored = keras_duq.DUQOutput.from_config(config)
    assert restored.projection_learning_rate == 1.0


def test_config_keeps_the_rate_it_was_saved_with():
    # A layer saved when the default was 0.1 stores `W / 0.1` in `kernel`:
    # it must load at 0.1, whatever today's default.
    config = keras_duq.DUQOutput(num_classes=3, projection_learning_rate=0.1).get_config()
    restored = keras_duq.DUQOutput.from_config(config)
    assert restored.projection_learning_rate == 0.1


def test_shared_head_matches_its_formula_and_a_per_class_head_with_equal_projections():
    shared = _layer(head="shared", length_scale=0.5, num_classes=7)
    assert shared.resolved_head == "shared"
    assert tuple(shared.kernel.shape) == (5, 4)
    features = _features()
    projection = keras.ops.convert_to_numpy(shared.projection)
    centroids = keras.ops.convert_to_numpy(shared.centroids)
    distance = np.mean(
        ((features @ projection)[:, :, None] - centroids[None]) ** 2, axis=1
    )
    got = keras.ops.convert_to_numpy(shared(features))
    np.testing.assert_allclose(got, np.exp(-distance / 0.5), rtol=1e-4, atol=1e-7)
    # The per-class head with every W_c = W computes the same kernel values.
    per_class = _layer(head="per_class", length_scale=0.5, num_classes=7)
    per_class.kernel.assign(
        np.repeat(
            keras.ops.convert_to_numpy(shared.kernel)[:, :, None], 7, axis=2
        ).reshape(5, 28)
    )
    per_class.centroid_sums.assign(keras.ops.convert_to_numpy(shared.centroid_sums))
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(per_class(features)), got, rtol=1e-5, atol=1e-7
    )


def test_shared_head_distances_stay_exact_far_from_the_origin():
    # The shared head expands ||z - e||^2 into one matrix product; centred on
    # the mean centroid, it does not lose the small distances of a trained
    # model whose embeddings and centroids sit far from zero.
    layer = _layer(head="shared", length_scale=0.1)
    offset = 1000.0
    layer.centroid_sums.assign(
        (keras.ops.convert_to_numpy(layer.centroids) + offset)
        * keras.ops.convert_to_numpy(layer.centroid_counts)[None]
    )
    centroids = keras.ops.convert_to_numpy(layer.centroids)
    embeddings = centroids.T + 0.01  # 0.01 from each centroid in every dim
    log_kernel = keras_duq._ops.log_kernel_values(
        keras_duq._ops.squared_distances(
            keras.ops.convert_to_tensor(embeddings), layer.centroids
        ),
        0.1,
    )
    own = np.diagonal(keras.ops.convert_to_numpy(log_kernel))
    np.testing.assert_allclose(own, -(0.01**2) / (2 * 0.1**2), rtol=1e-2)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_update_centroids_refuses_a_non_finite_update_on_every_backend(bad):
    layer = _layer(momentum=0.9)
    features = _features()
    features[2, 1] = bad
    labels_one_hot = np.eye(3, dtype="float32")[[0, 1, 1, 2, 2, 2]]
    sums = keras.ops.convert_to_numpy(layer.centroid_sums).copy()
    before = [keras.ops.convert_to_numpy(v).copy() for v in layer.non_trainable_weights]
    applied = layer.update_centroids(features, labels_one_hot)
    assert not bool(keras.ops.convert_to_numpy(applied))
    for old, variable in zip(before, layer.non_trainable_weights):
        np.testing.assert_array_equal(old, keras.ops.convert_to_numpy(variable))
    # A finite batch is applied, and says so.
    applied = layer.update_centroids(_features(), labels_one_hot)
    assert bool(keras.ops.convert_to_numpy(applied))
    assert not np.array_equal(sums, keras.ops.convert_to_numpy(layer.centroid_sums))


def test_shared_head_update_centroids_is_one_moving_average_step():
    layer = _layer(head="shared", momentum=0.9)
    features = _features()
    labels = np.array([0, 1, 1, 2, 2, 2])
    old_sums = layer.centroid_sums.numpy().copy()
    embedded = features @ keras.ops.convert_to_numpy(layer.projection)
    layer.update_centroids(features, np.eye(3, dtype="float32")[labels])
    for c in range(3):
        expected = 0.9 * old_sums[:, c] + 0.1 * embedded[labels == c].sum(0)
        np.testing.assert_allclose(
            layer.centroid_sums.numpy()[:, c], expected, rtol=1e-5
        )


def test_auto_head_is_per_class_while_small_and_shared_beyond():
    limit = keras_duq._duq_output.MAX_PER_CLASS_HEAD_VALUES
    small = keras_duq.DUQOutput(num_classes=10)
    small.build((None, 2048))  # 2048 x 256 x 10 = 5.2M values
    assert (
        small.resolved_head == "per_class" and small.get_config()["head"] == "per_class"
    )
    large = keras_duq.DUQOutput(num_classes=1000)
    large.build((None, 2048))
    assert large.resolved_head == "shared" and large.get_config()["head"] == "shared"
    # At most twice a softmax head's values (2048 x 1000 + 1000).
    assert large.count_params() <= 2 * (2048 * 1000 + 1000)
    assert 2048 * 256 * 10 <= limit < 2048 * 256 * 1000


def test_config_without_head_loads_the_per_class_head():
    # Files saved before `head` existed hold a per-class kernel, whatever
    # today's rule would choose for their sizes.
    layer = keras_duq.DUQOutput(num_classes=300)  # 512 x 256 x 300 > the limit
    config = layer.get_config()
    del config["head"]
    restored = keras_duq.DUQOutput.from_config(config)
    restored.build((None, 512))
    assert restored.resolved_head == "per_class"


def test_unknown_head_is_a_clear_error():
    with pytest.raises(ValueError, match="(?s)head.*Received: `head='low_rank'`"):
        keras_duq.DUQOutput(num_classes=3, head="low_rank")


# ------------------------------------------------- length_scale="auto"


def _auto_model(seed=0, features=4, classes=3, **kwargs):
    keras.utils.set_random_seed(seed)
    backbone = keras.Sequential(
        [keras.Input((features,)), keras.layers.Dense(16, activation="relu")]
    )
    model = keras_duq.wrap(backbone, num_classes=classes, **kwargs)
    model.compile(optimizer="adam")
    return model


def _numpy(value):
    return keras.ops.convert_to_numpy(value)


def _data(n=64, features=4, classes=3, scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    x = (scale * rng.normal(size=(n, features))).astype("float32")
    return x, np.arange(n) % classes


def test_auto_length_scale_is_a_share_of_the_features_spread_at_the_first_fit():
    share = keras_duq._duq_output.AUTO_LENGTH_SCALE_SPREADS
    model = _auto_model()
    head = model.duq_output
    assert head.length_scale == "auto" and head.needs_start
    x, y = _data()
    embeddings = _numpy(head.embed(model.feature_extractor(x, training=False)))
    spread = np.sqrt(embeddings.var(axis=0).mean())
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    assert not head.needs_start
    # Set before the first step, from the whole (64-example) sample.
    np.testing.assert_allclose(_numpy(head.length_scales), share * spread, rtol=1e-5)
    # The centroids start one spread from the features' mean, not at N(0, 1).
    centroids = _numpy(head.centroids)
    distance = np.sqrt(((centroids - embeddings.mean(axis=0)) ** 2).mean())
    assert distance < 3 * spread
    # A second `fit` does not measure again: the length scale is the
    # model's state now, and its step moves it by one moving-average step
    # towards its share of the spread at the step's weights.
    # Inputs twice as large (features about twice as spread): a restart
    # would land far from the moving average.
    before = _numpy(head.length_scales)
    embeddings = _numpy(head.embed(model.feature_extractor(2 * x, training=False)))
    spread = np.sqrt(embeddings.var(axis=0).mean())
    model.fit(2 * x, y, batch_size=64, epochs=1, verbose=0)
    expected = head.momentum * before + (1 - head.momentum) * share * spread
    np.testing.assert_allclose(_numpy(head.length_scales), expected, rtol=1e-5)
    assert not np.allclose(before, share * spread, rtol=1e-3)  # a restart would differ


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_auto_length_scale_follows_the_features_spread_in_training(momentum):
    # Features that grow tenfold after the start: the length scale follows
    # them, so kernel values keep their scale; a fixed length scale stays.
    for length_scale in ("auto", 0.5):
        model = _auto_model(momentum=momentum, length_scale=length_scale)
        head = model.duq_output
        x, y = _data()
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        start = _numpy(head.length_scales)
        dense = model.feature_extractor.get_layer(index=-1)
        while not isinstance(dense, keras.layers.Dense):  # the backbone's last layer
            dense = dense.get_layer(index=-1)
        dense.kernel.assign(10.0 * dense.kernel)
        dense.bias.assign(10.0 * dense.bias)
        for _ in range(3):
            embeddings = _numpy(head.embed(model.feature_extractor(x, training=False)))
            before = _numpy(head.length_scales)
            model.fit(x, y, batch_size=64, epochs=1, verbose=0)
            if length_scale == "auto":
                share = keras_duq._duq_output.AUTO_LENGTH_SCALE_SPREADS
                target = share * np.sqrt(embeddings.var(axis=0).mean())
                expected = momentum * before + (1 - momentum) * target
                np.testing.assert_allclose(
                    _numpy(head.length_scales), expected, rtol=1e-4
                )
        if length_scale == "auto":
            grown = _numpy(head.length_scales) / start
            assert np.all(grown > (3 if momentum else 8)), grown
        else:
            np.testing.assert_array_equal(_numpy(head.length_scales), start)


def test_auto_length_scale_follows_the_input_scale():
    # The same model on inputs 100 times larger: the length scale, and so
    # the starting kernel values, follow.
    scales = []
    for input_scale in (0.01, 1.0):
        model = _auto_model()
        x, y = _data(scale=input_scale)
        model.fit(x, y, batch_size=64, epochs=1, verbose=0)
        scales.append(float(_numpy(model.duq_output.length_scales)[0]))
        assert model.predict(x, verbose=0).max(axis=1).mean() > 1e-3
    assert 30 < scales[1] / scales[0] < 300


def test_auto_length_scale_from_a_generator_keeps_every_batch():
    model = _auto_model()
    x, y = _data(n=64)

    def batches():
        for start in range(0, 64, 16):
            yield x[start : start + 16], y[start : start + 16]

    model.fit(batches(), epochs=1, verbose=0)
    assert int(_numpy(model.optimizer.iterations)) == 4
    assert not model.duq_output.needs_start


def test_a_rejected_first_fit_leaves_the_auto_head_unstarted():
    model = _auto_model()
    head = model.duq_output
    before = [_numpy(v) for v in head.start_variables]
    x, y = _data(n=32)

    def bad_stream():
        yield x[:16], y[:16] + 10  # a label out of range, in the first batch

    with pytest.raises(ValueError, match="class indices"):
        model.fit(bad_stream(), epochs=1, verbose=0)
    for variable, value in zip(head.start_variables, before):
        np.testing.assert_array_equal(_numpy(variable), value)
    assert head.needs_start


def test_auto_length_scale_saves_and_loads_started(tmp_path):
    model = _auto_model()
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    path = str(tmp_path / "auto.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.duq_output.length_scale == "auto"
    assert not loaded.duq_output.needs_start
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-7
    )


def test_a_fixed_length_scale_is_left_as_given():
    keras.utils.set_random_seed(0)
    backbone = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
    model = keras_duq.wrap(backbone, num_classes=3, length_scale=0.3)
    model.compile(optimizer="adam")
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    np.testing.assert_allclose(_numpy(model.duq_output.length_scales), 0.3)
    assert not hasattr(model.duq_output, "started")


@pytest.mark.parametrize("value", ["automatic", True, 0, -0.1, None])
def test_length_scale_rejects_what_is_neither_auto_nor_positive(value):
    with pytest.raises(ValueError, match='"auto"'):
        keras_duq.DUQOutput(3, length_scale=value)


def test_duq_model_has_the_graph_ends_of_a_functional_model():
    model = _auto_model()
    assert len(model.inputs) == 1 and model.input is model.inputs[0]
    assert model.outputs == [model.output]
    assert tuple(model.output.shape) == (None, 3)
    x, _ = _data(n=4)
    rebuilt = keras.Model(model.inputs, model.outputs)
    np.testing.assert_allclose(
        rebuilt.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-4, atol=1e-12
    )

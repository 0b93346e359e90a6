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
    # today's default, or its kernel values would be read at a tenth.
    layer = keras_duq.DUQOutput(num_classes=3)
    assert layer.projection_learning_rate == 0.1
    config = layer.get_config()
    del config["projection_learning_rate"]
    restored = keras_duq.DUQOutput.from_config(config)
    assert restored.projection_learning_rate == 1.0


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

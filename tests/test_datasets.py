"""Tests of keras_duq.datasets on the real (Fashion-)MNIST files in shared/."""

import gzip

import numpy as np
import pytest
import tensorflow as tf

import keras_duq

MNIST_TEST_CLASS_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_read_idx_mnist_labels(mnist_dir):
    labels = keras_duq.datasets.read_idx(mnist_dir / "t10k-labels-idx1-ubyte.gz")
    assert labels.shape == (10000,)
    assert labels.dtype == np.uint8
    assert labels[:6].tolist() == [7, 2, 1, 0, 4, 1]
    assert np.bincount(labels).tolist() == MNIST_TEST_CLASS_COUNTS


def test_read_idx_mnist_images(mnist_dir):
    images = keras_duq.datasets.read_idx(mnist_dir / "t10k-images-idx3-ubyte.gz")
    assert images.shape == (10000, 28, 28)
    assert images.dtype == np.uint8
    assert images.min() == 0 and images.max() == 255
    # The digits are drawn in the middle: the border pixels are blank.
    assert images[:, 0, :].max() == 0


def test_read_idx_matches_npz_copy(mnist_dir):
    with np.load(mnist_dir / "mnist-test.npz") as npz:
        np.testing.assert_array_equal(
            keras_duq.datasets.read_idx(mnist_dir / "t10k-images-idx3-ubyte.gz"),
            npz["x_test"],
        )


def test_read_idx_uncompressed(mnist_dir, tmp_path):
    raw = tmp_path / "t10k-labels-idx1-ubyte"
    with gzip.open(mnist_dir / "t10k-labels-idx1-ubyte.gz") as file:
        raw.write_bytes(file.read())
    np.testing.assert_array_equal(
        keras_duq.datasets.read_idx(raw),
        keras_duq.datasets.read_idx(mnist_dir / "t10k-labels-idx1-ubyte.gz"),
    )


def test_read_idx_big_endian_types(tmp_path):
    # A 2x3 int32 (type 0x0C) array, written big-endian as the format says.
    values = np.arange(-3, 3, dtype=">i4").reshape(2, 3)
    header = bytes([0, 0, 0x0C, 2]) + np.array([2, 3], ">u4").tobytes()
    path = tmp_path / "ints.idx"
    path.write_bytes(header + values.tobytes())
    result = keras_duq.datasets.read_idx(path)
    np.testing.assert_array_equal(result, values)
    assert result.dtype == np.dtype("int32")


def test_read_idx_rejects_bad_files(mnist_dir, tmp_path):
    with pytest.raises(ValueError, match="not found"):
        keras_duq.datasets.read_idx(tmp_path / "missing.gz")
    not_idx = tmp_path / "notes.txt"
    not_idx.write_text("hello")
    with pytest.raises(ValueError, match="Not an IDX file"):
        keras_duq.datasets.read_idx(not_idx)
    truncated = tmp_path / "truncated"
    with gzip.open(mnist_dir / "t10k-labels-idx1-ubyte.gz") as file:
        truncated.write_bytes(file.read()[:-10])
    with pytest.raises(ValueError, match="Truncated"):
        keras_duq.datasets.read_idx(truncated)


def test_load_mnist_test_from_folder(mnist_dir):
    x_test, y_test = keras_duq.datasets.load_mnist_test(mnist_dir)
    assert x_test.shape == (10000, 28, 28) and x_test.dtype == np.uint8
    assert y_test[:6].tolist() == [7, 2, 1, 0, 4, 1]
    with pytest.raises(ValueError, match="Missing IDX files"):
        keras_duq.datasets.load_mnist_test(mnist_dir.parent)


@pytest.fixture(scope="module")
def fashion_mnist(fashion_mnist_dir):
    return keras_duq.datasets.load_fashion_mnist(fashion_mnist_dir)


def test_load_fashion_mnist_from_folder(fashion_mnist):
    (x_train, y_train), (x_test, y_test) = fashion_mnist
    assert x_train.shape == (60000, 28, 28) and x_train.dtype == np.uint8
    assert x_test.shape == (10000, 28, 28) and y_test.dtype == np.uint8
    assert np.bincount(y_train).tolist() == [6000] * 10
    assert np.bincount(y_test).tolist() == [1000] * 10
    # The first training images: ankle boot, T-shirt, T-shirt, dress.
    assert y_train[:4].tolist() == [9, 0, 0, 3]


def test_load_fashion_mnist_through_keras(keras_home, fashion_mnist):
    (x_train, y_train), (x_test, y_test) = keras_duq.datasets.load_fashion_mnist()
    (x_train_idx, y_train_idx), (x_test_idx, y_test_idx) = fashion_mnist
    np.testing.assert_array_equal(y_train, y_train_idx)
    np.testing.assert_array_equal(x_test, x_test_idx)


def test_normalize_uses_fashion_mnist_statistics(fashion_mnist, mnist_dir):
    (x_train, _), _ = fashion_mnist
    normalized = keras_duq.datasets.normalize(x_train[:20000])
    assert normalized.shape == (20000, 28, 28, 1)
    assert normalized.dtype == np.float32
    assert normalized.mean() == pytest.approx(0.0, abs=0.01)
    assert normalized.std() == pytest.approx(1.0, abs=0.01)
    # MNIST gets FashionMNIST's statistics, not its own: a blank pixel maps
    # to the same value in both sets.
    x_mnist, _ = keras_duq.datasets.load_mnist_test(mnist_dir)
    blank = (
        -keras_duq.datasets.FASHION_MNIST_MEAN / keras_duq.datasets.FASHION_MNIST_STD
    )
    assert keras_duq.datasets.normalize(x_mnist[:10])[0, 0, 0, 0] == pytest.approx(
        blank
    )
    assert normalized[0, 0, 0, 0] == pytest.approx(blank)


def test_normalize_accepts_channel_axis_and_unit_floats():
    images = np.full((2, 28, 28, 1), 255, dtype=np.uint8)
    expected = (
        1 - keras_duq.datasets.FASHION_MNIST_MEAN
    ) / keras_duq.datasets.FASHION_MNIST_STD
    np.testing.assert_allclose(
        keras_duq.datasets.normalize(images), expected, rtol=1e-6
    )
    np.testing.assert_allclose(
        keras_duq.datasets.normalize(images[..., 0] / 255.0), expected, rtol=1e-6
    )


@pytest.mark.parametrize(
    "images, kwargs, match",
    [
        (np.zeros((2, 28, 28, 3), np.uint8), {}, "grayscale"),
        (np.full((2, 28, 28), 255.0), {}, r"scaled to \[0, 1\]"),
        (np.zeros((2, 28, 28), np.uint8), {"std": 0.0}, "std"),
    ],
)
def test_normalize_rejects_bad_input(images, kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_duq.datasets.normalize(images, **kwargs)


def test_make_dataset_batches_and_shuffles():
    x = np.arange(10, dtype="float32")[:, None]
    y = np.arange(10)
    batches = list(
        keras_duq.datasets.make_dataset(x, y, batch_size=4).as_numpy_iterator()
    )
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    assert np.concatenate([b[1] for b in batches]).tolist() == list(range(10))

    shuffled = keras_duq.datasets.make_dataset(
        x, y, batch_size=10, shuffle=True, seed=1
    )
    epochs = [next(shuffled.as_numpy_iterator()) for _ in range(2)]
    for x_batch, y_batch in epochs:
        assert sorted(y_batch.tolist()) == list(range(10))
        np.testing.assert_array_equal(x_batch[:, 0], y_batch)  # still paired
    # Each epoch is reshuffled.
    assert not np.array_equal(epochs[0][1], epochs[1][1])


def test_make_dataset_inputs_only_and_repeat():
    x = np.zeros((5, 3), "float32")
    dataset = keras_duq.datasets.make_dataset(x, batch_size=2, repeat=True)
    assert dataset.element_spec.shape.as_list() == [None, 3]
    assert len(list(dataset.take(7))) == 7  # repeats past the 3 batches


def test_make_dataset_turns_autotuning_off_and_users_can_turn_it_on():
    # With autotuning on, dropping a half-read iterator of a repeated dataset
    # (`fit` with `steps_per_epoch`) could wait up to a minute.
    dataset = keras_duq.datasets.make_dataset(
        np.zeros((6, 2), "float32"), batch_size=2, repeat=True
    )
    assert dataset.options().autotune.enabled is False
    assert len(list(dataset.take(5))) == 5
    options = tf.data.Options()
    options.autotune.enabled = True
    assert dataset.with_options(options).options().autotune.enabled is True


def test_make_dataset_rejects_bad_input():
    with pytest.raises(ValueError, match="batch_size"):
        keras_duq.datasets.make_dataset(np.zeros((4, 2)), batch_size=0)
    with pytest.raises(ValueError, match="same length"):
        keras_duq.datasets.make_dataset(np.zeros((4, 2)), np.zeros(3))


def test_array_batches_pair_reshuffle_and_repeat_without_tensorflow():
    # What `make_dataset` returns when TensorFlow is not installed (see
    # tests/test_jax_backend.py for that path end to end).
    x = np.arange(10, dtype="float32")[:, None]
    y = np.arange(10)
    ordered = keras_duq.datasets._ArrayBatches((x, y), 4, (False, None, False))
    assert ordered.num_batches == len(ordered) == 3
    assert [ordered[i][1].tolist() for i in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]

    def one_pass(dataset, first=0):
        batches = [dataset[first + i] for i in range(dataset.batches_per_pass)]
        for x_batch, y_batch in batches:
            np.testing.assert_array_equal(x_batch[:, 0], y_batch)  # still paired
        return np.concatenate([b[1] for b in batches])

    shuffled = keras_duq.datasets._ArrayBatches((x, y), 4, (True, 1, False))
    first = one_pass(shuffled)
    assert sorted(first.tolist()) == list(range(10))
    np.testing.assert_array_equal(one_pass(shuffled), first)  # one order per pass
    shuffled.on_epoch_end()  # what Keras calls after every epoch
    second = one_pass(shuffled)
    assert sorted(second.tolist()) == list(range(10))
    assert not np.array_equal(first, second)
    again = keras_duq.datasets._ArrayBatches((x, y), 4, (True, 1, False))
    np.testing.assert_array_equal(one_pass(again), first)  # seeded

    # Endless: batch i is batch i % 3 of pass i // 3; epochs do not restart it.
    endless = keras_duq.datasets._ArrayBatches((x, y), 4, (True, 1, True))
    assert endless.num_batches is None
    np.testing.assert_array_equal(one_pass(endless), first)
    endless.on_epoch_end()
    np.testing.assert_array_equal(one_pass(endless, first=3), second)
    with pytest.raises(TypeError, match="steps_per_epoch"):
        len(endless)
    with pytest.raises(ValueError, match="at least one example"):
        keras_duq.datasets._ArrayBatches(
            (np.zeros((0, 2)), None), 4, (False, None, False)
        )

"""FashionMNIST (in distribution) and MNIST (out of distribution) loaders.

The paper's image benchmark trains on FashionMNIST and measures how well the
certainty separates its test set from MNIST's. Loaders return the raw
`uint8` images `(N, 28, 28)` and labels, as `keras.datasets` does;
`normalize` turns images into the model's float32 input.
"""

from __future__ import annotations

import gzip
import os
from typing import TYPE_CHECKING

import keras
import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "load_fashion_mnist",
    "load_mnist_test",
    "make_dataset",
    "normalize",
    "read_idx",
]

if TYPE_CHECKING:
    import tensorflow as tf

# Pixel mean and standard deviation of the FashionMNIST training images,
# scaled to [0, 1], as the paper's reference code rounds them.
FASHION_MNIST_MEAN = 0.2861
FASHION_MNIST_STD = 0.3530
# A fixed buffer instead of `tf.data.AUTOTUNE` (see `make_dataset`): batches
# come from memory far faster than a training step, so two are plenty.
_PREFETCH_BATCHES = 2

_MNIST_TEST_FILES = ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
_FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)

# IDX type codes (third byte of the header) and their big-endian dtypes.
_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads an IDX file, the format of the original (Fashion-)MNIST files.

    Gzip-compressed files (`.gz`) are recognised by their content and
    decompressed on the fly.

    Example:

    ```python
    labels = keras_duq.datasets.read_idx("mnist/t10k-labels-idx1-ubyte.gz")
    labels.shape   # (10000,)
    ```

    Args:
        path: path (str or `os.PathLike`) to an IDX file, plain or gzipped.

    Returns:
        A numpy array with the file's shape, in native byte order (`uint8`
        for image and label files).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(
            "IDX file not found. Pass the path of an existing file such as "
            f"'t10k-labels-idx1-ubyte.gz'. Received: `path={path!r}`"
        )
    with open(path, "rb") as file:
        compressed = file.read(2) == _GZIP_MAGIC
    opener = gzip.open if compressed else open
    with opener(path, "rb") as file:
        data = file.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(
            "Not an IDX file: the header must start with two zero bytes and a "
            f"known type code {sorted(hex(c) for c in _IDX_DTYPES)}. "
            f"Received: `path={path!r}` starting with {data[:4]!r}"
        )
    dtype = _IDX_DTYPES[data[2]]
    ndim = data[3]
    header_size = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(data, ">u4", count=ndim, offset=4))
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header_size != expected:
        raise ValueError(
            f"Truncated or corrupt IDX file: the header announces shape "
            f"{shape} ({expected} bytes of data) but the file holds "
            f"{len(data) - header_size}. Download it again. "
            f"Received: `path={path!r}`"
        )
    array = np.frombuffer(data, dtype, offset=header_size).reshape(shape)
    return array.astype(dtype.newbyteorder("="))


def load_fashion_mnist(
    path: str | os.PathLike | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Loads FashionMNIST, the paper's in-distribution data set.

    Example:

    ```python
    (x_train, y_train), (x_test, y_test) = keras_duq.datasets.load_fashion_mnist()
    x_train = keras_duq.datasets.normalize(x_train)   # (60000, 28, 28, 1) float32
    ```

    Args:
        path: `None` (default) loads through `keras.datasets.fashion_mnist`,
            which downloads the files once into `$KERAS_HOME/datasets` (set
            `KERAS_HOME` to a folder holding `datasets/fashion-mnist/` to work
            offline). Or the path of a folder holding the four original IDX
            files (`train-images-idx3-ubyte.gz`, ...), read with `read_idx`.

    Returns:
        `((x_train, y_train), (x_test, y_test))`: `uint8` images
        `(60000, 28, 28)` and `(10000, 28, 28)`, `uint8` labels.
    """
    if path is None:
        return keras.datasets.fashion_mnist.load_data()
    x_train, y_train, x_test, y_test = (
        read_idx(p) for p in _files_in(path, _FASHION_MNIST_FILES)
    )
    return (x_train, y_train), (x_test, y_test)


def load_mnist_test(
    path: str | os.PathLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Loads the MNIST test set, the paper's out-of-distribution data.

    Example:

    ```python
    x_ood, y_ood = keras_duq.datasets.load_mnist_test("shared/data/mnist")
    x_ood = keras_duq.datasets.normalize(x_ood)   # FashionMNIST's mean and std
    ```

    Args:
        path: `None` (default) loads through `keras.datasets.mnist` (online
            the first time). Or the path of a folder holding the original
            `t10k-images-idx3-ubyte.gz` and `t10k-labels-idx1-ubyte.gz`,
            read with `read_idx`.

    Returns:
        `(x_test, y_test)`: `uint8` images `(10000, 28, 28)` and `uint8`
        labels `(10000,)`.
    """
    if path is None:
        _, (x_test, y_test) = keras.datasets.mnist.load_data()
        return x_test, y_test
    images, labels = (read_idx(p) for p in _files_in(path, _MNIST_TEST_FILES))
    return images, labels


def normalize(
    images: ArrayLike,
    mean: float = FASHION_MNIST_MEAN,
    std: float = FASHION_MNIST_STD,
) -> np.ndarray:
    """Scales images to `[0, 1]`, standardises them and adds a channel axis.

    Apply it with the *same* statistics, those of the in-distribution
    training set, to in-distribution and OoD data alike. The paper
    (Section 4.2) stresses this: at test time nothing is known about an
    incoming OoD example, so it must go through the same preprocessing as
    the training data; normalising the OoD set with its own statistics uses
    knowledge of that set and "makes the problem artificially simple".

    Example:

    ```python
    x_train = keras_duq.datasets.normalize(x_train)   # FashionMNIST statistics
    x_ood = keras_duq.datasets.normalize(x_mnist)     # the same statistics
    ```

    Args:
        images: array-like `(N, H, W)` or `(N, H, W, 1)`: integer pixels in
            `[0, 255]` (e.g. `uint8`), or floats already in `[0, 1]`.
        mean: pixel mean of the training set on the `[0, 1]` scale.
            Defaults to FashionMNIST's `0.2861`.
        std: pixel standard deviation on that scale, > 0. Defaults to
            FashionMNIST's `0.3530`.

    Returns:
        A float32 array `(N, H, W, 1)`.
    """
    if not std > 0:
        raise ValueError(f"Expected `std` to be > 0. Received: `std={std!r}`")
    images = np.asarray(images)
    if images.ndim == 4 and images.shape[-1] == 1:
        images = images[..., 0]
    if images.ndim != 3:
        raise ValueError(
            "Expected grayscale images of shape (N, height, width) or "
            f"(N, height, width, 1). Received: shape {images.shape}"
        )
    if np.issubdtype(images.dtype, np.integer):
        images = images.astype("float32") / 255.0
    else:
        images = images.astype("float32")
        if images.size and (images.min() < 0.0 or images.max() > 1.0):
            raise ValueError(
                "Float images must already be scaled to [0, 1]; pass integer "
                "pixels in [0, 255] (e.g. uint8) to have them scaled. "
                f"Received: values in [{images.min()}, {images.max()}]"
            )
    return ((images - mean) / std)[..., None].astype("float32")


def make_dataset(
    x: ArrayLike,
    y: ArrayLike | None = None,
    batch_size: int = 128,
    shuffle: bool = False,
    seed: int | None = None,
    repeat: bool = False,
    cache: bool = True,
) -> tf.data.Dataset | keras.utils.PyDataset:
    """A batched `tf.data` pipeline over in-memory arrays.

    Cache, then shuffle (reshuffled every epoch), batch, optionally repeat,
    and prefetch two batches, so that the next batch is ready while the
    model trains.

    Without TensorFlow installed (the JAX backend), it returns a
    `keras.utils.PyDataset` with the same batches: shuffled anew every pass
    (reproducibly with `seed`), the last batch smaller, endless with
    `repeat=True`. `fit`, `evaluate`, `predict` and
    `keras_duq.callbacks.OODEvaluation` take either.

    `tf.data`'s autotuning is turned off in the returned dataset's options:
    dropping an iterator that has not reached the end of a repeated dataset
    waits for the autotuning thread's next wake-up, and this pipeline, whose
    batches come from memory, has nothing to tune. To turn autotuning back
    on, e.g. after adding your own parallel `map`:

    ```python
    options = tf.data.Options()
    options.autotune.enabled = True
    dataset = dataset.with_options(options)
    ```

    Example:

    ```python
    train = keras_duq.datasets.make_dataset(x_train, y_train, shuffle=True, seed=0)
    test = keras_duq.datasets.make_dataset(x_test, y_test)
    model.fit(train, epochs=30)
    ```

    Args:
        x: array `(N, ...)`, the inputs.
        y: optional array `(N, ...)`, the labels. With labels the dataset
            yields `(x, y)` pairs, else `x`.
        batch_size: int >= 1. Defaults to `128`, the paper's batch size.
        shuffle: bool, shuffle over the whole set, anew every epoch. Defaults
            to `False` (keep evaluation order).
        seed: optional int, shuffling seed.
        repeat: bool, repeat forever (pass `steps_per_epoch` to `fit`).
            Defaults to `False`.
        cache: bool, cache the elements in memory after the first pass.
            Defaults to `True`.

    Returns:
        A `tf.data.Dataset`.
    """
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int)
        or batch_size < 1
    ):
        raise ValueError(
            "Expected `batch_size` to be an integer >= 1. "
            f"Received: `batch_size={batch_size!r}`"
        )
    if y is not None and len(x) != len(y):
        raise ValueError(
            f"`x` and `y` must have the same length. Received: `x` of length "
            f"{len(x)} and `y` of length {len(y)}"
        )
    try:
        import tensorflow as tf  # tf.data serves every backend's `fit`
    except ImportError:
        return _ArrayBatches((x, y), batch_size, (shuffle, seed, repeat))

    dataset = tf.data.Dataset.from_tensor_slices(x if y is None else (x, y))
    if cache:
        dataset = dataset.cache()
    if shuffle:
        dataset = dataset.shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.batch(batch_size)
    if repeat:
        dataset = dataset.repeat()
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.prefetch(_PREFETCH_BATCHES).with_options(options)


class _ArrayBatches(keras.utils.PyDataset):
    """`make_dataset`'s batches without TensorFlow: a `keras.utils.PyDataset`.

    Batch `i` of an endless (`repeat=True`) one is batch `i % n` of pass
    `i // n`, so `fit` with `steps_per_epoch` goes on where the last epoch
    stopped, as a repeated `tf.data` pipeline does. A finite one starts a
    new pass at each `on_epoch_end`, which Keras calls after every epoch.
    Pass `p` is shuffled by a generator seeded with `(seed, p)`.
    """

    def __init__(
        self,
        arrays: tuple[ArrayLike, ArrayLike | None],
        batch_size: int,
        order: tuple[bool, int | None, bool],
    ) -> None:
        x, y = arrays
        shuffle, seed, repeat = order  # `make_dataset`'s arguments, checked there
        super().__init__()
        self.x, self.y = np.asarray(x), None if y is None else np.asarray(y)
        if not len(self.x):
            raise ValueError("Expected at least one example. Received: an empty `x`")
        self.batch_size, self.shuffle, self.repeat = batch_size, shuffle, repeat
        self.seed = np.random.SeedSequence(seed).entropy
        self.batches_per_pass = -(-len(self.x) // batch_size)
        self._pass = 0
        self._cached = (None, None)  # (pass, order): one permutation per pass

    @property
    def num_batches(self) -> int | None:
        return None if self.repeat else self.batches_per_pass

    def __len__(self) -> int:
        if self.repeat:
            raise TypeError(
                "A repeated dataset has no length; pass `steps_per_epoch` to `fit`."
            )
        return self.batches_per_pass

    def __getitem__(self, index: int) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        passes, index = divmod(index, self.batches_per_pass)
        order = self._order(self._pass + passes)
        rows = order[index * self.batch_size : (index + 1) * self.batch_size]
        return self.x[rows] if self.y is None else (self.x[rows], self.y[rows])

    def on_epoch_end(self) -> None:
        if not self.repeat:
            self._pass += 1

    def _order(self, pass_index: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.x))
        if self._cached[0] != pass_index:
            rng = np.random.default_rng([self.seed, pass_index])
            self._cached = (pass_index, rng.permutation(len(self.x)))
        return self._cached[1]


def _files_in(folder: str | os.PathLike, names: tuple[str, ...]) -> list[str]:
    folder = os.fspath(folder)
    paths = [os.path.join(folder, name) for name in names]
    missing = [name for name, p in zip(names, paths) if not os.path.isfile(p)]
    if missing:
        raise ValueError(
            f"Missing IDX files {missing} in the folder. Pass a folder holding "
            f"{list(names)}, or `path=None` to load through keras.datasets. "
            f"Received: `path={folder!r}`"
        )
    return paths

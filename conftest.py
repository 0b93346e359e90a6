"""Shared test set-up: the offline data in `shared/` beside the repository.

The repository and `shared/` sit side by side (`<root>/main`,
`<root>/shared`), locally and in CI.
"""

import os
from pathlib import Path

SHARED_DIR = Path(__file__).resolve().parents[1] / "shared"
DATA_DIR = SHARED_DIR / "data"

# Keras reads KERAS_HOME once, when `keras.src.backend.config` is imported,
# so it must be set before the first `import keras` of the test session.
# `setdefault` keeps a KERAS_HOME chosen by whoever runs the tests.
os.environ.setdefault("KERAS_HOME", str(DATA_DIR / "keras"))
# TensorFlow's CPU kernels without oneDNN have no gradient of dilated
# convolutions and no channels-first convolution, which the spectral
# normalisation tests use; TensorFlow leaves oneDNN off by default on some
# CPUs (AMD EPYC without AVX-512, for one). Read once, at TensorFlow's import.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

# JAX compiles every new model's train step, and many tests build the same
# small models: its persistent compilation cache (keyed by the compiled
# program) serves the repeats, here and in the backend subprocesses, which
# inherit the variable (as do pytest-xdist's workers: one folder for all).
# tests/test_health.py on JAX: 193 s with it, 250 s without. One folder per
# session, removed at exit; a folder chosen by whoever runs the tests is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _jax_cache = tempfile.mkdtemp(prefix="keras_duq_jax_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jax_cache
    atexit.register(shutil.rmtree, _jax_cache, ignore_errors=True)

import pytest  # noqa: E402


def _missing(message):
    """Skips locally; fails under CI, where the data must be there."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} CI must provide it (CI=true).")
    pytest.skip(message)


def _existing(path):
    if not path.exists():
        _missing(f"No offline data at {path} (expected shared/ beside the repo).")
    return path


@pytest.fixture(scope="session")
def mnist_dir():
    """Folder with the original MNIST IDX files (test set)."""
    return _existing(DATA_DIR / "mnist")


@pytest.fixture(scope="session")
def fashion_mnist_dir():
    """Folder with the original FashionMNIST IDX files (Keras cache layout)."""
    return _existing(DATA_DIR / "keras" / "datasets" / "fashion-mnist")


@pytest.fixture(scope="session")
def clinc150_path():
    """CLINC150's `data_full.json` (150 intents and out-of-scope queries)."""
    return _existing(DATA_DIR / "clinc150" / "data_full.json")


@pytest.fixture(scope="session")
def cifar10_zip():
    """All 60,000 CIFAR-10 images as JPEG, in one uncompressed zip."""
    return _existing(DATA_DIR / "cifar10" / "cifar10_jpg.zip")


@pytest.fixture(scope="session")
def tiny_imagenet_resize_path():
    """The 10,000 Tiny-ImageNet test images at 32x32 (an OoD set for CIFAR-10)."""
    return _existing(DATA_DIR / "tiny_imagenet" / "test_resize32.npz")


@pytest.fixture(scope="session")
def keras_home():
    """The Keras home in use, skipping when it cannot serve FashionMNIST offline.

    `keras.utils.get_file` falls back to `/tmp/.keras` (and downloads) when
    KERAS_HOME is not writable, which is the case for a read-only `shared/`
    when the tests do not run as root.
    """
    from keras.src.backend import config

    home = Path(config.keras_home())
    if not (home / "datasets" / "fashion-mnist").is_dir():
        _missing(f"KERAS_HOME={home} holds no datasets/fashion-mnist.")
    if not os.access(home, os.W_OK):
        _missing(f"KERAS_HOME={home} is read-only; keras would download.")
    return home


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "requires_backend(*names): runs only when the suite runs under one of "
        "these Keras backends (KERAS_BACKEND=name); tests that start their own "
        "backends in subprocesses run once, in the backend named",
    )


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("requires_backend")
    if marker is None:
        return
    import keras

    if keras.backend.backend() not in marker.args:
        pytest.skip(f"needs KERAS_BACKEND={' or '.join(marker.args)}")

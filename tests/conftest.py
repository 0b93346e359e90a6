"""Fixtures of the library's tests (the offline data's are in the root conftest.py)."""

import gc

import keras
import pytest


@pytest.fixture
def policy():
    """Sets a global dtype policy for one test and restores float32 after."""
    yield keras.mixed_precision.set_global_policy
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(autouse=True, scope="module")
def _freeze_survivors():
    """After each test module: one garbage collection, then `gc.freeze()`.

    A full collection walks every live object, and a worker holds over a
    million (TensorFlow, JAX, PyTorch, Keras's caches); frozen, the
    survivors of finished modules are out of later collections' way (the
    default run about 3% faster). At the end, pytest collects five times and
    pytest-xdist sends SIGINT to a worker still busy 5 seconds after its
    run: unfrozen, those collections took that long, and the interrupt
    printed a stray KeyboardInterrupt traceback from inside a garbage
    collection callback.
    """
    yield
    gc.collect()
    gc.freeze()

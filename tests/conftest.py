"""Fixtures of the library's tests (the offline data's are in the root conftest.py)."""

import keras
import pytest


@pytest.fixture
def policy():
    """Sets a global dtype policy for one test and restores float32 after."""
    yield keras.mixed_precision.set_global_policy
    keras.mixed_precision.set_global_policy("float32")

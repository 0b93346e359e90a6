"""Scripts run in a subprocess under a chosen Keras backend (a process has one)."""

import json
import os
import subprocess
import sys
import textwrap

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def make_model(
    gradient_penalty=0.5,
    batch_norm=True,
    classes=3,
    momentum=0.9,
    head="auto",
    **kwargs,
):
    """A small CNN with BatchNormalization and a DUQ head, compiled with momentum SGD."""
    import keras

    import keras_duq

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(4, 3)(inputs)
    if batch_norm:
        x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Flatten()(x)
    outputs = keras_duq.DUQOutput(
        classes, centroid_dims=6, length_scale=0.5, momentum=0.9, head=head
    )(x)
    model = keras_duq.DUQModel(
        inputs, outputs, gradient_penalty=gradient_penalty, **kwargs
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=momentum))
    return model


def data(n=96, classes=3, seed=0):
    """Random images and labels that depend on them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = (np.abs(x.mean(axis=(1, 2, 3))) * 30).astype("int64") % classes
    return x, y


def state(model):
    """Every variable of the model, as NumPy arrays."""
    import keras

    return [keras.ops.convert_to_numpy(v) for v in model.weights]


PRELUDE = f"""
import json, os, sys
sys.path.insert(0, {TESTS_DIR!r})
import numpy as np
import keras
import keras_duq
from backend_subprocess import data, make_model, state
"""


# After the prelude: any later `import tensorflow` fails, as where it is not installed.
BLOCK_TENSORFLOW = """
import importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "tensorflow":
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
"""


def skip_unless_installed(backend):
    """Skips the test where `backend` is not installed (`tests` installs TensorFlow only)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec(backend) is None:  # each backend's module name
        pytest.skip(f'needs {backend}: pip install -e ".[tests-{backend}]"')


def run(
    script, backend="jax", extra_env=None, timeout=300, block_tensorflow=False, args=()
):
    """Runs `PRELUDE + script` under `backend`; returns its last line of output, as JSON."""
    if backend != "tensorflow":
        skip_unless_installed(backend)
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    env.update(extra_env or {})
    prelude = PRELUDE + (BLOCK_TENSORFLOW if block_tensorflow else "")
    result = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        # The repository root: scripts import `reproduction` from there.
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])

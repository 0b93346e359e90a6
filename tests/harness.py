"""The tests' shared harness: model and data builders, state snapshots, and
scripts of `tests/scripts/` run in a subprocess under a chosen Keras backend.

A process has one backend, and some settings (logical devices, TF_CONFIG,
XLA flags) must be made before the backend starts. Each script is a file
that prints its results as JSON on its last line; `run` returns them.
The builders here (`make_model`, `dense_model`, `data`, `tabular_data`,
`token_ids`, `state`) serve the test modules and the scripts alike.
"""

import json
import os
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SCRIPTS_DIR = os.path.join(TESTS_DIR, "scripts")
ROOT = os.path.dirname(TESTS_DIR)


def make_model(
    gradient_penalty=0.5,
    batch_norm=True,
    classes=3,
    momentum=0.9,
    head="auto",
    jit_compile="auto",
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
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=momentum), jit_compile=jit_compile
    )
    return model


def dense_model(
    layers,
    classes=3,
    features=4,
    inputs=None,
    seed=0,
    length_scale=0.5,
    momentum=0.9,
    head="auto",
    **model_kwargs,
):
    """A small DUQ model on tabular data, uncompiled.

    `inputs` (`keras.Input((features,))` by default; a dict or list of
    inputs is concatenated), then the layers that `layers()` returns (made
    after the random seed is set, so that their weights are the same each
    time), then a `DUQOutput` with 6 centroid dimensions; `model_kwargs` go
    to `DUQModel`.
    """
    import keras

    import keras_duq

    keras.utils.set_random_seed(seed)
    if inputs is None:
        inputs = keras.Input((features,))
    x = inputs
    if not isinstance(inputs, keras.KerasTensor):
        x = keras.layers.Concatenate()(
            list(inputs.values() if isinstance(inputs, dict) else inputs)
        )
    for layer in layers():
        x = layer(x)
    outputs = keras_duq.DUQOutput(
        classes,
        centroid_dims=6,
        length_scale=length_scale,
        momentum=momentum,
        head=head,
    )(x)
    return keras_duq.DUQModel(inputs, outputs, **model_kwargs)


def data(n=96, classes=3, seed=0):
    """Random images and labels that depend on them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = (np.abs(x.mean(axis=(1, 2, 3))) * 30).astype("int64") % classes
    return x, y


def tabular_data(
    n=64, features=4, classes=3, seed=0, scale=1.0, shift=0.0, balanced=False
):
    """`(x, y)`: standard normal features (times `scale`, plus `shift`) and
    random labels, or with `balanced` the labels `0, 1, ..., classes - 1` in turn."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = (shift + scale * rng.normal(size=(n, features))).astype("float32")
    if balanced:
        return x, np.arange(n) % classes
    return x, rng.integers(0, classes, size=n)


def token_ids(n=32, length=12, vocabulary=30, lengths=(2, 12), seed=0):
    """`(n, length)` int32 token ids from `1..vocabulary - 1` in the first `k`
    positions of each row, `k` drawn from `lengths` (both ends included), and
    the padding id 0 after."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocabulary, size=(n, length))
    kept = rng.integers(lengths[0], lengths[1] + 1, size=n)
    ids[np.arange(length)[None, :] >= kept[:, None]] = 0
    return ids.astype("int32")


def state(model, optimizer=False):
    """Every variable of the model (and, with `optimizer`, of its optimizer,
    `iterations` included), as NumPy arrays."""
    import keras

    variables = model.weights + (model.optimizer.variables if optimizer else [])
    return [keras.ops.convert_to_numpy(v).copy() for v in variables]


def assert_state_equal(model, before, optimizer=False):
    """Asserts that `state(model, optimizer)` equals `before`, naming the variable."""
    import numpy as np

    variables = model.weights + (model.optimizer.variables if optimizer else [])
    for old, variable, new in zip(before, variables, state(model, optimizer)):
        np.testing.assert_array_equal(old, new, err_msg=variable.path)


# Puts the blocker below in place, then runs the script named by argv[1].
_BLOCKED_RUN = """
import runpy, sys
import harness
harness.block_tensorflow()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def block_tensorflow():
    """Makes any later `import tensorflow` fail, as where it is not installed."""
    import importlib.abc

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "tensorflow":
                raise ImportError("blocked: " + name)

    sys.meta_path.insert(0, Block())


def skip_unless_installed(backend):
    """Skips the test where `backend` is not installed (`tests` installs TensorFlow only)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec(backend) is None:  # each backend's module name
        pytest.skip(f'needs {backend}: pip install -e ".[tests-{backend}]"')


def script_path(script):
    """The path of `script`, a file of `tests/scripts/`."""
    return os.path.join(SCRIPTS_DIR, script)


def script_env(backend, extra_env=None):
    """The environment a script runs in: `backend`, and `tests/`, `tests/scripts/`
    and the repository root importable (for `harness`, the scripts'
    helper modules and `keras_duq` from this checkout)."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    path = [TESTS_DIR, SCRIPTS_DIR, ROOT] + (
        [env["PYTHONPATH"]] if "PYTHONPATH" in env else []
    )
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.update(extra_env or {})
    return env


def run(
    script, backend="jax", extra_env=None, timeout=300, block_tensorflow=False, args=()
):
    """Runs `tests/scripts/<script>` under `backend`; returns its last line of output, as JSON.

    With `block_tensorflow`, any `import tensorflow` in the script fails.
    """
    if backend != "tensorflow":
        skip_unless_installed(backend)
    command = [script_path(script), *args]
    if block_tensorflow:
        command = ["-c", _BLOCKED_RUN, *command]
    result = subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        env=script_env(backend, extra_env),
        timeout=timeout,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])

"""TensorFlow, JAX and PyTorch train the same model the same way, and share `.keras` files.

Each backend runs in its own subprocess (a process has one backend); the
tests run once, in the TensorFlow run of the tests marked slow (starting
six processes takes most of a minute).
"""

import json

import numpy as np
import pytest
from harness import run

BACKENDS = ("tensorflow", "jax", "torch")

pytestmark = [pytest.mark.requires_backend("tensorflow"), pytest.mark.slow]

# Same initial weights (written by TensorFlow), same 3 batches, a CNN with
# BatchNormalization, the penalty on and momentum SGD
# (`scripts/cross_backend_train.py`); then each backend loads the others'
# `.keras` files (`scripts/cross_backend_load.py`).


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The folder where each backend trained 3 steps, and the weights' names."""
    folder = tmp_path_factory.mktemp("backends")
    names = None
    for backend in BACKENDS:  # TensorFlow first: it writes the initial weights
        names = run("cross_backend_train.py", backend=backend, args=[str(folder)])[
            "names"
        ]
    return folder, names


def test_backends_agree_after_three_steps(trained):
    folder, names = trained
    values = {}
    for name in ("initial",) + BACKENDS:
        with np.load(folder / f"{name}.npz") as arrays:
            values[name] = [arrays[f"arr_{i}"] for i in range(len(names))]
    changed = 0
    for backend in ("jax", "torch"):
        report = []
        for name, start, reference, value in zip(
            names, values["initial"], values["tensorflow"], values[backend]
        ):
            change = np.abs(reference - start).max()
            difference = np.abs(value - reference).max()
            report.append((name, float(difference), float(change)))
            # The convolution's bias feeds BatchNormalization, which removes
            # any shift: its exact change is 0 (no weight decay at 0), so
            # what moves it is rounding, 1e-8 on any backend.
            assert difference <= max(1e-3 * change, 1e-6), (backend, report)
        print(backend, "against tensorflow:", report)
        changed = sum(change > 1e-6 for _, _, change in report)
    assert changed >= 8  # conv kernel, BN (4), W, centroid counts and sums


def test_keras_files_load_on_every_backend_and_keep_training(trained):
    folder, _ = trained
    for backend in BACKENDS:
        sources = [source for source in BACKENDS if source != backend]
        results = run(
            "cross_backend_load.py",
            backend=backend,
            args=[str(folder), json.dumps(sources)],
        )
        for source, result in results.items():
            assert result["error"] <= 1e-5, (source, backend, result)
            assert result["steps"] == 3 and np.isfinite(result["loss"]), (
                source,
                backend,
            )

"""What only the JAX backend has: TensorFlow-free runs, deferred error codes, DataParallel.

Each test runs a script of `tests/scripts/` with `KERAS_BACKEND=jax` in a subprocess (a
process has one backend, and some of these need an environment set before
JAX starts); they run once, in the suite's JAX run.
"""

import numpy as np
import pytest
from harness import run

pytestmark = pytest.mark.requires_backend("jax")


def test_imports_and_trains_without_tensorflow(tmp_path):
    out = run(
        "jax_without_tensorflow.py",
        args=[str(tmp_path / "model.keras")],
        block_tensorflow=True,
    )
    assert not out["tensorflow"]
    history = out["history"]
    assert {"loss", "bce", "gradient_penalty", "accuracy", "val_loss"} <= set(history)
    assert "duq_error_code" not in history and "duq_error_code" not in out["logs"]
    assert np.all(np.isfinite(history["loss"]))
    assert out["reload_error"] < 1e-6
    assert 0.0 <= out["kernel_range"][0] <= out["kernel_range"][1] <= 1.0


@pytest.mark.slow
def test_fashion_mnist_example_runs_without_tensorflow(
    tmp_path, mnist_dir, fashion_mnist_dir
):
    # Where JAX is installed without TensorFlow, the loaders, the data
    # pipeline (`make_dataset`) and the OoD callback must work.
    out = run(
        "fashion_mnist_example.py",
        args=[str(mnist_dir), str(fashion_mnist_dir), str(tmp_path)],
        block_tensorflow=True,
    )
    assert not out["tensorflow"]
    assert out["pipeline"] == "_ArrayBatches"
    assert len(out["history"]["loss"]) == 2 and np.all(
        np.isfinite(out["history"]["loss"])
    )
    assert len(out["history"]["ood_auroc"]) == 2  # the OoD callback ran each epoch
    assert 0.0 <= out["accuracy"] <= 1.0 and 0.0 <= out["auroc"] <= 1.0


def test_bad_batches_raise_before_any_state_changes():
    out = run("bad_batches.py")
    expected = {
        "too_large": "class indices in",
        "negative": "class indices in",
        "fractional": "fractional",
        "nan_input": "NaN",
        "overflow": "non-finite",
    }
    for name, text in expected.items():
        assert out[name]["message"] and text in out[name]["message"], (name, out[name])
        assert out[name]["finite"], name
    assert out["unchanged"] and out["trains_on"]
    assert "fractional" in out["evaluate"]
    assert "NaN" in out["late"] and "NaN" in out["late_evaluate"]
    assert out["late_state"] == 0.0


@pytest.mark.parametrize("head", ["per_class", "shared"])
def test_data_parallel_matches_one_device(head):
    one = run("data_parallel.py", args=[head])
    two = run(
        "data_parallel.py",
        args=[head],
        extra_env={
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            "DUQ_DATA_PARALLEL": "1",
        },
    )
    assert one.keys() == two.keys()
    for name in one:
        np.testing.assert_allclose(
            two[name], one[name], rtol=1e-4, atol=1e-5, err_msg=name
        )

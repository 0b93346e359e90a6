"""keras_duq on Keras's JAX backend, checked in subprocesses (a process has one backend).

Each test runs a short script with `KERAS_BACKEND=jax`; the parity test also
runs the same training on TensorFlow and compares the two.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax  # noqa: F401  (part of the tests extra: fail loudly without it)
import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

_PRELUDE = """
import json, os, sys
import numpy as np
import keras
import keras_duq

def make_model(gradient_penalty=0.5, batch_norm=True, classes=3, momentum=0.9, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(4, 3)(inputs)
    if batch_norm:
        x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Flatten()(x)
    outputs = keras_duq.DUQOutput(classes, centroid_dims=6, length_scale=0.5, momentum=0.9)(x)
    model = keras_duq.DUQModel(inputs, outputs, gradient_penalty=gradient_penalty, **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=momentum))
    return model

def data(n=96, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = (np.abs(x.mean(axis=(1, 2, 3))) * 30).astype("int64") % classes
    return x, y

def state(model):
    return [v.numpy().copy() for v in model.weights]
"""


# After the prelude: any later `import tensorflow` fails, as where it is not installed.
_BLOCK_TENSORFLOW = """
import importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "tensorflow":
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
"""


def _run(script, backend="jax", extra_env=None, timeout=300, block_tensorflow=False):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    env.update(extra_env or {})
    prelude = _PRELUDE + (_BLOCK_TENSORFLOW if block_tensorflow else "")
    result = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)],
        capture_output=True, text=True, env=env, timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_imports_and_trains_without_tensorflow(tmp_path):
    out = _run(f"""
        model = make_model()
        x, y = data()
        history = model.fit(x, y, batch_size=32, epochs=2, verbose=0,
                            validation_data=(x, y),
                            callbacks=[keras.callbacks.EarlyStopping(patience=5)])
        logs = model.evaluate(x, y, verbose=0, return_dict=True)
        expected = model.predict(x[:8], verbose=0)
        path = {str(tmp_path / "model.keras")!r}
        model.save(path)
        reloaded = keras.saving.load_model(path)
        print(json.dumps(dict(
            history={{k: [float(v) for v in vs] for k, vs in history.history.items()}},
            logs={{k: float(v) for k, v in logs.items()}},
            reload_error=float(np.abs(reloaded.predict(x[:8], verbose=0) - expected).max()),
            kernel_range=[float(expected.min()), float(expected.max())],
            tensorflow=any(m.split(".")[0] == "tensorflow" for m in sys.modules),
        )))
    """, block_tensorflow=True)
    assert not out["tensorflow"]
    history = out["history"]
    assert {"loss", "bce", "gradient_penalty", "accuracy", "val_loss"} <= set(history)
    assert "duq_error_code" not in history and "duq_error_code" not in out["logs"]
    assert np.all(np.isfinite(history["loss"]))
    assert out["reload_error"] < 1e-6
    assert 0.0 <= out["kernel_range"][0] <= out["kernel_range"][1] <= 1.0


@pytest.mark.slow
def test_fashion_mnist_example_runs_without_tensorflow(tmp_path, mnist_dir, fashion_mnist_dir):
    # The GPU machine has JAX but no TensorFlow: the example's data pipeline
    # (`make_dataset`) and OoD callback must work without it.
    out = _run(f"""
        from reproduction import fashion_mnist
        pipeline = type(keras_duq.datasets.make_dataset(np.zeros((4, 2)), batch_size=2))
        results = fashion_mnist.main([
            "--epochs", "2", "--batch-size", "64", "--train-subset", "256",
            "--test-subset", "256", "--ood-eval-every", "1", "--verbose", "0",
            "--mnist-path", {str(mnist_dir)!r},
            "--fashion-mnist-path", {str(fashion_mnist_dir)!r},
            "--output-dir", {str(tmp_path)!r},
        ])
        print(json.dumps(dict(
            pipeline=pipeline.__name__,
            history=results["history"],
            accuracy=results["accuracy"],
            auroc=results["auroc"],
            tensorflow=any(m.split(".")[0] == "tensorflow" for m in sys.modules),
        )))
    """, block_tensorflow=True)
    assert not out["tensorflow"]
    assert out["pipeline"] == "_ArrayBatches"
    assert len(out["history"]["loss"]) == 2 and np.all(np.isfinite(out["history"]["loss"]))
    assert len(out["history"]["ood_auroc"]) == 2  # the OoD callback ran each epoch
    assert 0.0 <= out["accuracy"] <= 1.0 and 0.0 <= out["auroc"] <= 1.0
    assert (tmp_path / "results.json").is_file()


def test_bad_batches_raise_before_any_state_changes():
    out = _run("""
        model = make_model()
        x, y = data()
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        results = {}
        x_nan = x.copy(); x_nan[40, 2, 2, 0] = np.nan  # in the second batch
        cases = {
            "too_large": (x, y + 3), "negative": (x, y - 1),
            "fractional": (x, y + 0.5), "nan_input": (x_nan, y),
            "overflow": (x * 1e30, y),
        }
        for name, (xs, ys) in cases.items():
            before = state(model)
            try:
                model.fit(xs, ys, batch_size=32, epochs=1, verbose=0, shuffle=False)
                message = None
            except ValueError as error:
                message = str(error)
            after = state(model)
            # Batches before the bad one train; compare from the failed step on.
            results[name] = dict(
                message=message,
                finite=all(np.isfinite(a).all() for a in after),
            )
        # A bad batch in the first step changes nothing at all.
        before = state(model)
        try:
            model.fit(x, y + 3, batch_size=32, epochs=1, verbose=0)
        except ValueError:
            pass
        results["unchanged"] = all(np.array_equal(a, b) for a, b in zip(before, state(model)))
        try:
            model.evaluate(x, y + 0.5, verbose=0)
            results["evaluate"] = None
        except ValueError as error:
            results["evaluate"] = str(error)
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # still trains
        results["trains_on"] = not all(np.array_equal(a, b) for a, b in zip(before, state(model)))

        # The error code is read every few calls: a bad 4th batch of 20 must
        # still leave the model as 3 good steps leave it.
        x, y = data(n=640)
        x_bad = x.copy(); x_bad[100, 0, 0, 0] = np.nan
        clean = make_model()
        clean.fit(x[:96], y[:96], batch_size=32, epochs=1, verbose=0, shuffle=False)
        model = make_model()
        try:
            model.fit(x_bad, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
            results["late"] = None
        except ValueError as error:
            results["late"] = str(error)
        results["late_state"] = max(
            float(np.abs(a - b).max()) for a, b in zip(state(clean), state(model))
        )
        try:
            model.evaluate(x_bad, y, batch_size=32, verbose=0)
            results["late_evaluate"] = None
        except ValueError as error:
            results["late_evaluate"] = str(error)
        print(json.dumps(results))
    """)
    expected = {
        "too_large": "class indices in", "negative": "class indices in",
        "fractional": "fractional", "nan_input": "NaN", "overflow": "non-finite",
    }
    for name, text in expected.items():
        assert out[name]["message"] and text in out[name]["message"], (name, out[name])
        assert out[name]["finite"], name
    assert out["unchanged"] and out["trains_on"]
    assert "fractional" in out["evaluate"]
    assert "NaN" in out["late"] and "NaN" in out["late_evaluate"]
    assert out["late_state"] == 0.0


def test_tensorflow_and_jax_agree_after_three_steps(tmp_path):
    # Same initial weights (written by TensorFlow), same 3 batches, a CNN
    # with BatchNormalization, the penalty on and momentum SGD.
    script = """
        model = make_model()
        x, y = data()
        folder = sys.argv[1]
        if keras.backend.backend() == "tensorflow":
            model.save_weights(os.path.join(folder, "initial.weights.h5"))
            np.savez(os.path.join(folder, "initial.npz"), *state(model))
        model.load_weights(os.path.join(folder, "initial.weights.h5"))
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        np.savez(os.path.join(folder, keras.backend.backend() + ".npz"), *state(model))
        print(json.dumps({"names": [v.path for v in model.weights]}))
    """
    for backend in ("tensorflow", "jax"):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        result = subprocess.run(
            [sys.executable, "-c", _PRELUDE + textwrap.dedent(script), str(tmp_path)],
            capture_output=True, text=True, env=env, timeout=300,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        names = json.loads(result.stdout.strip().splitlines()[-1])["names"]
    values = {}
    for name in ("initial", "tensorflow", "jax"):
        with np.load(tmp_path / f"{name}.npz") as arrays:
            values[name] = [arrays[f"arr_{i}"] for i in range(len(names))]
    report, changed = [], 0
    for name, start, tf_value, jax_value in zip(
        names, values["initial"], values["tensorflow"], values["jax"]
    ):
        change = np.abs(tf_value - start).max()
        difference = np.abs(jax_value - tf_value).max()
        report.append((name, float(difference), float(change)))
        # The convolution's bias feeds BatchNormalization, which removes any
        # shift: its exact change is 0 (no weight decay at 0), so what moves
        # it is rounding, 1e-8 on either backend.
        changed += change > 1e-6
        assert difference <= max(1e-3 * change, 1e-6), report
    print("parity", report)
    assert changed >= 8, report  # conv kernel, BN (4), W, centroid counts and sums


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_lazy_penalty_is_the_scaled_penalty_on_every_kth_step_only(backend):
    # penalty_interval=2, lambda=0.5: step 0 is an exact step with lambda=1,
    # step 1 a step without the penalty (plain SGD, so no optimizer state).
    out = _run("""
        x, y = data(n=32)
        def trained(gradient_penalty, steps, start=None, **kwargs):
            model = make_model(gradient_penalty, momentum=0.0, **kwargs)
            if start is not None:
                model.set_weights(start)
            for _ in range(steps):
                history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
            model.logs = history.history
            return model
        def difference(a, b):
            return max(float(np.abs(u - v).max()) for u, v in zip(state(a), state(b)))
        lazy = trained(0.5, 1, penalty_interval=2)
        exact = trained(1.0, 1)
        after_first = lazy.get_weights()
        logged = lazy.logs["gradient_penalty"][0]
        lazy.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        plain = trained(0.0, 1, start=after_first)
        config = keras_duq.DUQModel.from_config(lazy.get_config())
        print(json.dumps({
            "penalised_step": difference(trained(0.5, 1, penalty_interval=2), exact),
            "plain_step": difference(lazy, plain),
            "moved": max(float(np.abs(a - b).max()) for a, b in zip(after_first, state(lazy))),
            "logged_penalty": logged,
            "interval": config.penalty_interval,
        }))
    """, backend=backend)
    assert out["penalised_step"] <= 1e-5 and out["plain_step"] <= 1e-5, out
    assert out["moved"] > 1e-3 and out["logged_penalty"] > 0, out
    assert out["interval"] == 2


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_trains(policy):
    out = _run(f"""
        keras.mixed_precision.set_global_policy({policy!r})
        model = make_model(gradient_penalty=1.0)
        x, y = data(n=128)
        history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
        kernels = model.predict(x, verbose=0)
        print(json.dumps(dict(
            loss=[float(v) for v in history.history["loss"]],
            loss_scale=isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer),
            dtype=str(kernels.dtype),
            finite=all(np.isfinite(v.numpy()).all() for v in model.weights),
        )))
    """)
    assert np.all(np.isfinite(out["loss"])) and out["finite"]
    assert out["loss"][-1] < out["loss"][0]
    assert out["dtype"] == "float32"
    assert out["loss_scale"] == (policy == "mixed_float16")


def test_data_parallel_matches_one_device():
    script = """
        import jax
        if os.environ.get("DUQ_DATA_PARALLEL"):
            assert len(jax.devices()) == 2
            keras.distribution.set_distribution(keras.distribution.DataParallel())
        model = make_model(gradient_penalty=0.5, batch_norm=False)
        x, y = data(n=128)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        print(json.dumps({v.path: v.numpy().tolist() for v in model.weights}))
    """
    one = _run(script)
    two = _run(
        script,
        extra_env={
            "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
            "DUQ_DATA_PARALLEL": "1",
        },
    )
    assert one.keys() == two.keys()
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-4, atol=1e-5, err_msg=name)

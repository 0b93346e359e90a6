"""What only the JAX backend has: TensorFlow-free runs, deferred error codes, DataParallel.

Each test runs a short script with `KERAS_BACKEND=jax` in a subprocess (a
process has one backend, and some of these need an environment set before
JAX starts); they run once, in the suite's JAX run.
"""

import numpy as np
import pytest
from backend_subprocess import run

pytestmark = pytest.mark.requires_backend("jax")


def test_imports_and_trains_without_tensorflow(tmp_path):
    out = run(
        f"""
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
    """,
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
    # The GPU machine has JAX but no TensorFlow: the example's data pipeline
    # (`make_dataset`) and OoD callback must work without it.
    out = run(
        f"""
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
    """,
        block_tensorflow=True,
    )
    assert not out["tensorflow"]
    assert out["pipeline"] == "_ArrayBatches"
    assert len(out["history"]["loss"]) == 2 and np.all(
        np.isfinite(out["history"]["loss"])
    )
    assert len(out["history"]["ood_auroc"]) == 2  # the OoD callback ran each epoch
    assert 0.0 <= out["accuracy"] <= 1.0 and 0.0 <= out["auroc"] <= 1.0
    assert (tmp_path / "results.json").is_file()


def test_bad_batches_raise_before_any_state_changes():
    out = run("""
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
        # still leave the model as 3 good steps leave it. A generator, so
        # that the batches reach the step (arrays are checked before it).
        x, y = data(n=640)
        x_bad = x.copy(); x_bad[100, 0, 0, 0] = np.nan
        clean = make_model()
        clean.fit(x[:96], y[:96], batch_size=32, epochs=1, verbose=0, shuffle=False)
        model = make_model()

        def batches(xs, ys):
            for start in range(0, len(xs), 32):
                yield xs[start : start + 32], ys[start : start + 32]

        try:
            model.fit(batches(x_bad, y), epochs=1, verbose=0)
            results["late"] = None
        except ValueError as error:
            results["late"] = str(error)
        results["late_state"] = max(
            float(np.abs(a - b).max()) for a, b in zip(state(clean), state(model))
        )
        try:
            model.evaluate(batches(x_bad, y), verbose=0)
            results["late_evaluate"] = None
        except ValueError as error:
            results["late_evaluate"] = str(error)
        print(json.dumps(results))
    """)
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
    script = f"""
        import jax
        if os.environ.get("DUQ_DATA_PARALLEL"):
            assert len(jax.devices()) == 2
            keras.distribution.set_distribution(keras.distribution.DataParallel())
        model = make_model(gradient_penalty=0.5, batch_norm=False, head="{head}")
        x, y = data(n=128)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        print(json.dumps({{v.path: v.numpy().tolist() for v in model.weights}}))
    """
    one = run(script)
    two = run(
        script,
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

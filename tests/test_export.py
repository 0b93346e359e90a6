"""DUQModel.export: the serving signature from each backend, `accept`, option checks, ONNX.

The tests that export are backend-neutral and run under the suite's backend
(`KERAS_BACKEND=jax python -m pytest -q tests/test_export.py` for JAX; CI runs
all three). Every SavedModel is loaded in a separate process that imports
TensorFlow only.
"""

import logging
import os
import subprocess
import sys
import warnings

import harness
import keras
import numpy as np
import pytest

import keras_duq
from keras_duq.evaluation import CertaintyCalibrator

BACKEND = keras.backend.backend()


def _serve_with_tf_only(tmp_path, exports):
    """`{path: {input name: array}}` -> (`{path: outputs}`, report), in a TF-only process."""
    arguments = []
    for path, inputs in exports.items():
        np.savez(f"{path}.in.npz", **inputs)
        arguments.append(f"{path}={path}.in.npz")
    # No KERAS_BACKEND: the script imports TensorFlow alone.
    report = harness.run("serve_with_tf_only.py", backend="tensorflow", args=arguments)
    assert report.pop("imported") == []
    outputs = {path: dict(np.load(f"{path}.out.npz")) for path in exports}
    return outputs, report


_data = harness.tabular_data


def _model(inputs=None, head="auto"):
    """A small DUQ model with BatchNormalization; `inputs`: a single, dict or list input."""

    def layers():
        return [
            keras.layers.Dense(8, activation="relu"),
            keras.layers.BatchNormalization(),
        ]

    return harness.dense_model(
        layers, inputs=inputs, head=head, momentum=0.999, gradient_penalty=0.0
    )


def _trained_model():
    model = _model()
    x, y = _data()
    if BACKEND in (
        "tensorflow",
        "jax",
    ):  # training elsewhere is not this file's concern
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        model.fit(x, y, epochs=1, verbose=0)
    return model, x, y


# ------------------------------------------------- the serving signature


@pytest.mark.requires_backend("tensorflow", "jax")  # PyTorch: no SavedModel
def test_export_matches_predict_loaded_with_tensorflow_alone(tmp_path):
    model, x, y = _trained_model()
    kernel_values = model.predict(x, verbose=0)
    calibrator = CertaintyCalibrator().fit(
        kernel_values, kernel_values.argmax(axis=1) == y
    )
    x = x[:9].copy()
    expected = kernel_values[:9].copy()
    # The median certainty itself: `>=` is tested at equality too.
    threshold = float(np.median(expected.max(axis=1)))
    x[4, 0] = np.nan  # a row that must never be accepted
    expected[4] = np.nan
    path = str(tmp_path / "savedmodel")
    model.export(path, certainty_threshold=threshold, calibrator=calibrator)
    exports = {path: {"inputs": x}}

    # Multi-input models: the signature's input names.
    x2, input_names, expected2 = x[:, :3], {}, {}
    for kind in ("dict", "list"):
        a, b = keras.Input((2,), name="a"), keras.Input((1,), name="b")
        # The list-input model has the shared head: it exports the same way.
        other = _model(
            {"a": a, "b": b} if kind == "dict" else [a, b],
            head="per_class" if kind == "dict" else "shared",
        )
        arrays = {"a": x2[:, :2], "b": x2[:, 2:]}
        input_names[kind] = ["a", "b"] if kind == "dict" else ["inputs_0", "inputs_1"]
        other.export(str(tmp_path / kind))
        exports[str(tmp_path / kind)] = dict(zip(input_names[kind], arrays.values()))
        batch = arrays if kind == "dict" else list(arrays.values())
        expected2[kind] = other.predict(batch, verbose=0)

    # The top two classes and their kernel values in place of all of them.
    top_path = str(tmp_path / "top_k")
    model.export(top_path, top_k=2)
    exports[top_path] = {"inputs": x}

    outputs, report = _serve_with_tf_only(tmp_path, exports)
    top = outputs[top_path]
    assert set(top) == {
        "top_k_classes",
        "top_k_kernel_values",
        "predictions",
        "certainty",
    }
    assert top["top_k_classes"].dtype == np.int64
    finite_rows = np.arange(len(x)) != 4
    np.testing.assert_array_equal(
        top["top_k_classes"][finite_rows, 0], expected[finite_rows].argmax(axis=1)
    )
    np.testing.assert_allclose(
        top["top_k_kernel_values"][finite_rows],
        -np.sort(-expected[finite_rows], axis=1)[:, :2],
        rtol=1e-4,
        atol=1e-7,
    )
    assert np.isnan(top["top_k_kernel_values"][4]).all()
    served = outputs[path]
    assert report[path]["inputs"] == ["inputs"]
    assert report[path]["dtypes"] == {
        "kernel_values": "float32",
        "predictions": "int64",
        "certainty": "float32",
        "accept": "bool",
        "probability_correct": "float32",
    }
    # jax2tf computes in XLA, not in JAX's own kernels: not bit-identical.
    tolerance = 0.0 if BACKEND == "tensorflow" else 1e-4
    np.testing.assert_allclose(
        served["kernel_values"], expected, rtol=tolerance, atol=1e-7
    )
    np.testing.assert_allclose(
        served["certainty"], expected.max(axis=1), rtol=tolerance, atol=1e-7
    )
    finite = np.arange(len(x)) != 4
    np.testing.assert_array_equal(
        served["predictions"][finite], expected[finite].argmax(axis=1)
    )
    assert np.isnan(served["certainty"][4]) and not served["accept"][4]
    np.testing.assert_array_equal(
        served["accept"], served["certainty"] >= np.float32(threshold)
    )
    assert 0 < served["accept"].sum() < len(x)
    np.testing.assert_allclose(
        served["probability_correct"][finite],
        calibrator(served["kernel_values"][finite]),
        rtol=1e-6,
        atol=1e-7,
    )
    for kind, names in input_names.items():
        kind_path = str(tmp_path / kind)
        assert report[kind_path]["inputs"] == names
        np.testing.assert_allclose(
            outputs[kind_path]["kernel_values"],
            expected2[kind],
            rtol=tolerance,
            atol=1e-7,
        )


@pytest.mark.requires_backend("tensorflow")  # TF Serving's client needs TensorFlow
def test_a_tf_serving_request_built_with_the_client_package_runs_the_signature(
    tmp_path,
):
    """The gRPC request of docs/guide/serving.md, built with `tensorflow-serving-api`,
    names a signature and input that the export has, and its response tensors
    decode to `predict`'s outputs (the server itself cannot be installed here:
    the signature runs in its place, on the request's own bytes)."""
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    model, x, _ = _trained_model()
    kernel_values = model.predict(x, verbose=0)
    threshold = float(np.median(kernel_values.max(axis=1)))
    path = str(tmp_path / "duq" / "1")  # TF Serving's numbered version folder
    model.export(path, certainty_threshold=threshold)

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "duq"
    request.model_spec.signature_name = "serving_default"
    request.inputs["inputs"].CopyFrom(tf.make_tensor_proto(x))
    received = predict_pb2.PredictRequest.FromString(request.SerializeToString())

    signature = tf.saved_model.load(path).signatures[received.model_spec.signature_name]
    outputs = signature(
        **{
            name: tf.constant(tf.make_ndarray(tensor))
            for name, tensor in received.inputs.items()
        }
    )
    response = predict_pb2.PredictResponse()
    for name, value in outputs.items():
        response.outputs[name].CopyFrom(tf.make_tensor_proto(value))

    certainty = tf.make_ndarray(response.outputs["certainty"])
    np.testing.assert_allclose(certainty, kernel_values.max(axis=1), rtol=1e-5)
    np.testing.assert_array_equal(
        tf.make_ndarray(response.outputs["accept"]), certainty >= threshold
    )
    np.testing.assert_array_equal(
        tf.make_ndarray(response.outputs["predictions"]), kernel_values.argmax(axis=1)
    )


@pytest.mark.requires_backend("tensorflow")  # saved_model_cli reads the TF export
def test_export_signature_shapes_and_quiet_export(tmp_path, capfd):
    for _ in range(2):  # Keras numbers its input names per model built
        model = _model()
    path = str(tmp_path / "savedmodel")
    capfd.readouterr()
    model.export(path, certainty_threshold=0.5)
    printed = capfd.readouterr().out
    assert len(printed.splitlines()) <= 2, printed

    cli_path = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")
    cli = subprocess.run(
        [
            cli_path if os.path.exists(cli_path) else "saved_model_cli",
            "show",
            "--dir",
            path,
            "--all",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    serving = cli[cli.index("signature_def['serving_default']") :]
    for name in ("kernel_values", "predictions", "certainty", "accept"):
        assert f"outputs['{name}']" in serving
    assert "inputs['inputs']" in serving
    assert "shape: (-1, 4)" in serving and "shape: (-1, 3)" in serving

    import tensorflow as tf

    own = str(tmp_path / "own_signature")
    model.export(
        own,
        input_signature=[
            keras.InputSpec(shape=(None, 4), dtype="float32", name="features")
        ],
    )
    serve = tf.saved_model.load(own).signatures["serving_default"]
    assert list(serve.structured_input_signature[1]) == ["features"]


# ---------------------------------------------------------- PyTorch


@pytest.mark.requires_backend("torch")
def test_export_on_torch_says_how(tmp_path):
    model = _model()
    path = tmp_path / "savedmodel"
    with pytest.raises(
        ValueError, match=r"model\.save\('duq\.keras'\).*KERAS_BACKEND=tensorflow"
    ):
        model.export(str(path))
    assert not path.exists()


# -------------------------------------------------- options are checked


def test_export_without_its_packages_names_the_extra(tmp_path, monkeypatch):
    """A format whose packages are missing: an ImportError naming the extra, nothing written."""
    import importlib.util

    find_spec = importlib.util.find_spec

    def without_onnx(name, *args):
        return (
            None
            if name.split(".")[0] in ("onnx", "tf2onnx")
            else find_spec(name, *args)
        )

    monkeypatch.setattr(importlib.util, "find_spec", without_onnx)
    model = _model()
    path = tmp_path / "duq.onnx"
    with pytest.raises(ImportError, match=r'pip install "keras-duq\[export\]"'):
        model.export(str(path), format="onnx")
    assert not path.exists()


@pytest.mark.requires_backend("torch")
def test_litert_from_torch_without_litert_torch_says_how(tmp_path, monkeypatch):
    """litert-torch is not in the `export` extra: the error says where to install it."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "litert_torch" else find_spec(name, *args),
    )
    path = tmp_path / "duq.tflite"
    with pytest.raises(ImportError, match=r"pip install litert-torch.*of its own"):
        _model().export(str(path), format="litert")
    assert not path.exists()


@pytest.mark.requires_backend("tensorflow", "jax")  # PyTorch: no SavedModel
def test_export_unknown_option_is_an_error(tmp_path):
    model = _model()
    path = tmp_path / "savedmodel"
    with pytest.raises(ValueError, match=r"Received: `some_unknown_option=1`"):
        model.export(str(path), some_unknown_option=1)
    assert not path.exists()


@pytest.mark.parametrize("threshold", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_export_threshold_is_checked_before_writing(tmp_path, threshold):
    model = _model()
    path = tmp_path / "savedmodel"
    with pytest.raises(
        ValueError, match=r"float in \[0, 1\].*Received: `certainty_threshold="
    ):
        model.export(str(path), certainty_threshold=threshold)
    assert not path.exists()


@pytest.mark.parametrize("top_k", [0, 4, 1.5, True])
def test_export_top_k_is_checked_before_writing(tmp_path, top_k):
    model = _model()  # 3 classes
    path = tmp_path / "savedmodel"
    with pytest.raises(ValueError, match=r"int in \[1, 3\].*Received: `top_k="):
        model.export(str(path), top_k=top_k)
    assert not path.exists()


def test_export_refuses_an_unfitted_calibrator(tmp_path):
    model = _model()
    path = tmp_path / "savedmodel"
    with pytest.raises(ValueError, match=r"fitted.*Received: `calibrator="):
        model.export(str(path), calibrator=CertaintyCalibrator())
    assert not path.exists()


# PyTorch writes every format but the SavedModel, whose error has its own test.
@pytest.mark.requires_backend("tensorflow", "jax")
def test_a_format_this_backend_does_not_write_says_what_works(tmp_path):
    from keras_duq._export import SERVING_FORMATS

    format = next(f for f in ("torch", "litert") if f not in SERVING_FORMATS[BACKEND])
    model = _model()
    path = tmp_path / f"duq.{format}"
    with pytest.raises(
        ValueError, match=r"is not supported on the .* backend"
    ) as error:
        model.export(str(path), format=format, certainty_threshold=0.5)
    message = str(error.value)
    assert all(repr(name) in message for name in SERVING_FORMATS[BACKEND])
    assert "KERAS_BACKEND=" in message and "model.save('duq.keras')" in message
    assert not path.exists()


@pytest.mark.requires_backend("jax")
def test_an_onnx_file_from_jax_that_does_not_run_is_an_error(tmp_path):
    """No file that fails only in the server: the export runs it once."""
    pytest.importorskip("jax2onnx")
    import onnxruntime

    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(4, 3)(inputs)
    x = keras.layers.MaxPooling2D()(x)  # the layer jax2onnx 0.17 mistranslates
    backbone = keras.Model(inputs, keras.layers.Flatten()(x))
    model = keras_duq.wrap(backbone, num_classes=3)
    path = tmp_path / "duq.onnx"
    x = np.random.default_rng(0).normal(size=(4, 8, 8, 1)).astype("float32")
    try:
        model.export(str(path), format="onnx")
    except ValueError as error:
        assert "onnxruntime cannot run" in str(error)
        assert "KERAS_BACKEND=tensorflow" in str(error)
        assert not path.exists()
        return
    # A jax2onnx that writes this model correctly: the file serves it.
    session = onnxruntime.InferenceSession(str(path))
    names = [output.name for output in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, {"inputs": x})))
    np.testing.assert_allclose(
        outputs["certainty"],
        model.predict(x, verbose=0).max(axis=1),
        rtol=1e-5,
        atol=1e-7,
    )


# ------------------------------- the other formats, each in its own runtime


def _served_formats():
    from keras_duq._export import SERVING_FORMATS

    return [f for f in SERVING_FORMATS[BACKEND] if f != "tf_saved_model"]


_SUFFIX = {"onnx": ".onnx", "litert": ".tflite", "openvino": ".xml", "torch": ".pt2"}


def _serve(format, path, x):
    """The outputs of the export at `path` for `x`, from the format's own runtime."""
    if format == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(path)
        assert [i.name for i in session.get_inputs()] == ["inputs"]
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(None, {"inputs": x})))
    if format == "litert":
        from ai_edge_litert.interpreter import Interpreter

        return Interpreter(model_path=path).get_signature_runner()(inputs=x)
    if format == "openvino":
        import openvino

        # Without the hint OpenVINO may compute in bfloat16 on CPUs that have it.
        compiled = openvino.Core().compile_model(
            path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
        )
        assert "inputs" in compiled.input(0).get_names()
        results = compiled(x)
        return {o.get_any_name(): results[o] for o in compiled.outputs}
    import torch

    module = torch.export.load(path).module()
    return {k: v.detach().numpy() for k, v in module(torch.from_numpy(x)).items()}


_RUNTIME_PACKAGES = {
    "onnx": ("onnxruntime",),
    # From PyTorch, also the converter: litert-torch, which CI installs in a
    # virtual environment of its own (its pins conflict with the `export`
    # extra's), where this test runs with `-k litert`.
    "litert": ("ai_edge_litert",) + (("litert_torch",) if BACKEND == "torch" else ()),
    "openvino": ("openvino",),
    "torch": ("torch",),
}


def _export(model, path, format, batch_size, **options):
    """`model.export`; a LiteRT file from PyTorch has a fixed batch size: `batch_size`."""
    if format == "litert" and BACKEND == "torch":
        spec = keras.InputSpec(shape=(batch_size, 4), dtype="float32", name="inputs")
        options["input_signature"] = [spec]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.export(path, format=format, **options)
    # What a user's script prints: Python hides deprecation, import and
    # resource warnings raised outside `__main__`.
    hidden = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
    shown = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if not issubclass(w.category, hidden) and not _explained_in_serving_guide(w)
    ]
    assert shown == [], shown


def _explained_in_serving_guide(warning):
    """The warning docs/guide/serving.md explains: `import openvino` sends
    OpenVINO's telemetry from a forked process, and JAX warns about forks."""
    return (
        BACKEND == "jax"
        and issubclass(warning.category, RuntimeWarning)
        and "os.fork()" in str(warning.message)
    )


@pytest.mark.parametrize("precision", ["float32", "mixed_float16"])
@pytest.mark.parametrize("format", _served_formats())
def test_each_format_serves_the_duq_outputs_in_its_runtime(tmp_path, format, precision):
    """Certainty to 1e-5 of `predict` (float32), `accept` = certainty >= t, a NaN row
    refused; the export shows no warning the serving guide does not explain."""
    for package in _RUNTIME_PACKAGES[format]:
        pytest.importorskip(package)  # the `export` extra installs them
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        model, x, y = _trained_model()
    finally:
        keras.config.set_dtype_policy(previous)
    x = np.random.default_rng(1).normal(size=(256, 4)).astype("float32")
    kernel_values = model.predict(x, verbose=0)
    calibrator = CertaintyCalibrator().fit(
        kernel_values,
        kernel_values.argmax(axis=1) == np.random.default_rng(2).integers(0, 3, 256),
    )
    threshold = float(np.median(kernel_values.max(axis=1)))
    path = str(tmp_path / f"duq{_SUFFIX[format]}")
    if format == "litert" and precision != "float32":
        with pytest.raises(ValueError, match=r"float32.*set_dtype_policy"):
            model.export(path, format=format, certainty_threshold=threshold)
        assert not os.path.exists(path)
        # The way out the error names: a float32 copy of the same model.
        model32 = _model()  # built under the float32 policy
        model32.set_weights(model.get_weights())
        _export(model32, path, format, len(x), certainty_threshold=threshold)
        served = _serve(format, path, x)
        np.testing.assert_allclose(
            np.log(served["kernel_values"]), np.log(kernel_values), rtol=2e-3, atol=2e-2
        )
        return
    options = {"certainty_threshold": threshold, "calibrator": calibrator}
    _export(model, path, format, len(x), **options)

    x[4, 0] = np.nan  # a row that must never be accepted
    finite = np.arange(len(x)) != 4
    # float16 has 11 significant bits, and runtimes round its intermediates
    # at other points: their squared distances differ by a few of its units,
    # so log kernel values (minus a scaled squared distance) differ by about
    # 1e-3 of themselves (measured: up to 8e-4 relative, 3e-2 absolute with
    # onnxruntime and OpenVINO; 1e-5 in float32).
    rtol = 1e-5 if precision == "float32" else 2e-2
    # Batch sizes 256 (the NaN row among them), 1, and 1 that is the NaN row.
    paths = {len(x): path, 1: path}
    if format == "litert" and BACKEND == "torch":  # one file per batch size
        paths[1] = str(tmp_path / "duq_1.tflite")
        _export(model, paths[1], format, 1, **options)
    for rows in (np.arange(len(x)), np.array([0]), np.array([4])):
        served = _serve(format, paths[len(rows)], x[rows])
        expected, finite_rows = kernel_values[rows], finite[rows]
        assert sorted(served) == [
            "accept",
            "certainty",
            "kernel_values",
            "predictions",
            "probability_correct",
        ]
        assert served["accept"].dtype == np.bool_
        assert served["certainty"].dtype == np.float32
        assert served["predictions"].dtype == np.int64, served["predictions"].dtype
        ok = finite_rows
        if precision == "float32":
            np.testing.assert_allclose(
                served["kernel_values"][ok], expected[ok], rtol=rtol, atol=1e-7
            )
        else:
            # Relative to the log (a squared distance, rounded at float16's
            # 1e-3) and absolute near zero.
            np.testing.assert_allclose(
                np.log(served["kernel_values"][ok]),
                np.log(expected[ok]),
                rtol=2e-3,
                atol=rtol,
            )
        np.testing.assert_allclose(
            served["certainty"][ok], expected[ok].max(axis=1), rtol=rtol, atol=1e-7
        )
        # Rows whose top two kernel values are closer than the tolerance may
        # swap places between runtimes.
        top_two = -np.sort(-expected, axis=1)[:, :2]
        clear = ok & (top_two[:, 0] - top_two[:, 1] > 4 * rtol * top_two[:, 0])
        np.testing.assert_array_equal(
            served["predictions"][clear], expected[clear].argmax(axis=1)
        )
        np.testing.assert_array_equal(
            served["accept"], ok & (served["certainty"] >= np.float32(threshold))
        )
        np.testing.assert_allclose(
            served["probability_correct"][ok],
            calibrator(served["kernel_values"][ok]),
            rtol=1e-5,
            atol=1e-6,
        )
        assert np.isnan(served["certainty"][~ok]).all()
        assert np.isnan(served["kernel_values"][~ok]).all()
        assert np.isnan(served["probability_correct"][~ok]).all()
        if len(rows) == len(x):  # the median threshold accepts about half
            assert len(x) / 4 < served["accept"].sum() < 3 * len(x) / 4


@pytest.mark.parametrize(
    "format, name, match",
    [
        ("openvino", "model.bin", r"ending in '\.xml'"),
        ("openvino", "model", r"ending in '\.xml'"),
        pytest.param(
            "tf_saved_model",
            "a_file",
            "a file exists",
            marks=pytest.mark.requires_backend("tensorflow", "jax"),
        ),
    ],
)
def test_export_paths_the_format_cannot_write_fail_before_conversion(
    tmp_path, format, name, match
):
    model = _model()
    path = tmp_path / name
    if format == "tf_saved_model":
        path.write_text("not a SavedModel")
    with pytest.raises(ValueError, match=match):
        model.export(str(path), format=format)
    assert sorted(p.name for p in tmp_path.iterdir()) == (
        ["a_file"] if format == "tf_saved_model" else []
    )


@pytest.mark.requires_backend("jax")
def test_a_jax_saved_model_loads_without_a_gradient_warning(tmp_path, caplog):
    import tensorflow as tf

    model, x, _ = _trained_model()
    path = str(tmp_path / "duq")
    model.export(path, format="tf_saved_model")
    with caplog.at_level(logging.WARNING):
        loaded = tf.saved_model.load(path)
    assert not [r for r in caplog.records if "custom gradients" in r.getMessage()]
    served = loaded.signatures["serving_default"](inputs=tf.constant(x[:4]))
    np.testing.assert_allclose(
        served["kernel_values"].numpy(),
        model.predict(x[:4], verbose=0),
        rtol=1e-4,
        atol=1e-7,
    )



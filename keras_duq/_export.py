"""SavedModel export of a DUQ model for TF Serving, from TensorFlow or JAX.

The serving outputs are computed with `keras.ops` (`serving_outputs`), so
one function serves both backends: Keras's `ExportArchive` turns it into a
`tf.function` (traced on TensorFlow, converted with `jax2tf` on JAX), and a
thin TensorFlow wrapper fixes the output dtypes, since JAX without x64 has
no int64 for `predictions`.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
from typing import TYPE_CHECKING
from typing import Any

import keras
from keras import ops

from keras_duq._trainer import nan_for_non_finite_inputs
from keras_duq._typing import Tensor

if TYPE_CHECKING:
    from keras_duq._duq_model import DUQModel
    from keras_duq.evaluation import CertaintyCalibrator

# The serving signature's input key for a single-input model. Requests use
# it (`{"inputs": ...}` in TF Serving's columnar format); the row format
# `{"instances": [...]}` needs no key at all.
SINGLE_INPUT_NAME = "inputs"

# Backends whose `ExportArchive` can serve a function of our own (not only
# the model's `call`); PyTorch's needs `torch_xla` and serves `call` only.
SAVED_MODEL_BACKENDS = ("tensorflow", "jax")

# Options of Keras's own `tf_saved_model` export that apply here, by backend.
_BACKEND_OPTIONS = {"jax": ("is_static", "jax2tf_kwargs")}

_TORCH_MESSAGE = (
    "`DUQModel.export(format='tf_saved_model')` is not supported on the "
    "PyTorch backend: Keras exports a PyTorch model to a SavedModel only "
    "through `torch_xla`, with a fixed batch size, and only its `call` (the "
    "kernel values), not the DUQ serving signature. Save the model with "
    "`model.save('duq.keras')`, load it in a process started with "
    "`KERAS_BACKEND=tensorflow` (or `jax`) with "
    "`keras.models.load_model('duq.keras')`, and call `export` there; or "
    "export the kernel values alone with `format='onnx'` (its packages: "
    "`pip install \"keras-duq[export]\"`). Received: backend 'torch'"
)

# The modules each export format needs, by backend (`None`: any backend).
_FORMAT_MODULES = {
    "tf_saved_model": {None: ("tensorflow",)},
    "onnx": {"torch": ("onnx", "onnxscript"), None: ("tensorflow", "onnx", "tf2onnx")},
    "openvino": {None: ("openvino",)},
    "litert": {None: ("tensorflow",)},
}


def check_format_packages(format: str) -> None:
    """Raises an `ImportError` naming the extra to install when `format` cannot be written.

    Called before anything is traced or written.
    """
    import importlib.util

    by_backend = _FORMAT_MODULES.get(format)
    if by_backend is None:
        return  # Keras reports an unknown format itself.
    backend = keras.backend.backend()
    modules = by_backend.get(backend, by_backend[None])

    def installed(name):
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    missing = [name for name in modules if not installed(name)]
    if missing:
        raise ImportError(
            f"`export(format={format!r})` on the {backend} backend needs the "
            f"package(s) {', '.join(missing)}, which are not installed. Install "
            'them with `pip install "keras-duq[export]"` (or `pip install '
            f"{' '.join(missing)}`). Received: `format={format!r}`"
        )


def check_export_options(
    certainty_threshold: Any,
    calibrator: Any,
    options: dict[str, Any],
    top_k: Any,
    num_classes: int,
) -> None:
    """Raises a `ValueError` for an option `export_saved_model` cannot use.

    Called before anything is traced or written.
    """
    backend = keras.backend.backend()
    allowed = _BACKEND_OPTIONS.get(backend, ())
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        received = ", ".join(f"`{name}={options[name]!r}`" for name in unknown)
        passed_on = (
            f"takes {', '.join(f'`{name}`' for name in allowed)} besides its own arguments"
            if allowed
            else "takes only its own arguments"
        )
        raise ValueError(
            f"Unknown keyword argument(s) for `DUQModel.export`: with "
            f"`format='tf_saved_model'` on the {backend} backend it {passed_on}. "
            f"Remove them or check their spelling. Received: {received}"
        )
    if certainty_threshold is not None and (
        isinstance(certainty_threshold, bool)
        or not isinstance(certainty_threshold, (int, float))
        or not 0.0 <= certainty_threshold <= 1.0
    ):
        raise ValueError(
            "Expected `certainty_threshold` to be a float in [0, 1] (a kernel "
            "value: `accept` is `certainty >= certainty_threshold`), or `None` "
            "for no `accept` output. Received: "
            f"`certainty_threshold={certainty_threshold!r}`"
        )
    if calibrator is not None and (
        not callable(calibrator) or getattr(calibrator, "fitted", True) is False
    ):
        raise ValueError(
            "Expected `calibrator` to be a fitted "
            "`keras_duq.evaluation.CertaintyCalibrator` (call its `fit` on "
            "validation certainty and correctness first), or `None`. "
            f"Received: `calibrator={calibrator!r}`"
        )
    if top_k is not None and (
        isinstance(top_k, bool)
        or not isinstance(top_k, int)
        or not 1 <= top_k <= num_classes
    ):
        raise ValueError(
            f"Expected `top_k` to be an int in [1, {num_classes}] (the number "
            "of classes served per example), or `None` to serve every kernel "
            f"value. Received: `top_k={top_k!r}`"
        )
    if backend not in SAVED_MODEL_BACKENDS:
        raise ValueError(
            _TORCH_MESSAGE
            if backend == "torch"
            else "`DUQModel.export` writes a SavedModel from the TensorFlow or "
            f"JAX backend. Received: backend {backend!r}"
        )


def check_no_serving_options(
    format: str, certainty_threshold: Any, calibrator: Any, top_k: Any = None
) -> None:
    """Raises a `ValueError` when a DUQ serving option meets another format."""
    given = {
        name: value
        for name, value in (
            ("certainty_threshold", certainty_threshold),
            ("calibrator", calibrator),
            ("top_k", top_k),
        )
        if value is not None
    }
    if given:
        received = ", ".join(f"`{name}={value!r}`" for name, value in given.items())
        raise ValueError(
            f"{' and '.join(f'`{name}`' for name in given)}: the outputs these "
            "add to the DUQ serving signature are written only with "
            f"`format='tf_saved_model'`; `format={format!r}` exports the "
            "model's `call` (the kernel values). Export with `format='tf_saved_model'`, or "
            f"compare the certainty with the threshold yourself. Received: {received}"
        )


def serving_outputs(
    model: DUQModel,
    inputs: Any,
    certainty_threshold: float | None = None,
    calibrator: CertaintyCalibrator | None = None,
    top_k: int | None = None,
) -> dict[str, Tensor]:
    """The serving signature's outputs, with `keras.ops` (any backend).

    Returns a dict: `kernel_values` (or, with `top_k`, `top_k_classes` and
    `top_k_kernel_values`), `predictions` (argmax of the log kernel values),
    `certainty` (their max), `accept` when `certainty_threshold` is given
    and `probability_correct` when `calibrator` is.
    """
    features = model.feature_extractor(inputs, training=False)
    log_kernel = model.duq_output.log_kernel_values(features)
    # NaN where an input row is not finite: its certainty is NaN, its
    # `accept` False.
    log_kernel = nan_for_non_finite_inputs(inputs, log_kernel)
    kernel_values = ops.exp(log_kernel)
    certainty = ops.max(kernel_values, axis=-1)
    outputs = {
        "kernel_values": kernel_values,
        # From log K: far inputs underflow every K to 0, not log K.
        "predictions": ops.argmax(log_kernel, axis=-1),
        "certainty": certainty,
    }
    if top_k is not None:
        del outputs["kernel_values"]
        top_log_kernel, outputs["top_k_classes"] = _top_k(log_kernel, top_k)
        outputs["top_k_kernel_values"] = ops.exp(top_log_kernel)
    if certainty_threshold is not None:
        # The threshold is compared in float32, the certainty's dtype.
        outputs["accept"] = ops.greater_equal(
            certainty, ops.cast(certainty_threshold, certainty.dtype)
        )
    if calibrator is not None:
        outputs["probability_correct"] = ops.cast(calibrator(certainty), "float32")
    return outputs


def _top_k(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`(top values, their indices)` along the last axis, largest first."""
    if keras.backend.backend() != "jax":
        return ops.top_k(values, k)
    # JAX lowers `top_k` to a StableHLO composite that TensorFlow's XLA
    # cannot load from a jax2tf SavedModel; a sort exports everywhere.
    indices = ops.argsort(-values, axis=-1)[:, :k]
    return ops.take_along_axis(values, indices, axis=-1), indices


def export_saved_model(
    model: DUQModel,
    filepath: str | os.PathLike,
    verbose: bool = False,
    input_signature: list[Any] | None = None,
    certainty_threshold: float | None = None,
    calibrator: CertaintyCalibrator | None = None,
    top_k: int | None = None,
    **options: Any,
) -> None:
    """Writes `model` as a SavedModel whose `serving_default` gives DUQ outputs.

    `options` are Keras's backend options (`is_static`, `jax2tf_kwargs` on
    JAX); `check_export_options` must have accepted them.
    """
    import tensorflow as tf

    if input_signature is None:
        input_signature = [serving_input_signature(model.feature_extractor.input)]
    else:  # `keras.InputSpec`s too, as Keras's own export takes them.
        input_signature = tf.nest.map_structure(
            lambda spec: (
                spec
                if isinstance(spec, tf.TensorSpec)
                else tf.TensorSpec(
                    spec.shape, spec.dtype, name=getattr(spec, "name", None)
                )
            ),
            input_signature,
        )

    def outputs_fn(inputs: Any) -> dict[str, Tensor]:
        return serving_outputs(model, inputs, certainty_threshold, calibrator, top_k)

    # This archive only converts `outputs_fn` to a `tf.function`; the
    # SavedModel is written by the second one, with the dtypes fixed.
    converter = keras.export.ExportArchive()
    converter.track(model)
    converted = converter.add_endpoint(
        "outputs", outputs_fn, input_signature, **options
    )

    dtypes = {"predictions": tf.int64, "top_k_classes": tf.int64, "accept": tf.bool}

    @tf.function(input_signature=input_signature, autograph=False)
    def serve(inputs: Any) -> dict[str, tf.Tensor]:
        outputs = {
            name: tf.cast(value, dtypes.get(name, tf.float32))
            for name, value in converted(inputs).items()
        }
        return _refuse_non_finite_rows(inputs, outputs)

    serve.get_concrete_function()
    archive = keras.export.ExportArchive()
    # Keras saves the variables that `serve` captures (on JAX, the
    # converter's `tf.Variable` copies of the model's).
    archive.add_endpoint("serve", serve)
    if "verbose" in inspect.signature(archive.write_out).parameters:
        archive.write_out(filepath, verbose=bool(verbose))
    elif verbose:
        archive.write_out(filepath)
    else:  # Keras < 3.6 takes no `verbose` and always prints the summary.
        with contextlib.redirect_stdout(io.StringIO()):
            archive.write_out(filepath)


def _refuse_non_finite_rows(inputs: Any, outputs: dict[str, Any]) -> dict[str, Any]:
    """NaN outputs and `accept` False for rows whose float inputs are not finite.

    `serving_outputs` does the same with Keras ops; this repeats it with
    TensorFlow's own kernels around the converted function, because XLA
    (which runs a function converted from JAX) may assume finite values and
    drop the check.
    """
    import tensorflow as tf

    checks = [
        tf.reduce_all(tf.math.is_finite(tf.reshape(t, (tf.shape(t)[0], -1))), axis=1)
        for t in tf.nest.flatten(inputs)
        if t.dtype.is_floating
    ]
    if not checks:
        return outputs
    finite = tf.reduce_all(tf.stack(checks), axis=0)
    masked = {}
    for name, value in outputs.items():
        if value.dtype == tf.bool:
            masked[name] = tf.logical_and(value, finite)
        elif value.dtype.is_floating:
            shape = tf.concat(
                [tf.shape(finite), tf.ones([tf.rank(value) - 1], tf.int32)], 0
            )
            masked[name] = tf.where(
                tf.reshape(finite, shape), value, tf.constant(float("nan"), value.dtype)
            )
        else:
            masked[name] = value
    return masked


def serving_input_signature(inputs: Any, spec_type: str = "tf") -> Any:
    """Input specs with stable names and a free batch dimension.

    One input is named `"inputs"`; a dict of inputs keeps its keys; a list
    gets `"inputs_0"`, `"inputs_1"`, ...: Keras's own input names depend on
    how many models were built before (`input_layer_3`), so they cannot be
    documented. `spec_type`: `"tf"` for `tf.TensorSpec`s (the SavedModel's
    `tf.function`), `"keras"` for `keras.InputSpec`s (Keras's exporters
    on any backend).
    """
    if spec_type == "tf":
        import tensorflow as tf

        make_spec = tf.TensorSpec
    else:
        make_spec = keras.InputSpec

    def spec(tensor: Any, name: str) -> tf.TensorSpec | keras.InputSpec:
        shape = (None,) + tuple(tensor.shape[1:])
        return make_spec(shape=shape, dtype=tensor.dtype, name=name)

    if isinstance(inputs, dict):
        return {key: spec(tensor, key) for key, tensor in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        if len(inputs) == 1:
            return [spec(inputs[0], SINGLE_INPUT_NAME)]
        return [
            spec(tensor, f"{SINGLE_INPUT_NAME}_{index}")
            for index, tensor in enumerate(inputs)
        ]
    return spec(inputs, SINGLE_INPUT_NAME)

"""Export of a DUQ model with its serving outputs, in every format Keras writes.

The outputs are `_serving.serving_outputs`. The SavedModel (TensorFlow or
JAX) wraps them in a `tf.function` whose output dtypes are fixed (JAX without
x64 has no int64); the other formats export `_serving.DUQServingModel` with
Keras's own exporter. `SERVING_FORMATS` lists the formats by backend.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import warnings
from typing import TYPE_CHECKING
from typing import Any

import keras
from keras import ops

from keras_duq._serving import INDEX_OUTPUTS
from keras_duq._serving import DUQServingModel
from keras_duq._serving import ServingOptions
from keras_duq._serving import serving_outputs
from keras_duq._typing import Tensor

if TYPE_CHECKING:
    from keras_duq._duq_model import DUQModel

# The serving signature's input key for a single-input model. Requests use
# it (`{"inputs": ...}` in TF Serving's columnar format); the row format
# `{"instances": [...]}` needs no key at all.
SINGLE_INPUT_NAME = "inputs"

# The formats `DUQModel.export` writes with the DUQ serving outputs, by
# backend. Keras's OpenVINO export fails on JAX (on any model, JAX 0.10)
# and on PyTorch (its tracer refuses a dict of outputs), so there the
# OpenVINO file is converted from the ONNX export (`_OPENVINO_FROM_ONNX`).
# LiteRT from PyTorch goes through `litert-torch` (`_export_litert_from_torch`);
# Keras writes no LiteRT file from JAX.
SERVING_FORMATS = {
    "tensorflow": ("tf_saved_model", "onnx", "litert", "openvino"),
    "jax": ("tf_saved_model", "onnx", "openvino"),
    "torch": ("onnx", "openvino", "torch", "litert"),
}
_OPENVINO_FROM_ONNX = ("jax", "torch")

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
    "export the same outputs from PyTorch with `format='onnx'` or "
    "`format='torch'` (the ONNX packages: "
    "`pip install \"keras-duq[export]\"`). Received: backend 'torch'"
)

# The modules each export format needs, by backend (`None`: any backend).
_FORMAT_MODULES = {
    "tf_saved_model": {None: ("tensorflow",)},
    "onnx": {
        "torch": ("onnx", "onnxscript"),
        "jax": ("onnx", "jax2onnx"),
        None: ("tensorflow", "onnx", "tf2onnx"),
    },
    "torch": {None: ("torch",)},
    "openvino": {
        "torch": ("openvino", "onnx", "onnxscript"),
        "jax": ("openvino", "onnx", "jax2onnx"),
        None: ("openvino",),
    },
    "litert": {"torch": ("litert_torch", "ai_edge_litert"), None: ("tensorflow",)},
}

# Where a module is not in the `export` extra: how to install it.
_INSTALL_HINTS = {
    # litert-torch pins typing-extensions below 4.13 (through xdsl), which
    # TensorFlow's and Keras's own dependencies outgrew: it gets an
    # environment of its own, beside PyTorch and keras-duq.
    "litert_torch": (
        "with `pip install litert-torch` in an environment of its own with "
        "PyTorch and keras-duq (its pins conflict with the `export` extra's)"
    ),
}


def check_serving_format(format: str) -> None:
    """Raises a `ValueError` for a format this backend does not serve DUQ outputs in."""
    backend = keras.backend.backend()
    formats = SERVING_FORMATS.get(backend, ())
    if format in formats or format not in _FORMAT_MODULES:
        return  # Keras reports an unknown format itself.
    if backend == "torch" and format == "tf_saved_model":
        raise ValueError(_TORCH_MESSAGE)
    elsewhere = [name for name, served in SERVING_FORMATS.items() if format in served]
    raise ValueError(
        f"`DUQModel.export(format={format!r})` is not supported on the {backend} "
        f"backend, which exports the DUQ serving outputs as "
        f"{', '.join(repr(name) for name in formats)}. "
        "Save the model with `model.save('duq.keras')`, load it in a process "
        f"started with `KERAS_BACKEND={elsewhere[0]}` with "
        "`keras.models.load_model('duq.keras')` and export it there. "
        f"Received: `format={format!r}`"
    )


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
        hints = [_INSTALL_HINTS[name] for name in missing if name in _INSTALL_HINTS]
        how = (
            "; ".join(hints)
            if hints
            else 'with `pip install "keras-duq[export]"` (or `pip install '
            f"{' '.join(missing)}`)"
        )
        raise ImportError(
            f"`export(format={format!r})` on the {backend} backend needs the "
            f"package(s) {', '.join(missing)}, which are not installed. Install "
            f"them {how}. Received: `format={format!r}`"
        )


def check_export_options(options: dict[str, Any]) -> None:
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


def check_format_precision(model: DUQModel, format: str) -> None:
    """Refuses a LiteRT export of a model that computes in float16/bfloat16."""
    if format != "litert":
        return
    low = sorted(
        {
            layer.dtype_policy.compute_dtype
            for layer in _all_layers(model)
            if layer.dtype_policy.compute_dtype in ("float16", "bfloat16")
        }
    )
    if low:
        raise ValueError(
            "`DUQModel.export(format='litert')` needs a model that computes in "
            f"float32: this one computes in {' and '.join(low)} (a mixed-precision "
            "dtype policy), and LiteRT's built-in operators have no float16 "
            "matrix multiply (the converter would emit TensorFlow ops that the "
            "LiteRT interpreter cannot run). Build the same model under "
            "`keras.config.set_dtype_policy('float32')`, copy the weights with "
            "`model32.set_weights(model.get_weights())` and export that one; or "
            "export this one with `format='onnx'` or `format='openvino'`. "
            f"Received: a model with `dtype_policy={model.dtype_policy.name!r}`."
        )


def _all_layers(layer: Any) -> list[Any]:
    found = [layer]
    for child in getattr(layer, "layers", []):
        found.extend(_all_layers(child))
    return found


def export_serving_model(
    model: DUQModel,
    filepath: str | os.PathLike,
    format: str,
    options: ServingOptions,
    verbose: bool = False,
    input_signature: list[Any] | None = None,
    **kwargs: Any,
) -> None:
    """Writes `DUQServingModel(model, ...)` with `keras.Model.export(format=...)`."""
    if input_signature is None:
        # Keras infers no signature for a model subclass until called.
        input_signature = [
            serving_input_signature(model.feature_extractor.input, spec_type="keras")
        ]
    if format == "openvino" and keras.backend.backend() in _OPENVINO_FROM_ONNX:
        import tempfile

        import onnx
        import openvino

        with tempfile.TemporaryDirectory() as folder:
            onnx_path = os.path.join(folder, "duq.onnx")
            export_serving_model(
                model,
                onnx_path,
                "onnx",
                options,
                input_signature=input_signature,
                **kwargs,
            )
            # `Core().read_model` reads the ONNX file with the same frontend as
            # `openvino.convert_model`, without the converter's telemetry, which
            # forks a process to send its event over the network (and makes
            # JAX warn about the fork).
            ov_model = openvino.Core().read_model(onnx_path)
            # Only the serving names: OpenVINO's CPU plugin drops a final
            # `Convert` (the int64 `predictions`) and merges the names of its
            # input (`jnp_argmax_tmp_0`) into the output's.
            graph = onnx.load(onnx_path).graph
            names = [
                (port, value.name)
                for ports, values in (
                    (ov_model.inputs, graph.input),
                    (ov_model.outputs, graph.output),
                )
                for port, value in zip(ports, values)
            ]
            for op in ov_model.get_ops():
                for port in op.outputs():
                    port.get_tensor().set_names(set())
            for port, name in names:
                port.get_tensor().set_names({name})
            # `serialize`, as Keras's own OpenVINO export: float32 weights.
            openvino.serialize(ov_model, str(filepath))
        if verbose:
            print(f"Saved OpenVINO IR at '{filepath}'.")
        return
    serving_model = DUQServingModel(model, options)
    if format == "litert" and keras.backend.backend() == "torch":
        _export_litert_from_torch(
            serving_model, str(filepath), input_signature, verbose, **kwargs
        )
        return
    if format == "torch" and "dynamic_shapes" not in kwargs:
        kwargs["dynamic_shapes"] = _torch_batch_dims(input_signature)
    serving_model.export(
        str(filepath),
        format=format,
        verbose=verbose,
        input_signature=input_signature,
        **kwargs,
    )
    if format == "onnx" and keras.backend.backend() in ("torch", "jax"):
        # Their exporters number the outputs, in the order of the dict's keys.
        sample = keras.tree.map_structure(
            lambda spec: ops.zeros((1,) + tuple(spec.shape[1:]), spec.dtype),
            input_signature,
        )
        _name_onnx_outputs(str(filepath), sorted(serving_model(*sample)))
        if keras.backend.backend() == "jax":
            _check_onnx_runs(str(filepath), sample)


def _export_litert_from_torch(
    serving_model: DUQServingModel,
    filepath: str,
    input_signature: list[Any],
    verbose: bool,
    **kwargs: Any,
) -> None:
    """Writes `serving_model` as a LiteRT file from PyTorch, with `litert-torch`.

    Keras's own LiteRT export on PyTorch passes the sample inputs by
    position, so the signature's input is named `args_0`; passed by keyword,
    it is `inputs`, as in every other format. The file has a fixed batch
    size, the input signature's (1 where it is `None`): `litert-torch`
    lowers no dynamic batch through a `Dense` layer. `kwargs` go to
    `litert_torch.convert`; `enable_x64` defaults to `True` (int64
    `predictions`, as in the other formats).
    """
    import torch

    if len(input_signature) != 1 or not hasattr(input_signature[0], "shape"):
        raise ValueError(
            "`export(format='litert')` on the PyTorch backend takes a single "
            "input (one `keras.InputSpec`). Received: "
            f"`input_signature={input_signature!r}`"
        )
    (spec,) = input_signature
    shape = tuple(1 if size is None else size for size in spec.shape)
    sample = torch.zeros(shape, dtype=getattr(torch, str(spec.dtype or "float32")))
    kwargs.setdefault("enable_x64", True)
    serving_model.eval()
    out, err = io.StringIO(), io.StringIO()
    # litert-torch converts on the CPU: a model trained on a GPU goes there
    # for the conversion and back after it, as in Keras's own LiteRT export.
    devices = [
        (variable, variable.value.device) for variable in serving_model.variables
    ]
    try:
        for variable, _ in devices:
            variable.value.data = variable.value.data.to("cpu")
        with (
            keras.device("cpu"),
            _jax_x64_kept(),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            import litert_torch

            edge_model = litert_torch.convert(
                serving_model, sample_kwargs={SINGLE_INPUT_NAME: sample}, **kwargs
            )
            edge_model.export(filepath)
    finally:
        for variable, device in devices:
            variable.value.data = variable.value.data.to(device)
    if verbose:
        print(err.getvalue() + out.getvalue(), end="")
        print(f"Saved LiteRT model at '{filepath}' (batch size {shape[0]}).")


@contextlib.contextmanager
def _jax_x64_kept() -> Any:
    """Puts JAX's `jax_enable_x64` back as it was: litert-torch turns it on."""
    import jax  # litert-torch depends on it

    before = jax.config.jax_enable_x64
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


def _check_onnx_runs(path: str, sample: Any) -> None:
    """Removes an ONNX file that onnxruntime cannot run and says why.

    jax2onnx can write graphs that convert without error and fail only when
    run (0.17 writes Keras's max pooling as a `MaxPool` with a 4-D window);
    one row of zeros finds them before a server does.
    """
    import importlib.util

    if importlib.util.find_spec("onnxruntime") is None:
        return
    import numpy as np
    import onnxruntime

    try:
        session = onnxruntime.InferenceSession(path)
        arrays = [np.asarray(x) for x in keras.tree.flatten(sample)]
        session.run(None, {i.name: a for i, a in zip(session.get_inputs(), arrays)})
    except Exception as error:  # onnxruntime raises its own exception types
        os.remove(path)
        raise ValueError(
            "`DUQModel.export(format='onnx')` on the JAX backend wrote an ONNX "
            "file that onnxruntime cannot run, so it was removed: "
            f"{str(error).strip()[:300]} (jax2onnx 0.17, for example, writes "
            "Keras's `MaxPooling` layers as a `MaxPool` that onnxruntime and "
            "OpenVINO reject). Save the model with `model.save('duq.keras')`, "
            "load it in a process started with `KERAS_BACKEND=tensorflow` (or "
            "`torch`) with `keras.models.load_model('duq.keras')` and export it "
            "there. Received: `format='onnx'` on the JAX backend."
        ) from error


def _name_onnx_outputs(path: str, names: list[str]) -> None:
    """Renames the outputs of an ONNX file to `names`, in order.

    JAX without x64 computes class indices (`INDEX_OUTPUTS`) in int32: those
    outputs get a final cast to int64, the dtype every other format serves.
    """
    import onnx

    onnx_model = onnx.load(path)
    graph = onnx_model.graph
    if len(graph.output) != len(names):
        raise RuntimeError(
            f"The ONNX export has {len(graph.output)} outputs where the DUQ "
            f"serving model returns {len(names)} ({', '.join(names)})."
        )
    narrow = [
        name
        for output, name in zip(graph.output, names)
        if name in INDEX_OUTPUTS
        and output.type.tensor_type.elem_type == onnx.TensorProto.INT32
    ]
    # The int32 values keep a name of their own, which the cast reads.
    renamed = {
        output.name: f"{name}_int32" if name in narrow else name
        for output, name in zip(graph.output, names)
    }
    for node in graph.node:
        node.output[:] = [renamed.get(name, name) for name in node.output]
        node.input[:] = [renamed.get(name, name) for name in node.input]
    for info in list(graph.value_info) + list(graph.output):
        info.name = renamed.get(info.name, info.name)
    for output in graph.output:
        name = output.name.removesuffix("_int32")
        if name in narrow:
            graph.node.append(
                onnx.helper.make_node(
                    "Cast", [output.name], [name], to=onnx.TensorProto.INT64
                )
            )
            output.name = name
            output.type.tensor_type.elem_type = onnx.TensorProto.INT64
    onnx.save(onnx_model, path)


def _torch_batch_dims(input_signature: list[Any]) -> Any:
    """`torch.export`'s `dynamic_shapes`: a free batch size for every input."""
    import torch

    batch = torch.export.Dim("batch", min=1)
    return tuple(
        keras.tree.map_structure(lambda spec: {0: batch}, inputs)
        for inputs in input_signature
    )


def export_saved_model(
    model: DUQModel,
    filepath: str | os.PathLike,
    options: ServingOptions,
    verbose: bool = False,
    input_signature: list[Any] | None = None,
    **kwargs: Any,
) -> None:
    """Writes `model` as a SavedModel whose `serving_default` gives DUQ outputs.

    `kwargs` are Keras's backend options (`is_static`, `jax2tf_kwargs` on
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
        return serving_outputs(model, inputs, options)

    if keras.backend.backend() == "jax":
        # A serving signature takes no gradient: without jax2tf's custom
        # gradients, loading the SavedModel logs no "unsaved custom
        # gradients" warning.
        kwargs["jax2tf_kwargs"] = {
            "with_gradient": False,
            **(kwargs.get("jax2tf_kwargs") or {}),
        }
    # This archive only converts `outputs_fn` to a `tf.function`; the
    # SavedModel is written by the second one, with the dtypes fixed.
    converter = keras.export.ExportArchive()
    converter.track(model)
    converted = converter.add_endpoint("outputs", outputs_fn, input_signature, **kwargs)

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


# The file name each format's writer needs (OpenVINO's checks it deep in its
# C++ code, after the whole conversion has run).
_REQUIRED_SUFFIX = {"openvino": ".xml"}


def check_export_path(filepath, format):
    """Raises, before any conversion, for a path the format cannot write."""
    path = os.fspath(filepath)
    suffix = _REQUIRED_SUFFIX.get(format)
    if suffix is not None and not path.endswith(suffix):
        raise ValueError(
            f"`format={format!r}` writes a model file ending in {suffix!r} (its "
            f"weights go beside it). Pass a path such as 'model{suffix}'. "
            f"Received: `filepath={path!r}`"
        )
    if format == "tf_saved_model" and os.path.isfile(path):
        raise ValueError(
            "A SavedModel is a folder, but a file exists at this path. Pass a "
            "new folder path, or remove the file first. "
            f"Received: `filepath={path!r}`"
        )


def export(
    model,
    filepath,
    format,
    verbose,
    input_signature,
    certainty_threshold=None,
    calibrator=None,
    top_k=None,
    **kwargs,
):
    """`DUQModel.export`: every option checked before anything is written, then the export."""
    options = ServingOptions(certainty_threshold, calibrator, top_k)
    options.check(model.duq_output.num_classes)
    check_serving_format(format)
    check_format_precision(model, format)
    if format == "tf_saved_model":
        check_export_options(kwargs)
    check_export_path(filepath, format)
    check_format_packages(format)
    if format == "tf_saved_model":
        export_saved_model(model, filepath, options, verbose, input_signature, **kwargs)
    else:
        with warnings.catch_warnings():
            # tf2onnx (Keras's ONNX export on TensorFlow) still reads NumPy's
            # removed `np.object` alias: its warning is not the user's.
            warnings.filterwarnings(
                "ignore", message=".*`np.object`", category=FutureWarning
            )
            # PyTorch's ONNX export traces the serving model: Keras's ops turn
            # shapes into Python numbers there (`TracerWarning`). The export
            # tests run each file at batch sizes 256 and 1 against `predict`.
            warnings.filterwarnings(
                "ignore", message="(Converting a tensor|torch.as_tensor)", module="keras"
            )
            export_serving_model(
                model, filepath, format, options, verbose, input_signature, **kwargs
            )

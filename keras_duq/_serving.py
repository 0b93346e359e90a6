"""The serving outputs of a DUQ model, with `keras.ops` (any backend).

`serving_outputs` computes kernel values, predictions, certainty and, with
`ServingOptions`, `accept`, `probability_correct` or the top-k classes;
`DUQServingModel` is a model whose `call` returns them, for Keras's
exporters (`_export.py` writes the files).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING
from typing import Any

import keras
from keras import ops

from keras_duq._trainer import finite_rows
from keras_duq._trainer import nan_where_not_finite
from keras_duq._typing import Tensor
from keras_duq._validation import is_float

if TYPE_CHECKING:
    from keras_duq._duq_model import DUQModel
    from keras_duq.evaluation import CertaintyCalibrator


# Outputs that hold class indices (int64 in every format that has it).
INDEX_OUTPUTS = ("predictions", "top_k_classes")


@dataclasses.dataclass(frozen=True)
class ServingOptions:
    """The options of `DUQModel.export` that add or change serving outputs.

    Args:
        certainty_threshold: optional float in `[0, 1]`; adds `accept`
            (`certainty >= certainty_threshold`).
        calibrator: optional fitted `CertaintyCalibrator`; adds
            `probability_correct`.
        top_k: optional int; serves the `top_k` largest kernel values and
            their classes instead of every kernel value.
    """

    certainty_threshold: float | None = None
    calibrator: CertaintyCalibrator | None = None
    top_k: int | None = None

    def check(self, num_classes: int) -> None:
        """Raises a `ValueError` for an option out of its range.

        Called before anything is traced or written, for every format.
        """
        threshold = self.certainty_threshold
        if threshold is not None and (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not 0.0 <= threshold <= 1.0
        ):
            raise ValueError(
                "Expected `certainty_threshold` to be a float in [0, 1] (a "
                "kernel value: `accept` is `certainty >= certainty_threshold`), "
                "or `None` for no `accept` output. Received: "
                f"`certainty_threshold={threshold!r}`"
            )
        if self.calibrator is not None and (
            not callable(self.calibrator)
            or getattr(self.calibrator, "fitted", True) is False
        ):
            raise ValueError(
                "Expected `calibrator` to be a fitted "
                "`keras_duq.evaluation.CertaintyCalibrator` (call its `fit` on "
                "validation certainty and correctness first), or `None`. "
                f"Received: `calibrator={self.calibrator!r}`"
            )
        if self.top_k is not None and (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or not 1 <= self.top_k <= num_classes
        ):
            raise ValueError(
                f"Expected `top_k` to be an int in [1, {num_classes}] (the "
                "number of classes served per example), or `None` to serve "
                f"every kernel value. Received: `top_k={self.top_k!r}`"
            )


def serving_outputs(
    model: DUQModel, inputs: Any, options: ServingOptions
) -> dict[str, Tensor]:
    """The serving signature's outputs, with `keras.ops` (any backend).

    Returns a dict: `kernel_values` (or, with `top_k`, `top_k_classes` and
    `top_k_kernel_values`), `predictions` (argmax of the log kernel values),
    `certainty` (their max), `accept` when `certainty_threshold` is given
    and `probability_correct` when `calibrator` is.
    """
    features = model.feature_extractor(inputs, training=False)
    log_kernel = model.duq_output.log_kernel_values(features)
    kernel_values = ops.exp(log_kernel)
    certainty = ops.max(kernel_values, axis=-1)
    outputs = {
        "kernel_values": kernel_values,
        "predictions": _first_argmax(log_kernel),
        "certainty": certainty,
    }
    if options.top_k is not None:
        del outputs["kernel_values"]
        top_log_kernel, outputs["top_k_classes"] = _top_k(log_kernel, options.top_k)
        outputs["top_k_kernel_values"] = ops.exp(top_log_kernel)
    if options.certainty_threshold is not None:
        # The threshold is compared in float32, the certainty's dtype.
        outputs["accept"] = ops.greater_equal(
            certainty, ops.cast(options.certainty_threshold, certainty.dtype)
        )
    if options.calibrator is not None:
        # A map fitted on kernel values reads them whole (distance and
        # ambiguity); one fitted on certainties reads the certainty.
        calibrated = (
            kernel_values
            if getattr(options.calibrator, "takes_kernel_values", False)
            else certainty
        )
        outputs["probability_correct"] = ops.cast(
            options.calibrator(calibrated), "float32"
        )
    return _refuse_rows(outputs, finite_rows(inputs))


def _refuse_rows(
    outputs: dict[str, Tensor], finite: Tensor | None
) -> dict[str, Tensor]:
    """NaN outputs and `accept` False in the rows where `finite` is False.

    Layers such as ReLU map NaN to a number, and runtimes differ on `exp(NaN)`
    (OpenVINO's is inf, XNNPACK's 0), so the rows are refused last, on the
    outputs themselves.
    """
    if finite is None:
        return outputs
    refused = {}
    for name, value in outputs.items():
        if name == "accept":
            refused[name] = ops.logical_and(value, finite)
        elif is_float(value.dtype):
            refused[name] = nan_where_not_finite(finite, value)
        else:
            refused[name] = value
    return refused


def _first_argmax(log_kernel: Tensor) -> Tensor:
    """The index of the first largest value along the last axis.

    From log K: far inputs underflow every K to 0, not log K. Written as the
    argmax of an integer mask because Keras's float `argmax` on TensorFlow
    adds a sign-bit test (for -0.0) that ONNX has no operator for.
    """
    largest = ops.max(log_kernel, axis=-1, keepdims=True)
    return ops.argmax(ops.cast(ops.equal(log_kernel, largest), "int32"), axis=-1)


def _top_k(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """`(top values, their indices)` along the last axis, largest first."""
    if keras.backend.backend() != "jax":
        return ops.top_k(values, k)
    # JAX lowers `top_k` to a StableHLO composite that TensorFlow's XLA
    # cannot load from a jax2tf SavedModel; a sort exports everywhere.
    indices = ops.argsort(-values, axis=-1)[:, :k]
    return ops.take_along_axis(values, indices, axis=-1), indices


class DUQServingModel(keras.Model):
    """A model whose `call` returns `serving_outputs` as a dict.

    Keras's exporters other than the SavedModel's write a model's `call`;
    this one's is the DUQ serving computation, so every format serves the
    same outputs. Integer outputs are int64 where the backend has it; JAX
    without x64 computes them in int32, and its ONNX (and so OpenVINO) files
    end in a cast to int64 (`_export`).

    Args:
        duq_model: the (built) `DUQModel` to serve.
        options: the `ServingOptions` (outputs beyond the three served always).
    """

    def __init__(
        self, duq_model: DUQModel, options: ServingOptions, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.duq_model = duq_model
        self.options = options
        self.built = duq_model.built

    def call(self, inputs: Any) -> dict[str, Tensor]:
        outputs = serving_outputs(self.duq_model, inputs, self.options)
        # In the order of their names: the order of the outputs in formats
        # that flatten the dict (ONNX from PyTorch and JAX).
        outputs = {name: outputs[name] for name in sorted(outputs)}
        if keras.backend.backend() == "jax":
            return outputs
        return {
            name: ops.cast(value, "int64") if name in INDEX_OUTPUTS else value
            for name, value in outputs.items()
        }

"""Spectral normalisation with a soft bound, as DUE and SNGP use it."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from keras_duq._typing import Tensor
from keras_duq._validation import check_positive_int

SUPPORTED_LAYERS = (
    keras.layers.Dense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.DepthwiseConv2D,
)
_SUPPORTED_NAMES = "`Dense`, `Conv1D`, `Conv2D`, `Conv3D` or `DepthwiseConv2D`"
_EPSILON = 1e-12


@keras.saving.register_keras_serializable(package="keras_duq")
class SpectralNormalization(keras.layers.Wrapper):
    """Caps the spectral norm of a layer's linear map at `coefficient`.

    The wrapped layer computes with the kernel `W / max(1, sigma / coefficient)`,
    where `sigma` is the spectral norm (largest singular value) of the layer's
    linear map, estimated by power iteration. This is the soft bound of DUE
    (van Amersfoort et al., 2021) and SNGP (Liu et al., 2020): a layer whose
    norm is already at most `coefficient` is left unchanged, a larger one is
    scaled down to `coefficient`. Residual blocks `x + f(x)` of such layers
    keep distances in input space (bi-Lipschitz), so that DUQ's certainty can
    tell inputs far from the data apart from the data.

    Unlike `keras.layers.SpectralNormalization`, which divides by `sigma`
    (norm exactly 1) and writes the result back into the kernel variable,
    this wrapper leaves the kernel variable untouched: the normalised kernel
    is a differentiable function of it, computed in each forward pass, so
    gradients (and the second derivatives of DUQ's gradient penalty) flow
    through the normalisation, with the power-iteration vectors held constant.

    **Which norm.** For `Dense`, the spectral norm of the kernel matrix. For
    convolutions, the operator norm of the convolution itself on the layer's
    input size (padding, strides and dilation included), by power iteration
    through the convolution and its transpose, as DUE does. The norm of the
    kernel reshaped to a matrix would not bound the layer: it underestimates
    the operator norm, by up to a factor `sqrt(kernel height * kernel
    width)`. A convolution therefore needs a fixed input size (spatial
    dimensions not `None`). For `DepthwiseConv2D` (and grouped convolutions), the iteration
    runs through the equivalent full convolution, whose kernel is zero
    between groups: exact, at the cost of one full convolution of a single
    input per iteration.

    **State.** The power-iteration vector `vector_u` (in the layer's output
    space, float32) is non-trainable state, like `BatchNormalization`'s
    moving statistics: each call runs `power_iterations` steps of the
    iteration from it, and training-mode calls (`fit`, or
    `training=True`) store the result. Inference is deterministic and
    updates nothing. The vector is saved with the model. The iteration
    always runs in float32, also under a `mixed_float16` or
    `mixed_bfloat16` policy; the wrapped layer computes in its own dtype.

    Example:

    ```python
    inputs = keras.Input((28, 28, 1))
    x = keras_duq.SpectralNormalization(
        keras.layers.Conv2D(32, 3, padding="same"), coefficient=3.0
    )(inputs)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras_duq.SpectralNormalization(keras.layers.Dense(64), coefficient=3.0)(x)
    model = keras_duq.wrap(keras.Model(inputs, x), num_classes=10)
    ```

    Args:
        layer: a `keras.layers.Dense`, `Conv1D`, `Conv2D`, `Conv3D` or
            `DepthwiseConv2D` (not quantized, without LoRA).
        coefficient: float > 0, the largest spectral norm allowed. Defaults
            to `1.0`.
        power_iterations: int >= 1, power-iteration steps per call. Defaults
            to `1`, which, repeated over training steps, tracks `sigma`.
        **kwargs: base layer arguments (`name`, ...). The dtype policy
            defaults to the wrapped layer's.
    """

    def __init__(
        self,
        layer: keras.layers.Layer,
        coefficient: float = 1.0,
        power_iterations: int = 1,
        **kwargs: Any,
    ) -> None:
        _check_arguments(coefficient, power_iterations)
        if not isinstance(layer, SUPPORTED_LAYERS):
            raise ValueError(
                f"`SpectralNormalization` wraps a {_SUPPORTED_NAMES} layer. "
                "Apply it only to those layers (`keras_duq.spectral_normalize` "
                f"does so for a whole model). Received: `layer={layer!r}`"
            )
        kwargs.setdefault("dtype", layer.dtype_policy)
        # Without autocasting, `call` reads the float32 kernel as stored,
        # also under a mixed policy; the wrapped layer casts it itself.
        super().__init__(layer, autocast=False, **kwargs)
        self.coefficient = float(coefficient)
        self.power_iterations = power_iterations

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        super().build(input_shape)
        kernel = self.layer.kernel
        if not isinstance(kernel, keras.Variable) or not keras.backend.is_float_dtype(
            kernel.dtype
        ):
            raise ValueError(
                "`SpectralNormalization` needs the wrapped layer's kernel as a "
                "floating-point variable; a quantized layer or one with LoRA "
                "enabled has none. Normalise the layer before quantizing it or "
                f"enabling LoRA. Received: `layer={self.layer!r}`"
            )
        self._operator = _LinearOperator(self.layer, input_shape)
        self.vector_u = self.add_weight(
            shape=self._operator.output_shape,
            initializer="random_normal",
            trainable=False,
            name="vector_u",
            dtype="float32",
        )

    def call(self, inputs: Tensor, training: bool | None = None) -> Tensor:
        kernel_variable = self.layer.kernel
        kernel = ops.cast(kernel_variable, "float32")
        vector_u = ops.convert_to_tensor(self.vector_u)
        vector_u, vector_v = power_iteration(
            self._operator, ops.stop_gradient(kernel), vector_u, self.power_iterations
        )
        if training:
            self.vector_u.assign(vector_u)
        kernel = soft_bound(
            self._operator, kernel, vector_u, vector_v, self.coefficient
        )
        # The wrapped layer runs with the normalised kernel in place of its
        # variable, for this call only; the variable itself never changes.
        mapping = [
            (variable, kernel if variable is kernel_variable else variable)
            for variable in self.layer.variables
        ]
        with keras.StatelessScope(state_mapping=mapping, initialize_variables=False):
            return self.layer(inputs)

    def compute_output_shape(
        self, input_shape: tuple[int | None, ...]
    ) -> tuple[int | None, ...]:
        return self.layer.compute_output_shape(input_shape)

    def compute_output_spec(
        self, inputs: keras.KerasTensor, *args: Any, **kwargs: Any
    ) -> keras.KerasTensor:
        return self.layer.compute_output_spec(inputs)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "coefficient": self.coefficient,
            "power_iterations": self.power_iterations,
        }


def power_iteration(
    operator: _LinearOperator, kernel: Tensor, vector_u: Tensor, iterations: int
) -> tuple[Tensor, Tensor]:
    """`iterations` power-iteration steps: unit vectors `(u, v)`, `u ~ A v`.

    `v` is the estimate of the top right singular vector (input space) and
    `u` of the top left one (output space) of the operator `A` with `kernel`.
    """
    vector_v = None
    for _ in range(iterations):
        vector_v = _unit(operator.transpose(vector_u, kernel))
        vector_u = _unit(operator.apply(vector_v, kernel))
    return ops.stop_gradient(vector_u), ops.stop_gradient(vector_v)


def soft_bound(
    operator: _LinearOperator,
    kernel: Tensor,
    vector_u: Tensor,
    vector_v: Tensor,
    coefficient: float,
) -> Tensor:
    """`kernel / max(1, sigma / coefficient)`, with `sigma = <u, A v>`.

    `sigma` is a differentiable function of `kernel` (the vectors are
    constants), so the gradient sees the rescaling. With unit vectors it
    never exceeds the true norm: a layer within the bound stays unchanged.
    """
    sigma = ops.sum(vector_u * operator.apply(vector_v, kernel))
    return kernel / ops.maximum(1.0, sigma / coefficient)


def _unit(x: Tensor) -> Tensor:
    return x / (ops.sqrt(ops.sum(ops.square(x))) + _EPSILON)


class _LinearOperator:
    """The linear map of a Dense or convolution layer, and its transpose.

    A convolution's transpose is `ops.conv_transpose` with the same kernel and
    an output padding that restores the input size exactly (a strided
    convolution maps several input sizes to one output size).
    """

    def __init__(
        self, layer: keras.layers.Layer, input_shape: tuple[int | None, ...]
    ) -> None:
        self.is_dense = isinstance(layer, keras.layers.Dense)
        if self.is_dense:
            self.output_shape = (1, layer.units)
            return
        spatial = _spatial_shape(layer, input_shape)
        if any(size is None for size in spatial):
            raise ValueError(
                "`SpectralNormalization` of a convolution bounds its operator "
                "norm, which depends on the input size, so it needs fixed "
                "spatial dimensions. Give the model's `keras.Input` a full "
                f"shape (e.g. `(28, 28, 1)`). Received: input shape "
                f"{tuple(input_shape)} for layer `{layer.name}`"
            )
        self.channels_last = layer.data_format == "channels_last"
        self.strides = tuple(layer.strides)
        self.dilation_rate = tuple(layer.dilation_rate)
        self.data_format = layer.data_format
        kernel_size = tuple(layer.kernel_size)
        effective = [(k - 1) * d + 1 for k, d in zip(kernel_size, self.dilation_rate)]
        self.padding = layer.padding
        self.causal_padding = 0
        if layer.padding == "causal":
            # Conv1D's causal padding: zeros on the left, then "valid".
            self.padding = "valid"
            self.causal_padding = effective[0] - 1
            spatial = (spatial[0] + self.causal_padding,)
        self.output_shape = (1,) + tuple(layer.compute_output_shape(input_shape)[1:])
        output_spatial = (
            self.output_shape[1:-1] if self.channels_last else self.output_shape[2:]
        )
        self.output_padding = tuple(
            size - ((out - 1) * s + (k if self.padding == "valid" else k % 2))
            for size, out, s, k in zip(spatial, output_spatial, self.strides, effective)
        )
        self.group_mask = _group_mask(layer, input_shape)

    def apply(self, vector: Tensor, kernel: Tensor) -> Tensor:
        if self.is_dense:
            return ops.matmul(vector, kernel)
        kernel = self._full_kernel(kernel)
        if self.causal_padding:
            axis = 1 if self.channels_last else 2
            widths = [(0, 0)] * 3
            widths[axis] = (self.causal_padding, 0)
            vector = ops.pad(vector, widths)
        return ops.conv(
            vector,
            kernel,
            strides=self.strides,
            padding=self.padding,
            data_format=self.data_format,
            dilation_rate=self.dilation_rate,
        )

    def transpose(self, vector: Tensor, kernel: Tensor) -> Tensor:
        if self.is_dense:
            return ops.matmul(vector, ops.transpose(kernel))
        result = ops.conv_transpose(
            vector,
            self._full_kernel(kernel),
            strides=self.strides,
            padding=self.padding,
            output_padding=self.output_padding,
            data_format=self.data_format,
            dilation_rate=self.dilation_rate,
        )
        if self.causal_padding:
            # The transpose of zero-padding drops the padded positions.
            return (
                result[:, self.causal_padding :]
                if self.channels_last
                else (result[:, :, self.causal_padding :])
            )
        return result

    def _full_kernel(self, kernel: Tensor) -> Tensor:
        if self.group_mask is None:
            return kernel
        in_channels, out_channels = self.group_mask.shape
        rank = len(kernel.shape) - 2
        # A depthwise kernel `(..., in, m)` is the grouped kernel `(..., 1, in * m)`.
        kernel = ops.reshape(kernel, tuple(kernel.shape[:rank]) + (-1, out_channels))
        groups = in_channels // kernel.shape[-2]
        mask = ops.convert_to_tensor(self.group_mask, dtype=kernel.dtype)
        return ops.tile(kernel, (1,) * rank + (groups, 1)) * mask


def _spatial_shape(layer, input_shape):
    if layer.data_format == "channels_last":
        return tuple(input_shape[1:-1])
    return tuple(input_shape[2:])


def _channels(layer, input_shape):
    return input_shape[-1] if layer.data_format == "channels_last" else input_shape[1]


def _group_mask(layer, input_shape):
    """Mask `(in, out)` of a grouped convolution's full kernel, or `None`.

    A depthwise convolution with multiplier `m` is the grouped convolution
    with one group per input channel, input channel `c` feeding output
    channels `c * m ... c * m + m - 1`.
    """
    in_channels = _channels(layer, input_shape)
    if isinstance(layer, keras.layers.DepthwiseConv2D):
        groups, out_channels = in_channels, in_channels * layer.depth_multiplier
    else:
        groups, out_channels = layer.groups, layer.filters
    if groups == 1:
        return None
    in_group = np.arange(in_channels) // (in_channels // groups)
    out_group = np.arange(out_channels) // (out_channels // groups)
    return (in_group[:, None] == out_group[None, :]).astype("float32")


def spectral_normalize(
    model: keras.Model,
    coefficient: float = 1.0,
    power_iterations: int = 1,
) -> keras.Model:
    """A copy of `model` with each supported layer spectrally normalised.

    Every `Dense`, `Conv1D`, `Conv2D`, `Conv3D` and `DepthwiseConv2D` layer,
    also inside nested Sequential and functional models, is wrapped in
    `keras_duq.SpectralNormalization` (named as the layer it wraps); every
    layer keeps its weights. The original model is not changed. Other layers
    (`BatchNormalization`, pooling, ...) are copied as they are. A layer
    whose norm is at most `coefficient` computes exactly what it computed
    before; the others are scaled down to norm `coefficient`.

    Example:

    ```python
    backbone = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(64),
    ])
    model = keras_duq.wrap(
        keras_duq.spectral_normalize(backbone, coefficient=3.0), num_classes=10
    )
    ```

    Args:
        model: a Sequential or functional Keras model (not subclassed, and
            not yet wrapped: normalise the backbone, then `wrap` it).
            Convolutions need fixed input sizes (see
            `SpectralNormalization`).
        coefficient: float > 0, the largest spectral norm of each wrapped
            layer. Defaults to `1.0`.
        power_iterations: int >= 1, power-iteration steps per call. Defaults
            to `1`.

    Returns:
        A new model of the same kind, with the same inputs and outputs.
    """
    _check_arguments(coefficient, power_iterations)
    from keras_duq._duq_model import DUQModel

    functional = isinstance(model, keras.Model) and isinstance(model, keras.Function)
    if isinstance(model, DUQModel) or not (
        isinstance(model, keras.Sequential) or functional
    ):
        raise ValueError(
            "`spectral_normalize` copies a Sequential or functional model "
            "(the backbone, before `keras_duq.wrap`); a subclassed model "
            "cannot be copied layer by layer. Wrap its layers yourself with "
            "`keras_duq.SpectralNormalization(layer, coefficient=...)` in its "
            f"`__init__`. Received: `model={model!r}`"
        )
    copies = []

    def copy(layer: keras.layers.Layer) -> keras.layers.Layer:
        new = layer.__class__.from_config(layer.get_config())
        copies.append((layer, new))
        if isinstance(layer, SUPPORTED_LAYERS):
            return SpectralNormalization(
                new, coefficient, power_iterations, name=layer.name
            )
        return new

    normalized = keras.models.clone_model(model, clone_function=copy, recursive=True)
    for original, new in copies:
        new.set_weights(original.get_weights())
    return normalized


def _check_arguments(coefficient: Any, power_iterations: Any) -> None:
    if (
        isinstance(coefficient, bool)
        or not isinstance(coefficient, (int, float))
        or not (coefficient > 0)
    ):
        raise ValueError(
            "Expected `coefficient` (the largest spectral norm allowed) to be "
            f"a float > 0. Received: `coefficient={coefficient!r}`"
        )
    check_positive_int("power_iterations", power_iterations)

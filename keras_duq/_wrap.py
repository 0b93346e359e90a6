"""`wrap`: turn any Keras backbone into a DUQ model."""

from __future__ import annotations

import inspect
import types
from collections.abc import Sequence
from typing import Any

import keras

from keras_duq._duq_model import DUQModel
from keras_duq._duq_output import PAPER_PROJECTION_LEARNING_RATE
from keras_duq._duq_output import DUQOutput
from keras_duq._duq_output import check_feature_shape

# The paper's method where the library's defaults differ from it: the loss
# without the categorical term, `W` learning at the optimizer's rate, and
# gradients as they are (not clipped). The paper trained with SGD, under
# which the default weight decay is the paper's. The
# paper's problem-specific values (length scale, penalty weight, centroid size)
# stay arguments of their own.
PAPER_SETTINGS = types.MappingProxyType(
    {
        "categorical_cross_entropy_weight": 0.0,
        "projection_learning_rate": PAPER_PROJECTION_LEARNING_RATE,
        "clipnorm": None,
    }
)


def wrap(
    backbone: keras.Model | keras.layers.Layer,
    num_classes: int,
    *,
    input_shape: Sequence[int | None] | None = None,
    name: str | None = None,
    **kwargs: Any,
) -> DUQModel:
    """Turns a Keras backbone into a DUQ model.

    The backbone maps inputs to features `(batch, features)`; `wrap` puts a
    `DUQOutput` head on top and returns a `DUQModel`, ready for `compile`
    and `fit`. The backbone object is reused, not copied: its weights are the
    model's weights.

    Example:

    ```python
    backbone = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
    ])
    model = keras_duq.wrap(backbone, num_classes=10)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    model.fit(x_train, y_train, epochs=30)
    kernel_values = model.predict(x_test)      # (batch, 10), in [0, 1]
    predictions = kernel_values.argmax(axis=1)
    certainty = kernel_values.max(axis=1)      # low: out of distribution
    ```

    A text model, whose inputs are token ids, takes the penalty with
    respect to its embeddings:

    ```python
    backbone = keras.Sequential([
        keras.Input((256,), dtype="int32"),
        keras.layers.Embedding(20_000, 64, mask_zero=True, name="embedding"),
        keras.layers.GlobalAveragePooling1D(),
    ])
    model = keras_duq.wrap(backbone, num_classes=2, penalty_input="embedding")
    ```

    Args:
        backbone: a Keras model or layer returning one tensor of shape
            `(batch, features)`: Sequential, functional, subclassed,
            `keras.applications` (with `include_top=False, pooling="avg"`).
        num_classes: int >= 2, number of classes.
        input_shape: tuple, the input shape without the batch dimension.
            Needed only when the backbone does not define its inputs (a
            subclassed model, or a Sequential model without `keras.Input`).
        name: optional model name.
        **kwargs: by name, the arguments of the head, `DUQOutput`
            (`centroid_dims`, `length_scale`, `momentum`,
            `kernel_initializer`, `trainable_length_scale`,
            `bias_correction`, `trainable_projection`,
            `projection_learning_rate`, `head`), and of the model,
            `DUQModel` (`gradient_penalty`, `penalty`, `penalty_interval`,
            `weight_decay`, `bce_epsilon`,
            `categorical_cross_entropy_weight`, `clipnorm`,
            `health_checks`, `penalty_input`), with the defaults and
            meanings documented there. `**keras_duq.PAPER_SETTINGS` gives
            the paper's method. Any other name raises a `TypeError`.

    Returns:
        A `DUQModel`.
    """
    layer_kwargs, model_kwargs = _split_kwargs(kwargs)
    inputs = _model_inputs(backbone, input_shape)
    features = backbone(inputs)
    if isinstance(features, (list, tuple, dict)):
        raise ValueError(
            "The backbone must return a single feature tensor of shape "
            "(batch, features), but it returns several outputs. Wrap a model "
            "that ends at the feature layer. Received: outputs "
            f"{keras.tree.map_structure(lambda t: tuple(t.shape), features)}"
        )
    # Before the layer's own input check, whose message has no fix.
    check_feature_shape(features.shape)
    outputs = DUQOutput(num_classes, name="duq_output", **layer_kwargs)(features)
    return DUQModel(inputs, outputs, name=name, **model_kwargs)


def _own_arguments(cls, *skipped):
    """The names of `cls.__init__`'s own arguments, but `skipped`."""
    return tuple(
        name
        for name, parameter in inspect.signature(cls.__init__).parameters.items()
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        and name not in ("self", *skipped)
    )


def argument_names():
    """The keyword arguments `wrap` takes: its own, `DUQOutput`'s and `DUQModel`'s."""
    return (
        ("input_shape", "name")
        + _own_arguments(DUQOutput, "num_classes")
        + _own_arguments(DUQModel, "inputs", "outputs")
    )


def _split_kwargs(kwargs):
    """`wrap`'s keyword arguments as `(DUQOutput's, DUQModel's)`."""
    layer_names = _own_arguments(DUQOutput, "num_classes")
    model_names = _own_arguments(DUQModel, "inputs", "outputs")
    unknown = sorted(set(kwargs) - set(layer_names) - set(model_names))
    if unknown:
        raise TypeError(
            f"`wrap` got unexpected keyword arguments {unknown}. It takes "
            f"`input_shape`, `name`, the arguments of `DUQOutput` {list(layer_names)} "
            f"and those of `DUQModel` {list(model_names)}. "
            f"Received: {', '.join(f'`{k}={kwargs[k]!r}`' for k in unknown)}"
        )
    layer_kwargs = {k: v for k, v in kwargs.items() if k in layer_names}
    model_kwargs = {k: v for k, v in kwargs.items() if k in model_names}
    return layer_kwargs, model_kwargs


def _model_inputs(
    backbone: keras.Model | keras.layers.Layer,
    input_shape: Sequence[int | None] | None,
) -> Any:
    """Fresh `keras.Input`s matching the backbone's declared inputs."""
    if input_shape is not None:
        return keras.Input(shape=tuple(input_shape))
    try:
        declared = backbone.input
    except (AttributeError, ValueError):
        # Sequential models built from `keras.Input` only expose `inputs`.
        declared = getattr(backbone, "inputs", None)
        if isinstance(declared, list) and len(declared) == 1:
            declared = declared[0]
    if declared is None:
        raise ValueError(
            "Cannot tell the backbone's input shape: it does not define its "
            "inputs (a subclassed model, or a Sequential model without "
            "`keras.Input`). Pass `input_shape=` (without the batch "
            f"dimension) to `wrap`. Received: backbone {backbone!r}"
        )
    return keras.tree.map_structure(
        lambda t: keras.Input(shape=tuple(t.shape[1:]), dtype=t.dtype, name=t.name),
        declared,
    )

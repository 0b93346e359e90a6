"""`wrap`: turn any Keras backbone into a DUQ model."""

from __future__ import annotations

import inspect
import types
from collections.abc import Sequence
from typing import Any

import keras

from keras_duq._duq_model import DUQModel
from keras_duq._duq_output import DEFAULT_PROJECTION_LEARNING_RATE
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
    # DUQOutput's arguments.
    centroid_dims: int | None = None,
    length_scale: float | str = "auto",
    momentum: float = 0.999,
    kernel_initializer: str | keras.initializers.Initializer = "he_normal",
    trainable_length_scale: bool = False,
    bias_correction: bool = False,
    trainable_projection: bool = True,
    projection_learning_rate: float = DEFAULT_PROJECTION_LEARNING_RATE,
    head: str = "auto",
    # DUQModel's arguments.
    gradient_penalty: float = 0.1,
    penalty: str = "two_sided",
    penalty_interval: int = 1,
    weight_decay: float | None = None,
    bce_epsilon: float = 0.0,
    categorical_cross_entropy_weight: float | None = None,
    clipnorm: float | None = 1.0,
    health_checks: bool = True,
    penalty_input: str | None = None,
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
        centroid_dims: size of the space the kernels compare in (`None`: a rule
            from the features' size). See `DUQOutput`.
        length_scale: the RBF kernels' length scale; `"auto"` sets it from the
            features at the first `fit`. See `DUQOutput`.
        momentum: the centroids' moving-average momentum. See `DUQOutput`.
        kernel_initializer: initializer of the per-class projections. See
            `DUQOutput`.
        trainable_length_scale: learn the length scale by gradient descent. See
            `DUQOutput`.
        bias_correction: centroids as bias-corrected averages from the first
            step. See `DUQOutput`.
        trainable_projection: train the projections (`False`: fixed random
            ones). See `DUQOutput`.
        projection_learning_rate: the projections' rate relative to the
            optimizer's. See `DUQOutput`.
        head: `"per_class"`, `"shared"` or `"auto"` (a rule from the sizes).
            See `DUQOutput`.
        gradient_penalty: weight of the gradient penalty (0: none). See
            `DUQModel`.
        penalty: `"two_sided"` (the paper's) or `"one_sided"`. See `DUQModel`.
        penalty_interval: compute the penalty on every k-th step only. See
            `DUQModel`.
        weight_decay: coupled L2 weight decay (`None`: the paper's under SGD,
            else 0). See `DUQModel`.
        bce_epsilon: floor of the cross-entropy's gradient denominator. See
            `DUQModel`.
        categorical_cross_entropy_weight: weight of a categorical term on the
            kernel values. See `DUQModel`.
        clipnorm: clip the gradients to this global norm (`None`: no clipping).
            See `DUQModel`.
        health_checks: warn, with a fix, when the certainty is meaningless. See
            `DUQModel`.
        penalty_input: name of the layer whose outputs the penalty
            differentiates (token models: the embedding). See `DUQModel`.
            `**keras_duq.PAPER_SETTINGS` gives the paper's method.

    Returns:
        A `DUQModel`.
    """
    arguments = dict(locals())
    layer_kwargs = {k: arguments[k] for k in _own_arguments(DUQOutput, "num_classes")}
    model_kwargs = {
        k: arguments[k] for k in _own_arguments(DUQModel, "inputs", "outputs")
    }
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
    return tuple(
        name
        for name, parameter in inspect.signature(wrap).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    )


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

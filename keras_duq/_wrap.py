"""`wrap`: turn any Keras backbone into a DUQ model."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import keras

from keras_duq._duq_model import DEFAULT_CLIPNORM
from keras_duq._duq_model import DEFAULT_GRADIENT_PENALTY
from keras_duq._duq_model import DUQModel
from keras_duq._duq_output import DEFAULT_KERNEL_INITIALIZER
from keras_duq._duq_output import DEFAULT_PROJECTION_LEARNING_RATE
from keras_duq._duq_output import PAPER_PROJECTION_LEARNING_RATE
from keras_duq._duq_output import DUQOutput

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
    centroid_dims: int | None = None,
    length_scale: float = 0.1,
    momentum: float = 0.999,
    kernel_initializer: str | keras.initializers.Initializer = (
        DEFAULT_KERNEL_INITIALIZER
    ),
    gradient_penalty: float = DEFAULT_GRADIENT_PENALTY,
    penalty: str = "two_sided",
    penalty_interval: int = 1,
    weight_decay: float | None = None,
    bce_epsilon: float = 0.0,
    categorical_cross_entropy_weight: float | None = None,
    trainable_length_scale: bool = False,
    bias_correction: bool = False,
    trainable_projection: bool = True,
    projection_learning_rate: float = DEFAULT_PROJECTION_LEARNING_RATE,
    head: str = "auto",
    clipnorm: float | None = DEFAULT_CLIPNORM,
    health_checks: bool = True,
    penalty_input: str | None = None,
    input_shape: Sequence[int | None] | None = None,
    name: str | None = None,
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
        centroid_dims: int or `None`, size of the centroids. `None` (default)
            uses the number of backbone features, at most 256 (see
            `DUQOutput`).
        length_scale: float > 0, RBF length scale. Defaults to `0.1`.
        momentum: float in `[0, 1)`, centroid moving-average momentum.
            Defaults to `0.999`.
        kernel_initializer: initializer of the per-class projections `W`.
            Defaults to `"he_normal"`.
        gradient_penalty: float >= 0, weight of the gradient penalty; `0`
            turns it off. Defaults to `0.1`.
        penalty: `"two_sided"` (default) or `"one_sided"`.
        penalty_interval: int >= 1, compute the penalty on every
            `penalty_interval`-th step only, weighted by `penalty_interval`
            there (see `DUQModel`). Defaults to `1`: every step.
        weight_decay: float >= 0 or `None`, coupled L2 weight decay (each
            gradient gets `+ weight_decay * w`) on every weight but embedding
            tables. `None` (default): the paper's `1e-4` under
            `keras.optimizers.SGD`, `0` under any other optimizer, which
            decays with its own `weight_decay` (see `DUQModel`).
        bce_epsilon: float >= 0, floor of `K (1 - K)` in the cross-entropy
            gradient's denominator; `0` (default) is the exact gradient,
            `1e-12` that of the paper's PyTorch code (see `DUQModel`).
        categorical_cross_entropy_weight: float >= 0 or `None`, weight per
            example of a categorical cross-entropy over the classes'
            distances added to the paper's loss (see `DUQModel`); `0` is the
            paper's loss. `None` (default) takes `1.0`, or more when the
            backbone's features come straight out of a dropout layer (3 at
            rate 0.5).
        trainable_length_scale: bool, learn one length scale per class, at
            the optimizer's full rate (see `DUQOutput`). Defaults to
            `False`.
        bias_correction: bool, bias-correct the centroid moving average
            (see `DUQOutput`). Defaults to `False`.
        trainable_projection: bool, learn the per-class projections `W`
            (as in the paper), or keep them at their random initial values
            (see `DUQOutput`). Defaults to `True`.
        projection_learning_rate: float > 0, the rate at which `W` learns,
            as a multiple of the optimizer's. Defaults to `0.1`, which keeps
            more separation of out-of-distribution inputs; `1.0` is the
            paper's (see `DUQOutput`).
        head: `"auto"` (default), `"per_class"` (the paper's: one
            projection per class) or `"shared"` (one projection for all
            classes, for many classes); `"auto"` takes the per-class head
            up to 2**24 projection values (see `DUQOutput`).
        clipnorm: float > 0 or `None`, clips each weight's gradient to this
            L2 norm before the optimizer's step, unless the optimizer clips
            its gradients itself (see `DUQModel`). `None` turns it off, as
            in the paper. Defaults to `1.0`.
        health_checks: bool, whether `fit`, `evaluate` and `predict` warn
            (once per cause, with a `keras_duq.DUQHealthWarning`) about
            DUQ's failure modes and log the numbers behind them (see
            `DUQModel`). Defaults to `True`.
        penalty_input: name of a backbone layer, or `None` (default). With
            a name, the gradient penalty is taken with respect to that
            layer's output instead of the model's floating-point inputs:
            for token ids, name the `Embedding` layer, e.g.
            `penalty_input="embedding"` (see `DUQModel`).
        input_shape: tuple, the input shape without the batch dimension.
            Needed only when the backbone does not define its inputs (a
            subclassed model, or a Sequential model without `keras.Input`).
        name: optional model name.

    Returns:
        A `DUQModel`.
    """
    inputs = _model_inputs(backbone, input_shape)
    features = backbone(inputs)
    if isinstance(features, (list, tuple, dict)):
        raise ValueError(
            "The backbone must return a single feature tensor of shape "
            "(batch, features), but it returns several outputs. Wrap a model "
            "that ends at the feature layer. Received: outputs "
            f"{keras.tree.map_structure(lambda t: tuple(t.shape), features)}"
        )
    if len(features.shape) != 2:
        raise ValueError(
            "The backbone must return features of shape (batch, features). "
            f"Received: output shape {tuple(features.shape)}. Add "
            "`keras.layers.GlobalAveragePooling2D()` (for images) or "
            "`keras.layers.Flatten()` as the backbone's last layer, or for "
            "`keras.applications` pass `include_top=False, pooling='avg'`."
        )
    outputs = DUQOutput(
        num_classes=num_classes,
        centroid_dims=centroid_dims,
        length_scale=length_scale,
        momentum=momentum,
        kernel_initializer=kernel_initializer,
        trainable_length_scale=trainable_length_scale,
        bias_correction=bias_correction,
        trainable_projection=trainable_projection,
        projection_learning_rate=projection_learning_rate,
        head=head,
        name="duq_output",
    )(features)
    return DUQModel(
        inputs,
        outputs,
        gradient_penalty=gradient_penalty,
        penalty=penalty,
        penalty_interval=penalty_interval,
        weight_decay=weight_decay,
        bce_epsilon=bce_epsilon,
        categorical_cross_entropy_weight=categorical_cross_entropy_weight,
        clipnorm=clipnorm,
        health_checks=health_checks,
        penalty_input=penalty_input,
        name=name,
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

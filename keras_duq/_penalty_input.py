"""`penalty_input`: the gradient penalty with respect to a layer's output.

A model whose inputs are token ids has no floating-point input to
differentiate, so its penalty is taken with respect to the output of a layer
named by the user instead (for text: the embeddings).

The model's own graph is left as it is (`predict`, saving and export do not
change). The penalty's forward pass runs a copy of the feature extractor's
graph, made with `keras.models.clone_model`, that shares every layer and
variable, and in which the named layer is wrapped in a `ProbedLayer`. Inside
`probing(probe)`, that layer's floating-point outputs become
`output + s * p` for a zero tensor `p` that the backend creates and
differentiates against (`probe(output)` is `output + p`) and `s` the
output's spread over the batch (`in_own_units`). The gradient at `p = 0` is
the gradient with respect to the layer's output per unit of its
spread, and the model's values do not change. Each
backend creates `p` in its own way (`_trainer.InputGradients`): TensorFlow
and PyTorch inside the forward pass, JAX as an argument of `jax.grad`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import keras
from keras import ops

from keras_duq import _compat
from keras_duq import _ops
from keras_duq._duq_output import replica_sum
from keras_duq._typing import Tensor
from keras_duq._validation import is_float

# The probe of the penalty's forward pass; per thread, because
# `tf.distribute` runs the replicas' steps in threads of their own.
_active = threading.local()

# How many layer names an error lists.
_CANDIDATES = 8


@contextlib.contextmanager
def probing(probe: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Within the block, `ProbedLayer`s return `probe(output)` for each float output."""
    previous = getattr(_active, "probe", None)
    _active.probe = probe
    try:
        yield
    finally:
        _active.probe = previous


class ProbedLayer(keras.layers.Wrapper):
    """Calls `layer`; inside `probing(probe)`, passes its float outputs to `probe`.

    It computes in the wrapped layer's own dtype and propagates its mask
    (e.g. an `Embedding(mask_zero=True)`'s padding mask), so the copy of the
    graph computes what the original does.
    """

    def __init__(self, layer: keras.layers.Layer) -> None:
        super().__init__(
            layer, name=f"{layer.name}_probed", dtype=layer.dtype_policy, autocast=False
        )
        self.supports_masking = layer.supports_masking

    def call(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = self.layer(inputs, *args, **kwargs)
        probe = getattr(_active, "probe", None)
        if probe is None:
            return outputs
        mask = None
        if not isinstance(outputs, (list, tuple, dict)):
            mask = self.layer.compute_mask(inputs, kwargs.get("mask"))
        return keras.tree.map_structure(
            lambda output: (
                in_own_units(probe, output, mask) if is_float(output.dtype) else output
            ),
            outputs,
        )

    def compute_output_spec(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return self.layer.compute_output_spec(inputs, *args, **kwargs)

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return self.layer.compute_mask(inputs, mask)


def in_own_units(
    probe: Callable[[Tensor], Tensor], output: Tensor, mask: Tensor | None = None
) -> Tensor:
    """`probe(output)`, differentiated in units of `output`'s spread.

    Returns `output + s * p`, for `p` the probe's zero tensor and `s =
    output_scale(output, mask)` (not differentiated): the gradient with
    respect to `p` is `s` times the gradient with respect to `output`, the
    gradient per unit of the output's spread, as for standardised inputs. A
    user standardises a model's inputs but not a layer's outputs: a Keras
    `Embedding` starts at a scale of about 0.03, where a gradient norm held
    near 1 kept every kernel value low (mean certainty 0.017 against 0.17 on
    CLINC150; docs/reports/defaults.md).
    """
    scale = ops.stop_gradient(output_scale(output, mask))
    return output + ops.cast(scale, output.dtype) * (probe(output) - output)


def output_scale(output: Tensor, mask: Tensor | None = None) -> Tensor:
    """The spread of a layer's output over the batch (`_ops.embedding_scale`).

    The root of the mean per-feature variance over the batch's positions
    (every axis but the last), those the layer's `mask` keeps (an
    `Embedding(mask_zero=True)`'s padding left out), summed over the
    replicas of a `tf.distribute` strategy, so that padding and the number
    of replicas do not change it.
    """
    values = ops.cast(output, "float32")
    values = ops.reshape(values, (-1, ops.shape(values)[-1]))
    if mask is None or len(mask.shape) != len(output.shape) - 1:
        weights = ops.ones_like(values[:, :1])
    else:
        weights = ops.reshape(ops.cast(mask, "float32"), (-1, 1))
    first, second, count = replica_sum(
        ops.sum(weights * values, axis=0),
        ops.sum(weights * ops.square(values), axis=0),
        ops.sum(weights),
    )
    variance = _ops.variance_from_sums(first, second, ops.maximum(count, 1.0))
    return _ops.embedding_scale(variance)


def probed_copy(
    feature_extractor: keras.Model, path: list[keras.layers.Layer]
) -> keras.Model:
    """A copy of `feature_extractor`'s graph, the layer at `path` wrapped in a `ProbedLayer`.

    `path` is `find_layer`'s. Every other layer is shared, not cloned: the
    copy computes with the model's own variables. Only the models on the
    way to the layer are copied (`clone_model` builds new Sequential and
    functional containers around the same layers).
    """
    probed = ProbedLayer(path[-1])

    def rebuild(model, rest):
        def clone_function(layer):
            if layer is not rest[0]:
                return layer
            return probed if len(rest) == 1 else rebuild(layer, rest[1:])

        if isinstance(model, keras.Sequential):
            return keras.models.clone_model(model, clone_function=clone_function)
        # The same input tensors: the copy's inputs keep their names.
        return keras.models.clone_model(
            model, input_tensors=model.input, clone_function=clone_function
        )

    return rebuild(feature_extractor, path)


def find_layer(feature_extractor: keras.Model, name: Any) -> list[keras.layers.Layer]:
    """The path to the layer called `name`: `[layer]`, or `[model, ..., layer]`.

    The path starts at a layer of `feature_extractor` and goes down through
    nested Sequential or functional models.

    Raises a `ValueError` for a name that is not a string, names no layer
    of a functional or Sequential model in the graph (also when the only
    match is inside a subclassed layer, whose graph cannot be copied), names
    several, names an input, or a layer without a floating-point output.
    """
    received = f"Received: `penalty_input={name!r}`"
    if not isinstance(name, str):
        raise ValueError(
            "Expected `penalty_input` to be the name of a layer (a string), "
            f"e.g. 'embedding', or None. {received}"
        )
    matches = [
        path for path in _layer_paths(feature_extractor) if path[-1].name == name
    ]
    if not matches:
        inside = [
            path[-1].name
            for path in _layer_paths(feature_extractor)
            if any(nested.name == name for nested in _compat.all_layers(path[-1]))
        ]
        where = (
            f" It is inside the subclassed layer or model {inside[0]!r}, whose "
            "graph cannot be copied: name a layer of a functional or "
            "Sequential model."
            if inside
            else ""
        )
        raise ValueError(
            "`penalty_input` must be the name of a layer of the model's "
            f"backbone, and there is no layer {name!r}.{where} Layers whose "
            f"output is floating point: {_candidates(feature_extractor)}. "
            f"{received}"
        )
    if len(matches) > 1:
        raise ValueError(
            f"`penalty_input={name!r}` is ambiguous: layers of several nested "
            f"models have that name "
            f"({[' > '.join(layer.name for layer in path) for path in matches]}). "
            "Give the layer a unique `name=` when building the backbone. "
            f"{received}"
        )
    path = matches[0]
    layer = path[-1]
    if isinstance(layer, keras.layers.InputLayer):
        raise ValueError(
            f"`penalty_input={name!r}` names an input. Leave `penalty_input=None` "
            "to take the penalty with respect to the model's floating-point "
            "inputs, or name the layer whose output to differentiate (for "
            f"token ids, the Embedding layer). {received}"
        )
    if not _has_float_output(layer):
        dtypes = [output.dtype for output in keras.tree.flatten(layer.output)]
        raise ValueError(
            "`penalty_input` must name a layer whose output is floating point "
            f"(e.g. an Embedding layer), but layer {name!r} outputs {dtypes}. "
            f"Layers whose output is floating point: "
            f"{_candidates(feature_extractor)}. {received}"
        )
    return path


def embedding_name(feature_extractor: keras.Model) -> str | None:
    """The name of the first `Embedding` layer in the graph, if there is one."""
    for path in _layer_paths(feature_extractor):
        if isinstance(path[-1], keras.layers.Embedding):
            return path[-1].name
    return None


def _is_graph(layer):
    """Whether `layer` is a Sequential or functional model (`clone_model` copies those)."""
    # Subclassed models define no `outputs`.
    return isinstance(layer, keras.Sequential) or (
        isinstance(layer, keras.Model) and hasattr(layer, "outputs")
    )


def _layer_paths(model, prefix=()):
    """The path from a layer of `model` to every layer of its graph, depth first."""
    for layer in model.layers:
        path = (*prefix, layer)
        yield list(path)
        if _is_graph(layer):
            yield from _layer_paths(layer, path)


def _has_float_output(layer):
    try:
        outputs = keras.tree.flatten(layer.output)
    except (AttributeError, ValueError):  # never called: no output to read
        return False
    return any(is_float(output.dtype) for output in outputs)


def _candidates(feature_extractor):
    """A few names to suggest: Embedding layers first, then other float outputs."""
    layers = [
        path[-1]
        for path in _layer_paths(feature_extractor)
        if not isinstance(path[-1], keras.layers.InputLayer)
        and _has_float_output(path[-1])
    ]
    layers.sort(key=lambda layer: not isinstance(layer, keras.layers.Embedding))
    return [layer.name for layer in layers[:_CANDIDATES]]


def no_float_input_message(inputs, feature_extractor):
    """The error for a model without float inputs whose penalty is on."""
    embedding = embedding_name(feature_extractor)
    example = (
        f"`penalty_input={embedding!r}` (this model's Embedding layer)"
        if embedding is not None
        else "`penalty_input='embedding'` (the name of the model's Embedding layer)"
    )
    return (
        "The gradient penalty is taken with respect to the model's "
        "floating-point inputs, and this model has none (input dtypes: "
        f"{[t.dtype for t in keras.tree.flatten(inputs)]}). For token ids, "
        "take it with respect to the output of a layer instead, e.g. "
        f"{example}. Otherwise declare a float input, e.g. "
        "`keras.Input(shape, dtype='float32')`, or pass `gradient_penalty=0`."
    )

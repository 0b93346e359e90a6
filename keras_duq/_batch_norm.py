"""BatchNormalization statistics re-estimated from data, for any Keras model.

A short training, or a `momentum` close to 1, leaves BatchNormalization's
moving statistics behind the weights, and inference mode then computes
features that training never saw. `recompute_batch_norm_statistics` sets
them to the average of the layers' batch statistics over some training
inputs (as SWA's `bn_update` does); `RecomputeBatchNormStatistics` does so
after every epoch of `fit`. Neither needs a DUQ model. Public as
`keras_duq.recompute_batch_norm_statistics` and
`keras_duq.callbacks.RecomputeBatchNormStatistics`.

Example:

```python
model.fit(x_train, y_train, epochs=3)
keras_duq.recompute_batch_norm_statistics(model, x_train[:5000])
```
"""

from __future__ import annotations

import sys
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_duq import _compat
from keras_duq._ops import optimizer_steps
from keras_duq._ops import to_float64
from keras_duq._validation import check_positive_int

__all__ = ["RecomputeBatchNormStatistics", "recompute_batch_norm_statistics"]


def batch_norm_layers(model):
    """The BatchNormalization layers whose moving statistics training updates."""
    return [
        layer
        for layer in _compat.all_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization)
        and layer.trainable
        and layer.momentum < 1
    ]


def _batch_statistics(model, layers, inputs):
    """Training-mode outputs and each layer's batch `(mean, variance)`, changing nothing.

    One stateless training-mode pass: each layer's updated moving statistics
    `m * old + (1 - m) * batch` give back its batch statistics.
    """
    trainable = [v.value for v in model.trainable_variables]
    old = [v.value for v in model.non_trainable_variables]
    outputs, new = model.stateless_call(trainable, old, inputs, training=True)
    position = _positions(model)

    def batch_value(layer, variable):
        i = position[id(variable)]
        old_value = to_float64(old[i])
        new_value = to_float64(new[i])
        return (new_value - layer.momentum * old_value) / (1.0 - layer.momentum)

    statistics = {}
    for layer in layers:
        mean = batch_value(layer, layer.moving_mean)
        if getattr(layer, "renorm", False):
            # Renormalisation averages the standard deviation instead.
            variance = (
                np.square(batch_value(layer, layer.moving_stddev)) - layer.epsilon
            )
        else:
            variance = batch_value(layer, layer.moving_variance)
        statistics[layer] = (mean, np.maximum(variance, 0.0))
    return outputs, statistics


def _positions(model):
    """Each non-trainable variable's position in `model.non_trainable_variables`."""
    return {id(v): i for i, v in enumerate(model.non_trainable_variables)}


def average_statistics(model, layers, batches, keep_outputs=True):
    """Training-mode outputs of `batches` and each layer's average batch `(mean, variance)`.

    Averaged over the batches, weighted by their size, as SWA's `bn_update`
    does: the value the moving averages would settle at if the weights
    stopped changing. Changes nothing. Statistics are `None` without data;
    outputs are an empty list unless `keep_outputs`.
    """
    totals = {layer: [0.0, 0.0] for layer in layers}
    outputs = []
    count = 0
    for batch in batches:
        size = int(keras.tree.flatten(batch)[0].shape[0])
        output, statistics = _batch_statistics(model, layers, batch)
        if keep_outputs:
            outputs.append(output)
        for layer, (mean, variance) in statistics.items():
            totals[layer][0] = totals[layer][0] + size * mean
            totals[layer][1] = totals[layer][1] + size * variance
        count += size
    if count == 0:
        return outputs, None
    return outputs, {
        layer: (mean_sum / count, variance_sum / count)
        for layer, (mean_sum, variance_sum) in totals.items()
    }


def with_statistics(model, statistics, inputs):
    """Inference-mode outputs with the moving statistics set to `statistics`, changing nothing.

    `statistics`: `{layer: (mean, variance)}`, e.g. from `average_statistics`:
    what the model computes after `recompute_batch_norm_statistics`.
    """
    trainable = [v.value for v in model.trainable_variables]
    values = [v.value for v in model.non_trainable_variables]
    position = _positions(model)
    for layer, (mean, variance) in statistics.items():
        for variable, value in (
            (layer.moving_mean, mean),
            (layer.moving_variance, variance),
        ):
            values[position[id(variable)]] = ops.cast(value, variable.dtype)
    outputs, _ = model.stateless_call(trainable, values, inputs, training=False)
    return outputs


def normalisation_error(layer, mean, variance):
    """RMS over channels of the error (in standard deviations) of the moving statistics."""
    moving_mean = to_float64(layer.moving_mean)
    moving_variance = to_float64(layer.moving_variance)
    moving_std = np.sqrt(moving_variance + layer.epsilon)
    scale = np.sqrt(variance + layer.epsilon) / moving_std
    shift = (mean - moving_mean) / moving_std
    return float(np.sqrt(np.mean(np.square(scale - 1.0) + np.square(shift))))


def in_chunks(inputs, size):
    """`inputs` (arrays or tensors, or a list or dict of them) in slices of `size` rows."""
    count = int(keras.tree.flatten(inputs)[0].shape[0])
    return [
        keras.tree.map_structure(lambda a: a[start : start + size], inputs)
        for start in range(0, count, size)
    ]


def inputs_of(element):
    if isinstance(element, tuple):
        return keras.utils.unpack_x_y_sample_weight(element)[0]
    return element


def as_arrays(x):
    return keras.tree.map_structure(np.asarray, x)


def recompute_batch_norm_statistics(
    model: keras.layers.Layer,
    data: Any,
    steps: int | None = None,
    batch_size: int = 128,
) -> list[str]:
    """Re-estimates the moving statistics of every BatchNormalization layer from data.

    A short training, or a `momentum` close to 1, leaves BatchNormalization's
    moving mean and variance far from the statistics of the batches seen in
    training, and the model then behaves differently in inference mode
    (`evaluate`, `predict`) than in training. This sets each layer's moving
    statistics to the average of its training-mode batch statistics over
    `data`, weighted by batch size, as SWA's `bn_update` does: the value the
    moving average would settle at if the weights stopped changing. Layers
    anywhere in the model are found, also inside nested models and custom
    layers; frozen layers (`trainable=False`) and layers with `momentum=1`
    are left alone. Nothing else changes: no weights, no other layer's
    state, no layer's `momentum`.

    Example:

    ```python
    model.fit(x_train, y_train, epochs=3)
    keras_duq.recompute_batch_norm_statistics(model, x_train[:5000])
    kernel_values = model.predict(x_test)
    ```

    Args:
        model: a Keras model (a `DUQModel` or any other) or layer.
        data: training inputs: an array (or a list or dict of arrays), a
            tuple `(x, y)`, a `tf.data.Dataset` or a `keras.utils.PyDataset`
            yielding batches of `x` or `(x, y[, sample_weight])`, or any
            iterable of such batches. Labels are ignored.
        steps: int >= 1 or `None`, the number of batches to use. `None`
            (default) uses all of `data` once; an endless dataset needs it.
        batch_size: int >= 1, the batch size used for arrays (as in
            training: the statistics are those of batches of this size).
            Defaults to `128`.

    Returns:
        The names of the BatchNormalization layers whose statistics were
        re-estimated.
    """
    caller = "`recompute_batch_norm_statistics`"
    _check_recompute_arguments(data, steps, batch_size, caller)
    layers = _updated_batch_norm_layers(model, caller)
    _, statistics = average_statistics(
        model, layers, _batches(data, batch_size, steps), keep_outputs=False
    )
    if statistics is None:  # an empty stream: arrays were checked above
        raise ValueError(
            f"{caller} received no data: pass training inputs with at least "
            "one example. Received: an empty `data`"
        )
    for layer, (mean, variance) in statistics.items():
        layer.moving_mean.assign(mean.astype(layer.moving_mean.dtype))
        layer.moving_variance.assign(variance.astype(layer.moving_variance.dtype))
        if getattr(layer, "renorm", False):
            layer.moving_stddev.assign(
                np.sqrt(variance + layer.epsilon).astype(layer.moving_stddev.dtype)
            )
    if isinstance(model, keras.Model):
        # Kept on the model: for these weights its statistics are settled by
        # construction (`settled_by_recompute`).
        model._recomputed_statistics = (
            optimizer_steps(model),
            _statistics_fingerprint(model),
        )
    return [layer.name for layer in layers]


def _statistics_fingerprint(model):
    """The sums of every BatchNormalization layer's moving statistics."""
    return tuple(
        float(np.sum(to_float64(variable)))
        for layer in batch_norm_layers(model)
        for variable in (layer.moving_mean, layer.moving_variance)
    )


def _check_recompute_arguments(data, steps, batch_size, caller):
    """Raises, naming `caller`, for arguments the re-estimation cannot use."""
    if steps is not None:
        check_positive_int("steps", steps)
    check_positive_int("batch_size", batch_size)
    if isinstance(data, tuple):
        data = inputs_of(data)
    if steps is None and _is_endless(data):
        raise ValueError(
            f"{caller} received an endless dataset: pass `steps`, the number "
            "of batches to average over. Received: `steps=None`"
        )
    if not _is_stream(data) and _is_empty(data):
        raise ValueError(
            f"{caller} received no data: pass training inputs with at least "
            "one example. Received: an empty `data`"
        )


def _is_endless(data):
    if isinstance(data, keras.utils.PyDataset):
        return data.num_batches is None
    tf = sys.modules.get("tensorflow")
    return (
        tf is not None
        and isinstance(data, tf.data.Dataset)
        and data.cardinality() == tf.data.INFINITE_CARDINALITY
    )


def _updated_batch_norm_layers(model, caller):
    """`batch_norm_layers(model)`, or a `ValueError` naming `caller` when there are none."""
    layers = batch_norm_layers(model)
    if not layers:
        raise ValueError(
            f"{caller} found no BatchNormalization layer that training updates "
            "in this model (none, or all frozen with `trainable=False` or "
            "`momentum=1`): there is nothing to re-estimate. Received: "
            f"`model={model.name!r}`"
        )
    return layers


def _batches(data, batch_size, steps):
    """Batches of inputs from `data` (checked beforehand), at most `steps` of them."""
    if isinstance(data, tuple):
        data = inputs_of(data)
    if _is_stream(data):
        if isinstance(data, keras.utils.PyDataset):
            total = min(n for n in (data.num_batches, steps) if n is not None)
            elements = (data[i] for i in range(total))
        else:
            elements = iter(data)
        for step, element in enumerate(elements):
            if steps is not None and step >= steps:
                return
            yield as_arrays(inputs_of(element))
        return
    chunks = in_chunks(data, batch_size)
    for chunk in chunks if steps is None else chunks[:steps]:
        yield keras.tree.map_structure(np.asarray, chunk)


def _is_stream(data):
    if isinstance(data, keras.utils.PyDataset):
        return True
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(data, tf.data.Dataset):
        return True
    return not isinstance(data, (tuple, list, dict)) and not hasattr(data, "shape")


def _is_empty(data):
    if isinstance(data, tuple):
        data = inputs_of(data)
    arrays = keras.tree.flatten(data)
    return not arrays or any(
        hasattr(a, "shape") and len(a.shape) and int(a.shape[0]) == 0 for a in arrays
    )


_CALLBACK = "`RecomputeBatchNormStatistics`"


class RecomputeBatchNormStatistics(keras.callbacks.Callback):
    """Re-estimates BatchNormalization statistics from data after each epoch of `fit`.

    `keras_duq.recompute_batch_norm_statistics(model, data)` after every
    epoch's training steps: before the validation pass (so `val_` metrics,
    checkpoints, early stopping and the health checks see settled
    statistics) and at the end of `fit`. A short training, or Keras's default
    BatchNormalization `momentum=0.99`, leaves the moving statistics behind
    the weights, and inference mode (`evaluate`, `predict`) computes what
    training never saw. The weights go on
    training with each batch's own statistics and the moving averages go on
    from the re-estimated values; a DUQ model's centroid updates, which
    compute features in inference mode, use them from the next step on.

    `DUQModel.fit` runs this callback before its other callbacks, so that
    they see the re-estimated statistics; with `health_checks=False`, or
    with another model, put it first in `callbacks`. Each re-estimation
    costs one training-mode forward pass over `data` (or `steps` batches of
    it): a few thousand examples suffice.

    Example:

    ```python
    model.fit(
        x_train, y_train, epochs=3, validation_data=(x_val, y_val),
        callbacks=[keras_duq.callbacks.RecomputeBatchNormStatistics(x_train[:10000])],
    )
    ```

    Args:
        data: training inputs, re-read after every epoch: an array (or a list
            or dict of arrays), a tuple `(x, y)`, a `tf.data.Dataset` or a
            `keras.utils.PyDataset` yielding batches of `x` or
            `(x, y[, sample_weight])`. Labels are ignored.
        steps: int >= 1 or `None`, the number of batches to use. `None`
            (default) uses all of `data` once; an endless dataset needs it.
        batch_size: int >= 1, the batch size used for arrays (as in
            training: the statistics are those of batches of this size).
            Defaults to `128`.
    """

    def __init__(self, data: Any, steps: int | None = None, batch_size: int = 128):
        super().__init__()
        _check_recompute_arguments(data, steps, batch_size, _CALLBACK)
        if _is_stream(data) and iter(data) is data:
            raise ValueError(
                f"{_CALLBACK} reads `data` after every epoch, so it needs data "
                "it can read again: arrays, a `tf.data.Dataset` or a "
                "`keras.utils.PyDataset`. Received: a one-time iterator of "
                f"type {type(data).__name__}"
            )
        self.data = data
        self.steps = steps
        self.batch_size = batch_size
        # True from the start of an epoch of `fit` until its re-estimation.
        self._stale = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        # Before the first step, so that a model without BatchNormalization
        # fails before any training.
        _updated_batch_norm_layers(self.model, _CALLBACK)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._stale = True

    def on_test_begin(self, logs: dict | None = None) -> None:
        # Within an epoch of `fit`, this is its validation pass; `evaluate`
        # outside `fit` finds nothing stale and changes nothing.
        self._recompute()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._recompute()

    def _recompute(self) -> None:
        if self._stale:
            recompute_batch_norm_statistics(
                self.model, self.data, self.steps, self.batch_size
            )
            self._stale = False


def settled_by_recompute(model: keras.Model) -> bool:
    """Whether `model`'s statistics are those its last re-estimation set, at the same step."""
    return getattr(model, "_recomputed_statistics", None) == (
        optimizer_steps(model),
        _statistics_fingerprint(model),
    )

"""The DUQ training and evaluation steps on the JAX backend.

Keras's JAX trainer is stateless: a step takes the model's state (trainable,
non-trainable, optimizer and metric variables) and returns the new state. One
training step:

1. Forward pass in training mode under `keras.StatelessScope`. With the
   penalty on, `jax.grad` of `sum_c K_c` with respect to the float inputs
   gives the input gradient whose norm is penalised; an outer `jax.grad`
   differentiates the objective (cross-entropy + `lambda` * penalty + coupled
   L2 weight decay) through it: double backprop by nested differentiation,
   exact through BatchNormalization (JAX differentiates `jnp.var` exactly).
2. Optimizer step (`optimizer.stateless_apply`), then the centroid update
   from features recomputed in inference mode with the new weights. Under
   `keras.distribution.DataParallel` the batch is one global, sharded array,
   so the centroid sums are over the global batch: no explicit all-reduce.
3. Checks. Values cannot be asserted inside a jitted function, so the step
   computes an error code (labels out of range or fractional, non-finite
   inputs, a non-finite loss, gradient or centroid update) and, when it is
   not zero, returns the state it received, unchanged. The code is carried in
   a metric variable, so every later step of the same epoch is a no-op too;
   `make_function`'s wrapper reads it (every few calls, and at the end of the
   epoch), puts the (unchanged) state back into the model's variables and
   raises.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
from keras import ops

from keras_duq import _compat
from keras_duq import _ops
from keras_duq._validation import FRACTIONAL_LABEL_MESSAGE
from keras_duq._validation import NON_FINITE_CENTROID_MESSAGE
from keras_duq._validation import NON_FINITE_INPUT_MESSAGE
from keras_duq._validation import NON_FINITE_STEP_MESSAGE
from keras_duq._validation import is_float
from keras_duq._validation import label_dtype_message
from keras_duq._validation import label_range_message
from keras_duq._validation import label_shape_message
from keras_duq._validation import standardize_inputs

# The log key (and metric name) that carries a step's error code.
ERROR_LOG = "duq_error_code"
# A train or test call's error code is read every this many calls.
CHECK_EVERY = 8
_LABEL_RANGE, _FRACTIONAL_LABEL, _NON_FINITE_INPUT = 1, 2, 3
_NON_FINITE_STEP, _NON_FINITE_CENTROIDS = 4, 5


def error_message(code, num_classes):
    return {
        _LABEL_RANGE: label_range_message(num_classes),
        _FRACTIONAL_LABEL: FRACTIONAL_LABEL_MESSAGE,
        _NON_FINITE_INPUT: NON_FINITE_INPUT_MESSAGE,
        _NON_FINITE_STEP: NON_FINITE_STEP_MESSAGE,
        _NON_FINITE_CENTROIDS: NON_FINITE_CENTROID_MESSAGE,
    }[code]


class ErrorCode(keras.metrics.Metric):
    """Holds the first error code of the epoch (0: none); reset with the metrics."""

    def __init__(self, name=ERROR_LOG, **kwargs):
        super().__init__(name=name, **kwargs)
        self.code = self.add_variable(
            shape=(), initializer="zeros", dtype="float32", name="code"
        )

    def update_state(self, code):
        code = ops.cast(code, "float32")
        current = self.code.value
        self.code.assign(ops.where(current > 0, current, code))

    def result(self):
        return self.code.value


def train_step(model, state, data):
    trainable, non_trainable, optimizer_variables, metrics_variables = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    x, labels_one_hot, sample_weight, code = _prepare_batch(model, x, y, sample_weight)

    def gradients_and_losses(trainable, with_penalty=True):
        def objective(trainable):
            log_kernel, penalty, new_non_trainable = _forward(
                model, trainable, non_trainable, optimizer_variables, x,
                training=True, with_penalty=with_penalty,
            )
            total, bce = model._total_loss(
                log_kernel, penalty, labels_one_hot, sample_weight, trainable,
                training=True,
            )
            if penalty is None and model._lazy_penalty:
                # `lax.cond`'s branches return the same structure.
                penalty = jnp.zeros(log_kernel.shape[:1], "float32")
            with keras.StatelessScope(
                state_mapping=list(zip(model.optimizer.variables, optimizer_variables))
            ):
                scaled = model.optimizer.scale_loss(total)
            return scaled, (total, bce, log_kernel, penalty, new_non_trainable)

        return jax.grad(objective, has_aux=True)(trainable)

    penalised = None
    if model._lazy_penalty:
        iterations = optimizer_variables[
            _index(model.optimizer.variables, model.optimizer.iterations)
        ]
        penalised = model._is_penalty_step(iterations)
        gradients, (total, bce, log_kernel, penalty, new_non_trainable) = jax.lax.cond(
            penalised,
            lambda trainable: gradients_and_losses(trainable, True),
            lambda trainable: gradients_and_losses(trainable, False),
            trainable,
        )
    else:
        gradients, (total, bce, log_kernel, penalty, new_non_trainable) = (
            gradients_and_losses(trainable)
        )
    new_trainable, new_optimizer_variables = model.optimizer.stateless_apply(
        optimizer_variables, gradients, trainable
    )
    # Includes the statistics layers update in the forward pass (BatchNorm).
    finite = _all_finite(gradients + [total] + list(new_non_trainable))
    if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        # It skips such a step itself and lowers the loss scale; the
        # centroids and metrics then stay as they are too.
        applied = finite
    else:
        applied = jnp.array(True)
        code = _first_error(code, jnp.where(finite, 0, _NON_FINITE_STEP))
    new_non_trainable, centroids_finite = _update_centroids(
        model, new_trainable, new_non_trainable, x, labels_one_hot
    )
    code = _first_error(code, jnp.where(centroids_finite | ~applied, 0, _NON_FINITE_CENTROIDS))

    ok = (code == 0) & (_previous_error(model, metrics_variables) == 0)
    commit = ok & applied
    new_metrics_variables, logs = _update_metrics(
        model, metrics_variables, x, y, sample_weight,
        log_kernel, penalty, total, bce, labels_one_hot, code, penalised,
    )
    state = (
        _select(ok, new_trainable, trainable),
        _select(commit, new_non_trainable, non_trainable),
        # A loss-scale-skipped step still lowers the loss scale.
        _select(ok, new_optimizer_variables, optimizer_variables),
        _select_metrics(model, commit, new_metrics_variables, metrics_variables),
    )
    return logs, state


def test_step(model, state, data):
    trainable, non_trainable, metrics_variables = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    x, labels_one_hot, sample_weight, code = _prepare_batch(model, x, y, sample_weight)
    log_kernel, penalty, _ = _forward(model, trainable, non_trainable, None, x, training=False)
    total, bce = model._total_loss(
        log_kernel, penalty, labels_one_hot, sample_weight, trainable
    )
    new_metrics_variables, logs = _update_metrics(
        model, metrics_variables, x, y, sample_weight,
        log_kernel, penalty, total, bce, labels_one_hot, code,
    )
    ok = (code == 0) & (_previous_error(model, metrics_variables) == 0)
    new_metrics_variables = _select_metrics(model, ok, new_metrics_variables, metrics_variables)
    return logs, (trainable, non_trainable, new_metrics_variables)


def make_function(model, make, force):
    """Keras's train/test function, wrapped to raise on a step's error code.

    Reading an error code is a device-to-host transfer, and reading it right
    after the call waits for the step to finish, so the host cannot prepare
    the next one meanwhile. The code a call returns is the first error of
    the epoch so far (the metric keeps it), so the newest one says it all:
    the wrapper reads one every `CHECK_EVERY` calls, the previous call's,
    which is most likely done. Waiting that long is safe because after an
    error every later step is a no-op: the state a later call returns is
    still the one the failed step received. The last call's code is read by
    `check_pending_errors`, which `DUQModel.jax_state_sync` calls at the end
    of every epoch and evaluation. `reproduction/studies/jax_error_check.py` measures
    the difference.
    """
    make(force)
    attribute = "train_function" if make.__name__ == "make_train_function" else "test_function"
    function = getattr(model, attribute)
    if function is None or getattr(function, "_duq_checked", False):
        return function
    pending = _pending(model, attribute)

    def checked(state, *args, **kwargs):
        logs, new_state = function(state, *args, **kwargs)
        previous, pending["code"] = pending["code"], logs.pop(ERROR_LOG, 0)
        pending["calls"] += 1
        if pending["calls"] >= CHECK_EVERY and previous is not None:
            pending["calls"] = 0
            code = int(previous)
            if code:
                pending["code"] = None
                # Keras holds the state outside the variables during `fit`:
                # put the (unchanged) state back into them.
                _assign_state(model, new_state, training=attribute == "train_function")
                _compat.mark_state_restored(model)
                raise ValueError(error_message(code, model.num_classes))
        return logs, new_state

    checked._duq_checked = True
    setattr(model, attribute, checked)
    return checked


def check_pending_errors(model):
    """Raises the last call's error, once the model's variables hold the state."""
    for attribute in ("train_function", "test_function"):
        pending = _pending(model, attribute)
        code, pending["code"], pending["calls"] = pending["code"], None, 0
        if code is not None and int(code):
            raise ValueError(error_message(int(code), model.num_classes))


def _pending(model, attribute):
    # Outside Keras's attribute tracking; one record per function.
    records = model.__dict__.setdefault("_duq_pending_errors", {})
    return records.setdefault(attribute, {"code": None, "calls": 0})


# ------------------------------------------------------------------ pieces


def _forward(model, trainable, non_trainable, optimizer_variables, x, training,
             with_penalty=True):
    """`(log_kernel, penalty or None, new non-trainable values)`, statelessly."""
    mapping = _variable_mapping(model, trainable, non_trainable)
    flat = keras.tree.flatten(x)
    float_positions = [i for i, t in enumerate(flat) if is_float(t.dtype)]

    def log_kernel_values(float_inputs):
        values = list(flat)
        for position, value in zip(float_positions, float_inputs):
            values[position] = value
        inputs = keras.tree.pack_sequence_as(x, values)
        with keras.StatelessScope(state_mapping=mapping) as scope:
            features = model.feature_extractor(inputs, training=training)
            log_kernel = model.duq_output.log_kernel_values(features)
        new_non_trainable = [
            _current(scope, variable, value)
            for variable, value in zip(model.non_trainable_variables, non_trainable)
        ]
        return log_kernel, new_non_trainable

    float_inputs = [flat[i] for i in float_positions]
    if model.gradient_penalty == 0 or not with_penalty:
        log_kernel, new_non_trainable = log_kernel_values(float_inputs)
        return log_kernel, None, new_non_trainable

    scale = _input_gradient_scale(model, optimizer_variables)

    def kernel_sum(float_inputs):
        log_kernel, new_non_trainable = log_kernel_values(float_inputs)
        return jnp.sum(jnp.exp(log_kernel)) * scale, (log_kernel, new_non_trainable)

    input_gradients, (log_kernel, new_non_trainable) = jax.grad(
        kernel_sum, has_aux=True
    )(float_inputs)
    norms = _ops.gradient_norms(
        [jnp.asarray(g, "float32") / scale for g in input_gradients]
    )
    return log_kernel, _ops.gradient_penalty(norms, model.penalty), new_non_trainable


def _input_gradient_scale(model, optimizer_variables):
    """The loss scale, for the penalty's input gradient too (1 without one).

    See `_tensorflow_trainer._input_gradient_scale`: under mixed_float16 the
    input gradient underflows in float16 layers unless it is scaled too.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer_variables is None or not isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ):
        return jnp.float32(1.0)
    with keras.StatelessScope(
        state_mapping=list(zip(optimizer.variables, optimizer_variables))
    ):
        return jnp.asarray(optimizer.scale_loss(1.0), "float32")


def _update_centroids(model, trainable, non_trainable, x, labels_one_hot):
    """Non-trainable values with the centroid update, and whether it is finite."""
    layer = model.duq_output
    mapping = _variable_mapping(model, trainable, non_trainable)
    with keras.StatelessScope(state_mapping=mapping):
        features = model.feature_extractor(x, training=False)
        counts, sums = layer._batch_centroid_statistics(features, labels_one_hot)
        new_counts, new_sums = layer._next_centroid_state(
            layer.centroid_counts.value, layer.centroid_sums.value, counts, sums
        )
    updated = list(non_trainable)
    updated[_index(model.non_trainable_variables, layer.centroid_counts)] = new_counts
    updated[_index(model.non_trainable_variables, layer.centroid_sums)] = new_sums
    return updated, _all_finite([new_counts, new_sums])


def _update_metrics(
    model, metrics_variables, x, y, sample_weight,
    log_kernel, penalty, total, bce, labels_one_hot, code, penalised=None,
):
    mapping = list(zip(model.metrics_variables, metrics_variables))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        model._update_duq_metrics(
            x, y, sample_weight, log_kernel, penalty, total, bce, labels_one_hot,
            penalised,
        )
        model._error_tracker.update_state(code)
        logs = model.get_metrics_result()
        logs[ERROR_LOG] = model._error_tracker.result()
    new_values = [
        _current(scope, variable, value)
        for variable, value in zip(model.metrics_variables, metrics_variables)
    ]
    return new_values, logs


def _select_metrics(model, condition, new, old):
    """Metric values if `condition`, else the old ones, but always the error code."""
    codes = {id(v) for v in model._error_tracker.variables}
    return [
        n if id(variable) in codes else jnp.where(condition, n, o)
        for variable, n, o in zip(model.metrics_variables, new, old)
    ]


def _previous_error(model, metrics_variables):
    position = _index(model.metrics_variables, model._error_tracker.code)
    return metrics_variables[position]


def _prepare_batch(model, x, y, sample_weight):
    """Standardised inputs, one-hot labels, sample weights and an error code."""
    model._check_batch_structure(y)
    x = standardize_inputs(model.feature_extractor.input, x)
    if sample_weight is not None:
        sample_weight = jnp.reshape(jnp.asarray(sample_weight, "float32"), (-1,))
    labels_one_hot, code = _labels_to_one_hot(jnp.asarray(y), model.num_classes)
    inputs_finite = _all_finite([t for t in keras.tree.flatten(x) if is_float(t.dtype)])
    code = _first_error(code, jnp.where(inputs_finite, 0, _NON_FINITE_INPUT))
    return x, labels_one_hot, sample_weight, code


def _labels_to_one_hot(y, num_classes):
    # JAX traces one function per shape, so the label format is always static.
    if y.ndim == 2 and y.shape[-1] == num_classes:
        return y.astype("float32"), jnp.int32(0)
    if not (y.ndim == 1 or (y.ndim == 2 and y.shape[-1] == 1)):
        raise ValueError(label_shape_message(num_classes, tuple(y.shape)))
    labels = jnp.reshape(y, (-1,))
    code = jnp.int32(0)
    if jnp.issubdtype(labels.dtype, jnp.floating):
        whole = jnp.all(labels == jnp.floor(labels))
        code = jnp.where(whole, 0, _FRACTIONAL_LABEL)
    elif not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(label_dtype_message(num_classes, labels.dtype))
    in_range = jnp.all((labels >= 0) & (labels < num_classes))
    code = _first_error(code, jnp.where(in_range, 0, _LABEL_RANGE))
    indices = jnp.clip(labels, 0, num_classes - 1).astype("int32")
    return jax.nn.one_hot(indices, num_classes, dtype="float32"), code


def _assign_state(model, state, training):
    if training:
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        for variable, value in zip(model.optimizer.variables, optimizer_variables):
            variable.assign(value)
    else:
        trainable, non_trainable, metrics_variables = state
    for variables, values in (
        (model.trainable_variables, trainable),
        (model.non_trainable_variables, non_trainable),
        (model.metrics_variables, metrics_variables),
    ):
        for variable, value in zip(variables, values):
            variable.assign(value)


def _first_error(code, new_code):
    return jnp.where(code != 0, code, new_code).astype("int32")


def _all_finite(tensors):
    # Integer state (e.g. a layer's random seed) is always finite.
    checks = [
        jnp.all(jnp.isfinite(t))
        for t in tensors
        if t is not None and jnp.issubdtype(jnp.asarray(t).dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(checks)) if checks else jnp.array(True)


def _select(condition, new, old):
    return [jnp.where(condition, n, o) for n, o in zip(new, old)]


def _variable_mapping(model, trainable, non_trainable):
    """`StatelessScope`'s mapping of the model's variables to these values."""
    return list(zip(model.trainable_variables, trainable)) + list(
        zip(model.non_trainable_variables, non_trainable)
    )


def _current(scope, variable, default):
    value = scope.get_current_value(variable)
    return default if value is None else value


def _index(variables, target):
    for position, variable in enumerate(variables):
        if variable is target:
            return position
    raise ValueError(f"Variable {target.path} is not among the model's variables.")

"""The DUQ training and evaluation steps on the JAX backend.

Keras's JAX trainer is stateless: a step takes the model's state (trainable,
non-trainable, optimizer and metric variables) and returns the new state. One
training step:

1. Forward pass in training mode under `keras.StatelessScope`. With the
   penalty on, `jax.grad` of `sum_c K_c` with respect to the float inputs
   gives the input gradient whose norm is penalised; an outer `jax.grad`
   differentiates the objective (binary cross-entropy + the categorical term +
   `lambda` * penalty + coupled L2 weight decay) through it: double backprop
   by nested differentiation, exact through BatchNormalization (JAX
   differentiates `jnp.var` exactly).
2. Optimizer step (`optimizer.stateless_apply`) and the centroid update
   from features recomputed in inference mode with the step's weights. Under
   `keras.distribution.DataParallel` the batch is one global, sharded array,
   so the centroid sums are over the global batch: no explicit all-reduce.
3. Checks. Values cannot be asserted inside a jitted function, so the step
   computes an error code (labels out of range or fractional, non-finite
   inputs, a non-finite loss, gradient or centroid update) and, when it is
   not zero, returns the state it received, unchanged. The code is carried in
   a metric variable, so every later step of the same epoch is a no-op too;
   `_checked_function`'s wrapper reads it (every few calls, and at the end of the
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
from keras_duq import _trainer
from keras_duq import _validation

# The log key (and metric name) that carries a step's error code.
ERROR_LOG = "duq_error_code"
# A train or test call's error code is read every this many calls.
CHECK_EVERY = 8


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


def _tensor_gradients(function, tensors):
    return jax.grad(function, has_aux=True)(tensors)


def _probe_gradients(function):
    """Gradients with respect to the zero probes of `function(probe)`.

    `jax.grad` differentiates with respect to arguments, so the probes are
    arguments, made after a trace without values (`jax.eval_shape`) that
    finds their shapes.
    """
    shapes = []

    def record(tensor):
        shapes.append(jax.ShapeDtypeStruct(tensor.shape, tensor.dtype))
        return tensor

    jax.eval_shape(lambda: function(record))

    def with_probes(probes):
        remaining = iter(probes)
        return function(lambda tensor: tensor + next(remaining))

    probes = [jnp.zeros(shape.shape, shape.dtype) for shape in shapes]
    return _tensor_gradients(with_probes, probes)


_INPUT_GRADIENTS = _trainer.InputGradients(_tensor_gradients, _probe_gradients)


class JAXTrainer(_trainer.Trainer):
    """DUQModel's steps on Keras's JAX backend."""

    error_tracker_class = ErrorCode
    input_gradients = _INPUT_GRADIENTS

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x, labels_one_hot, sample_weight, code = self._check_batch(x, y, sample_weight)
        batch = _trainer.Batch(x, y, labels_one_hot, sample_weight)
        optimizer = self.optimizer
        scale = self._input_gradient_scale(optimizer_variables)

        def gradients_and_losses(trainable, with_penalty=True):
            def loss(trainable):
                total, (values, forward_state) = self._stateless_objective(
                    (trainable, non_trainable),
                    batch,
                    training=True,
                    with_penalty=with_penalty,
                    scale=scale,
                )
                if values.penalty is None and self._lazy_penalty:
                    # `lax.cond`'s branches return the same structure.
                    zeros = jnp.zeros(values.log_kernel.shape[:1], "float32")
                    values = values._replace(penalty=zeros)
                with keras.StatelessScope(
                    state_mapping=list(zip(optimizer.variables, optimizer_variables))
                ):
                    scaled = optimizer.scale_loss(total)
                return scaled, (values, forward_state)

            gradients, aux = jax.grad(loss, has_aux=True)(trainable)
            return self._clipped(gradients, scale), aux

        penalised = None
        if self._lazy_penalty:
            iterations = optimizer_variables[
                _index(optimizer.variables, optimizer.iterations)
            ]
            penalised = self._is_penalty_step(iterations)
            gradients, (values, forward_state) = jax.lax.cond(
                penalised,
                lambda trainable: gradients_and_losses(trainable, True),
                lambda trainable: gradients_and_losses(trainable, False),
                trainable,
            )
        else:
            gradients, (values, forward_state) = gradients_and_losses(trainable)
        new_trainable, new_optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, gradients, trainable
        )
        # Includes the statistics layers update in the forward pass (BatchNorm).
        finite = _ops.all_finite(
            gradients + [values.objective] + list(forward_state.layer_values)
        )
        if self._uses_loss_scale():
            # It skips such a step itself and lowers the loss scale; the
            # centroids and metrics then stay as they are too.
            applied = finite
        else:
            applied = jnp.array(True)
            code = _trainer.first_error(
                code, jnp.where(finite, 0, _validation.NON_FINITE_STEP)
            )
        new_non_trainable, centroids_finite = self._update_centroids(
            (trainable, non_trainable), forward_state, x, labels_one_hot
        )
        code = _trainer.first_error(
            code,
            jnp.where(centroids_finite | ~applied, 0, _validation.NON_FINITE_CENTROIDS),
        )

        ok = (code == 0) & (self._previous_error(metrics_variables) == 0)
        commit = ok & applied
        new_metrics_variables, logs = self._updated_metrics(
            metrics_variables,
            batch,
            values,
            code,
            penalised,
        )
        state = (
            _select(ok, new_trainable, trainable),
            _select(commit, new_non_trainable, non_trainable),
            # A loss-scale-skipped step still lowers the loss scale.
            _select(ok, new_optimizer_variables, optimizer_variables),
            self._select_metrics(commit, new_metrics_variables, metrics_variables),
        )
        return logs, state

    def _stateless_objective(
        self, variables, batch, training, with_penalty=True, scale=None
    ):
        """`_trainer.objective` on `(trainable, non_trainable)` values."""
        trainable, non_trainable = variables
        return _trainer.objective(
            self._forward(trainable, non_trainable, training=training),
            self.input_gradients,
            batch.x,
            batch.labels_one_hot,
            batch.sample_weight,
            trainable,
            self._objective_settings(training=training, with_penalty=with_penalty),
            scale,
        )

    def test_step(self, state, data):
        trainable, non_trainable, metrics_variables = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x, labels_one_hot, sample_weight, code = self._check_batch(x, y, sample_weight)
        batch = _trainer.Batch(x, y, labels_one_hot, sample_weight)
        _, (values, _) = self._stateless_objective(
            (trainable, non_trainable), batch, training=False
        )
        new_metrics_variables, logs = self._updated_metrics(
            metrics_variables,
            batch,
            values,
            code,
        )
        ok = (code == 0) & (self._previous_error(metrics_variables) == 0)
        new_metrics_variables = self._select_metrics(
            ok, new_metrics_variables, metrics_variables
        )
        return logs, (trainable, non_trainable, new_metrics_variables)

    def make_train_function(self, force=False):
        return self._checked_function(
            super().make_train_function, "train_function", force
        )

    def make_test_function(self, force=False):
        return self._checked_function(
            super().make_test_function, "test_function", force
        )

    def jax_state_sync(self):
        # Keras calls it after every epoch and evaluation; the last step's
        # error code is read here.
        super().jax_state_sync()
        self._check_pending_errors()

    def _checked_function(self, make, attribute, force):
        """Keras's train/test function, wrapped to raise on a step's error code.

        Reading an error code is a device-to-host transfer, and reading it
        right after the call waits for the step to finish, so the host
        cannot prepare the next one meanwhile. The code a call returns is the
        first error of the epoch so far (the metric keeps it), so the newest
        one says it all: the wrapper reads one every `CHECK_EVERY` calls, the
        previous call's, which is most likely done. Waiting that long is safe
        because after an error every later step is a no-op: the state a later
        call returns is still the one the failed step received. The last
        call's code is read by `_check_pending_errors`, which
        `jax_state_sync` calls at the end of every epoch and evaluation.
        """
        make(force)
        function = getattr(self, attribute)
        if function is None or getattr(function, "_duq_checked", False):
            return function
        pending = self._pending(attribute)

        def checked(state, *args, **kwargs):
            logs, new_state = function(state, *args, **kwargs)
            previous, pending["code"] = pending["code"], logs.pop(ERROR_LOG, 0)
            pending["calls"] += 1
            if pending["calls"] >= CHECK_EVERY and previous is not None:
                pending["calls"] = 0
                code = int(previous)
                if code:
                    pending["code"] = None
                    # Keras holds the state outside the variables during
                    # `fit`: put the (unchanged) state back into them.
                    self._assign_state(
                        new_state, training=attribute == "train_function"
                    )
                    _compat.mark_state_restored(self)
                    raise _validation.batch_error(code, self.num_classes)
            return logs, new_state

        checked._duq_checked = True
        setattr(self, attribute, checked)
        return checked

    def _check_pending_errors(self):
        """Raises the last call's error, once the model's variables hold the state."""
        for attribute in ("train_function", "test_function"):
            pending = self._pending(attribute)
            code, pending["code"], pending["calls"] = pending["code"], None, 0
            if code is not None and int(code):
                raise _validation.batch_error(code, self.num_classes)

    def _pending(self, attribute):
        # Outside Keras's attribute tracking; one record per function.
        records = self.__dict__.setdefault("_duq_pending_errors", {})
        return records.setdefault(attribute, {"code": None, "calls": 0})

    def _forward(self, trainable, non_trainable, training):
        """`x -> (log_kernel, ForwardState)`, statelessly: the state holds the
        features and the new non-trainable values."""
        mapping = self._variable_mapping(trainable, non_trainable)

        def forward(x, probe=None):
            with keras.StatelessScope(state_mapping=mapping) as scope:
                log_kernel, features = self._log_kernel_and_features(x, training, probe)
            return log_kernel, _trainer.ForwardState(
                features,
                [
                    _current(scope, variable, value)
                    for variable, value in zip(
                        self.non_trainable_variables, non_trainable
                    )
                ],
            )

        return forward

    def _input_gradient_scale(self, optimizer_variables):
        """The loss scale, for the penalty's input gradient too (or `None`)."""
        if not self._uses_loss_scale():
            return None
        with keras.StatelessScope(
            state_mapping=list(zip(self.optimizer.variables, optimizer_variables))
        ):
            return jnp.asarray(self.optimizer.scale_loss(1.0), "float32")

    def _update_centroids(self, variables, forward_state, x, labels_one_hot):
        """The forward pass's non-trainable values with the centroid update,
        and whether it is finite.

        The update is computed at the step's `(trainable, non_trainable)`
        `variables`, the values the gradients were taken at.
        """
        layer = self.duq_output
        non_trainable = forward_state.layer_values
        with keras.StatelessScope(state_mapping=self._variable_mapping(*variables)):
            values, finite = self._next_centroids(
                x, labels_one_hot, forward_state.features
            )
        updated = list(non_trainable)
        for variable, value in zip(layer._centroid_state, values):
            updated[_index(self.non_trainable_variables, variable)] = value
        return updated, finite

    def _updated_metrics(self, metrics_variables, batch, values, code, penalised=None):
        mapping = list(zip(self.metrics_variables, metrics_variables))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self._update_duq_metrics(batch, values, penalised)
            self._error_tracker.update_state(code)
            logs = self.get_metrics_result()
            logs[ERROR_LOG] = self._error_tracker.result()
        new_values = [
            _current(scope, variable, value)
            for variable, value in zip(self.metrics_variables, metrics_variables)
        ]
        return new_values, logs

    def _select_metrics(self, condition, new, old):
        """Metric values if `condition`, else the old ones, but always the error code."""
        codes = {id(v) for v in self._error_tracker.variables}
        return [
            n if id(variable) in codes else jnp.where(condition, n, o)
            for variable, n, o in zip(self.metrics_variables, new, old)
        ]

    def _previous_error(self, metrics_variables):
        return metrics_variables[
            _index(self.metrics_variables, self._error_tracker.code)
        ]

    def _assign_state(self, state, training):
        if training:
            trainable, non_trainable, optimizer_variables, metrics_variables = state
            for variable, value in zip(self.optimizer.variables, optimizer_variables):
                variable.assign(value)
        else:
            trainable, non_trainable, metrics_variables = state
        for variables, values in (
            (self.trainable_variables, trainable),
            (self.non_trainable_variables, non_trainable),
            (self.metrics_variables, metrics_variables),
        ):
            for variable, value in zip(variables, values):
                variable.assign(value)

    def _variable_mapping(self, trainable, non_trainable):
        """`StatelessScope`'s mapping of the model's variables to these values."""
        return list(zip(self.trainable_variables, trainable)) + list(
            zip(self.non_trainable_variables, non_trainable)
        )


def _select(condition, new, old):
    return [jnp.where(condition, n, o) for n, o in zip(new, old)]


def _current(scope, variable, default):
    value = scope.get_current_value(variable)
    return default if value is None else value


def _index(variables, target):
    for position, variable in enumerate(variables):
        if variable is target:
            return position
    raise ValueError(f"Variable {target.path} is not among the model's variables.")

"""The DUQ training and evaluation steps on the TensorFlow backend.

One training step:

1. Check the batch (`_trainer.check_batch`, as graph assertions): every
   state change of the step runs after them, so a bad batch raises before
   any state changes.
2. `_trainer.objective` in training mode. With the penalty on, a nested
   `tf.GradientTape` takes the input gradient of `sum_c K_c`, whose norm is
   penalised (double backprop). The outer tape differentiates the objective:
   binary cross-entropy + the categorical term + `lambda` * penalty + coupled
   L2 weight decay.
   The forward pass runs in a `keras.StatelessScope`: the layer state it
   writes (BatchNorm's statistics, spectrally normalised kernels) comes back
   as values. The centroid update is computed from features recomputed in
   inference mode, and not assigned either.
3. Check: a step whose loss, gradients, layer writes or centroid update are
   not finite fails its graph assertion before anything is assigned. Under
   a `LossScaleOptimizer` a non-finite step is skipped instead and the scale
   lowered (a normal event in float16).
4. Commit, after the checks: layer state, optimizer step, centroids and
   metrics. Nothing is copied and nothing is put back.

With `jit_compile`, step 2 (gradients, layer writes and the centroid
update's features) is compiled by XLA, while the checks and the commit stay
in the TensorFlow graph around it: XLA drops assertion ops without a word.

Batch moments differentiated twice: `tf.nn.moments`, which Keras's
`BatchNormalization` and `GroupNormalization` use on this backend, computes
the variance around `stop_gradient(mean)`. The first derivative is exact,
but the penalty differentiates an input gradient, and the second loses a
term: every weight below a normalization layer gets a slightly wrong penalty
gradient (a bias feeding `BatchNormalization` gets a nonzero one). While the
step builds its forward pass, `second_order_moments()` makes Keras use
`moments`, the same values (bitwise) without the `stop_gradient`.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf
from keras import ops

from keras_duq import _compat
from keras_duq import _ops
from keras_duq import _trainer
from keras_duq import _validation
from keras_duq._validation import NON_FINITE_CENTROID_MESSAGE
from keras_duq._validation import NON_FINITE_STEP_MESSAGE
from keras_duq._validation import label_shape_message


def moments(
    x: tf.Tensor, axes: int | list[int] | tuple[int, ...], keepdims: bool = False
) -> tuple[tf.Tensor, tf.Tensor]:
    """Mean and (biased) variance of `x` over `axes`, twice differentiable.

    The same operations as `tf.nn.moments`, but the variance stays a function
    of the mean in the gradient graph.
    """
    mean = tf.reduce_mean(x, axes, keepdims=True)
    variance = tf.reduce_mean(tf.math.squared_difference(x, mean), axes, keepdims=True)
    if not keepdims:
        mean = tf.squeeze(mean, axes)
        variance = tf.squeeze(variance, axes)
    return mean, variance


def second_order_moments() -> contextlib.AbstractContextManager[None]:
    """Within the block, Keras layers compute batch moments with `moments`.

    Nested and concurrent blocks share one swap (see `_compat`). Any other
    code that runs meanwhile gets the same values as without the swap.
    """
    return _compat.swap_batch_moments(moments)


def _tensor_gradients(function, tensors):
    """Gradients of `function(tensors)[0]`, themselves differentiable (nested tape)."""
    with _nested_tape() as tape:
        tape.watch(tensors)
        value, aux = function(tensors)
    return tape.gradient(value, tensors), aux


def _probe_gradients(function):
    """Gradients with respect to the zero probes of `function(probe)` (nested tape)."""
    probes = []

    def probe(tensor):
        zeros = tf.zeros_like(tensor)
        tape.watch(zeros)
        probes.append(zeros)
        return tensor + zeros

    with _nested_tape() as tape:
        value, aux = function(probe)
    return tape.gradient(value, probes), aux


@contextlib.contextmanager
def _nested_tape():
    with (
        tf.GradientTape(watch_accessed_variables=False) as tape,
        second_order_moments(),
    ):
        yield tape


_INPUT_GRADIENTS = _trainer.InputGradients(_tensor_gradients, _probe_gradients)


class TensorFlowTrainer(_trainer.UncompiledSteps, _trainer.Trainer):
    """DUQModel's steps on Keras's TensorFlow backend."""

    input_gradients = _INPUT_GRADIENTS

    def make_train_function(self, force=False):
        return self._checked_function(
            "train_function", super().make_train_function, force
        )

    def make_test_function(self, force=False):
        return self._checked_function(
            "test_function", super().make_test_function, force
        )

    def _checked_function(self, attribute, make, force):
        """Keras's train/test function, raising a `DUQBatchError` where a
        step's checks failed (TensorFlow raises a graph error for them)."""
        self._error_code()
        make(force)
        function = getattr(self, attribute)
        if function is None or getattr(function, "_duq_checked", False):
            return function

        def checked(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except tf.errors.InvalidArgumentError as error:
                rejected = self._batch_error(error)
                if rejected is None:
                    raise
                raise rejected from error

        checked._duq_checked = True
        setattr(self, attribute, checked)
        return checked

    def _error_code(self):
        """The variable a step writes its error code into before its checks
        fail, so that the graph error they raise can be told apart.

        Made before the steps are traced, outside Keras's tracking (it is no
        weight), one copy per replica (read with `_batch_error`).
        """
        variable = self.__dict__.get("_duq_error_code")
        if variable is None:
            with tf.init_scope(), self.distribute_strategy.scope():
                variable = tf.Variable(
                    0,
                    dtype=tf.int32,
                    trainable=False,
                    name="duq_error_code",
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.SUM,
                )
            self.__dict__["_duq_error_code"] = variable
        return variable

    def _recorded(self, code):
        """`code` (0: none) written into `_error_code()`; the written value."""
        return self._error_code().assign(tf.cast(code, tf.int32))

    def _batch_error(self, error):
        if isinstance(error, tf.errors.InvalidArgumentError):
            variable = self.__dict__.get("_duq_error_code")
            if variable is None:
                return None
            strategy = self.distribute_strategy
            code = max(
                int(v.numpy()) for v in strategy.experimental_local_results(variable)
            )
            if code:
                variable.assign(0)
                return _validation.batch_error(code, self.num_classes)
        return super()._batch_error(error)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x, labels_one_hot, sample_weight, checks = self._validated_batch(
            x, y, sample_weight
        )
        weights = self.trainable_weights
        optimizer = self.optimizer
        layer_state = self._layer_state()

        def compute(x, labels_one_hot, sample_weight, with_penalty=True):
            # Nothing here assigns a variable: the layers' writes (BatchNorm's
            # statistics) come back as values, committed after the checks.
            with tf.GradientTape() as tape, keras.StatelessScope() as scope:
                total, (values, state) = self._own_objective(
                    _trainer.Batch(x, y, labels_one_hot, sample_weight),
                    training=True,
                    weights=weights,
                    with_penalty=with_penalty,
                )
                # Replicas' gradients are summed: divide by their number.
                scaled = total / tf.distribute.get_strategy().num_replicas_in_sync
                scaled = optimizer.scale_loss(scaled)
            gradients = tape.gradient(scaled, weights)
            writes = _trainer.written_values(scope, layer_state)
            centroids = self._next_centroids(x, labels_one_hot, state.features)
            return gradients, values, writes, centroids

        penalised = None
        if self._lazy_penalty:
            penalised = self._is_penalty_step(optimizer.iterations)
            compute = _lazy(self, compute, penalised, weights, layer_state)
        else:
            compute = _maybe_xla(self, compute)
        gradients, values, writes, centroids = compute(x, labels_one_hot, sample_weight)
        gradients = self._clipped_as_one_batch(gradients)
        finite = _ops.all_finite(gradients + [values.objective] + writes)
        code = _trainer.step_error(finite, centroids.finite)
        if self._uses_loss_scale():
            # It skips a non-finite step itself and lowers the loss scale.
            applied = finite
            code = tf.where(finite, code, 0)
        else:
            applied = None
        with tf.control_dependencies([self._recorded(code)]):
            checks = checks + [
                tf.debugging.Assert(tf.not_equal(code, error), [message])
                for error, message in (
                    (_validation.NON_FINITE_STEP, NON_FINITE_STEP_MESSAGE),
                    (_validation.NON_FINITE_CENTROIDS, NON_FINITE_CENTROID_MESSAGE),
                )
            ]
        # The commit: every state change of the step (layer state, weights,
        # optimizer slots and `iterations`, centroids, metrics) runs after
        # the checks, so a failed check changes nothing.
        with tf.control_dependencies(checks):
            committed = _run_if(applied, lambda: _assign(layer_state, writes))
            with tf.control_dependencies([committed]):
                gradients = [None if g is None else tf.identity(g) for g in gradients]
                optimizer.apply(gradients, weights)
            _run_if(
                applied,
                lambda: self.duq_output._assign_centroid_state(centroids.values),
            )
            # A skipped step's loss may be inf (the scaled input gradient): not logged.
            _run_if(
                applied,
                lambda: self._update_duq_metrics(
                    _trainer.Batch(x, y, labels_one_hot, sample_weight),
                    values,
                    penalised,
                ),
            )
        return self._logs()

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x, labels_one_hot, sample_weight, _ = self._validated_batch(x, y, sample_weight)

        def step_values(x, labels_one_hot, sample_weight):
            _, (values, _) = self._own_objective(
                _trainer.Batch(x, y, labels_one_hot, sample_weight), training=False
            )
            return values

        values = _maybe_xla(self, step_values)(x, labels_one_hot, sample_weight)
        self._update_duq_metrics(
            _trainer.Batch(x, y, labels_one_hot, sample_weight), values
        )
        return self._logs()

    @staticmethod
    def prepare_arguments(method, arguments):
        return _quiet_array_inputs(method, arguments)

    def _validated_batch(self, x, y, sample_weight):
        """`(x, labels_one_hot, sample_weight, checks)`: the checks as graph ops.

        Every tensor the step uses depends on them, and the step's state
        changes run after them, so a bad batch raises before any state
        changes.
        """
        x, labels_one_hot, sample_weight, code = self._check_batch(x, y, sample_weight)
        with tf.control_dependencies([self._recorded(code)]):
            checks = [
                tf.debugging.Assert(
                    tf.not_equal(code, error),
                    [_validation.error_message(error, self.num_classes)],
                )
                for error in _validation.BATCH_ERRORS
            ]
        with tf.control_dependencies(checks):
            x, labels_one_hot, sample_weight = tf.nest.map_structure(
                lambda t: None if t is None else tf.identity(t),
                (x, labels_one_hot, sample_weight),
            )
        return x, labels_one_hot, sample_weight, checks

    def _labels_to_one_hot(self, y):
        return labels_to_one_hot(y, self.num_classes)

    def _log_kernel_and_penalty(self, x, training, with_penalty=True):
        """Forward pass; with the penalty on, also the per-example penalty.

        Used by the tests that check the penalty's gradient.
        """
        if self.gradient_penalty == 0 or not with_penalty:
            return self._log_kernel_and_features(x, training)[0], None
        log_kernel, penalty, _ = _trainer.log_kernel_and_penalty(
            self._own_forward(training),
            self.input_gradients,
            x,
            self.penalty,
            self._input_gradient_scale(),
            self.penalty_input is not None,
        )
        return log_kernel, penalty

    def _input_gradient_scale(self):
        """The loss scale, for the penalty's input gradient too (or `None`)."""
        if not self._uses_loss_scale():
            return None
        return ops.cast(self.optimizer.scale_loss(1.0), "float32")

    def _clipped_as_one_batch(self, gradients):
        """`gradients` clipped (`clipnorm`) as the whole batch's gradient would be.

        With several replicas each holds the gradient of its share of the
        batch, and the optimizer sums them: here each passes on its share of
        the clipped sum instead, so that training matches one device.
        Embedding gradients (`tf.IndexedSlices`) are clipped by the norm of
        their values, as the optimizer's own `clipnorm` clips them.
        """
        if self._clipnorm_in_effect() is None:
            return gradients
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:
            indices = [i for i, g in enumerate(gradients) if g is not None]
            summed = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, [gradients[i] for i in indices]
            )
            gradients = list(gradients)
            for i, gradient in zip(indices, summed):
                gradients[i] = _scaled(gradient, 1.0 / replicas)
        sparse = [isinstance(g, tf.IndexedSlices) for g in gradients]
        values = [g.values if s else g for g, s in zip(gradients, sparse)]
        # The bound scales with the replicas' shares too.
        scale = self._input_gradient_scale()
        if replicas > 1:
            scale = (1.0 if scale is None else scale) / replicas
        values = self._clipped(values, scale)
        return [
            tf.IndexedSlices(v, g.indices, g.dense_shape) if s else v
            for g, v, s in zip(gradients, values, sparse)
        ]

    def _logs(self):
        logs = self.get_metrics_result()
        if _compat.is_multi_worker(tf.distribute.get_strategy()):
            # Keras reduces each log over workers with `reduce("MEAN",
            # axis=0)`, which needs a batch axis; metric results are scalars
            # (and already global: mean of equal values).
            logs = {name: ops.reshape(value, (1,)) for name, value in logs.items()}
        return logs


def _lazy(model, compute, penalised, weights, layer_state):
    """`compute` with the penalty only where `penalised` is true.

    Both branches of the `tf.cond` must return the same structure: a missing
    gradient, penalty or layer write becomes zeros inside, and one missing
    in both branches is `None` again outside (the optimizer skips such
    weights; such layer state is not written).
    """
    missing = []

    def branch(with_penalty):
        def run(x, labels_one_hot, sample_weight):
            gradients, values, writes, centroids = compute(
                x, labels_one_hot, sample_weight, with_penalty
            )
            missing.append([g is None for g in gradients + writes])
            gradients = _filled(gradients, weights)
            writes = _filled(writes, layer_state)
            if values.penalty is None:
                zeros = tf.zeros(
                    tf.shape(values.log_kernel)[:1], values.objective.dtype
                )
                values = values._replace(penalty=zeros)
            return gradients, values, writes, centroids

        return _maybe_xla(model, run)

    def run(x, labels_one_hot, sample_weight):
        gradients, values, writes, centroids = tf.cond(
            penalised,
            lambda: branch(True)(x, labels_one_hot, sample_weight),
            lambda: branch(False)(x, labels_one_hot, sample_weight),
        )
        both = gradients + writes
        both = [
            None if all(branch_missing[i] for branch_missing in missing) else t
            for i, t in enumerate(both)
        ]
        return both[: len(gradients)], values, both[len(gradients) :], centroids

    return run


def _filled(tensors, variables):
    """`tensors` with zeros of each variable's shape in place of `None`."""
    return [
        tf.zeros_like(v) if t is None else tf.convert_to_tensor(t)
        for t, v in zip(tensors, variables)
    ]


def _maybe_xla(model, function):
    if model.jit_compile and not model.run_eagerly:
        # No tensor-dependent Python control flow inside: no AutoGraph.
        return tf.function(function, jit_compile=True, autograph=False)
    return function


def _scaled(gradient, factor):
    """`factor * gradient`, dense or `tf.IndexedSlices`."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            gradient.values * factor, gradient.indices, gradient.dense_shape
        )
    return gradient * factor


def _assign(variables, values):
    """Assigns each value that is not `None`; returns a tensor to depend on."""
    for variable, value in zip(variables, values):
        if value is not None:
            variable.assign(value)
    return tf.constant(True)


def _run_if(condition, function):
    """Runs `function` (for its effects) if `condition`; always if it is `None`.

    Returns a tensor that later state changes can depend on.
    """
    if condition is None:
        function()
        return tf.constant(True)

    def run():
        function()
        return tf.constant(True)

    return tf.cond(condition, run, lambda: tf.constant(False))


def labels_to_one_hot(y, num_classes):
    """One-hot float32 labels and the error code of their values.

    Keras retraces a TensorFlow step with relaxed shapes when the label shape
    changes between calls, so a step may see labels whose rank or last axis
    is unknown while it is traced. Labels of known format take the
    backend-neutral path (`_trainer.labels_to_one_hot`); these are decided in
    the graph.
    """
    y = tf.convert_to_tensor(y)
    rank = y.shape.rank
    if rank is not None and (rank == 1 or (rank == 2 and y.shape[-1] is not None)):
        return _trainer.labels_to_one_hot(y, num_classes)
    if rank is not None and rank not in (1, 2):
        raise ValueError(label_shape_message(num_classes, y.shape))
    # Checks the dtype before anything runs.
    _trainer.labels_to_one_hot(tf.zeros((0,), y.dtype), num_classes)
    return _labels_of_unknown_format(y, num_classes)


def _labels_of_unknown_format(y, num_classes):
    rank = tf.rank(y)
    # The size of the last axis, read as 1 for rank-1 labels.
    last = tf.shape(tf.reshape(y, (tf.shape(y)[0], -1)))[-1]
    is_one_hot = tf.logical_and(tf.equal(rank, 2), tf.equal(last, num_classes))
    is_indices = tf.logical_or(
        tf.equal(rank, 1), tf.logical_and(tf.equal(rank, 2), tf.equal(last, 1))
    )
    flat = tf.reshape(y, (-1,))
    # One-hot labels pass the index checks trivially: they only bind for indices.
    candidate = tf.where(is_one_hot, tf.zeros_like(flat), flat)
    indices_one_hot, code = _trainer.labels_to_one_hot(candidate, num_classes)
    # A shape that is neither is the batch's error, before its values'.
    shape_code = tf.where(
        tf.logical_or(is_one_hot, is_indices), 0, _validation.LABEL_SHAPE
    )
    code = _trainer.first_error(tf.cast(shape_code, code.dtype), code)
    one_hot = tf.cond(
        is_one_hot,
        lambda: tf.cast(tf.reshape(flat, (-1, num_classes)), "float32"),
        lambda: indices_one_hot,
    )
    row_code = tf.cond(
        is_one_hot,
        lambda: ops.max(_validation.one_hot_codes(one_hot, ops), initial=0),
        lambda: tf.zeros((), code.dtype),
    )
    code = _trainer.first_error(code, tf.cast(row_code, code.dtype))
    return one_hot, code


def _quiet_array_inputs(method, arguments):
    """`fit`/`evaluate`/`predict` arguments, in-memory arrays fed without autotuning.

    Keras feeds arrays through a `tf.data` pipeline with autotuning on, and
    dropping such an iterator before its end, as `fit` does after each
    epoch's last step, sometimes waits for the autotuning thread's next
    wake-up. The same pipeline with autotuning off gives the same batches
    without the wait. `arguments` maps every parameter
    name of the Keras method to its value; datasets, generators and other
    inputs pass through unchanged.
    """
    arguments = dict(arguments)
    x, y, weights = (arguments.get(k) for k in ("x", "y", "sample_weight"))
    if not _compat.is_array_data(x, y, weights):
        return arguments
    if method == "predict":
        arguments["x"] = _compat.array_dataset(
            x, batch_size=arguments["batch_size"], steps=arguments["steps"]
        )
        arguments["batch_size"] = None
        return arguments
    if method == "evaluate":
        arguments["x"] = _compat.array_dataset(
            x, y, weights, batch_size=arguments["batch_size"], steps=arguments["steps"]
        )
        arguments.update(y=None, sample_weight=None, batch_size=None)
        return arguments
    if arguments["validation_split"] and arguments["validation_data"] is None:
        (x, y, weights), validation = _compat.split_validation(
            (x, y, weights), arguments["validation_split"]
        )
        arguments.update(validation_data=validation, validation_split=0.0)
    validation = arguments["validation_data"]
    if validation is not None:
        val_x, val_y, val_weights = keras.utils.unpack_x_y_sample_weight(validation)
        if _compat.is_array_data(val_x, val_y, val_weights):
            arguments["validation_data"] = _compat.array_dataset(
                val_x,
                val_y,
                val_weights,
                batch_size=arguments["validation_batch_size"]
                or arguments["batch_size"],
                steps=arguments["validation_steps"],
            )
            arguments["validation_batch_size"] = None
    arguments["x"] = _compat.array_dataset(
        x,
        y,
        weights,
        batch_size=arguments["batch_size"],
        steps=arguments["steps_per_epoch"],
        shuffle=arguments["shuffle"],
        class_weight=arguments["class_weight"],
    )
    arguments.update(
        y=None, sample_weight=None, class_weight=None, batch_size=None, shuffle=False
    )
    return arguments

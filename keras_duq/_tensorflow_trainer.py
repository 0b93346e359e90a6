"""The DUQ training and evaluation steps on the TensorFlow backend.

One training step:

1. Check the batch (`_tensorflow_batch`): a bad batch raises here, before
   any state changes.
2. Forward pass in training mode. With the penalty on, a nested
   `tf.GradientTape` takes the input gradient of `sum_c K_c`, whose norm is
   penalised (double backprop). The outer tape differentiates the objective:
   cross-entropy + `lambda` * penalty + coupled L2 weight decay.
3. Guard: a step whose loss, gradients or layer state written in the
   forward pass (BatchNorm's statistics, spectrally normalised kernels;
   restored from a copy) are not finite is never applied. Under a
   `LossScaleOptimizer` it is skipped and the scale lowered (a normal event
   in float16); otherwise training stops with an error naming causes. The
   centroid update is checked the same way before it is assigned.
4. Optimizer step, then the centroid moving-average update from features
   recomputed in inference mode with the updated weights.

With `jit_compile`, steps 2 and 4's feature computation are compiled by XLA,
while the checks and the state updates stay in the TensorFlow graph around
them: XLA drops assertion ops without a word.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_duq import _compat
from keras_duq import _moments
from keras_duq import _ops
from keras_duq._tensorflow_batch import validate_batch
from keras_duq._validation import NON_FINITE_CENTROID_MESSAGE
from keras_duq._validation import NON_FINITE_STEP_MESSAGE
from keras_duq._validation import is_float


def train_step(model, data):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    x, labels_one_hot, sample_weight = validate_batch(model, x, y, sample_weight)
    weights = model.trainable_weights

    def gradients_and_losses(x, labels_one_hot, sample_weight, with_penalty=True):
        with tf.GradientTape() as tape:
            log_kernel, penalty, objective, bce = _objective(
                model, x, labels_one_hot, sample_weight, training=True,
                with_penalty=with_penalty,
            )
            # Replicas' gradients are summed: divide by their number.
            scaled = objective / tf.distribute.get_strategy().num_replicas_in_sync
            scaled = model.optimizer.scale_loss(scaled)
        gradients = tape.gradient(scaled, weights)
        return gradients, log_kernel, penalty, objective, bce

    # Layers write state in the forward pass (BatchNormalization's moving
    # mean and variance), before the check can run: keep a copy, to put back
    # if the step fails it.
    layer_state = _layer_state(model)
    saved = [tf.identity(variable) for variable in layer_state]
    penalised = None
    if model._lazy_penalty:
        penalised = model._is_penalty_step(model.optimizer.iterations)
        gradients, log_kernel, penalty, objective, bce = _lazy(
            model, gradients_and_losses, penalised, weights
        )(x, labels_one_hot, sample_weight)
    else:
        gradients, log_kernel, penalty, objective, bce = _maybe_xla(
            model, gradients_and_losses
        )(x, labels_one_hot, sample_weight)
    finite = _all_finite(
        gradients + [objective] + [tf.identity(variable) for variable in layer_state]
    )
    restored = _restore_unless(finite, layer_state, saved)
    if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        # It skips such a step itself and lowers the loss scale.
        applied = finite
    else:
        applied = None
        # Every state change of the step (weights, optimizer slots,
        # centroids) depends on the check, so a failed check changes nothing.
        with tf.control_dependencies([restored]):
            check = tf.debugging.Assert(finite, [NON_FINITE_STEP_MESSAGE])
        with tf.control_dependencies([check]):
            gradients = [None if g is None else tf.identity(g) for g in gradients]
            x, labels_one_hot = tf.nest.map_structure(
                tf.identity, (x, labels_one_hot)
            )
    model.optimizer.apply(gradients, weights)
    _run_if(applied, lambda: _update_centroids(model, x, labels_one_hot))
    # A skipped step's loss may be inf (the scaled input gradient): not logged.
    _run_if(
        applied,
        lambda: model._update_duq_metrics(
            x, y, sample_weight, log_kernel, penalty, objective, bce, labels_one_hot,
            penalised,
        ),
    )
    return _logs(model)


def test_step(model, data):
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    x, labels_one_hot, sample_weight = validate_batch(model, x, y, sample_weight)
    log_kernel, penalty, objective, bce = _maybe_xla(
        model,
        lambda x, labels_one_hot, sample_weight: _objective(
            model, x, labels_one_hot, sample_weight, training=False
        ),
    )(x, labels_one_hot, sample_weight)
    model._update_duq_metrics(
        x, y, sample_weight, log_kernel, penalty, objective, bce, labels_one_hot
    )
    return _logs(model)


def make_function(model, make, force):
    """Keras's train/test function, never compiled whole by XLA.

    XLA drops `Assert` ops without a word, so a function compiled whole would
    skip the batch checks and let a bad batch change the weights. With
    `jit_compile` on, the step compiles its computation with XLA itself
    (`_maybe_xla`) and keeps the checks and state updates around it.
    """
    jit_compile = model.jit_compile
    model.jit_compile = False
    try:
        return make(force)
    finally:
        model.jit_compile = jit_compile


def quiet_array_inputs(method, arguments):
    """`fit`/`evaluate`/`predict` arguments, in-memory arrays fed without autotuning.

    Keras feeds arrays through a `tf.data` pipeline with autotuning on, and
    dropping such an iterator before its end, as `fit` does after each
    epoch's last step, sometimes waits for the autotuning thread's next
    wake-up: up to a minute. Measured, a whole `fit` took 1.9-2.0x the sum of
    its steps (docs/performance.md). The same pipeline with autotuning off
    gives the same batches without the wait. `arguments` maps every parameter
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
                batch_size=arguments["validation_batch_size"] or arguments["batch_size"],
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


def _objective(model, x, labels_one_hot, sample_weight, training, with_penalty=True):
    """Kernel values (log), penalty, full objective and its BCE part."""
    log_kernel, penalty = _log_kernel_and_penalty(
        model, x, training=training, with_penalty=with_penalty
    )
    objective, bce = model._total_loss(
        log_kernel, penalty, labels_one_hot, sample_weight, model.trainable_weights,
        training=training,
    )
    return log_kernel, penalty, objective, bce


def _lazy(model, gradients_and_losses, penalised, weights):
    """`gradients_and_losses` with the penalty only where `penalised` is true.

    Both branches of the `tf.cond` must return the same structure: a missing
    gradient or penalty becomes zeros inside, and a gradient missing in both
    branches is `None` again outside (the optimizer skips those weights).
    """
    missing = []

    def branch(with_penalty):
        def run(x, labels_one_hot, sample_weight):
            gradients, log_kernel, penalty, objective, bce = gradients_and_losses(
                x, labels_one_hot, sample_weight, with_penalty
            )
            missing.append([g is None for g in gradients])
            gradients = [
                tf.zeros_like(w) if g is None else tf.convert_to_tensor(g)
                for g, w in zip(gradients, weights)
            ]
            if penalty is None:
                penalty = tf.zeros(tf.shape(log_kernel)[:1], dtype=objective.dtype)
            return gradients, log_kernel, penalty, objective, bce

        return _maybe_xla(model, run)

    def step(x, labels_one_hot, sample_weight):
        return tf.cond(
            penalised,
            lambda: branch(True)(x, labels_one_hot, sample_weight),
            lambda: branch(False)(x, labels_one_hot, sample_weight),
        )

    def run(x, labels_one_hot, sample_weight):
        gradients, *rest = step(x, labels_one_hot, sample_weight)
        gradients = [
            None if all(branch_missing[i] for branch_missing in missing) else g
            for i, g in enumerate(gradients)
        ]
        return (gradients, *rest)

    return run


def _log_kernel_and_penalty(model, x, training, with_penalty=True):
    """Forward pass; with the penalty on, also the per-example penalty."""
    if model.gradient_penalty == 0 or not with_penalty:
        features = model.feature_extractor(x, training=training)
        return model.duq_output.log_kernel_values(features), None
    float_inputs = [t for t in tf.nest.flatten(x) if is_float(t.dtype)]
    scale = _input_gradient_scale(model)
    with (
        tf.GradientTape(watch_accessed_variables=False) as inner_tape,
        _moments.second_order_moments(),
    ):
        inner_tape.watch(float_inputs)
        features = model.feature_extractor(x, training=training)
        log_kernel = model.duq_output.log_kernel_values(features)
        kernel_sum = ops.sum(ops.exp(log_kernel))
        if scale is not None:
            kernel_sum = kernel_sum * scale
    input_gradients = inner_tape.gradient(kernel_sum, float_inputs)
    if scale is not None:
        input_gradients = [
            None if g is None else ops.cast(g, "float32") / scale
            for g in input_gradients
        ]
    norms = _ops.gradient_norms(input_gradients)
    return log_kernel, _ops.gradient_penalty(norms, model.penalty)


def _input_gradient_scale(model):
    """The loss scale, for the penalty's input gradient too (or `None`).

    Under mixed_float16 the input gradient flows back through float16 layers,
    where small values underflow to zero just as weight gradients do. Scaling
    `sum_c K_c` by the optimizer's dynamic loss scale (a power of two: exact)
    keeps them; an overflow makes the penalty, and so the gradients,
    non-finite, and the optimizer then skips the step and lowers the scale.
    """
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    return ops.cast(optimizer.scale_loss(1.0), "float32")


def _update_centroids(model, x, labels_one_hot):
    features = _maybe_xla(
        model, lambda x: model.feature_extractor(x, training=False)
    )(x)
    model.duq_output.update_centroids(features, labels_one_hot)


def assign_centroid_state(layer, counts, sums):
    """All-reduces a batch's centroid statistics, checks the new state, assigns it."""
    replica_context = tf.distribute.get_replica_context()
    if replica_context is not None and replica_context.num_replicas_in_sync > 1:
        counts, sums = replica_context.all_reduce(
            tf.distribute.ReduceOp.SUM, [counts, sums]
        )
    new_counts, new_sums = layer._next_centroid_state(
        layer.centroid_counts, layer.centroid_sums, counts, sums
    )
    # Features that overflow (e.g. unnormalised inputs) must not turn the
    # centroids into Inf/NaN for good: check before assigning.
    check = tf.debugging.Assert(
        _all_finite([new_counts, new_sums]), [NON_FINITE_CENTROID_MESSAGE]
    )
    with tf.control_dependencies([check]):
        layer.centroid_counts.assign(new_counts)
        layer.centroid_sums.assign(new_sums)


def _logs(model):
    logs = model.get_metrics_result()
    if _compat.is_multi_worker(tf.distribute.get_strategy()):
        # Keras reduces each log over workers with `reduce("MEAN", axis=0)`,
        # which needs a batch axis; metric results are scalars (and already
        # global: mean of equal values).
        logs = {name: ops.reshape(value, (1,)) for name, value in logs.items()}
    return logs


def _maybe_xla(model, function):
    if model.jit_compile and not model.run_eagerly:
        # No tensor-dependent Python control flow inside: no AutoGraph.
        return tf.function(function, jit_compile=True, autograph=False)
    return function


def _layer_state(model):
    """Variables that layers assign in the forward pass.

    Non-trainable state (BatchNormalization's moving statistics), and the
    kernels of Keras's `SpectralNormalization`, which writes the normalised
    kernel back into the wrapped layer's trainable kernel.
    """
    centroid_state = (model.duq_output.centroid_counts, model.duq_output.centroid_sums)
    state = [
        variable
        for variable in model.non_trainable_variables
        if all(variable is not other for other in centroid_state)
    ]
    return state + [
        layer.kernel
        for layer in _compat.all_layers(model.feature_extractor)
        if isinstance(layer, keras.layers.SpectralNormalization)
    ]


def _restore_unless(condition, variables, saved):
    """Assigns `saved` back to `variables` unless `condition`; returns a tensor."""

    def restore():
        for variable, value in zip(variables, saved):
            variable.assign(value)
        return tf.constant(False)

    return tf.cond(condition, lambda: tf.constant(True), restore)


def _all_finite(tensors):
    checks = []
    for tensor in tensors:
        if tensor is None:
            continue
        if isinstance(tensor, tf.IndexedSlices):
            tensor = tensor.values
        if not tensor.dtype.is_floating:
            continue  # integer state (e.g. a layer's random seed)
        checks.append(tf.reduce_all(tf.math.is_finite(tensor)))
    if not checks:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(checks))


def _run_if(condition, function):
    """Runs `function` (for its effects) if `condition`; always if it is `None`."""
    if condition is None:
        function()
        return

    def run():
        function()
        return tf.constant(True)

    tf.cond(condition, run, lambda: tf.constant(False))

"""The DUQ model: a feature extractor, a `DUQOutput` head and the DUQ training step."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_duq import _moments
from keras_duq import _ops
from keras_duq._duq_output import DUQOutput
from keras_duq._validation import check_non_negative

DEFAULT_GRADIENT_PENALTY = 0.1
DEFAULT_WEIGHT_DECAY = 1e-4


@keras.saving.register_keras_serializable(package="keras_duq")
class DUQModel(keras.Model):
    """A classifier trained with Deterministic Uncertainty Quantification.

    Built like a functional model whose output is a `DUQOutput` layer (or
    with `keras_duq.wrap(backbone, num_classes)`). `fit` runs the DUQ
    training step; `predict` returns kernel values `(batch, num_classes)` in
    `[0, 1]`: the prediction is their argmax and the certainty their max.

    One training step:

    1. Forward pass in training mode; the loss is the binary cross-entropy of
       each kernel value against the one-hot label (computed in log space),
       averaged over classes and batch, plus `gradient_penalty` times the
       penalty on `||grad_x sum_c K_c||_2` (double backprop with a nested
       `tf.GradientTape`), plus the coupled L2 weight decay. In the
       penalty's forward pass, Keras's `BatchNormalization` and
       `GroupNormalization` compute their batch statistics with a formula
       that TensorFlow differentiates exactly twice (`tf.nn.moments`, used
       otherwise, drops a term of the second derivative); the values are
       the same.
    2. Optimizer step on all trainable weights.
    3. Centroid moving-average update from the same batch, with features
       recomputed in inference mode (`DUQOutput.update_centroids`).

    `fit` and `evaluate` log `loss` (the full objective), `bce`,
    `gradient_penalty` (the penalty term before weighting, when the penalty
    is on) and `accuracy`. Metrics passed to `compile(metrics=[...])` get the
    labels as given and the kernel values as `y_pred`. Do not pass a `loss` to
    `compile`: the DUQ loss is built in.

    Labels may be sparse integers `(batch,)` or `(batch, 1)`, or one-hot
    `(batch, num_classes)`. `sample_weight` and `class_weight` weight the
    per-example loss (cross-entropy plus penalty); the centroids are
    unweighted class means, as in the paper.

    Inputs declared floating point that arrive as integers (e.g. `uint8`
    images) are cast to the declared dtype before the penalty's gradient is
    taken. Integer inputs (e.g. token ids for an `Embedding`) are left out of
    the penalty; at least one floating-point input is needed when the
    penalty is on.

    `compile(jit_compile=...)` works as for any Keras model (Keras's
    `"auto"`: XLA on GPUs, not on CPUs). With XLA on, the step's computation
    (forward pass, penalty, gradients, the centroid update's features) is
    compiled by XLA while the batch checks and the state updates stay in the
    TensorFlow graph around it: XLA drops assertion ops without a word, and a
    bad batch must raise before it changes anything.

    References:
        - [van Amersfoort et al., 2020](https://arxiv.org/abs/2003.02037),
          "Uncertainty Estimation Using a Single Deep Deterministic Neural
          Network", ICML 2020.

    Example:

    ```python
    inputs = keras.Input(shape=(2,))
    x = keras.layers.Dense(20, activation="relu")(inputs)
    x = keras.layers.Dense(20, activation="relu")(x)
    outputs = keras_duq.DUQOutput(num_classes=2, length_scale=0.3)(x)
    model = keras_duq.DUQModel(inputs, outputs, gradient_penalty=1.0)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    model.fit(x_train, y_train, epochs=30, batch_size=64)
    kernel_values = model.predict(x_test)
    certainty = kernel_values.max(axis=1)
    ```

    Args:
        inputs: the model's input tensor(s) (`keras.Input`), as for a
            functional model.
        outputs: the output of a `DUQOutput` layer applied to a feature
            tensor computed from `inputs`.
        gradient_penalty: float >= 0, the penalty weight `lambda`. `0` turns
            the penalty off and skips the second gradient tape. Defaults to
            `0.1`; the paper used 0.05 (FashionMNIST), 0.5 (CIFAR-10) and 1.0
            (two moons). Choose it on validation data, e.g. by the
            misclassification AUROC of the certainty.
        penalty: `"two_sided"` (default, `(||g|| - 1)^2`) or `"one_sided"`
            (`max(0, ||g|| - 1)^2`).
        weight_decay: float >= 0, coupled L2 weight decay on every trainable
            weight, as in the paper: each gradient gets `+ weight_decay * w`
            (the loss gets `weight_decay / 2 * sum ||w||^2`). This is
            PyTorch SGD's `weight_decay`, not the decoupled `weight_decay` of
            Keras optimizers. Defaults to `1e-4`, the paper's value.
        bce_epsilon: float >= 0, floor of `K (1 - K)` in the denominator of
            the cross-entropy's gradient with respect to each kernel value
            `K`. `0` (default) gives the exact gradient. `1e-12` gives the
            gradient of PyTorch's `binary_cross_entropy`, as in the paper's
            code: a kernel value far below `1e-12`, as every one is at
            initialisation, then gets almost no gradient until the centroids
            have moved to the class means. The loss value is the same.
        **kwargs: base model keyword arguments such as `name`.
    """

    def __init__(
        self,
        inputs,
        outputs,
        gradient_penalty: float = DEFAULT_GRADIENT_PENALTY,
        penalty: str = "two_sided",
        weight_decay: float = DEFAULT_WEIGHT_DECAY,
        bce_epsilon: float = 0.0,
        **kwargs,
    ):
        check_non_negative("gradient_penalty", gradient_penalty)
        check_non_negative("weight_decay", weight_decay)
        check_non_negative("bce_epsilon", bce_epsilon)
        _ops.validate_penalty(penalty)
        duq_output = _find_duq_output(outputs)
        feature_extractor = keras.Model(
            inputs, duq_output.input, name="feature_extractor"
        )
        if gradient_penalty > 0 and not any(
            _is_float(t.dtype) for t in keras.tree.flatten(inputs)
        ):
            raise ValueError(
                "The gradient penalty is taken with respect to the model's "
                "floating-point inputs, and this model has none (input "
                f"dtypes: {[t.dtype for t in keras.tree.flatten(inputs)]}). "
                "Declare a float input, e.g. `keras.Input(shape, "
                "dtype='float32')`, or pass `gradient_penalty=0`."
            )
        super().__init__(**kwargs)
        self.feature_extractor = feature_extractor
        self.duq_output = duq_output
        self.gradient_penalty = float(gradient_penalty)
        self.penalty = penalty
        self.weight_decay = float(weight_decay)
        self.bce_epsilon = float(bce_epsilon)
        self.num_classes = duq_output.num_classes
        self._bce_tracker = keras.metrics.Mean(name="bce")
        self._penalty_tracker = (
            keras.metrics.Mean(name="gradient_penalty")
            if self.gradient_penalty > 0
            else None
        )
        self._accuracy_tracker = keras.metrics.Mean(name="accuracy")
        self.built = True

    def call(self, inputs, training=None):
        features = self.feature_extractor(inputs, training=training)
        return self.duq_output(features)

    # ---------------------------------------------------------------- steps

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x, labels_one_hot, sample_weight = self._validate_batch(x, y, sample_weight)
        trainable_weights = self.trainable_weights

        def gradients_and_losses(x, labels_one_hot, sample_weight):
            with tf.GradientTape() as tape:
                log_kernel, penalty, objective, bce = self._objective(
                    x, labels_one_hot, sample_weight, training=True
                )
                scaled = _scale_loss_for_distribution(objective)
                scaled = self.optimizer.scale_loss(scaled)
            gradients = tape.gradient(scaled, trainable_weights)
            return gradients, log_kernel, penalty, objective, bce

        gradients, log_kernel, penalty, objective, bce = self._maybe_xla(
            gradients_and_losses
        )(x, labels_one_hot, sample_weight)
        applied = self._step_applied(gradients)
        self.optimizer.apply(gradients, trainable_weights)
        # A skipped step (overflow) leaves the centroids and the metrics alone
        # too: its loss may be inf (the penalty's scaled input gradient).
        _run_if(applied, lambda: self._update_centroids(x, labels_one_hot))
        return self._update_metrics(
            x, y, sample_weight, log_kernel, penalty, objective, bce, labels_one_hot,
            applied,
        )

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x, labels_one_hot, sample_weight = self._validate_batch(x, y, sample_weight)

        log_kernel, penalty, objective, bce = self._maybe_xla(
            lambda x, labels_one_hot, sample_weight: self._objective(
                x, labels_one_hot, sample_weight, training=False
            )
        )(x, labels_one_hot, sample_weight)
        return self._update_metrics(
            x, y, sample_weight, log_kernel, penalty, objective, bce, labels_one_hot
        )

    # XLA drops `Assert` ops without a word, so a train or test function
    # compiled whole by XLA would skip the batch checks and let a bad batch
    # change the weights. With `jit_compile` on, DUQModel compiles the
    # computation with XLA (`_maybe_xla`) and keeps the checks and the state
    # updates in the TensorFlow graph around it.

    def make_train_function(self, force=False):
        return self._make_function_without_outer_xla(super().make_train_function, force)

    def make_test_function(self, force=False):
        return self._make_function_without_outer_xla(super().make_test_function, force)

    def _make_function_without_outer_xla(self, make_function, force):
        jit_compile = self.jit_compile
        self._jit_compile = False
        try:
            return make_function(force)
        finally:
            self._jit_compile = jit_compile

    def _maybe_xla(self, function):
        if self.jit_compile and not self.run_eagerly:
            # No tensor-dependent Python control flow inside: no AutoGraph.
            return tf.function(function, jit_compile=True, autograph=False)
        return function

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras (3.x, TensorFlow backend) builds a distributed model from one
        # batch that it reduces with `strategy.reduce("MEAN", batch)`; the
        # whole `(x, y)` structure at once, which MultiWorkerMirroredStrategy
        # rejects ("Attempt to convert a value (PerReplica...)"), for any
        # Keras model. Only the shapes matter there, so under that strategy
        # the first replica's part of the batch is used instead.
        strategy = getattr(self, "_distribute_strategy", None)
        if iterator is None or not _is_multi_worker(strategy):
            return super()._maybe_symbolic_build(
                iterator=iterator, data_batch=data_batch
            )
        for _, _, batches in iterator:
            data_batch = keras.tree.map_structure(
                lambda value: strategy.experimental_local_results(value)[0],
                next(batches),
            )
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    # -------------------------------------------------------------- helpers

    def _step_applied(self, gradients):
        """Whether the optimizer applies this step: `None` when it always does.

        A `LossScaleOptimizer` skips a step whose gradients are not finite.
        """
        if not isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            return None
        return tf.reduce_all(
            [tf.reduce_all(tf.math.is_finite(g)) for g in gradients if g is not None]
        )

    def _update_centroids(self, x, labels_one_hot):
        features = self._maybe_xla(lambda x: self.feature_extractor(x, training=False))(x)
        self.duq_output.update_centroids(features, labels_one_hot)

    def _log_kernel_and_penalty(self, x, training):
        """Forward pass; with the penalty on, also the per-example penalty."""
        if self.gradient_penalty == 0:
            features = self.feature_extractor(x, training=training)
            return self.duq_output.log_kernel_values(features), None
        float_inputs = [t for t in tf.nest.flatten(x) if _is_float(t.dtype)]
        scale = self._input_gradient_scale()
        with (
            tf.GradientTape(watch_accessed_variables=False) as inner_tape,
            _moments.second_order_moments(),
        ):
            inner_tape.watch(float_inputs)
            features = self.feature_extractor(x, training=training)
            log_kernel = self.duq_output.log_kernel_values(features)
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
        return log_kernel, _ops.gradient_penalty(norms, self.penalty)

    def _input_gradient_scale(self):
        """The loss scale, for the penalty's input gradient too (or `None`).

        Under mixed_float16 the input gradient flows back through float16
        layers, where small values underflow to zero just as weight
        gradients do. Scaling `sum_c K_c` by the optimizer's dynamic loss
        scale (a power of two: exact) keeps them; an overflow makes the
        penalty, and so the gradients, non-finite, and the optimizer then
        skips the step and lowers the scale.
        """
        optimizer = getattr(self, "optimizer", None)
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return None
        return ops.cast(optimizer.scale_loss(1.0), "float32")

    def _objective(self, x, labels_one_hot, sample_weight, training):
        """Kernel values (log), penalty, full objective and its BCE part."""
        log_kernel, penalty = self._log_kernel_and_penalty(x, training=training)
        loss, bce = self._loss(log_kernel, penalty, labels_one_hot, sample_weight)
        objective = loss + _ops.coupled_weight_decay_loss(
            self.trainable_weights, self.weight_decay
        )
        return log_kernel, penalty, objective, bce

    def _loss(self, log_kernel, penalty, labels_one_hot, sample_weight):
        """Mean over the batch of the weighted per-example loss, and its BCE part."""
        bce = _ops.binary_cross_entropy(
            log_kernel, labels_one_hot, self.bce_epsilon
        )
        per_example = bce
        if penalty is not None:
            per_example = bce + self.gradient_penalty * penalty
        if sample_weight is not None:
            per_example = per_example * sample_weight
            bce = bce * sample_weight
        # Keras's "sum_over_batch_size": divide by the number of examples.
        return ops.mean(per_example), ops.mean(bce)

    def _update_metrics(
        self, x, y, sample_weight, log_kernel, penalty, objective, bce, labels_one_hot,
        applied=None,
    ):
        def update():
            batch_size = ops.shape(log_kernel)[0]
            self._loss_tracker.update_state(objective, sample_weight=batch_size)
            self._bce_tracker.update_state(bce, sample_weight=batch_size)
            if penalty is not None:
                self._penalty_tracker.update_state(
                    ops.mean(penalty), sample_weight=batch_size
                )
            correct = ops.cast(
                ops.equal(
                    ops.argmax(log_kernel, axis=-1), ops.argmax(labels_one_hot, axis=-1)
                ),
                "float32",
            )
            self._accuracy_tracker.update_state(correct, sample_weight=sample_weight)
            self.compute_metrics(x, y, ops.exp(log_kernel), sample_weight)

        _run_if(applied, update)
        logs = self.get_metrics_result()
        if _is_multi_worker(tf.distribute.get_strategy()):
            # Keras reduces each log over workers with `reduce("MEAN",
            # axis=0)`, which needs a batch axis; metric results are scalars
            # (and already global: mean of equal values).
            logs = {name: ops.reshape(value, (1,)) for name, value in logs.items()}
        return logs

    def _validate_batch(self, x, y, sample_weight):
        """Checks a batch; returns it with every later op depending on the checks.

        The checks of values (label range, NaN inputs) run in the graph. All
        tensors the step uses are routed through them, so a bad batch raises
        before the optimizer or the centroid update touches any state.
        """
        self._check_compiled_without_loss()
        x = self._standardize_inputs(x)
        if sample_weight is not None:
            sample_weight = ops.reshape(ops.cast(sample_weight, "float32"), (-1,))
        labels_one_hot, checks = self._prepare_labels(y)
        checks += self._input_checks(x)
        if not checks:
            return x, labels_one_hot, sample_weight
        with tf.control_dependencies(checks):
            return tf.nest.map_structure(
                lambda t: None if t is None else tf.identity(t),
                (x, labels_one_hot, sample_weight),
            )

    def _check_compiled_without_loss(self):
        if self.loss is not None:
            raise ValueError(
                "DUQModel computes its own loss (binary cross-entropy on the "
                "kernel values plus the gradient penalty). Remove `loss` from "
                f"`compile()`. Received: `loss={self.loss!r}`"
            )

    def _standardize_inputs(self, x):
        """Casts inputs declared floating point to their declared dtype."""

        def cast(spec, value):
            value = tf.convert_to_tensor(value)
            if _is_float(spec.dtype) and value.dtype != spec.dtype:
                return tf.cast(value, spec.dtype)
            return value

        specs = self.feature_extractor.input
        try:
            return keras.tree.map_structure(cast, specs, x)
        except (ValueError, TypeError):
            # A structure Keras accepts but that differs from the declared
            # one (e.g. a list for a dict); the functional call maps it.
            return tf.nest.map_structure(tf.convert_to_tensor, x)

    def _input_checks(self, x):
        return [
            tf.debugging.assert_all_finite(
                t,
                "DUQModel received an input batch containing NaN or Inf "
                "values. Clean or impute the data before training "
                "(e.g. `np.nan_to_num`); the gradient penalty and the "
                "centroids cannot recover from a non-finite input.",
            )
            for t in tf.nest.flatten(x)
            if _is_float(t.dtype)
        ]

    def _prepare_labels(self, y):
        """One-hot float32 labels and the in-graph checks of their values."""
        if y is None:
            raise ValueError(
                "DUQModel needs labels to train and evaluate: pass `y` (or a "
                "dataset of `(x, y)` pairs)."
            )
        y = tf.convert_to_tensor(y)
        num_classes = self.num_classes
        rank = y.shape.rank
        if rank == 2 and y.shape[-1] == num_classes:
            return tf.cast(y, "float32"), []
        if rank == 2 and y.shape[-1] == 1:
            y = tf.squeeze(y, axis=-1)
        elif rank != 1:
            raise ValueError(
                "Expected labels of shape (batch,), (batch, 1) or one-hot "
                f"(batch, {num_classes}) for this model with "
                f"num_classes={num_classes}. Received: labels of shape "
                f"{tuple(y.shape)}. If the labels are one-hot for a different "
                "number of classes, build the model with that `num_classes`."
            )
        if y.dtype.is_floating:
            y = tf.cast(y, "int64")
        checks = [
            tf.debugging.assert_non_negative(
                y,
                f"Labels must be class indices in [0, {num_classes}), "
                "but a negative label was found.",
            ),
            tf.debugging.assert_less(
                y,
                tf.cast(num_classes, y.dtype),
                f"Labels must be class indices in [0, {num_classes}) for this "
                f"model with num_classes={num_classes}, but a label >= "
                f"{num_classes} was found. Check the labels, or build the "
                "model with the right `num_classes`.",
            ),
        ]
        return tf.one_hot(y, num_classes, dtype="float32"), checks

    # ---------------------------------------------------------------- export

    def export(
        self,
        filepath,
        format="tf_saved_model",
        verbose=None,
        input_signature=None,
        **kwargs,
    ):
        """Exports a SavedModel for TF Serving (Keras's `Model.export`).

        With `format="tf_saved_model"` (the default) the `serving_default`
        signature (also callable as `serve`) takes the model's input(s), with
        a free batch dimension, and returns a dict:

        - `kernel_values`: `(batch, num_classes)` float32 kernel values;
        - `predictions`: `(batch,)` int64 predicted class (argmax);
        - `certainty`: `(batch,)` float32 max kernel value.

        Loading it needs only TensorFlow (`tf.saved_model.load`). Other
        formats are passed to `keras.Model.export` unchanged.

        Example:

        ```python
        model.export("duq_savedmodel")
        reloaded = tf.saved_model.load("duq_savedmodel")
        outputs = reloaded.signatures["serving_default"](inputs=x)
        ```

        Args:
            filepath: directory to write the SavedModel to.
            format: `"tf_saved_model"` (default) or another format that
                `keras.Model.export` supports.
            verbose: whether to print a summary of the export.
            input_signature: optional structure of `tf.TensorSpec` for the
                inputs; defaults to the model's inputs with a free batch size.
            **kwargs: passed to `keras.Model.export` for other formats.
        """
        if format != "tf_saved_model":
            return super().export(
                filepath,
                format=format,
                verbose=verbose,
                input_signature=input_signature,
                **kwargs,
            )
        if input_signature is None:
            input_signature = [
                keras.tree.map_structure(
                    lambda t: tf.TensorSpec(
                        (None,) + tuple(t.shape[1:]), t.dtype, name=_input_name(t)
                    ),
                    self.feature_extractor.input,
                )
            ]

        def serve(inputs):
            features = self.feature_extractor(inputs, training=False)
            log_kernel = self.duq_output.log_kernel_values(features)
            kernel_values = tf.exp(log_kernel)
            return {
                "kernel_values": kernel_values,
                # From log K: far inputs underflow every K to 0, not log K.
                "predictions": tf.argmax(log_kernel, axis=-1),
                "certainty": tf.reduce_max(kernel_values, axis=-1),
            }

        archive = keras.export.ExportArchive()
        archive.track(self)
        archive.add_endpoint("serve", serve, input_signature)
        archive.write_out(filepath, verbose=True if verbose is None else verbose)

    # -------------------------------------------------------- serialization

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "feature_extractor": keras.saving.serialize_keras_object(
                self.feature_extractor
            ),
            "duq_output": keras.saving.serialize_keras_object(self.duq_output),
            "gradient_penalty": self.gradient_penalty,
            "penalty": self.penalty,
            "weight_decay": self.weight_decay,
            "bce_epsilon": self.bce_epsilon,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        feature_extractor = keras.saving.deserialize_keras_object(
            config.pop("feature_extractor"), custom_objects=custom_objects
        )
        duq_output = keras.saving.deserialize_keras_object(
            config.pop("duq_output"), custom_objects=custom_objects
        )
        outputs = duq_output(feature_extractor.output)
        return cls(feature_extractor.input, outputs, **config)


def _scale_loss_for_distribution(loss):
    """Divides by the number of replicas: their gradients are summed."""
    num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if num_replicas > 1:
        loss = loss / num_replicas
    return loss


def _run_if(condition, function):
    """Runs `function` (for its effects) if `condition`; always if it is `None`."""
    if condition is None:
        function()
        return

    def run():
        function()
        return tf.constant(True)

    tf.cond(condition, run, lambda: tf.constant(False))


def _is_multi_worker(strategy):
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def _find_duq_output(outputs):
    history = getattr(outputs, "_keras_history", None)
    layer = history[0] if history else None
    if not isinstance(layer, DUQOutput):
        raise ValueError(
            "DUQModel's `outputs` must be the output of a `DUQOutput` layer, "
            "e.g. `outputs = keras_duq.DUQOutput(num_classes)(features)`; to "
            "turn an existing backbone into a DUQ model use "
            f"`keras_duq.wrap(backbone, num_classes)`. Received: `outputs={outputs!r}`"
        )
    return layer


def _input_name(tensor):
    """The input layer's name: the key TF Serving requests use."""
    history = getattr(tensor, "_keras_history", None)
    return history[0].name if history else "inputs"


def _is_float(dtype):
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype))

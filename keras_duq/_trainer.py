"""The backend-neutral half of DUQModel's training and evaluation steps.

Every backend's step is the same computation, written once here:

- `check_batch`: standardised inputs, one-hot labels and an error code (0:
  the batch is good), with Keras ops only;
- `objective`: one stateless function from the inputs to the objective
  (kernel values, cross-entropy, the penalty's input gradient, coupled L2
  weight decay), given the backend's forward pass and its way to take the
  penalty's input gradient (`InputGradients`: `GradientTape`, `jax.grad`,
  `torch.autograd`).

Each step is computed, checked, then committed: the gradients, the layers'
writes in the forward pass (collected in a `keras.StatelessScope`) and the
centroid update (`Trainer._next_centroids`) are values until every check has
passed, so a rejected batch needs no copy and nothing is put back.

Each backend's part is a class (`TensorFlowTrainer`, `JAXTrainer`,
`TorchTrainer`), chosen once when `keras_duq` is imported and mixed into
`DUQModel` as Keras mixes its own trainers into `keras.Model`. It
differentiates `objective`, applies the optimizer and acts on the error
code in its own way, with one promise on every backend: a rejected batch
changes no weight, centroid, optimizer slot or `optimizer.iterations`, and
the error names the cause.

What the mixins need from the model they are mixed into is written down as
`DUQModelAttributes`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import NamedTuple
from typing import Protocol

import keras
from keras import ops

from keras_duq import _compat
from keras_duq import _ops
from keras_duq import _penalty_input
from keras_duq._ops import optimizer_steps
from keras_duq._validation import NON_FINITE_CENTROIDS
from keras_duq._validation import NON_FINITE_INPUT
from keras_duq._validation import NON_FINITE_STEP
from keras_duq._validation import DUQBatchError
from keras_duq._validation import finite_row_mask
from keras_duq._validation import is_float
from keras_duq._validation import is_one_hot
from keras_duq._validation import label_codes
from keras_duq._validation import label_dtype_message
from keras_duq._validation import one_hot_codes
from keras_duq._validation import own_loss_message
from keras_duq._validation import standardize_inputs

# The paper's coupled weight decay, which a model's `weight_decay=None`
# applies under SGD (`Trainer._weight_decay_in_effect`).
SGD_WEIGHT_DECAY = 1e-4


@dataclasses.dataclass(frozen=True)
class ObjectiveSettings:
    """What `objective` computes: the model's DUQ settings for one step."""

    penalty: str | None  # None: no penalty on this step
    penalty_weight: float
    weight_decay: float
    bce_epsilon: float
    categorical_cross_entropy_weight: float = 0.0
    # The penalty is taken with respect to the output of the layer the
    # model's `penalty_input` names, instead of the float inputs.
    penalty_input: bool = False
    # Per trainable weight, the rate of `_ops.rate_scaled` it is used with
    # (the head's projection), so that weight decay acts on what it stands for.
    rates: tuple[float, ...] = ()
    # Per trainable weight, whether weight decay applies to it (all where
    # empty): not to embedding tables (`Trainer._decayed`).
    decayed: tuple[bool, ...] = ()


@dataclasses.dataclass(frozen=True)
class InputGradients:
    """A backend's way to take the penalty's input gradient (nested differentiation).

    Both return gradients that are themselves differentiable, and
    `function`'s auxiliary output.

    - `of_tensors(function, tensors) -> (gradients, aux)`: the gradient of
      `function(tensors) -> (scalar, aux)` with respect to `tensors`.
    - `of_probes(function) -> (gradients, aux)`: `function(probe) ->
      (scalar, aux)` runs a forward pass in which each tensor to
      differentiate passes through `probe(tensor)`, which returns
      `tensor + p` for a zero tensor `p` of its shape; the gradients are
      with respect to each `p` (equal to those with respect to the tensors),
      in the order of the calls.
    """

    of_tensors: Callable
    of_probes: Callable


# ------------------------------------------------------------ batch check


def check_batch(input_specs, x, y, sample_weight, one_hot):
    """`(x, labels_one_hot, sample_weight, code)` for one batch.

    Errors that need no values (label dtype and shape) raise here; errors
    in the values give a non-zero int32 `code` (the first found), which each
    backend turns into an error before the batch changes any state.
    `one_hot(y) -> (labels_one_hot, code)` is `labels_to_one_hot` for the
    model's number of classes.
    """
    x = standardize_inputs(input_specs, x)
    if sample_weight is not None:
        sample_weight = ops.reshape(ops.cast(sample_weight, "float32"), (-1,))
    labels_one_hot, code = one_hot(y)
    inputs_finite = _ops.all_finite(keras.tree.flatten(x))
    code = first_error(code, ops.where(inputs_finite, 0, NON_FINITE_INPUT))
    return x, labels_one_hot, sample_weight, code


def labels_to_one_hot(y, num_classes):
    """One-hot float32 labels and the error code of their values.

    `y` must have a static rank and, for rank 2, a static last axis (the
    TensorFlow backend handles labels whose format is only known at run
    time itself).
    """
    y = ops.convert_to_tensor(y)
    dtype = keras.backend.standardize_dtype(y.dtype)
    if dtype == "bool" or not ("int" in dtype or is_float(dtype)):
        raise ValueError(label_dtype_message(num_classes, dtype))
    if is_one_hot(tuple(y.shape), num_classes):
        code = ops.cast(ops.max(one_hot_codes(y, ops), initial=0), "int32")
        return ops.cast(y, "float32"), code
    labels = ops.reshape(y, (-1,))
    # The worst code of the batch: a fractional label before one out of range.
    code = ops.cast(ops.max(label_codes(labels, num_classes, ops)), "int32")
    indices = ops.cast(ops.clip(labels, 0, num_classes - 1), "int32")
    return ops.one_hot(indices, num_classes, dtype="float32"), code


# -------------------------------------------------------------- objective


def objective(
    forward,
    input_gradients,
    x,
    labels_one_hot,
    sample_weight,
    weights,
    settings,
    scale=None,
):
    """The DUQ objective of one batch, statelessly: `(objective, aux)`.

    Args:
        forward: `forward(x, probe=None) -> (log_kernel, state)`: the
            model's forward pass; `state` is a `ForwardState` (the features,
            and on JAX the layers' new non-trainable values). With a
            `probe`, the outputs of the model's `penalty_input` layer pass
            through it (see `InputGradients`).
        input_gradients: the backend's `InputGradients`.
        x: standardised inputs; without `settings.penalty_input`, the
            penalty is taken with respect to the floating-point ones.
        labels_one_hot, sample_weight: from `check_batch`.
        weights: the trainable weights (or their values), for weight decay.
        settings: `ObjectiveSettings`.
        scale: the loss scale (mixed_float16), or `None`. The penalty's
            input gradient flows back through float16 layers, where small
            values underflow to zero just as weight gradients do: `sum_c K_c`
            is scaled by the same power of two (exact), and an overflow makes
            the step non-finite, so that the optimizer skips it and lowers
            the scale.

    Returns:
        `(objective, (values, state))`: the scalar objective (cross-entropy +
        weighted penalty + weight decay), the `StepValues` the metrics take
        (the objective again, the log kernel values, the per-example penalty,
        `None` without one, and the cross-entropy part) and `forward`'s
        state.
    """
    if settings.penalty is None:
        log_kernel, state = forward(x)
        penalty = None
    else:
        log_kernel, penalty, state = log_kernel_and_penalty(
            forward,
            input_gradients,
            x,
            settings.penalty,
            scale,
            settings.penalty_input,
        )
    loss, bce = _ops.duq_loss(
        log_kernel,
        labels_one_hot,
        penalty,
        settings.penalty_weight,
        sample_weight,
        settings.bce_epsilon,
        settings.categorical_cross_entropy_weight,
    )
    total = loss
    if settings.weight_decay:
        total = total + _ops.coupled_weight_decay_loss(
            weights, settings.weight_decay, settings.rates, settings.decayed
        )
    return total, (StepValues(total, log_kernel, penalty, bce), state)


def log_kernel_and_penalty(
    forward, input_gradients, x, penalty, scale=None, penalty_input=False
):
    """`(log_kernel, per-example penalty, state)`: `objective`'s forward pass.

    The gradient is that of `sum_c K_c` with respect to the float inputs,
    or, with `penalty_input`, to the outputs of the model's `penalty_input`
    layer.
    """

    def kernel_sum(log_kernel, state):
        total = ops.sum(ops.exp(log_kernel))
        if scale is not None:
            total = total * scale
        return total, (log_kernel, state)

    if penalty_input:
        gradients, (log_kernel, state) = input_gradients.of_probes(
            lambda probe: kernel_sum(*forward(x, probe))
        )
    else:
        flat = keras.tree.flatten(x)
        positions = [i for i, t in enumerate(flat) if is_float(t.dtype)]

        def of_float_inputs(float_inputs):
            values = list(flat)
            for position, value in zip(positions, float_inputs):
                values[position] = value
            return kernel_sum(*forward(keras.tree.pack_sequence_as(x, values)))

        gradients, (log_kernel, state) = input_gradients.of_tensors(
            of_float_inputs, [flat[i] for i in positions]
        )
    if scale is not None:
        gradients = [
            None if g is None else ops.cast(g, "float32") / scale for g in gradients
        ]
    norms = _ops.gradient_norms(gradients)
    return log_kernel, _ops.gradient_penalty(norms, penalty), state


# ---------------------------------------------------------------- helpers


def first_error(code, new_code):
    """`code` if it is an error already, else `new_code` (int32)."""
    return ops.cast(ops.where(ops.not_equal(code, 0), code, new_code), "int32")


def finite_rows(inputs):
    """`(batch,)` bool: whether each row's float inputs are all finite.

    `None` for inputs without a float tensor.
    """
    checks = [
        finite_row_mask(t, ops)
        for t in keras.tree.flatten(inputs)
        if is_float(t.dtype) and len(t.shape) > 0
    ]
    if not checks:
        return None
    finite = checks[0]
    for check in checks[1:]:
        finite = ops.logical_and(finite, check)
    return finite


def nan_where_not_finite(finite, values):
    """`values` `(batch, ...)` with NaN in the rows where `finite` is False.

    The NaN is a scalar: tf2onnx's conversion of a `where` with a tensor of
    NaN returns NaN everywhere.
    """
    if finite is None:
        return values
    finite = ops.reshape(finite, (-1,) + (1,) * (len(values.shape) - 1))
    return ops.where(finite, values, float("nan"))


def nan_for_non_finite_inputs(inputs, values):
    """`values` `(batch, ...)` with NaN in the rows whose float inputs are not finite.

    Layers such as ReLU map NaN to a number, so a non-finite input can get a
    finite kernel value; this keeps inference from answering for it.
    """
    return nan_where_not_finite(finite_rows(inputs), values)


def written_values(scope, variables):
    """The value each of `variables` was given inside `scope` (a
    `keras.StatelessScope` without a mapping), or `None` where none was."""
    return [scope.get_current_value(variable) for variable in variables]


def step_error(finite, centroids_finite):
    """The error code of a step's computed values (int32, 0: none).

    `finite`: whether the loss, gradients and layer writes are finite;
    `centroids_finite`: whether the centroid update is.
    """
    return ops.cast(
        ops.where(
            finite,
            ops.where(centroids_finite, 0, NON_FINITE_CENTROIDS),
            NON_FINITE_STEP,
        ),
        "int32",
    )


class ForwardState(NamedTuple):
    """What a forward pass gives back besides the log kernel values.

    `features`: the feature extractor's outputs, for the centroid update
    where they equal inference mode's (`Trainer._features_for_centroids`);
    `layer_values`: the layers' new non-trainable values (JAX), else `None`.
    """

    features: Any
    layer_values: Any = None


class Centroids(NamedTuple):
    """A step's centroid update, computed and not yet assigned.

    `values`: new values of `DUQOutput._centroid_state`, in its order.
    """

    values: list
    finite: Any


class Batch(NamedTuple):
    """One checked batch of a step: inputs, labels as given and one-hot, weights."""

    x: Any
    y: Any
    labels_one_hot: Any
    sample_weight: Any


class StepValues(NamedTuple):
    """What one step reports to the metrics: the objective and its parts."""

    objective: Any
    log_kernel: Any
    penalty: Any
    bce: Any


class DUQModelAttributes(Protocol):
    """The contract of the trainer mixins: what `DUQModel` gives them.

    `Trainer` and the backend classes read these, and nothing else of the
    model but Keras's own `keras.Model` API (`optimizer`, `trainable_weights`,
    `non_trainable_variables`, `compute_metrics`, `jit_compile`, ...).
    """

    feature_extractor: keras.Model
    duq_output: Any  # `DUQOutput`
    num_classes: int
    gradient_penalty: float
    penalty: str
    penalty_interval: int
    penalty_input: str | None
    weight_decay: float | None
    bce_epsilon: float
    categorical_cross_entropy_weight: float
    clipnorm: float | None
    # The `keras.metrics.Mean` trackers the steps update (`_update_duq_metrics`).
    _objective_tracker: keras.metrics.Mean
    _bce_tracker: keras.metrics.Mean
    _penalty_tracker: keras.metrics.Mean
    _accuracy_tracker: keras.metrics.Mean
    _step_metrics: list[keras.metrics.Metric]
    # The feature extractor with the penalty's probe at `penalty_input`.
    _probed_feature_extractor: keras.Model


class UncompiledSteps:
    """Training and test functions that are never compiled whole (TensorFlow, PyTorch).

    XLA drops `Assert` ops without a word, so a function compiled whole
    would skip the batch checks and let a bad batch change the weights; with
    `jit_compile` on, the TensorFlow step compiles its computation with XLA
    itself and keeps the checks and state updates around it. PyTorch's
    `torch.compile` does not differentiate twice, which the penalty needs.
    """

    def make_train_function(self, force=False):
        return self._make_uncompiled(super().make_train_function, force)

    def make_test_function(self, force=False):
        return self._make_uncompiled(super().make_test_function, force)


class Trainer:
    """The backend-neutral methods of `DUQModel`'s steps (a `keras.Model` mixin)."""

    # How the backend takes input gradients: each backend's trainer sets it.
    input_gradients: InputGradients

    @property
    def _lazy_penalty(self):
        """Whether training computes the penalty on some steps only."""
        return self.gradient_penalty > 0 and self.penalty_interval > 1

    def _is_penalty_step(self, iterations):
        """Whether the lazy penalty is computed at optimizer step `iterations`."""
        return ops.equal(iterations % self.penalty_interval, 0)

    def _objective_settings(self, training, with_penalty=True):
        """`ObjectiveSettings` of a training (or evaluation) step.

        A training step of a lazy penalty weighs it by `penalty_interval`,
        so that it weighs as much per step on average.
        """
        penalised = self.gradient_penalty > 0 and with_penalty
        weight = self.gradient_penalty * (self.penalty_interval if training else 1)
        return ObjectiveSettings(
            penalty=self.penalty if penalised else None,
            penalty_weight=weight,
            weight_decay=self._weight_decay_in_effect(),
            bce_epsilon=self.bce_epsilon,
            categorical_cross_entropy_weight=self.categorical_cross_entropy_weight,
            penalty_input=self.penalty_input is not None,
            rates=self._weight_rates(),
            decayed=self._decayed(),
        )

    def _weight_rates(self):
        """`ObjectiveSettings.rates`: empty unless the projection has its own rate."""
        head = self.duq_output
        if head.projection_learning_rate == 1.0:
            return ()
        return tuple(
            head.projection_learning_rate if weight is head.kernel else 1.0
            for weight in self.trainable_weights
        )

    def _weight_decay_in_effect(self):
        """The model's `weight_decay`; for `None`, the paper's under SGD, else 0."""
        if self.weight_decay is not None:
            return self.weight_decay
        if isinstance(self._inner_optimizer(), keras.optimizers.SGD):
            return SGD_WEIGHT_DECAY
        return 0.0

    def _decayed(self):
        """`ObjectiveSettings.decayed`: every trainable weight but embedding tables.

        A row of an embedding table gets a gradient only from the batches
        whose inputs hold its token. Coupled decay would give every row one
        on every step, which an adaptive optimizer (Adam) scales up to a
        step of about its full learning rate towards zero: the rows of rare
        tokens were erased between their occurrences, and the table's
        sparse gradient became a dense one.
        """
        embeddings = self._embedding_weight_ids()
        if not embeddings:
            return ()
        return tuple(id(weight) not in embeddings for weight in self.trainable_weights)

    def _embedding_weight_ids(self):
        """Ids of the embedding tables' weights, found once the model is built.

        PyTorch's eager step asks on every step; the layers do not change.
        """
        ids = self.__dict__.get("_embedding_ids")  # not a tracked attribute
        if ids is None:
            ids = frozenset(
                id(weight)
                for layer in _compat.all_layers(self)
                if isinstance(layer, keras.layers.Embedding)
                for weight in layer.weights
            )
            if self.built:
                self.__dict__["_embedding_ids"] = ids
        return ids

    def _inner_optimizer(self):
        """The optimizer, or the one a `LossScaleOptimizer` wraps."""
        return getattr(self.optimizer, "inner_optimizer", self.optimizer)

    def _clipped(self, gradients, loss_scale=None):
        """`gradients` clipped to the model's `clipnorm` (see `DUQModel`).

        Where the optimizer clips its gradients itself, its own setting
        rules, and `gradients` pass as they are. Under loss scaling
        (`loss_scale`: the scale, else `None`) the gradients are that many
        times the true ones, and so is the bound.
        """
        clipnorm = self._clipnorm_in_effect()
        if clipnorm is None:
            return list(gradients)
        bound = clipnorm if loss_scale is None else clipnorm * loss_scale
        return _ops.clipped_by_norm(gradients, bound)

    def _clipnorm_in_effect(self):
        """The model's `clipnorm`, or `None` where the optimizer clips itself."""
        optimizer = self._inner_optimizer()
        if any(
            getattr(optimizer, name, None) is not None
            for name in ("clipnorm", "global_clipnorm", "clipvalue")
        ):
            return None
        return self.clipnorm

    def _check_batch(self, x, y, sample_weight):
        """`check_batch` for this model; structural errors raise here."""
        if self.loss is not None:  # only if `compile`'s check was bypassed
            raise ValueError(own_loss_message(self.loss))
        if y is None:
            raise ValueError(
                "DUQModel needs labels to train and evaluate: pass `y` (or a "
                "dataset of `(x, y)` pairs)."
            )
        return check_batch(
            self.feature_extractor.input, x, y, sample_weight, self._labels_to_one_hot
        )

    def _labels_to_one_hot(self, y):
        return labels_to_one_hot(y, self.num_classes)

    def _log_kernel_and_features(self, x, training, probe=None):
        """The forward pass: `(log kernel values (batch, num_classes), features)`.

        With a `probe` (see `InputGradients`), the outputs of the
        `penalty_input` layer pass through it, in the copy of the feature
        extractor's graph that probes them.
        """
        if probe is None:
            features = self.feature_extractor(x, training=training)
        else:
            with _penalty_input.probing(probe):
                features = self._probed_feature_extractor(x, training=training)
        return self.duq_output.log_kernel_values(features), features

    def _own_forward(self, training):
        """`forward` for `objective` over the model's own variables.

        TensorFlow's and PyTorch's steps run it; JAX's steps are stateless
        and pass a forward pass over the state they are given.
        """

        def forward(x, probe=None):
            log_kernel, features = self._log_kernel_and_features(x, training, probe)
            return log_kernel, ForwardState(features)

        return forward

    def _own_objective(self, batch, training, weights=None, with_penalty=True):
        """`objective` of `batch` (a `Batch`) over the model's own variables.

        `weights`: the trainable weights as the backend differentiates them
        (default `trainable_weights`). A training step passes the loss scale
        for the penalty's input gradient (`_input_gradient_scale`, which
        each backend's trainer defines, as `input_gradients`).
        """
        return objective(
            self._own_forward(training),
            self.input_gradients,
            batch.x,
            batch.labels_one_hot,
            batch.sample_weight,
            self.trainable_weights if weights is None else weights,
            self._objective_settings(training, with_penalty),
            self._input_gradient_scale() if training else None,
        )

    def _next_centroids(self, x, labels_one_hot, training_features):
        """The step's `Centroids` update, from inference-mode features.

        The features are those of the weights the step's gradients were
        taken at, so that the whole step is computed and checked before any
        of it is assigned. `training_features`: the step's forward pass's,
        used as they are where inference mode computes the same
        (`_features_for_centroids`), which saves a forward pass.
        """
        features = training_features
        if not self._features_for_centroids():
            features = self.feature_extractor(x, training=False)
        return Centroids(
            *self.duq_output._next_centroid_state(
                ops.stop_gradient(features), labels_one_hot
            )
        )

    def _features_for_centroids(self):
        """Whether a training forward pass's features are inference mode's.

        True where no layer of the feature extractor uses a `training`
        argument (`_compat.uses_training_argument`: Dropout,
        BatchNormalization, GaussianNoise, SpectralNormalization, recurrent
        and attention layers and any custom layer that takes one do).
        Asked once the model is built; the layers do not change.
        """
        same = self.__dict__.get("_duq_features_for_centroids")
        if same is None:
            same = not any(
                _compat.uses_training_argument(layer)
                for layer in _compat.all_layers(self.feature_extractor)
            )
            if self.built:
                self.__dict__["_duq_features_for_centroids"] = same
        return same

    def _layer_state(self):
        """Variables that layers assign in the forward pass.

        Non-trainable state (BatchNormalization's moving statistics), and
        the kernels of Keras's `SpectralNormalization`, which writes the
        normalised kernel back into the wrapped layer's trainable kernel.
        """
        centroid_state = self.duq_output._centroid_state
        state = [
            variable
            for variable in self.non_trainable_variables
            if all(variable is not other for other in centroid_state)
        ]
        return state + [
            layer.kernel
            for layer in _compat.all_layers(self.feature_extractor)
            if isinstance(layer, keras.layers.SpectralNormalization)
        ]

    def _make_uncompiled(self, make, force):
        """Keras's train or test function `make(force)`, never compiled whole."""
        jit_compile = self.jit_compile
        self.jit_compile = False
        try:
            return make(force)
        finally:
            self.jit_compile = jit_compile

    def _uses_loss_scale(self):
        return isinstance(
            getattr(self, "optimizer", None), keras.optimizers.LossScaleOptimizer
        )

    @staticmethod
    def prepare_arguments(method, arguments):
        """`fit`/`evaluate`/`predict` arguments as this backend feeds them best."""
        return arguments

    error_tracker_class = None

    def _batch_error(self, error):
        """`error` as the `DUQBatchError` it stands for, or `None`."""
        return error if isinstance(error, DUQBatchError) else None

    def _update_duq_metrics(self, batch, values, penalised=None):
        """Updates the trackers from a step's `Batch` and `StepValues`;
        `penalised` (bool tensor): whether the step computed `values.penalty`."""
        x, y, labels_one_hot, sample_weight = batch
        objective, log_kernel, penalty, bce = values
        batch_size = ops.cast(ops.shape(log_kernel)[0], "float32")
        self._objective_tracker.update_state(objective, sample_weight=batch_size)
        self._bce_tracker.update_state(bce, sample_weight=batch_size)
        weight = None
        if penalty is not None:
            # A lazy penalty's `gradient_penalty` log: the mean over the
            # steps that computed it.
            weight = (
                batch_size
                if penalised is None
                else batch_size * ops.cast(penalised, "float32")
            )
            self._penalty_tracker.update_state(ops.mean(penalty), sample_weight=weight)
        for metric in self._step_metrics:
            metric.update_state(log_kernel, penalty, weight)
        correct = ops.cast(
            ops.equal(
                ops.argmax(log_kernel, axis=-1), ops.argmax(labels_one_hot, axis=-1)
            ),
            "float32",
        )
        self._accuracy_tracker.update_state(correct, sample_weight=sample_weight)
        self.compute_metrics(x, y, ops.exp(log_kernel), sample_weight)


def optimizer_steps_or_zero(model):
    """`optimizer_steps(model)`, 0 before `compile`: the count a call compares before and after."""
    return optimizer_steps(model) or 0


def rejected_batch_error(model, error, iterations=None):
    """The `DUQBatchError` of a batch the step rejected (in `fit`, with the
    steps applied before it since `iterations`); `None` for any other error,
    which propagates as it is."""
    rejected = model._batch_error(error)
    if rejected is None or iterations is None:
        return rejected
    return rejected._after_steps(optimizer_steps_or_zero(model) - iterations)

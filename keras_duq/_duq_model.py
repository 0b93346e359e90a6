"""The DUQ model: a feature extractor, a `DUQOutput` head and the DUQ training step."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any

import keras
import numpy as np

from keras_duq import _compat
from keras_duq import _health
from keras_duq import _ops
from keras_duq import _penalty_input
from keras_duq import _saved_configs
from keras_duq import _trainer
from keras_duq import _validation
from keras_duq._batch_norm import as_arrays
from keras_duq._batch_norm import inputs_of
from keras_duq._duq_output import find_duq_output
from keras_duq._typing import Tensor
from keras_duq._validation import check_non_negative
from keras_duq._validation import check_positive
from keras_duq._validation import check_positive_int
from keras_duq._validation import is_float
from keras_duq._validation import own_loss_message

if TYPE_CHECKING:
    from keras_duq.evaluation import CertaintyCalibrator


def _backend_trainer():
    """The step class of the Keras backend in use, chosen once at import.

    Only its module is imported, so keras_duq imports without TensorFlow on
    the JAX and PyTorch backends.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from keras_duq._tensorflow_trainer import TensorFlowTrainer

        return TensorFlowTrainer
    if backend == "jax":
        from keras_duq._jax_trainer import JAXTrainer

        return JAXTrainer
    if backend == "torch":
        from keras_duq._torch_trainer import TorchTrainer

        return TorchTrainer
    raise ValueError(
        "keras_duq trains on the TensorFlow, JAX and PyTorch backends of "
        "Keras. Set `KERAS_BACKEND` to `tensorflow`, `jax` or `torch` before "
        f"importing Keras. Received: backend {backend!r}"
    )


_BackendTrainer = _backend_trainer()

DEFAULT_GRADIENT_PENALTY = 0.1
DEFAULT_CATEGORICAL_CROSS_ENTROPY_WEIGHT = 1.0
DEFAULT_CLIPNORM = 1.0


def default_categorical_cross_entropy_weight(feature_extractor: keras.Layer) -> float:
    """The categorical term's weight when the user gives none.

    `1 + 2 p / (1 - p)` for features that come straight out of dropout at
    rate `p` (1 without). `p / (1 - p)` is the dropout's variance
    relative to each feature's square; the binary cross-entropy's own-class
    term grows with it through `W`, which can pull `W` smaller at the cost
    of the classes' separation; the categorical term, which compares the
    classes, keeps them apart. 3 at rate 0.5, 1.5 at 0.2.
    """
    rate = float(getattr(_health.feature_noise_layer(feature_extractor), "rate", 0))
    if not 0.0 < rate < 1.0:  # no dropout, or (rate 1) no features to weigh
        return DEFAULT_CATEGORICAL_CROSS_ENTROPY_WEIGHT
    relative_variance = rate / (1.0 - rate)
    return DEFAULT_CATEGORICAL_CROSS_ENTROPY_WEIGHT * (1.0 + 2.0 * relative_variance)


def _documented(keras_method, added):
    """`functools.wraps(keras_method)`, with `added` (what DUQModel adds)
    before Keras's own docstring."""

    def decorate(function):
        function = functools.wraps(keras_method)(function)
        # Keras documents the method on its backend-neutral trainer; each
        # backend's override has no docstring of its own.
        docs = (
            vars(cls)[keras_method.__name__].__doc__
            for cls in keras.Model.__mro__
            if keras_method.__name__ in vars(cls)
        )
        keras_doc = inspect.cleandoc(next((d for d in docs if d), ""))
        function.__doc__ = (
            inspect.cleandoc(added) + "\n\nKeras's documentation:\n\n" + keras_doc
        )
        return function

    return decorate


@keras.saving.register_keras_serializable(package="keras_duq")
class DUQModel(_compat.MultiWorkerBuildMixin, _BackendTrainer, keras.Model):
    """A classifier trained with Deterministic Uncertainty Quantification.

    Built like a functional model whose output is a `DUQOutput` layer (or
    with `keras_duq.wrap(backbone, num_classes)`). `fit` runs the DUQ
    training step; `predict` returns kernel values `(batch, num_classes)` in
    `[0, 1]`: the prediction is their argmax and the certainty their max.

    It trains on the TensorFlow, JAX and PyTorch backends of Keras, with
    the same results (and `.keras` files that load on any of them). One
    training step:

    1. Forward pass in training mode; the loss is the binary cross-entropy of
       each kernel value against the one-hot label (computed in log space),
       averaged over classes and batch, plus
       `categorical_cross_entropy_weight` times a categorical cross-entropy
       over minus the distances to the centroids, plus `gradient_penalty`
       times the penalty on `||grad_x sum_c K_c||_2` (double backprop: a nested
       `tf.GradientTape`, `jax.grad` or `torch.autograd.grad` with
       `create_graph=True`), plus the coupled L2 weight decay. The penalty's
       gradient is exact through `BatchNormalization` and
       `GroupNormalization` on every backend (on TensorFlow, their batch
       statistics use a formula that TensorFlow differentiates exactly
       twice: `tf.nn.moments`, used otherwise, drops a term of the second
       derivative; the values are the same).
    2. Optimizer step on all trainable weights.
    3. Centroid moving-average update from the same batch, with features
       recomputed in inference mode (`DUQOutput.update_centroids`).

    A batch with labels out of range or fractional, or non-finite inputs,
    raises an error before it changes anything; so does a step whose loss,
    gradients or centroid update are not finite (under a
    `LossScaleOptimizer` such a step is skipped and the loss scale lowered
    instead). Neither the weights, the centroids, the optimizer's slots nor
    `optimizer.iterations` change.

    `fit` and `evaluate` log `loss` (the full objective), `bce`,
    `gradient_penalty` (the penalty term before weighting, when the penalty
    is on) and `accuracy`; with `health_checks`, also `certainty` (mean
    largest kernel value), `underflow` (fraction of examples whose kernel
    values all underflow) and, with the two-sided penalty,
    `zero_input_gradient` (fraction of examples whose input gradient is
    ~0), and `fit` adds `centroid_overlap` and `batch_norm_gap` per epoch.
    Metrics passed to `compile(metrics=[...])` get the labels as given and
    the kernel values as `y_pred`. Do not pass a `loss` to `compile`: the DUQ
    loss is built in.

    Labels may be sparse integers `(batch,)` or `(batch, 1)`, or one-hot
    `(batch, num_classes)`. `sample_weight` and `class_weight` weight the
    per-example loss (cross-entropy plus penalty); the centroids are
    unweighted class means, as in the paper.

    Inputs declared floating point that arrive as integers (e.g. `uint8`
    images) are cast to the declared dtype before the penalty's gradient is
    taken. Integer inputs (e.g. token ids for an `Embedding`) are left out of
    the penalty; at least one floating-point input is needed when the
    penalty is on, unless `penalty_input` names a layer: then the penalty is
    on the gradient with respect to that layer's output (for text, the
    embeddings) instead of the inputs.

    `compile(jit_compile=...)` works as for any Keras model (Keras's
    `"auto"`: XLA on GPUs, not on CPUs). On TensorFlow with XLA on, the
    step's computation (forward pass, penalty, gradients, the centroid
    update's features) is compiled by XLA while the batch checks and the
    state updates stay in the TensorFlow graph around it: XLA drops
    assertion ops without a word, and a bad batch must raise before it
    changes anything.

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
        penalty_interval: int >= 1. Compute the penalty only on every
            `penalty_interval`-th training step (the optimizer's steps 0, k,
            2k, ...), weighted there by `gradient_penalty * penalty_interval`
            so that it weighs as much per step on average ("lazy
            regularization", as StyleGAN2 applies its R1 penalty). The other
            steps cost what a step without the penalty costs. `evaluate`
            always computes the penalty. Defaults to `1`, the paper's exact
            penalty on every step.
        weight_decay: float >= 0 or `None`, coupled L2 weight decay on
            every trainable weight but embedding tables, as in the paper:
            each gradient gets `+ weight_decay * w` (the loss gets
            `weight_decay / 2 * sum ||w||^2`), PyTorch SGD's `weight_decay`.
            `None` (default): `1e-4`, the paper's value, when the optimizer is
            `keras.optimizers.SGD`, and `0` with any other optimizer. An
            adaptive optimizer (Adam, RMSprop, ...) divides each gradient by
            its running scale, so an L2 term decays the weights whose loss
            gradients are small (rare tokens' embeddings, rarely seen
            classes' projections) far more than the rest; decay them with the
            optimizer's own decoupled `weight_decay` (e.g. `keras.optimizers.
            AdamW`) instead. The weights of
            `keras.layers.Embedding` layers are never decayed here: a row
            gets a gradient only from the batches that hold its token; give
            an `Embedding` an `embeddings_regularizer` to decay it.
        bce_epsilon: float >= 0, floor of `K (1 - K)` in the denominator of
            the cross-entropy's gradient with respect to each kernel value
            `K`. `0` (default) gives the exact gradient. `1e-12` gives the
            gradient of PyTorch's `binary_cross_entropy`, as in the paper's
            code: a kernel value far below `1e-12`, as every one is at
            initialisation, then gets almost no gradient until the centroids
            have moved to the class means. The loss value is the same.
        categorical_cross_entropy_weight: float >= 0 or `None`, weight per
            example of a categorical cross-entropy added to the paper's
            binary cross-entropy (which is averaged over classes): softmax
            over minus each class's distance `sqrt(d_c) / length_scale`. It
            pushes a misclassified example away from the centroid it is
            nearest to, which the binary cross-entropy barely does while
            that kernel value is small; its weight does not depend on the
            number of classes. `None` (default) takes `1.0`, or
            `1 + 2 * p / (1 - p)` when the features come straight out of a
            dropout layer of rate `p` (through `Flatten`, `Reshape` or
            `Permute` at most): 3 at `p = 0.5`. The weight used is saved
            with the model. `0` is the paper's loss
            (`keras_duq.PAPER_SETTINGS`).
        clipnorm: float > 0 or `None`, clips each weight's gradient to this
            L2 norm before the optimizer's step, as the optimizer argument of
            the same name does (under loss scaling: the unscaled gradient).
            It keeps a backbone trained from scratch from growing faster
            than its BatchNormalization statistics follow, which would
            make the centroids diverge. Where the optimizer clips
            its gradients itself (`clipnorm`, `global_clipnorm` or
            `clipvalue`), the optimizer's setting rules instead. `None` turns
            it off, as in the paper (`keras_duq.PAPER_SETTINGS`). Defaults
            to `1.0`.
        health_checks: bool, whether `fit`, `evaluate` and `predict` watch
            DUQ's failure modes (kernel values that underflow, unsettled
            BatchNormalization statistics, centroids that never received
            their class or overlap, a constant penalty) and warn once per
            cause with a `keras_duq.DUQHealthWarning` (see
            `keras_duq.callbacks.HealthCheck`). Defaults to `True`.
        penalty_input: `None` (default) or the name of a layer of the
            feature extractor (also inside a nested Sequential or functional
            backbone) with a floating-point output. The penalty is then on
            `s * ||grad_z sum_c K_c||_2` for `z` that layer's output (all
            its outputs, if it is called more than once) instead of the
            inputs, `s` the spread of `z` over the batch (the root of its
            mean per-dimension variance over the positions the layer's mask
            keeps): the gradient per unit of `z`'s own scale, as if `z` were
            standardised like the inputs should be.
            For a model of token ids, the `Embedding` layer, e.g.
            `penalty_input="embedding"`. The model's predictions, saving
            and export are unchanged. Saved with the model.
        **kwargs: base model keyword arguments such as `name`.
    """

    def __init__(
        self,
        inputs: Any,
        outputs: keras.KerasTensor,
        gradient_penalty: float = DEFAULT_GRADIENT_PENALTY,
        penalty: str = "two_sided",
        penalty_interval: int = 1,
        weight_decay: float | None = None,
        bce_epsilon: float = 0.0,
        categorical_cross_entropy_weight: float | None = None,
        clipnorm: float | None = DEFAULT_CLIPNORM,
        health_checks: bool = True,
        penalty_input: str | None = None,
        **kwargs: Any,
    ) -> None:
        check_non_negative("gradient_penalty", gradient_penalty)
        if weight_decay is not None:
            check_non_negative("weight_decay", weight_decay)
        check_non_negative("bce_epsilon", bce_epsilon)
        if categorical_cross_entropy_weight is not None:
            check_non_negative(
                "categorical_cross_entropy_weight", categorical_cross_entropy_weight
            )
        check_positive_int("penalty_interval", penalty_interval)
        if clipnorm is not None:
            check_positive("clipnorm", clipnorm, "or `None` (no clipping)")
        _ops.validate_penalty(penalty)
        if not isinstance(health_checks, bool):
            raise ValueError(
                "Expected `health_checks` to be True or False. "
                f"Received: `health_checks={health_checks!r}`"
            )
        duq_output = find_duq_output(inputs, outputs)
        feature_extractor = keras.Model(
            inputs, duq_output.input, name="feature_extractor"
        )
        if penalty_input is not None:
            penalty_path = _penalty_input.find_layer(feature_extractor, penalty_input)
        elif gradient_penalty > 0 and not any(
            is_float(t.dtype) for t in keras.tree.flatten(inputs)
        ):
            raise ValueError(
                _penalty_input.no_float_input_message(inputs, feature_extractor)
            )
        super().__init__(**kwargs)
        self.penalty_input = penalty_input
        # The penalty's forward pass runs this copy of the graph (sharing
        # every layer), kept out of Keras's tracking: it is no part of the
        # saved model.
        self.__dict__["_probed_feature_extractor"] = (
            _penalty_input.probed_copy(feature_extractor, penalty_path)
            if penalty_input is not None
            else None
        )
        self.feature_extractor = feature_extractor
        self.duq_output = duq_output
        # The symbolic output, outside Keras's tracking (for `output`).
        self.__dict__["_symbolic_output"] = outputs
        self.gradient_penalty = float(gradient_penalty)
        self.penalty = penalty
        self.penalty_interval = penalty_interval
        self.weight_decay = None if weight_decay is None else float(weight_decay)
        self.bce_epsilon = float(bce_epsilon)
        if categorical_cross_entropy_weight is None:
            categorical_cross_entropy_weight = default_categorical_cross_entropy_weight(
                feature_extractor
            )
        self.categorical_cross_entropy_weight = float(categorical_cross_entropy_weight)
        self.clipnorm = None if clipnorm is None else float(clipnorm)
        self.num_classes = duq_output.num_classes
        self._objective_tracker = keras.metrics.Mean(name="loss")
        self._bce_tracker = keras.metrics.Mean(name="bce")
        self._penalty_tracker = (
            keras.metrics.Mean(name="gradient_penalty")
            if self.gradient_penalty > 0
            else None
        )
        self._accuracy_tracker = keras.metrics.Mean(name="accuracy")
        self.health_checks = health_checks
        # Metrics of the step's own values, updated by every step with
        # `(log_kernel, penalty, penalty_weight)`: the health numbers.
        self._step_metrics = (
            [
                _health.BatchHealth(
                    zero_gradient=self.gradient_penalty > 0 and penalty == "two_sided"
                )
            ]
            if self.health_checks
            else []
        )
        # On JAX, a jitted step reports a bad batch through this metric.
        self._error_tracker = (
            None if self.error_tracker_class is None else self.error_tracker_class()
        )
        self.built = True

    # The graph's ends, as a functional model has them: `keras.Model(
    # model.inputs, model.outputs)` and tools that read input specs work.
    @property
    def inputs(self) -> list:
        """The model's symbolic inputs (a list), as on a functional model."""
        return self.feature_extractor.inputs

    @property
    def input(self) -> Any:
        """The model's symbolic input(s), in the structure it was built with."""
        return self.feature_extractor.input

    @property
    def outputs(self) -> list:
        """The model's symbolic outputs: `[kernel_values]`."""
        return [self._symbolic_output]

    @property
    def output(self) -> keras.KerasTensor:
        """The model's symbolic output: the kernel values `(batch, num_classes)`."""
        return self._symbolic_output

    def call(self, inputs: Any, training: bool | None = None) -> Tensor:
        features = self.feature_extractor(inputs, training=training)
        # A row whose input is not finite gets NaN kernel values, never a
        # finite certainty.
        return _trainer.nan_for_non_finite_inputs(inputs, self.duq_output(features))

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        # Keras's documented pattern for a custom `train_step`: our own
        # trackers first, in place of Keras's loss tracker (a DUQ model is
        # compiled without a loss), then the metrics passed to `compile`.
        own = [
            tracker
            for tracker in (
                self._objective_tracker,
                self._bce_tracker,
                self._penalty_tracker,
                self._accuracy_tracker,
                *self._step_metrics,
                self._error_tracker,
            )
            if tracker is not None
        ]
        others = [
            metric
            for metric in super().metrics
            if metric.name != "loss" and all(metric is not m for m in own)
        ]
        return own + others

    def get_metrics_result(self) -> dict[str, Any]:
        logs = super().get_metrics_result()
        if self._error_tracker is not None:
            logs.pop(self._error_tracker.name, None)
        return logs

    def compile(
        self,
        optimizer: Any = "rmsprop",
        loss: Any = None,
        loss_weights: Any = None,
        metrics: Any = None,
        weighted_metrics: Any = None,
        run_eagerly: bool = False,
        steps_per_execution: int = 1,
        jit_compile: bool | str = "auto",
        auto_scale_loss: bool = True,
    ) -> None:
        """Configures training as `keras.Model.compile` does, without a `loss`.

        Args:
            optimizer: the optimizer, as in `keras.Model.compile` (a name or
                a `keras.optimizers.Optimizer`). Under a `mixed_float16`
                policy it is wrapped in a `LossScaleOptimizer`, as Keras does.
            loss: must stay `None`: the DUQ loss (binary cross-entropy on
                the kernel values plus the gradient penalty) is built in,
                and any other value raises a `ValueError`.
            loss_weights: as in `keras.Model.compile` (there is one loss).
            metrics: metrics of the kernel values: each receives
                `(y_true, kernel_values)`, e.g. `"accuracy"`.
            weighted_metrics: as `metrics`, weighted by `sample_weight`.
            run_eagerly: run the steps eagerly (debugging).
            steps_per_execution: batches per compiled call.
            jit_compile: XLA, as in `keras.Model.compile`. On TensorFlow the
                step's computation is compiled and its checks and state
                updates stay around it (XLA drops assertions); on PyTorch
                the steps always run eagerly (`torch.compile` does not
                differentiate twice).
            auto_scale_loss: loss scaling under `mixed_float16`.

        Example:

        ```python
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
        ```
        """
        if loss is not None:
            raise ValueError(own_loss_message(loss))
        # Keras's arguments, in its order (the same in Keras 3.3 to 3.15).
        super().compile(
            optimizer, None, loss_weights, metrics, weighted_metrics,
            run_eagerly, steps_per_execution, jit_compile, auto_scale_loss,
        )  # fmt: skip

    def compile_from_config(self, config: dict[str, Any]) -> None:
        # Keras does not restore the compilation of models that override
        # `compile` (it cannot know what the override needs); this one only
        # adds a check, so loading compiles as Keras's own would.
        config = _compat.portable_config(config)
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    # On TensorFlow, in-memory arrays reach Keras as the same batches in a
    # pipeline without tf.data's autotuning
    # (`_tensorflow_trainer._quiet_array_inputs`).

    def _prepared_call(self, method, name, args, kwargs):
        """`(args, kwargs)` for the Keras `method`: data checked whole, a
        `HealthCheck` added (`fit`, `evaluate`), fed as the backend wants."""
        arguments = _validation.lists_as_arrays(
            self, _bound_arguments(method, args, kwargs)
        )
        _validation.check_call_data(self, name, arguments)
        if name == "fit" and self.duq_output.needs_start:
            arguments = self._start_from_data(arguments)
        if self.health_checks and name != "predict":
            arguments = _health.with_health_check(self, arguments)
        return (), _BackendTrainer.prepare_arguments(name, arguments)

    def _start_from_data(self, arguments):
        """`length_scale="auto"`: the head's scale and centroid start from a
        sample of the training inputs (`DUQOutput.start_from_features`);
        the arguments, with a generator's first batch put back."""
        x = arguments.get("x")
        if inspect.isgenerator(x):
            first = next(x, None)
            if first is None:
                return arguments  # empty: `fit` says so
            arguments = {**arguments, "x": _chained(first, x)}
            sample = as_arrays(inputs_of(first))
        else:
            sample, _ = _health.sample_inputs(x, arguments.get("batch_size"))
        if sample is None:
            return arguments
        head = self.duq_output
        self._unstarted = [keras.ops.copy(v.value) for v in head.start_variables]
        features = self.feature_extractor(sample, training=False)
        head.start_from_features(features)
        return arguments

    @_documented(
        keras.Model.fit,
        """Trains the model as `keras.Model.fit` does, with the DUQ step.

        What `DUQModel` adds to Keras's `fit`:

        - The data is checked before any step (input shapes and dtypes,
          label values and forms, `class_weight`, a dataset's element spec);
          bad data raises a `ValueError` that names the argument and the fix,
          and the model is left unchanged.
        - With `length_scale="auto"` (the default), the first `fit` sets the
          head's length scale and centroid start from a sample of `x`
          (`DUQOutput.start_from_features`).
        - Each step checks its batch and its computed update before
          assigning anything: a rejected batch raises `DUQBatchError` (a
          `ValueError`) and changes no weight, centroid or optimizer slot; in
          a stream, the steps before it stay applied and the error says how
          many.
        - With `health_checks=True` (the default) a `HealthCheck` callback
          warns when the certainty is meaningless (underflowing kernel
          values, a constant penalty, unsettled BatchNorm statistics, ...)
          and names a fix.
        - Logs `loss`, `bce`, `gradient_penalty`, `accuracy` and, with health
          checks, `certainty` and the health metrics.
        """,
    )
    def fit(self, *args: Any, **kwargs: Any) -> keras.callbacks.History:
        self._unstarted = None
        args, kwargs = self._prepared_call(super().fit, "fit", args, kwargs)
        iterations = _trainer.optimizer_steps_or_zero(self)
        try:
            with _failed_call_guard(self, iterations), _empty_data_error("fit"):
                history = super().fit(*args, **kwargs)
        except BaseException:
            # A call that applied no step leaves the head as it found it.
            if self._unstarted is not None and (
                _trainer.optimizer_steps_or_zero(self) == iterations
            ):
                for variable, value in zip(
                    self.duq_output.start_variables, self._unstarted
                ):
                    variable.assign(value)
            raise
        finally:
            self._unstarted = None
        ran_no_step = (
            _trainer.optimizer_steps_or_zero(self) == iterations
            and kwargs.get("epochs", 1) > kwargs.get("initial_epoch", 0)
            and not self.stop_training
            and not self._uses_loss_scale()
        )
        if ran_no_step:
            raise ValueError(_validation.EMPTY_STREAM_MESSAGE.format(method="fit"))
        return history

    @_documented(
        keras.Model.evaluate,
        """Evaluates the model as `keras.Model.evaluate` does.

        What `DUQModel` adds: the data is checked first, as in `fit`; the
        logs hold the DUQ loss (`loss`, `bce`, `gradient_penalty`),
        `accuracy` and the compiled metrics of the kernel values; with
        `health_checks=True` the health metrics too. A rejected batch raises
        `DUQBatchError` and changes no state.
        """,
    )
    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._prepared_call(super().evaluate, "evaluate", args, kwargs)
        with _failed_call_guard(self), _empty_data_error("evaluate"):
            results = super().evaluate(*args, **kwargs)
        if float(self._objective_tracker.count) == 0:
            raise ValueError(_validation.EMPTY_STREAM_MESSAGE.format(method="evaluate"))
        return results

    @_documented(
        keras.Model.predict,
        """The kernel values `(batch, num_classes)`, each in `[0, 1]`.

        What `DUQModel` adds to `keras.Model.predict`: the inputs are checked
        first, as in `fit`; the prediction is `argmax` of the kernel values
        and the certainty their `max` (low: likely out of distribution); a
        row whose float inputs are not finite gets NaN; with
        `health_checks=True` predictions on data like the training data are
        checked for underflowing kernel values.
        """,
    )
    def predict(self, *args: Any, **kwargs: Any) -> np.ndarray:
        args, kwargs = self._prepared_call(super().predict, "predict", args, kwargs)
        with (
            _failed_call_guard(self),
            _empty_data_error("predict"),
            quiet_retracing(),
        ):
            kernel_values = super().predict(*args, **kwargs)
        if self.health_checks:
            _health.check_predictions(self, kernel_values)
        return kernel_values

    # ---------------------------------------------------------------- export

    def export(
        self,
        filepath: str | os.PathLike,
        format: str = "tf_saved_model",
        verbose: bool = False,
        input_signature: Any = None,
        certainty_threshold: float | None = None,
        calibrator: CertaintyCalibrator | None = None,
        top_k: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Exports the DUQ serving outputs (Keras's `Model.export`).

        Every format serves the same computation and outputs: a dict of

        - `kernel_values`: `(batch, num_classes)` float32 kernel values;
        - `predictions`: `(batch,)` int64 predicted class (argmax; int32
          from JAX, which has no int64 without x64);
        - `certainty`: `(batch,)` float32 max kernel value;
        - `accept`: `(batch,)` bool, `certainty >= certainty_threshold`
          (compared in float32), only with `certainty_threshold`;
        - `probability_correct`: `(batch,)` float32, the calibrator's
          probability that the prediction is correct, only with
          `calibrator`.

        With `top_k`, `kernel_values` is replaced by `top_k_classes`
        `(batch, top_k)` int64 and `top_k_kernel_values` `(batch, top_k)`
        float32, the classes of the largest kernel values, largest first:
        at thousands of classes a response then holds `top_k` values per
        example, not one per class.

        A row with a NaN or infinite input gets NaN float outputs and
        `accept` False (its `predictions` value means nothing).

        Formats, by backend: `"tf_saved_model"` from TensorFlow and JAX
        (JAX through `jax2tf`); `"onnx"` and `"openvino"` from all three
        (from JAX and PyTorch, OpenVINO's file is converted from the ONNX
        export); `"litert"` from TensorFlow and PyTorch (from PyTorch through
        `litert-torch`, installed apart from the `export` extra, with the
        input signature's batch size fixed: 1 unless `input_signature`
        gives one); `"torch"` (`torch.export`) from PyTorch. Another format
        raises a `ValueError` that says what works. The outputs are named
        as above in every format (ONNX and `torch` list them in the order
        of their names). The SavedModel's `serving_default` signature
        (also `serve`) takes the input with a free batch dimension, under
        a stable name: `inputs` for a single-input model, the keys of a
        dict of inputs, or `inputs_0`, `inputs_1`, ... for a list; every
        format names a single input `inputs`. A mixed-precision model
        exports to every format but LiteRT, whose built-in operators have
        no float16 matrix multiply. Loading needs only the format's
        runtime (`tf.saved_model.load`, `onnxruntime`, `ai_edge_litert`,
        `openvino`, `torch.export.load`).

        Example:

        ```python
        model.export("duq_savedmodel", certainty_threshold=0.5)
        reloaded = tf.saved_model.load("duq_savedmodel")
        outputs = reloaded.signatures["serving_default"](inputs=tf.constant(x))
        outputs["accept"]  # False: refer the example to a person

        model.export("duq.onnx", format="onnx", certainty_threshold=0.5)
        session = onnxruntime.InferenceSession("duq.onnx")
        names = [output.name for output in session.get_outputs()]
        outputs = dict(zip(names, session.run(None, {"inputs": x})))
        ```

        The body of a TF Serving REST request (`POST .../models/NAME:predict`)
        is `{"instances": x.tolist()}`.

        Args:
            filepath: where to write: a directory for the SavedModel, a
                `.onnx`, `.tflite`, `.xml` (OpenVINO) or `.pt2` file.
            format: `"tf_saved_model"` (default), `"onnx"`, `"litert"`,
                `"openvino"` or `"torch"`, as the backend supports (above).
            verbose: whether to print Keras's summary of the export
                (hundreds of lines for a large backbone). Defaults to
                `False`.
            input_signature: optional structure of `tf.TensorSpec` (or
                `keras.InputSpec`) for the inputs; defaults to the model's
                inputs with a free batch size and the names above.
            certainty_threshold: optional float in `[0, 1]`; adds the
                `accept` output. Choose it on in-distribution validation
                data, e.g. the certainty that keeps 95% of it.
            calibrator: optional fitted
                `keras_duq.evaluation.CertaintyCalibrator`; adds the
                `probability_correct` output.
            top_k: optional int in `[1, num_classes]`: serve the `top_k`
                largest kernel values and their classes instead of every
                kernel value.
            **kwargs: for the SavedModel on JAX, Keras's `is_static` and
                `jax2tf_kwargs` (any other keyword raises a `ValueError`);
                for other formats, passed to `keras.Model.export`.
        """
        from keras_duq import _export

        _export.export(
            self,
            filepath,
            format,
            verbose,
            input_signature,
            certainty_threshold=certainty_threshold,
            calibrator=calibrator,
            top_k=top_k,
            **kwargs,
        )

    # -------------------------------------------------------- serialization

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "trainable": self.trainable,
            "feature_extractor": keras.saving.serialize_keras_object(
                self.feature_extractor
            ),
            "duq_output": keras.saving.serialize_keras_object(self.duq_output),
            "gradient_penalty": self.gradient_penalty,
            "penalty": self.penalty,
            "penalty_interval": self.penalty_interval,
            "weight_decay": self.weight_decay,
            "bce_epsilon": self.bce_epsilon,
            "categorical_cross_entropy_weight": self.categorical_cross_entropy_weight,
            **_saved_configs.MODEL_MARKERS,
            "clipnorm": self.clipnorm,
            "health_checks": self.health_checks,
            "penalty_input": self.penalty_input,
        }

    @classmethod
    def from_config(
        cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None
    ) -> DUQModel:
        # Copied: Keras's deserialisation consumes the nested configs, and the
        # caller's `config` stays usable.
        config = copy.deepcopy(config)
        feature_extractor = keras.saving.deserialize_keras_object(
            config.pop("feature_extractor"), custom_objects=custom_objects
        )
        duq_output = keras.saving.deserialize_keras_object(
            config.pop("duq_output"), custom_objects=custom_objects
        )
        config = _saved_configs.model_config(config, duq_output.num_classes)
        outputs = duq_output(feature_extractor.output)
        return cls(feature_extractor.input, outputs, **config)


def _bound_arguments(method, args, kwargs):
    """Every parameter of the Keras `method` by name, defaults included."""
    signature = inspect.signature(method)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = {}
    for parameter, value in bound.arguments.items():
        if signature.parameters[parameter].kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        else:
            arguments[parameter] = value
    return arguments


@contextlib.contextmanager
def _failed_call_guard(model, iterations=None):
    """What keeps a failed call from leaving the model unusable (see `_compat`),
    and a rejected batch's error typed (`DUQBatchError`; in training, with the
    steps applied since `iterations`)."""
    with _compat.purged_values_restored_on_failure(model):
        try:
            yield
        except UnboundLocalError:
            raise  # no batches: `_empty_data_error` says so
        except Exception as error:
            rejected = _trainer.rejected_batch_error(model, error, iterations)
            if rejected is None or rejected is error:
                raise
            raise rejected from error


def _chained(first, rest):
    """A generator of `first`, then what `rest` yields."""
    yield first
    yield from rest


@contextlib.contextmanager
def _empty_data_error(method):
    """Keras's loops fail on a stream of no batches with an `UnboundLocalError`
    (JAX's `fit` and `evaluate`, every `predict`): say what happened instead."""
    try:
        yield
    except UnboundLocalError as error:
        raise ValueError(
            _validation.EMPTY_STREAM_MESSAGE.format(method=method)
        ) from error


class _RetracingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "triggered tf.function retracing" not in record.getMessage()


@contextlib.contextmanager
def quiet_retracing() -> Iterator[None]:
    """Drops TensorFlow's retracing warning inside the block.

    Every model traces its own `predict` function once, and TensorFlow
    counts the traces of all models' functions together: from the sixth
    model on (a search's trials, the examples' several models), it reports
    excessive retracing although nothing is traced twice. Other messages
    pass; the filter is removed afterwards.
    """
    logger = logging.getLogger("tensorflow")
    retracing_filter = _RetracingFilter()
    logger.addFilter(retracing_filter)
    try:
        yield
    finally:
        logger.removeFilter(retracing_filter)

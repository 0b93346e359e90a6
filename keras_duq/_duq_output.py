"""The DUQ output layer: per-class RBF kernels around moving-average centroids."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_duq import _ops
from keras_duq import _saved_configs
from keras_duq._ops import to_float64
from keras_duq._typing import Tensor
from keras_duq._validation import check_int
from keras_duq._validation import check_positive

DEFAULT_KERNEL_INITIALIZER = "he_normal"
# The default centroid size is the number of features, capped here: the head
# has `features * centroid_dims * num_classes` weights, which without the cap
# grows with the square of a wide backbone's width. The paper's FashionMNIST
# model (256 features) is unchanged by the cap.
MAX_DEFAULT_CENTROID_DIMS = 256
# With many classes the default centroid size shrinks so that all centroids
# together hold at most this many coordinates (and each at least
# `MIN_DEFAULT_CENTROID_DIMS`): the per-class head's step grows with
# `features * centroid_dims * num_classes`, and on a 150-intent text model it
# was 10x a softmax step at 128 dimensions, 3x at 16, with OoD ranking as good
# (docs/reports/defaults.md). Ten classes keep up to 256 dimensions (the
# paper's FashionMNIST head).
MAX_DEFAULT_CENTROID_COORDINATES = 2560
MIN_DEFAULT_CENTROID_DIMS = 16
# `W` learns at 0.3 of the optimizer's rate: it stays closer to its random
# start, which keeps more of the out-of-distribution separation that the
# backbone's features hold. At 0.1 short runs on tabular rows trained below
# softmax; at 1.0 (the paper's) most problems ranked OoD lower
# (docs/reports/defaults.md).
DEFAULT_PROJECTION_LEARNING_RATE = 0.3
PAPER_PROJECTION_LEARNING_RATE = 1.0
HEADS = ("auto", "per_class", "shared")
# `head="auto"` keeps the paper's per-class head up to this many projection
# values (`features * centroid_dims * num_classes`; 64 MB of float32, three
# times that with Adam's moments) and takes the shared head above it. The
# per-class head's training step grows with this product; the shared head holds
# `features * centroid_dims` values whatever the number of classes.
MAX_PER_CLASS_HEAD_VALUES = 2**24
AUTO = "auto"
# `length_scale="auto"`'s value until `start_from_features` measures it: the
# paper's, so a model used before training computes what it always did.
AUTO_PLACEHOLDER_LENGTH_SCALE = 0.1
# `length_scale="auto"`: the length scale in units of the features' spread
# (`_ops.embedding_scale`), at the start and as it moves in training. At 0.35
# an example one spread from its centroid has a kernel value of exp(-4). Of
# 0.25, 0.35 and 0.5 (docs/reports/defaults.md), 0.5 ranked OoD digits below
# softmax and 0.25 left short runs' certainty below 0.05.
AUTO_LENGTH_SCALE_SPREADS = 0.35


@keras.saving.register_keras_serializable(package="keras_duq")
class DUQOutput(keras.layers.Layer):
    """Deterministic Uncertainty Quantification (DUQ) output layer.

    Replaces a softmax classifier head. Each class `c` has a learned
    projection `W_c` and a centroid `e_c`; the layer returns, for each class,
    the RBF kernel value between the projected features and the centroid:

    `K_c = exp(-mean_over_centroid_dims((W_c f(x) - e_c)^2) / (2 length_scale^2))`

    With `head="shared"` all classes share one projection `W` and differ
    only by their centroids, `K_c = exp(-mean((W f(x) - e_c)^2) / (2
    length_scale^2))`: the head holds `features * centroid_dims` values
    instead of `features * centroid_dims * num_classes`, for hundreds or
    thousands of classes. `head="auto"` (default) builds the per-class head
    up to `MAX_PER_CLASS_HEAD_VALUES` (2**24) values, the shared one above.

    Every value lies in `[0, 1]`. The prediction is `argmax_c K_c` and the
    certainty is `max_c K_c`: an input far from every centroid has low
    certainty, i.e. it is likely out of distribution.

    The centroids are not trained by gradient descent. Like the moving
    statistics of `BatchNormalization`, they are non-trainable state that is
    updated once per training step by `DUQModel.train_step`, from the
    features of the current batch computed in inference mode with the
    weights the step's gradients were taken at, and assigned with the
    optimizer step, after the step's checks:

    - `N_c = momentum * N_c + (1 - momentum) * (number of class-c examples)`
    - `m_c = momentum * m_c + (1 - momentum) * sum(W_c f(x) for class-c x)`
    - `e_c = m_c / N_c`
    - with `length_scale="auto"`: `sigma = momentum * sigma + (1 - momentum)
      * 0.35 * spread`, `spread` the root of the batch's mean per-dimension
      variance of the projected features

    The state starts at `N_c = 12` and `m_c = 12 * normal(0, 1)`, as in the
    reference implementation, or, with `bias_correction=True`, at a
    negligible `N_c`, so that each centroid is the average of its class's
    embeddings as soon as the class has been seen.

    **During training and inference** the layer computes the same thing;
    calling it never changes the centroids. Its computation always runs in
    float32, whatever the global dtype policy, and its output is float32.

    `W` is stored as one matrix `kernel` of shape
    `(features, centroid_dims * num_classes)`, so `W_c` is
    `ops.reshape(kernel, (features, centroid_dims, num_classes))[:, :, c]`
    transposed. One matrix makes the projection of all classes a single
    matrix multiplication, and gives Keras initializers the right fan-in
    (`features`). With a `projection_learning_rate` other than 1, `kernel`
    holds `W / projection_learning_rate`; the `projection` property is `W`.

    Example:

    ```python
    inputs = keras.Input(shape=(28, 28, 1))
    x = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras_duq.DUQOutput(num_classes=10, centroid_dims=32)(x)
    model = keras_duq.DUQModel(inputs, outputs)
    model.compile(optimizer="adam")
    ```

    Args:
        num_classes: int, number of classes (at least 2).
        centroid_dims: int or `None`, size `n` of the centroids and of each
            projected feature vector `W_c f(x)`. `None` (default) uses the
            number of input features, at most 256 and at most
            `2560 // num_classes` (but at least 16): the head has
            `features * centroid_dims * num_classes` weights, and the caps
            keep it proportionate on wide backbones (5.2M weights instead of
            42M for 2048 features and 10 classes) and with many classes (17
            dimensions for 150 classes). The paper used 256 for
            FashionMNIST and 512 for CIFAR-10 (pass it explicitly).
        length_scale: `"auto"` (default) or a float > 0, the RBF length
            scale `sigma`. `"auto"` measures it on the features: at the
            start of the first `fit` (or `start_from_features`), `sigma` is
            set to 0.35 times the spread of the projected training features
            (the root of their mean variance), and the centroids' random
            start is placed around their mean at that spread, so that the
            kernel values start near `exp(-8)`, not underflowing, whatever
            the backbone's scale. From then on `sigma` follows 0.35 times
            the features' spread as a moving average, updated with the
            centroids (same `momentum`): features that grow or shrink in
            training keep their kernel values on the same scale. A
            fixed `sigma` (the paper's `0.1` for FashionMNIST and CIFAR-10)
            suits features whose spread is near it; on small or
            short-trained models it can leave every kernel value
            underflowing. With `trainable_length_scale=True` it is the
            initial value of a per-class learned length scale.
        momentum: float in `[0, 1)`, momentum of the centroid moving average
            (as in `BatchNormalization`). Defaults to `0.999`.
        kernel_initializer: initializer for `W`. Defaults to `"he_normal"`:
            scaled by the fan-in, so the projected features keep the scale of
            the input features whatever their number. Small models can do
            better with a larger scale (the two-moons demo uses
            `RandomNormal(stddev=1.0)`).
        trainable_length_scale: bool, whether to learn one length scale per
            class by gradient descent. Defaults to `False`. The length
            scales learn at the optimizer's full rate: with Adam at its
            default rate they settle, with SGD at the paper's rate they can
            grow far past a useful scale.
        trainable_projection: bool, whether `W` is learned (as in the
            paper) or stays at its random initial value, a fixed random
            projection of the features. Defaults to `True`.
        projection_learning_rate: float > 0, the rate at which `W` learns,
            as a multiple of the optimizer's learning rate. Defaults to
            `0.3`: `W` stays closer to its random initial value, which keeps
            more of the separation of out-of-distribution inputs that the
            backbone's features hold. `1.0` trains `W` like every other
            weight, as the paper does. Exact for
            optimizers whose step is proportional to the learning rate (SGD,
            Adam and their kin):
            `kernel` holds `W / projection_learning_rate`, and the layer
            multiplies it back.
        bias_correction: bool, whether the centroid moving average is
            bias-corrected (as Adam's moment estimates are). `False` starts
            the state as the paper does, as if every class had already been
            seen 12 times at a random centroid: with `momentum=0.999` the
            centroids owe most of their value to their random start for
            hundreds of steps, and short trainings give near-zero certainty
            everywhere. `True` makes each centroid the momentum-weighted
            average of its class's embeddings from the first batch that
            contains the class on.
        head: `"auto"` (default), `"per_class"` or `"shared"`. The paper's
            `"per_class"` head learns one projection `W_c` per class
            (`features * centroid_dims * num_classes` values); `"shared"`
            learns one `W` for all classes (`features * centroid_dims`
            values), with one centroid per class in its space. `"auto"`
            takes the per-class head while it has at most 2**24 values
            (16.8M; e.g. 10 classes on 2048 features, 150 on 128) and the
            shared head above.
        **kwargs: base layer keyword arguments such as `name`. The layer's
            dtype is always float32.

    Input shape:
        `(batch_size, features)`: the output of a feature extractor. Add
        `keras.layers.Flatten()` or `keras.layers.GlobalAveragePooling2D()`
        to a backbone that returns feature maps.

    Output shape:
        `(batch_size, num_classes)` float32 kernel values in `[0, 1]`.

    References:
        - [van Amersfoort et al., 2020](https://arxiv.org/abs/2003.02037),
          "Uncertainty Estimation Using a Single Deep Deterministic Neural
          Network", ICML 2020.
    """

    def __init__(
        self,
        num_classes: int,
        centroid_dims: int | None = None,
        length_scale: float | str = "auto",
        momentum: float = 0.999,
        kernel_initializer: str | keras.initializers.Initializer = (
            DEFAULT_KERNEL_INITIALIZER
        ),
        trainable_length_scale: bool = False,
        bias_correction: bool = False,
        trainable_projection: bool = True,
        projection_learning_rate: float = DEFAULT_PROJECTION_LEARNING_RATE,
        head: str = "auto",
        **kwargs: Any,
    ) -> None:
        dtype = kwargs.pop("dtype", None)
        if dtype is not None:
            policy = keras.dtype_policies.get(dtype)
            if policy.compute_dtype != "float32":
                raise ValueError(
                    "DUQOutput always computes in float32 (its kernel, "
                    "centroids and gradient penalty need the precision). "
                    "Leave `dtype` unset; mixed-precision backbones work. "
                    f"Received: `dtype={dtype!r}`"
                )
        super().__init__(dtype="float32", **kwargs)
        check_int("num_classes", num_classes, minimum=2)
        if centroid_dims is not None:
            check_int("centroid_dims", centroid_dims, minimum=1)
        if length_scale != AUTO and (
            isinstance(length_scale, bool)
            or not isinstance(length_scale, (int, float))
            or not length_scale > 0
        ):
            raise ValueError(
                'Expected `length_scale` to be "auto" (measured on the features '
                "at the start of training) or a float > 0. "
                f"Received: `length_scale={length_scale!r}`"
            )
        if not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(
                "Expected `momentum` to be a float in [0, 1) (the paper uses "
                f"0.99 to 0.999). Received: `momentum={momentum!r}`"
            )
        check_positive(
            "projection_learning_rate",
            projection_learning_rate,
            "(a multiple of the optimizer's learning rate; to keep `W` fixed, "
            "pass `trainable_projection=False`)",
        )
        if head not in HEADS:
            raise ValueError(
                f"Unknown `head`. Expected one of {HEADS}: 'per_class' is the "
                "paper's head (one projection per class), 'shared' one "
                "projection for all classes (for many classes), 'auto' the "
                f"per-class head up to {MAX_PER_CLASS_HEAD_VALUES:,} projection "
                "values and the shared one above. "
                f"Received: `head={head!r}`"
            )
        self.head = head
        self.num_classes = num_classes
        self.centroid_dims = centroid_dims
        self.length_scale = AUTO if length_scale == AUTO else float(length_scale)
        self.momentum = float(momentum)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.trainable_length_scale = bool(trainable_length_scale)
        self.bias_correction = bool(bias_correction)
        self.trainable_projection = bool(trainable_projection)
        self.projection_learning_rate = float(projection_learning_rate)
        self.input_spec = keras.layers.InputSpec(ndim=2)

    def build(self, input_shape: tuple) -> None:
        check_feature_shape(input_shape)
        features = input_shape[-1]
        dims = self.centroid_dims or default_centroid_dims(features, self.num_classes)
        self._resolved_centroid_dims = dims
        self._resolved_head = resolve_head(self.head, features, dims, self.num_classes)
        rate = self.projection_learning_rate

        def stored_initial_value(shape, dtype=None):
            return self.kernel_initializer(shape, dtype) / rate

        self.kernel = self.add_weight(
            name="kernel",
            # The shared head has one projection: `(features, dims)`.
            shape=(
                features,
                dims * (self.num_classes if self._resolved_head == "per_class" else 1),
            ),
            initializer=self.kernel_initializer
            if rate == 1.0
            else stored_initial_value,
            trainable=self.trainable_projection,
        )
        self.length_scales = self.add_weight(
            name="length_scales",
            shape=(self.num_classes,),
            initializer=keras.initializers.Constant(
                AUTO_PLACEHOLDER_LENGTH_SCALE
                if self.length_scale == AUTO
                else self.length_scale
            ),
            trainable=self.trainable_length_scale,
            # Following the spread, it is assigned as the centroids are
            # (otherwise Keras's default, which differs between versions).
            **({"aggregation": "mean"} if self._follows_spread else {}),
        )
        if self.length_scale == AUTO:
            # 1 once `start_from_features` has set the length scale and the
            # centroids' start: saved with the model, so that a reloaded
            # model that trained keeps them.
            self.started = self.add_weight(
                name="started",
                shape=(),
                initializer="zeros",
                trainable=False,
                aggregation="only_first_replica",
            )
        prior_count = (
            _ops.BIAS_CORRECTED_CENTROID_COUNT
            if self.bias_correction
            else _ops.INITIAL_CENTROID_COUNT
        )
        # Replicas all-reduce the batch statistics before assigning, so every
        # replica assigns the same value and "mean" aggregation is exact.
        self.centroid_counts = self.add_weight(
            name="centroid_counts",
            shape=(self.num_classes,),
            initializer=keras.initializers.Constant(prior_count),
            trainable=False,
            aggregation="mean",
        )
        self.centroid_sums = self.add_weight(
            name="centroid_sums",
            shape=(dims, self.num_classes),
            initializer=keras.initializers.RandomNormal(stddev=prior_count),
            trainable=False,
            aggregation="mean",
        )
        self.input_spec = keras.layers.InputSpec(ndim=2, axes={-1: features})

    @property
    def needs_start(self) -> bool:
        """Whether `length_scale="auto"` still waits for `start_from_features`."""
        return (
            self.length_scale == AUTO
            and self.built
            and float(to_float64(self.started)) == 0.0
        )

    @property
    def start_variables(self) -> list:
        """The variables `start_from_features` sets."""
        return [self.length_scales, self.centroid_sums, self.started]

    def start_from_features(self, features: Tensor) -> None:
        """Sets `length_scale="auto"`'s length scale and centroid start from features.

        `fit` calls this once, on a sample of its training inputs, before
        the first step; call it yourself only in a custom training loop.
        The length scale becomes the spread of the projected features
        (`_ops.embedding_scale`), and the centroids start around their mean
        at that spread (`_ops.centroid_start`), with the counts kept, so the
        moving averages move them as before. A layer with a fixed
        `length_scale` is left as it is.

        Example:

        ```python
        head = model.duq_output
        if head.needs_start:  # a custom training loop, before its first step
            head.start_from_features(model.feature_extractor(x_train[:512]))
        ```

        Args:
            features: `(batch, features)` backbone output on training
                inputs, in inference mode; at least two examples.
        """
        if self.length_scale != AUTO:
            return
        embeddings = self.embed(features)
        scale = _ops.embedding_scale(_ops.embedding_variance(embeddings))
        noise = keras.random.normal(
            (self._resolved_centroid_dims, self.num_classes), dtype="float32"
        )
        centroids = _ops.centroid_start(embeddings, scale, noise)
        self.length_scales.assign(self._auto_length_scales(scale))
        self.centroid_sums.assign(centroids * self.centroid_counts.value[None, :])
        self.started.assign(1.0)

    @property
    def resolved_head(self) -> str:
        """`"per_class"` or `"shared"`: the head built (`head="auto"` chooses at build)."""
        return getattr(self, "_resolved_head", self.head)

    @property
    def centroids(self) -> Tensor:
        """The current centroids `e_c`, shape `(centroid_dims, num_classes)`."""
        return _ops.centroids(self.centroid_counts, self.centroid_sums)

    @property
    def projection(self) -> Tensor:
        """`W`: `kernel` times the rate.

        Shape `(features, centroid_dims * num_classes)` for the per-class
        head, `(features, centroid_dims)` for the shared one.

        Its value is `projection_learning_rate * kernel`, but the gradient
        reaches `kernel` unscaled, so an optimizer's step on `kernel` moves
        `W` by `projection_learning_rate` times the step.
        """
        return _ops.rate_scaled(self.kernel, self.projection_learning_rate)

    def embed(self, features: Tensor) -> Tensor:
        """Projects features with every `W_c`: `(batch, centroid_dims, classes)`.

        The shared head has one projection: `(batch, centroid_dims)`.

        Args:
            features: tensor `(batch, features)`, the backbone's output.
        """
        features = ops.cast(features, "float32")
        projected = ops.matmul(features, self.projection)
        if self._resolved_head == "shared":
            return projected
        return ops.reshape(
            projected, (-1, self._resolved_centroid_dims, self.num_classes)
        )

    def log_kernel_values(self, features: Tensor) -> Tensor:
        """`log K_c` for every class: `(batch, num_classes)`, all `<= 0`.

        Prefer this to `log(layer(features))`: kernel values underflow to
        zero far from the centroids, their logarithm does not.

        Args:
            features: tensor `(batch, features)`, the backbone's output.
        """
        distances = _ops.squared_distances(self.embed(features), self.centroids)
        return _ops.log_kernel_values(distances, self.length_scales)

    def call(self, inputs: Tensor) -> Tensor:
        return ops.exp(self.log_kernel_values(inputs))

    def update_centroids(self, features: Tensor, labels_one_hot: Tensor) -> Tensor:
        """One moving-average step of the centroid state on a batch.

        `DUQModel`'s training step does this once per step; call it yourself
        only in a custom training loop. Under a `tf.distribute` strategy the
        per-class counts and sums are summed over all replicas first, so the
        update uses the global batch and every replica keeps the same state.
        An update that would not be finite (features that overflow) is not
        applied: the centroids keep their values, and the result says so.

        Args:
            features: `(batch, features)` backbone output, computed in
                inference mode.
            labels_one_hot: `(batch, num_classes)` one-hot labels.

        Returns:
            A scalar bool tensor: whether the update was finite and applied.
            The caller decides what a refused update means (`DUQModel`'s
            step computes the same update before assigning anything, and
            raises).
        """
        values, finite = self._next_centroid_state(features, labels_one_hot)
        # A select, not a Python `if`: the same code runs eagerly and inside
        # a compiled TensorFlow step.
        self._assign_centroid_state(
            [
                ops.where(finite, value, variable.value)
                for value, variable in zip(values, self._centroid_state)
            ]
        )
        return finite

    @property
    def _follows_spread(self) -> bool:
        """Whether the length scale follows the features' moving spread.

        `length_scale="auto"` without `trainable_length_scale`.
        """
        return self.length_scale == AUTO and not self.trainable_length_scale

    @property
    def _centroid_state(self) -> list:
        """The variables a centroid update assigns, in `_next_centroid_state`'s order.

        `centroid_counts` and `centroid_sums`, and `length_scales` where it
        follows the features' spread.
        """
        state = [self.centroid_counts, self.centroid_sums]
        return state + [self.length_scales] if self._follows_spread else state

    def _assign_centroid_state(self, values: list) -> None:
        """Assigns the centroid state (a training step's commit).

        Args:
            values: new values of `_centroid_state`, in its order.
        """
        for variable, value in zip(self._centroid_state, values):
            variable.assign(value)

    def _next_centroid_state(
        self, features: Tensor, labels_one_hot: Tensor
    ) -> tuple[list, Tensor]:
        """The centroid state after one batch, without assigning it.

        Reads the current state (the variables, or their values inside a
        `keras.StatelessScope`, as JAX's training step runs it).

        Args:
            features: `(batch, features)` backbone output.
            labels_one_hot: `(batch, num_classes)` one-hot labels.

        Returns:
            `(values, finite)`: the new values of `_centroid_state`, and a
            scalar bool tensor, whether all are finite.
        """
        embeddings = self.embed(features)
        statistics = _ops.centroid_statistics(
            embeddings, ops.cast(labels_one_hot, "float32")
        )
        if self._follows_spread:
            # Moments about the current centroids, which every replica holds:
            # the replicas' sums then give the global batch's variance
            # exactly, with little cancellation (the centroids sit near the
            # features' means).
            reference = self.centroids
            if len(embeddings.shape) == 2:  # the shared head
                reference = ops.mean(reference, axis=-1)
            shifted = embeddings - reference
            statistics += (
                ops.sum(shifted, axis=0),
                ops.sum(ops.square(shifted), axis=0),
                ops.cast(ops.shape(embeddings)[0], "float32"),
            )
        counts, sums, *moments = replica_sum(*statistics)
        values = [
            _ops.moving_average(self.centroid_counts.value, counts, self.momentum),
            _ops.moving_average(self.centroid_sums.value, sums, self.momentum),
        ]
        if moments:
            first, second, batch = moments
            spread = _ops.embedding_scale(_ops.variance_from_sums(first, second, batch))
            moved = _ops.moving_average(
                self.length_scales.value, self._auto_length_scales(spread), self.momentum
            )
            # The spread of one example is not measured: the length scale
            # keeps its value on such a batch.
            values.append(ops.where(batch > 1, moved, self.length_scales.value))
        return values, _ops.all_finite(values)

    def _auto_length_scales(self, spread: Tensor) -> Tensor:
        """`length_scale="auto"`'s value for features of this spread."""
        return ops.ones((self.num_classes,)) * (AUTO_LENGTH_SCALE_SPREADS * spread)

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return (input_shape[0], self.num_classes)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.pop("dtype", None)
        config.update(
            {
                "num_classes": self.num_classes,
                "centroid_dims": self.centroid_dims,
                "length_scale": self.length_scale,
                "momentum": self.momentum,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
                "trainable_length_scale": self.trainable_length_scale,
                "trainable_projection": self.trainable_projection,
                "projection_learning_rate": self.projection_learning_rate,
                "bias_correction": self.bias_correction,
                "head": self.resolved_head,
            }
        )
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DUQOutput:
        return super().from_config(_saved_configs.output_config(config))


def default_centroid_dims(features: int, num_classes: int) -> int:
    """`centroid_dims=None`: the features, at most 256 and at most 2560 coordinates in all."""
    share = max(MAX_DEFAULT_CENTROID_COORDINATES // num_classes, MIN_DEFAULT_CENTROID_DIMS)
    return min(features, MAX_DEFAULT_CENTROID_DIMS, share)


def resolve_head(head: str, features: int, centroid_dims: int, num_classes: int) -> str:
    """`"per_class"` or `"shared"`: what `head` builds on these sizes."""
    if head != "auto":
        return head
    values = features * centroid_dims * num_classes
    return "per_class" if values <= MAX_PER_CLASS_HEAD_VALUES else "shared"


def check_feature_shape(shape: Any) -> None:
    """Raises the error for features that are not `(batch, features)` with known `features`."""
    if len(shape) != 2 or shape[-1] is None:
        raise ValueError(
            "DUQ's head takes features of shape (batch, features) with a known "
            "number of features. Add `keras.layers.GlobalAveragePooling2D()` "
            "(images) or `keras.layers.Flatten()` as the backbone's last layer, "
            "or for `keras.applications` pass `include_top=False, "
            f"pooling='avg'`. Received: features of shape {tuple(shape)}"
        )


def find_duq_output(inputs, outputs):
    """The `DUQOutput` layer that produces `outputs` (else a clear error)."""
    layer = None
    if not isinstance(outputs, (list, tuple, dict)):
        try:
            graph = keras.Model(inputs, outputs)
        except Exception:  # noqa: BLE001 - any failure means "not a DUQ head"
            graph = None
        if graph is not None:
            candidates = [
                candidate
                for candidate in graph.layers
                if isinstance(candidate, DUQOutput) and candidate.output is outputs
            ]
            layer = candidates[0] if candidates else None
    if layer is None:
        raise ValueError(
            "DUQModel's `outputs` must be the output of a `DUQOutput` layer, "
            "e.g. `outputs = keras_duq.DUQOutput(num_classes)(features)`; to "
            "turn an existing backbone into a DUQ model use "
            f"`keras_duq.wrap(backbone, num_classes)`. Received: `outputs={outputs!r}`"
        )
    return layer


def replica_sum(*tensors):
    """`tensors`, each summed over the replicas in sync (as a tuple).

    The centroid update sums its batch statistics over the replicas of a
    `tf.distribute` strategy before the moving-average step, so every replica
    assigns the same state. JAX's and PyTorch's steps see the global batch
    already: a no-op there.
    """
    if keras.backend.backend() != "tensorflow":
        return tensors
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return tensors
    return tuple(context.all_reduce(tf.distribute.ReduceOp.SUM, list(tensors)))

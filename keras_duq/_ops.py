"""The math of DUQ, each formula in exactly one function.

Everything else in keras_duq (the layer, the model, the metrics) calls these
functions, so that the kernel, the loss, the gradient penalty and the centroid
moving average are defined once. All functions take and return float32
tensors; callers are responsible for casting. The last two, `to_float64`
and `optimizer_steps`, read values back to NumPy and Python on any backend.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_duq._typing import Tensor
from keras_duq._validation import is_float

PENALTIES = ("two_sided", "one_sided")

# The centroid state starts as if every class had already been seen this many
# times, as in the reference implementation: the first batches then move the
# centroids gently instead of replacing them.
INITIAL_CENTROID_COUNT = 12.0
# With bias correction the prior is negligible instead: a centroid keeps its
# random initial value until its class is first seen, then it is the
# (momentum-weighted) average of the class's embeddings. A count of exactly
# zero would divide by zero for classes not seen yet.
BIAS_CORRECTED_CENTROID_COUNT = 1e-6

# `log(1 - K)` is evaluated as `log(-expm1(log K))`, which is -inf when a
# feature vector sits exactly on a wrong centroid. Clamping `log K` just below
# zero keeps the loss finite there; the clamp only binds when
# `d / (2 length_scale^2) < 1e-7`, where the true value is below log(1e-7).
_LOG_KERNEL_CEILING = -1e-7

# Added to squared distances (in length scales) under a square root: its
# gradient is then at most 1 / (2 sqrt(1e-6)) = 500 where a feature vector
# sits on a centroid.
_DISTANCE_FLOOR = 1e-6


def squared_distances(embeddings: Tensor, centroids: Tensor) -> Tensor:
    """Mean squared distance between class embeddings and centroids.

    Args:
        embeddings: `(batch, centroid_dims, num_classes)`: `W_c f(x)` for
            every class `c` (the per-class head), or `(batch, centroid_dims)`:
            one `W f(x)` measured against every centroid (the shared head).
        centroids: `(centroid_dims, num_classes)`: `e_c` for every class.

    Returns:
        `(batch, num_classes)`: `mean_over_centroid_dims((W_c f(x) - e_c)^2)`.
        Dividing by `centroid_dims` (the paper's `1/n`) keeps the length
        scale meaningful whatever the centroid size.
    """
    if len(embeddings.shape) == 2:
        return _shared_squared_distances(embeddings, centroids)
    return ops.mean(ops.square(embeddings - centroids[None]), axis=1)


def _shared_squared_distances(embeddings: Tensor, centroids: Tensor) -> Tensor:
    # `||z - e||^2 = ||z||^2 - 2 z.e + ||e||^2`: one matrix product instead of
    # a `(batch, centroid_dims, num_classes)` difference, which at 10,000
    # classes is larger than the whole shared head. Both sides are first
    # centred on the mean centroid, so that the expansion does not cancel
    # large norms against each other (float32 keeps ~7 digits of each).
    center = ops.mean(centroids, axis=1)
    embeddings = embeddings - center[None, :]
    centroids = centroids - center[:, None]
    squared = (
        ops.sum(ops.square(embeddings), axis=1, keepdims=True)
        - 2.0 * ops.matmul(embeddings, centroids)
        + ops.sum(ops.square(centroids), axis=0)[None, :]
    )
    return ops.relu(squared) / ops.cast(ops.shape(centroids)[0], squared.dtype)


# The smallest variance `embedding_scale` reports: features that do not vary
# over the sample (one example, a constant backbone) still give a finite,
# positive length scale.
_MIN_EMBEDDING_VARIANCE = 1e-12


def embedding_variance(embeddings: Tensor) -> Tensor:
    """The mean per-dimension variance of embeddings over the batch.

    Args:
        embeddings: `(batch, centroid_dims, num_classes)` or
            `(batch, centroid_dims)`, as in `squared_distances`.
    """
    return ops.mean(ops.var(embeddings, axis=0))


def variance_from_sums(first: Tensor, second: Tensor, count: Tensor) -> Tensor:
    """`embedding_variance` from sums over a batch of (shifted) embeddings.

    Args:
        first: the sum of the embeddings minus any fixed reference, over
            the batch axis.
        second: the sum of their squares.
        count: the number of embeddings summed.
    """
    mean = first / count
    return ops.mean(ops.maximum(second / count - ops.square(mean), 0.0))


def embedding_scale(variance: Tensor) -> Tensor:
    """The spread of embeddings: the root of their mean per-dimension variance.

    The typical distance (in `squared_distances`' units, a mean over the
    centroid dimensions) of an embedding from the mean embedding. With
    `length_scale="auto"` 0.35 of it is the length scale, and all of it the
    scale of the centroids' random start: the kernel is then measured in
    units of the
    features' own spread instead of an absolute `0.1`, which underflows
    where features are small (pooled embeddings) and saturates where they
    are large.

    Args:
        variance: the embeddings' `embedding_variance` (or
            `variance_from_sums`, for sums over replicas).

    Returns:
        A scalar float32 tensor `> 0`.
    """
    return ops.sqrt(ops.maximum(variance, _MIN_EMBEDDING_VARIANCE))


def centroid_start(embeddings: Tensor, scale: Tensor, noise: Tensor) -> Tensor:
    """Random centroids around the mean embedding, `scale` apart in each dimension.

    `mean_embedding + scale * noise`: every class starts one spread from the
    data, in a random direction of its own, so the kernel values start near
    `exp(-8)` (at a length scale of 0.35 spreads) instead of underflowing,
    and classes are told apart from the first step.

    Args:
        embeddings: as in `embedding_scale`.
        scale: scalar from `embedding_scale`.
        noise: `(centroid_dims, num_classes)` standard normal values.

    Returns:
        `(centroid_dims, num_classes)` centroids.
    """
    center = ops.mean(embeddings, axis=0)
    if len(center.shape) == 1:  # the shared head: one embedding for all classes
        center = center[:, None]
    return center + scale * noise


def log_kernel_values(distances: Tensor, length_scale: float | Tensor) -> Tensor:
    """Logarithm of the RBF kernel: `log K_c = -d_c / (2 length_scale^2)`.

    Working in log space keeps the loss and its gradient exact when the
    kernel values underflow to zero, which is the normal state of a freshly
    initialised model.

    Args:
        distances: `(batch, num_classes)` output of `squared_distances`.
        length_scale: scalar or `(num_classes,)` length scale `sigma`.

    Returns:
        `(batch, num_classes)` log kernel values, all `<= 0`.
    """
    return -distances / (2.0 * ops.square(length_scale))


def binary_cross_entropy(
    log_kernel: Tensor, labels_one_hot: Tensor, epsilon: float = 0.0
) -> Tensor:
    """Per-example DUQ loss: binary cross-entropy of each kernel value.

    `-mean_c [y_c log K_c + (1 - y_c) log(1 - K_c)]`, computed from
    `log K_c` with `log(1 - K_c) = log(-expm1(log K_c))`, so the value is
    exact even where the kernel values underflow.

    Its gradient with respect to each kernel value is
    `(K_c - y_c) / max(K_c (1 - K_c), epsilon) / num_classes`. With
    `epsilon=0` this is the exact gradient: a feature vector far from its
    class centroid is pulled towards it however small its kernel value.
    With `epsilon > 0` it is the gradient of PyTorch's
    `binary_cross_entropy` (which uses `epsilon=1e-12`), the loss of the
    paper's code: a kernel value far below `epsilon` gets almost no
    gradient, so at initialisation, when every kernel value is tiny, the
    centroids first move to the class means (their moving average) before
    the loss pulls features to them. The loss value is the same either way.

    Args:
        log_kernel: `(batch, num_classes)` from `log_kernel_values`.
        labels_one_hot: `(batch, num_classes)` one-hot labels (float32).
        epsilon: float >= 0, floor of `K (1 - K)` in the gradient's
            denominator; `0` for the exact gradient.

    Returns:
        `(batch,)` loss per example (averaged over classes).
    """
    if epsilon > 0:
        # d/d(log K) of the exact loss times min(1, K (1 - K) / epsilon):
        # the value is unchanged, only the gradient is scaled.
        kernel = ops.exp(log_kernel)
        gradient_scale = ops.stop_gradient(
            ops.minimum(1.0, kernel * (1.0 - kernel) / epsilon)
        )
        log_kernel = gradient_scale * log_kernel + ops.stop_gradient(
            (1.0 - gradient_scale) * log_kernel
        )
    log_one_minus_kernel = ops.log(
        -ops.expm1(ops.minimum(log_kernel, _LOG_KERNEL_CEILING))
    )
    per_class = (
        labels_one_hot * log_kernel + (1.0 - labels_one_hot) * log_one_minus_kernel
    )
    return -ops.mean(per_class, axis=-1)


def categorical_cross_entropy(log_kernel: Tensor, labels_one_hot: Tensor) -> Tensor:
    """Per-example categorical cross-entropy over the classes' distances.

    `-sum_c y_c log softmax(-r)_c` with `r_c = sqrt(d_c) / length_scale =
    sqrt(-2 log K_c)`, the distance to each centroid in length scales. The
    binary cross-entropy pushes a feature vector away from a wrong centroid
    only while that kernel value is far from zero, so a misclassified
    example whose kernel values are all small is only pulled towards its own
    centroid; this term also pushes it away from the centroid it is nearest
    to, and vanishes once the example is classified with a margin. The
    distance, not its square (`-log K`), keeps that push bounded: with the
    squared distance it grows with the distance itself, and SGD with
    momentum diverged on it.

    Args:
        log_kernel: `(batch, num_classes)` from `log_kernel_values`.
        labels_one_hot: `(batch, num_classes)` one-hot labels (float32).

    Returns:
        `(batch,)` loss per example.
    """
    # The floor keeps the square root's gradient finite on a centroid.
    distances = ops.sqrt(ops.maximum(-2.0 * log_kernel, 0.0) + _DISTANCE_FLOOR)
    logits = -distances
    return -ops.sum(labels_one_hot * ops.log_softmax(logits, axis=-1), axis=-1)


def duq_loss(
    log_kernel: Tensor,
    labels_one_hot: Tensor,
    penalty: Tensor | None = None,
    penalty_weight: float | Tensor = 0.0,
    sample_weight: Tensor | None = None,
    bce_epsilon: float = 0.0,
    categorical_cross_entropy_weight: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """The batch loss and its BCE part.

    Per example: `bce + categorical_cross_entropy_weight * cce +
    penalty_weight * penalty`, `bce` averaged over classes and `cce` from
    `categorical_cross_entropy`. `cce` is one term per example (a softmax
    over the classes), so its weight is per example too: it does not shrink
    as the number of classes grows, as the positive-class share of `bce`
    does. Keras's `"sum_over_batch_size"` reduction: weighted per-example
    losses are summed and divided by the number of examples.

    Args:
        log_kernel: `(batch, num_classes)` from `log_kernel_values`.
        labels_one_hot: `(batch, num_classes)` float32.
        penalty: `(batch,)` from `gradient_penalty`, or `None` (no penalty).
        penalty_weight: float, the penalty's weight `lambda`.
        sample_weight: `(batch,)` float32 or `None`.
        bce_epsilon: see `binary_cross_entropy`.
        categorical_cross_entropy_weight: float >= 0, the weight of
            `categorical_cross_entropy`.

    Returns:
        `(loss, bce)`: scalar float32 tensors.
    """
    bce = binary_cross_entropy(log_kernel, labels_one_hot, bce_epsilon)
    per_example = bce
    if categorical_cross_entropy_weight > 0:
        per_example = per_example + categorical_cross_entropy_weight * (
            categorical_cross_entropy(log_kernel, labels_one_hot)
        )
    if penalty is not None:
        per_example = per_example + penalty_weight * penalty
    if sample_weight is not None:
        per_example = per_example * sample_weight
        bce = bce * sample_weight
    return ops.mean(per_example), ops.mean(bce)


def gradient_norms(gradients: Iterable[Tensor | None]) -> Tensor:
    """Per-example L2 norm of input gradients, flattened over all inputs.

    The norm is safe at zero: where the gradient is exactly zero (all kernel
    values underflowed, as at initialisation) the norm is 0 and its own
    gradient is 0, not NaN.

    Args:
        gradients: list of `(batch, ...)` gradient tensors, one per
            floating-point input; `None` entries (inputs the output does not
            depend on) are skipped.

    Returns:
        `(batch,)` float32 norms.
    """
    squared = None
    for gradient in gradients:
        if gradient is None:
            continue
        gradient = ops.cast(gradient, "float32")
        batch_size = ops.shape(gradient)[0]
        term = ops.sum(ops.square(ops.reshape(gradient, (batch_size, -1))), -1)
        squared = term if squared is None else squared + term
    if squared is None:
        raise ValueError(
            "The gradient penalty needs the kernel values to depend on at "
            "least one floating-point input (or on the output of the "
            "`penalty_input` layer), but none received a gradient. Check "
            "that the backbone uses them, or pass `gradient_penalty=0` to "
            "train without the penalty."
        )
    positive = squared > 0.0
    # Double `where`: sqrt is only differentiated where its argument is > 0.
    safe_squared = ops.where(positive, squared, ops.ones_like(squared))
    return ops.where(positive, ops.sqrt(safe_squared), ops.zeros_like(squared))


def gradient_penalty(norms: Tensor, penalty: str = "two_sided") -> Tensor:
    """Per-example gradient penalty on the input-gradient norm.

    - `"two_sided"`: `(||g|| - 1)^2`, the paper's default: the sum of kernel
      values must change with the input, neither too fast (smoothness) nor
      too slowly (sensitivity, which prevents feature collapse).
    - `"one_sided"`: `max(0, ||g|| - 1)^2`: smoothness only.

    Args:
        norms: `(batch,)` from `gradient_norms`.
        penalty: `"two_sided"` or `"one_sided"`.

    Returns:
        `(batch,)` penalty per example (not yet multiplied by its weight).
    """
    validate_penalty(penalty)
    if penalty == "one_sided":
        return ops.square(ops.relu(norms - 1.0))
    return ops.square(norms - 1.0)


def centroid_statistics(
    embeddings: Tensor, labels_one_hot: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-class example counts and embedding sums of one batch.

    Args:
        embeddings: `(batch, centroid_dims, num_classes)` (per-class head) or
            `(batch, centroid_dims)` (shared head), as in `squared_distances`.
        labels_one_hot: `(batch, num_classes)` float32.

    Returns:
        `(counts, sums)`: `(num_classes,)` and `(centroid_dims, num_classes)`,
        where `sums[:, c]` adds `W_c f(x)` over the batch's class-`c` examples.
    """
    counts = ops.sum(labels_one_hot, axis=0)
    if len(embeddings.shape) == 2:
        sums = ops.matmul(ops.transpose(embeddings), labels_one_hot)
    else:
        sums = ops.einsum("bdc,bc->dc", embeddings, labels_one_hot)
    return counts, sums


def moving_average(
    state: Tensor, batch_value: Tensor, momentum: float | Tensor
) -> Tensor:
    """The exponential moving average step used for the centroid state.

    `state <- momentum * state + (1 - momentum) * batch_value`, applied to
    both the counts `N_c` and the embedding sums `m_c`; the centroids are
    then `e_c = m_c / N_c` (see `centroids`).
    """
    return momentum * state + (1.0 - momentum) * batch_value


def centroids(counts: Tensor, sums: Tensor) -> Tensor:
    """Centroids `e_c = m_c / N_c` from the moving-average state."""
    return sums / counts[None, :]


def rate_scaled(stored: Tensor, rate: float) -> Tensor:
    """`rate * stored` in value, with the gradient reaching `stored` unscaled.

    A weight used through this moves `rate` times as far per optimizer step
    as `stored` does: a per-weight learning rate, exact for any optimizer
    whose step is proportional to its learning rate (SGD, Adam).
    """
    if rate == 1.0:
        return stored
    stored = ops.convert_to_tensor(stored)
    return stored + ops.stop_gradient((rate - 1.0) * stored)


def clipped_by_norm(
    gradients: Iterable[Tensor | None], clipnorm: float | Tensor
) -> list[Tensor | None]:
    """Each gradient scaled down to L2 norm `clipnorm` where it is longer.

    Keras's optimizer argument `clipnorm` (per weight, not global): a
    gradient `g` becomes `g * clipnorm / max(||g||, clipnorm)`. A
    non-finite gradient stays non-finite, so the step's finiteness check
    still sees it; `None` (a weight the loss does not reach) stays `None`.
    """
    clipped = []
    for gradient in gradients:
        if gradient is None:
            clipped.append(None)
            continue
        bound = ops.cast(clipnorm, gradient.dtype)
        norm = ops.sqrt(ops.sum(ops.square(gradient)))
        clipped.append(gradient * (bound / ops.maximum(norm, bound)))
    return clipped


def coupled_weight_decay_loss(
    weights: Iterable[Tensor],
    weight_decay: float | Tensor,
    rates: Sequence[float] = (),
    decayed: Sequence[bool] = (),
) -> Tensor:
    """`weight_decay / 2 * sum ||w||^2` over `weights`.

    Its gradient adds `weight_decay * w` to the gradient of every weight:
    the coupled L2 weight decay of the paper (PyTorch's SGD `weight_decay`),
    which is not the decoupled `weight_decay` of Keras optimizers. `rates`
    (one per weight; 1.0 where missing): a weight stored for `rate_scaled`
    decays as the weight it stands for. `decayed` (one per weight; True
    where missing): a weight marked False gets no term at all, so its
    gradient stays as the loss gives it (a sparse one stays sparse).
    """
    total = ops.zeros((), dtype="float32")
    rates = itertools.chain(rates, itertools.repeat(1.0))
    decayed = itertools.chain(decayed, itertools.repeat(True))
    for weight, rate, decays in zip(weights, rates, decayed):
        if not decays:
            continue
        weight = rate_scaled(weight, rate)
        total = total + ops.sum(ops.square(ops.cast(weight, "float32")))
    return 0.5 * weight_decay * total


def validate_penalty(penalty: str) -> None:
    """Raises a `ValueError` unless `penalty` is a known penalty name."""
    if penalty not in PENALTIES:
        raise ValueError(
            f"Unknown penalty. Expected one of {PENALTIES} (use "
            "`gradient_penalty=0` to turn the penalty off). "
            f"Received: `penalty={penalty!r}`"
        )


def all_finite(tensors):
    """Whether every floating-point tensor in `tensors` is finite (a bool tensor)."""
    # Integer state (e.g. a layer's random seed) is always finite.
    checks = [
        ops.all(ops.isfinite(t)) for t in tensors if t is not None and is_float(t.dtype)
    ]
    if not checks:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack(checks))


def to_float64(value: Any) -> np.ndarray:
    """A tensor's or a variable's value as a float64 NumPy array (any backend)."""
    if isinstance(value, keras.Variable):
        value = value.value
    if keras.backend.backend() == "tensorflow" and hasattr(value, "numpy"):
        # Not `np.array(tensor)` (what `convert_to_numpy` does there): NumPy 2
        # warns about TensorFlow's `__array__`, which takes no `copy`.
        return np.asarray(value.numpy(), dtype="float64")
    if keras.backend.backend() == "torch" and hasattr(value, "detach"):
        # The same for PyTorch's `__array__` (also without `copy`).
        return value.detach().cpu().double().numpy()
    return np.asarray(ops.convert_to_numpy(value)).astype("float64")


def optimizer_steps(model: keras.Model) -> int | None:
    """`model.optimizer.iterations` as an int (`None` before `compile`)."""
    iterations = getattr(getattr(model, "optimizer", None), "iterations", None)
    return None if iterations is None else int(to_float64(iterations))

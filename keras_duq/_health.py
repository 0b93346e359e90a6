"""Health checks: a DUQ model watches its own failure modes and says so.

Four causes make DUQ's certainty meaningless without any error: kernel
values that underflow for (nearly) every example, BatchNormalization moving
statistics that have not settled (inference-mode features far from those
that re-estimated statistics give), centroids that never received their
class or that sit on another class's centroid, and a gradient penalty that
is constant because the input gradients are zero. Two more are seen at the
start of `fit`, before any step: inputs far from standardised, and features
that come out of a dropout layer. Each warns once per model with a subclass
of `DUQHealthWarning`, naming the numbers and the fix.

The numbers are measured cheaply: per batch inside the training and test
steps, from tensors the step already has (logged as `certainty`, `underflow`
and `zero_input_gradient`), and once per epoch, evaluate or predict on a
sample of a few hundred inputs (`batch_norm_gap`, `centroid_overlap`).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_duq import _compat
from keras_duq import _ops
from keras_duq._typing import Tensor
from keras_duq._validation import check_positive_int
from keras_duq._validation import is_float

if TYPE_CHECKING:
    from keras_duq._duq_model import DUQModel

# Below float32's smallest normal number a kernel value has underflowed:
# `predict` returns it as a subnormal or as 0, and the certainty no longer
# ranks such examples.
UNDERFLOW_KERNEL_VALUE = float(np.finfo(np.float32).tiny)
UNDERFLOW_LOG_KERNEL = float(np.log(UNDERFLOW_KERNEL_VALUE))
# "(Nearly) every example": the fraction of examples at which a per-example
# failure warns.
MOST_EXAMPLES = 0.9
# A mean certainty on the training batches below this is no certainty at all:
# a trained model's is near 1 on the data it was fit to.
NEGLIGIBLE_CERTAINTY = 1e-3
# An input-gradient norm below this counts as zero (two-sided penalty only:
# it is then within 2e-3 of 1, its value at a zero gradient).
ZERO_GRADIENT_NORM = 1e-3
# Relative RMS distance between the inference-mode features and those that
# statistics re-estimated on the sample (`SAMPLE_SIZE` examples) would give,
# above which the statistics warn. Per-layer errors of 0.1-0.2 standard
# deviations add up over layers; the measurements behind the threshold are
# in docs/health_checks.md ("BatchNormalization statistics that lag").
BATCH_NORM_GAP = 0.15
# The per-epoch comparison of the modes takes at most this share of the
# training time (it only logs `batch_norm_gap`; the warnings come from the
# checks at the end of `fit`). Its three passes over the sample are a fixed
# cost per epoch, large beside the short epochs of a small data set on an
# accelerator: there it runs every few epochs, and the log is NaN between.
CHECK_TIME_SHARE = 0.05
# Kernel value of one class at another class's centroid above which the two
# centroids overlap.
CENTROID_OVERLAP = 0.5
# A class whose centroid count gained less than this fraction of what the
# most frequent class's gained during `fit` received (almost) no examples.
UNSEEN_CLASS_SHARE = 1e-3
# A fresh DUQ model's kernel values underflow until its embeddings reach the
# centroids, and the centroids start random: `fit` checks nothing before this
# many steps, and before the centroids' moving averages owe at least this
# share to data.
WARMUP_STEPS = 100
WARMUP_DATA_SHARE = 0.5
# Examples drawn from the inputs for the once-per-epoch checks (at least
# one batch), and the chunk size of their passes when the batch size is not
# known (Keras's default batch size).
SAMPLE_SIZE = 512
DEFAULT_CHUNK_SIZE = 32
# ... and fewer for large inputs: the sample is kept with the model and
# passed three times per check (e.g. 111 images of 224x224x3 float32).
SAMPLE_BYTES = 64 * 2**20
_LISTED_LAYERS = 5


class DUQHealthWarning(UserWarning):
    """Base class of the warnings a `DUQModel` gives about its own health.

    Each cause warns once per model, naming the numbers and the fix.
    Silence them all, or one cause, with the `warnings` module.

    Example:

    ```python
    import warnings

    warnings.filterwarnings("ignore", category=keras_duq.DUQHealthWarning)
    warnings.filterwarnings("ignore", category=keras_duq.CentroidWarning)
    ```
    """


class KernelUnderflowWarning(DUQHealthWarning):
    """The kernel values of (nearly) every example underflow, in training or inference mode."""


class BatchNormStatisticsWarning(DUQHealthWarning):
    """Inference-mode features far from those of re-estimated BatchNormalization statistics."""


class CentroidWarning(DUQHealthWarning):
    """A centroid never received its class, or sits on another class's centroid."""


class ConstantPenaltyWarning(DUQHealthWarning):
    """The gradient penalty is constant: the input gradients are zero."""


class InputScaleWarning(DUQHealthWarning):
    """Floating-point inputs far from standardised, and no normalisation layer to fix it."""


class FeatureDropoutWarning(DUQHealthWarning):
    """The backbone's features come straight out of a dropout (or noise) layer."""


# Layers that put their inputs on a known scale: a backbone with one of them
# does not depend on its inputs being standardised (measured in
# docs/own_model.md).
_NORMALIZING_LAYERS = (
    keras.layers.Normalization,
    keras.layers.Rescaling,
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
)
# Layers that add random noise in training mode, and layers that only
# reshape: a backbone whose features come out of a noise layer, through
# reshaping layers at most, hands DUQ's kernel noisy features in training.
_NOISE_LAYERS = (
    keras.layers.Dropout,
    keras.layers.GaussianDropout,
    keras.layers.GaussianNoise,
    keras.layers.AlphaDropout,
)
_RESHAPING_LAYERS = (keras.layers.Flatten, keras.layers.Reshape, keras.layers.Permute)
# Standardised inputs have mean 0 and standard deviation 1: flagged are a
# mean beyond one standard deviation, or a scale off by more than 2x (images
# scaled to [0, 1] have a standard deviation of 0.25-0.4; two moons' raw
# coordinates, on which the paper's demo works, about 0.75).
_INPUT_MEAN_TOLERANCE = 1.0
_INPUT_SCALE_RANGE = (0.5, 2.0)


# Per model: the causes it has warned about, the optimizer step at which its
# BatchNormalization statistics were last compared with the sample's, its
# centroid counts at the start of its first `fit` (with the step), a sample
# of its last `fit`'s inputs with their batch size, and whether `predict` is
# given OoD inputs; the seconds its epochs and its per-epoch comparisons
# have taken, over all its `fit` calls.
_STATE = weakref.WeakKeyDictionary()


def _state(model):
    return _STATE.setdefault(
        model,
        {
            "warned": set(),
            "compared_at": None,
            # The step and the statistics `recompute_batch_norm_statistics`
            # set: for these weights they are settled by construction.
            "recomputed": None,
            "centroid_start": None,
            "training_inputs": None,
            "training_chunk_size": None,
            "out_of_distribution": 0,
            "epoch_seconds": 0.0,
            "comparison_seconds": 0.0,
        },
    )


@contextlib.contextmanager
def out_of_distribution(model: DUQModel) -> Iterator[None]:
    """Within the block, `model.predict` checks nothing: its inputs are meant to be OoD.

    Out-of-distribution inputs should get kernel values near 0, and
    BatchNormalization's batch statistics on them differ from the moving
    ones by nature.
    """
    state = _state(model)
    state["out_of_distribution"] += 1
    try:
        yield
    finally:
        state["out_of_distribution"] -= 1


def _warn(model, cause, category, message):
    warned = _state(model)["warned"]
    if cause in warned:
        return
    warned.add(cause)
    warnings.warn(f"{model.name}: {message}", category, stacklevel=3)


# ----------------------------------------------------------- batch metrics


def batch_trackers(gradient_penalty: float, penalty: str) -> list[keras.metrics.Mean]:
    """The per-batch health metrics of a model with this penalty."""
    trackers = [
        keras.metrics.Mean(name="certainty"),
        keras.metrics.Mean(name="underflow"),
    ]
    if gradient_penalty > 0 and penalty == "two_sided":
        trackers.append(keras.metrics.Mean(name="zero_input_gradient"))
    return trackers


def update_batch_metrics(
    trackers: list[keras.metrics.Mean],
    log_kernel: Tensor,
    penalty: Tensor | None,
    penalty_weight: float | Tensor,
) -> None:
    """Updates `batch_trackers` from one step's log kernel values and penalty.

    `penalty_weight` weighs the batch's zero-gradient fraction (0 on the
    steps of a lazy penalty that did not compute it).
    """
    certainty, underflow, *zero_gradient = trackers
    max_log_kernel = ops.max(log_kernel, axis=-1)
    certainty.update_state(ops.exp(max_log_kernel))
    underflow.update_state(ops.cast(max_log_kernel < UNDERFLOW_LOG_KERNEL, "float32"))
    if zero_gradient and penalty is not None:
        # The two-sided penalty is `(||g|| - 1)^2`: within this band the norm
        # is ~0 (or, never in practice, ~2).
        band = _ops.gradient_penalty(
            ops.convert_to_tensor([ZERO_GRADIENT_NORM, 0.0], "float32"), "two_sided"
        )
        flat = ops.logical_and(penalty >= band[0], penalty <= band[1])
        zero_gradient[0].update_state(
            ops.mean(ops.cast(flat, "float32")), sample_weight=penalty_weight
        )


# ------------------------------------------------------ training vs inference


def _batch_norm_layers(model):
    """The BatchNormalization layers whose moving statistics training updates."""
    return [
        layer
        for layer in _compat.all_layers(model)
        if isinstance(layer, keras.layers.BatchNormalization)
        and layer.trainable
        and layer.momentum < 1
    ]


def _batch_norm_statistics(model, layers, inputs):
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
        old_value = _float64(old[i])
        new_value = _float64(new[i])
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


def _average_statistics(model, layers, batches, keep_outputs=True):
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
        output, statistics = _batch_norm_statistics(model, layers, batch)
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


def _with_statistics(model, statistics, inputs):
    """Inference-mode outputs with the moving statistics set to `statistics`, changing nothing.

    `statistics`: `{layer: (mean, variance)}`, e.g. from `_average_statistics`:
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


def _normalisation_error(layer, mean, variance):
    """RMS over channels of the error (in standard deviations) of the moving statistics."""
    moving_mean = _float64(layer.moving_mean)
    moving_variance = _float64(layer.moving_variance)
    moving_std = np.sqrt(moving_variance + layer.epsilon)
    scale = np.sqrt(variance + layer.epsilon) / moving_std
    shift = (mean - moving_mean) / moving_std
    return float(np.sqrt(np.mean(np.square(scale - 1.0) + np.square(shift))))


class _ModeComparison:
    """Training- and inference-mode features of a sample, and what they imply.

    `gap` compares the inference-mode features with those the same inference
    pass gives with each BatchNormalization layer's moving statistics set to
    the sample's (averaged over chunks of `chunk_size`): what
    `recompute_batch_norm_statistics` on the sample would change. Dropout and
    other training-only layers are inactive in both, so they do not count as
    a gap.
    """

    def __init__(self, model, inputs, chunk_size=None):
        extractor = model.feature_extractor
        self.layers = _batch_norm_layers(extractor)
        chunks = _chunks(inputs, chunk_size or DEFAULT_CHUNK_SIZE)
        training, statistics = _average_statistics(extractor, self.layers, chunks)
        inference = [extractor(chunk, training=False) for chunk in chunks]
        self.underflow_training = _underflow_fraction(
            model.duq_output.log_kernel_values(ops.concatenate(training))
        )
        self.underflow_inference = _underflow_fraction(
            model.duq_output.log_kernel_values(ops.concatenate(inference))
        )
        self.size = int(keras.tree.flatten(inputs)[0].shape[0])
        self.gap = 0.0
        self.norms = (0.0, 0.0)
        self.errors = {}
        if self.layers:
            settled = np.concatenate(
                [
                    _float64(_with_statistics(extractor, statistics, chunk))
                    for chunk in chunks
                ]
            )
            inference = np.concatenate([_float64(f) for f in inference])
            self.gap = float(
                np.linalg.norm(settled - inference)
                / max(np.linalg.norm(settled), 1e-12)
            )
            self.norms = (
                float(np.linalg.norm(settled, axis=1).mean()),
                float(np.linalg.norm(inference, axis=1).mean()),
            )
            self.errors = {
                layer: _normalisation_error(layer, *statistics[layer])
                for layer in self.layers
            }
        # Worst first: the layers to look at.
        self.ranked = sorted(self.layers, key=lambda layer: -self.errors[layer])


def _chunks(inputs, size):
    """`inputs` (arrays or tensors, or a list or dict of them) in slices of `size` rows."""
    count = int(keras.tree.flatten(inputs)[0].shape[0])
    return [
        keras.tree.map_structure(lambda a: a[start : start + size], inputs)
        for start in range(0, count, size)
    ]


def _float64(value):
    """A tensor's or a variable's value as a float64 NumPy array (any backend)."""
    return np.asarray(ops.convert_to_numpy(value)).astype("float64")


def _underflow_fraction(log_kernel):
    max_log_kernel = _float64(ops.max(log_kernel, axis=-1))
    return float(np.mean(max_log_kernel < UNDERFLOW_LOG_KERNEL))


# -------------------------------------------------------------- the checks


def _check_underflow(model, fraction, mode, where):
    if fraction is None or not fraction >= MOST_EXAMPLES:
        return
    if mode == "training":
        advice = (
            "The embeddings are far from every centroid (compare the length "
            "scale with their distances), or the centroids are still near "
            "their random initial values. Increase `length_scale`, pass "
            "`bias_correction=True` (centroids from the first batches on), or "
            "lower the centroid `momentum`. While every kernel value "
            "underflows, the gradient penalty has no input gradient to act on."
        )
    else:
        advice = (
            "If training mode is fine (`underflow` low, `val_underflow` "
            "high), the features differ between the modes (see "
            "`BatchNormStatisticsWarning`) or these inputs differ from the "
            "training inputs (scale, preprocessing). Otherwise the fixes for "
            "training apply: a larger `length_scale`, `bias_correction=True`. "
            "For out-of-distribution inputs, a certainty of 0 is what DUQ "
            "should give: ignore this warning then."
        )
    _warn(
        model,
        f"underflow_{mode}",
        KernelUnderflowWarning,
        f"in {mode} mode ({where}), the kernel values of {fraction:.0%} of the "
        f"examples are all below {UNDERFLOW_KERNEL_VALUE:.2g} (float32 "
        "underflow): their certainty is 0 and their prediction arbitrary. "
        f"{advice} Logged as `underflow` (fraction of such examples) and "
        "`certainty` (mean largest kernel value).",
    )


def _check_batch_norm(model, comparison, where):
    state = _state(model)
    state["compared_at"] = optimizer_steps(model)
    if state["recomputed"] == (state["compared_at"], _statistics_fingerprint(model)):
        return  # re-estimated for these weights: a gap is the sample's noise
    if not comparison.layers or comparison.gap <= BATCH_NORM_GAP:
        return
    listed = ", ".join(
        f"{layer.name} ({comparison.errors[layer]:.2g})"
        for layer in comparison.ranked[:_LISTED_LAYERS]
    )
    more = len(comparison.ranked) - _LISTED_LAYERS
    if more > 0:
        listed += f" and {more} more"
    settled_norm, inference_norm = comparison.norms
    _warn(
        model,
        "batch_norm",
        BatchNormStatisticsWarning,
        f"BatchNormalization moving statistics have not settled ({where}): in "
        "inference mode (`evaluate`, `predict`) the backbone's features are "
        f"{comparison.gap:.0%} away from those that statistics re-estimated on "
        f"a sample of {comparison.size} inputs give (relative RMS "
        "distance; mean feature norm "
        f"{inference_norm:.3g} against {settled_norm:.3g}), so the kernel "
        "values in inference mode do not reflect what training learned. "
        "Layers whose moving statistics differ most from the sample's "
        "(error of the normalised output, in standard deviations; small "
        f"errors add up over layers): {listed}. Fix: re-estimate the "
        "statistics after training with "
        "`keras_duq.recompute_batch_norm_statistics(model, x_train[:10000])` "
        "(or after every epoch with the callback "
        "`keras_duq.callbacks.RecomputeBatchNormStatistics(x_train[:10000])`), "
        "lower these layers' `momentum` (Keras's default 0.99 lags behind "
        "weights that change fast; e.g. 0.9), or train for more steps. "
        "Logged per epoch as `batch_norm_gap`.",
    )


def _centroid_overlap(layer, rows_per_chunk=1024):
    """`(kernel value, class, other)`: the largest kernel value of a class at another's centroid."""
    centroids = layer.centroids
    classes = layer.num_classes
    best = (-1.0, 0, 0)
    # Centroid j measured by class c's kernel: every head compares all
    # centroids in one space. In chunks of rows, so that 10,000 classes do
    # not need a 10,000 x 10,000 matrix at once.
    for start in range(0, classes, rows_per_chunk):
        rows = ops.transpose(centroids[:, start : start + rows_per_chunk])
        log_kernel = _ops.log_kernel_values(
            _ops.squared_distances(rows, centroids), layer.length_scales
        )
        kernel = np.exp(_float64(log_kernel))
        own = np.arange(kernel.shape[0])
        kernel[own, own + start] = -1.0
        at, cls = np.unravel_index(np.argmax(kernel), kernel.shape)
        if kernel[at, cls] > best[0]:
            best = (float(kernel[at, cls]), int(cls), int(at + start))
    return best


def _check_centroid_overlap(model, where):
    layer = model.duq_output
    value, cls, other = _centroid_overlap(layer)
    if value > CENTROID_OVERLAP:
        _warn(
            model,
            "centroid_overlap",
            CentroidWarning,
            f"the centroids of classes {cls} and {other} overlap ({where}): "
            f"class {cls}'s kernel value at class {other}'s centroid is "
            f"{value:.3g} (length scale "
            f"{_float64(layer.length_scales)[cls]:.3g}). "
            "Examples of either class get a high kernel value for both, so "
            "the certainty cannot tell them apart: the features collapsed. "
            "Fix: turn the gradient penalty on or raise it (the two-sided "
            "penalty keeps the features sensitive to the input), lower "
            "`length_scale`, and check that the two classes' labels are not "
            "mixed up. Logged per epoch as `centroid_overlap`.",
        )
    return value


def optimizer_steps(model: DUQModel) -> int | None:
    """`model.optimizer.iterations` as an int (`None` before `compile`)."""
    iterations = getattr(getattr(model, "optimizer", None), "iterations", None)
    return None if iterations is None else int(_float64(iterations))


def _record_centroid_start(model):
    """Keeps the centroid counts at the start of the model's first `fit`."""
    state = _state(model)
    iterations = optimizer_steps(model)
    start = state["centroid_start"]
    # A new optimizer restarts the step count: start again from here.
    if start is None or iterations < start[1]:
        state["centroid_start"] = (
            _float64(model.duq_output.centroid_counts),
            iterations,
        )


def _warmed_up(model):
    """Whether `model` is past DUQ's start-up (see `WARMUP_STEPS`)."""
    iterations = optimizer_steps(model)
    if iterations is None or iterations < WARMUP_STEPS:
        return False
    layer = model.duq_output
    prior = (
        _ops.BIAS_CORRECTED_CENTROID_COUNT
        if layer.bias_correction
        else _ops.INITIAL_CENTROID_COUNT
    )
    # What is left of the initial count; the mean over classes, so that a
    # class never seen does not hold the checks back.
    initial = prior * layer.momentum**iterations
    return bool(
        initial <= (1.0 - WARMUP_DATA_SHARE) * _float64(layer.centroid_counts).mean()
    )


def _check_unseen_classes(model):
    """Warns about classes whose centroid gained nothing since the first `fit`."""
    counts_before, iterations_before = _state(model)["centroid_start"]
    steps = optimizer_steps(model) - iterations_before
    layer = model.duq_output
    counts = _float64(layer.centroid_counts)
    # Without examples a count only decays, `N <- momentum * N`: what it
    # has above that came from the class's examples.
    gained = counts - counts_before * layer.momentum**steps
    if steps < WARMUP_STEPS or not gained.max() > 0:
        return
    unseen = [
        int(c) for c in np.flatnonzero(gained < UNSEEN_CLASS_SHARE * gained.max())
    ]
    if unseen:
        _warn(
            model,
            "centroid_unseen",
            CentroidWarning,
            f"the centroids of classes {unseen} received no training examples "
            f"in {steps} training steps (their counts only decayed, to "
            f"{', '.join(f'{counts[c]:.3g}' for c in unseen)}), so they keep "
            "their initial, random values and these classes are never "
            "predicted with any certainty. Check that the labels cover "
            f"0..{layer.num_classes - 1} (e.g. not 1..{layer.num_classes}) "
            "and that `num_classes` is right.",
        )


def _check_constant_penalty(model, fraction, where):
    if fraction is None or not fraction >= MOST_EXAMPLES:
        return
    _warn(
        model,
        "constant_penalty",
        ConstantPenaltyWarning,
        f"the gradient penalty is constant ({where}): for {fraction:.0%} of "
        "the training examples the input gradient of the summed kernel "
        f"values is zero (norm < {ZERO_GRADIENT_NORM:g}, penalty ~1), so the "
        "penalty adds a constant to the loss and no gradient. The kernel "
        "values do not change with the input: they are vanishingly small "
        "(see `certainty`), or the backbone does not pass the input on (a "
        "layer that zeroes it, dead ReLU units, inputs on a tiny scale). Fix "
        "the cause (inputs normalised to about unit variance, a lower "
        "learning rate, a larger `length_scale`); `gradient_penalty=0` turns "
        "the penalty off. Logged as `zero_input_gradient` (fraction of such "
        "examples).",
    )


def _check_short_run(model, logs):
    """A run too short for the other checks that ends with no certainty at all.

    Before the warm-up (`WARMUP_STEPS`, `WARMUP_DATA_SHARE`) kernel values
    that underflow are expected; a whole `fit` that ends so, with a constant
    penalty too, has learnt nothing DUQ can use, however few steps it had.
    """
    certainty = logs.get("certainty")
    zero_gradient = logs.get("zero_input_gradient")
    if certainty is None or not float(certainty) < NEGLIGIBLE_CERTAINTY:
        return
    if zero_gradient is None or not float(zero_gradient) >= MOST_EXAMPLES:
        return
    layer = model.duq_output
    steps = optimizer_steps(model) or 0
    prior = (
        _ops.BIAS_CORRECTED_CENTROID_COUNT
        if layer.bias_correction
        else _ops.INITIAL_CENTROID_COUNT
    )
    random_share = (
        prior
        * layer.momentum**steps
        / max(_float64(layer.centroid_counts).mean(), 1e-12)
    )
    _warn(
        model,
        "short_run",
        KernelUnderflowWarning,
        f"`fit` ended after {steps} training steps with a mean certainty of "
        f"{float(certainty):.2g} on the last epoch's training batches (below "
        f"{NEGLIGIBLE_CERTAINTY:g}) and a constant gradient penalty: the "
        "model's certainty means nothing yet, and its "
        "predictions can stay at one class. The centroids still owe "
        f"{min(random_share, 1.0):.0%} of their value to their random start "
        f"(`momentum={layer.momentum:g}`). For a short run, pass "
        "`bias_correction=True` (centroids from the class means of the first "
        "batches) or a lower `momentum` (e.g. 0.9), or train longer.",
    )


def _compare_modes(model, inputs, chunk_size=None):
    """The `_ModeComparison` on `inputs` (or `None` without inputs)."""
    if inputs is None:
        return None
    return _ModeComparison(model, inputs, chunk_size)


def _check_final_state(model, inputs, where, training=False, chunk_size=None):
    """The checks of a model as it is now: on `inputs`, and of its centroids.

    `training`: whether `inputs` are training inputs, whose training-mode
    kernel values are then checked too. `chunk_size`: the batch size of the
    passes over `inputs`.
    """
    comparison = _compare_modes(model, inputs, chunk_size)
    if comparison is not None:
        _check_batch_norm(model, comparison, where)
        if training:
            _check_underflow(model, comparison.underflow_training, "training", where)
        _check_underflow(model, comparison.underflow_inference, "inference", where)
    _check_centroid_overlap(model, where)


def check_predictions(model: DUQModel, kernel_values: Any) -> None:
    """The checks after `predict`: inference-mode underflow, unsettled BatchNormalization.

    The modes are compared on a sample of the last `fit`'s inputs, not on
    `predict`'s own: on inputs unlike the training data (out of
    distribution, say) BatchNormalization's batch statistics differ from
    the moving ones by nature.
    """
    state = _state(model)
    # An untrained model's kernel values underflow by nature (its centroids
    # are random): nothing to warn about yet.
    if state["out_of_distribution"] or not optimizer_steps(model):
        return
    if (
        isinstance(kernel_values, np.ndarray)
        and kernel_values.ndim == 2
        and len(kernel_values)
    ):
        fraction = float(np.mean(kernel_values.max(axis=1) < UNDERFLOW_KERNEL_VALUE))
        _check_underflow(model, fraction, "inference", "`predict`")
    # `predict` runs often (in callbacks, on grids): check the modes once per
    # set of weights.
    if "batch_norm" in state["warned"] or state["compared_at"] == optimizer_steps(
        model
    ):
        return
    if _batch_norm_layers(model.feature_extractor):
        comparison = _compare_modes(
            model, state["training_inputs"], state["training_chunk_size"]
        )
        if comparison is not None:
            _check_batch_norm(model, comparison, "`predict`")


# ------------------------------------------------------------ the callback


class HealthCheck(keras.callbacks.Callback):
    """Warns when a DUQ model shows a known failure mode; logs the numbers behind it.

    `DUQModel.fit` and `evaluate` add one to their callbacks themselves, and
    `predict` runs its checks, unless the model was built with
    `health_checks=False`. Add it yourself only to choose the inputs of the
    checks that compare training and inference mode, or to place its logs
    before another callback's (`TensorBoard`, `CSVLogger`). Each cause warns
    once per model with a subclass of `keras_duq.DUQHealthWarning`:

    - `KernelUnderflowWarning`: the kernel values of at least 90% of the
      examples are all below float32's smallest normal number, in training
      mode or in inference mode (validation data, `evaluate`, `predict`);
    - `BatchNormStatisticsWarning`: inference-mode features more than 15%
      (relative RMS distance) away from those that BatchNormalization
      statistics re-estimated on the sample would give;
    - `CentroidWarning`: a class whose centroid received no example during
      `fit`, or two overlapping centroids (the kernel value of one class at
      the other's centroid above 0.5);
    - `ConstantPenaltyWarning`: the input gradient is ~0 for at least 90% of
      the training examples (two-sided penalty), so the penalty is constant.

    When: a freshly initialised DUQ model's kernel values underflow until
    its embeddings reach the centroids, the centroids start random, and
    BatchNormalization statistics start unsettled. So `fit` checks nothing
    before the model has trained 100 steps and its centroids' moving
    averages owe at least half to data (about 660 steps with the default
    centroid `momentum=0.999`, batches of 128 and 10 classes, without bias
    correction). From
    then on it checks each epoch's training and validation numbers (from
    the first epoch that starts after that) and, at its end, the model's
    state (features in both modes on the sample, the centroids, the classes
    seen). `evaluate` and `predict`, whose
    outputs are being used, check the model's state whenever they run.

    At the end of each epoch it adds to the logs `centroid_overlap` (the
    largest kernel value of a class at another class's centroid) and, for
    backbones with BatchNormalization, `batch_norm_gap` (that relative RMS
    distance; NaN at epochs where it is skipped so that these comparisons
    take at most 5% of the training time). The model
    itself logs `certainty`, `underflow` and `zero_input_gradient` per step.

    Example:

    ```python
    history = model.fit(
        x_train, y_train, epochs=10,
        callbacks=[keras_duq.callbacks.HealthCheck(x_train[:512], batch_size=128),
                   keras.callbacks.TensorBoard("logs")],
    )
    history.history["centroid_overlap"]
    ```

    Args:
        inputs: optional sample of model inputs (an array, or a list or
            dict of arrays, as `predict` takes them; a few hundred examples)
            on which training- and inference-mode features are compared (in
            `fit`, training inputs: `predict` then compares the modes on
            them too). `fit` and `evaluate` pass 512 random examples of
            their inputs (fewer for large inputs; or their first batches)
            when these are in-memory arrays, a `tf.data.Dataset` or a
            `keras.utils.PyDataset`; `None` skips these comparisons.
        batch_size: int >= 1 or `None`, the batch size of the passes over
            `inputs`, as in `predict`: BatchNormalization statistics are
            averaged over batches of this size. `fit` and `evaluate` pass
            their own. Defaults to `32`.
    """

    def __init__(self, inputs: Any = None, batch_size: int | None = None) -> None:
        super().__init__()
        if batch_size is not None:
            check_positive_int("batch_size", batch_size)
        self.inputs = inputs
        self.batch_size = batch_size
        self._in_fit = False
        self._epoch_warmed_up = False
        self._epoch_start = time.perf_counter()

    def _checked_model(self) -> DUQModel:
        if not hasattr(self.model, "duq_output"):
            raise ValueError(
                "`HealthCheck` checks DUQ models (`keras_duq.DUQModel`). "
                f"Received: a model of type {type(self.model).__name__}"
            )
        return self.model

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._in_fit = True
        model = self._checked_model()
        _record_centroid_start(model)
        _check_feature_noise(model)
        if self.inputs is not None:
            _state(model)["training_inputs"] = self.inputs
            _state(model)["training_chunk_size"] = self.batch_size
            _check_input_scale(model, self.inputs)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch_warmed_up = _warmed_up(self._checked_model())
        self._epoch_start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        model = self._checked_model()
        logs = {} if logs is None else logs
        self._last_logs = dict(logs)
        if self._epoch_warmed_up:
            where = f"`fit`, epoch {epoch + 1}"
            _check_underflow(model, logs.get("underflow"), "training", where)
            _check_constant_penalty(model, logs.get("zero_input_gradient"), where)
        if _batch_norm_layers(model.feature_extractor) and self.inputs is not None:
            logs["batch_norm_gap"] = self._timed_gap(model)
        logs["centroid_overlap"] = _centroid_overlap(model.duq_output)[0]

    def _timed_gap(self, model: DUQModel) -> float:
        """`batch_norm_gap` now, or NaN when the comparisons have used their share of time."""
        state = _state(model)
        state["epoch_seconds"] += time.perf_counter() - self._epoch_start
        if state["comparison_seconds"] > CHECK_TIME_SHARE * state["epoch_seconds"]:
            return float("nan")
        start = time.perf_counter()
        gap = _compare_modes(model, self.inputs, self.batch_size).gap
        state["comparison_seconds"] += time.perf_counter() - start
        return gap

    def on_train_end(self, logs: dict | None = None) -> None:
        model = self._checked_model()
        self._in_fit = False
        if not _warmed_up(model):
            _check_short_run(model, getattr(self, "_last_logs", {}))
        if _warmed_up(model):
            _check_final_state(
                model,
                self.inputs,
                "end of `fit`",
                training=True,
                chunk_size=self.batch_size,
            )
            _check_unseen_classes(model)

    def on_test_end(self, logs: dict | None = None) -> None:
        model = self._checked_model()
        logs = {} if logs is None else logs
        if not self._in_fit:
            _check_underflow(model, logs.get("underflow"), "inference", "`evaluate`")
            _check_final_state(
                model, self.inputs, "`evaluate`", chunk_size=self.batch_size
            )
        elif self._epoch_warmed_up:
            _check_underflow(
                model, logs.get("underflow"), "inference", "validation data"
            )


def _check_input_scale(model, inputs):
    """Warns when floating-point training inputs are far from standardised.

    Only for backbones without a normalising layer (docs/own_model.md has
    the measurements).
    """
    if any(
        isinstance(layer, _NORMALIZING_LAYERS)
        for layer in _compat.all_layers(model.feature_extractor)
    ):
        return
    declared = keras.tree.flatten(model.feature_extractor.inputs)
    arrays = keras.tree.flatten(inputs)
    if len(declared) != len(arrays):
        return
    for tensor, array in zip(declared, arrays):
        if not is_float(tensor.dtype):
            continue
        values = np.asarray(array, dtype=np.float64)
        mean, std = float(np.mean(values)), float(np.std(values))
        low, high = _INPUT_SCALE_RANGE
        if std == 0 or not np.isfinite(std):
            continue
        if abs(mean) <= _INPUT_MEAN_TOLERANCE * std and low <= std <= high:
            continue
        name = getattr(tensor, "name", "inputs")
        _warn(
            model,
            "input_scale",
            InputScaleWarning,
            f"the training input `{name}` is not standardised (mean {mean:.3g}, "
            f"standard deviation {std:.3g} on a sample of {values.shape[0]}) and "
            "the backbone has no normalisation layer. DUQ's gradient penalty acts "
            "on the input gradient, and its certainty separates "
            "out-of-distribution inputs far better on standardised inputs "
            "(docs/own_model.md). Standardise every set with the training set's "
            "mean and standard deviation (`keras_duq.datasets.normalize` for "
            "FashionMNIST-like images), or make a `keras.layers.Normalization()` "
            "adapted on the training inputs the backbone's first layer.",
        )


def feature_noise_layer(layer):
    """The noise layer whose output (reshaped at most) `layer` returns, or `None`.

    Looks into Sequential and functional models only: a subclassed model's
    `layers` are in the order they were created, not called.
    """
    if isinstance(layer, _NOISE_LAYERS):
        return layer
    outputs = getattr(layer, "outputs", None)
    if not isinstance(layer, keras.Model) or not outputs or len(outputs) != 1:
        return None
    # A graph model lists its layers in call order; with one output the
    # last of them computes it.
    for child in reversed(layer.layers):
        if isinstance(child, keras.layers.InputLayer):
            return None
        if not isinstance(child, _RESHAPING_LAYERS):
            return feature_noise_layer(child)
    return None


def _check_feature_noise(model):
    """Warns when the features come out of a dropout or noise layer (the
    measurement behind it: docs/own_model_measurements.md, "Dropout right before the head")."""
    layer = feature_noise_layer(model.feature_extractor)
    if layer is None:
        return
    rate = getattr(layer, "rate", None)
    described = type(layer).__name__ + ("" if rate is None else f"(rate={rate:g})")
    weight = model.categorical_cross_entropy_weight
    _warn(
        model,
        "feature_noise",
        FeatureDropoutWarning,
        f"the backbone's features come out of `{layer.name}` ({described}). In "
        "training it zeroes or perturbs a random part of every feature vector, "
        "and DUQ's kernel values (exp of minus the squared distance to a "
        "centroid over twice the squared length scale) are far more sensitive "
        "to that noise than a softmax head: the defaults weigh the categorical "
        "term more behind dropout (this model: "
        f"`categorical_cross_entropy_weight={weight:g}`), and the backbones "
        "measured still separated out-of-distribution inputs better without "
        'the layer (docs/own_model_measurements.md, "The categorical weight behind '
        'dropout"). Remove that layer from the backbone (the gradient '
        "penalty regularises DUQ), or move it before the backbone's last "
        "Dense layer.",
    )


# ------------------------------------------------- hooks of fit/evaluate


def with_health_check(
    model: DUQModel,
    method: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`(args, kwargs)` of `fit` or `evaluate` with a `HealthCheck` in the callbacks."""
    bound = inspect.signature(method).bind(*args, **kwargs)
    arguments = bound.arguments
    callbacks = arguments.get("callbacks")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return args, kwargs
    callbacks = list(callbacks or [])
    if any(isinstance(callback, HealthCheck) for callback in callbacks):
        return args, kwargs
    inputs, chunk_size = sample_inputs(arguments.get("x"), arguments.get("batch_size"))
    # Re-estimated statistics first, so that the checks and the user's
    # callbacks (checkpoints, early stopping) see them; then the health
    # check, whose logs every other callback sees.
    first = [c for c in callbacks if isinstance(c, RecomputeBatchNormStatistics)]
    rest = [c for c in callbacks if not isinstance(c, RecomputeBatchNormStatistics)]
    arguments["callbacks"] = first + [HealthCheck(inputs, batch_size=chunk_size)] + rest
    return bound.args, bound.kwargs


def sample_inputs(x: Any, batch_size: int | None = None) -> tuple[Any, int | None]:
    """`(inputs, chunk_size)`: a sample of `x` for the mode comparison, and its batch size.

    About `SAMPLE_SIZE` examples, fewer where they would take more than
    `SAMPLE_BYTES` (but at least one batch): a random sample of
    in-memory arrays (data sorted by class would bias the first rows), the
    first batches of a `tf.data.Dataset` or a `PyDataset`. `chunk_size` is
    the batch size to pass them in: `batch_size`, or the dataset's. Inputs
    are `None` for generators: reading them would consume data.
    """
    if x is None:
        return None, None
    if isinstance(x, keras.utils.PyDataset):
        count = x.num_batches
        indices = itertools.count() if count is None else range(count)
        return _first_batches(x[i] for i in indices)
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(x, tf.data.Dataset):
        return _first_batches(iter(x))
    arrays = keras.tree.flatten(x)
    if not arrays or not all(hasattr(a, "shape") and len(a.shape) for a in arrays):
        return None, None
    count = int(arrays[0].shape[0])
    if count == 0 or any(int(a.shape[0]) != count for a in arrays):
        return None, None
    size = min(count, max(batch_size or 0, _sample_size(arrays)))
    rows = np.sort(np.random.default_rng(0).choice(count, size=size, replace=False))
    sample = keras.tree.map_structure(lambda a: np.asarray(a)[rows], x)
    return sample, batch_size


def _sample_size(arrays):
    """`SAMPLE_SIZE`, or fewer examples of `arrays` (a batch) within `SAMPLE_BYTES`."""
    per_example = sum(
        np.dtype(getattr(a, "dtype", "float32")).itemsize
        * int(np.prod(a.shape[1:], dtype=np.int64))
        for a in arrays
    )
    return max(1, min(SAMPLE_SIZE, SAMPLE_BYTES // max(per_example, 1)))


def _first_batches(elements):
    """`(inputs, first batch size)` of the first batches that hold a sample (`_sample_size`)."""
    batches = []
    count = 0
    for element in elements:
        batches.append(_as_arrays(_inputs_of(element)))
        arrays = keras.tree.flatten(batches[-1])
        count += int(arrays[0].shape[0])
        if count >= _sample_size(arrays):
            break
    if not batches:
        return None, None
    chunk_size = int(keras.tree.flatten(batches[0])[0].shape[0])
    sample = keras.tree.map_structure(lambda *arrays: np.concatenate(arrays), *batches)
    return sample, chunk_size


def _inputs_of(element):
    if isinstance(element, tuple):
        return keras.utils.unpack_x_y_sample_weight(element)[0]
    return element


def _as_arrays(x):
    return keras.tree.map_structure(np.asarray, x)


# ------------------------------------------------- BatchNormalization fix


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
    _, statistics = _average_statistics(
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
        _state(model)["recomputed"] = (
            optimizer_steps(model),
            _statistics_fingerprint(model),
        )
    return [layer.name for layer in layers]


def _statistics_fingerprint(model):
    """The sums of every BatchNormalization layer's moving statistics."""
    return tuple(
        float(np.sum(_float64(variable)))
        for layer in _batch_norm_layers(model)
        for variable in (layer.moving_mean, layer.moving_variance)
    )


def _check_recompute_arguments(data, steps, batch_size, caller):
    """Raises, naming `caller`, for arguments the re-estimation cannot use."""
    if steps is not None:
        check_positive_int("steps", steps)
    check_positive_int("batch_size", batch_size)
    if isinstance(data, tuple):
        data = _inputs_of(data)
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
    """`_batch_norm_layers(model)`, or a `ValueError` naming `caller` when there are none."""
    layers = _batch_norm_layers(model)
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
        data = _inputs_of(data)
    if _is_stream(data):
        if isinstance(data, keras.utils.PyDataset):
            total = min(n for n in (data.num_batches, steps) if n is not None)
            elements = (data[i] for i in range(total))
        else:
            elements = iter(data)
        for step, element in enumerate(elements):
            if steps is not None and step >= steps:
                return
            yield _as_arrays(_inputs_of(element))
        return
    chunks = _chunks(data, batch_size)
    for chunk in chunks if steps is None else chunks[:steps]:
        yield keras.tree.map_structure(np.asarray, chunk)


def _is_stream(data):
    if isinstance(data, keras.utils.PyDataset):
        return True
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(data, tf.data.Dataset):
        return True
    return not isinstance(data, (tuple, list, dict)) and not hasattr(data, "shape")


_CALLBACK = "`RecomputeBatchNormStatistics`"


class RecomputeBatchNormStatistics(keras.callbacks.Callback):
    """Re-estimates BatchNormalization statistics from data after each epoch of `fit`.

    `keras_duq.recompute_batch_norm_statistics(model, data)` after every
    epoch's training steps: before the validation pass (so `val_` metrics,
    checkpoints, early stopping and the health checks see settled
    statistics) and at the end of `fit`. A short training, or Keras's default
    BatchNormalization `momentum=0.99`, leaves the moving statistics behind
    the weights, and inference mode (`evaluate`, `predict`) computes what
    training never saw (measured in docs/own_model.md). The weights go on
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


def _is_empty(data):
    if isinstance(data, tuple):
        data = _inputs_of(data)
    arrays = keras.tree.flatten(data)
    return not arrays or any(
        hasattr(a, "shape") and len(a.shape) and int(a.shape[0]) == 0 for a in arrays
    )

"""The checks: each reads numbers a model already has and warns once per cause.

Also what the checks keep per model between calls (the warn-once rule), and
the metric of per-batch health numbers that the training and test steps update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING
from typing import Any

import keras
import numpy as np
from keras import ops

from keras_duq import _compat
from keras_duq import _ops
from keras_duq._batch_norm import average_statistics
from keras_duq._batch_norm import batch_norm_layers
from keras_duq._batch_norm import in_chunks
from keras_duq._batch_norm import normalisation_error
from keras_duq._batch_norm import settled_by_recompute
from keras_duq._batch_norm import with_statistics
from keras_duq._health import rules
from keras_duq._health.warning_types import BatchNormStatisticsWarning
from keras_duq._health.warning_types import CentroidWarning
from keras_duq._health.warning_types import ConstantPenaltyWarning
from keras_duq._health.warning_types import FeatureDropoutWarning
from keras_duq._health.warning_types import InputScaleWarning
from keras_duq._health.warning_types import KernelUnderflowWarning
from keras_duq._health.warning_types import LowCertaintyWarning
from keras_duq._health.warning_types import PaddingWarning
from keras_duq._ops import optimizer_steps
from keras_duq._ops import to_float64
from keras_duq._typing import Tensor
from keras_duq._validation import is_float

if TYPE_CHECKING:
    from keras_duq._duq_model import DUQModel


@dataclasses.dataclass
class HealthState:
    """One model's health-check state, kept over all its calls.

    Attributes:
        warned: the causes it has warned about (each warns once).
        centroid_start: its centroid counts at the start of its first
            `fit`, with the optimizer step then.
        out_of_distribution: > 0 while `predict` is given OoD inputs.
        healthy_in_distribution: whether its last check on in-distribution
            inputs (`fit`'s training sample, `evaluate`'s data) found the
            kernel values in inference mode not underflowing; `predict`'s
            underflow then means inputs far from the training data, which
            is DUQ's answer, not a fault.
        epoch_seconds: the seconds its epochs have taken, over all `fit`s ...
        comparison_seconds: ... and its per-epoch mode comparisons.
    """

    warned: set[str] = dataclasses.field(default_factory=set)
    centroid_start: tuple[Any, int | None] | None = None
    out_of_distribution: int = 0
    healthy_in_distribution: bool = False
    epoch_seconds: float = 0.0
    comparison_seconds: float = 0.0


def state_of(model: keras.Model) -> HealthState:
    """`model`'s `HealthState`, kept on the model (a fresh one at the first call)."""
    state = getattr(model, "_duq_health_state", None)
    if state is None:
        state = HealthState()
        model._duq_health_state = state
    return state


@contextlib.contextmanager
def out_of_distribution(model: keras.Model) -> Iterator[None]:
    """Within the block, `model.predict` checks nothing: its inputs are meant to be OoD.

    Out-of-distribution inputs should get kernel values near 0, and
    BatchNormalization's batch statistics on them differ from the moving
    ones by nature.
    """
    state = state_of(model)
    state.out_of_distribution += 1
    try:
        yield
    finally:
        state.out_of_distribution -= 1


def warn_once(model, cause, category, message):
    warned = state_of(model).warned
    if cause in warned:
        return
    warned.add(cause)
    warnings.warn(f"{model.name}: {message}", category, stacklevel=3)


class BatchHealth(keras.metrics.Metric):
    """The health numbers of each training or test batch, as one metric.

    Logged as `certainty` (mean largest kernel value), `underflow` (share of
    examples whose largest kernel value underflows float32) and, with the
    two-sided penalty, `zero_input_gradient` (share of examples whose input
    gradient is ~0: the penalty is constant for them). `DUQModel` adds it to
    its metrics with `health_checks=True`; the step updates it from values
    it has already, `update_state(log_kernel, penalty, penalty_weight)`
    (`penalty_weight` 0 on the steps of a lazy penalty that skip it), and
    `HealthCheck` reads the logs at each epoch's end.

    Args:
        zero_gradient: bool, whether to log `zero_input_gradient`.
        name: the metric's name.
    """

    def __init__(self, zero_gradient: bool = False, name: str = "health") -> None:
        super().__init__(name=name)
        self.zero_gradient = zero_gradient
        # One variable of sums, [certainty, underflow, examples, zero-gradient
        # share x weight, weight]: one `assign_add` per step and one reset per
        # `train_on_batch`; five variables made a 26-class MLP's
        # `train_on_batch` 14% slower (2 ms, mostly their eager resets).
        self.totals = self.add_variable(shape=(5,), initializer="zeros", name="totals")
        # The two-sided penalty is `(||g|| - 1)^2`: within this band the norm
        # is ~0 (or, never in practice, ~2). A constant, computed once.
        self._zero_band = tuple(
            float(value)
            for value in to_float64(
                _ops.gradient_penalty(
                    ops.convert_to_tensor([rules.ZERO_GRADIENT_NORM, 0.0], "float32"),
                    "two_sided",
                )
            )
        )

    def update_state(
        self,
        log_kernel: Tensor,
        penalty: Tensor | None = None,
        penalty_weight: float | Tensor | None = None,
    ) -> None:
        max_log_kernel = ops.max(ops.cast(log_kernel, "float32"), axis=-1)
        sums = [
            ops.sum(ops.exp(max_log_kernel)),
            ops.sum(ops.cast(max_log_kernel < rules.UNDERFLOW_LOG_KERNEL, "float32")),
            ops.cast(ops.shape(max_log_kernel)[0], "float32"),
        ]
        zero, weight = 0.0, 0.0
        if self.zero_gradient and penalty is not None:
            low, high = self._zero_band
            flat = ops.logical_and(penalty >= low, penalty <= high)
            weight = ops.cast(
                1.0 if penalty_weight is None else penalty_weight, "float32"
            )
            zero = ops.mean(ops.cast(flat, "float32")) * weight
        sums += [ops.cast(zero, "float32"), ops.cast(weight, "float32")]
        self.totals.assign_add(ops.stack(sums))

    def result(self) -> dict[str, Tensor]:
        certainty, underflow, examples, zero, weight = ops.unstack(
            ops.convert_to_tensor(self.totals)
        )
        results = {
            "certainty": ops.divide_no_nan(certainty, examples),
            "underflow": ops.divide_no_nan(underflow, examples),
        }
        if self.zero_gradient:
            results["zero_input_gradient"] = ops.divide_no_nan(zero, weight)
        return results

    def get_config(self) -> dict[str, Any]:
        return {"zero_gradient": self.zero_gradient, "name": self.name}


class ModeComparison:
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
        self.layers = batch_norm_layers(extractor)
        chunks = in_chunks(inputs, chunk_size or rules.DEFAULT_CHUNK_SIZE)
        training, statistics = average_statistics(extractor, self.layers, chunks)
        inference = [extractor(chunk, training=False) for chunk in chunks]
        self.underflow_training = underflow_fraction(
            model.duq_output.log_kernel_values(ops.concatenate(training))
        )
        log_kernel = model.duq_output.log_kernel_values(ops.concatenate(inference))
        self.underflow_inference = underflow_fraction(log_kernel)
        self.certainty_inference = float(
            np.mean(np.exp(to_float64(ops.max(log_kernel, axis=-1))))
        )
        self.size = int(keras.tree.flatten(inputs)[0].shape[0])
        self.gap = 0.0
        self.norms = (0.0, 0.0)
        self.errors = {}
        if self.layers:
            settled = np.concatenate(
                [
                    to_float64(with_statistics(extractor, statistics, chunk))
                    for chunk in chunks
                ]
            )
            inference = np.concatenate([to_float64(f) for f in inference])
            self.gap = float(
                np.linalg.norm(settled - inference)
                / max(np.linalg.norm(settled), 1e-12)
            )
            self.norms = (
                float(np.linalg.norm(settled, axis=1).mean()),
                float(np.linalg.norm(inference, axis=1).mean()),
            )
            self.errors = {
                layer: normalisation_error(layer, *statistics[layer])
                for layer in self.layers
            }
        # Worst first: the layers to look at.
        self.ranked = sorted(self.layers, key=lambda layer: -self.errors[layer])


def underflow_fraction(log_kernel):
    max_log_kernel = to_float64(ops.max(log_kernel, axis=-1))
    return float(np.mean(max_log_kernel < rules.UNDERFLOW_LOG_KERNEL))


def check_underflow(model, fraction, mode, where):
    if fraction is None or not fraction >= rules.MOST_EXAMPLES:
        return
    if mode == "training":
        advice = (
            "The embeddings are far from every centroid (compare the length "
            "scale with their distances), or the centroids are still near "
            "their random initial values. "
            + _length_scale_fix(model.duq_output)
            + "While every kernel value underflows, the gradient penalty has "
            "no input gradient to act on."
        )
    else:
        advice = (
            "If training mode is fine (`underflow` low, `val_underflow` "
            "high), the features differ between the modes (see "
            "`BatchNormStatisticsWarning`) or these inputs differ from the "
            "training inputs (scale, preprocessing). Otherwise the fixes for "
            "training apply. "
            + _length_scale_fix(model.duq_output)
            + "For out-of-distribution inputs, a certainty of 0 is what DUQ "
            "should give: ignore this warning then."
        )
    warn_once(
        model,
        f"underflow_{mode}",
        KernelUnderflowWarning,
        f"in {mode} mode ({where}), the kernel values of {fraction:.0%} of the "
        f"examples are all below {rules.UNDERFLOW_KERNEL_VALUE:.2g} (float32 "
        "underflow): their certainty is 0 and their prediction arbitrary. "
        f"{advice} Logged as `underflow` (fraction of such examples) and "
        "`certainty` (mean largest kernel value).",
    )


def check_batch_norm(model, comparison, where):
    if settled_by_recompute(model):
        return  # re-estimated for these weights: a gap is the sample's noise
    if not comparison.layers or comparison.gap <= rules.BATCH_NORM_GAP:
        return
    listed = ", ".join(
        f"{layer.name} ({comparison.errors[layer]:.2g})"
        for layer in comparison.ranked[: rules.LISTED_LAYERS]
    )
    more = len(comparison.ranked) - rules.LISTED_LAYERS
    if more > 0:
        listed += f" and {more} more"
    settled_norm, inference_norm = comparison.norms
    warn_once(
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


def centroid_overlap(layer, rows_per_chunk=1024):
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
        kernel = np.exp(to_float64(log_kernel))
        own = np.arange(kernel.shape[0])
        kernel[own, own + start] = -1.0
        at, cls = np.unravel_index(np.argmax(kernel), kernel.shape)
        if kernel[at, cls] > best[0]:
            best = (float(kernel[at, cls]), int(cls), int(at + start))
    return best


def check_centroid_overlap(model, where):
    layer = model.duq_output
    value, cls, other = centroid_overlap(layer)
    if value > rules.CENTROID_OVERLAP:
        warn_once(
            model,
            "centroid_overlap",
            CentroidWarning,
            f"the centroids of classes {cls} and {other} overlap ({where}): "
            f"class {cls}'s kernel value at class {other}'s centroid is "
            f"{value:.3g} (length scale "
            f"{to_float64(layer.length_scales)[cls]:.3g}). "
            "Examples of either class get a high kernel value for both, so "
            "the certainty cannot tell them apart: the features collapsed. "
            "Fix: turn the gradient penalty on or raise it (the two-sided "
            "penalty keeps the features sensitive to the input), lower "
            "`length_scale`, and check that the two classes' labels are not "
            "mixed up. Logged per epoch as `centroid_overlap`.",
        )
    return value


def record_centroid_start(model):
    """Keeps the centroid counts at the start of the model's first `fit`."""
    state = state_of(model)
    iterations = optimizer_steps(model)
    start = state.centroid_start
    # A new optimizer restarts the step count: start again from here.
    if start is None or iterations < start[1]:
        state.centroid_start = (
            to_float64(model.duq_output.centroid_counts),
            iterations,
        )


def past_first_steps(model):
    """Whether `model` has trained `rules.WARMUP_STEPS` optimizer steps."""
    return (optimizer_steps(model) or 0) >= rules.WARMUP_STEPS


def warmed_up(model):
    """Whether `model` is past DUQ's start-up: its first steps, and centroids
    that owe at least `rules.WARMUP_DATA_SHARE` to data."""
    return past_first_steps(model) and bool(
        centroid_random_share(model) <= 1.0 - rules.WARMUP_DATA_SHARE
    )


def check_unseen_classes(model):
    """Warns about classes whose centroid gained nothing since the first `fit`."""
    counts_before, iterations_before = state_of(model).centroid_start
    steps = optimizer_steps(model) - iterations_before
    layer = model.duq_output
    counts = to_float64(layer.centroid_counts)
    # Without examples a count only decays, `N <- momentum * N`: what it
    # has above that came from the class's examples.
    gained = counts - counts_before * layer.momentum**steps
    if steps < rules.WARMUP_STEPS or not gained.max() > 0:
        return
    unseen = [
        int(c) for c in np.flatnonzero(gained < rules.UNSEEN_CLASS_SHARE * gained.max())
    ]
    if unseen:
        warn_once(
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


def check_constant_penalty(model, fraction, where):
    if fraction is None or not fraction >= rules.MOST_EXAMPLES:
        return
    warn_once(
        model,
        "constant_penalty",
        ConstantPenaltyWarning,
        f"the gradient penalty is constant ({where}): for {fraction:.0%} of "
        "the training examples the input gradient of the summed kernel "
        f"values is zero (norm < {rules.ZERO_GRADIENT_NORM:g}, penalty ~1), so the "
        "penalty adds a constant to the loss and no gradient. The kernel "
        "values do not change with the input: they are vanishingly small "
        "(see `certainty`), or the backbone does not pass the input on (a "
        "layer that zeroes it, dead ReLU units, inputs on a tiny scale). Fix "
        "the cause (inputs normalised to about unit variance, a lower "
        "learning rate, a larger `length_scale`); `gradient_penalty=0` turns "
        "the penalty off. Logged as `zero_input_gradient` (fraction of such "
        "examples).",
    )


def check_short_run(model, logs):
    """A run too short for the other checks that ends with no certainty at all.

    Before the warm-up (`rules.WARMUP_STEPS`, `rules.WARMUP_DATA_SHARE`) kernel values
    that underflow are expected; a whole `fit` that ends so, with a constant
    penalty too, has learnt nothing DUQ can use, however few steps it had.
    """
    certainty = logs.get("certainty")
    zero_gradient = logs.get("zero_input_gradient")
    if certainty is None or not float(certainty) < rules.NEGLIGIBLE_CERTAINTY:
        return
    if zero_gradient is None or not float(zero_gradient) >= rules.MOST_EXAMPLES:
        return
    layer = model.duq_output
    steps = optimizer_steps(model) or 0
    warn_once(
        model,
        "short_run",
        KernelUnderflowWarning,
        f"`fit` ended after {steps} training steps with a mean certainty of "
        f"{float(certainty):.2g} on the last epoch's training batches (below "
        f"{rules.NEGLIGIBLE_CERTAINTY:g}) and a constant gradient penalty: the "
        "model's certainty means nothing yet, and its "
        "predictions can stay at one class. The centroids still owe "
        f"{centroid_random_share(model):.0%} of their value to their random start "
        f"(`momentum={layer.momentum:g}`). " + _length_scale_fix(layer),
    )


def _length_scale_fix(layer):
    """The fix for kernel values that underflow in training, for this head."""
    if layer.length_scale != "auto":
        return (
            f"The length scale is fixed at {layer.length_scale:g}: leave "
            '`length_scale` at its default, `"auto"`, which measures it and the '
            "centroids' start on the features at the start of `fit` "
            "(docs/guide/how_it_works.md), or pass a larger one. "
        )
    return (
        "Lower the centroid `momentum` (e.g. 0.9) so that the centroids follow "
        "the features, or train longer. "
    )


def check_final_state(model, inputs, where, training=False, chunk_size=None):
    """The checks of a model as it is now: on `inputs`, and of its centroids.

    `training`: whether `inputs` are training inputs, whose training-mode
    kernel values are then checked too. `chunk_size`: the batch size of the
    passes over `inputs`.
    """
    if inputs is not None:
        comparison = ModeComparison(model, inputs, chunk_size)
        check_batch_norm(model, comparison, where)
        if training:
            check_underflow(model, comparison.underflow_training, "training", where)
        check_underflow(model, comparison.underflow_inference, "inference", where)
        note_in_distribution(model, comparison)
        check_low_certainty(model, comparison, where)
    check_centroid_overlap(model, where)


def note_in_distribution(model, comparison):
    """Keeps whether in-distribution inputs' kernel values did not underflow
    (`HealthState.healthy_in_distribution`, read by `check_predictions`)."""
    state_of(model).healthy_in_distribution = (
        comparison.underflow_inference < rules.MOST_EXAMPLES
    )


def check_low_certainty(model, comparison, where):
    """Warns when in-distribution inputs get a certainty far below any
    hand-picked threshold (after `rules.WARMUP_STEPS` steps; kernel values
    that underflow have their own warning)."""
    certainty = comparison.certainty_inference
    if (
        not certainty < rules.LOW_CERTAINTY
        or comparison.underflow_inference >= rules.MOST_EXAMPLES
        or not past_first_steps(model)
    ):
        return
    share = centroid_random_share(model)
    start = (
        f" The centroids still owe {share:.0%} of their value to their random "
        "start: training longer moves them to the data."
        if share > rules.WARMUP_DATA_SHARE
        else ""
    )
    warn_once(
        model,
        "low_certainty",
        LowCertaintyWarning,
        f"in-distribution inputs get a low certainty ({where}): the mean "
        f"largest kernel value of a sample of {comparison.size} inputs is "
        f"{certainty:.3g} in inference mode, so a certainty threshold picked by "
        "hand (0.5, say) would refuse nearly all of them, although the "
        "certainty may still rank inputs well. Pick the threshold from "
        "in-distribution validation data: `t = keras_duq.evaluation."
        "certainty_threshold(model.predict(x_val).max(axis=1), keep=0.95)` "
        "accepts 95% of it; serve it with `model.export(path, "
        "certainty_threshold=t)`. To raise the certainty itself, train longer "
        "or use a larger `length_scale` (each kernel value is exp(-distance^2 "
        "/ (2 length_scale^2)))." + start,
    )


def centroid_random_share(model):
    """What is left of the centroids' initial count, relative to their count now.

    The share of the moving averages still owed to their random start, at
    most 1 (counts that no longer follow from `optimizer.iterations`, e.g.
    after `set_weights`, could give more). The mean over classes, so that a
    class never seen does not hold the checks back.
    """
    layer = model.duq_output
    prior = (
        _ops.BIAS_CORRECTED_CENTROID_COUNT
        if layer.bias_correction
        else _ops.INITIAL_CENTROID_COUNT
    )
    initial = prior * layer.momentum ** (optimizer_steps(model) or 0)
    return min(initial / max(to_float64(layer.centroid_counts).mean(), 1e-12), 1.0)


def check_predictions(model: DUQModel, kernel_values: Any) -> None:
    """The check after `predict`: inference-mode underflow, read off its outputs.

    `predict` passes nothing more through the model: the modes are compared
    by `fit` and `evaluate`, on their own data.
    """
    state = state_of(model)
    # An untrained model's kernel values underflow by nature (its centroids
    # are random): nothing to warn about yet. A model whose in-distribution
    # check passed gives inputs far from its training data a certainty of 0:
    # that is the answer asked for.
    if (
        state.out_of_distribution
        or state.healthy_in_distribution
        or not optimizer_steps(model)
    ):
        return
    if (
        isinstance(kernel_values, np.ndarray)
        and kernel_values.ndim == 2
        and len(kernel_values)
    ):
        fraction = float(
            np.mean(kernel_values.max(axis=1) < rules.UNDERFLOW_KERNEL_VALUE)
        )
        check_underflow(model, fraction, "inference", "`predict`")


def _declared_inputs(model, inputs):
    """`[(declared input tensor, sample array)]` of the backbone's inputs, or `[]`."""
    declared = keras.tree.flatten(model.feature_extractor.inputs)
    arrays = keras.tree.flatten(inputs)
    return list(zip(declared, arrays)) if len(declared) == len(arrays) else []


def check_input_scale(model, inputs):
    """Warns when floating-point training inputs are far from standardised.

    Only for backbones without a normalising layer.
    """
    if any(
        isinstance(layer, rules.NORMALIZING_LAYERS)
        for layer in _compat.all_layers(model.feature_extractor)
    ):
        return
    declared = _declared_inputs(model, inputs)
    for position, (tensor, array) in enumerate(declared):
        if not is_float(tensor.dtype):
            continue
        values = np.asarray(array, dtype=np.float64)
        mean, std = float(np.mean(values)), float(np.std(values))
        low, high = rules.INPUT_SCALE_RANGE
        if std == 0 or not np.isfinite(std):
            continue
        if abs(mean) <= rules.INPUT_MEAN_TOLERANCE * std and low <= std <= high:
            continue
        name = getattr(tensor, "name", "") or ""
        if name.startswith("keras_tensor") or not name:
            # Keras's automatic name (a `Sequential`'s or an unnamed
            # `keras.Input`) means nothing to the user: name the argument.
            name = "x" if len(declared) == 1 else f"x[{position}]"
        warn_once(
            model,
            "input_scale",
            InputScaleWarning,
            f"the training input `{name}` is not standardised (mean {mean:.3g}, "
            f"standard deviation {std:.3g} on a sample of {values.shape[0]}) and "
            "the backbone has no normalisation layer. DUQ's gradient penalty acts "
            "on the input gradient, and its certainty separates "
            "out-of-distribution inputs far better on standardised inputs. "
            "Standardise every set with the training set's "
            "mean and standard deviation (`keras_duq.datasets.normalize` for "
            "FashionMNIST-like images), or make a `keras.layers.Normalization()` "
            "adapted on the training inputs the backbone's first layer.",
        )


def check_padding(model, inputs):
    """Warns when the backbone averages over padding that the inputs hold.

    An `Embedding` without `mask_zero` and an averaging layer in the
    backbone, and token ids (integer inputs, or strings through the
    backbone's `TextVectorization`) whose rows hold the padding id in varying
    amounts.
    """
    layers = _compat.all_layers(model.feature_extractor)
    embeddings = [
        layer
        for layer in layers
        if isinstance(layer, keras.layers.Embedding) and not layer.mask_zero
    ]
    pooling = [layer for layer in layers if isinstance(layer, rules.AVERAGING_LAYERS)]
    if not embeddings or not pooling:
        return
    for tensor, array in _declared_inputs(model, inputs):
        array = _token_ids(layers, tensor, np.asarray(array))
        if array is None or array.ndim != 2:
            continue
        padding = np.sum(array == rules.PADDING_ID, axis=1)
        if padding.min() == padding.max():
            continue
        warn_once(
            model,
            "padding",
            PaddingWarning,
            f"the backbone averages over padding: `Embedding` layer "
            f"`{embeddings[0].name}` has `mask_zero=False` and "
            f"`{pooling[0].name}` averages its positions, while the training "
            f"inputs hold the padding id {rules.PADDING_ID} in {padding.min()} to "
            f"{padding.max()} of their {array.shape[1]} positions (a sample of "
            f"{array.shape[0]}). The features then encode each input's length: "
            "short inputs, in or out of distribution, share the padding "
            "embedding's direction, and their certainty depends on where "
            "training happens to put it. Pass `mask_zero=True` to the "
            "`Embedding` so that the average leaves the padding out (if "
            f"{rules.PADDING_ID} is a real token, shift the ids by one).",
        )
        return


def _token_ids(layers, tensor, array):
    """The token ids of a sample input: integer inputs as they are, strings
    through the backbone's `TextVectorization`; `None` for other inputs."""
    if array.dtype.kind in "iu" and not is_float(tensor.dtype):
        return array
    if array.dtype.kind in "USO":
        for layer in layers:
            if (
                isinstance(layer, keras.layers.TextVectorization)
                and layer.get_config()["output_mode"] == "int"
            ):
                return np.asarray(ops.convert_to_numpy(layer(array)))
    return None


def feature_noise_layer(layer):
    """The noise layer whose output (reshaped at most) `layer` returns, or `None`.

    Looks into Sequential and functional models only: a subclassed model's
    `layers` are in the order they were created, not called.
    """
    if isinstance(layer, rules.NOISE_LAYERS):
        return layer
    outputs = getattr(layer, "outputs", None)
    if not isinstance(layer, keras.Model) or not outputs or len(outputs) != 1:
        return None
    # A graph model lists its layers in call order; with one output the
    # last of them computes it.
    for child in reversed(layer.layers):
        if isinstance(child, keras.layers.InputLayer):
            return None
        if not isinstance(child, rules.RESHAPING_LAYERS):
            return feature_noise_layer(child)
    return None


def check_feature_noise(model):
    """Warns when the features come out of a dropout or noise layer."""
    layer = feature_noise_layer(model.feature_extractor)
    if layer is None:
        return
    rate = getattr(layer, "rate", None)
    described = type(layer).__name__ + ("" if rate is None else f"(rate={rate:g})")
    weight = model.categorical_cross_entropy_weight
    warn_once(
        model,
        "feature_noise",
        FeatureDropoutWarning,
        f"the backbone's features come out of `{layer.name}` ({described}). In "
        "training it zeroes or perturbs a random part of every feature vector, "
        "and DUQ's kernel values (exp of minus the squared distance to a "
        "centroid over twice the squared length scale) are far more sensitive "
        "to that noise than a softmax head: the defaults weigh the categorical "
        "term more behind dropout (this model: "
        f"`categorical_cross_entropy_weight={weight:g}`), yet the certainty "
        "separates out-of-distribution inputs better without the layer. "
        "Remove that layer from the backbone (the gradient "
        "penalty regularises DUQ), or move it before the backbone's last "
        "Dense layer.",
    )

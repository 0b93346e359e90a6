"""The `HealthCheck` callback, and how `fit` and `evaluate` add it."""

from __future__ import annotations

import itertools
import sys
import time
from typing import TYPE_CHECKING
from typing import Any

import keras
import numpy as np

from keras_duq._batch_norm import RecomputeBatchNormStatistics
from keras_duq._batch_norm import as_arrays
from keras_duq._batch_norm import batch_norm_layers
from keras_duq._batch_norm import inputs_of
from keras_duq._health import checks
from keras_duq._health import rules
from keras_duq._validation import check_positive_int

if TYPE_CHECKING:
    from keras_duq._duq_model import DUQModel


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
      the training examples (two-sided penalty), so the penalty is constant;
    - `LowCertaintyWarning`: the mean in-distribution certainty in inference
      mode below 0.1 without underflowing;
    - at the start of `fit`: `InputScaleWarning` (floating-point inputs far
      from standardised), `FeatureDropoutWarning` (features straight out of
      a dropout layer) and `PaddingWarning` (an average over padding).

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
    seen); BatchNormalization statistics are compared at its end even
    before that. `evaluate` checks the model's state whenever it runs, and
    `predict` the kernel values it returns.

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
            `fit`, training inputs). The callback keeps it for the call
            only. `fit` and `evaluate` pass 512 random examples of
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
        checks.record_centroid_start(model)
        checks.check_feature_noise(model)
        if self.inputs is not None:
            checks.check_input_scale(model, self.inputs)
            checks.check_padding(model, self.inputs)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch_warmed_up = checks.warmed_up(self._checked_model())
        self._epoch_start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        model = self._checked_model()
        logs = {} if logs is None else logs
        self._last_logs = dict(logs)
        if self._epoch_warmed_up:
            where = f"`fit`, epoch {epoch + 1}"
            checks.check_underflow(model, logs.get("underflow"), "training", where)
            checks.check_constant_penalty(model, logs.get("zero_input_gradient"), where)
        if batch_norm_layers(model.feature_extractor) and self.inputs is not None:
            logs["batch_norm_gap"] = self._timed_gap(model)
        logs["centroid_overlap"] = checks.centroid_overlap(model.duq_output)[0]

    def _timed_gap(self, model: DUQModel) -> float:
        """`batch_norm_gap` now, or NaN when the comparisons have used their share of time."""
        state = checks.state_of(model)
        state.epoch_seconds += time.perf_counter() - self._epoch_start
        if state.comparison_seconds > rules.CHECK_TIME_SHARE * state.epoch_seconds:
            return float("nan")
        start = time.perf_counter()
        gap = checks.ModeComparison(model, self.inputs, self.batch_size).gap
        state.comparison_seconds += time.perf_counter() - start
        return gap

    def on_train_end(self, logs: dict | None = None) -> None:
        model = self._checked_model()
        self._in_fit = False
        if not checks.warmed_up(model):
            checks.check_short_run(model, getattr(self, "_last_logs", {}))
            # Moving statistics lag behind the weights of a short training
            # most, and a low certainty is worth knowing whatever the
            # centroids' state: both are checked before the warm-up too.
            if self.inputs is not None:
                comparison = checks.ModeComparison(model, self.inputs, self.batch_size)
                checks.note_in_distribution(model, comparison)
                if batch_norm_layers(model.feature_extractor) or (
                    checks.past_first_steps(model)
                ):
                    checks.check_batch_norm(model, comparison, "end of `fit`")
                    checks.check_low_certainty(model, comparison, "end of `fit`")
        else:
            checks.check_final_state(
                model,
                self.inputs,
                "end of `fit`",
                training=True,
                chunk_size=self.batch_size,
            )
            checks.check_unseen_classes(model)

    def on_test_end(self, logs: dict | None = None) -> None:
        model = self._checked_model()
        logs = {} if logs is None else logs
        if not self._in_fit:
            checks.check_underflow(
                model, logs.get("underflow"), "inference", "`evaluate`"
            )
            checks.check_final_state(
                model, self.inputs, "`evaluate`", chunk_size=self.batch_size
            )
        elif self._epoch_warmed_up:
            checks.check_underflow(
                model, logs.get("underflow"), "inference", "validation data"
            )


def with_health_check(model: DUQModel, arguments: dict[str, Any]) -> dict[str, Any]:
    """The arguments of `fit` or `evaluate`, by name, with a `HealthCheck` in the callbacks."""
    callbacks = arguments.get("callbacks")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return arguments
    callbacks = list(callbacks or [])
    if any(isinstance(callback, HealthCheck) for callback in callbacks):
        return arguments
    inputs, chunk_size = sample_inputs(arguments.get("x"), arguments.get("batch_size"))
    # Re-estimated statistics first, so that the checks and the user's
    # callbacks (checkpoints, early stopping) see them; then the health
    # check, whose logs every other callback sees.
    first = [c for c in callbacks if isinstance(c, RecomputeBatchNormStatistics)]
    rest = [c for c in callbacks if not isinstance(c, RecomputeBatchNormStatistics)]
    health = HealthCheck(inputs, batch_size=chunk_size)
    return {**arguments, "callbacks": first + [health] + rest}


def sample_inputs(x: Any, batch_size: int | None = None) -> tuple[Any, int | None]:
    """`(inputs, chunk_size)`: a sample of `x` for the mode comparison, and its batch size.

    About `rules.SAMPLE_SIZE` examples, fewer where they would take more than
    `rules.SAMPLE_BYTES` (but at least one batch): a random sample of
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
    """`rules.SAMPLE_SIZE`, or fewer examples of `arrays` (a batch) within `rules.SAMPLE_BYTES`."""
    per_example = sum(
        np.dtype(getattr(a, "dtype", "float32")).itemsize
        * int(np.prod(a.shape[1:], dtype=np.int64))
        for a in arrays
    )
    return max(1, min(rules.SAMPLE_SIZE, rules.SAMPLE_BYTES // max(per_example, 1)))


def _first_batches(elements):
    """`(inputs, first batch size)` of the first batches that hold a sample (`_sample_size`)."""
    batches = []
    count = 0
    for element in elements:
        batches.append(as_arrays(inputs_of(element)))
        arrays = keras.tree.flatten(batches[-1])
        count += int(arrays[0].shape[0])
        if count >= _sample_size(arrays):
            break
    if not batches:
        return None, None
    chunk_size = int(keras.tree.flatten(batches[0])[0].shape[0])
    sample = keras.tree.map_structure(lambda *arrays: np.concatenate(arrays), *batches)
    return sample, chunk_size

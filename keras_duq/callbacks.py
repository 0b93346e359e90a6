"""Keras callbacks for uncertainty evaluation and health checks during `fit`.

- `OODEvaluation`: out-of-distribution metrics logged after each epoch.
- `HealthCheck`: the health checks (`fit` adds one itself).
- `RecomputeBatchNormStatistics`: BatchNormalization statistics
  re-estimated from training data after each epoch.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import keras
import numpy as np

from keras_duq import _health
from keras_duq._batch_norm import RecomputeBatchNormStatistics  # noqa: F401 - public here
from keras_duq._health import HealthCheck  # noqa: F401 - public here
from keras_duq._validation import check_int
from keras_duq.evaluation import CERTAINTY_METHODS
from keras_duq.evaluation import certainty_scores
from keras_duq.evaluation import misclassification_auroc
from keras_duq.evaluation import ood_metrics

__all__ = [
    "HealthCheck",
    "OODEvaluation",
    "RecomputeBatchNormStatistics",
]


class OODEvaluation(keras.callbacks.Callback):
    """Logs out-of-distribution detection metrics during `fit`.

    Every `every_n_epochs` epochs (and after the last epoch), predicts on an
    in-distribution and an OoD set, turns the predictions into certainties
    with `certainty_scores(..., method)` and adds to the epoch's `logs`:

    - `{prefix}auroc`, `{prefix}aupr`, `{prefix}fpr_at_95_tpr`
      (see `ood_metrics`);
    - with in-distribution labels, also `{prefix}in_distribution_accuracy`
      and `{prefix}misclassification_auroc` (`nan` when all predictions are
      right or all wrong).

    The values land in the `History` returned by `fit` and in every callback
    that runs after this one. Put `keras.callbacks.TensorBoard` (or
    `CSVLogger`, `EarlyStopping` on `"ood_auroc"`...) *after* it in the
    `callbacks` list, so that it sees the new values. As with `fit`'s
    `validation_freq`, the keys only appear on the epochs that were
    evaluated, so `History` holds one value per evaluation; the epochs are in
    `self.history["epoch"]`. `keras.callbacks.CSVLogger` fixes its columns
    at the first epoch: use `every_n_epochs=1` with it.

    It works for any classifier whose `predict` returns per-class scores:
    DUQ models (`method="max"`, the default) and softmax models
    (`method="max"` for the maximum softmax probability, or
    `"negative_entropy"`). BatchNormalization and Dropout run in inference
    mode, as in `predict`.

    Example:

    ```python
    callbacks = [
        keras_duq.callbacks.OODEvaluation(
            in_distribution=(x_test, y_test),
            out_of_distribution=x_ood,
            every_n_epochs=5,
        ),
        keras.callbacks.TensorBoard("logs"),  # after it: sees ood_* values
    ]
    history = model.fit(x_train, y_train, epochs=30, callbacks=callbacks)
    history.history["ood_auroc"]
    ```

    Args:
        in_distribution: in-distribution test data: a numpy array `x`, a
            tuple `(x, y)` with integer labels `(n,)`, or a batched
            `tf.data.Dataset` or finite `keras.utils.PyDataset` yielding `x`
            or `(x, y)` (as in `fit`, a tuple element is read as `(x, y)` or
            `(x, y, sample_weight)`).
        out_of_distribution: OoD data: a numpy array `x` or a batched
            dataset (labels, if any, are ignored). Datasets are
            read into memory at each evaluation, so keep the sets at test
            set size.
        every_n_epochs: int >= 1, evaluate after every this many epochs.
            Defaults to `5`.
        method: `"max"` (default) or `"negative_entropy"`, see
            `certainty_scores`.
        prefix: str, prepended to every logged key. Defaults to `"ood_"`.
        batch_size: int, batch size of the predictions. Defaults to `256`.
    """

    def __init__(
        self,
        in_distribution: Any,
        out_of_distribution: Any,
        every_n_epochs: int = 5,
        method: str = "max",
        prefix: str = "ood_",
        batch_size: int = 256,
    ) -> None:
        super().__init__()
        check_int("every_n_epochs", every_n_epochs, minimum=1)
        if method not in CERTAINTY_METHODS:
            raise ValueError(
                f"Unknown certainty method. Expected one of {CERTAINTY_METHODS}. "
                f"Received: `method={method!r}`"
            )
        if not isinstance(prefix, str):
            raise ValueError(
                f"Expected `prefix` to be a string. Received: `prefix={prefix!r}`"
            )
        check_int("batch_size", batch_size, minimum=1)
        self.in_distribution = _check_data("in_distribution", in_distribution)
        self.out_of_distribution = _check_data(
            "out_of_distribution", out_of_distribution
        )
        self.every_n_epochs = every_n_epochs
        self.method = method
        self.prefix = prefix
        self.batch_size = batch_size
        self.history = {}

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        last_epoch = self.params.get("epochs") if self.params else None
        if (epoch + 1) % self.every_n_epochs and epoch + 1 != last_epoch:
            return
        results = self.evaluate()
        if logs is not None:
            logs.update(results)
        self.history.setdefault("epoch", []).append(epoch)
        for key, value in results.items():
            self.history.setdefault(key, []).append(value)

    def evaluate(self) -> dict[str, float]:
        """Computes the metrics now, with the current weights.

        Returns:
            The dict of metrics that `on_epoch_end` adds to the logs.
        """
        in_scores, labels = self._predict(self.in_distribution)
        # OoD inputs should look unhealthy: no health warning about them.
        with _health.out_of_distribution(self.model):
            ood_scores, _ = self._predict(self.out_of_distribution)
        in_certainty = certainty_scores(in_scores, self.method)
        ood_certainty = certainty_scores(ood_scores, self.method)
        results = ood_metrics(in_certainty, ood_certainty)
        if labels is not None:
            correct = np.argmax(in_scores, axis=1) == labels
            results["in_distribution_accuracy"] = float(correct.mean())
            if correct.all() or not correct.any():
                results["misclassification_auroc"] = math.nan
            else:
                results["misclassification_auroc"] = misclassification_auroc(
                    in_certainty, correct
                )
        return {self.prefix + key: value for key, value in results.items()}

    def _predict(self, data: Any) -> tuple[np.ndarray, np.ndarray | None]:
        """Scores `(n, classes)` and labels `(n,)` (or `None`) for `data`."""
        if not _is_dataset(data):
            x, y = data if isinstance(data, tuple) else (data, None)
            scores = self.model.predict(x, batch_size=self.batch_size, verbose=0)
            return scores, None if y is None else _as_labels(y)
        # Inputs and labels are read in one pass: a dataset that reshuffles
        # on every iteration would pair them wrongly over two passes. One
        # `predict` call on the result then traces its function once, where
        # batch-by-batch prediction would retrace on the smaller last batch.
        input_batches, label_batches = [], []
        for element in _elements(data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(element)
            input_batches.append(keras.tree.map_structure(np.asarray, x))
            if y is not None:
                label_batches.append(np.asarray(y))
        if not input_batches:
            raise ValueError("The dataset passed to `OODEvaluation` is empty.")
        x = keras.tree.map_structure(
            lambda *batches: np.concatenate(batches), *input_batches
        )
        scores = self.model.predict(x, batch_size=self.batch_size, verbose=0)
        labels = _as_labels(np.concatenate(label_batches)) if label_batches else None
        return scores, labels


def _check_data(name, data):
    if _is_dataset(data):
        if isinstance(data, keras.utils.PyDataset) and data.num_batches is None:
            raise ValueError(
                f"`{name}` is an endless `keras.utils.PyDataset`; evaluation "
                "needs a finite one (e.g. `make_dataset(..., repeat=False)`)."
            )
        return data
    if isinstance(data, tuple):
        if len(data) != 2:
            raise ValueError(
                f"Expected `{name}` to be an array `x`, a tuple `(x, y)` or a "
                f"dataset. Received: a tuple of length {len(data)}"
            )
        x, y = data
        if len(x) != len(y):
            raise ValueError(
                f"`{name}` has {len(x)} inputs but {len(y)} labels. Pass "
                f"matching arrays. Received: `{name}=(x, y)` with "
                f"x of length {len(x)} and y of length {len(y)}"
            )
        return data
    if not hasattr(data, "shape") and not isinstance(data, (list, dict)):
        raise ValueError(
            f"Expected `{name}` to be an array `x`, a tuple `(x, y)` or a "
            f"dataset. Received: `{name}` of type {type(data).__name__}"
        )
    return data


def _as_labels(y):
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] > 1:
        return y.argmax(axis=1)
    return y.reshape(-1)


def _is_dataset(data):
    if isinstance(data, keras.utils.PyDataset):
        return True
    # Without TensorFlow loaded (the JAX backend) no tf.data dataset exists.
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(data, tf.data.Dataset)


def _elements(data):
    if not isinstance(data, keras.utils.PyDataset):
        return iter(data)
    return (data[index] for index in range(data.num_batches))

"""The per-batch health metrics, updated inside the training and test steps."""

from __future__ import annotations

import keras
from keras import ops

from keras_duq import _ops
from keras_duq._health import rules
from keras_duq._typing import Tensor


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
    underflow.update_state(
        ops.cast(max_log_kernel < rules.UNDERFLOW_LOG_KERNEL, "float32")
    )
    if zero_gradient and penalty is not None:
        # The two-sided penalty is `(||g|| - 1)^2`: within this band the norm
        # is ~0 (or, never in practice, ~2).
        band = _ops.gradient_penalty(
            ops.convert_to_tensor([rules.ZERO_GRADIENT_NORM, 0.0], "float32"),
            "two_sided",
        )
        flat = ops.logical_and(penalty >= band[0], penalty <= band[1])
        zero_gradient[0].update_state(
            ops.mean(ops.cast(flat, "float32")), sample_weight=penalty_weight
        )

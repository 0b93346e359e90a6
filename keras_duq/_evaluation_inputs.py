"""Checks of the arrays that `keras_duq.evaluation` takes, with actionable errors."""

from __future__ import annotations

import math

import numpy as np

from keras_duq._validation import non_finite_rows


def count_for_fraction(total, fraction):
    # Rounded before the ceiling so that 0.9 * 10 (9.000000000000002 in
    # floating point) counts 9 examples, not 10.
    return max(1, math.ceil(round(fraction * total, 9)))


def check_both_outcomes(correct, what, fix):
    if correct.all() or not correct.any():
        raise ValueError(
            f"{what} needs both correct and wrong predictions, but all "
            f"predictions are {'correct' if correct.all() else 'wrong'}. {fix} "
            f"Received: {len(correct)} predictions"
        )


def check_fraction(name, value):
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value <= 1
    ):
        raise ValueError(
            f"Expected `{name}` to be a fraction in (0, 1], e.g. 0.95. "
            f"Received: `{name}={value!r}`"
        )


def as_certainty(name, values):
    values = np.asarray(values, dtype="float64")
    if values.ndim != 1 or len(values) == 0:
        raise ValueError(
            f"Expected `{name}` to be a non-empty 1-D array of per-example "
            "certainties. Turn per-class scores into certainties with "
            f"`keras_duq.evaluation.certainty_scores(scores)`. Received: `{name}` of "
            f"shape {values.shape}"
        )
    check_finite(name, values)
    return values


def as_correct(name, values, length):
    values = np.asarray(values)
    if values.shape != (length,):
        raise ValueError(
            f"Expected `{name}` to have shape ({length},), one entry per "
            f"certainty. Received: `{name}` of shape {values.shape}"
        )
    if values.dtype != bool:
        if not np.all((values == 0) | (values == 1)):
            raise ValueError(
                f"Expected `{name}` to hold booleans or 0/1, e.g. "
                f"`predictions == labels`. Received: values {np.unique(values)[:5]}"
            )
        values = values.astype(bool)
    return values


def check_finite(name, values):
    bad = non_finite_rows(values)
    if bad.size:
        raise ValueError(
            f"`{name}` contains NaN or infinite values "
            f"({bad.size} of {len(values)}, the first at index {int(bad[0])}). "
            "Check the model's predictions (a diverged model predicts NaN)."
        )


def detection_problem(in_certainty, ood_certainty):
    """Binary labels (OoD = 1) and detector scores (uncertainty)."""
    is_ood = np.concatenate(
        [np.zeros(len(in_certainty), "int64"), np.ones(len(ood_certainty), "int64")]
    )
    uncertainty = -np.concatenate([in_certainty, ood_certainty])
    return is_ood, uncertainty

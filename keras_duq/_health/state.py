"""What the health checks keep per model between calls, and the warn-once rule."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import keras


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

"""What the health checks keep per model between calls, and the warn-once rule."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import keras


@dataclasses.dataclass
class HealthState:
    """One model's health-check state, kept over all its calls.

    Attributes:
        warned: the causes it has warned about (each warns once).
        compared_at: the optimizer step at which its BatchNormalization
            statistics were last compared with the sample's.
        centroid_start: its centroid counts at the start of its first
            `fit`, with the optimizer step then.
        training_inputs: a sample of its last `fit`'s inputs ...
        training_chunk_size: ... and their batch size.
        out_of_distribution: > 0 while `predict` is given OoD inputs.
        epoch_seconds: the seconds its epochs have taken, over all `fit`s ...
        comparison_seconds: ... and its per-epoch mode comparisons.
        comparison: its last mode comparison, `(inputs, key, comparison)`
            (see `checks.compare_modes`).
    """

    warned: set[str] = dataclasses.field(default_factory=set)
    compared_at: int | None = None
    centroid_start: tuple[Any, int | None] | None = None
    training_inputs: Any = None
    training_chunk_size: int | None = None
    out_of_distribution: int = 0
    epoch_seconds: float = 0.0
    comparison_seconds: float = 0.0
    comparison: tuple[Any, Any, Any] | None = None


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def state_of(model: keras.Model) -> HealthState:
    """`model`'s `HealthState` (a fresh one at the first call)."""
    state = _STATES.get(model)
    if state is None:
        state = _STATES[model] = HealthState()
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

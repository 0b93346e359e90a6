"""Values of tensors and variables read back to NumPy, on any backend."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops


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

"""Type aliases shared by keras_duq's annotations."""

from __future__ import annotations

from typing import Any

# A backend tensor: tf.Tensor, jax.Array or torch.Tensor (whatever `keras.ops`
# takes and returns on the active backend), so no single class describes it.
Tensor = Any

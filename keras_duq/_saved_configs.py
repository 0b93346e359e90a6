"""Configs saved by earlier keras_duq versions, read as the current arguments.

Every setting added since the first release is absent from the files saved
before it, and such a file describes a model that trained as that version
did; these functions fill in what it meant. They are the only place that
knows about earlier versions.
"""

from __future__ import annotations

from typing import Any

# Written into every model config: the categorical weight is per example.
# A file without it was saved when the weight was divided by the number of
# classes.
MODEL_MARKERS = {"categorical_cross_entropy_per_example": True}


def output_config(config: dict[str, Any]) -> dict[str, Any]:
    """A `DUQOutput` config with the settings that earlier files lack."""
    return {
        # `W` trained at the optimizer's rate, and `kernel` held `W` itself.
        "projection_learning_rate": 1.0,
        # The per-class head was the only one.
        "head": "per_class",
        **config,
    }


def model_config(config: dict[str, Any], num_classes: int) -> dict[str, Any]:
    """A `DUQModel` config (the nested layers already taken out) with the
    settings that earlier files lack, and without the markers."""
    config = {"categorical_cross_entropy_weight": 0.0, "clipnorm": None, **config}
    if not config.pop("categorical_cross_entropy_per_example", False):
        config["categorical_cross_entropy_weight"] /= num_classes
    return config

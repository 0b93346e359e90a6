"""Argument checks shared by the library, with Keras-style messages."""

from __future__ import annotations


def check_int(name: str, value, minimum: int) -> None:
    """Raises a `ValueError` unless `value` is an int >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"Expected `{name}` to be an integer >= {minimum}. "
            f"Received: `{name}={value!r}`"
        )


def check_non_negative(name: str, value) -> None:
    """Raises a `ValueError` unless `value` is a number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(
            f"Expected `{name}` to be a float >= 0. Received: `{name}={value!r}`"
        )


# Shared by every guard against non-finite training state.
NON_FINITE_TRAINING_MESSAGE = (
    "a non-finite value (NaN or Inf) appeared in training, so this update "
    "was not applied (the weights and centroids keep their last finite "
    "values) and training stopped. Likely causes, most common first: inputs "
    "that are not normalised (e.g. raw 0-255 pixels: scale them to about "
    "unit variance); a learning rate that is too high (lower it, or clip "
    "gradients with the optimizer's `clipnorm`); a `length_scale` that is "
    "too small for the scale of the features (try a larger one)."
)

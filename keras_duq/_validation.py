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

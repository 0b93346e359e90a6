"""Saved `.keras` files: `load_model`, and configs saved by earlier versions.

`load_model` checks a file before Keras reads it, so that a damaged one is
named as damaged (Keras says "File not found" for a truncated archive and
raises zipfile's raw `BadZipFile` for a corrupted one).

Configs saved by earlier keras_duq versions are read as the current arguments.

Every setting added since the first release is absent from the files saved
before it, and such a file describes a model that trained as that version
did; these functions fill in what it meant. They are the only place that
knows about earlier versions.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

import keras

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


def load_model(filepath: str | os.PathLike, **kwargs: Any) -> keras.Model:
    """Loads a `.keras` file saved by `model.save`, after checking it is whole.

    The same as `keras.models.load_model(filepath, **kwargs)`, which also
    loads DUQ models, with clear errors for the files it cannot read: a
    missing file, a file that is not a `.keras` archive, and one that was cut
    off or damaged in saving or copying.

    Args:
        filepath: path of the `.keras` file.
        **kwargs: passed on to `keras.models.load_model` (`custom_objects`,
            `compile`, `safe_mode`).

    Returns:
        The model, compiled as it was saved (unless `compile=False`).

    Example:

    ```python
    model.save("duq.keras")
    model = keras_duq.load_model("duq.keras")
    ```
    """
    path = os.fspath(filepath)
    if path.endswith(".keras"):
        check_keras_file(path)
    return keras.models.load_model(filepath, **kwargs)


def check_keras_file(path: str) -> None:
    """Raises a clear error unless `path` is a whole `.keras` archive:
    `FileNotFoundError` for a missing file, `ValueError` for a damaged one."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"No `.keras` file at `filepath={path!r}`. Expected the path that "
            "`model.save` wrote; check the name and the working directory "
            f"({os.getcwd()})."
        )
    size = os.path.getsize(path)
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"`filepath={path!r}` ({size} bytes) is not a readable `.keras` "
            "archive: its zip directory is missing, so the file was cut off "
            "(an interrupted save, copy or download) or is no `.keras` file. "
            "Save the model again, or copy the file again from where it is whole."
        )
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        problem = (
            None if damaged is None else f"its part {damaged!r} fails its checksum"
        )
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        problem = f"its records cannot be read ({error})"
    if problem is not None:
        raise ValueError(
            f"`filepath={path!r}` is a damaged `.keras` archive: {problem}, so "
            "the bytes changed after saving (a failed copy or disk). Save the "
            "model again, or copy the file again from where it is whole."
        )

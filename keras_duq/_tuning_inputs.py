"""Checks of `keras_duq.tuning.search`'s arguments, raised before any training."""

from __future__ import annotations

import keras
import numpy as np

from keras_duq._validation import non_finite_rows
from keras_duq._wrap import argument_names

# The arguments `search` chooses itself.
SEARCHED = ("length_scale", "gradient_penalty")


def check_wrap_kwargs(wrap_kwargs):
    searched = [key for key in SEARCHED if key in wrap_kwargs]
    if searched:
        raise ValueError(
            f"`search` chooses {' and '.join(f'`{key}`' for key in searched)} "
            "itself, so it cannot be held fixed. Pass the values to try as "
            "`length_scales=[...]` or `gradient_penalties=[...]` instead. "
            f"Received: {', '.join(f'`{k}={wrap_kwargs[k]!r}`' for k in searched)}"
        )
    accepted = [name for name in argument_names() if name not in SEARCHED]
    unknown = [key for key in wrap_kwargs if key not in accepted]
    if unknown:
        raise ValueError(
            f"Unknown argument(s) {unknown}: `search` passes its other keyword "
            f"arguments to `keras_duq.wrap`, which takes {accepted}. Received: "
            + ", ".join(f"`{k}={wrap_kwargs[k]!r}`" for k in unknown)
        )


def check_inputs(name, x):
    """Returns the number of examples in `x`, checking its arrays agree."""
    leaves = keras.tree.flatten(x)
    lengths = {len(leaf) for leaf in leaves if hasattr(leaf, "__len__")}
    if (
        not leaves
        or len(lengths) != 1
        or len(leaves) != sum(hasattr(leaf, "__len__") for leaf in leaves)
    ):
        raise ValueError(
            f"Expected `{name}` to be an array (or a list or dict of arrays "
            "with one row per example, all of the same length). Received: "
            f"`{name}` of type {type(x).__name__}"
            + (f" with lengths {sorted(lengths)}" if lengths else "")
        )
    for leaf in leaves:
        bad = non_finite_rows(leaf)
        if bad.size:
            raise ValueError(
                f"`{name}` contains NaN or infinite values. Clean or impute "
                "the data before the search (e.g. `np.nan_to_num`). Received: "
                f"{bad.size} example(s) with non-finite values, the first at "
                f"index {int(bad[0])}"
            )
    (num_examples,) = lengths
    if num_examples == 0:
        raise ValueError(f"`{name}` is empty. Received: `{name}` with 0 examples")
    return num_examples


def check_labels(name, y, num_examples, num_classes):
    y = np.asarray(y)
    one_hot = y.ndim == 2 and y.shape[1] == num_classes
    if len(y) != num_examples or not (
        y.ndim == 1 or (y.ndim == 2 and (y.shape[1] == 1 or one_hot))
    ):
        raise ValueError(
            f"Expected `{name}` to hold one label per example ({num_examples}): "
            f"class indices of shape ({num_examples},) or ({num_examples}, 1), "
            f"or one-hot of shape ({num_examples}, {num_classes}). Received: "
            f"`{name}` of shape {y.shape}"
        )
    if not np.issubdtype(y.dtype, np.number):
        raise ValueError(
            f"Expected numeric labels in `{name}`. Received: dtype {y.dtype}"
        )
    indices = y.argmax(axis=1) if one_hot else y.reshape(-1)
    if not np.all(
        (indices == np.round(indices)) & (indices >= 0) & (indices < num_classes)
    ):
        raise ValueError(
            f"Expected `{name}` to hold class indices in [0, {num_classes}) "
            f"(`num_classes={num_classes}`). Received: labels "
            f"{np.unique(indices)[:10]}"
        )


def check_validation_data(validation_data, num_classes):
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) != 2:
        raise ValueError(
            "Expected `validation_data` to be a tuple `(x_val, y_val)` of "
            "in-distribution validation inputs and labels. Received: "
            f"`validation_data` of type {type(validation_data).__name__}"
        )
    x_val, y_val = validation_data
    num_examples = check_inputs("validation_data[0]", x_val)
    check_labels("validation_data[1]", y_val, num_examples, num_classes)
    return x_val, y_val


def class_indices(y):
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] > 1:
        return y.argmax(axis=1)
    return y.reshape(-1).astype("int64")

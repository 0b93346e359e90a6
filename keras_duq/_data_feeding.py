"""How `fit`, `evaluate` and `predict` feed in-memory arrays on TensorFlow,
and TensorFlow's retracing warning that several models set off."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import keras

from keras_duq import _compat


def quiet_array_inputs(method, arguments):
    """`fit`/`evaluate`/`predict` arguments, in-memory arrays fed without autotuning.

    Keras feeds arrays through a `tf.data` pipeline with autotuning on, and
    dropping such an iterator before its end, as `fit` does after each
    epoch's last step, sometimes waits for the autotuning thread's next
    wake-up. The same pipeline with autotuning off gives the same batches
    without the wait. `arguments` maps every parameter
    name of the Keras method to its value; datasets, generators and other
    inputs pass through unchanged.
    """
    arguments = dict(arguments)
    x, y, weights = (arguments.get(k) for k in ("x", "y", "sample_weight"))
    if not _compat.is_array_data(x, y, weights):
        return arguments
    if method == "predict":
        arguments["x"] = _compat.array_dataset(
            x, batch_size=arguments["batch_size"], steps=arguments["steps"]
        )
        arguments["batch_size"] = None
        return arguments
    if method == "evaluate":
        arguments["x"] = _compat.array_dataset(
            x, y, weights, batch_size=arguments["batch_size"], steps=arguments["steps"]
        )
        arguments.update(y=None, sample_weight=None, batch_size=None)
        return arguments
    if arguments["validation_split"] and arguments["validation_data"] is None:
        (x, y, weights), validation = _compat.split_validation(
            (x, y, weights), arguments["validation_split"]
        )
        arguments.update(validation_data=validation, validation_split=0.0)
    validation = arguments["validation_data"]
    if validation is not None:
        val_x, val_y, val_weights = keras.utils.unpack_x_y_sample_weight(validation)
        if _compat.is_array_data(val_x, val_y, val_weights):
            arguments["validation_data"] = _compat.array_dataset(
                val_x,
                val_y,
                val_weights,
                batch_size=arguments["validation_batch_size"]
                or arguments["batch_size"],
                steps=arguments["validation_steps"],
            )
            arguments["validation_batch_size"] = None
    arguments["x"] = _compat.array_dataset(
        x,
        y,
        weights,
        batch_size=arguments["batch_size"],
        steps=arguments["steps_per_epoch"],
        shuffle=arguments["shuffle"],
        class_weight=arguments["class_weight"],
    )
    arguments.update(
        y=None, sample_weight=None, class_weight=None, batch_size=None, shuffle=False
    )
    return arguments


class _RetracingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "triggered tf.function retracing" not in record.getMessage()


@contextlib.contextmanager
def quiet_retracing() -> Iterator[None]:
    """Drops TensorFlow's retracing warning inside the block.

    Every model traces its own `predict` function once, and TensorFlow
    counts the traces of all models' functions together: from the sixth
    model on (a search's trials, the examples' several models), it reports
    excessive retracing although nothing is traced twice. Other messages
    pass; the filter is removed afterwards.
    """
    logger = logging.getLogger("tensorflow")
    retracing_filter = _RetracingFilter()
    logger.addFilter(retracing_filter)
    try:
        yield
    finally:
        logger.removeFilter(retracing_filter)

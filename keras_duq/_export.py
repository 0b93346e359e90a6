"""SavedModel export of a DUQ model for TF Serving."""

from __future__ import annotations

import inspect

import keras
import tensorflow as tf

# The serving signature's input key for a single-input model. Requests use
# it (`{"inputs": ...}` in TF Serving's columnar format); the row format
# `{"instances": [...]}` needs no key at all.
SINGLE_INPUT_NAME = "inputs"


def export_saved_model(model, filepath, verbose=False, input_signature=None):
    """Writes `model` as a SavedModel whose `serving_default` gives DUQ outputs."""
    if input_signature is None:
        input_signature = [serving_input_signature(model.feature_extractor.input)]

    def serve(inputs):
        features = model.feature_extractor(inputs, training=False)
        log_kernel = model.duq_output.log_kernel_values(features)
        kernel_values = tf.exp(log_kernel)
        return {
            "kernel_values": kernel_values,
            # From log K: far inputs underflow every K to 0, not log K.
            "predictions": tf.argmax(log_kernel, axis=-1),
            "certainty": tf.reduce_max(kernel_values, axis=-1),
        }

    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serve", serve, input_signature)
    if "verbose" in inspect.signature(archive.write_out).parameters:
        archive.write_out(filepath, verbose=bool(verbose))
    else:  # Keras < 3.6 prints nothing and takes no `verbose`.
        archive.write_out(filepath)


def serving_input_signature(inputs):
    """`tf.TensorSpec`s with stable names and a free batch dimension.

    One input is named `"inputs"`; a dict of inputs keeps its keys; a list
    gets `"inputs_0"`, `"inputs_1"`, ...: Keras's own input names depend on
    how many models were built before (`input_layer_3`), so they cannot be
    documented.
    """

    def spec(tensor, name):
        return tf.TensorSpec((None,) + tuple(tensor.shape[1:]), tensor.dtype, name=name)

    if isinstance(inputs, dict):
        return {key: spec(tensor, key) for key, tensor in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        if len(inputs) == 1:
            return [spec(inputs[0], SINGLE_INPUT_NAME)]
        return [
            spec(tensor, f"{SINGLE_INPUT_NAME}_{index}")
            for index, tensor in enumerate(inputs)
        ]
    return spec(inputs, SINGLE_INPUT_NAME)

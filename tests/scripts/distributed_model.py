"""The small model of the distribution tests (imported by their scripts and tests)."""

import keras

import keras_duq


def build(head="per_class", length_scale=0.5):
    """A Dense backbone with a DUQ head, compiled with momentum SGD."""
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras_duq.DUQOutput(
        num_classes=3,
        centroid_dims=5,
        momentum=0.9,
        length_scale=length_scale,
        head=head,
    )(x)
    model = keras_duq.DUQModel(inputs, outputs, gradient_penalty=0.5)
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    return model

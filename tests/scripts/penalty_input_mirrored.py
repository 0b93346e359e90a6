"""A token model with `penalty_input`, on one device and under `MirroredStrategy`.

    python penalty_input_mirrored.py

Two logical CPUs must be configured before TensorFlow starts: a process of
its own. Prints both runs' penalties and the largest weight difference.
"""

import json

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
from test_penalty_input import _model  # noqa: E402
from test_penalty_input import _tokens  # noqa: E402


def build():
    model = _model(health_checks=False)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


x, y = _tokens(n=16)
single = build()
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    mirrored = build()
for weight, other in zip(mirrored.weights, single.weights):
    weight.assign(other.numpy())
logs = [
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    for model in (single, mirrored)
]
report = {
    "penalties": [log["gradient_penalty"] for log in logs],
    "difference": max(
        float(np.abs(a.numpy() - b.numpy()).max())
        for a, b in zip(single.weights, mirrored.weights)
    ),
}
print(json.dumps(report))

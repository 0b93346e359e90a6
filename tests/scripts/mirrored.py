"""The same 2 epochs on one device and under `MirroredStrategy` on two logical CPUs.

    python mirrored.py HEAD [LENGTH_SCALE]

The two logical CPUs must be configured before TensorFlow starts, so this
runs in a process of its own. Prints the largest weight difference and
whether the replicas' centroid copies agree.
"""

import json
import sys

import keras
import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

from distributed_model import build  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(16, 4)).astype("float32")
y = np.array([0] * 2 + [1] * 6 + [2] * 8)  # the replicas see different classes
head = sys.argv[1]
length_scale = sys.argv[2] if len(sys.argv) > 2 else "0.5"
length_scale = length_scale if length_scale == "auto" else float(length_scale)
single = build(head, length_scale)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    mirrored = build(head, length_scale)
for weight, other in zip(mirrored.weights, single.weights):
    weight.assign(other.numpy())
# `length_scale="auto"` draws the centroids' start: the same draws for both.
keras.utils.set_random_seed(0)
single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
keras.utils.set_random_seed(0)
mirrored.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
layer = mirrored.duq_output
copies = [
    [t.numpy() for t in strategy.experimental_local_results(v.value)]
    for v in layer._centroid_state
]
report = {
    "replicas": strategy.num_replicas_in_sync,
    "copies": len(copies[0]),
    "copy_difference": max(float(np.abs(c[0] - c[1]).max()) for c in copies),
    "difference": max(
        float(np.abs(a.numpy() - b.numpy()).max())
        for a, b in zip(single.weights, mirrored.weights)
    ),
}
print(json.dumps(report))

"""The same 2 epochs on one device and under `MirroredStrategy` on two logical CPUs.

    python mirrored.py

The two logical CPUs must be configured before TensorFlow starts, so this
runs in a process of its own, once for every head and length scale (one
TensorFlow start). Prints, for each `"head-length_scale"`, the largest
weight difference and whether the replicas' centroid copies agree.
"""

import json

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
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def compare(head, length_scale):
    single = build(head, length_scale)
    with strategy.scope():
        mirrored = build(head, length_scale)
    for weight, other in zip(mirrored.weights, single.weights):
        weight.assign(other.numpy())
    # `length_scale="auto"` draws the centroids' start: the same draws for both.
    keras.utils.set_random_seed(0)
    single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    keras.utils.set_random_seed(0)
    mirrored.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    copies = [
        [t.numpy() for t in strategy.experimental_local_results(v.value)]
        for v in mirrored.duq_output._centroid_state
    ]
    return {
        "replicas": strategy.num_replicas_in_sync,
        "copies": len(copies[0]),
        "copy_difference": max(float(np.abs(c[0] - c[1]).max()) for c in copies),
        "difference": max(
            float(np.abs(a.numpy() - b.numpy()).max())
            for a, b in zip(single.weights, mirrored.weights)
        ),
    }


print(
    json.dumps(
        {
            f"{head}-{length_scale}": compare(head, length_scale)
            for head in ("per_class", "shared")
            for length_scale in (0.5, "auto")
        }
    )
)

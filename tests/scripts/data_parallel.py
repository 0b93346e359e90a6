"""Trains two epochs and prints every variable; with `DUQ_DATA_PARALLEL` on two devices.

    python data_parallel.py HEAD

Run under JAX; with `DUQ_DATA_PARALLEL=1` set, and XLA's flag for two host
devices, it trains under `keras.distribution.DataParallel`.
"""

import json
import os
import sys

import jax
import keras
from harness import data
from harness import make_model

if os.environ.get("DUQ_DATA_PARALLEL"):
    assert len(jax.devices()) == 2
    keras.distribution.set_distribution(keras.distribution.DataParallel())
model = make_model(gradient_penalty=0.5, batch_norm=False, head=sys.argv[1])
x, y = data(n=128)
model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
print(
    json.dumps({v.path: keras.ops.convert_to_numpy(v).tolist() for v in model.weights})
)

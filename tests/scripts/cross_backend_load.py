"""Loads other backends' `.keras` files: their predictions' error, and 3 more steps.

    python cross_backend_load.py FOLDER '["jax", "torch"]'

Reads the files `cross_backend_train.py` wrote to FOLDER.
"""

import json
import os
import sys

import keras
import numpy as np
from harness import data

import keras_duq  # noqa: F401  (registers its classes for loading)

folder = sys.argv[1]
x, y = data()
results = {}
for source in json.loads(sys.argv[2]):
    model = keras.saving.load_model(os.path.join(folder, source + ".keras"))
    expected = np.load(os.path.join(folder, source + "_predictions.npy"))
    error = float(np.abs(model.predict(x, verbose=0) - expected).max())
    before = int(model.optimizer.iterations)
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0).history
    results[source] = {
        "error": error,
        "steps": int(model.optimizer.iterations) - before,
        "loss": history["loss"][0],
    }
print(json.dumps(results))

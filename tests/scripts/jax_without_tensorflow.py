"""Trains, evaluates, saves and reloads a model; says whether TensorFlow was imported.

    python jax_without_tensorflow.py MODEL_PATH

Run by `harness.run(..., block_tensorflow=True)` under JAX.
"""

import json
import sys

import keras
import numpy as np
from harness import data
from harness import make_model

model = make_model()
x, y = data()
history = model.fit(
    x,
    y,
    batch_size=32,
    epochs=2,
    verbose=0,
    validation_data=(x, y),
    callbacks=[keras.callbacks.EarlyStopping(patience=5)],
)
logs = model.evaluate(x, y, verbose=0, return_dict=True)
expected = model.predict(x[:8], verbose=0)
model.save(sys.argv[1])
reloaded = keras.saving.load_model(sys.argv[1])
report = {
    "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    "logs": {k: float(v) for k, v in logs.items()},
    "reload_error": float(np.abs(reloaded.predict(x[:8], verbose=0) - expected).max()),
    "kernel_range": [float(expected.min()), float(expected.max())],
    "tensorflow": any(m.split(".")[0] == "tensorflow" for m in sys.modules),
}
print(json.dumps(report))

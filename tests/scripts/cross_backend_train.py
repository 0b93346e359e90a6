"""Trains 3 steps from shared initial weights; saves the state, a `.keras` file, predictions.

    python cross_backend_train.py FOLDER

Under TensorFlow it first writes the initial weights that every backend
then loads. Prints the names of the model's variables.
"""

import json
import os
import sys

import keras
import numpy as np
from harness import data
from harness import make_model
from harness import state

model = make_model()
x, y = data()
folder = sys.argv[1]
backend = keras.backend.backend()
if backend == "tensorflow":
    model.save_weights(os.path.join(folder, "initial.weights.h5"))
    np.savez(os.path.join(folder, "initial.npz"), *state(model))
model.load_weights(os.path.join(folder, "initial.weights.h5"))
model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
np.savez(os.path.join(folder, backend + ".npz"), *state(model))
model.save(os.path.join(folder, backend + ".keras"))
predictions = model.predict(x, verbose=0)
np.save(os.path.join(folder, backend + "_predictions.npy"), predictions)
print(json.dumps({"names": [v.path for v in model.weights]}))

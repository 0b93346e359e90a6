"""Serves SavedModels with TensorFlow alone (no Keras, no keras_duq).

    python serve_with_tf_only.py PATH=INPUTS.npz [PATH=INPUTS.npz ...]

Loads each SavedModel, calls `serving_default` with the arrays of its .npz
by name and writes the outputs to `PATH.out.npz`. Prints each signature's
input names and output dtypes, and the keras_duq modules imported (none).
"""

import json
import sys

import numpy as np
import tensorflow as tf

report = {}
for argument in sys.argv[1:]:
    path, inputs = argument.split("=")
    serve = tf.saved_model.load(path).signatures["serving_default"]
    arrays = np.load(inputs)
    outputs = serve(**{name: tf.constant(arrays[name]) for name in arrays.files})
    np.savez(path + ".out.npz", **{k: v.numpy() for k, v in outputs.items()})
    report[path] = {
        "inputs": sorted(serve.structured_input_signature[1]),
        "dtypes": {k: v.dtype.name for k, v in outputs.items()},
    }
report["imported"] = sorted(m for m in sys.modules if m.startswith("keras_duq"))
print(json.dumps(report))

"""
Title: Serving a DUQ model with TensorFlow Serving
Description: Export a trained DUQ model as a SavedModel, load it with
TensorFlow alone and build a TF Serving REST request.

A DUQ model answers two questions per input: which class, and how certain.
`DUQModel.export` writes a TensorFlow SavedModel whose `serving_default`
signature returns both: `kernel_values` `(batch, classes)`, `predictions`
`(batch,)` and `certainty` `(batch,)`. Serving it needs neither Keras nor
keras_duq. This example trains a small model, exports it, calls the export
from a fresh Python process that imports only TensorFlow, and writes the body
of a TF Serving REST request.

    python examples/serving.py            # under a minute on a CPU
    python examples/serving.py --quick    # a smoke run (KERAS_DUQ_SMOKE=1 too)

Needs TensorFlow for the SavedModel (`pip install "keras-duq[tensorflow]"`).
"""

# ----------------------------------------------------------------------
# Setup

import argparse
import json
import os
import subprocess
import sys

import keras
import numpy as np

import keras_duq

parser = argparse.ArgumentParser(description="Export a DUQ model for TF Serving.")
parser.add_argument("--output-dir", default=os.path.join("outputs", "serving"))
parser.add_argument(
    "--quick",
    action="store_true",
    default=os.environ.get("KERAS_DUQ_SMOKE") == "1",
    help="A smoke run: 1 epoch.",
)
args = parser.parse_args()
keras.utils.set_random_seed(0)

# ----------------------------------------------------------------------
# Train a small model
#
# Three Gaussian blobs in the plane, and a DUQ model on a small MLP. Any trained
# DUQ model exports the same way.

rng = np.random.default_rng(0)
centres = np.array([[0.0, 2.0], [-2.0, -1.0], [2.0, -1.0]], "float32")
y_train = rng.integers(0, 3, 3000)
x_train = (centres[y_train] + 0.4 * rng.normal(size=(3000, 2))).astype("float32")

backbone = keras.Sequential(
    [
        keras.Input((2,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(16),
    ]
)
model = keras_duq.wrap(backbone, num_classes=3, length_scale=0.3, gradient_penalty=0.5)
model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
model.fit(x_train, y_train, batch_size=64, epochs=1 if args.quick else 10, verbose=0)

# ----------------------------------------------------------------------
# Export
#
# TF Serving loads numbered versions of a model: `<model folder>/<version>/`.

export_dir = os.path.join(args.output_dir, "duq", "1")
model.export(export_dir)
print(f"exported to {export_dir}")

# ----------------------------------------------------------------------
# Load it with TensorFlow alone
#
# A fresh process that imports only TensorFlow (no Keras model code, no
# keras_duq) loads the SavedModel and calls its signature by input name
# (`inputs` for a single-input model).

x = np.array([[0.0, 2.0], [-2.0, -1.0], [10.0, 10.0]], "float32")  # the last: far away
SERVE = """
import json, sys
import tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
outputs = serve(inputs=tf.constant(json.loads(sys.argv[2]), tf.float32))
print(json.dumps({name: value.numpy().tolist() for name, value in outputs.items()}))
print(json.dumps(any(name.startswith("keras_duq") for name in sys.modules)))
"""
process = subprocess.run(
    [sys.executable, "-c", SERVE, export_dir, json.dumps(x.tolist())],
    capture_output=True,
    text=True,
    check=True,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
)
*_, output_line, imported_line = process.stdout.strip().splitlines()
served = json.loads(output_line)
keras_duq_imported = json.loads(imported_line)
for row, prediction, certainty in zip(
    x.tolist(), served["predictions"], served["certainty"]
):
    print(f"input {row}: class {prediction}, certainty {certainty:.4f}")
matches = np.allclose(served["kernel_values"], model.predict(x, verbose=0), atol=1e-5)
print(
    f"keras_duq imported by the server: {keras_duq_imported}; "
    f"same as predict: {matches}"
)

# ----------------------------------------------------------------------
# A TF Serving REST request
#
# Serve the folder with TF Serving's Docker image:
#
#     docker run -p 8501:8501 -v "$PWD/outputs/serving/duq:/models/duq" \
#         -e MODEL_NAME=duq tensorflow/serving
#
# and POST the body below to the `:predict` endpoint:
#
#     curl -X POST localhost:8501/v1/models/duq:predict -d @outputs/serving/request.json
#
# The answer holds one object per instance: {"predictions": [{"kernel_values":
# [...], "predictions": 0, "certainty": 0.93}, ...]}. Flag an input as out of
# distribution when its certainty is below a threshold chosen on held-out
# data (`keras_duq.evaluation.certainty_threshold`).

body = {"instances": x.tolist()}
request_path = os.path.join(args.output_dir, "request.json")
with open(request_path, "w") as file:
    json.dump(body, file)
print(f"wrote {request_path}: {json.dumps(body)}")

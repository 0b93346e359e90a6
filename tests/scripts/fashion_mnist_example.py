"""A short run of `reproduction.fashion_mnist`; says whether TensorFlow was imported.

    python fashion_mnist_example.py MNIST_DIR FASHION_MNIST_DIR OUTPUT_DIR

Run by `backend_subprocess.run(..., block_tensorflow=True)` under JAX: the
example's data pipeline and OoD callback must work without TensorFlow.
"""

import json
import sys

import numpy as np

import keras_duq
from reproduction import fashion_mnist

mnist_dir, fashion_mnist_dir, output_dir = sys.argv[1:4]
pipeline = type(keras_duq.datasets.make_dataset(np.zeros((4, 2)), batch_size=2))
results = fashion_mnist.main(
    ["--epochs", "2", "--batch-size", "64", "--train-subset", "256"]
    + ["--test-subset", "256", "--ood-eval-every", "1", "--verbose", "0"]
    + ["--mnist-path", mnist_dir, "--fashion-mnist-path", fashion_mnist_dir]
    + ["--output-dir", output_dir]
)
report = {
    "pipeline": pipeline.__name__,
    "history": results["history"],
    "accuracy": results["accuracy"],
    "auroc": results["auroc"],
    "tensorflow": any(m.split(".")[0] == "tensorflow" for m in sys.modules),
}
print(json.dumps(report))

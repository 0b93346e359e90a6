"""FashionMNIST through keras_duq's data pipeline and OoD callback; says whether
TensorFlow was imported.

    python fashion_mnist_example.py MNIST_DIR FASHION_MNIST_DIR OUTPUT_DIR

Run by `harness.run(..., block_tensorflow=True)` under JAX: the
loaders, `make_dataset` and `OODEvaluation` must work without TensorFlow.
"""

import json
import sys

import keras
import numpy as np

import keras_duq
from keras_duq import datasets
from keras_duq import evaluation

mnist_dir, fashion_mnist_dir, output_dir = sys.argv[1:4]
keras.utils.set_random_seed(0)
(x_train, y_train), (x_test, y_test) = datasets.load_fashion_mnist(fashion_mnist_dir)
x_ood, _ = datasets.load_mnist_test(mnist_dir)
x_train, x_test, x_ood = (datasets.normalize(x[:256]) for x in (x_train, x_test, x_ood))
y_train, y_test = y_train[:256], y_test[:256]
train = datasets.make_dataset(x_train, y_train, batch_size=64, shuffle=True, seed=0)
backbone = keras.Sequential(
    [
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="relu"),
    ]
)
model = keras_duq.wrap(backbone, num_classes=10)
model.compile(optimizer="adam")
history = model.fit(
    train,
    epochs=2,
    verbose=0,
    callbacks=[keras_duq.callbacks.OODEvaluation(x_test, x_ood, every_n_epochs=1)],
)
kernel_values = model.predict(x_test, verbose=0)
certainty = kernel_values.max(axis=1)
ood_certainty = model.predict(x_ood, verbose=0).max(axis=1)
report = {
    "pipeline": type(train).__name__,
    "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
    "accuracy": float(np.mean(kernel_values.argmax(axis=1) == y_test)),
    "auroc": float(evaluation.ood_metrics(certainty, ood_certainty)["auroc"]),
    "tensorflow": any(m.split(".")[0] == "tensorflow" for m in sys.modules),
}
print(json.dumps(report))

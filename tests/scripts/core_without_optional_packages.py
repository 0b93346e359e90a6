"""Imports keras_duq and trains with matplotlib and scikit-learn blocked.

    python core_without_optional_packages.py

Keras itself imports both when they are installed, so only importing them
fails here (PyTorch looks for them with `find_spec` without importing).
Prints the keras_duq modules imported.
"""

import importlib.abc
import importlib.util
import json
import sys


class Block(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("matplotlib", "sklearn"):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        raise ImportError(f"blocked: {spec.name}")

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, Block())

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_duq  # noqa: E402

model = keras_duq.wrap(
    keras.Sequential([keras.Input((2,)), keras.layers.Dense(4)]), num_classes=2
)
model.compile(optimizer="sgd")
x = np.random.default_rng(0).normal(size=(32, 2)).astype("float32")
model.fit(x, (x[:, 0] > 0).astype("int64"), epochs=1, verbose=0)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("keras_duq."))))

"""The health checks on JAX: the warnings `fit` and `evaluate` give, and BN re-estimation.

    python health_jax.py

Run under JAX. Prints the `DUQHealthWarning` classes seen, the
zero-input-gradient metric, and the mode gap after re-estimating the
BatchNormalization statistics.
"""

import json
import warnings

import keras
import numpy as np

import keras_duq
from keras_duq import _health

keras.utils.set_random_seed(0)
# Features that are all zero: no input gradient, centroids that cannot move.
inputs = keras.Input((4,))
x = keras.layers.Rescaling(0.0)(inputs)
outputs = keras_duq.DUQOutput(3, centroid_dims=6, momentum=0.9)(
    keras.layers.Dense(8, use_bias=False)(x)
)
model = keras_duq.DUQModel(inputs, outputs, gradient_penalty=0.5)
model.compile(optimizer="sgd")
rng = np.random.default_rng(0)
x = rng.normal(size=(400, 4)).astype("float32")
y = np.arange(400) % 3
# BatchNormalization whose moving statistics never saw the data.
inputs = keras.Input((4,))
features = keras.layers.Dense(8)(keras.layers.BatchNormalization()(inputs))
unsettled = keras_duq.DUQModel(
    inputs, keras_duq.DUQOutput(3, centroid_dims=6, length_scale=0.5)(features)
)
unsettled.compile(optimizer="sgd")
shifted = 5.0 + 10.0 * x
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0).history
    unsettled.evaluate(shifted, y, verbose=0)
names = keras_duq.recompute_batch_norm_statistics(unsettled, shifted, batch_size=400)
gap = _health.ModeComparison(unsettled, shifted, chunk_size=400).gap
report = {
    "warnings": sorted(
        {
            w.category.__name__
            for w in record
            if issubclass(w.category, keras_duq.DUQHealthWarning)
        }
    ),
    "gap_after_recompute": gap,
    "names": names,
    "zero_input_gradient": history["zero_input_gradient"],
}
print(json.dumps(report))

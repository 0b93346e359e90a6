"""Spectral normalisation on JAX: the norm bound, the transposed convolutions, training.

    python spectral_normalization_jax.py

Run under JAX (from the TensorFlow suite: the test module's helpers need
TensorFlow for their references). Prints `{"ok": true}` when every check holds.
"""

import json

import keras
import numpy as np
from test_spectral_normalization import _assert_transpose_is_adjoint
from test_spectral_normalization import _cnn_backbone
from test_spectral_normalization import _dense_model
from test_spectral_normalization import _images
from test_spectral_normalization import _np
from test_spectral_normalization import _operator_norm
from test_spectral_normalization import _train_calls
from test_spectral_normalization import _wrappers

import keras_duq

assert keras.backend.backend() == "jax"
normalized = keras_duq.spectral_normalize(
    _dense_model([10.0, 5.0, 2.0]), coefficient=2.0, power_iterations=20
)
_train_calls(normalized, (6,), 1)
assert 1.9 <= _operator_norm(normalized, (6,)) <= 2.1

# The configurations where the transpose's output size needs care.
for name in [
    "conv1d_causal_dilated",
    "conv2d_channels_first",
    "conv2d_strided_odd",
    "depthwise_strided",
]:
    _assert_transpose_is_adjoint(name)

keras.utils.set_random_seed(0)
backbone = keras_duq.spectral_normalize(_cnn_backbone(), coefficient=1.0)
model = keras_duq.wrap(backbone, num_classes=2, length_scale=0.5, gradient_penalty=0.5)
model.compile(optimizer=keras.optimizers.SGD(0.05))
x, y = _images(16)
initial = [_np(w.vector_u).copy() for w in _wrappers(backbone)]
history = model.fit(x, y, batch_size=8, verbose=0)
assert np.isfinite(history.history["loss"][-1])
vectors = [_np(w.vector_u).copy() for w in _wrappers(backbone)]
assert not any(np.array_equal(a, b) for a, b in zip(initial, vectors))
try:
    model.fit(x * 1e30, y, batch_size=16, verbose=0)
    raise AssertionError("the overflowing batch was accepted")
except ValueError as error:
    assert "non-finite" in str(error), error
for before, wrapper in zip(vectors, _wrappers(backbone)):
    np.testing.assert_array_equal(before, _np(wrapper.vector_u))
print(json.dumps({"ok": True}))

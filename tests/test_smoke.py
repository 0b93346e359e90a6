"""The end-to-end path a user meets first: wrap, fit with the penalty, save, load, export.

CI also runs this file alone on the lowest TensorFlow and Keras versions that
pyproject.toml declares (see `.ci/run`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_duq

# Export to a SavedModel and the lowest supported TensorFlow: TensorFlow only.
pytestmark = pytest.mark.requires_backend("tensorflow")


def test_wrap_fit_save_load_export(tmp_path):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8, 8, 1)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0).astype("int64")
    backbone = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.GlobalAveragePooling2D(),
        ]
    )
    model = keras_duq.wrap(
        backbone, num_classes=2, length_scale=0.5, gradient_penalty=0.5
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    centroids_before = model.duq_output.centroids.numpy()
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert {"loss", "bce", "gradient_penalty", "accuracy"} <= set(history.history)
    assert not np.allclose(model.duq_output.centroids.numpy(), centroids_before)

    expected = model.predict(x[:8], verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    reloaded = keras.saving.load_model(path)
    np.testing.assert_allclose(reloaded.predict(x[:8], verbose=0), expected, rtol=1e-6)
    reloaded.fit(x, y, batch_size=32, epochs=1, verbose=0)  # trains on after loading

    export_dir = str(tmp_path / "savedmodel")
    model.export(export_dir)
    served = tf.saved_model.load(export_dir).signatures["serving_default"](
        inputs=tf.constant(x[:8])
    )
    np.testing.assert_allclose(served["kernel_values"].numpy(), expected, rtol=1e-6)
    np.testing.assert_array_equal(
        served["predictions"].numpy(), expected.argmax(axis=1)
    )

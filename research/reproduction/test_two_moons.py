"""The two-moons demo (research/reproduction/two_moons.py) learns, and the penalty matters.

Single-seed results depend on the CPU: oneDNN's rounding differs between
machines, and 700 SGD steps amplify it (see docs/two_moons.md). So the tests
assert statistics over seeds, with margins measured on three numerics (oneDNN
on and off on an Intel Xeon, oneDNN on on an AMD EPYC): the seed tables are in
the docs; the sweep is `python -m research.reproduction.two_moons --seeds $(seq 0 19)`.
"""

from pathlib import Path

import keras
import numpy as np
import pytest

from research.reproduction import two_moons

# The reproduction harness runs on TensorFlow.
pytestmark = pytest.mark.requires_backend("tensorflow")

SEEDS = range(5)  # the first five; not chosen by their results


def test_far_points_are_far_from_training_data():
    (x_train, _), _, x_far = two_moons.make_data(seed=0)
    distances = np.linalg.norm(x_far[:, None, :] - x_train[None, :, :], axis=-1)
    assert distances.min() > 1.0
    assert len(x_far) > 1000


@pytest.mark.slow
def test_demo_meets_its_bar_on_most_seeds():
    # The default (spectrally normalised residual) backbone; medians over 5
    # seeds pass when at least 3 seeds do. Measured on seeds 0-4 (oneDNN on
    # and off): accuracy 0.986-1.000, far certainty 0.0008-0.0046.
    results = [two_moons.run(seed) for seed in SEEDS]
    far = [result["far_certainty_mean"] for result in results]
    assert np.median([r["test_accuracy"] for r in results]) >= 0.98, results
    assert np.median(far) <= 0.05, far
    assert np.median([r["auroc_test_vs_far"] for r in results]) >= 0.99, results


@pytest.mark.slow
def test_paper_backbone_needs_the_penalty():
    # The paper's Figure 1 against Figure 3, on the paper's MLP. With the
    # penalty, seed 3 misses the bar on every CPU measured and seed 0 on
    # some (far certainty 0.131 on an AMD EPYC, 0.062 with oneDNN off here).
    with_penalty = [two_moons.run(seed, backbone="paper") for seed in SEEDS]
    far = [result["far_certainty_mean"] for result in with_penalty]
    assert np.median([r["test_accuracy"] for r in with_penalty]) >= 0.98, with_penalty
    assert np.median(far) <= 0.05, far
    assert np.median([r["auroc_test_vs_far"] for r in with_penalty]) >= 0.99, (
        with_penalty
    )
    # Without the penalty the far certainty comes out clearly higher
    # (measured mean over these seeds: 0.16 without, 0.05-0.075 with).
    without = [
        two_moons.run(seed, gradient_penalty=0.0, backbone="paper") for seed in SEEDS
    ]
    far_without = [result["far_certainty_mean"] for result in without]
    assert np.mean(far_without) > 1.5 * np.mean(far), (far, far_without)


def test_demo_writes_certainty_map(tmp_path):
    result = two_moons.run(0, epochs=1, output_dir=str(tmp_path))
    assert Path(result["figure"]).stat().st_size > 10_000


def test_spectral_normalized_dense_caps_the_spectral_norm():
    rng = np.random.default_rng(0)
    layer = two_moons.SpectralNormalizedDense(8, coefficient=3.0)
    inputs = rng.normal(size=(4, 5)).astype("float32")
    layer(inputs)
    kernel = rng.normal(size=(5, 8)).astype("float32") * 10.0  # norm about 50
    layer.kernel.assign(kernel)
    for _ in range(50):  # one power iteration per training call
        layer(inputs, training=True)
    identity = np.eye(5, dtype="float32")
    effective = keras.ops.convert_to_numpy(layer(identity) - layer.bias)
    assert np.linalg.norm(effective, ord=2) == pytest.approx(3.0, rel=1e-3)
    small = kernel / 100.0  # norm below the cap: left as it is
    layer.kernel.assign(small)
    for _ in range(50):
        layer(inputs, training=True)
    effective = keras.ops.convert_to_numpy(layer(identity) - layer.bias)
    np.testing.assert_allclose(effective, small, rtol=1e-5)


def test_residual_sn_backbone_trains_saves_and_loads(tmp_path):
    result = two_moons.run(0, epochs=1, backbone="residual_sn")
    assert (
        result["backbone"] == "residual_sn"
        and 0.0 <= result["far_certainty_mean"] <= 1.0
    )
    model = two_moons.build_model(backbone="residual_sn")
    (x, y), _, _ = two_moons.make_data(seed=0)
    model.fit(x[:128], y[:128], batch_size=64, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    import keras

    restored = keras.models.load_model(path)
    np.testing.assert_allclose(
        restored.predict(x[:16], verbose=0), model.predict(x[:16], verbose=0), rtol=1e-5
    )

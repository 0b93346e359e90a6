"""Smoke test of research/reproduction/fashion_mnist.py on a real FashionMNIST subset.

Trains DUQ for a few epochs on 3,000 real training images and checks that it
learns to classify and to tell FashionMNIST from MNIST. The thresholds sit
well below what was measured over seeds 0, 1 and 2 (see the test), and well
above chance (accuracy 0.1, AUROC 0.5).
"""

import json

import keras
import numpy as np
import pytest

from research.reproduction import fashion_mnist

# The reproduction harness feeds data through tf.data.
pytestmark = pytest.mark.requires_backend("tensorflow")


@pytest.mark.slow
def test_duq_smoke_run_learns(tmp_path, mnist_dir, fashion_mnist_dir):
    results = fashion_mnist.main(
        [
            "--model",
            "duq",
            "--epochs",
            "3",
            "--batch-size",
            "32",
            "--train-subset",
            "3000",
            "--test-subset",
            "2000",
            "--seed",
            "0",
            "--ood-eval-every",
            "0",
            "--mnist-path",
            str(mnist_dir),
            "--fashion-mnist-path",
            str(fashion_mnist_dir),
            "--output-dir",
            str(tmp_path),
            "--verbose",
            "0",
        ]
    )
    # 282 steps (batch 32). With batch 64 (141 steps) the AUROC was volatile:
    # 0.74-0.98 over seeds 0-2 and repeated runs, and 0.600 for seed 0 once
    # `--seed` fixed the backbone's initial weights (seed 1: 0.885). With
    # batch 32, measured: seed 0 accuracy 0.781 / AUROC 0.914, seed 2 0.783 /
    # 0.740 (145 s each, two runs sharing 2 CPU cores). The
    # thresholds fail a model that learned nothing (0.1 / 0.5) or whose
    # certainty has the wrong sign (AUROC 1 - 0.74 = 0.26 or lower).
    assert results["accuracy"] >= 0.6
    assert results["auroc"] >= 0.6
    assert results["num_train"] == 3000 and results["steps_per_epoch"] == 94

    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["auroc"] == pytest.approx(results["auroc"])
    assert saved["settings"]["gradient_penalty"] == 0.05
    for name in ("roc_curve.png", "rejection_curve.png", "certainty_histograms.png"):
        assert (tmp_path / name).stat().st_size > 1000, name


@pytest.mark.slow
def test_backup_dir_resumes_from_the_last_finished_epoch(
    tmp_path, mnist_dir, fashion_mnist_dir
):

    def run(epochs):
        return fashion_mnist.main(
            [
                "--model",
                "duq",
                "--epochs",
                str(epochs),
                "--batch-size",
                "64",
                "--train-subset",
                "256",
                "--test-subset",
                "256",
                "--seed",
                "0",
                "--ood-eval-every",
                "0",
                "--verbose",
                "0",
                "--mnist-path",
                str(mnist_dir),
                "--fashion-mnist-path",
                str(fashion_mnist_dir),
                "--output-dir",
                str(tmp_path / "out"),
                "--backup-dir",
                str(tmp_path / "backup"),
            ]
        )

    first = run(1)
    log = tmp_path / "backup" / "member_0" / "epochs.jsonl"
    (epoch_1,) = [json.loads(line) for line in log.read_text().splitlines()]
    second = run(2)  # resumes: trains epoch 2 only
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    assert records[0] == epoch_1  # not trained again
    assert second["history"]["loss"][0] == pytest.approx(first["history"]["loss"][0])
    assert len(second["history"]["loss"]) == 2
    assert second["train_time_s"] == pytest.approx(sum(r["seconds"] for r in records))


def test_softmax_model_matches_the_paper():
    args = fashion_mnist.parse_args(["--model", "softmax"])
    model = fashion_mnist.build_softmax_model(args, steps_per_epoch=4)
    assert model.output_shape == (None, 10)
    # The paper's CNN: 28 -> 14 -> 7 -> 5 (unpadded) -> 2, then 256 features.
    backbone = model.layers[0]
    assert backbone.output_shape == (None, 256)
    assert backbone.layers[-2].input.shape == (None, 2, 2, 128)
    # L2(5e-5) on every weight, the coupled decay 1e-4 of DUQ.
    assert len(model.losses) == len(model.trainable_weights)


def test_learning_rate_schedule():
    schedule = fashion_mnist.learning_rate_schedule(steps_per_epoch=4, epochs=30)
    # Step 39 is the last of epoch 10 (1-based), step 40 the first of epoch 11.
    rates = [float(schedule(step)) for step in (0, 39, 40, 79, 80, 119)]
    assert rates == pytest.approx([0.05, 0.05, 0.01, 0.01, 0.002, 0.002])
    assert fashion_mnist.learning_rate_schedule(steps_per_epoch=4, epochs=3) == 0.05


def test_duq_model_settings():
    args = fashion_mnist.parse_args([])
    model = fashion_mnist.build_duq_model(args, steps_per_epoch=4)
    assert model.gradient_penalty == 0.05
    assert model.weight_decay == 1e-4
    assert model.duq_output.length_scale == 0.1
    assert model.duq_output.momentum == 0.999
    assert model.duq_output.kernel.shape == (256, 256 * 10)
    assert model.duq_output.kernel_initializer.get_config()["stddev"] == 0.05
    assert model.bce_epsilon == 0.0
    assert (
        fashion_mnist.build_duq_model(
            fashion_mnist.parse_args(["--bce-epsilon", "1e-12"]), steps_per_epoch=4
        ).bce_epsilon
        == 1e-12
    )


def test_mixed_precision_policy_applies_to_the_backbone_only():
    assert (
        fashion_mnist.parse_args(["--mixed-precision"]).mixed_precision
        == "mixed_float16"
    )
    args = fashion_mnist.parse_args(["--mixed-precision", "mixed_bfloat16"])
    try:
        model = fashion_mnist.build_model(args, steps_per_epoch=4, seed=0)
        convolution = next(
            layer
            for layer in model._flatten_layers()
            if isinstance(layer, keras.layers.Conv2D)
        )
        assert convolution.compute_dtype == "bfloat16"
        assert model.duq_output.compute_dtype == "float32"
        assert (
            model.predict(np.zeros((2, 28, 28, 1), "float32"), verbose=0).dtype
            == "float32"
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_seed_fixes_the_initial_weights():
    # The backbone's initializers must draw their seeds after
    # `set_random_seed`, or `--seed` would not fix the initial weights.
    import keras

    def initial_weights(seed):
        keras.utils.set_random_seed(seed)
        return [w.numpy() for w in fashion_mnist.build_backbone().weights]

    first, other, again = initial_weights(0), initial_weights(1), initial_weights(0)
    for a, b, c in zip(first, other, again):
        np.testing.assert_array_equal(a, c)
    kernels = [i for i, w in enumerate(first) if w.ndim > 1]
    assert all(not np.array_equal(first[i], other[i]) for i in kernels)


def test_ensemble_member_is_the_softmax_run_of_its_seed():
    # So a member can be trained on its own (`--model softmax --seed 0+i`)
    # and its state dropped into the ensemble's `member_i` backup.
    ensemble = fashion_mnist.parse_args(["--model", "ensemble"])
    fashion_mnist.build_model(ensemble, steps_per_epoch=4, seed=0)  # member 0
    member_1 = fashion_mnist.build_model(ensemble, steps_per_epoch=4, seed=1).weights
    member_1 = [w.numpy() for w in member_1]
    softmax = fashion_mnist.parse_args(["--model", "softmax"])
    alone = fashion_mnist.build_model(softmax, steps_per_epoch=4, seed=1).weights
    assert len(member_1) == len(alone)
    for a, b in zip(member_1, alone):
        np.testing.assert_array_equal(a, b)

"""research/reproduction/cifar10.py: the paper's ResNet-18, the data pipeline, a smoke run.

No CIFAR-10 or SVHN here: the pipeline and the end-to-end run use
`tfds.testing.mock_data`, which makes tfds serve random images with the
datasets' real shapes and dtypes (the same images for every split and for
both datasets) and turns `download_and_prepare` into a no-op.
"""

import itertools
import json
import socket

import numpy as np
import pytest
import tensorflow as tf

tfds = pytest.importorskip("tensorflow_datasets")

from research.reproduction import cifar10  # noqa: E402

# The reproduction harness feeds data through tf.data.
pytestmark = pytest.mark.requires_backend("tensorflow")

RESULT_KEYS = (
    "accuracy",
    "auroc",
    "aupr",
    "fpr_at_95_tpr",
    "misclassification_auroc",
    "validation_accuracy",
    "validation_misclassification_auroc",
    "model",
    "recipe",
    "seed",
    "epochs",
    "num_train",
    "num_validation",
    "num_test",
    "num_ood",
    "normalization",
    "settings",
    "history",
    "rejection_curve",
    "figures",
)


@pytest.fixture
def no_network(monkeypatch):
    """Fails any attempt to open a network connection."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _weights(weights):
    return sum(int(np.prod(w.shape)) for w in weights)


def test_backbone_has_the_papers_resnet18_size():
    # torchvision's ResNet-18 has 11,689,512 parameters. Without its last
    # linear layer (512 x 1000 + 1000 = 513,000) and with the paper's 3 x 3
    # first convolution (1,728 weights instead of 7 x 7's 9,408) that leaves
    # 11,168,832: every convolution kernel (no biases) and every
    # BatchNormalization scale and offset. Keras also counts BatchNorm's
    # moving mean and variance as (non-trainable) weights, which PyTorch
    # keeps as buffers: 2 x 4,800 channels.
    backbone = cifar10.build_resnet18()
    assert _weights(backbone.trainable_weights) == 11_168_832
    assert _weights(backbone.non_trainable_weights) == 9_600
    assert backbone.count_params() == 11_178_432
    assert tuple(backbone.output.shape) == (None, 512)
    assert tuple(backbone.input.shape) == (None, 32, 32, 3)

    # The paper's code keeps the last linear layer as 512 x 512 (+ bias).
    with_layer = cifar10.build_resnet18(feature_layer=True)
    assert _weights(with_layer.trainable_weights) == 11_168_832 + 512 * 512 + 512


def test_recipes_fill_the_unset_flags():
    paper = cifar10.parse_args([])
    assert (paper.recipe, paper.model, paper.epochs) == ("paper", "duq", 75)
    assert paper.gradient_penalty == 0.5 and paper.weight_decay == 1e-4
    assert paper.lr_milestones == [25, 50] and paper.lr_decay == 0.2
    assert paper.batch_size == 128 and paper.learning_rate == 0.05
    assert paper.centroid_dims == 512 and paper.length_scale == 0.1
    assert paper.centroid_momentum == 0.999 and paper.validation_split == 10000
    assert not paper.feature_layer and paper.initial_centroid_count is None
    assert paper.initial_centroid_stddev == 0.05

    code = cifar10.parse_args(["--recipe", "paper_code"])
    assert code.epochs == 100 and code.gradient_penalty == 0.75
    assert code.weight_decay == 5e-4 and code.lr_milestones == [25, 50, 75]
    assert code.feature_layer and code.kernel_initializer == "reference"
    assert code.initial_centroid_count == 13.0

    # Flags override the recipe; the code's baselines follow its ensemble script.
    override = cifar10.parse_args(
        ["--recipe", "paper_code", "--epochs", "3", "--gradient-penalty", "0"]
    )
    assert override.epochs == 3 and override.gradient_penalty == 0.0
    softmax = cifar10.parse_args(["--recipe", "paper_code", "--model", "softmax"])
    assert softmax.epochs == 75 and softmax.lr_decay == 0.1
    assert softmax.weight_decay == 5e-4 and softmax.gradient_penalty is None
    with pytest.raises(SystemExit):
        cifar10.parse_args(["--model", "softmax", "--gradient-penalty", "0.5"])
    with pytest.raises(SystemExit):
        cifar10.parse_args(["--recipe", "paper_code", "--bias-correction"])
    assert cifar10.parse_args(["--mixed-precision"]).mixed_precision == "mixed_float16"
    stats = cifar10.parse_args(["--normalization-stats", "0.1,0.2,0.3,0.4,0.5,0.6"])
    assert stats.normalization_stats == {
        "mean": [0.1, 0.2, 0.3],
        "std": [0.4, 0.5, 0.6],
    }


def test_learning_rate_schedule_drops_at_the_milestones():
    args = cifar10.parse_args([])
    schedule = cifar10.learning_rate_schedule(args, steps_per_epoch=10)
    # Epoch 25 (0-based) starts at step 250.
    rates = [float(schedule(step)) for step in (0, 249, 250, 499, 500, 749)]
    np.testing.assert_allclose(rates, [0.05, 0.05, 0.01, 0.01, 0.002, 0.002])


def test_paper_code_recipe_initialises_duq_as_the_code():
    args = cifar10.parse_args(["--recipe", "paper_code"])
    model = cifar10.build_model(args, steps_per_epoch=10, seed=0)
    head = model.duq_output
    np.testing.assert_array_equal(head.centroid_counts.numpy(), np.full(10, 13.0))
    centroids = np.asarray(head.centroids)
    assert centroids.shape == (512, 10)
    assert 0.045 < centroids.std() < 0.055
    # Kaiming normal over a fan-in of classes x features (10 x 512).
    assert np.asarray(head.kernel).std() == pytest.approx(np.sqrt(2 / 5120), rel=0.05)
    assert model.feature_extractor.get_layer("resnet18").get_layer("fc")


def test_paper_recipe_draws_centroids_as_appendix_a():
    # "we initialise the centroids using draws from N(0, 0.05 I_n)"; the
    # count keeps keras_duq's 12, which the paper does not specify.
    model = cifar10.build_model(cifar10.parse_args([]), steps_per_epoch=10, seed=0)
    head = model.duq_output
    np.testing.assert_array_equal(head.centroid_counts.numpy(), np.full(10, 12.0))
    assert 0.045 < np.asarray(head.centroids).std() < 0.055
    backbone = model.feature_extractor.get_layer("resnet18")
    assert "fc" not in [layer.name for layer in backbone.layers]


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_augmentation_keeps_shape_and_dtype_and_crops_the_padded_image(dtype):
    rng = np.random.default_rng(0)
    # No zero pixels in the image, so the padding is recognisable.
    image = rng.integers(1, 256, size=(32, 32, 3)).astype(dtype)
    padded = np.pad(image, ((4, 4), (4, 4), (0, 0)))
    windows = [
        padded[dy : dy + 32, dx : dx + 32]
        for dy, dx in itertools.product(range(9), repeat=2)
    ]
    windows += [window[:, ::-1] for window in windows]
    outputs = []
    for seed in range(16):
        out = cifar10.augment(tf.constant(image), tf.constant([seed, 7], tf.int64))
        assert out.shape == (32, 32, 3) and out.dtype == tf.as_dtype(dtype)
        out = out.numpy()
        assert any(np.array_equal(out, w) for w in windows), seed
        outputs.append(out)
    assert len({o.tobytes() for o in outputs}) > 8  # the crops and flips vary
    # Stateless: the same seed gives the same image.
    again = cifar10.augment(tf.constant(image), tf.constant([3, 7], tf.int64))
    np.testing.assert_array_equal(again.numpy(), outputs[3])


def _images(dataset):
    return np.concatenate([x for x, _ in dataset.as_numpy_iterator()])


def test_pipeline_augments_training_data_only(tmp_path, no_network):
    args = cifar10.parse_args(
        [
            "--validation-split",
            "8",
            "--test-subset",
            "16",
            "--data-dir",
            str(tmp_path / "tfds"),
        ]
    )
    with tfds.testing.mock_data(num_examples=40):
        train, num_train, normalization, evaluation = cifar10.load_data(args)
        raw = np.stack([image for image, _ in train.as_numpy_iterator()])
        validation = _images(evaluation["validation"])
        assert num_train == 32 and len(raw) == 32 and len(validation) == 8

        # Normalisation statistics: those of the training images only.
        pixels = raw.astype("float64") / 255.0
        np.testing.assert_allclose(normalization["mean"], pixels.mean((0, 1, 2)))
        np.testing.assert_allclose(normalization["std"], pixels.std((0, 1, 2)))
        expected = (pixels - normalization["mean"]) / normalization["std"]
        expected = {np.round(x, 4).tobytes() for x in expected.astype("float32")}

        def batch(augmentation):
            dataset = cifar10.make_training_dataset(
                train,
                normalization,
                batch_size=32,
                seed=0,
                num_examples=num_train,
                augmentation=augmentation,
            )
            assert dataset.element_spec[0].shape.as_list() == [32, 32, 32, 3]
            images, labels = next(iter(dataset))
            assert images.dtype == tf.float32 and labels.dtype == tf.int32
            return {np.round(x, 4).tobytes() for x in images.numpy()}

        # Training batches: without augmentation a permutation of the
        # normalised training images; with it, mostly other images.
        assert batch(augmentation=False) == expected
        assert len(batch(augmentation=True) - expected) > 16

        # Evaluation data: normalised, never augmented, the same every pass.
        test = evaluation["test"]
        first, second = _images(test), _images(test)
        np.testing.assert_array_equal(first, second)
        raw_test = np.stack(
            [
                image
                for image, _ in cifar10.load_split("cifar10", "test", args)
                .take(16)
                .as_numpy_iterator()
            ]
        )
        np.testing.assert_allclose(
            first,
            (raw_test / 255.0 - normalization["mean"]) / normalization["std"],
            rtol=1e-5,
            atol=1e-5,
        )
        assert evaluation["ood"].element_spec[0].shape.as_list() == [None, 32, 32, 3]


def test_validation_split_is_random_disjoint_and_seeded():
    images = np.arange(20, dtype="uint8").reshape(20, 1, 1, 1) * np.ones(
        (1, 32, 32, 3), "uint8"
    )
    data = tf.data.Dataset.from_tensor_slices((images, np.zeros(20, "int64")))

    def ids(dataset):
        return sorted(int(x[0, 0, 0]) for x, _ in dataset.as_numpy_iterator())

    train, validation, num_train = cifar10.split_validation(data, 5, seed=0)
    assert num_train == 15 and int(train.cardinality()) == 15
    assert sorted(ids(train) + ids(validation)) == list(range(20))
    assert ids(validation) != list(range(15, 20))  # not just the last ones
    assert ids(cifar10.split_validation(data, 5, seed=0)[1]) == ids(validation)
    assert ids(cifar10.split_validation(data, 5, seed=1)[1]) != ids(validation)
    assert cifar10.split_validation(data, 0, seed=0)[1] is None
    with pytest.raises(ValueError, match="validation-split"):
        cifar10.split_validation(data, 20, seed=0)


def test_missing_data_names_the_way_to_prepare_it(tmp_path, no_network):
    args = cifar10.parse_args(["--data-dir", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="download_and_prepare"):
        cifar10.load_split("cifar10", "train", args)


@pytest.mark.slow
def test_end_to_end_under_mock_data(tmp_path, no_network):
    # DUQ with the paper's lambda 0.5 (the slowest model): 2 steps of 16
    # images, 32 test, 32 SVHN and 32 validation images. About 40 s on 2
    # shared CPU cores, mostly tracing the ResNet-18 with double backprop.
    output = tmp_path / "out"
    with tfds.testing.mock_data(num_examples=96):
        results = cifar10.main(
            [
                "--epochs",
                "1",
                "--max-steps-per-epoch",
                "2",
                "--batch-size",
                "16",
                "--test-subset",
                "32",
                "--validation-split",
                "32",
                "--data-dir",
                str(tmp_path / "tfds"),
                "--output-dir",
                str(output),
                "--verbose",
                "0",
            ]
        )
    saved = json.loads((output / "results.json").read_text())
    for key in RESULT_KEYS:
        assert key in saved, key
    assert saved["model"] == "duq" and saved["settings"]["gradient_penalty"] == 0.5
    assert saved["num_train"] == 64 and saved["num_validation"] == 32
    assert saved["num_test"] == 32 and saved["num_ood"] == 32
    assert saved["steps_per_epoch"] == 2
    assert 0.0 <= saved["accuracy"] <= 1.0 and 0.0 <= saved["auroc"] <= 1.0
    assert saved["auroc"] == pytest.approx(results["auroc"])
    assert len(saved["history"]["loss"]) == 1
    for name in ("certainty_histograms.png", "rejection_curve.png", "roc_curve.png"):
        assert (output / name).stat().st_size > 1000, name


@pytest.mark.slow
def test_ensemble_with_backup_under_mock_data(tmp_path, no_network):
    # Two softmax members of the paper code's baseline, one step each, no
    # validation split: the ensemble's averaged probabilities, the softmax
    # certainty and the per-member backups.
    output, backup = tmp_path / "out", tmp_path / "backup"
    with tfds.testing.mock_data(num_examples=32):
        results = cifar10.main(
            [
                "--model",
                "ensemble",
                "--ensemble-size",
                "2",
                "--recipe",
                "paper_code",
                "--epochs",
                "1",
                "--max-steps-per-epoch",
                "1",
                "--batch-size",
                "8",
                "--test-subset",
                "16",
                "--validation-split",
                "0",
                "--ood-eval-every",
                "0",
                "--data-dir",
                str(tmp_path / "tfds"),
                "--output-dir",
                str(output),
                "--backup-dir",
                str(backup),
                "--verbose",
                "0",
            ]
        )
    saved = json.loads((output / "results.json").read_text())
    assert saved["model"] == "ensemble"
    assert saved["certainty_method"] == "negative_entropy"
    assert saved["num_train"] == 32 and "validation_accuracy" not in saved
    assert len(saved["history"]) == 2 and "auroc_max_probability" in saved
    assert saved["settings"]["weight_decay"] == 5e-4
    assert results["accuracy"] == pytest.approx(saved["accuracy"])
    for member in ("member_0", "member_1"):
        lines = (backup / member / "epochs.jsonl").read_text().splitlines()
        assert len(lines) == 1 and json.loads(lines[0])["epoch"] == 1

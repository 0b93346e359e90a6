"""`python -m research.benchmarks --quick` measures and prints the speed table.

On the TensorFlow backend only, the two-moons network only: a smoke run.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about 20 s: a subprocess trains each model
@pytest.mark.requires_backend("tensorflow")  # its subprocess runs TensorFlow
def test_quick_run_prints_the_table_and_writes_json(tmp_path):
    output = tmp_path / "speed.json"
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "research.benchmarks",
            "--quick",
            "--backends",
            "tensorflow",
            "--networks",
            "two_moons_mlp",
            "--output",
            str(output),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert process.returncode == 0, process.stderr[-2000:]
    lines = process.stdout.splitlines()
    rows = [line for line in lines if line.startswith("tensorflow  two_moons_mlp")]
    # Three training steps and two inference batches, softmax first in each.
    assert len(rows) == 5, process.stdout
    assert rows[0].endswith(" 1.00") and rows[3].endswith(" 1.00"), process.stdout
    report = json.loads(output.read_text())["tensorflow"]
    result = report["networks"]["two_moons_mlp"]
    assert set(result["train_ms"]) == {"softmax", "duq", "duq_penalty"}
    assert set(result["predict_ms"]) == {"softmax", "duq"}
    assert all(value > 0 for value in result["train_ms"].values())
    assert report["machine"]["backend"] == "tensorflow"


def test_a_missing_backend_is_skipped_with_the_reason():
    from research.benchmarks.__main__ import table

    text = table({"torch": {"skipped": "not installed (`pip install torch`)"}})
    assert "torch skipped: not installed" in text


@pytest.mark.requires_backend("tensorflow")
def test_every_own_model_backbone_can_be_wrapped():
    """Each backbone the own-model benchmark names maps FashionMNIST-shaped
    images to `(batch, features)` that `keras_duq.wrap` accepts."""
    import keras_duq
    from research.benchmarks.own_model_defaults import BACKBONES

    images = np.zeros((2, 28, 28, 1), "float32")
    for name, build in BACKBONES.items():
        kernel_values = keras_duq.wrap(build(), 10)(images)
        assert tuple(kernel_values.shape) == (2, 10), name


def test_own_model_initial_centroids_are_redrawn_at_the_asked_spread():
    import keras

    import keras_duq
    from research.benchmarks.own_model_defaults import BACKBONES
    from research.reproduction._harness import set_initial_centroids

    model = keras_duq.wrap(BACKBONES["mlp"](), 10)
    counts = keras.ops.convert_to_numpy(model.duq_output.centroid_counts)
    set_initial_centroids(model.duq_output, 0.05, seed=0)
    centroids = keras.ops.convert_to_numpy(model.duq_output.centroids)
    # 128 x 10 draws: the sample spread is within a few percent of 0.05.
    assert abs(centroids.std() - 0.05) < 0.005
    # The counts, and so the weight of this prior, are unchanged.
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(model.duq_output.centroid_counts), counts
    )


def _settings(rate, weight=0.0):
    """The settings cell of a DUQ row of the own-model summary."""
    return (
        f'{{"categorical_cross_entropy_weight": {weight}, '
        f'"projection_learning_rate": {rate}}}'
    )


def _summary_rows(tmp_path, records, at_epochs=(1,)):
    """The own-model summary's lines for these records, written as a JSONL file."""
    from research.benchmarks.own_model_defaults import summarize

    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return summarize(path, at_epochs=at_epochs).splitlines()


def test_own_model_summary_averages_each_setup_over_its_seeds(tmp_path):
    def record(seed, head, aurocs):
        epochs = [
            {"epoch": epoch, "accuracy": 0.5 + 0.1 * seed, "auroc": auroc}
            for epoch, auroc in enumerate(aurocs, start=1)
        ]
        return {
            "backbone": "mlp",
            "head": head,
            "wrap_kwargs": {},
            "seed": seed,
            "epochs": epochs,
        }

    records = [record(1, "duq", [0.8, 0.9]), record(0, "duq", [0.6, 0.7])]
    records.append(record(0, "softmax", [0.5]))
    rows = _summary_rows(tmp_path, records, at_epochs=(1, 2))
    assert len(rows) == 4  # header, rule, one row per setup
    # Seeds in order, mean accuracy, AUROC per seed and its mean, per epoch.
    assert rows[2] == (
        f"| mlp | duq | {_settings(1.0)} | 0, 1 | 0.550 | 0.600, 0.800 |"
        " 0.700 |"
        " 0.550 | 0.700, 0.900 | 0.800 |"
    )
    # A setup that stopped before an epoch leaves that epoch's cells empty.
    assert rows[3] == "| mlp | softmax |  | 0 | 0.500 | 0.500 | 0.500 | | | |"


def _duq_record(seed, **fields):
    """An own-model record of one epoch of `mlp` with DUQ's head."""
    epochs = [{"epoch": 1, "accuracy": 0.5, "auroc": 0.6 + 0.1 * seed}]
    return dict(
        backbone="mlp", head="duq", wrap_kwargs={}, seed=seed, epochs=epochs, **fields
    )


def test_own_model_summary_groups_runs_by_the_rate_at_which_w_learned(tmp_path):
    # The layer at 0.1; the layer at 1.0 with the optimizer's step for W
    # scaled by 0.1 (a record that does not name the layer's rate); and the
    # layer at 1.0.
    records = [
        _duq_record(0, head_projection_learning_rate=0.1, projection_learning_rate=1.0),
        _duq_record(1, projection_learning_rate=0.1),
        _duq_record(2, head_projection_learning_rate=1.0, projection_learning_rate=1.0),
    ]
    rows = _summary_rows(tmp_path, records)
    assert rows[2:] == [
        f"| mlp | duq | {_settings(0.1)} | 0, 1 | 0.500 | 0.600, 0.700 | 0.650 |",
        f"| mlp | duq | {_settings(1.0)} | 2 | 0.500 | 0.800 | 0.800 |",
    ]


def test_own_model_summary_groups_runs_by_the_categorical_weight(tmp_path):
    # A record that does not name the weight was made when the default was 0.
    records = [
        _duq_record(0, head_projection_learning_rate=0.1),
        _duq_record(
            1, head_projection_learning_rate=0.1, categorical_cross_entropy_weight=0.0
        ),
        _duq_record(
            2, head_projection_learning_rate=0.1, categorical_cross_entropy_weight=3.0
        ),
    ]
    rows = _summary_rows(tmp_path, records)
    assert rows[2:] == [
        f"| mlp | duq | {_settings(0.1)} | 0, 1 | 0.500 | 0.600, 0.700 | 0.650 |",
        f"| mlp | duq | {_settings(0.1, 3.0)} | 2 | 0.500 | 0.800 | 0.800 |",
    ]


def test_own_model_summary_gives_re_estimated_statistics_a_row_of_their_own(tmp_path):
    epochs = [
        {
            "epoch": 1,
            "accuracy": 0.6,
            "auroc": 0.7,
            "accuracy_recomputed": 0.9,
            "auroc_recomputed": 0.8,
        }
    ]
    record = {
        "backbone": "batchnorm",
        "head": "duq",
        "wrap_kwargs": {},
        "seed": 0,
        "recompute_batch_norm": True,
        "epochs": epochs,
    }
    rows = _summary_rows(tmp_path, [record])
    assert rows[2:] == [
        f"| batchnorm | duq | {_settings(1.0)} | 0 | 0.600 | 0.700 | 0.700 |",
        f"| batchnorm | duq, BN re-estimated | {_settings(1.0)} | 0 |"
        " 0.900 | 0.800 | 0.800 |",
    ]


def test_own_model_summary_separates_optimizer_feature_layer_and_callback(tmp_path):
    def record(head, **setup):
        epochs = [{"epoch": 1, "accuracy": 0.5, "auroc": 0.6}]
        return dict(
            backbone="mlp", head=head, wrap_kwargs={}, seed=0, epochs=epochs, **setup
        )

    records = [
        record("softmax", optimizer="adam", feature_layer="none"),
        record("softmax", optimizer="sgd", feature_layer="none"),
        record("softmax", optimizer="adam", feature_layer="layer_norm"),
        record("duq", optimizer="adam", recompute_callback=True),
    ]
    heads = [row.split(" | ")[1] for row in _summary_rows(tmp_path, records)[2:]]
    assert heads == [
        "duq, RecomputeBatchNormStatistics",
        "softmax",
        "softmax, + layer_norm on the features",
        "softmax, SGD",
    ]


@pytest.mark.slow
def test_tuning_fashion_mnist_quickstart_recipe_records_every_candidate(
    tmp_path, keras_home, mnist_dir
):
    from research.benchmarks import tuning_fashion_mnist

    output = tmp_path / "tuning.json"
    tuning_fashion_mnist.main(
        ["--recipe", "quickstart", "--seeds", "0", "--mnist-path", str(mnist_dir)]
        + ["--train-subset", "600", "--test-subset", "200", "--epochs-per-trial"]
        + ["1", "--max-trials", "2", "--final-epochs", "2", "--output", str(output)]
    )
    (run,) = json.loads(output.read_text())["runs"]
    assert [trial["stage"] for trial in run["trials"]] == [1, 2]
    assert set(run["best"]) == {"length_scale", "gradient_penalty"}
    finals = run["final"]
    assert set(finals) == {"chosen", "library_defaults", "paper"}
    assert finals["chosen"]["values"] == run["best"]
    expected = {
        "library_defaults": tuning_fashion_mnist.LIBRARY_DEFAULTS,
        "paper": tuning_fashion_mnist.PAPER,
    }
    for name, values in expected.items():
        final = finals[name]
        if "same_as" in final:  # the search chose these values: not retrained
            assert finals[final["same_as"]]["values"] == values
        else:
            assert final["values"] == values
            assert [row["epoch"] for row in final["epochs"]] == [1, 2]
            assert all(0.0 <= row["auroc"] <= 1.0 for row in final["epochs"])


def test_tuning_summary_puts_seeds_side_by_side_and_follows_reused_runs(tmp_path):
    from research.benchmarks.tuning_fashion_mnist import summarize

    def trial(stage, length_scale, penalty, accuracy):
        return {
            "stage": stage,
            "length_scale": length_scale,
            "gradient_penalty": penalty,
            "val_accuracy": accuracy,
            "val_misclassification_auroc": 0.8,
            "diverged": False,
        }

    def final(length_scale, penalty, auroc):
        values = {"length_scale": length_scale, "gradient_penalty": penalty}
        rows = [{"epoch": 1, "accuracy": 0.5, "auroc": auroc}]
        return {"values": values, "epochs": rows}

    runs = [
        {
            "seed": seed,
            "best": {"length_scale": 0.1, "gradient_penalty": penalty},
            "trials": [trial(1, 0.1, 0.0, 0.9), trial(2, 0.1, penalty, 0.89)],
            "final": finals,
        }
        for seed, penalty, finals in [
            (
                0,
                0.3,
                {
                    "chosen": final(0.1, 0.3, 0.9),
                    "library_defaults": final(0.1, 0.1, 0.7),
                    "paper": final(0.1, 0.05, 0.6),
                },
            ),
            (
                1,
                0.1,
                {
                    "chosen": final(0.1, 0.1, 0.8),
                    "library_defaults": {"same_as": "chosen"},
                    "paper": final(0.1, 0.05, 0.4),
                },
            ),
        ]
    ]
    paths = []
    for run in runs[::-1]:  # one file per seed, in any order
        paths.append(tmp_path / f"seed{run['seed']}.json")
        paths[-1].write_text(json.dumps({"runs": [run]}))
    table = summarize(paths, at_epochs=[1]).splitlines()
    assert "| 2 | 0.1 | 0.3 | 0.8900 / 0.8000 * | |" in table
    assert "| 2 | 0.1 | 0.1 | | 0.8900 / 0.8000 * |" in table
    assert "| chosen | 0.1 / 0.3, 0.1 / 0.1 | 0.500 | 0.900, 0.800 | 0.850 |" in table
    assert (
        "| library defaults | 0.1 / 0.1, 0.1 / 0.1 | 0.500 | 0.700, 0.800 | 0.750 |"
        in table
    )
    assert "| paper | 0.1 / 0.05, 0.1 / 0.05 | 0.500 | 0.600, 0.400 | 0.500 |" in table


def test_ood_feature_statistics_see_digits_mapped_onto_one_class():
    from research.benchmarks.ood_features import feature_statistics

    # Two classes at +-3 along the first axis; "OoD" inputs on class 1's
    # side but twice as far, so the head is sure of them while the distance
    # to the nearest class mean gives them away.
    rng = np.random.default_rng(0)
    labels = np.arange(400) % 2
    features = rng.normal(size=(400, 2)) + np.where(labels[:, None] == 1, 3.0, -3.0) * [
        1.0,
        0.0,
    ]
    ood = rng.normal(size=(100, 2)) + [9.0, 0.0]

    def softmax_of(f):
        logits = np.stack([-f[:, 0], f[:, 0]], axis=1)
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    result = feature_statistics(
        features, labels, features, labels, ood, softmax_of(features), softmax_of(ood)
    )
    assert result["ood_predicted_class_share"] == [0.0, 1.0]
    assert result["accuracy"] > 0.99
    assert result["auroc_max_probability"] < 0.3  # the head prefers the OoD inputs
    assert result["auroc_nearest_mean_distance"] > 0.99
    assert result["ood_median_nearest_mean_distance"] > 20.0
    assert len(result["feature_norm_per_class"]) == 2


@pytest.mark.slow  # a fresh process per configuration
def test_many_classes_measures_both_heads_and_names_what_it_did_not_build(tmp_path):
    from research.benchmarks import many_classes

    output = tmp_path / "many_classes.json"
    many_classes.main(
        [
            "--classes", "3", "40",
            "--features", "16",
            "--steps", "1",
            "--max-per-class-values", "1000",
            "--output", str(output),
        ]
    )  # fmt: skip
    records = json.loads(output.read_text())["records"]
    assert [(r["classes"], r["head"]) for r in records] == [
        (3, "per_class"),
        (3, "shared"),
        (40, "per_class"),
        (40, "shared"),
    ]
    per_class, shared, not_built, many = records
    assert per_class["head_values"] == 16 * 16 * 3 + 3 * 16 + 3 + 3
    assert shared["head_values"] == 16 * 16 + 3 * 16 + 3 + 3
    assert "10,240 projection values" in not_built["not_built"]
    for record in (per_class, shared, many):
        assert record["train_step_ms"] > 0 and record["softmax_train_step_ms"] > 0
        assert record["peak_rss_gb"] > 0


def test_recipe_summary_averages_each_label_and_counts_failed_runs(tmp_path):
    from research.benchmarks import recipe

    records = [
        {
            "problem": "cifar10",
            "method": "softmax",
            "label": "softmax",
            "seed": s,
            "train_accuracy": 0.6,
            "test_accuracy": acc,
            "ood_auroc": 0.6,
            "ood_fpr_at_95_tpr": 0.9,
            "epochs": epochs,
        }
        for s, acc, epochs in ((0, 0.5, 10), (1, 0.7, 10), (0, 0.8, 30))
    ] + [
        {
            "problem": "cifar10",
            "method": "duq",
            "label": "defaults",
            "seed": 0,
            "epochs": 10,
            "failed": "non-finite update in epoch 1",
        }
    ]
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = recipe.summarize([str(path)]).splitlines()
    assert "| cifar10 | softmax | 10 | 0, 1 | 0 |" in rows[2]
    assert "0.500 / 0.700 (0.600)" in rows[2]
    assert "| cifar10 | softmax | 30 | 0 | 0 |" in rows[3]  # another budget
    assert rows[4] == "| cifar10 | defaults | 10 | 0 | 1 | - | - | - | - |"


def test_recipe_small_resnet_maps_images_to_pooled_features():
    from research.benchmarks import recipe

    backbone = recipe.small_resnet((32, 32, 3))
    features = backbone(np.zeros((2, 32, 32, 3), "float32"))
    assert tuple(features.shape) == (2, 64)


def test_recipe_held_out_classes_keep_unknown_classes_for_ood_only():
    from research.benchmarks import recipe

    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(4), 25)
    x = rng.normal(size=(100, 3)) + y[:, None] * 10.0
    spec = recipe._held_out_classes(x, y, known=[1, 3], seed=0, epochs=1)
    (x_train, y_train), (x_test, y_test) = spec["train"], spec["test"]
    assert len(x_train) == 35 and len(x_test) == 15
    assert set(y_train) | set(y_test) == {0, 1}  # classes 1 and 3, renumbered
    assert len(spec["ood"]) == 50 and spec["num_classes"] == 2
    # Standardised with the training split's statistics.
    np.testing.assert_allclose(x_train.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(x_train.std(axis=0), 1.0, atol=1e-4)
    # Every OoD row comes from a held-out class (0 or 2): renumbered known
    # classes land on 1 and 3's standardised positions, never on these.
    known_rows = np.concatenate([x_train, x_test])
    assert np.abs(spec["ood"][:, :1] - known_rows[:, 0][None]).min() > 0.1


def test_letters_held_out_trains_on_13_letters_and_keeps_the_others_for_ood(
    tmp_path, monkeypatch
):
    from research.benchmarks import recipe

    rows = ["Letter," + ",".join(str(i) for i in range(1, 17))]
    for letter in "ABCDEFGHIJKLMNOPQRSTUVWXYZ":
        for k in range(10):
            value = ord(letter) - ord("A")
            rows.append(letter + "," + ",".join(str(value + k % 3) for _ in range(16)))
    path = tmp_path / "letter-recognition.data"
    path.write_text("\n".join(rows) + "\n")
    monkeypatch.setenv("LETTER_RECOGNITION_DATA", str(path))
    spec = recipe.letters_held_out(seed=0)
    assert spec["num_classes"] == 13
    assert len(spec["train"][0]) + len(spec["test"][0]) == 130
    assert len(spec["ood"]) == 130 and spec["train"][0].shape[1] == 16
    assert set(spec["train"][1]) <= set(range(13))


def test_letters_held_out_without_its_file_names_the_variable_to_set(monkeypatch):
    from research.benchmarks import recipe

    monkeypatch.setenv("LETTER_RECOGNITION_DATA", "/nonexistent/letters.data")
    with pytest.raises(ValueError, match="LETTER_RECOGNITION_DATA"):
        recipe.letters_held_out(seed=0)

"""Every tutorial in examples/ runs start to finish in its `--quick` mode.

The quick runs train for a step or an epoch on a few hundred examples, so
their metrics mean nothing: the tests check that each tutorial runs, computes
what it teaches and writes its outputs, not how well it learns (the
research/reproduction/ tests and docs cover that).
"""

import json
import logging
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name, argv, monkeypatch):
    """Runs `examples/<name>` as `python examples/<name> *argv`; returns its globals."""
    monkeypatch.setattr(sys, "argv", [name, *argv])
    return runpy.run_path(str(EXAMPLES / name), run_name="__main__")


def test_examples_are_short_and_import_no_other_example():
    for path in EXAMPLES.glob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 300, path.name
        for other in EXAMPLES.glob("*.py"):
            assert f"import {other.stem}" not in text, (path.name, other.stem)
        assert "sys.path" not in text and "spec_from_file_location" not in text, (
            path.name
        )


def test_two_moons(tmp_path, monkeypatch, recwarn):
    messages = []

    class Recorder(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    recorder = Recorder(logging.WARNING)
    logging.getLogger("tensorflow").addHandler(recorder)
    try:
        result = run_example(
            "two_moons.py", ["--quick", "--output-dir", str(tmp_path)], monkeypatch
        )
    finally:
        logging.getLogger("tensorflow").removeHandler(recorder)
    # Three models, each tracing its own `predict`: no retracing warning, and
    # no Python warning that a user running the example would see (Python
    # shows a DeprecationWarning only where `__main__`, the example, calls
    # the deprecated code).
    assert not [m for m in messages if "retracing" in m], messages
    shown = [
        str(w.message)
        for w in recwarn
        if not issubclass(w.category, DeprecationWarning)
        or w.filename.endswith("two_moons.py")
    ]
    assert shown == []
    assert len(result["models"]) == 3
    for metrics in result["results"].values():
        assert 0.0 <= metrics["far_certainty"] <= 1.0 and 0.0 <= metrics["auroc"] <= 1.0
    assert (tmp_path / "certainty_maps.png").stat().st_size > 10_000


@pytest.mark.slow  # about 25 s of training; CI runs it with the slow tests
def test_fashion_mnist(tmp_path, monkeypatch, keras_home, mnist_dir):
    argv = ["--quick", "--mnist-path", str(mnist_dir), "--output-dir", str(tmp_path)]
    result = run_example("fashion_mnist.py", argv, monkeypatch)
    assert set(result["metrics"]) >= {
        "accuracy",
        "auroc",
        "aupr",
        "misclassification_auroc",
    }
    assert "ood_auroc" in result["history"].history
    assert (tmp_path / "fashion_mnist_vs_mnist.png").stat().st_size > 10_000


@pytest.mark.slow
def test_bring_your_own_backbone(monkeypatch, keras_home, mnist_dir):
    argv = ["--quick", "--mnist-path", str(mnist_dir)]
    result = run_example("bring_your_own_backbone.py", argv, monkeypatch)
    assert result["same"]  # the reloaded .keras model predicts as the trained one
    assert 0.0 <= result["threshold"] <= 1.0
    assert result["model"].duq_output.centroids.shape == (256, 10)


def test_clinc150(monkeypatch, clinc150_path):
    argv = ["--quick", "--data", str(clinc150_path)]
    result = run_example("clinc150.py", argv, monkeypatch)
    assert [(r["method"], r["seed"]) for r in result["results"]] == [
        ("duq", 0),
        ("softmax", 0),
    ]
    for scores in result["results"]:
        assert 0.0 <= scores["accuracy"] <= 1.0 and 0.0 <= scores["auroc"] <= 1.0
        assert 0.0 <= scores["oos_refused"] <= 1.0
    assert len(result["ids_oos"]) == 1000 and len(result["ids_test"]) == 4500


@pytest.mark.requires_backend("tensorflow")  # SavedModel from TensorFlow
def test_serving(tmp_path, monkeypatch):
    result = run_example(
        "serving.py", ["--quick", "--output-dir", str(tmp_path)], monkeypatch
    )
    assert result["matches"] and result["keras_duq_imported"] is False
    assert (tmp_path / "duq" / "1" / "saved_model.pb").exists()
    body = json.loads((tmp_path / "request.json").read_text())
    assert body == {"instances": result["x"].tolist()}


@pytest.mark.slow  # 20-25 s: a ResNet on mock CIFAR-10
@pytest.mark.requires_backend("tensorflow")  # tensorflow-datasets mock data
def test_cifar10_under_mock_data(tmp_path, monkeypatch):
    # No CIFAR-10 or SVHN here: tfds serves random images with the data sets'
    # shapes and dtypes, and fails any attempt to download.
    tfds = pytest.importorskip("tensorflow_datasets")
    argv = [
        "--quick",
        "--data-dir",
        str(tmp_path / "tfds"),
        "--output-dir",
        str(tmp_path),
    ]
    with tfds.testing.mock_data(num_examples=128):
        result = run_example("cifar10.py", argv, monkeypatch)
    assert len(result["labels"]) == 64 and len(result["ood_certainty"]) == 64
    assert 0.0 <= result["metrics"]["auroc"] <= 1.0
    assert (tmp_path / "cifar10_vs_svhn.png").stat().st_size > 10_000


@pytest.mark.requires_backend("tensorflow")  # tensorflow-datasets mock data
def test_text_classification_under_mock_data(monkeypatch):
    # No IMDB here: tfds serves random strings and labels in its place.
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=256):
        result = run_example("text_classification.py", ["--quick"], monkeypatch)
    assert result["model"].penalty_input == "embedding"
    assert np.isfinite(result["history"].history["gradient_penalty"]).all()
    assert 0.0 <= result["metrics"]["accuracy"] <= 1.0
    assert len(result["certainty"]) == 256

"""Tests of keras_duq.plots: figures are returned, complete and savable."""

import keras
import matplotlib.image
import numpy as np
import pytest
from matplotlib.figure import Figure

import keras_duq

RNG = np.random.default_rng(0)
IN_CERTAINTY = RNG.uniform(0.5, 1.0, 200)
OOD_CERTAINTY = RNG.uniform(0.0, 0.6, 150)
IN_CORRECT = RNG.random(200) < 0.9


def _saves_png(figure, path):
    figure.savefig(path)
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def _legend_texts(axes):
    return [text.get_text() for text in axes.get_legend().get_texts()]


def test_plot_roc_curve(tmp_path):
    figure = keras_duq.plots.plot_roc_curve(
        IN_CERTAINTY, OOD_CERTAINTY, label="DUQ", title="FashionMNIST vs MNIST"
    )
    assert isinstance(figure, Figure)
    (axes,) = figure.axes
    assert len(axes.get_lines()) == 2  # the curve and the chance diagonal
    auroc = keras_duq.evaluation.ood_metrics(IN_CERTAINTY, OOD_CERTAINTY)["auroc"]
    assert _legend_texts(axes)[0] == f"DUQ (AUROC {auroc:.3f})"
    assert axes.get_title() == "FashionMNIST vs MNIST"
    fpr, tpr = axes.get_lines()[0].get_data()
    assert fpr[0] == 0 and tpr[0] == 0 and fpr[-1] == 1 and tpr[-1] == 1
    _saves_png(figure, tmp_path / "roc.png")


def test_plot_rejection_curve_from_dict_and_inputs(tmp_path):
    curve = keras_duq.evaluation.rejection_curve(IN_CERTAINTY, IN_CORRECT, OOD_CERTAINTY)
    figure = keras_duq.plots.plot_rejection_curve(curve, label="DUQ")
    assert isinstance(figure, Figure)
    (axes,) = figure.axes
    model_line, oracle_line = axes.get_lines()
    np.testing.assert_array_equal(model_line.get_ydata(), curve["accuracy"])
    np.testing.assert_array_equal(oracle_line.get_ydata(), curve["oracle_accuracy"])
    assert _legend_texts(axes) == ["DUQ", "theoretical maximum"]
    _saves_png(figure, tmp_path / "rejection.png")

    same = keras_duq.plots.plot_rejection_curve(
        in_certainty=IN_CERTAINTY, in_correct=IN_CORRECT, ood_certainty=OOD_CERTAINTY
    )
    np.testing.assert_array_equal(
        same.axes[0].get_lines()[0].get_ydata(), curve["accuracy"]
    )


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((), {}, "not both and not neither"),
        (({"accuracy": []},), {"in_certainty": IN_CERTAINTY}, "not both"),
        (({"accuracy": []},), {}, "missing the keys"),
        ((), {"in_certainty": IN_CERTAINTY}, "both needed"),
    ],
)
def test_plot_rejection_curve_rejects_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_duq.plots.plot_rejection_curve(*args, **kwargs)


def test_plot_certainty_histograms(tmp_path):
    figure = keras_duq.plots.plot_certainty_histograms(
        IN_CERTAINTY, OOD_CERTAINTY, bins=20, in_label="FashionMNIST", ood_label="MNIST"
    )
    assert isinstance(figure, Figure)
    (axes,) = figure.axes
    assert len(axes.patches) == 40  # two histograms of 20 bars
    assert _legend_texts(axes) == ["FashionMNIST", "MNIST"]
    # Densities: each histogram has area 1 whatever the set sizes.
    for bars in (axes.patches[:20], axes.patches[20:]):
        area = sum(bar.get_width() * bar.get_height() for bar in bars)
        assert area == pytest.approx(1.0)
    _saves_png(figure, tmp_path / "histograms.png")


def test_plot_certainty_histograms_constant_certainty():
    figure = keras_duq.plots.plot_certainty_histograms(np.ones(5), np.ones(3), bins=4)
    assert len(figure.axes[0].patches) == 8


def test_plot_certainty_histograms_rejects_bad_bins():
    with pytest.raises(ValueError, match="bins"):
        keras_duq.plots.plot_certainty_histograms(IN_CERTAINTY, OOD_CERTAINTY, bins=0)


def test_plot_certainty_map(tmp_path):
    backbone = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8)])
    model = keras_duq.wrap(backbone, num_classes=2, length_scale=0.3)
    x = RNG.normal(size=(20, 2)).astype("float32")
    y = np.arange(20) % 2
    figure = keras_duq.plots.plot_certainty_map(model, x, y, resolution=20, title="moons")
    assert isinstance(figure, Figure)
    assert figure.axes[0].get_title() == "moons"
    _saves_png(figure, tmp_path / "map.png")

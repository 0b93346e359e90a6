"""Tests of keras_duq.plots: axes are returned, complete and savable.

Every plot draws on a new current pyplot figure (`plt.savefig` writes it) or
on the axes it is given.
"""

import matplotlib

matplotlib.use("Agg")

import keras  # noqa: E402
import matplotlib.image  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib import pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

import keras_duq  # noqa: E402

RNG = np.random.default_rng(0)
IN_CERTAINTY = RNG.uniform(0.5, 1.0, 200)
OOD_CERTAINTY = RNG.uniform(0.0, 0.6, 150)
IN_CORRECT = RNG.random(200) < 0.9


@pytest.fixture(autouse=True)
def _close_figures():
    plt.close("all")
    yield
    plt.close("all")


def _saves_png(axes, path):
    """`plt.savefig` writes the plot: it is on the current figure, not blank."""
    assert plt.gcf() is axes.figure
    plt.savefig(path)
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    # A blank figure is one colour; a plot has lines, text and fills.
    assert image[..., :3].std() > 0.05


def _legend_texts(axes):
    return [text.get_text() for text in axes.get_legend().get_texts()]


def test_plot_roc_curve(tmp_path):
    axes = keras_duq.plots.plot_roc_curve(
        IN_CERTAINTY, OOD_CERTAINTY, label="DUQ", title="FashionMNIST vs MNIST"
    )
    assert isinstance(axes, Axes)
    assert len(axes.get_lines()) == 2  # the curve and the chance diagonal
    auroc = keras_duq.evaluation.ood_metrics(IN_CERTAINTY, OOD_CERTAINTY)["auroc"]
    assert _legend_texts(axes)[0] == f"DUQ (AUROC {auroc:.3f})"
    assert axes.get_title() == "FashionMNIST vs MNIST"
    fpr, tpr = axes.get_lines()[0].get_data()
    assert fpr[0] == 0 and tpr[0] == 0 and fpr[-1] == 1 and tpr[-1] == 1
    _saves_png(axes, tmp_path / "roc.png")


def test_plot_rejection_curve_from_dict_and_inputs(tmp_path):
    curve = keras_duq.evaluation.rejection_curve(
        IN_CERTAINTY, IN_CORRECT, OOD_CERTAINTY
    )
    axes = keras_duq.plots.plot_rejection_curve(curve, label="DUQ")
    assert isinstance(axes, Axes)
    model_line, oracle_line = axes.get_lines()
    np.testing.assert_array_equal(model_line.get_ydata(), curve["accuracy"])
    np.testing.assert_array_equal(oracle_line.get_ydata(), curve["oracle_accuracy"])
    assert _legend_texts(axes) == ["DUQ", "theoretical maximum"]
    _saves_png(axes, tmp_path / "rejection.png")

    same = keras_duq.plots.plot_rejection_curve(
        in_certainty=IN_CERTAINTY, in_correct=IN_CORRECT, ood_certainty=OOD_CERTAINTY
    )
    np.testing.assert_array_equal(same.get_lines()[0].get_ydata(), curve["accuracy"])


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
    axes = keras_duq.plots.plot_certainty_histograms(
        IN_CERTAINTY, OOD_CERTAINTY, bins=20, in_label="FashionMNIST", ood_label="MNIST"
    )
    assert isinstance(axes, Axes)
    assert len(axes.patches) == 40  # two histograms of 20 bars
    assert _legend_texts(axes) == ["FashionMNIST", "MNIST"]
    # Densities: each histogram has area 1 whatever the set sizes.
    for bars in (axes.patches[:20], axes.patches[20:]):
        area = sum(bar.get_width() * bar.get_height() for bar in bars)
        assert area == pytest.approx(1.0)
    _saves_png(axes, tmp_path / "histograms.png")


def test_plot_certainty_histograms_constant_certainty():
    axes = keras_duq.plots.plot_certainty_histograms(np.ones(5), np.ones(3), bins=4)
    assert len(axes.patches) == 8


def test_plot_certainty_histograms_rejects_bad_bins():
    with pytest.raises(ValueError, match="bins"):
        keras_duq.plots.plot_certainty_histograms(IN_CERTAINTY, OOD_CERTAINTY, bins=0)


def test_plot_certainty_map(tmp_path):
    backbone = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8)])
    model = keras_duq.wrap(backbone, num_classes=2, length_scale=0.3)
    x = RNG.normal(size=(20, 2)).astype("float32")
    y = np.arange(20) % 2
    axes = keras_duq.plots.plot_certainty_map(model, x, y, resolution=20, title="moons")
    assert isinstance(axes, Axes)
    assert axes.get_title() == "moons"
    _saves_png(axes, tmp_path / "map.png")

    # On the caller's axes, with the colour bar beside them.
    figure, (left, right) = plt.subplots(1, 2)
    drawn = keras_duq.plots.plot_certainty_map(model, x, y, resolution=20, ax=right)
    assert drawn is right and len(right.collections) > 0
    assert len(figure.axes) == 3 and not left.has_data()


def test_plot_reliability_diagram(tmp_path):
    rng = np.random.default_rng(0)
    confidence = rng.uniform(0.3, 1.0, 1000)
    correct = rng.random(1000) < confidence**2  # over-confident
    axes = keras_duq.plots.plot_reliability_diagram(
        confidence, correct, num_bins=10, label="softmax", title="calibration"
    )
    assert isinstance(axes, Axes)
    curve = keras_duq.evaluation.calibration_curve(confidence, correct, num_bins=10)
    filled = curve["count"] > 0
    accuracy_bars = axes.patches[: filled.sum()]
    gap_bars = axes.patches[filled.sum() :]
    np.testing.assert_allclose(
        [bar.get_height() for bar in accuracy_bars], curve["accuracy"][filled]
    )
    # Each gap bar ends at the bin's mean confidence.
    np.testing.assert_allclose(
        [bar.get_y() + bar.get_height() for bar in gap_bars],
        curve["confidence"][filled],
    )
    np.testing.assert_allclose(
        [bar.get_x() for bar in accuracy_bars], curve["bin_edges"][:-1][filled]
    )
    ece = keras_duq.evaluation.expected_calibration_error(
        confidence, correct, num_bins=10
    )
    assert f"softmax accuracy (ECE {ece:.3f})" in _legend_texts(axes)
    assert axes.get_title() == "calibration"
    _saves_png(axes, tmp_path / "reliability.png")

    quantile = keras_duq.plots.plot_reliability_diagram(
        confidence, correct, num_bins=5, strategy="quantile"
    )
    assert len(quantile.patches) == 10


def test_plot_reliability_diagram_rejects_bad_input():
    with pytest.raises(ValueError, match="strategy"):
        keras_duq.plots.plot_reliability_diagram([0.5], [1], strategy="width")
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        keras_duq.plots.plot_reliability_diagram([2.0], [1])


PLOTS = ("roc", "rejection", "histograms", "reliability", "map")


def _draw_every_plot(axes=None):
    """Each plot once; `axes` maps a plot's name to the `ax=` it gets."""
    axes = axes or {}
    backbone = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4)])
    model = keras_duq.wrap(backbone, num_classes=2, length_scale=0.3)
    x = RNG.normal(size=(10, 2)).astype("float32")
    return {
        "roc": keras_duq.plots.plot_roc_curve(
            IN_CERTAINTY, OOD_CERTAINTY, ax=axes.get("roc")
        ),
        "rejection": keras_duq.plots.plot_rejection_curve(
            in_certainty=IN_CERTAINTY, in_correct=IN_CORRECT, ax=axes.get("rejection")
        ),
        "histograms": keras_duq.plots.plot_certainty_histograms(
            IN_CERTAINTY, OOD_CERTAINTY, ax=axes.get("histograms")
        ),
        "reliability": keras_duq.plots.plot_reliability_diagram(
            IN_CERTAINTY, IN_CORRECT, ax=axes.get("reliability")
        ),
        "map": keras_duq.plots.plot_certainty_map(
            model, x, np.arange(10) % 2, resolution=10, ax=axes.get("map")
        ),
    }


def test_every_plot_draws_on_a_new_current_figure():
    drawn = _draw_every_plot()
    assert list(drawn) == list(PLOTS)
    figures = [axes.figure for axes in drawn.values()]
    # One new pyplot figure each; the last drawn is the current one.
    assert len({id(figure) for figure in figures}) == len(PLOTS)
    assert len(plt.get_fignums()) == len(PLOTS)
    assert plt.gcf() is figures[-1] and plt.gca() is drawn["map"]


def test_every_plot_draws_on_the_given_axes(tmp_path):
    figure, grid = plt.subplots(2, 3, figsize=(12, 7))
    given = dict(zip(PLOTS, grid.flat))
    drawn = _draw_every_plot(given)
    assert plt.get_fignums() == [figure.number]  # no other figure was made
    for name in PLOTS:
        assert drawn[name] is given[name] and given[name].has_data(), name
    assert not grid.flat[5].has_data()
    figure.savefig(tmp_path / "grid.png")
    assert matplotlib.image.imread(tmp_path / "grid.png")[..., :3].std() > 0.05

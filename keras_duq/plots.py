"""The paper's figures and a reliability diagram, drawn with matplotlib.

Every function draws on the `ax=` it is given, or else on a new pyplot
figure, which becomes the current figure (so `plt.savefig`, `plt.show` and
notebooks show it), and returns the `matplotlib.axes.Axes` it drew on; its
figure is `axes.figure`. (keras_duq 0.2 returned a `Figure` unknown to
pyplot: replace `plot_...(...).savefig(path)` by
`plot_...(...).figure.savefig(path)`, or call `plt.savefig(path)`.)

matplotlib is an optional dependency (`pip install "keras-duq[plots]"`),
imported the first time a figure is drawn.

Example:

```python
import matplotlib.pyplot as plt
from keras_duq import plots

plots.plot_certainty_histograms(in_certainty, ood_certainty)
plt.savefig("hist.png")

figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
plots.plot_roc_curve(in_certainty, ood_certainty, label="DUQ", ax=left)
plots.plot_reliability_diagram(confidence, correct, ax=right)
figure.savefig("duq.png")
```"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from sklearn import metrics as sk_metrics

from keras_duq import evaluation as _evaluation
from keras_duq._evaluation_inputs import as_certainty
from keras_duq._evaluation_inputs import detection_problem
from keras_duq._validation import check_int

__all__ = [
    "plot_certainty_histograms",
    "plot_certainty_map",
    "plot_rejection_curve",
    "plot_reliability_diagram",
    "plot_roc_curve",
]

if TYPE_CHECKING:
    import keras
    import matplotlib.axes


def _axes(
    ax: matplotlib.axes.Axes | None, figsize: tuple[float, float]
) -> tuple[matplotlib.axes.Axes, bool]:
    """The caller's axes, or those of a new pyplot figure; and which it was.

    A new figure goes through pyplot, as `plt.subplots` would make it, so it
    is the current figure for `plt.savefig` and shows in notebooks.
    """
    if ax is not None:
        return ax, False
    try:
        from matplotlib import pyplot
    except ImportError as error:
        raise ImportError(
            "keras_duq's plots need matplotlib, which is not installed. "
            'Install it with `pip install "keras-duq[plots]"` (or `pip '
            "install matplotlib`)."
        ) from error
    return pyplot.figure(figsize=figsize).add_subplot(), True


# Every plot's last argument and its return value, written once.
_AXES_DOC = """
        ax: optional `matplotlib.axes.Axes` to draw on. Defaults to a new
            pyplot figure, which becomes the current figure.

    Returns:
        The `matplotlib.axes.Axes` drawn on (its figure: `axes.figure`;
        keras_duq 0.2 returned the figure).
    """


def _documents_axes(function):
    """Ends `function`'s docstring (its `Args:` last) with `_AXES_DOC`."""
    if function.__doc__:  # `python -OO` strips docstrings
        function.__doc__ = function.__doc__.rstrip() + "\n" + _AXES_DOC.lstrip("\n")
    return function


@_documents_axes
def plot_certainty_map(
    model: keras.Model,
    x_train: np.ndarray,
    y_train: ArrayLike,
    x_range: tuple[float, float] = (-3.5, 4.5),
    y_range: tuple[float, float] = (-3.0, 3.5),
    resolution: int = 200,
    title: str | None = None,
    ax: matplotlib.axes.Axes | None = None,
) -> matplotlib.axes.Axes:
    """Certainty (max kernel value) of a 2-D model over a grid, as in Figure 1.

    Yellow is certain, dark blue uncertain; the training points are drawn on
    top, coloured by class.

    Example:

    ```python
    keras_duq.plots.plot_certainty_map(model, x_train, y_train)
    plt.savefig("two_moons.png")
    ```

    Args:
        model: a Keras model mapping `(batch, 2)` inputs to per-class scores
            in `[0, 1]` (a `DUQModel`, or any model with `predict`).
        x_train: `(n, 2)` training inputs to draw.
        y_train: `(n,)` integer labels of `x_train`.
        x_range: `(min, max)` of the first input dimension.
        y_range: `(min, max)` of the second input dimension.
        resolution: number of grid points per dimension.
        title: optional title.
    """
    xs = np.linspace(*x_range, resolution)
    ys = np.linspace(*y_range, resolution)
    grid_x, grid_y = np.meshgrid(xs, ys)
    grid = np.stack([grid_x.ravel(), grid_y.ravel()], axis=1).astype("float32")
    certainty = np.max(model.predict(grid, batch_size=4096, verbose=0), axis=1)
    axes, created = _axes(ax, figsize=(6, 5))
    image = axes.contourf(
        grid_x,
        grid_y,
        certainty.reshape(grid_x.shape),
        levels=np.linspace(0.0, 1.0, 21),
        cmap="viridis",
    )
    axes.figure.colorbar(image, ax=axes, label="certainty (max kernel value)")
    y_train = np.asarray(y_train).reshape(-1)
    for label, color in zip(np.unique(y_train), ("tab:red", "white", "tab:orange")):
        points = x_train[y_train == label]
        axes.scatter(points[:, 0], points[:, 1], s=4, c=color, label=f"class {label}")
    axes.set(xlim=x_range, ylim=y_range)
    return _finish(axes, created, title, legend_loc="lower left", fontsize="small")


@_documents_axes
def plot_roc_curve(
    in_certainty: ArrayLike,
    ood_certainty: ArrayLike,
    label: str | None = None,
    title: str | None = None,
    ax: matplotlib.axes.Axes | None = None,
) -> matplotlib.axes.Axes:
    """ROC curve of separating in-distribution from OoD data, as in Figure 5.

    Uses the convention of `ood_metrics`: OoD is the positive class and the
    detector score is the uncertainty, so the curve bows towards the top left
    for a good detector. The AUROC is shown in the legend.

    Example:

    ```python
    keras_duq.plots.plot_roc_curve(
        model.predict(x_fashion_mnist).max(axis=1),
        model.predict(x_mnist).max(axis=1),
        label="DUQ",
    )
    plt.savefig("roc.png")
    ```

    Args:
        in_certainty: array-like `(num_in,)`, certainty on in-distribution
            data (see `certainty_scores`).
        ood_certainty: array-like `(num_ood,)`, certainty on OoD data.
        label: optional name of the model, shown in the legend.
        title: optional title.
    """
    in_certainty = as_certainty("in_certainty", in_certainty)
    ood_certainty = as_certainty("ood_certainty", ood_certainty)
    is_ood, uncertainty = detection_problem(in_certainty, ood_certainty)
    fpr, tpr, _ = sk_metrics.roc_curve(is_ood, uncertainty)
    auroc = sk_metrics.roc_auc_score(is_ood, uncertainty)
    axes, created = _axes(ax, figsize=(5, 5))
    name = f"{label} " if label else ""
    axes.plot(fpr, tpr, color="tab:blue", label=f"{name}(AUROC {auroc:.3f})")
    return _finish_with_reference(
        axes,
        created,
        title,
        ([0, 1], [0, 1], {"color": "grey", "linestyle": ":", "label": "chance"}),
        ylim=(0.0, 1.01),
        xlabel="false positive rate (in-distribution flagged as OoD)",
        ylabel="true positive rate (OoD flagged)",
    )


@_documents_axes
def plot_rejection_curve(
    curve: dict[str, np.ndarray] | None = None,
    *,
    in_certainty: ArrayLike | None = None,
    in_correct: ArrayLike | None = None,
    ood_certainty: ArrayLike | None = None,
    label: str | None = None,
    title: str | None = None,
    ax: matplotlib.axes.Axes | None = None,
) -> matplotlib.axes.Axes:
    """Accuracy on the kept data against the rejected fraction (Figure 6).

    Draws the model's curve and the oracle ("theoretical maximum") of
    `rejection_curve`. Pass either the dict returned by `rejection_curve`,
    or its inputs as keyword arguments.

    Example:

    ```python
    curve = keras_duq.evaluation.rejection_curve(
        in_certainty, in_correct, ood_certainty
    )
    axes = keras_duq.plots.plot_rejection_curve(curve, label="DUQ")
    # or, in one go:
    axes = keras_duq.plots.plot_rejection_curve(
        in_certainty=in_certainty,
        in_correct=in_correct,
        ood_certainty=ood_certainty,
    )
    ```

    Args:
        curve: dict with `"rejected_fraction"`, `"accuracy"` and
            `"oracle_accuracy"` arrays, as returned by `rejection_curve`.
        in_certainty: instead of `curve`: certainty on in-distribution data.
        in_correct: instead of `curve`: whether each in-distribution
            prediction is right.
        ood_certainty: instead of `curve`, optional: certainty on OoD data
            (predictions counted as wrong).
        label: optional name of the model, shown in the legend.
        title: optional title.
    """
    given_inputs = in_certainty is not None or in_correct is not None
    if (curve is None) == (not given_inputs) or (
        ood_certainty is not None and curve is not None
    ):
        raise ValueError(
            "Pass either `curve` (the dict returned by "
            "`keras_duq.evaluation.rejection_curve`) or `in_certainty` and "
            "`in_correct` (and optionally `ood_certainty`), not both and not neither. "
            f"Received: `curve` {'set' if curve is not None else 'None'}, "
            f"`in_certainty` {'set' if in_certainty is not None else 'None'}, "
            f"`in_correct` {'set' if in_correct is not None else 'None'}"
        )
    if curve is None:
        if in_certainty is None or in_correct is None:
            raise ValueError(
                "`in_certainty` and `in_correct` are both needed to compute "
                "the rejection curve. Received: "
                f"`in_certainty` {'set' if in_certainty is not None else 'None'}, "
                f"`in_correct` {'set' if in_correct is not None else 'None'}"
            )
        curve = _evaluation.rejection_curve(in_certainty, in_correct, ood_certainty)
    missing = {"rejected_fraction", "accuracy", "oracle_accuracy"} - set(curve)
    if missing:
        raise ValueError(
            "`curve` must be the dict returned by "
            "`keras_duq.evaluation.rejection_curve`. "
            f"Received: a dict missing the keys {sorted(missing)}"
        )
    axes, created = _axes(ax, figsize=(6, 4.5))
    axes.plot(
        curve["rejected_fraction"],
        curve["accuracy"],
        color="tab:blue",
        label=label or "model",
    )
    return _finish_with_reference(
        axes,
        created,
        title,
        (
            curve["rejected_fraction"],
            curve["oracle_accuracy"],
            {"color": "black", "linestyle": "--", "label": "theoretical maximum"},
        ),
        xlabel="fraction of data rejected (least certain first)",
        ylabel="accuracy on the kept data",
    )


@_documents_axes
def plot_certainty_histograms(
    in_certainty: ArrayLike,
    ood_certainty: ArrayLike,
    bins: int = 50,
    in_label: str = "in distribution",
    ood_label: str = "out of distribution",
    xlabel: str = "certainty",
    title: str | None = None,
    ax: matplotlib.axes.Axes | None = None,
) -> matplotlib.axes.Axes:
    """Normalised histograms of the certainty on in-distribution and OoD data.

    As in the paper's Figure 7, each histogram is a density (area 1), so sets
    of different sizes compare directly; both share the same bins.

    Example:

    ```python
    keras_duq.plots.plot_certainty_histograms(
        model.predict(x_fashion_mnist).max(axis=1),
        model.predict(x_mnist).max(axis=1),
        in_label="FashionMNIST",
        ood_label="MNIST",
    )
    ```

    Args:
        in_certainty: array-like `(num_in,)`, certainty on in-distribution
            data.
        ood_certainty: array-like `(num_ood,)`, certainty on OoD data.
        bins: int >= 1, number of bins over the joint range. Defaults to `50`.
        in_label: legend label of the in-distribution histogram.
        ood_label: legend label of the OoD histogram.
        xlabel: label of the x axis, e.g. `"max kernel value"` or
            `"negative entropy"`.
        title: optional title.
    """
    check_int("bins", bins, minimum=1)
    in_certainty = as_certainty("in_certainty", in_certainty)
    ood_certainty = as_certainty("ood_certainty", ood_certainty)
    low = min(in_certainty.min(), ood_certainty.min())
    high = max(in_certainty.max(), ood_certainty.max())
    if low == high:
        # A constant certainty still needs bins of non-zero width.
        low, high = low - 0.5, high + 0.5
    edges = np.linspace(low, high, bins + 1)
    axes, created = _axes(ax, figsize=(6, 4))
    for certainty, color, label in (
        (in_certainty, "tab:blue", in_label),
        (ood_certainty, "tab:orange", ood_label),
    ):
        axes.hist(
            certainty, bins=edges, density=True, alpha=0.6, color=color, label=label
        )
    axes.set(xlabel=xlabel, ylabel="density")
    return _finish(axes, created, title, legend_loc="upper center")


@_documents_axes
def plot_reliability_diagram(
    confidence: ArrayLike,
    correct: ArrayLike,
    num_bins: int = 15,
    strategy: str = "uniform",
    label: str | None = None,
    title: str | None = None,
    ax: matplotlib.axes.Axes | None = None,
) -> matplotlib.axes.Axes:
    """Reliability diagram: accuracy against confidence, bin by bin.

    Blue bars are the accuracy in each bin of `calibration_curve`; red bars
    span the gap to the bin's mean confidence (above the blue bar: over-
    confident, inside it: under-confident). A calibrated model follows the
    diagonal. The expected calibration error is shown in the legend. Empty
    bins are left blank.

    Example:

    ```python
    probabilities = softmax_model.predict(x_test)
    keras_duq.plots.plot_reliability_diagram(
        probabilities.max(axis=1), probabilities.argmax(axis=1) == y_test,
        label="softmax",
    )
    plt.savefig("reliability.png")
    ```

    Args:
        confidence: array-like `(num_examples,)` in `[0, 1]`: softmax or
            ensemble probabilities, DUQ certainty, or a `CertaintyCalibrator`
            output.
        correct: array-like `(num_examples,)` of bools (or 0/1), whether each
            prediction is right.
        num_bins: int >= 1, number of bins. Defaults to `15`.
        strategy: `"uniform"` (default, equal-width bins) or `"quantile"`
            (equal-count bins), as in `calibration_curve`.
        label: optional name of the model, shown in the legend.
        title: optional title.
    """
    curve = _evaluation.calibration_curve(confidence, correct, num_bins, strategy)
    ece = _evaluation.expected_calibration_error(
        confidence, correct, num_bins, strategy
    )
    axes, created = _axes(ax, figsize=(5, 5))
    filled = curve["count"] > 0
    left = curve["bin_edges"][:-1][filled]
    widths = np.diff(curve["bin_edges"])[filled]
    accuracy = curve["accuracy"][filled]
    name = f"{label} " if label else ""
    axes.bar(
        left,
        accuracy,
        width=widths,
        align="edge",
        color="tab:blue",
        edgecolor="black",
        label=f"{name}accuracy (ECE {ece:.3f})",
    )
    axes.bar(
        left,
        curve["confidence"][filled] - accuracy,
        bottom=accuracy,
        width=widths,
        align="edge",
        color="tab:red",
        alpha=0.3,
        edgecolor="tab:red",
        hatch="//",
        label="gap to mean confidence",
    )
    axes.plot([0, 1], [0, 1], color="grey", linestyle=":", label="calibrated")
    axes.set(xlim=(0.0, 1.0), ylim=(0.0, 1.0), xlabel="confidence", ylabel="accuracy")
    # Which corner is free depends on the bars (over-confident models leave
    # the upper left empty, under-confident ones fill it).
    return _finish(axes, created, title, legend_loc="best")


def _finish(
    axes: matplotlib.axes.Axes,
    created: bool,
    title: str | None,
    legend_loc: str,
    **legend_kwargs: Any,
) -> matplotlib.axes.Axes:
    """Legend, optional title and a tight layout: the end of every plot."""
    axes.legend(loc=legend_loc, **legend_kwargs)
    if title:
        axes.set_title(title)
    if created:
        # Only a figure made here: a caller's layout is the caller's.
        axes.figure.tight_layout()
    return axes


def _finish_with_reference(
    axes: matplotlib.axes.Axes,
    created: bool,
    title: str | None,
    reference: tuple[Any, Any, dict[str, Any]],
    **settings: Any,
) -> matplotlib.axes.Axes:
    """A curve's plot ended: its reference line `(x, y, style)`, axes from 0 to
    1 along x, the legend at the lower right."""
    x, y, style = reference
    axes.plot(x, y, **style)
    axes.set(xlim=(0.0, 1.0), **settings)
    return _finish(axes, created, title, legend_loc="lower right")

"""The paper's figures, drawn with matplotlib. Every function returns the figure.

matplotlib is an optional dependency (`pip install "keras-duq[plots]"`),
imported the first time a figure is drawn.

Example:

```python
from keras_duq import plots

plots.plot_certainty_histograms(in_certainty, ood_certainty).savefig("hist.png")
```"""

from __future__ import annotations

import numpy as np
from sklearn import metrics as sk_metrics

from keras_duq import evaluation as _evaluation
from keras_duq._validation import check_int

# Figures are built with `matplotlib.figure.Figure`, not `pyplot`: nothing
# pops up, nothing is kept in pyplot's global registry, and any backend works.


def _new_figure(**kwargs):
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "keras_duq's plots need matplotlib, which is not installed. "
            'Install it with `pip install "keras-duq[plots]"` (or `pip '
            "install matplotlib`)."
        ) from error
    return Figure(**kwargs)


def plot_certainty_map(
    model,
    x_train,
    y_train,
    x_range=(-3.5, 4.5),
    y_range=(-3.0, 3.5),
    resolution=200,
    title=None,
):
    """Certainty (max kernel value) of a 2-D model over a grid, as in Figure 1.

    Yellow is certain, dark blue uncertain; the training points are drawn on
    top, coloured by class.

    Example:

    ```python
    figure = keras_duq.plots.plot_certainty_map(model, x_train, y_train)
    figure.savefig("two_moons.png")
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

    Returns:
        The `matplotlib.figure.Figure`.
    """
    xs = np.linspace(*x_range, resolution)
    ys = np.linspace(*y_range, resolution)
    grid_x, grid_y = np.meshgrid(xs, ys)
    grid = np.stack([grid_x.ravel(), grid_y.ravel()], axis=1).astype("float32")
    certainty = np.max(model.predict(grid, batch_size=4096, verbose=0), axis=1)
    figure = _new_figure(figsize=(6, 5))
    axes = figure.subplots()
    image = axes.contourf(
        grid_x,
        grid_y,
        certainty.reshape(grid_x.shape),
        levels=np.linspace(0.0, 1.0, 21),
        cmap="viridis",
    )
    figure.colorbar(image, ax=axes, label="certainty (max kernel value)")
    y_train = np.asarray(y_train).reshape(-1)
    for label, color in zip(np.unique(y_train), ("tab:red", "white", "tab:orange")):
        points = x_train[y_train == label]
        axes.scatter(points[:, 0], points[:, 1], s=4, c=color, label=f"class {label}")
    axes.set_xlim(*x_range)
    axes.set_ylim(*y_range)
    return _finish(figure, axes, title, legend_loc="lower left", fontsize="small")


def plot_roc_curve(
    in_certainty,
    ood_certainty,
    label: str | None = None,
    title: str | None = None,
) -> "matplotlib.figure.Figure":
    """ROC curve of separating in-distribution from OoD data, as in Figure 5.

    Uses the convention of `ood_metrics`: OoD is the positive class and the
    detector score is the uncertainty, so the curve bows towards the top left
    for a good detector. The AUROC is shown in the legend.

    Example:

    ```python
    figure = keras_duq.plots.plot_roc_curve(
        model.predict(x_fashion_mnist).max(axis=1),
        model.predict(x_mnist).max(axis=1),
        label="DUQ",
    )
    figure.savefig("roc.png")
    ```

    Args:
        in_certainty: array-like `(num_in,)`, certainty on in-distribution
            data (see `certainty_scores`).
        ood_certainty: array-like `(num_ood,)`, certainty on OoD data.
        label: optional name of the model, shown in the legend.
        title: optional title.

    Returns:
        The `matplotlib.figure.Figure`.
    """
    in_certainty = _evaluation._as_certainty("in_certainty", in_certainty)
    ood_certainty = _evaluation._as_certainty("ood_certainty", ood_certainty)
    is_ood, uncertainty = _evaluation._detection_problem(in_certainty, ood_certainty)
    fpr, tpr, _ = sk_metrics.roc_curve(is_ood, uncertainty)
    auroc = sk_metrics.roc_auc_score(is_ood, uncertainty)
    figure = _new_figure(figsize=(5, 5))
    axes = figure.subplots()
    name = f"{label} " if label else ""
    axes.plot(fpr, tpr, color="tab:blue", label=f"{name}(AUROC {auroc:.3f})")
    axes.plot([0, 1], [0, 1], color="grey", linestyle=":", label="chance")
    axes.set_xlim(0.0, 1.0)
    axes.set_ylim(0.0, 1.01)
    axes.set_xlabel("false positive rate (in-distribution flagged as OoD)")
    axes.set_ylabel("true positive rate (OoD flagged)")
    return _finish(figure, axes, title, legend_loc="lower right")


def plot_rejection_curve(
    curve: dict | None = None,
    *,
    in_certainty=None,
    in_correct=None,
    ood_certainty=None,
    label: str | None = None,
    title: str | None = None,
) -> "matplotlib.figure.Figure":
    """Accuracy on the kept data against the rejected fraction (Figure 6).

    Draws the model's curve and the oracle ("theoretical maximum") of
    `rejection_curve`. Pass either the dict returned by `rejection_curve`,
    or its inputs as keyword arguments.

    Example:

    ```python
    curve = keras_duq.evaluation.rejection_curve(in_certainty, in_correct, ood_certainty)
    figure = keras_duq.plots.plot_rejection_curve(curve, label="DUQ")
    # or, in one go:
    figure = keras_duq.plots.plot_rejection_curve(
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

    Returns:
        The `matplotlib.figure.Figure`.
    """
    given_inputs = in_certainty is not None or in_correct is not None
    if (curve is None) == (not given_inputs) or (
        ood_certainty is not None and curve is not None
    ):
        raise ValueError(
            "Pass either `curve` (the dict returned by "
            "`keras_duq.evaluation.rejection_curve`) or `in_certainty` and `in_correct` "
            "(and optionally `ood_certainty`), not both and not neither. "
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
            "`curve` must be the dict returned by `keras_duq.evaluation.rejection_curve`. "
            f"Received: a dict missing the keys {sorted(missing)}"
        )
    figure = _new_figure(figsize=(6, 4.5))
    axes = figure.subplots()
    axes.plot(
        curve["rejected_fraction"],
        curve["accuracy"],
        color="tab:blue",
        label=label or "model",
    )
    axes.plot(
        curve["rejected_fraction"],
        curve["oracle_accuracy"],
        color="black",
        linestyle="--",
        label="theoretical maximum",
    )
    axes.set_xlim(0.0, 1.0)
    axes.set_xlabel("fraction of data rejected (least certain first)")
    axes.set_ylabel("accuracy on the kept data")
    return _finish(figure, axes, title, legend_loc="lower right")


def plot_certainty_histograms(
    in_certainty,
    ood_certainty,
    bins: int = 50,
    in_label: str = "in distribution",
    ood_label: str = "out of distribution",
    xlabel: str = "certainty",
    title: str | None = None,
) -> "matplotlib.figure.Figure":
    """Normalised histograms of the certainty on in-distribution and OoD data.

    As in the paper's Figure 7, each histogram is a density (area 1), so sets
    of different sizes compare directly; both share the same bins.

    Example:

    ```python
    figure = keras_duq.plots.plot_certainty_histograms(
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

    Returns:
        The `matplotlib.figure.Figure`.
    """
    check_int("bins", bins, minimum=1)
    in_certainty = _evaluation._as_certainty("in_certainty", in_certainty)
    ood_certainty = _evaluation._as_certainty("ood_certainty", ood_certainty)
    low = min(in_certainty.min(), ood_certainty.min())
    high = max(in_certainty.max(), ood_certainty.max())
    if low == high:
        # A constant certainty still needs bins of non-zero width.
        low, high = low - 0.5, high + 0.5
    edges = np.linspace(low, high, bins + 1)
    figure = _new_figure(figsize=(6, 4))
    axes = figure.subplots()
    axes.hist(
        in_certainty, bins=edges, density=True, alpha=0.6, color="tab:blue",
        label=in_label,
    )
    axes.hist(
        ood_certainty, bins=edges, density=True, alpha=0.6, color="tab:orange",
        label=ood_label,
    )
    axes.set_xlabel(xlabel)
    axes.set_ylabel("density")
    return _finish(figure, axes, title, legend_loc="upper center")


def _finish(figure, axes, title, legend_loc, **legend_kwargs):
    """Legend, optional title and a tight layout: the end of every plot."""
    axes.legend(loc=legend_loc, **legend_kwargs)
    if title:
        axes.set_title(title)
    figure.tight_layout()
    return figure

"""Matplotlib plots used in the paper. Every function returns the figure."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

# Figures are built with `matplotlib.figure.Figure`, not `pyplot`: nothing
# pops up, nothing is kept in pyplot's global registry, and any backend works.


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
    figure = keras_duq.plot_certainty_map(model, x_train, y_train)
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
    figure = Figure(figsize=(6, 5))
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
    axes.legend(loc="lower left", fontsize="small")
    if title:
        axes.set_title(title)
    figure.tight_layout()
    return figure

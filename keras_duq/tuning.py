"""Choosing DUQ's length scale and gradient penalty from validation data.

The paper's procedure, on in-distribution validation data only (no OoD data
is needed):

1. **Length scale**: train one model per length scale with the gradient
   penalty off, and keep the length scale with the highest validation
   accuracy.
2. **Gradient penalty**: with that length scale, train one model per penalty
   weight and keep the weight whose certainty best separates correct from
   wrong validation predictions (the misclassification AUROC,
   `keras_duq.evaluation.misclassification_auroc`), among the weights that
   cost at most `accuracy_tolerance` of validation accuracy.

Example:

```python
import keras
import keras_duq

def build_backbone():
    return keras.Sequential([
        keras.Input((2,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(32),
    ])

result = keras_duq.tuning.search(
    build_backbone, x_train, y_train,
    validation_data=(x_val, y_val), num_classes=2, epochs=10,
)
print(result.summary())
model = keras_duq.wrap(build_backbone(), num_classes=2, **result.best)
model.compile(optimizer=keras.optimizers.Adam())
model.fit(x_train, y_train, epochs=30)
```
"""

from __future__ import annotations

import dataclasses
import gc
import math
import random
import time
import warnings
import weakref
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from numpy.typing import ArrayLike

from keras_duq._duq_model import quiet_retracing
from keras_duq._validation import NON_FINITE_TRAINING_MESSAGE
from keras_duq._validation import check_int
from keras_duq._validation import check_positive_int
from keras_duq._validation import non_finite_rows
from keras_duq._wrap import argument_names
from keras_duq._wrap import wrap
from keras_duq.evaluation import misclassification_auroc

__all__ = [
    "DEFAULT_ACCURACY_TOLERANCE",
    "DEFAULT_GRADIENT_PENALTIES",
    "DEFAULT_LENGTH_SCALES",
    "SearchResult",
    "search",
]

# Roughly log-spaced over the paper's interval (0, 1], with the paper's
# choices: 0.1 (FashionMNIST, CIFAR-10) and 0.3 (two moons).
DEFAULT_LENGTH_SCALES = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
# The penalty weights of the paper's FashionMNIST table, 0 left out: a
# certainty without the penalty can be insensitive to inputs far from the
# data, which in-distribution validation data cannot reveal.
DEFAULT_GRADIENT_PENALTIES = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
# Penalties that cost at most this much validation accuracy are eligible.
DEFAULT_ACCURACY_TOLERANCE = 0.01
# Fewer wrong validation predictions than this make the misclassification
# AUROC too coarse to rank penalty weights: the search says so.
_FEW_ERRORS = 10
# How a stopped, non-finite training step is recognised in the error of
# either backend (TensorFlow escapes the quotes in the rest of the message).
_NON_FINITE_MARK = NON_FINITE_TRAINING_MESSAGE.split(",")[0]


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What `search` chose, and every trial's numbers.

    Attributes:
        best: dict `{"length_scale": float, "gradient_penalty": float}`, the
            choice, ready for `keras_duq.wrap(backbone, num_classes,
            **result.best)`.
        trials: list of dicts, one per trained model, in training order:
            `"trial"` (1-based), `"stage"` (`1`: length scale, penalty off;
            `2`: penalty), `"length_scale"`, `"gradient_penalty"`,
            `"val_accuracy"`, `"val_misclassification_auroc"` (`nan` when
            every validation prediction is right, or every one wrong),
            `"val_errors"` (wrong validation predictions), `"diverged"`
            (training stopped at a non-finite step; its metrics are `nan`
            and `"val_errors"` is `-1`) and `"seconds"` (training and
            validation time).
        seed: int, the seed every trial started from.

    Example:

    ```python
    result = keras_duq.tuning.search(build_backbone, x, y,
                                     validation_data=(x_val, y_val),
                                     num_classes=10)
    print(result.summary())
    result.best_trial["val_accuracy"]
    json.dump({"best": result.best, "trials": result.trials}, file)
    ```
    """

    best: dict[str, float]
    trials: list[dict[str, Any]]
    seed: int

    @property
    def best_trial(self) -> dict[str, Any]:
        """The trial whose hyperparameters are `best`."""
        for trial in self.trials:
            if all(trial[key] == self.best[key] for key in SEARCHED):
                return trial
        raise ValueError(f"No trial has the hyperparameters {self.best}.")

    def summary(self) -> str:
        """The trials as a text table, the chosen one marked with `*`."""
        best = self.best_trial
        lines = [
            "trial stage length_scale gradient_penalty val_accuracy "
            "val_misclassification_auroc seconds"
        ]
        for trial in self.trials:
            lines.append(
                f"{trial['trial']:>5} {trial['stage']:>5} "
                f"{trial['length_scale']:>12g} {trial['gradient_penalty']:>16g} "
                f"{trial['val_accuracy']:>12.4f} "
                f"{trial['val_misclassification_auroc']:>27.4f} "
                f"{trial['seconds']:>7.1f}" + (" *" if trial is best else "")
            )
        return "\n".join(lines)


def search(
    build_backbone: Callable[[], Any],
    x: Any,
    y: ArrayLike,
    *,
    validation_data: tuple[Any, ArrayLike],
    num_classes: int,
    length_scales: Sequence[float] | None = None,
    gradient_penalties: Sequence[float] | None = None,
    max_trials: int | None = None,
    epochs: int = 5,
    batch_size: int = 64,
    optimizer: Callable[[], keras.optimizers.Optimizer] | None = None,
    accuracy_tolerance: float = DEFAULT_ACCURACY_TOLERANCE,
    seed: int | None = None,
    verbose: int = 1,
    **wrap_kwargs: Any,
) -> SearchResult:
    """Chooses the length scale and the gradient penalty on validation data.

    Two stages, as in the paper, on in-distribution validation data only:

    1. For each length scale, a fresh model trained with the penalty off
       (`gradient_penalty=0`); the length scale with the highest validation
       accuracy wins. Ties go to the higher misclassification AUROC, then to
       the smaller length scale.
    2. With that length scale, for each penalty weight, a fresh model; among
       the weights whose validation accuracy is within `accuracy_tolerance`
       of the best accuracy at that length scale (stage 1's included), the
       one with the highest misclassification AUROC of the certainty wins
       (ties: higher accuracy, then the smaller weight). A weight of `0` in
       `gradient_penalties` reuses stage 1's model.

    Every trial starts from the same seed, so trials differ by their
    hyperparameters, not by their initial weights or data order (an
    initializer instance in `wrap_kwargs` is copied for each trial, so that
    it too draws from the seed). The search trains one model per length
    scale and one per non-zero penalty weight, `epochs` epochs each, and
    returns the choice, not a model: wrap a fresh backbone with
    `result.best` and train it in full.

    The search sets the global random seeds (`keras.utils.set_random_seed`)
    before each trial. It does not call `keras.backend.clear_session()`,
    which would also reset global settings such as the dtype policy; each
    trial's model is released before the next is built.

    Example:

    ```python
    result = keras_duq.tuning.search(
        build_backbone, x_train, y_train,
        validation_data=(x_val, y_val), num_classes=10,
        epochs=5, optimizer=lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        centroid_dims=256, momentum=0.999,
    )
    result.best    # {"length_scale": ..., "gradient_penalty": ...}
    model = keras_duq.wrap(
        build_backbone(), num_classes=10,
        centroid_dims=256, momentum=0.999, **result.best,
    )
    ```

    Args:
        build_backbone: a callable without arguments that returns a new,
            untrained backbone (what `keras_duq.wrap` takes) on every call.
        x: training inputs: an array, or a list or dict of arrays, as
            `model.fit` takes them.
        y: training labels: class indices `(n,)` or `(n, 1)`, or one-hot
            `(n, num_classes)`.
        validation_data: tuple `(x_val, y_val)` of in-distribution
            validation inputs and labels, in the same forms as `x` and `y`.
            The choice is made on these only.
        num_classes: int >= 2, number of classes.
        length_scales: the length scales of stage 1, floats > 0. Defaults to
            `(0.05, 0.1, 0.2, 0.3, 0.5, 1.0)`, roughly log-spaced over the
            paper's interval `(0, 1]`.
        gradient_penalties: the penalty weights of stage 2, floats >= 0.
            Defaults to `(0.05, 0.1, 0.2, 0.3, 0.5, 1.0)`, the weights of the
            paper's FashionMNIST table without `0`.
        max_trials: optional int >= 2, the most models to train. Default
            grids are thinned to fit it (evenly, ends kept); grids passed
            explicitly are kept whole, and an error is raised when they do
            not fit. `None` (default): the grids as they are.
        epochs: int >= 1, training epochs per trial. Defaults to `5`.
        batch_size: int >= 1. Defaults to `64`, the paper's.
        optimizer: a callable without arguments returning a new optimizer
            for each trial, e.g. `lambda: keras.optimizers.SGD(0.05,
            momentum=0.9)`; pass the one the final model will train with.
            `None` (default): `keras.optimizers.Adam()` at its default
            learning rate, which needs no tuning to the backbone's scale.
        accuracy_tolerance: float in `[0, 1]`, the validation accuracy a
            penalty weight may cost. Defaults to `0.01`.
        seed: optional int, the seed of every trial. `None` (default): one
            drawn at random, returned as `result.seed`.
        verbose: `0` (silent), `1` (default, one line per trial) or `2`
            (also `fit`'s line per epoch).
        **wrap_kwargs: any other argument of `keras_duq.wrap`
            (`centroid_dims`, `momentum`, `weight_decay`, ...), the same for
            every trial.

    Returns:
        A `SearchResult`: `result.best` (the choice), `result.trials` (every
        trial's numbers), `result.seed` and `result.summary()`.
    """
    # A Keras model is callable too, but calling it runs it on inputs.
    if not callable(build_backbone) or isinstance(build_backbone, keras.layers.Layer):
        raise ValueError(
            "Expected `build_backbone` to be a function that returns a new "
            "backbone on every call (not a backbone itself), e.g. `lambda: "
            "keras.Sequential([...])`. Received: "
            f"`build_backbone={build_backbone!r}`"
        )
    check_wrap_kwargs(wrap_kwargs)
    check_int("num_classes", num_classes, minimum=2)
    num_examples = check_inputs("x", x)
    check_labels("y", y, num_examples, num_classes)
    x_val, y_val = check_validation_data(validation_data, num_classes)
    y_val = class_indices(y_val)
    length_scales, gradient_penalties = _grids(
        length_scales, gradient_penalties, max_trials
    )
    check_positive_int("epochs", epochs)
    check_positive_int("batch_size", batch_size)
    if optimizer is not None and not callable(optimizer):
        raise ValueError(
            "Expected `optimizer` to be a callable returning a new optimizer "
            "for each trial, e.g. `lambda: keras.optimizers.SGD(0.05, "
            "momentum=0.9)`, or `None`. Received: "
            f"`optimizer={optimizer!r}`"
        )
    if isinstance(accuracy_tolerance, bool) or not (
        isinstance(accuracy_tolerance, (int, float)) and 0 <= accuracy_tolerance <= 1
    ):
        raise ValueError(
            "Expected `accuracy_tolerance` to be a float in [0, 1], the "
            "validation accuracy a penalty may cost. Received: "
            f"`accuracy_tolerance={accuracy_tolerance!r}`"
        )
    if seed is not None:
        check_int("seed", seed, minimum=0)
    if verbose not in (0, 1, 2):
        raise ValueError(
            f"Expected `verbose` to be 0, 1 or 2. Received: `verbose={verbose!r}`"
        )
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    trainer = _Trainer(
        build_backbone,
        num_classes,
        wrap_kwargs,
        optimizer or keras.optimizers.Adam,
        (x, y),
        (x_val, y_val),
        epochs,
        batch_size,
        seed,
        verbose,
        total=len(length_scales) + sum(1 for gp in gradient_penalties if gp > 0),
    )
    with quiet_retracing():
        trainer.check(length_scales[0], max(gradient_penalties))
        stage_1 = [trainer.run(1, length_scale, 0.0) for length_scale in length_scales]
        chosen = _choose_length_scale(stage_1)
        candidates = [
            chosen
            if gradient_penalty == 0
            else trainer.run(2, chosen["length_scale"], gradient_penalty)
            for gradient_penalty in gradient_penalties
        ]
    best = _choose_gradient_penalty(candidates, chosen, accuracy_tolerance)
    return SearchResult(
        best={key: best[key] for key in SEARCHED}, trials=trainer.trials, seed=seed
    )


@dataclasses.dataclass
class _Trainer:
    """Trains and validates the search's models, all but two settings fixed."""

    build_backbone: Callable
    num_classes: int
    wrap_kwargs: dict
    make_optimizer: Callable
    train: tuple
    validation: tuple
    epochs: int
    batch_size: int
    seed: int
    verbose: int
    total: int
    trials: list = dataclasses.field(default_factory=list)
    # Weak references, so that earlier backbones are freed yet a backbone
    # returned twice is recognised (a live object is the one referenced).
    backbones: list = dataclasses.field(default_factory=list)

    def model(self, length_scale: float, gradient_penalty: float) -> keras.Model:
        backbone = self.build_backbone()
        if any(reference() is backbone for reference in self.backbones):
            raise ValueError(
                "`build_backbone` returned a backbone it had returned before, "
                "so each trial would go on training the previous trial's "
                "weights. Build the backbone inside the function, e.g. `def "
                "build_backbone(): return keras.Sequential([...])`. Received: "
                f"backbone {getattr(backbone, 'name', backbone)!r}"
            )
        self.backbones.append(weakref.ref(backbone))
        # An initializer instance drew its seed when it was made; a copy made
        # now draws it from the trial's seed, as one given by name does.
        wrap_kwargs = {
            key: value.__class__.from_config(value.get_config())
            if isinstance(value, keras.initializers.Initializer)
            else value
            for key, value in self.wrap_kwargs.items()
        }
        model = wrap(
            backbone,
            self.num_classes,
            length_scale=length_scale,
            gradient_penalty=gradient_penalty,
            **wrap_kwargs,
        )
        optimizer = self.make_optimizer()
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "Expected `optimizer` to return a new Keras optimizer on each "
                "call, e.g. `lambda: keras.optimizers.SGD(0.05, momentum=0.9)`. "
                f"Received: it returned {optimizer!r}"
            )
        model.compile(optimizer=optimizer)
        return model

    def check(self, length_scale: float, gradient_penalty: float) -> None:
        """Builds one model and predicts two validation examples, so that a
        backbone, `wrap` argument or input that does not fit fails before
        any training and before the seeds are set."""
        model = self.model(length_scale, gradient_penalty)
        model.predict(
            keras.tree.map_structure(lambda array: array[:2], self.validation[0]),
            verbose=0,
        )

    def run(
        self, stage: int, length_scale: float, gradient_penalty: float
    ) -> dict[str, Any]:
        keras.utils.set_random_seed(self.seed)
        start = time.perf_counter()
        model = self.model(length_scale, gradient_penalty)
        trial = {
            "trial": len(self.trials) + 1,
            "stage": stage,
            "length_scale": float(length_scale),
            "gradient_penalty": float(gradient_penalty),
        }
        try:
            model.fit(
                *self.train,
                epochs=self.epochs,
                batch_size=self.batch_size,
                verbose=2 if self.verbose == 2 else 0,
            )
        except Exception as error:  # the backends raise different types
            if _NON_FINITE_MARK not in str(error):
                raise
            trial.update(_metrics(None, None), diverged=True)
        else:
            x_val, y_val = self.validation
            kernel_values = model.predict(
                x_val, batch_size=max(self.batch_size, 256), verbose=0
            )
            trial.update(_metrics(kernel_values, y_val), diverged=False)
        trial["seconds"] = round(time.perf_counter() - start, 2)
        del model
        gc.collect()
        self.trials.append(trial)
        if self.verbose:
            print(_trial_line(trial, self.total))
        return trial


def _metrics(kernel_values, labels):
    nan = float("nan")
    if kernel_values is None or not np.all(np.isfinite(kernel_values)):
        return {
            "val_accuracy": nan,
            "val_misclassification_auroc": nan,
            "val_errors": -1,
        }
    correct = kernel_values.argmax(axis=1) == labels
    # Undefined (nan) when every prediction is right or every one wrong.
    auroc = (
        nan
        if correct.all() or not correct.any()
        else misclassification_auroc(kernel_values.max(axis=1), correct)
    )
    return {
        "val_accuracy": float(correct.mean()),
        "val_misclassification_auroc": auroc,
        "val_errors": int((~correct).sum()),
    }


def _finite_or(value, fallback):
    return value if math.isfinite(value) else fallback


def _finished(trials, what, key, argument):
    """The trials that did not diverge; raises if there are none."""
    finished = [trial for trial in trials if not trial["diverged"]]
    if not finished:
        raise RuntimeError(
            f"Every {what}'s training stopped at a non-finite step "
            f"({NON_FINITE_TRAINING_MESSAGE}) Received: "
            f"`{argument}={[trial[key] for trial in trials]}`"
        )
    return finished


def _choose_length_scale(stage_1):
    return max(
        _finished(stage_1, "length scale", "length_scale", "length_scales"),
        key=lambda trial: (
            trial["val_accuracy"],
            _finite_or(trial["val_misclassification_auroc"], -math.inf),
            -trial["length_scale"],
        ),
    )


def _choose_gradient_penalty(candidates, stage_1_trial, tolerance):
    finished = _finished(
        candidates, "penalty weight", "gradient_penalty", "gradient_penalties"
    )
    reference = max(trial["val_accuracy"] for trial in finished + [stage_1_trial])
    eligible = [t for t in finished if t["val_accuracy"] >= reference - tolerance]
    if not eligible:
        warnings.warn(
            "Every penalty weight cost more than `accuracy_tolerance` of "
            f"validation accuracy (best {reference:.4f}); the most accurate "
            "one is chosen. Try smaller weights or more `epochs`. Received: "
            f"`accuracy_tolerance={tolerance}`",
            UserWarning,
            stacklevel=3,
        )
        top = max(trial["val_accuracy"] for trial in finished)
        eligible = [t for t in finished if t["val_accuracy"] == top]
    if not any(math.isfinite(t["val_misclassification_auroc"]) for t in eligible):
        warnings.warn(
            "The misclassification AUROC is undefined for every penalty "
            "weight: their validation predictions are all right (or all "
            "wrong), so the certainty cannot be judged on them and the most "
            "accurate weight is chosen. Use more validation data, or data "
            "with some hard examples.",
            UserWarning,
            stacklevel=3,
        )
    best = max(
        eligible,
        key=lambda trial: (
            _finite_or(trial["val_misclassification_auroc"], -math.inf),
            trial["val_accuracy"],
            -trial["gradient_penalty"],
        ),
    )
    if 0 < best["val_errors"] < _FEW_ERRORS:
        warnings.warn(
            f"The chosen penalty weight's misclassification AUROC rests on "
            f"{best['val_errors']} wrong validation "
            f"prediction{'s' if best['val_errors'] > 1 else ''}, too few to "
            "tell penalty weights apart reliably. Use more validation data "
            f"(at least {_FEW_ERRORS} wrong predictions) for a firmer choice.",
            UserWarning,
            stacklevel=3,
        )
    return best


def _trial_line(trial, total):
    outcome = (
        "stopped at a non-finite step"
        if trial["diverged"]
        else f"val_accuracy {trial['val_accuracy']:.4f}, val misclassification "
        f"AUROC {trial['val_misclassification_auroc']:.4f}"
    )
    return (
        f"Trial {trial['trial']}/{total} (stage {trial['stage']}): length_scale="
        f"{trial['length_scale']:g}, gradient_penalty={trial['gradient_penalty']:g}: "
        f"{outcome} ({trial['seconds']:.1f} s)"
    )


def _grids(length_scales, gradient_penalties, max_trials):
    """The two stages' grids, default ones thinned to `max_trials`."""
    explicit_ls = length_scales is not None
    explicit_gp = gradient_penalties is not None
    length_scales = _grid(
        "length_scales",
        DEFAULT_LENGTH_SCALES if length_scales is None else length_scales,
        positive=True,
    )
    gradient_penalties = _grid(
        "gradient_penalties",
        DEFAULT_GRADIENT_PENALTIES
        if gradient_penalties is None
        else gradient_penalties,
        positive=False,
    )
    if max_trials is None:
        return length_scales, gradient_penalties
    check_int("max_trials", max_trials, minimum=2)
    # A zero weight reuses stage 1's model: no trial of its own.
    trained = lambda grid: sum(1 for value in grid if value > 0)  # noqa: E731
    if explicit_ls and explicit_gp:
        needed = len(length_scales) + trained(gradient_penalties)
        if needed > max_trials:
            raise ValueError(
                f"The grids need {needed} trials, more than `max_trials`. Pass "
                "shorter grids, a larger `max_trials`, or leave one grid to "
                f"its default (thinned to fit). Received: `max_trials={max_trials}`, "
                f"`length_scales={length_scales}`, "
                f"`gradient_penalties={gradient_penalties}`"
            )
        return length_scales, gradient_penalties
    if explicit_ls:
        budget = max_trials - len(length_scales)
        name, other = "length_scales", length_scales
    elif explicit_gp:
        budget = max_trials - trained(gradient_penalties)
        name, other = "gradient_penalties", gradient_penalties
    else:
        stage_1 = (max_trials + 1) // 2
        return _thin(length_scales, stage_1), _thin(
            gradient_penalties, max_trials - stage_1
        )
    if budget < 1:
        raise ValueError(
            f"`{name}` alone needs all {max_trials} trials, leaving none for "
            "the other stage. Pass a larger `max_trials` or a shorter grid. "
            f"Received: `max_trials={max_trials}`, `{name}={other}`"
        )
    if explicit_ls:
        return length_scales, _thin(gradient_penalties, budget)
    return _thin(length_scales, budget), gradient_penalties


def _thin(grid, count):
    """`count` values of `grid`, evenly spaced by position, ends kept."""
    if count >= len(grid):
        return grid
    if count == 1:
        return [grid[len(grid) // 2]]
    positions = np.linspace(0, len(grid) - 1, count).round().astype(int)
    return [grid[i] for i in positions]


def _grid(name, values, positive):
    bound = "> 0" if positive else ">= 0"
    try:
        grid = [float(value) for value in values]
    except (TypeError, ValueError):
        grid = []
    if not grid or any(
        not math.isfinite(v) or v < 0 or (positive and v == 0) for v in grid
    ):
        raise ValueError(
            f"Expected `{name}` to be a non-empty list of finite floats "
            f"{bound}. Received: `{name}={values!r}`"
        )
    if len(set(grid)) != len(grid):
        raise ValueError(
            f"`{name}` repeats a value; each is trained once. Received: "
            f"`{name}={values!r}`"
        )
    return grid


# Checks of `search`'s arguments, raised before any training.

# The arguments `search` chooses itself.
SEARCHED = ("length_scale", "gradient_penalty")


def check_wrap_kwargs(wrap_kwargs):
    searched = [key for key in SEARCHED if key in wrap_kwargs]
    if searched:
        raise ValueError(
            f"`search` chooses {' and '.join(f'`{key}`' for key in searched)} "
            "itself, so it cannot be held fixed. Pass the values to try as "
            "`length_scales=[...]` or `gradient_penalties=[...]` instead. "
            f"Received: {', '.join(f'`{k}={wrap_kwargs[k]!r}`' for k in searched)}"
        )
    accepted = [name for name in argument_names() if name not in SEARCHED]
    unknown = [key for key in wrap_kwargs if key not in accepted]
    if unknown:
        raise ValueError(
            f"Unknown argument(s) {unknown}: `search` passes its other keyword "
            f"arguments to `keras_duq.wrap`, which takes {accepted}. Received: "
            + ", ".join(f"`{k}={wrap_kwargs[k]!r}`" for k in unknown)
        )


def check_inputs(name, x):
    """Returns the number of examples in `x`, checking its arrays agree."""
    leaves = keras.tree.flatten(x)
    lengths = {len(leaf) for leaf in leaves if hasattr(leaf, "__len__")}
    if (
        not leaves
        or len(lengths) != 1
        or len(leaves) != sum(hasattr(leaf, "__len__") for leaf in leaves)
    ):
        raise ValueError(
            f"Expected `{name}` to be an array (or a list or dict of arrays "
            "with one row per example, all of the same length). Received: "
            f"`{name}` of type {type(x).__name__}"
            + (f" with lengths {sorted(lengths)}" if lengths else "")
        )
    for leaf in leaves:
        bad = non_finite_rows(leaf)
        if bad.size:
            raise ValueError(
                f"`{name}` contains NaN or infinite values. Clean or impute "
                "the data before the search (e.g. `np.nan_to_num`). Received: "
                f"{bad.size} example(s) with non-finite values, the first at "
                f"index {int(bad[0])}"
            )
    (num_examples,) = lengths
    if num_examples == 0:
        raise ValueError(f"`{name}` is empty. Received: `{name}` with 0 examples")
    return num_examples


def check_labels(name, y, num_examples, num_classes):
    y = np.asarray(y)
    one_hot = y.ndim == 2 and y.shape[1] == num_classes
    if len(y) != num_examples or not (
        y.ndim == 1 or (y.ndim == 2 and (y.shape[1] == 1 or one_hot))
    ):
        raise ValueError(
            f"Expected `{name}` to hold one label per example ({num_examples}): "
            f"class indices of shape ({num_examples},) or ({num_examples}, 1), "
            f"or one-hot of shape ({num_examples}, {num_classes}). Received: "
            f"`{name}` of shape {y.shape}"
        )
    if not np.issubdtype(y.dtype, np.number):
        raise ValueError(
            f"Expected numeric labels in `{name}`. Received: dtype {y.dtype}"
        )
    indices = y.argmax(axis=1) if one_hot else y.reshape(-1)
    if not np.all(
        (indices == np.round(indices)) & (indices >= 0) & (indices < num_classes)
    ):
        raise ValueError(
            f"Expected `{name}` to hold class indices in [0, {num_classes}) "
            f"(`num_classes={num_classes}`). Received: labels "
            f"{np.unique(indices)[:10]}"
        )


def check_validation_data(validation_data, num_classes):
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) != 2:
        raise ValueError(
            "Expected `validation_data` to be a tuple `(x_val, y_val)` of "
            "in-distribution validation inputs and labels. Received: "
            f"`validation_data` of type {type(validation_data).__name__}"
        )
    x_val, y_val = validation_data
    num_examples = check_inputs("validation_data[0]", x_val)
    check_labels("validation_data[1]", y_val, num_examples, num_classes)
    return x_val, y_val


def class_indices(y):
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] > 1:
        return y.argmax(axis=1)
    return y.reshape(-1).astype("int64")

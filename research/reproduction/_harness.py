"""What the image experiments share: research/reproduction/fashion_mnist.py and cifar10.py.

Both train DUQ or the softmax / deep ensemble baselines, resumably, then
measure how well the certainty separates an in-distribution test set from
an OoD one and write `results.json`, the figures and one summary line. This
module holds that common frame: the shared command-line flags, the Keras
state each model starts from, the resumable training loop and its epoch
log, the evaluation of predicted scores, the figures and the results file.
What differs (data, networks, schedules) stays in each script and comes in
as plain arguments.

Imports neither TensorFlow nor tf.data: FashionMNIST also runs on the JAX
backend without TensorFlow installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import time

import keras
import numpy as np

import keras_duq

# The paper's SGD for both (Appendix A).
LEARNING_RATE = 0.05
SGD_MOMENTUM = 0.9
MIXED_PRECISION_POLICIES = ("none", "mixed_float16", "mixed_bfloat16")
MODEL_LABELS = {"duq": "DUQ", "softmax": "softmax", "ensemble": "deep ensemble"}

# Flags with the same meaning and help in both scripts; each script adds
# them where its `--help` lists them.
SHARED_ARGUMENTS = {
    "--centroid-momentum": dict(
        type=float,
        default=0.999,
        help="DUQ's gamma, momentum of the centroid moving average.",
    ),
    "--bias-correction": dict(
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Bias-correct the centroid moving average (keras_duq.DUQOutput).",
    ),
    "--head": dict(
        choices=("auto", "per_class", "shared"),
        default="auto",
        help="DUQ's head (keras_duq.DUQOutput's head): the paper's per-class "
        "projections, one shared projection, or 'auto' (the library's rule).",
    ),
    "--max-steps-per-epoch": dict(
        type=int,
        default=None,
        help="Cap the steps per epoch (smoke runs).",
    ),
    "--mixed-precision": dict(
        nargs="?",
        const="mixed_float16",
        default="none",
        choices=MIXED_PRECISION_POLICIES,
        help="Keras dtype policy for the backbone ('--mixed-precision' alone: "
        "mixed_float16). DUQ's head always computes in float32.",
    ),
}


# ------------------------------------------------------------ arguments


def new_parser(description: str) -> argparse.ArgumentParser:
    """A parser that shows the defaults, with the `--model` flag."""
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", choices=("duq", "softmax", "ensemble"), default="duq"
    )
    return parser


def add_arguments(parser: argparse.ArgumentParser, *flags: str) -> None:
    """Adds `flags`, names of `SHARED_ARGUMENTS`, in that order."""
    for flag in flags:
        parser.add_argument(flag, **SHARED_ARGUMENTS[flag])


def add_run_arguments(parser: argparse.ArgumentParser, ood_name: str) -> None:
    """`--ood-eval-every`, `--tensorboard`, `--backup-dir` and `--jit-compile`."""
    parser.add_argument(
        "--ood-eval-every",
        type=int,
        default=5,
        help=f"Log OoD metrics vs. {ood_name} every N epochs during training "
        "(keras_duq.callbacks.OODEvaluation); 0 turns it off. Logged only, "
        "never used for model selection.",
    )
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="Write TensorBoard logs (OoD metrics included) to OUTPUT_DIR/logs.",
    )
    parser.add_argument(
        "--backup-dir",
        default=None,
        help="Back up the training state here after every epoch "
        "(keras.callbacks.BackupAndRestore) and log each epoch to "
        "epochs.jsonl; rerunning the same command resumes from the last "
        "finished epoch.",
    )
    parser.add_argument(
        "--jit-compile",
        choices=("auto", "true", "false"),
        default="auto",
        help="XLA compilation, passed to `Model.compile` (auto: Keras's choice, "
        "XLA on GPUs, not on CPUs).",
    )


def check_tensorboard(parser: argparse.ArgumentParser, args) -> None:
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        parser.error("--tensorboard needs the `tensorboard` package installed")


# --------------------------------------------------------------- models


def pytorch_default_initializer() -> keras.initializers.Initializer:
    """PyTorch's default for conv and linear kernels (the paper's "default in
    PyTorch"): uniform in +-1/sqrt(fan_in).

    A new instance per layer, created after `set_random_seed`: an instance
    made at import time would draw its seed before the script sets one, and
    `--seed` would not fix the initial weights.
    """
    return keras.initializers.VarianceScaling(
        scale=1.0 / 3.0, mode="fan_in", distribution="uniform"
    )


def set_initial_centroids(head, stddev: float, seed) -> None:
    """Redraws a built `DUQOutput`'s initial centroids `m / N` from
    normal(0, stddev), keeping the counts `N` (keras_duq draws them from
    normal(0, 1), the FashionMNIST code's choice; the state is plain
    variables, so it is set after building)."""
    counts = keras.ops.convert_to_numpy(head.centroid_counts)  # per class
    draw = keras.random.normal(head.centroid_sums.shape, stddev=stddev, seed=seed)
    head.centroid_sums.assign(counts * keras.ops.convert_to_numpy(draw))


def pytorch_batch_normalization(regularizer=None, name=None):
    """BatchNormalization with PyTorch's momentum and epsilon, as the paper's
    code; `regularizer` on its scale and offset."""
    return keras.layers.BatchNormalization(
        momentum=0.9,
        epsilon=1e-5,
        gamma_regularizer=regularizer,
        beta_regularizer=regularizer,
        name=name,
    )


def compile_softmax(model: keras.Model, optimizer, args) -> keras.Model:
    """Compiles a softmax baseline: cross-entropy, accuracy, `--jit-compile`."""
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=jit_compile_argument(args),
    )
    return model


def step_decay_schedule(steps_per_epoch: int, decay_epochs, rate):
    """A learning rate that drops at the start of each epoch of `decay_epochs`.

    `rate(i)` is the learning rate after `i` drops. Without drops, the
    constant `rate(0)`.
    """
    # The schedule keeps a value while `step <= boundary`, and the first step
    # of epoch e (0-based) is e * steps_per_epoch: hence the -1.
    boundaries = [e * steps_per_epoch - 1 for e in decay_epochs]
    if not boundaries:
        return rate(0)
    return keras.optimizers.schedules.PiecewiseConstantDecay(
        boundaries, [rate(i) for i in range(len(boundaries) + 1)]
    )


def set_dtype_policy(mixed_precision: str):
    keras.mixed_precision.set_global_policy(
        "float32" if mixed_precision == "none" else mixed_precision
    )


def jit_compile_argument(args):
    """`--jit-compile` as `Model.compile` takes it."""
    return {"auto": "auto", "true": True, "false": False}[args.jit_compile]


def fresh_keras_state(args, seed: int) -> None:
    """Clears Keras's state, then sets `--mixed-precision` and the seed.

    Keras's layer-name counters and other global state survive
    `set_random_seed`; `clear_session` also resets the dtype policy, so the
    policy is set after it.
    """
    keras.backend.clear_session()
    set_dtype_policy(args.mixed_precision)
    keras.utils.set_random_seed(seed)


def certainty_method(model: str) -> str:
    """DUQ's certainty is the largest kernel value; the softmax baselines use
    the negative entropy of the (averaged) prediction, as the paper does."""
    return "max" if model == "duq" else "negative_entropy"


# ------------------------------------------------------------- training


class EpochLog(keras.callbacks.Callback):
    """Appends each finished epoch (its seconds and logs) to a JSON-lines file.

    With `BackupAndRestore`, a resumed run's `History` holds only the epochs
    of its own process; this file holds all of them.
    """

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        record = {
            "epoch": epoch + 1,
            "seconds": time.perf_counter() - self._start,
            "logs": {k: float(v) for k, v in (logs or {}).items()},
        }
        with open(self.path, "a") as file:
            file.write(json.dumps(record) + "\n")


def read_epoch_log(path: str) -> list:
    """Records of `EpochLog`, the last one per epoch (a resumed run may
    repeat an epoch that was cut off before its backup)."""
    if not os.path.exists(path):
        return []
    with open(path) as file:
        records = [json.loads(line) for line in file if line.strip()]
    return sorted({r["epoch"]: r for r in records}.values(), key=lambda r: r["epoch"])


def train_model(
    model, make_dataset, args, steps_per_epoch, seed, callbacks=(), backup_dir=None
):
    """Fits one model; returns its per-epoch history and training seconds.

    `make_dataset(seed)` builds the training pipeline, repeated, reshuffling
    itself every pass. With `backup_dir`, the training state is backed up
    after every epoch and a rerun resumes from the last finished one.
    """
    callbacks = list(callbacks)
    epoch_log = None
    done = 0
    if backup_dir:
        os.makedirs(backup_dir, exist_ok=True)
        epoch_log = os.path.join(backup_dir, "epochs.jsonl")
        state_dir = os.path.join(backup_dir, "state")
        if not os.path.exists(state_dir) and os.path.exists(epoch_log):
            os.remove(epoch_log)  # a log without its state is stale
        done = len(read_epoch_log(epoch_log))
        callbacks += [
            # Kept after the last epoch: rerunning a finished run then only
            # evaluates it.
            keras.callbacks.BackupAndRestore(state_dir, delete_checkpoint=False),
            EpochLog(epoch_log),
        ]
    # A resumed run must not replay the first epochs' data order.
    dataset = make_dataset(seed + 1000 * done)
    start = time.perf_counter()
    history = model.fit(
        dataset,
        epochs=args.epochs,
        steps_per_epoch=steps_per_epoch,
        # The dataset reshuffles itself every pass.
        shuffle=False,
        callbacks=callbacks,
        verbose=args.verbose,
    )
    seconds = time.perf_counter() - start
    if epoch_log is None:
        history = {k: [float(v) for v in vs] for k, vs in history.history.items()}
        return history, seconds
    records = read_epoch_log(epoch_log)
    history = {}
    for record in records:
        for key, value in record["logs"].items():
            history.setdefault(key, []).append(value)
    return history, sum(r["seconds"] for r in records)


def training_callbacks(args, method, log_dir, ood_data, **ood_options) -> list:
    """OoD metrics every `--ood-eval-every` epochs, and `--tensorboard`'s logs.

    `ood_data()` gives the in-distribution and OoD evaluation data; it is
    called only when the metrics are on. `ood_options` go to `OODEvaluation`.
    """
    callbacks = []
    if args.ood_eval_every:
        in_distribution, out_of_distribution = ood_data()
        callbacks.append(
            keras_duq.callbacks.OODEvaluation(
                in_distribution=in_distribution,
                out_of_distribution=out_of_distribution,
                every_n_epochs=args.ood_eval_every,
                method=method,
                **ood_options,
            )
        )
    if args.tensorboard:
        # After OODEvaluation, so that it sees the ood_* values.
        callbacks.append(keras.callbacks.TensorBoard(log_dir))
    return callbacks


def train_members(args, build_model, make_dataset, steps_per_epoch, make_callbacks):
    """Builds and fits the `--model`: one model, or each member of an ensemble.

    Args:
        args: the parsed command line.
        build_model: `build_model(args, steps_per_epoch, seed)`, compiled.
        make_dataset: `make_dataset(seed)`, see `train_model`.
        steps_per_epoch: int.
        make_callbacks: `make_callbacks(log_dir)`, one model's callbacks.

    Returns:
        The models, the history (a list of one per member for an ensemble)
        and the training seconds of all of them.
    """
    num_models = args.ensemble_size if args.model == "ensemble" else 1
    log_dir = os.path.join(args.output_dir, "logs")
    models, histories = [], []
    train_time = 0.0
    for index in range(num_models):
        # Ensemble members differ by their initialisation and data order.
        seed = args.seed + index
        model = build_model(args, steps_per_epoch, seed)
        callbacks = make_callbacks(
            log_dir if num_models == 1 else os.path.join(log_dir, f"member_{index}")
        )
        backup_dir = None
        if args.backup_dir:
            backup_dir = os.path.join(args.backup_dir, f"member_{index}")
        history, seconds = train_model(
            model, make_dataset, args, steps_per_epoch, seed, callbacks, backup_dir
        )
        histories.append(history)
        train_time += seconds
        models.append(model)
    return models, histories[0] if num_models == 1 else histories, train_time


# ----------------------------------------------------------- evaluation


def predict(models, x, batch_size=None):
    """Scores of one model, or the averaged probabilities of an ensemble."""
    return np.mean(
        [m.predict(x, batch_size=batch_size, verbose=0) for m in models], axis=0
    )


def evaluate_scores(
    method,
    test_scores,
    test_labels,
    ood_scores,
    validation=None,
    misclassification_auroc=keras_duq.evaluation.misclassification_auroc,
):
    """Accuracy, OoD metrics and rejection curve of predicted scores.

    Args:
        method: the certainty method, as `certainty_method` gives it.
        test_scores, test_labels: the in-distribution test set's scores
            `(n, classes)` and labels `(n,)`.
        ood_scores: the OoD test set's scores.
        validation: `(scores, labels)` of held-out training images, or `None`.
        misclassification_auroc: `f(certainty, correct)`.

    Returns:
        The results, the test and OoD certainties (for the plots) and the
        rejection curve.
    """
    in_certainty = keras_duq.evaluation.certainty_scores(test_scores, method)
    ood_certainty = keras_duq.evaluation.certainty_scores(ood_scores, method)
    correct = test_scores.argmax(axis=1) == test_labels
    results = {"accuracy": float(correct.mean())}
    results.update(keras_duq.evaluation.ood_metrics(in_certainty, ood_certainty))
    if method != "max":
        # Also the maximum softmax probability, the other usual certainty.
        results["auroc_max_probability"] = keras_duq.evaluation.ood_metrics(
            keras_duq.evaluation.certainty_scores(test_scores),
            keras_duq.evaluation.certainty_scores(ood_scores),
        )["auroc"]
    results["misclassification_auroc"] = misclassification_auroc(in_certainty, correct)
    if validation is not None:
        # How the paper chooses lambda: no OoD data, only how well the
        # certainty tells right from wrong predictions on held-out images.
        val_scores, val_labels = validation
        val_correct = val_scores.argmax(axis=1) == val_labels
        results["validation_accuracy"] = float(val_correct.mean())
        results["validation_misclassification_auroc"] = misclassification_auroc(
            keras_duq.evaluation.certainty_scores(val_scores, method), val_correct
        )
    curve = keras_duq.evaluation.rejection_curve(in_certainty, correct, ood_certainty)
    return results, in_certainty, ood_certainty, curve


# -------------------------------------------------------------- outputs


def save_figures(
    output_dir, label, in_certainty, ood_certainty, curve, method, in_name, ood_name
):
    """The paper's Figures 7 and 8 (histograms, rejection curve) and the ROC."""
    import matplotlib.pyplot

    title = f"{label}: {in_name} vs. {ood_name}"
    figures = {
        "roc_curve.png": keras_duq.plots.plot_roc_curve(
            in_certainty, ood_certainty, label=label, title=title
        ),
        "rejection_curve.png": keras_duq.plots.plot_rejection_curve(
            curve, label=label, title=title
        ),
        "certainty_histograms.png": keras_duq.plots.plot_certainty_histograms(
            in_certainty,
            ood_certainty,
            in_label=f"{in_name} (test)",
            ood_label=f"{ood_name} (test)",
            xlabel="max kernel value" if method == "max" else "negative entropy",
            title=title,
        ),
    }
    for name, axes in figures.items():
        axes.figure.savefig(os.path.join(output_dir, name), dpi=120)
        # The plots draw on pyplot figures: close them, runs make many.
        matplotlib.pyplot.close(axes.figure)
    return sorted(figures)


def run_main(run, args) -> dict:
    """`run(args, start)` in `--output-dir`, the dtype policy restored after.

    `start` is the run's start on `time.perf_counter`.
    """
    start = time.perf_counter()
    os.makedirs(args.output_dir, exist_ok=True)
    previous_policy = keras.mixed_precision.global_policy()
    try:
        return run(args, start)
    finally:
        # Leave the process as it was (tests call `main` in-process).
        keras.mixed_precision.set_global_policy(previous_policy)


def finish(
    args,
    results: dict,
    evaluated,
    *,
    names,
    start,
    steps_per_epoch,
    data: dict,
    history,
    train_time,
    versions: dict,
    run: dict | None = None,
) -> dict:
    """Draws the figures, writes `results.json` and prints the summary line.

    Args:
        args: the parsed command line.
        results: the metrics, as `evaluate_scores` gives them (updated in
            place with the rest).
        evaluated: `(in_certainty, ood_certainty, curve)`.
        names: the in-distribution and OoD data's names, for the figures and
            the summary line.
        start: the run's start on `time.perf_counter`.
        steps_per_epoch: int.
        data: what the run trained and evaluated on (sizes, ...), put after
            `steps_per_epoch` in `results.json`.
        history: as `train_members` gives it.
        train_time: seconds, as `train_members` gives them.
        versions: the versions of the software used.
        run: settings that name the run, put after `model`.

    Returns:
        `results`, as written.
    """
    in_certainty, ood_certainty, curve = evaluated
    in_name, ood_name = names
    method = certainty_method(args.model)
    label = MODEL_LABELS[args.model]
    figures = save_figures(
        args.output_dir,
        label,
        in_certainty,
        ood_certainty,
        curve,
        method,
        in_name=in_name,
        ood_name=ood_name,
    )
    results.update(
        {
            "model": args.model,
            **(run or {}),
            "certainty_method": method,
            "seed": args.seed,
            "epochs": args.epochs,
            "steps_per_epoch": steps_per_epoch,
            **data,
            # With --backup-dir: the sum over all (resumed) runs' epochs.
            "train_time_s": train_time,
            "wall_time_s": time.perf_counter() - start,
            "settings": vars(args),
            "versions": versions,
            "history": history,
            "rejection_curve": {k: [float(v) for v in vs] for k, vs in curve.items()},
            "figures": figures,
        }
    )
    with open(os.path.join(args.output_dir, "results.json"), "w") as file:
        # NaN (the rejection curve's last point) is not valid JSON: write null.
        json.dump(nan_to_none(results), file, indent=2)
    print(
        f"{label}: accuracy {results['accuracy']:.4f}, AUROC vs {ood_name} "
        f"{results['auroc']:.4f}, AUPR {results['aupr']:.4f}, FPR@95%TPR "
        f"{results['fpr_at_95_tpr']:.4f}, misclassification AUROC "
        f"{_format(results['misclassification_auroc'])}, "
        f"{results['wall_time_s']:.0f} s -> {args.output_dir}"
    )
    return results


def _format(value):
    return "n/a" if value is None else f"{value:.4f}"


def nan_to_none(value):
    """`value` with every NaN float, at any depth, replaced by `None` (for JSON)."""
    if isinstance(value, dict):
        return {k: nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_to_none(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value

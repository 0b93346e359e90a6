"""FashionMNIST vs. MNIST: the paper's image experiment (Section 4.2).

Trains DUQ (or the softmax / deep ensemble baselines) on FashionMNIST with
the paper's three-layer CNN and settings (Appendix A), then measures how well
the certainty separates the FashionMNIST test set from the MNIST test set.
Writes `results.json` and the ROC, rejection and histogram figures into
`--output-dir`.

    # DUQ, the paper's settings (30 epochs; hours on a laptop CPU)
    python -m reproduction.fashion_mnist --model duq --output-dir outputs/duq \\
        --mnist-path ../shared/data/mnist
    # baselines
    python -m reproduction.fashion_mnist --model softmax --output-dir outputs/softmax
    python -m reproduction.fashion_mnist --model ensemble --output-dir outputs/ensemble
    # quick smoke run
    python -m reproduction.fashion_mnist --epochs 2 --train-subset 3000 \\
        --batch-size 64 --output-dir outputs/smoke

FashionMNIST comes from `keras.datasets.fashion_mnist` (set `KERAS_HOME` to
a folder holding `datasets/fashion-mnist/` to run offline) or from
`--fashion-mnist-path`, MNIST's test set from `--mnist-path` (a folder with
the original IDX files) or, without it, from `keras.datasets.mnist`.

Paper results to compare with (30 epochs, full training set, 5 runs):
DUQ (lambda 0.05) 92.4% accuracy, AUROC 0.955; softmax 92.4%, AUROC 0.843;
5-model deep ensemble 93.6%, AUROC 0.861.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import keras
import numpy as np

import keras_duq

NUM_CLASSES = 10
WEIGHT_DECAY = 1e-4
LEARNING_RATE = 0.05
SGD_MOMENTUM = 0.9
# The learning rate is divided by 5 after every 10 epochs (epochs 10 and 20).
LR_DECAY_FACTOR = 5.0
LR_DECAY_EVERY_EPOCHS = 10
MIXED_PRECISION_POLICIES = ("none", "mixed_float16", "mixed_bfloat16")


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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", choices=("duq", "softmax", "ensemble"), default="duq"
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument(
        "--gradient-penalty",
        type=float,
        default=0.05,
        help="DUQ's lambda (the paper's best on FashionMNIST).",
    )
    parser.add_argument(
        "--penalty-interval",
        type=int,
        default=1,
        help="Compute the penalty on every Nth step only, weighted N times "
        "(keras_duq.DUQModel's penalty_interval); 1 is the paper's exact penalty.",
    )
    parser.add_argument("--length-scale", type=float, default=0.1)
    parser.add_argument(
        "--spectral-normalization",
        type=float,
        default=None,
        metavar="COEFFICIENT",
        help="DUQ: wrap the backbone's convolutions and dense layer with "
        "keras_duq.spectral_normalize(backbone, coefficient=COEFFICIENT)",
    )
    parser.add_argument(
        "--bias-correction",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Bias-correct the centroid moving average (keras_duq.DUQOutput).",
    )
    parser.add_argument(
        "--centroid-momentum",
        type=float,
        default=0.999,
        help="DUQ's gamma, momentum of the centroid moving average.",
    )
    parser.add_argument(
        "--kernel-initializer",
        default="reference",
        help="Initializer of DUQ's projection W: 'reference' (normal, stddev "
        "0.05, as the paper's code) or a Keras initializer name such as "
        "'he_normal' (keras_duq's default).",
    )
    parser.add_argument(
        "--bce-epsilon",
        type=float,
        default=0.0,
        help="Floor of K(1-K) in the cross-entropy gradient: 0 is exact, "
        "1e-12 is PyTorch's binary_cross_entropy as in the paper's code "
        "(see keras_duq.DUQModel).",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--validation-split",
        type=int,
        default=0,
        help="Hold out this many random training images (the paper: 5000) "
        "and report accuracy and misclassification AUROC on them.",
    )
    parser.add_argument("--ensemble-size", type=int, default=5)
    parser.add_argument("--output-dir", default="outputs/fashion_mnist")
    parser.add_argument(
        "--max-steps-per-epoch",
        type=int,
        default=None,
        help="Cap the steps per epoch (smoke runs).",
    )
    parser.add_argument(
        "--train-subset",
        type=int,
        default=None,
        help="Train on this many random training images (smoke runs).",
    )
    parser.add_argument(
        "--test-subset",
        type=int,
        default=None,
        help="Evaluate on the first N images of each test set (smoke runs).",
    )
    parser.add_argument(
        "--mnist-path",
        default=None,
        help="Folder with MNIST's t10k IDX files; default: keras.datasets.mnist.",
    )
    parser.add_argument(
        "--fashion-mnist-path",
        default=None,
        help="Folder with FashionMNIST's IDX files; default: "
        "keras.datasets.fashion_mnist.",
    )
    parser.add_argument(
        "--ood-eval-every",
        type=int,
        default=5,
        help="Log OoD metrics vs. MNIST every N epochs during training "
        "(keras_duq.callbacks.OODEvaluation); 0 turns it off. Logged only, never used "
        "for model selection.",
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
    parser.add_argument(
        "--mixed-precision",
        nargs="?",
        const="mixed_float16",
        default="none",
        choices=MIXED_PRECISION_POLICIES,
        help="Keras dtype policy for the backbone ('--mixed-precision' alone: "
        "mixed_float16). DUQ's head always computes in float32.",
    )
    parser.add_argument("--verbose", type=int, default=2, choices=(0, 1, 2))
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "ensemble_size", "penalty_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("max_steps_per_epoch", "train_subset", "test_subset"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.validation_split < 0 or args.ood_eval_every < 0:
        parser.error("--validation-split and --ood-eval-every must be >= 0")
    if not args.bce_epsilon >= 0:
        parser.error("--bce-epsilon must be >= 0 (0: the exact gradient)")
    if args.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            parser.error("--tensorboard needs the `tensorboard` package installed")
    return args


# ---------------------------------------------------------------- models


def build_backbone(l2: float = 0.0) -> keras.Sequential:
    """The paper's CNN, up to the 256-unit feature layer.

    Three 3x3 convolutions (64, 128, 128 filters; the third unpadded), each
    followed by BatchNorm, ReLU and 2x2 max pooling, then a 256-unit ReLU
    dense layer. BatchNorm uses PyTorch's momentum and epsilon, as the
    reference code.

    Args:
        l2: L2 regularisation factor put on every weight (kernels, biases,
            BatchNorm scale and offset); `0` for none.
    """
    regularizer = keras.regularizers.L2(l2) if l2 else None

    def conv_block(filters, padding):
        return [
            keras.layers.Conv2D(
                filters,
                3,
                padding=padding,
                kernel_initializer=pytorch_default_initializer(),
                kernel_regularizer=regularizer,
                bias_regularizer=regularizer,
            ),
            keras.layers.BatchNormalization(
                momentum=0.9,
                epsilon=1e-5,
                gamma_regularizer=regularizer,
                beta_regularizer=regularizer,
            ),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(2),
        ]

    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            *conv_block(64, "same"),
            *conv_block(128, "same"),
            *conv_block(128, "valid"),
            keras.layers.Flatten(),
            keras.layers.Dense(
                256,
                activation="relu",
                kernel_initializer=pytorch_default_initializer(),
                kernel_regularizer=regularizer,
                bias_regularizer=regularizer,
            ),
        ],
        name="backbone",
    )


def learning_rate_schedule(steps_per_epoch: int, epochs: int):
    """0.05, divided by 5 after every 10 epochs (epochs 10 and 20 of 30)."""
    decay_epochs = range(LR_DECAY_EVERY_EPOCHS, epochs, LR_DECAY_EVERY_EPOCHS)
    # The schedule keeps a value while `step <= boundary`, and the first step
    # of epoch e (0-based) is e * steps_per_epoch: hence the -1.
    boundaries = [e * steps_per_epoch - 1 for e in decay_epochs]
    if not boundaries:
        return LEARNING_RATE
    return keras.optimizers.schedules.PiecewiseConstantDecay(
        boundaries,
        [LEARNING_RATE / LR_DECAY_FACTOR**i for i in range(len(boundaries) + 1)],
    )


def make_optimizer(steps_per_epoch: int, epochs: int) -> keras.optimizers.SGD:
    """SGD with momentum 0.9 and the paper's step schedule."""
    return keras.optimizers.SGD(
        learning_rate_schedule(steps_per_epoch, epochs), momentum=SGD_MOMENTUM
    )


def build_duq_model(args, steps_per_epoch: int) -> keras_duq.DUQModel:
    """DUQ on the paper's backbone, compiled. Weight decay is built in."""
    backbone = build_backbone()
    if args.spectral_normalization:
        backbone = keras_duq.spectral_normalize(
            backbone, coefficient=args.spectral_normalization
        )
    model = keras_duq.wrap(
        backbone,
        NUM_CLASSES,
        centroid_dims=256,
        length_scale=args.length_scale,
        momentum=args.centroid_momentum,
        kernel_initializer=(
            # The reference code draws W from N(0, 0.05^2).
            keras.initializers.RandomNormal(stddev=0.05)
            if args.kernel_initializer == "reference"
            else args.kernel_initializer
        ),
        gradient_penalty=args.gradient_penalty,
        penalty_interval=args.penalty_interval,
        weight_decay=WEIGHT_DECAY,
        bce_epsilon=args.bce_epsilon,
        bias_correction=args.bias_correction,
    )
    model.compile(
        optimizer=make_optimizer(steps_per_epoch, args.epochs),
        jit_compile=jit_compile_argument(args),
    )
    return model


def build_softmax_model(args, steps_per_epoch: int) -> keras.Model:
    """The same backbone with a 10-way softmax layer, compiled.

    Weight decay: DUQ's coupled decay adds `1e-4 * w` to each gradient;
    `L2(5e-5)` adds `5e-5 * ||w||^2` to the loss, whose gradient is the same
    `1e-4 * w`. It is put on every weight, as PyTorch's SGD decay is.
    """
    l2 = WEIGHT_DECAY / 2
    regularizer = keras.regularizers.L2(l2)
    model = keras.Sequential(
        [
            build_backbone(l2),
            keras.layers.Dense(
                NUM_CLASSES,
                activation="softmax",
                kernel_initializer=pytorch_default_initializer(),
                kernel_regularizer=regularizer,
                bias_regularizer=regularizer,
            ),
        ],
        name="softmax",
    )
    model.compile(
        optimizer=make_optimizer(steps_per_epoch, args.epochs),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=jit_compile_argument(args),
    )
    return model


def build_model(args, steps_per_epoch: int, seed: int) -> keras.Model:
    """The `--model` of `seed`, built from a fresh Keras state.

    Keras's layer-name counters and other global state survive
    `set_random_seed`. Starting fresh makes ensemble member `i` the same
    model, names included, that `--model softmax --seed seed + i` builds in
    a new process, so members can be trained in separate processes.
    """
    keras.backend.clear_session()
    # After `clear_session`, which resets the dtype policy.
    set_dtype_policy(args.mixed_precision)
    keras.utils.set_random_seed(seed)
    if args.model == "duq":
        return build_duq_model(args, steps_per_epoch)
    return build_softmax_model(args, steps_per_epoch)


def set_dtype_policy(mixed_precision: str):
    keras.mixed_precision.set_global_policy(
        "float32" if mixed_precision == "none" else mixed_precision
    )


def jit_compile_argument(args):
    """`--jit-compile` as `Model.compile` takes it."""
    return {"auto": "auto", "true": True, "false": False}[args.jit_compile]


# ------------------------------------------------------------------ data


def load_data(args):
    """Normalised train, validation (or `None`), test and OoD arrays."""
    (x_train, y_train), (x_test, y_test) = keras_duq.datasets.load_fashion_mnist(
        args.fashion_mnist_path
    )
    x_ood, _ = keras_duq.datasets.load_mnist_test(args.mnist_path)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(x_train))
    validation = None
    if args.validation_split:
        held_out, order = order[: args.validation_split], order[args.validation_split :]
        validation = (
            keras_duq.datasets.normalize(x_train[held_out]),
            y_train[held_out],
        )
    if args.train_subset:
        order = order[: args.train_subset]
    if args.test_subset:
        x_test, y_test = x_test[: args.test_subset], y_test[: args.test_subset]
        x_ood = x_ood[: args.test_subset]
    # Both sets use FashionMNIST's training statistics (paper, Section 4.2).
    return (
        (keras_duq.datasets.normalize(x_train[order]), y_train[order].astype("int32")),
        validation,
        (keras_duq.datasets.normalize(x_test), y_test.astype("int32")),
        keras_duq.datasets.normalize(x_ood),
    )


# -------------------------------------------------------------- training


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
    (reproduction/cifar10.py trains with this function too.)
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


def training_callbacks(args, test, x_ood, method, log_dir):
    callbacks = []
    if args.ood_eval_every:
        callbacks.append(
            keras_duq.callbacks.OODEvaluation(
                in_distribution=keras_duq.datasets.make_dataset(*test, batch_size=512),
                out_of_distribution=keras_duq.datasets.make_dataset(
                    x_ood, batch_size=512
                ),
                every_n_epochs=args.ood_eval_every,
                method=method,
            )
        )
    if args.tensorboard:
        # After OODEvaluation, so that it sees the ood_* values.
        callbacks.append(keras.callbacks.TensorBoard(log_dir))
    return callbacks


def predict(models, x):
    """Scores of one model, or the averaged probabilities of an ensemble."""
    return np.mean([m.predict(x, batch_size=512, verbose=0) for m in models], axis=0)


def evaluate(models, method, test, x_ood, validation=None) -> dict:
    """Accuracy, OoD metrics and rejection curve; certainties for the plots."""
    x_test, y_test = test
    test_scores = predict(models, x_test)
    ood_scores = predict(models, x_ood)
    in_certainty = keras_duq.evaluation.certainty_scores(test_scores, method)
    ood_certainty = keras_duq.evaluation.certainty_scores(ood_scores, method)
    correct = test_scores.argmax(axis=1) == y_test
    results = {"accuracy": float(correct.mean())}
    results.update(keras_duq.evaluation.ood_metrics(in_certainty, ood_certainty))
    if method != "max":
        # Also the maximum softmax probability, the other usual certainty.
        results["auroc_max_probability"] = keras_duq.evaluation.ood_metrics(
            keras_duq.evaluation.certainty_scores(test_scores),
            keras_duq.evaluation.certainty_scores(ood_scores),
        )["auroc"]
    results["misclassification_auroc"] = keras_duq.evaluation.misclassification_auroc(
        in_certainty, correct
    )
    if validation is not None:
        x_val, y_val = validation
        val_scores = predict(models, x_val)
        val_correct = val_scores.argmax(axis=1) == y_val
        results["validation_accuracy"] = float(val_correct.mean())
        results["validation_misclassification_auroc"] = (
            keras_duq.evaluation.misclassification_auroc(
                keras_duq.evaluation.certainty_scores(val_scores, method), val_correct
            )
        )
    curve = keras_duq.evaluation.rejection_curve(in_certainty, correct, ood_certainty)
    return results, in_certainty, ood_certainty, curve


def save_figures(
    output_dir,
    label,
    in_certainty,
    ood_certainty,
    curve,
    method,
    in_name="FashionMNIST",
    ood_name="MNIST",
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


def main(argv=None) -> dict:
    """Runs the experiment; returns the dict written to `results.json`."""
    args = parse_args(argv)
    previous_policy = keras.mixed_precision.global_policy()
    try:
        return _run(args)
    finally:
        # Leave the process as it was (tests call `main` in-process).
        keras.mixed_precision.set_global_policy(previous_policy)


def _run(args) -> dict:
    start = time.perf_counter()
    os.makedirs(args.output_dir, exist_ok=True)
    keras.utils.set_random_seed(args.seed)
    train_data, validation, test, x_ood = load_data(args)

    steps_per_epoch = math.ceil(len(train_data[0]) / args.batch_size)

    def make_dataset(seed):
        return keras_duq.datasets.make_dataset(
            *train_data,
            batch_size=args.batch_size,
            shuffle=True,
            seed=seed,
            repeat=True,
        )

    if args.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, args.max_steps_per_epoch)
    # DUQ's certainty is the largest kernel value; the softmax baselines use
    # the negative entropy of the (averaged) prediction, as the paper does.
    method = "max" if args.model == "duq" else "negative_entropy"
    num_models = args.ensemble_size if args.model == "ensemble" else 1
    log_dir = os.path.join(args.output_dir, "logs")

    models, histories = [], []
    train_time = 0.0
    for index in range(num_models):
        # Ensemble members differ by their initialisation and data order.
        seed = args.seed + index
        model = build_model(args, steps_per_epoch, seed)
        callbacks = training_callbacks(
            args,
            test,
            x_ood,
            method,
            log_dir if num_models == 1 else os.path.join(log_dir, f"member_{index}"),
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

    results, in_certainty, ood_certainty, curve = evaluate(
        models, method, test, x_ood, validation
    )
    label = {"duq": "DUQ", "softmax": "softmax", "ensemble": "deep ensemble"}[
        args.model
    ]
    figures = save_figures(
        args.output_dir, label, in_certainty, ood_certainty, curve, method
    )
    results.update(
        {
            "model": args.model,
            "certainty_method": method,
            "seed": args.seed,
            "epochs": args.epochs,
            "steps_per_epoch": steps_per_epoch,
            "num_train": len(train_data[0]),
            "num_test": len(test[0]),
            "num_ood": len(x_ood),
            # With --backup-dir: the sum over all (resumed) runs' epochs.
            "train_time_s": train_time,
            "wall_time_s": time.perf_counter() - start,
            "settings": vars(args),
            "versions": {
                "backend": keras.backend.backend(),
                "keras": keras.__version__,
                "keras_duq": keras_duq.__version__,
            },
            "history": histories[0] if num_models == 1 else histories,
            "rejection_curve": {k: [float(v) for v in vs] for k, vs in curve.items()},
            "figures": figures,
        }
    )
    with open(os.path.join(args.output_dir, "results.json"), "w") as file:
        # NaN (the rejection curve's last point) is not valid JSON: write null.
        json.dump(nan_to_none(results), file, indent=2)
    print(
        f"{label}: accuracy {results['accuracy']:.4f}, AUROC vs MNIST "
        f"{results['auroc']:.4f}, AUPR {results['aupr']:.4f}, FPR@95%TPR "
        f"{results['fpr_at_95_tpr']:.4f}, misclassification AUROC "
        f"{results['misclassification_auroc']:.4f}, "
        f"{results['wall_time_s']:.0f} s -> {args.output_dir}"
    )
    return results


def nan_to_none(value):
    """`value` with every NaN float, at any depth, replaced by `None` (for JSON)."""
    if isinstance(value, dict):
        return {k: nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_to_none(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


if __name__ == "__main__":
    main(sys.argv[1:])

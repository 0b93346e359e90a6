"""DUQ on backbones a user writes: accuracy and AUROC vs MNIST per epoch.

Trains one model on FashionMNIST (images scaled to [0, 1], as a user would
from `keras.datasets`) and, after each epoch, measures test accuracy and the
AUROC of the certainty against the MNIST test set. One run per call; the
results are appended as one JSON line to `--output`.

Heads:
- `duq`: `keras_duq.wrap(backbone, 10, **wrap_kwargs)`; `--wrap-json '{}'`
  gives the library's defaults; `--wrap-json` with the 0.2.0 values
  (`{"length_scale": 0.1, "momentum": 0.999, ...}`) gives the old ones.
- `softmax`: a `Dense(10, "softmax")` head on the same backbone; certainty is
  the maximum softmax probability.

Example:

```bash
KERAS_HOME=../shared/data/keras python -m research.benchmarks.own_model_defaults \
    --backbone quickstart --head duq --epochs 3 --seed 0 \
    --mnist-path ../shared/data/mnist --output own_model.jsonl
# a Markdown table of such a file: mean accuracy, AUROC per seed and mean
python -m research.benchmarks.own_model_defaults --summarize own_model.jsonl --at-epochs 1 3 10
```
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import keras
import numpy as np

import keras_duq
from keras_duq import datasets
from keras_duq import evaluation
from research.reproduction._harness import set_initial_centroids

OLD_DEFAULTS = {
    "length_scale": 0.1,
    "momentum": 0.999,
    "gradient_penalty": 0.1,
    "kernel_initializer": "he_normal",
    "bias_correction": False,
    "categorical_cross_entropy_weight": 0.0,
}


def quickstart_backbone():
    """The README quickstart's backbone of keras_duq 0.2.0."""
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(128, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
        ]
    )


def paper_backbone():
    """The paper's FashionMNIST CNN (with Keras's default initialisers)."""
    layers = [keras.Input((28, 28, 1))]
    for filters, padding in ((64, "same"), (128, "same"), (128, "valid")):
        layers += [
            keras.layers.Conv2D(filters, 3, padding=padding),
            keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(2),
        ]
    layers += [keras.layers.Flatten(), keras.layers.Dense(256, activation="relu")]
    return keras.Sequential(layers)


def _batch_norm_relu(layer):
    """`layer`, BatchNormalization, ReLU (the normalisation's offset stands in
    for `layer`'s bias, so build `layer` with `use_bias=False`)."""
    return [layer, keras.layers.BatchNormalization(), keras.layers.ReLU()]


def batchnorm_backbone():
    """A small residual-free CNN with BatchNormalization, pooled features."""

    def block(filters):
        conv = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)
        return _batch_norm_relu(conv)

    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            *block(32),
            *block(32),
            keras.layers.MaxPooling2D(),
            *block(64),
            *block(64),
            keras.layers.MaxPooling2D(),
            *block(128),
            keras.layers.GlobalAveragePooling2D(),
        ]
    )


def batchnorm_small_backbone():
    """Conv-BatchNormalization-ReLU blocks and a dense layer, a cheaper BN CNN."""
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            *_batch_norm_relu(
                keras.layers.Conv2D(32, 3, padding="same", use_bias=False)
            ),
            keras.layers.MaxPooling2D(),
            *_batch_norm_relu(
                keras.layers.Conv2D(64, 3, padding="same", use_bias=False)
            ),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            *_batch_norm_relu(keras.layers.Dense(128, use_bias=False)),
        ]
    )


def _dense_relu(*units):
    """Flattened pixels, then a Dense-ReLU layer of each width."""
    layers = [keras.Input((28, 28, 1)), keras.layers.Flatten()]
    layers += [keras.layers.Dense(width, activation="relu") for width in units]
    return keras.Sequential(layers)


def mlp_backbone():
    """A plain MLP on flattened pixels."""
    return _dense_relu(256, 128)


def _keras_io_layers():
    """keras.io's "Simple MNIST convnet" up to its flattened feature maps."""
    return [
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
    ]


def dropout_backbone():
    """Conv, max pooling, dropout and a dense layer: a keras.io-style CNN."""
    return keras.Sequential(
        [
            *_keras_io_layers(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(128, activation="relu"),
        ]
    )


def keras_io_backbone():
    """keras.io's "Simple MNIST convnet" without its classifier: features
    are the flattened, dropped-out feature maps (1,600 of them)."""
    return keras.Sequential([*_keras_io_layers(), keras.layers.Dropout(0.5)])


def keras_io_no_dropout_backbone():
    """`keras_io` without its last layer (the Dropout)."""
    return keras.Sequential(_keras_io_layers())


def _mlp_dropout_layers():
    """keras.io's MNIST MLP up to its second dense layer."""
    return [
        keras.Input((28, 28, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(512, activation="relu"),
    ]


def mlp_dropout_backbone():
    """keras.io's MNIST MLP without its classifier: two dense layers of 512
    units, each followed by dropout 0.2."""
    return keras.Sequential([*_mlp_dropout_layers(), keras.layers.Dropout(0.2)])


def mlp_no_last_dropout_backbone():
    """`mlp_dropout` without its last layer: its one dropout feeds a Dense."""
    return keras.Sequential(_mlp_dropout_layers())


def lenet_backbone():
    """LeNet-5 as a Keras user writes it today: ReLU and max pooling,
    features from its 84-unit dense layer."""
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(6, 5, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(16, 5, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(120, activation="relu"),
            keras.layers.Dense(84, activation="relu"),
        ]
    )


def vgg_small_backbone():
    """Two VGG-style blocks (two 3x3 convolutions, then max pooling) and a
    dense layer of 128 units."""
    layers = [keras.Input((28, 28, 1))]
    for filters in (32, 64):
        layers += [
            keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
        ]
    layers += [keras.layers.Flatten(), keras.layers.Dense(128, activation="relu")]
    return keras.Sequential(layers)


def mlp_batchnorm_backbone():
    """Dense-BatchNormalization-ReLU twice (256 and 128 units)."""
    layers = [keras.Input((28, 28, 1)), keras.layers.Flatten()]
    for units in (256, 128):
        layers += _batch_norm_relu(keras.layers.Dense(units, use_bias=False))
    return keras.Sequential(layers)


def resnet_small_backbone():
    """A small residual network: a stem and two residual blocks (the second
    halves the resolution through a strided 1x1 shortcut), pooled features."""

    def conv_batch_norm(x, filters, strides=1):
        conv = keras.layers.Conv2D(
            filters, 3, strides=strides, padding="same", use_bias=False
        )
        return keras.layers.BatchNormalization()(conv(x))

    def residual_block(x, filters, strides=1):
        shortcut = x
        if strides != 1 or x.shape[-1] != filters:
            shortcut = keras.layers.Conv2D(filters, 1, strides=strides)(x)
        y = keras.layers.ReLU()(conv_batch_norm(x, filters, strides))
        y = conv_batch_norm(y, filters)
        return keras.layers.ReLU()(keras.layers.Add()([shortcut, y]))

    inputs = keras.Input((28, 28, 1))
    x = keras.layers.ReLU()(conv_batch_norm(inputs, 32))
    x = keras.layers.MaxPooling2D()(x)
    x = residual_block(x, 32)
    x = residual_block(x, 64, strides=2)
    outputs = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, outputs)


def separable_backbone():
    """Depthwise-separable convolutions with BatchNormalization (MobileNet's
    building block), pooled features."""
    layers = [
        keras.Input((28, 28, 1)),
        *_batch_norm_relu(keras.layers.Conv2D(32, 3, padding="same", use_bias=False)),
    ]
    for filters in (64, 128):
        layers += [
            keras.layers.MaxPooling2D(),
            *_batch_norm_relu(
                keras.layers.SeparableConv2D(filters, 3, padding="same", use_bias=False)
            ),
        ]
    layers.append(keras.layers.GlobalAveragePooling2D())
    return keras.Sequential(layers)


def mlp_layernorm_backbone():
    """Dense-LayerNormalization-ReLU twice (256 and 128 units)."""
    layers = [keras.Input((28, 28, 1)), keras.layers.Flatten()]
    for units in (256, 128):
        layers += [
            keras.layers.Dense(units),
            keras.layers.LayerNormalization(),
            keras.layers.ReLU(),
        ]
    return keras.Sequential(layers)


class _PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per token position."""

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=tuple(input_shape[1:]), initializer="random_normal", name="positions"
        )

    def call(self, tokens):
        return tokens + self.positions


def attention_small_backbone():
    """A small vision transformer: 4x4 patches as 49 tokens of 64 numbers,
    two pre-normalised self-attention blocks, tokens averaged."""
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(64, 4, strides=4)(inputs)
    x = _PositionEmbedding()(keras.layers.Reshape((49, 64))(x))
    for _ in range(2):
        y = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.MultiHeadAttention(num_heads=4, key_dim=16)(y, y)
        y = keras.layers.LayerNormalization()(x)
        y = keras.layers.Dense(128, activation="gelu")(y)
        x = x + keras.layers.Dense(64)(y)
    x = keras.layers.LayerNormalization()(x)
    return keras.Model(inputs, keras.layers.GlobalAveragePooling1D()(x))


def mlp_wide_backbone():
    """Two wide Dense-ReLU layers (1,024 and 512 units): 512 features."""
    return _dense_relu(1024, 512)


BACKBONES = {
    "quickstart": quickstart_backbone,
    "paper": paper_backbone,
    "batchnorm": batchnorm_backbone,
    "batchnorm_small": batchnorm_small_backbone,
    "mlp": mlp_backbone,
    "dropout": dropout_backbone,
    "keras_io": keras_io_backbone,
    "keras_io_no_dropout": keras_io_no_dropout_backbone,
    "mlp_dropout": mlp_dropout_backbone,
    "mlp_no_last_dropout": mlp_no_last_dropout_backbone,
    "lenet": lenet_backbone,
    "vgg_small": vgg_small_backbone,
    "mlp_batchnorm": mlp_batchnorm_backbone,
    "resnet_small": resnet_small_backbone,
    "separable": separable_backbone,
    "mlp_layernorm": mlp_layernorm_backbone,
    "attention_small": attention_small_backbone,
    "mlp_wide": mlp_wide_backbone,
}


def append_feature_layer(backbone, kind):
    """The backbone with one more layer on its features, or unchanged."""
    if kind == "none":
        return backbone
    width = backbone.compute_output_shape((None, 28, 28, 1))[-1]
    layer = {
        "batch_norm": lambda: keras.layers.BatchNormalization(),
        "layer_norm": lambda: keras.layers.LayerNormalization(),
        "linear": lambda: keras.layers.Dense(width),
    }[kind]()
    return keras.Sequential([backbone, layer])


def make_optimizer(name, projection_learning_rate=1.0, clipnorm=None):
    """The optimizer; `projection_learning_rate` scales its rate for DUQ's `W`.

    `clipnorm`: Keras's per-gradient norm clipping (`None`: none).

    Keras optimizers have no per-variable rate, so this one scales the rate
    in `update_step` for the variable named `duq_output/kernel` (TensorFlow
    backend: the step sees the backend's variables, matched by name). The
    same update as `wrap(..., projection_learning_rate=...)`, which scales
    `W` inside the layer instead, up to float rounding.
    """
    if name == "adam":
        base = keras.optimizers.Adam
        kwargs = {}
    elif name == "sgd":
        base = keras.optimizers.SGD
        kwargs = {"learning_rate": 0.05, "momentum": 0.9}
    else:
        raise ValueError(f"Unknown optimizer. Received: {name!r}")
    if clipnorm is not None:
        kwargs["clipnorm"] = clipnorm
    if projection_learning_rate == 1.0:
        return base(**kwargs)
    if keras.backend.backend() != "tensorflow":
        raise ValueError("--projection-learning-rate needs the TensorFlow backend.")

    class SlowProjection(base):
        def update_step(self, gradient, variable, learning_rate):
            if variable.name.startswith("duq_output/kernel"):
                learning_rate = learning_rate * projection_learning_rate
            return super().update_step(gradient, variable, learning_rate)

    return SlowProjection(**kwargs)


def load(mnist_path, train_subset, standardize=False):
    """FashionMNIST and the MNIST test set, in [0, 1] or standardised.

    Standardised images use FashionMNIST's training mean and standard
    deviation for both sets, as the paper does.
    """
    (x_train, y_train), (x_test, y_test) = datasets.load_fashion_mnist()
    x_ood, _ = datasets.load_mnist_test(mnist_path)
    if standardize:
        scale = datasets.normalize
    else:
        scale = lambda x: (x[..., None] / 255.0).astype("float32")  # noqa: E731
    if train_subset:
        x_train, y_train = x_train[:train_subset], y_train[:train_subset]
    return scale(x_train), y_train, scale(x_test), y_test, scale(x_ood)


def json_logs(logs):
    """Keras's epoch logs (loss, DUQ's health metrics) as JSON values: floats,
    and `None` for a value that is not finite (strict JSON has no NaN)."""
    return {
        key: float(value) if np.isfinite(value) else None for key, value in logs.items()
    }


class EpochMetrics(keras.callbacks.Callback):
    """After each epoch: test accuracy, AUROC vs the OoD set, and more.

    With `recompute_on` (training inputs), each epoch is measured a second
    time after `keras_duq.recompute_batch_norm_statistics(model,
    recompute_on)` (keys ending in `_recomputed`); the moving statistics are
    then put back, so that training continues as without it.
    """

    def __init__(self, x_test, y_test, x_ood, head, recompute_on=None):
        super().__init__()
        self.data = (x_test, y_test, x_ood)
        self.head = head
        self.recompute_on = recompute_on
        self.rows = []

    def measure(self):
        x_test, y_test, x_ood = self.data
        scores = self.model.predict(x_test, batch_size=500, verbose=0)
        ood_scores = self.model.predict(x_ood, batch_size=500, verbose=0)
        certainty, ood_certainty = scores.max(1), ood_scores.max(1)
        return {
            "accuracy": float(np.mean(scores.argmax(1) == y_test)),
            "auroc": evaluation.ood_metrics(certainty, ood_certainty)["auroc"],
            "median_certainty": float(np.median(certainty)),
        }

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        row = {"epoch": epoch + 1, **self.measure()}
        row["train_accuracy"] = float(logs.get("accuracy", np.nan))
        if "batch_norm_gap" in logs:
            row["batch_norm_gap"] = float(logs["batch_norm_gap"])
        row["logs"] = json_logs(logs)
        head = getattr(self.model, "duq_output", None)
        if head is not None and head.trainable_length_scale:
            scales = keras.ops.convert_to_numpy(head.length_scales)
            row["length_scales"] = [round(float(s), 5) for s in scales]
        if self.recompute_on is not None:
            variables = self.model.non_trainable_variables
            saved = [keras.ops.convert_to_numpy(v) for v in variables]
            keras_duq.recompute_batch_norm_statistics(self.model, self.recompute_on)
            for key, value in self.measure().items():
                row[f"{key}_recomputed"] = value
            for variable, value in zip(variables, saved):
                variable.assign(value)
        row["time_s"] = time.time() - self.start
        self.rows.append(row)
        print(json.dumps(row), flush=True)

    def on_train_begin(self, logs=None):
        self.start = time.time()


def summarize(path, at_epochs=(1, 3, 10)):
    """A Markdown table of the runs in a JSON-lines file, grouped by setup.

    One row per (backbone, head, settings); for each epoch in `at_epochs`:
    the mean test accuracy over seeds, the AUROC of each seed and its mean.
    """
    groups = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            settings = dict(record["wrap_kwargs"])
            if record["head"] == "duq":
                # The rate at which W learned: the layer's times the
                # optimizer-level scaling. Records that do not name the
                # layer's rate were made when `wrap`'s default was 1.0.
                head_rate = record.get(
                    "head_projection_learning_rate",
                    settings.get("projection_learning_rate", 1.0),
                )
                settings["projection_learning_rate"] = head_rate * record.get(
                    "projection_learning_rate", 1.0
                )
                # Records that do not name it were made when the default was 0.
                settings["categorical_cross_entropy_weight"] = record.get(
                    "categorical_cross_entropy_weight",
                    settings.get("categorical_cross_entropy_weight", 0.0),
                )
            if record.get("clipnorm") is not None:
                settings["clipnorm"] = record["clipnorm"]
            settings = json.dumps(settings, sort_keys=True)
            head = ", ".join([record["head"], *_setup(record)])
            key = (record["backbone"], head, settings)
            groups.setdefault(key, []).append(record)
            if record.get("recompute_batch_norm"):
                # The same run measured after re-estimating BatchNormalization
                # statistics: a row of its own.
                recomputed = dict(record, epochs=_recomputed(record["epochs"]))
                key = (record["backbone"], head + ", BN re-estimated", settings)
                groups.setdefault(key, []).append(recomputed)
    header = "| backbone | head | settings | seeds |"
    for epoch in at_epochs:
        header += f" epoch {epoch}: accuracy | AUROC per seed | AUROC mean |"
    lines = [header, "|" + "---|" * (4 + 3 * len(at_epochs))]
    for (backbone, head, settings), records in sorted(groups.items()):
        records.sort(key=lambda record: record["seed"])
        seeds = ", ".join(str(record["seed"]) for record in records)
        settings = settings if head.startswith("duq") else ""
        row = f"| {backbone} | {head} | {settings} | {seeds} |"
        for epoch in at_epochs:
            rows = [
                metrics
                for record in records
                for metrics in record["epochs"]
                if metrics["epoch"] == epoch
            ]
            row += epoch_cells(rows)
        lines.append(row)
    return "\n".join(lines)


def _setup(record):
    """What a run changed beyond the head's settings, as words for its row."""
    words = []
    if record.get("optimizer", "adam") != "adam":
        words.append(record["optimizer"].upper())
    if record.get("feature_layer") not in (None, "none"):
        words.append(f"+ {record['feature_layer']} on the features")
    if record.get("recompute_callback"):
        words.append("RecomputeBatchNormStatistics")
    if record.get("initial_centroid_stddev") is not None:
        words.append(
            f"centroids start at normal(0, {record['initial_centroid_stddev']:g})"
        )
    return words


def _recomputed(rows):
    """Per-epoch rows with the values measured after re-estimating statistics."""
    suffix = "_recomputed"
    return [
        {"epoch": row["epoch"]}
        | {
            key[: -len(suffix)]: value
            for key, value in row.items()
            if key.endswith(suffix)
        }
        for row in rows
    ]


def epoch_cells(rows):
    """Three table cells for one epoch of several seeds' runs: the mean
    accuracy, each seed's AUROC and their mean (empty without runs)."""
    if not rows:
        return " | | |"
    aurocs = [row["auroc"] for row in rows]
    return (
        f" {np.mean([row['accuracy'] for row in rows]):.3f} |"
        f" {', '.join(f'{auroc:.3f}' for auroc in aurocs)} | {np.mean(aurocs):.3f} |"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--summarize",
        metavar="JSONL",
        help="Print a Markdown table of the runs in this file and exit.",
    )
    parser.add_argument("--at-epochs", type=int, nargs="+", default=[1, 3, 10])
    parser.add_argument("--backbone", choices=sorted(BACKBONES))
    parser.add_argument("--head", choices=("duq", "softmax"), default="duq")
    parser.add_argument("--wrap-json", default="{}")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument(
        "--projection-learning-rate",
        type=float,
        default=1.0,
        help="Multiplies the optimizer's rate for DUQ's projection W (TensorFlow), "
        "on top of the layer's `projection_learning_rate`.",
    )
    parser.add_argument(
        "--clipnorm",
        type=float,
        default=None,
        help="Clip each gradient to this norm (the optimizer's `clipnorm`).",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-subset", type=int, default=None)
    parser.add_argument("--mnist-path", default=None)
    parser.add_argument(
        "--feature-layer",
        choices=("none", "batch_norm", "layer_norm", "linear"),
        default="none",
        help="A layer appended to the backbone's features.",
    )
    parser.add_argument(
        "--standardize",
        action="store_true",
        help="Standardise images with FashionMNIST's mean and std (else [0, 1]).",
    )
    parser.add_argument(
        "--input-normalization",
        action="store_true",
        help="Put a keras.layers.Normalization, adapted on x_train, first.",
    )
    parser.add_argument(
        "--recompute-batch-norm",
        action="store_true",
        help="Also measure each epoch after re-estimating BatchNormalization "
        "statistics on 10,000 training images (then put back).",
    )
    parser.add_argument(
        "--recompute-callback",
        action="store_true",
        help="Train with keras_duq.callbacks.RecomputeBatchNormStatistics on "
        "10,000 training images (statistics re-estimated after every epoch).",
    )
    parser.add_argument(
        "--initial-centroid-stddev",
        type=float,
        default=None,
        help="DUQ head: draw the initial centroids from normal(0, STDDEV) "
        "instead of keras_duq's normal(0, 1).",
    )
    parser.add_argument("--label", default="")
    parser.add_argument("--output", default="own_model_defaults.jsonl")
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize, args.at_epochs))
        return None
    if args.backbone is None:
        parser.error("--backbone is required (or --summarize to read results)")
    stddev = args.initial_centroid_stddev
    if stddev is not None and (args.head != "duq" or not stddev > 0):
        parser.error(
            "--initial-centroid-stddev takes a number > 0 and applies to "
            f"--head duq only. Received: {stddev} with --head {args.head}"
        )

    x_train, y_train, x_test, y_test, x_ood = load(
        args.mnist_path, args.train_subset, args.standardize
    )
    keras.utils.set_random_seed(args.seed)
    backbone = BACKBONES[args.backbone]()
    backbone = append_feature_layer(backbone, args.feature_layer)
    if args.input_normalization:
        # Standardisation inside the model, adapted on the training images.
        normalization = keras.layers.Normalization()
        normalization.adapt(x_train[:10000])
        backbone = keras.Sequential([keras.Input((28, 28, 1)), normalization, backbone])
    wrap_kwargs = json.loads(args.wrap_json)
    if args.head == "duq":
        model = keras_duq.wrap(backbone, 10, **wrap_kwargs)
        if stddev is not None:
            set_initial_centroids(model.duq_output, stddev, args.seed)
        model.compile(
            optimizer=make_optimizer(
                args.optimizer, args.projection_learning_rate, args.clipnorm
            )
        )
    else:
        model = keras.Sequential(
            [backbone, keras.layers.Dense(10, activation="softmax")]
        )
        model.compile(
            optimizer=make_optimizer(args.optimizer, clipnorm=args.clipnorm),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    metrics = EpochMetrics(
        x_test,
        y_test,
        x_ood,
        args.head,
        recompute_on=x_train[:10000] if args.recompute_batch_norm else None,
    )
    callbacks = [metrics]
    if args.recompute_callback:
        callbacks.insert(
            0, keras_duq.callbacks.RecomputeBatchNormStatistics(x_train[:10000])
        )
    model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=callbacks,
        verbose=0,
    )
    record = {
        "label": args.label,
        "backbone": args.backbone,
        "head": args.head,
        "wrap_kwargs": wrap_kwargs,
        "feature_layer": args.feature_layer,
        "standardize": args.standardize,
        "input_normalization": args.input_normalization,
        "recompute_batch_norm": args.recompute_batch_norm,
        "recompute_callback": args.recompute_callback,
        "initial_centroid_stddev": args.initial_centroid_stddev,
        "optimizer": args.optimizer,
        "clipnorm": args.clipnorm,
        "projection_learning_rate": args.projection_learning_rate,
        "head_projection_learning_rate": (
            model.duq_output.projection_learning_rate if args.head == "duq" else None
        ),
        "categorical_cross_entropy_weight": (
            model.categorical_cross_entropy_weight if args.head == "duq" else None
        ),
        # Records without it were made when the weight was divided by the
        # number of classes (10 here): weight 10 then is weight 1 now.
        "categorical_cross_entropy_per_example": True,
        "seed": args.seed,
        "train_subset": args.train_subset,
        "batch_size": args.batch_size,
        "keras_duq": keras_duq.__version__,
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "cpu": platform.processor() or platform.machine(),
        "epochs": metrics.rows,
    }
    with open(args.output, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
